"""Evaluate a fine-tuned model on a recipe's held-out rows: greedy generations, a task score, held-out loss.

    .venv/bin/python -m trainer.evaluate --model outputs/emoji-local/merged --recipe emoji-local --max-samples 20
    .venv/bin/python -m trainer.evaluate --model outputs/emoji-local/adapter --recipe emoji-local   # adapter folder works too
    python -m trainer.evaluate --model /mnt/run/adapter --recipe text-to-sql-gemma4-31b   # a GPU machine: bf16, device_map=auto

Scores: emoji F1 over SETS of emoji (order and repetition ignored), SQL execution match, ROUGE-L F1 over words for
descriptions and the user's own formats, exact match, and for every task the held-out loss of the answer tokens.
Decisions (the definitions and the sources: docs/trainer.md#held-out-evaluation):
- A GPU loads the recipe's dtype with `device_map="auto"`, a CPU float32; an adapter loads its base, then itself
  (a QLoRA adapter is scored on the unquantised base it is merged into and served with).
- Greedy generation in left-padded batches (the same outputs as one at a time); the held-out loss is one forward
  per batch through trl's fused head on the answers' positions only, with no logits tensor.
- The rows are exactly the recipe's eval split, never a training row. Results go to `--out` (default
  `<model>/eval_results.json`). The training run scores its base and itself with these (trainer/run_eval.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
import unicodedata
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from trainer.formatting import prompt_messages, reference_text
from trainer.recipe import Recipe, RecipeError, Task, load_recipe

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

_ZWJ = "\u200d"
_MODIFIERS = {"\ufe0f", "\ufe0e", "\u20e3"} | {chr(c) for c in range(0x1F3FB, 0x1F400)}  # selectors, keycap, skin tones


def _is_emoji_char(char: str) -> bool:
    code = ord(char)
    return (
        0x1F000 <= code <= 0x1FAFF
        or 0x2600 <= code <= 0x27BF
        or 0x2B00 <= code <= 0x2BFF
        or 0x1F1E6 <= code <= 0x1F1FF
        or (code >= 0x2190 and unicodedata.category(char) == "So")
    )


def extract_emoji(text: str) -> list[str]:
    """The emoji in `text` in order, each ZWJ sequence / flag / modified emoji as one item."""
    items: list[str] = []
    joining = False
    for char in text:
        if char == _ZWJ and items:
            items[-1] += char
            joining = True
        elif char in _MODIFIERS and items:
            items[-1] += char
        elif _is_emoji_char(char):
            is_second_flag_letter = (
                0x1F1E6 <= ord(char) <= 0x1F1FF
                and items
                and len(items[-1]) == 1
                and 0x1F1E6 <= ord(items[-1]) <= 0x1F1FF
            )
            if joining or is_second_flag_letter:
                items[-1] += char
            else:
                items.append(char)
            joining = False
        else:
            joining = False
    return [item.replace("\ufe0f", "") for item in items]  # 🌧️ and 🌧 are the same emoji


def emoji_f1(prediction: str, reference: str) -> float:
    """F1 over the sets of emoji in prediction and reference (docs/trainer.md#held-out-evaluation)."""
    predicted, expected = set(extract_emoji(prediction)), set(extract_emoji(reference))
    if not predicted and not expected:
        return 1.0
    overlap = len(predicted & expected)
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(predicted), overlap / len(expected)
    return 2 * precision * recall / (precision + recall)


def load_for_eval(
    model_dir: str | Path, recipe: Recipe, device: str | None = None, processing_class: Any = None
) -> tuple[PreTrainedModel, Any]:
    """A merged model folder or an adapter folder, and its tokenizer (text) or processor (vision).

    `device`: "cuda" or "cpu"; default the GPU when there is one. `processing_class`: the tokenizer or
    processor the folder was saved with, already in memory (the run that wrote it): used instead of
    loading the folder's copy again.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    from trainer.model_files import resolve_model_path
    from trainer.modeling import ensure_chat_template, resolve_dtype

    model_dir = Path(model_dir)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if device == "cuda":
        dtype = recipe.model.dtype if recipe.model.dtype != "auto" else "bfloat16"
        kwargs = {"dtype": resolve_dtype(dtype), "device_map": "auto"}
    loader = AutoModelForCausalLM if recipe.model.text_only else AutoModelForImageTextToText
    adapter_config = model_dir / "adapter_config.json"
    if adapter_config.exists():
        from peft import PeftModel

        base = json.loads(adapter_config.read_text()).get("base_model_name_or_path") or recipe.model.name_or_path
        model = PeftModel.from_pretrained(loader.from_pretrained(resolve_model_path(base), **kwargs), model_dir)
        has_tokenizer = (model_dir / "tokenizer_config.json").exists()
        source = model_dir if has_tokenizer else Path(resolve_model_path(base))
    else:
        model, source = loader.from_pretrained(model_dir, **kwargs), model_dir
    if processing_class is None:
        processing_class = (AutoTokenizer if recipe.model.text_only else AutoProcessor).from_pretrained(source)
    ensure_chat_template(processing_class, recipe.model.chat_template)
    model.eval()
    return model, processing_class


def _tokenizer(processing_class: Any) -> PreTrainedTokenizerBase:
    return getattr(processing_class, "tokenizer", processing_class)


def _encode(processing_class: Any, texts: list[str], images: list[list[Any]] | None, device: Any) -> dict[str, Any]:
    """Tokenise prompts (left-padded), with their images for a vision processor."""
    tokenizer = _tokenizer(processing_class)
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        if images is not None:
            batch = processing_class(
                text=texts, images=images, padding=True, add_special_tokens=False, return_tensors="pt"
            )
        else:
            batch = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    finally:
        tokenizer.padding_side = side
    return {k: v.to(device) for k, v in batch.items()}


def generate_batch(
    model: PreTrainedModel,
    processing_class: Any,
    conversations: list[dict[str, Any]],
    max_new_tokens: int,
) -> list[str]:
    """Greedy completions of each conversation's next assistant turn (left-padded batch), without special tokens.

    The KV cache is asked for: the Trainer sets the model's `config.use_cache` to `TrainingArguments.use_cache`
    (False by default: transformers 5 trainer.py, "Finalize"), and without a cache every new token of the run's
    own evaluation (trainer/run_eval.py) would recompute the whole sequence.
    Under FSDP with several ranks transformers' `generate` keeps the ranks' forwards in step by itself
    (`synced_gpus` defaults to on for an FSDP-managed module: transformers 5 generation/utils.py)."""
    import torch

    tokenizer = _tokenizer(processing_class)
    prompts = [
        str(processing_class.apply_chat_template(c["messages"], add_generation_prompt=True, tokenize=False))
        for c in conversations
    ]
    images = [list(c["images"]) for c in conversations] if "images" in conversations[0] else None
    inputs = _encode(processing_class, prompts, images, model.device)
    prompt_length = int(inputs["input_ids"].shape[1])
    with torch.no_grad():
        output: Any = cast(Any, model).generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=tokenizer.pad_token_id,
        )
    return [str(tokenizer.decode(row[prompt_length:], skip_special_tokens=True)).strip() for row in output]


def generate(model: PreTrainedModel, processing_class: Any, messages: list[dict], max_new_tokens: int) -> str:
    """Greedy completion of one conversation's next assistant turn, without special tokens."""
    return generate_batch(model, processing_class, [{"messages": messages}], max_new_tokens)[0]


_EVAL_FUSED_HEAD = "_gemma_ft_eval_fused_head"


def fused_head_model(model: Any) -> Any:
    """The model to call with `fused_lm_head=True`: `model`, or the base inside a PEFT wrapper (its LoRA layers stay
    in it), with trl's fused LM head scoring labelled positions only. Added once; generation is unchanged.

    As in training (trainer/lm_head.py `new_sft_trainer`), trl's Triton kernel is taken only where Triton can
    build its driver stub (trainer/triton_build.py): an evaluation-only run on a GPU has no trainer to install it."""
    from trl.trainer.utils import add_fused_lm_head

    from trainer.lm_head import score_labelled_positions_only
    from trainer.triton_build import use_triton_only_where_it_builds

    use_triton_only_where_it_builds()

    owner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(owner, _EVAL_FUSED_HEAD, False):
        add_fused_lm_head(owner)
        score_labelled_positions_only(owner)
        setattr(owner, _EVAL_FUSED_HEAD, True)
    return owner


def answer_losses(model: PreTrainedModel, processing_class: Any, conversations: list[dict]) -> list[tuple[float, int]]:
    """(summed cross-entropy, token count) of each reference answer given its prompt (and images): one forward.

    The conversations are left-padded together, so every answer ends at the last position; positions
    count from each row's first real token, as for the row alone. Only the answer tokens carry a label,
    and trl's fused head projects only the hidden states that predict them, in vocabulary tiles
    (`fused_head_model`): the `[batch, length, vocab]` logits are never built.
    """
    import torch

    if not conversations:
        return []
    images = [list(c["images"]) for c in conversations] if "images" in conversations[0] else None
    prompts, fulls = [], []
    for conversation in conversations:
        prompt_text = processing_class.apply_chat_template(
            prompt_messages(conversation), add_generation_prompt=True, tokenize=False
        )
        prompts.append(prompt_text)
        fulls.append(processing_class.apply_chat_template(conversation["messages"], tokenize=False))
    prompt_lengths = _encode(processing_class, prompts, images, model.device)["attention_mask"].sum(dim=1)
    inputs = _encode(processing_class, fulls, images, model.device)
    real = inputs["attention_mask"].sum(dim=1)
    answers = [max(0, int(n) - int(p)) for n, p in zip(real, prompt_lengths, strict=True)]
    if max(answers) == 0:
        return [(0.0, 0) for _ in conversations]
    inputs["position_ids"] = (inputs["attention_mask"].cumsum(dim=1) - 1).clamp(min=0)
    length = inputs["input_ids"].shape[1]
    in_answer = torch.arange(length, device=inputs["input_ids"].device) >= torch.tensor(
        [length - a for a in answers], device=inputs["input_ids"].device
    ).unsqueeze(1)
    labels = torch.where(in_answer, inputs["input_ids"], -100)  # left-padded: the answers are each row's last tokens
    with torch.no_grad():
        log_probs = fused_head_model(model)(**inputs, labels=labels, fused_lm_head=True).log_probs  # 0 off-answer
    sums = -log_probs.float().sum(dim=1)
    return [(float(total), count) for total, count in zip(sums, answers, strict=True)]


def held_out_rows(recipe: Recipe, max_samples: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(conversation, raw row) pairs from the recipe's eval split, capped at `max_samples`; bad rows skipped."""
    from trainer.data import held_out_raw, open_image, resolve_image_dir
    from trainer.formatting import FormattingError, row_formatter

    raw = held_out_raw(recipe.data)
    if raw is None:
        raise RecipeError(f"recipe {recipe.name} holds out no rows (data.eval_rows is 0): nothing to evaluate on")
    has_images = recipe.data.task is Task.PRODUCT_DESCRIPTION or "images" in raw.column_names
    formatter, pairs = row_formatter(recipe.data, has_images), []
    images_root = resolve_image_dir(recipe.data.image_dir)
    for row in raw.select(range(min(max_samples, len(raw)))):
        try:
            conversation = formatter(row)
            if "images" in conversation:
                conversation["images"] = [open_image(image, images_root) for image in conversation["images"]]
        except (FormattingError, OSError) as exc:  # OSError: an image that does not open
            log.warning("evaluation skips a row: %s", exc)
            continue
        pairs.append((conversation, row))
    return pairs


_WORD = re.compile(r"\w+")


def rouge_l_f1(prediction: str, reference: str) -> float:
    """ROUGE-L F1 over lower-cased words (docs/trainer.md#held-out-evaluation); two empty texts score 1."""
    pred, ref = _WORD.findall(prediction.lower()), _WORD.findall(reference.lower())
    if not pred or not ref:
        return float(pred == ref)
    previous = [0] * (len(ref) + 1)
    for word in pred:
        current = [0]
        for j, other in enumerate(ref):
            current.append(previous[j] + 1 if word == other else max(previous[j + 1], current[j]))
        previous = current
    lcs = previous[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, reference: str, task: Task | None = None) -> float:
    """1.0 when the texts are the same up to runs of whitespace (emoji: up to any whitespace), else 0.0."""
    if task is Task.EMOJI:
        return float("".join(prediction.split()) == "".join(reference.split()))
    return float(" ".join(prediction.split()) == " ".join(reference.split()))


_METRIC = {Task.EMOJI: "emoji_f1", Task.TEXT_TO_SQL: "execution_match", Task.PRODUCT_DESCRIPTION: "rouge_l_f1"}
# data.format messages / prompt-completion / columns (no task): ROUGE-L F1 as the text overlap, and exact_match
GENERIC_METRIC = "rouge_l_f1"


def score_name(task: Task | None) -> str:
    """The headline score of a format: the tutorial task's own metric, else ROUGE-L F1 (what the serving gate compares)."""
    return _METRIC[task] if task is not None else GENERIC_METRIC


def text_scores(task: Task | None, answers: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> dict[str, float]:
    """Mean exact match, ROUGE-L F1 and the task's own metric over (prediction, conversation, raw row) triples."""
    if not answers:
        return {}
    pairs = [(prediction, reference_text(conversation)) for prediction, conversation, _ in answers]
    scores = {
        "exact_match": sum(exact_match(p, r, task) for p, r in pairs) / len(pairs),
        GENERIC_METRIC: sum(rouge_l_f1(p, r) for p, r in pairs) / len(pairs),
    }
    if task is not None and score_name(task) not in scores:
        own = [_score(task, p, reference_text(c), row) for p, c, row in answers]
        scores[score_name(task)] = sum(own) / len(own)
    return scores


def sharded_answers(
    model: PreTrainedModel,
    processing_class: Any,
    conversations: list[dict[str, Any]],
    max_new_tokens: int,
    batch_size: int,
) -> list[str]:
    """Greedy answers to `conversations` (each without its last assistant turn), on every rank the same list.

    With several ranks (torch.distributed) each answers an even, contiguous share (the last conversation repeated
    to fill the shares, its repeats dropped) in the same number of batches, and the shares are gathered with
    `all_gather_object`: under FSDP every rank must run each forward anyway, so each does 1/world of the rows.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if not conversations:
        return []
    share = -(-len(conversations) // world)
    padded = conversations + [conversations[-1]] * (share * world - len(conversations))
    mine = padded[rank * share : (rank + 1) * share]
    if distributed:
        last = min((rank + 1) * share, len(conversations))
        log.info(
            "rank %d of %d answers held-out rows %d-%d of %d", rank, world, rank * share + 1, last, len(conversations)
        )
    answers: list[str] = []
    for first in range(0, len(mine), batch_size):
        answers += generate_batch(model, processing_class, mine[first : first + batch_size], max_new_tokens)
    if not distributed:
        return answers
    shares: list[Any] = [None] * world
    dist.all_gather_object(shares, answers)
    return [answer for part in shares for answer in part][: len(conversations)]


def evaluate(
    model_dir: str | Path,
    recipe: Recipe,
    max_samples: int | None = None,
    out: str | Path | None = None,
    processing_class: Any = None,
) -> dict[str, Any]:
    """Score `model_dir` on the recipe's held-out rows; returns the results and writes them as JSON.

    `processing_class`: the folder's tokenizer or processor already in memory (`load_for_eval`).
    """
    model, processing_class = load_for_eval(model_dir, recipe, processing_class=processing_class)
    samples = max_samples or recipe.evaluation.max_samples
    rows = held_out_rows(recipe, samples)
    size = recipe.evaluation.batch_size
    predictions, scores, loss_sum, loss_tokens = [], [], 0.0, 0
    for first in range(0, len(rows), size):
        chunk = rows[first : first + size]
        prompts = [{**conversation, "messages": prompt_messages(conversation)} for conversation, _ in chunk]
        generated = generate_batch(model, processing_class, prompts, recipe.max_new_tokens)
        losses = answer_losses(model, processing_class, [conversation for conversation, _ in chunk])
        for (conversation, row), prediction, (summed, tokens) in zip(chunk, generated, losses, strict=True):
            reference = reference_text(conversation)
            scores.append(_score(recipe.data.task, prediction, reference, row))
            loss_sum, loss_tokens = loss_sum + summed, loss_tokens + tokens
            predictions.append({"prompt": _prompt_text(conversation), "reference": reference, "prediction": prediction})
    results: dict[str, Any] = {
        "model": str(model_dir),
        "recipe": recipe.name,
        "samples": len(predictions),
        "max_new_tokens": recipe.max_new_tokens,
        score_name(recipe.data.task): sum(scores) / len(scores) if scores else None,
        "held_out_loss": loss_sum / loss_tokens if loss_tokens else None,
        "held_out_perplexity": math.exp(loss_sum / loss_tokens) if loss_tokens else None,
        "predictions": predictions,
    }
    if recipe.data.task is Task.EMOJI or recipe.data.task is None:
        results["exact_match"] = sum(
            exact_match(p["prediction"], p["reference"], recipe.data.task) for p in predictions
        ) / max(len(predictions), 1)
    out_path = Path(out) if out else Path(model_dir) / "eval_results.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=2, ensure_ascii=False))
    return results


def _prompt_text(conversation: dict[str, Any]) -> str:
    content = prompt_messages(conversation)[-1]["content"]
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content if part.get("type") == "text")


def _score(task: Task | None, prediction: str, reference: str, row: dict[str, Any]) -> float:
    if task is Task.EMOJI:
        return emoji_f1(prediction, reference)
    if task is Task.PRODUCT_DESCRIPTION or task is None:
        return rouge_l_f1(prediction, reference)
    from trainer.sql_eval import execution_match

    return float(execution_match(_strip_code_fence(prediction), reference, row["sql_context"]))


def _strip_code_fence(text: str) -> str:
    """Models sometimes wrap SQL in ```sql fences; the query is what is inside."""
    text = text.strip()
    if text.startswith("```"):
        text = text.split("\n", 1)[-1].rsplit("```", 1)[0]
    return text.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.evaluate", description="Score a fine-tuned model.")
    parser.add_argument("--model", required=True, help="merged model folder or adapter folder")
    parser.add_argument("--recipe", required=True, help="recipe name or path (its eval split is used)")
    parser.add_argument("--max-samples", type=int, default=None)
    parser.add_argument("--out", default=None, help="JSON file for the results (default <model>/eval_results.json)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    try:
        results = evaluate(args.model, load_recipe(args.recipe, args.overrides), args.max_samples, args.out)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in results.items() if k != "predictions"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
