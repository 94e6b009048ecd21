"""Evaluate a fine-tuned model on a recipe's held-out rows: greedy generations, a task score, held-out loss.

    .venv/bin/python -m trainer.evaluate --model outputs/emoji-local/merged --recipe emoji-local --max-samples 20
    .venv/bin/python -m trainer.evaluate --model outputs/emoji-local/adapter --recipe emoji-local   # adapter folder works too

Scores:
- emoji: **emoji F1**. Both texts are reduced to their SETS of emoji (a ZWJ sequence, a flag, or an
  emoji with its variation selector / skin tone counts as one); precision = |pred ∩ ref| / |pred|,
  recall = |pred ∩ ref| / |ref|, F1 their harmonic mean; two empty sets score 1, one empty set 0.
  Order and repetition are ignored on purpose: "🍌🍌😋" for "😋🍌" is a perfect translation.
  `exact_match` (the same emoji string, whitespace ignored) is reported too.
- text-to-sql: **execution match** from trainer.sql_eval (the predicted query returns the same
  result as the reference on the row's schema), imported only for that task.
- every task: **held-out loss**, the mean cross-entropy of the reference answer's tokens given the
  prompt (the same tokens the training loss covers).

The held-out rows are exactly the recipe's eval split (seeded shuffle, first `eval_rows`), so a model
is never scored on rows it trained on. Returns a dict and writes it as JSON (`--out`, default
`<model>/eval_results.json`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
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
    """F1 over the sets of emoji in prediction and reference (see the module docstring)."""
    predicted, expected = set(extract_emoji(prediction)), set(extract_emoji(reference))
    if not predicted and not expected:
        return 1.0
    overlap = len(predicted & expected)
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(predicted), overlap / len(expected)
    return 2 * precision * recall / (precision + recall)


def load_for_eval(model_dir: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A merged model folder, or an adapter folder (its base is read from adapter_config.json)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    if (model_dir / "adapter_config.json").exists():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(model_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model.eval()
    return model, tokenizer


def generate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_new_tokens: int
) -> str:
    """Greedy completion of a conversation's next assistant turn, without special tokens."""
    import torch

    prompt = str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    inputs = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").to(model.device)
    prompt_length = int(inputs["input_ids"].shape[1])
    with torch.no_grad():
        output: Any = cast(Any, model).generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return str(tokenizer.decode(output[0, prompt_length:], skip_special_tokens=True)).strip()


def answer_loss(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, conversation: dict) -> tuple[float, int]:
    """(summed cross-entropy, token count) of the reference answer given the prompt."""
    import torch

    prompt = tokenizer.apply_chat_template(prompt_messages(conversation), add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(conversation["messages"], tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    full_ids = tokenizer(full, add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
    labels = full_ids.clone()
    labels[:, : len(prompt_ids)] = -100
    answer_tokens = int((labels[:, 1:] != -100).sum())
    with torch.no_grad():
        loss = model(input_ids=full_ids, labels=labels).loss
    return float(loss) * answer_tokens, answer_tokens


def held_out_rows(recipe: Recipe, max_samples: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(conversation, raw row) pairs from the recipe's eval split, capped at `max_samples`; bad rows skipped."""
    from trainer.data import load_rows, split_rows
    from trainer.formatting import FormattingError, formatter_for

    _, raw = split_rows(load_rows(recipe.data), recipe.data)
    if raw is None:
        raise RecipeError(f"recipe {recipe.name} holds out no rows (data.eval_rows is 0): nothing to evaluate on")
    formatter, pairs = formatter_for(recipe.data.task), []
    for row in raw.select(range(min(max_samples, len(raw)))):
        try:
            pairs.append((formatter(row), row))
        except FormattingError as exc:
            log.warning("evaluation skips a row: %s", exc)
    return pairs


def evaluate(
    model_dir: str | Path, recipe: Recipe, max_samples: int | None = None, out: str | Path | None = None
) -> dict[str, Any]:
    """Score `model_dir` on the recipe's held-out rows; returns the results and writes them as JSON."""
    if recipe.data.task is Task.PRODUCT_DESCRIPTION:
        raise RecipeError(
            "evaluate covers the text tasks (emoji, text-to-sql); product descriptions are judged by people"
        )
    model, tokenizer = load_for_eval(model_dir)
    samples = max_samples or recipe.evaluation.max_samples
    predictions, scores, loss_sum, loss_tokens = [], [], 0.0, 0
    for conversation, row in held_out_rows(recipe, samples):
        prediction = generate(model, tokenizer, prompt_messages(conversation), recipe.evaluation.max_new_tokens)
        reference = reference_text(conversation)
        scores.append(_score(recipe.data.task, prediction, reference, row))
        summed, tokens = answer_loss(model, tokenizer, conversation)
        loss_sum, loss_tokens = loss_sum + summed, loss_tokens + tokens
        predictions.append(
            {"prompt": prompt_messages(conversation)[-1]["content"], "reference": reference, "prediction": prediction}
        )
    metric = "emoji_f1" if recipe.data.task is Task.EMOJI else "execution_match"
    results: dict[str, Any] = {
        "model": str(model_dir),
        "recipe": recipe.name,
        "samples": len(predictions),
        metric: sum(scores) / len(scores) if scores else None,
        "held_out_loss": loss_sum / loss_tokens if loss_tokens else None,
        "held_out_perplexity": math.exp(loss_sum / loss_tokens) if loss_tokens else None,
        "predictions": predictions,
    }
    if recipe.data.task is Task.EMOJI:
        results["exact_match"] = sum(
            "".join(p["prediction"].split()) == "".join(p["reference"].split()) for p in predictions
        ) / max(len(predictions), 1)
    out_path = Path(out) if out else Path(model_dir) / "eval_results.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=2, ensure_ascii=False))
    return results


def _score(task: Task, prediction: str, reference: str, row: dict[str, Any]) -> float:
    if task is Task.EMOJI:
        return emoji_f1(prediction, reference)
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
