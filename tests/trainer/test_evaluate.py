"""Evaluation: the score definitions, and real scoring of tiny models (text and vision) on held-out rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from trainer.evaluate import (
    _encode,
    _score,
    answer_losses,
    emoji_f1,
    evaluate,
    extract_emoji,
    generate,
    generate_batch,
    held_out_rows,
    load_for_eval,
    rouge_l_f1,
)
from trainer.recipe import REPO_ROOT, Task, load_recipe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


class TestEmojiScore:
    def test_sequences_flags_and_variation_selectors_are_single_emoji(self) -> None:
        assert extract_emoji("I 🍌 then 👩‍🍳!") == ["🍌", "👩\u200d🍳"]
        assert extract_emoji("🇵🇹🇧🇷") == ["🇵🇹", "🇧🇷"]
        assert extract_emoji("🌧️") == extract_emoji("🌧") == ["🌧"]
        assert extract_emoji("no emoji, just words 123") == []

    def test_order_and_repetition_do_not_matter(self) -> None:
        assert emoji_f1("🍌🍌😋", "😋🍌") == 1.0

    def test_partial_overlap(self) -> None:
        # prediction {🍌, 🍕}, reference {🍌, 🥣, 😋}: precision 1/2, recall 1/3, F1 = 0.4
        assert emoji_f1("🍌🍕", "🍌🥣😋") == pytest.approx(0.4)

    def test_empty_cases(self) -> None:
        assert emoji_f1("", "") == 1.0
        assert emoji_f1("banana", "🍌") == 0.0
        assert emoji_f1("🍌", "") == 0.0


def test_sql_score_uses_execution_match() -> None:
    row = {
        "sql_context": "CREATE TABLE t (id INT, v INT); INSERT INTO t VALUES (1, 10), (2, 20);",
        "sql": "SELECT SUM(v) FROM t;",
    }
    assert _score(Task.TEXT_TO_SQL, "```sql\nSELECT SUM(v) FROM t WHERE id > 0;\n```", row["sql"], row) == 1.0
    assert _score(Task.TEXT_TO_SQL, "SELECT MAX(v) FROM t;", row["sql"], row) == 0.0


@pytest.fixture(scope="module")
def tiny_merged(tiny_gemma3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer.export import merge_and_export

    root = tmp_path_factory.mktemp("eval")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir), LoraConfig(target_modules=["q_proj"]))
    model.save_pretrained(root / "adapter")
    return merge_and_export(str(tiny_gemma3_dir), root / "adapter", root / "merged", dtype="float32")


def test_evaluate_emoji_on_held_out_rows(tiny_merged: Path, tmp_path: Path) -> None:
    recipe = load_recipe("emoji-local", ["evaluation.max_new_tokens=4"])
    results = evaluate(tiny_merged, recipe, max_samples=3, out=tmp_path / "eval.json")
    assert results["samples"] == 3
    assert 0.0 <= results["emoji_f1"] <= 1.0 and 0.0 <= results["exact_match"] <= 1.0
    assert results["held_out_loss"] > 0
    written = json.loads((tmp_path / "eval.json").read_text())
    assert written["held_out_loss"] == results["held_out_loss"]
    assert {p["reference"] for p in written["predictions"]} <= {
        json.loads(line)["emoji"] for line in (REPO_ROOT / "trainer/samples/emoji.jsonl").read_text().splitlines()
    }


def test_evaluate_text_to_sql(tiny_merged: Path, tmp_path: Path) -> None:
    recipe_file = tmp_path / "sql.yaml"
    recipe_file.write_text(
        "name: sql-local\nmodel: {name_or_path: local:gemma3-270m}\n"
        "data: {task: text-to-sql, source: local, path: trainer/samples/text_to_sql.jsonl, eval_rows: 5}\n"
        "training: {max_length: 512}\noutput: {dir: out}\nevaluation: {max_new_tokens: 4}\n"
    )
    results = evaluate(tiny_merged, load_recipe(str(recipe_file)), max_samples=2, out=tmp_path / "sql.json")
    assert results["samples"] == 2 and results["execution_match"] == 0.0  # an untrained tiny model writes no SQL


class TestRougeL:
    def test_identical_disjoint_and_empty(self) -> None:
        assert rouge_l_f1("A red mug.", "a red MUG") == 1.0
        assert rouge_l_f1("blue lamp", "red mug") == 0.0
        assert rouge_l_f1("", "") == 1.0 and rouge_l_f1("mug", "") == 0.0

    def test_longest_common_subsequence_in_order(self) -> None:
        # LCS of "a sturdy red enamel mug" and "a red mug for camp" is "a red mug": P 3/5, R 3/5
        assert rouge_l_f1("a sturdy red enamel mug", "a red mug for camp") == pytest.approx(0.6)
        assert rouge_l_f1("mug red a", "a red mug") == pytest.approx(1 / 3)


def test_generation_budget_comes_from_the_recipe_by_task() -> None:
    """64 new tokens cut SQL queries off; each task gets the budget its answers need."""
    assert load_recipe("text-to-sql-gemma4-31b").max_new_tokens == 512
    assert load_recipe("product-descriptions-gemma3-4b").max_new_tokens == 512
    assert load_recipe("emoji-gemma3-1b").max_new_tokens == 32
    unset = load_recipe("text-to-sql-gemma4-31b", ["evaluation.max_new_tokens=null"])
    assert unset.max_new_tokens == 512
    assert load_recipe("emoji-local", ["evaluation.max_new_tokens=7"]).max_new_tokens == 7


def test_gpu_loading_is_bf16_with_a_device_map(tiny_merged: Path) -> None:
    """The GPU path (bf16, device_map="auto") loads and generates on whatever device there is.

    On a machine without a GPU, accelerate's "auto" map places everything on the CPU; the spread over
    several GPUs is accelerate's own behaviour and is not exercised here.
    """
    import torch

    recipe = load_recipe("emoji-gemma3-1b")  # dtype bfloat16, as the cloud recipes
    model, tokenizer = load_for_eval(tiny_merged, recipe, device="cuda")
    assert model.dtype == torch.bfloat16
    assert isinstance(generate(model, tokenizer, [{"role": "user", "content": "Translate to emoji: rain"}], 3), str)
    cpu_model, _ = load_for_eval(tiny_merged, recipe, device="cpu")
    assert cpu_model.dtype == torch.float32


@pytest.mark.parametrize("recipe_name", ["emoji-local", pytest.param("text-to-sql", marks=pytest.mark.slow)])
def test_batched_generation_equals_one_at_a_time(tiny_merged: Path, tmp_path: Path, recipe_name: str) -> None:
    """Left-padded greedy batches give exactly the outputs of one prompt at a time."""
    from trainer.formatting import prompt_messages

    recipe = load_recipe("emoji-local") if recipe_name == "emoji-local" else _sql_recipe(tmp_path)
    model, tokenizer = load_for_eval(tiny_merged, recipe, device="cpu")
    conversations = [{"messages": prompt_messages(c)} for c, _ in held_out_rows(recipe, 5)]
    lengths = {len(tokenizer.apply_chat_template(c["messages"], tokenize=False)) for c in conversations}
    assert len(lengths) > 1, "the prompts must differ in length for padding to matter"
    batched = generate_batch(model, tokenizer, conversations, max_new_tokens=12)
    alone = [generate(model, tokenizer, c["messages"], max_new_tokens=12) for c in conversations]
    assert batched == alone and any(batched)


def _one_row_loss(model, processing_class, conversation: dict) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """The reference: the row alone, unpadded, through the model's own loss (mean over the answer's tokens)."""
    import torch

    from trainer.formatting import prompt_messages

    images = [list(conversation["images"])] if "images" in conversation else None
    prompt = processing_class.apply_chat_template(
        prompt_messages(conversation), add_generation_prompt=True, tokenize=False
    )
    full = processing_class.apply_chat_template(conversation["messages"], tokenize=False)
    prompt_ids = _encode(processing_class, [prompt], images, model.device)["input_ids"]
    inputs = _encode(processing_class, [full], images, model.device)
    labels = inputs["input_ids"].clone()
    labels[:, : prompt_ids.shape[1]] = -100
    tokens = int((labels[:, 1:] != -100).sum())
    with torch.no_grad():
        return float(model(**inputs, labels=labels).loss) * tokens, tokens


def _assert_losses_match_one_row_at_a_time(model, processing_class, conversations: list[dict]) -> None:  # type: ignore[no-untyped-def]
    batched = answer_losses(model, processing_class, conversations)
    alone = [_one_row_loss(model, processing_class, c) for c in conversations]
    assert [tokens for _, tokens in batched] == [tokens for _, tokens in alone]
    assert len({tokens for _, tokens in alone}) > 1, "answers of several lengths, so the padding matters"
    for (got, _), (want, _) in zip(batched, alone, strict=True):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("recipe_name", ["emoji-local", pytest.param("text-to-sql", marks=pytest.mark.slow)])
def test_batched_answer_losses_equal_each_row_alone(tiny_merged: Path, tmp_path: Path, recipe_name: str) -> None:
    """One left-padded forward with the answers' logits only gives each row's own held-out loss."""
    recipe = load_recipe("emoji-local") if recipe_name == "emoji-local" else _sql_recipe(tmp_path)
    model, tokenizer = load_for_eval(tiny_merged, recipe, device="cpu")
    _assert_losses_match_one_row_at_a_time(model, tokenizer, [c for c, _ in held_out_rows(recipe, 5)])


@pytest.mark.parametrize("adapter", [False, True])
def test_answer_losses_build_no_logits(
    tiny_merged: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, adapter: bool
) -> None:
    """The held-out loss never calls the model's LM head (which returns `[batch, positions, vocab]` logits): the
    fused head projects exactly the hidden states that predict an answer token, as training does, and the loss
    is the full-logit one (the test above). Generation afterwards is the model's own, unchanged."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    from trainer.cpu_logprob import LabelledRowsLogProb

    recipe = load_recipe("emoji-local")
    model_dir = tiny_merged
    if adapter:  # a PEFT adapter folder: the fused head goes on the base inside the wrapper
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        peft_model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(tiny_merged), LoraConfig(r=2, target_modules=["q_proj"])
        )
        peft_model.save_pretrained(tmp_path / "adapter")
        config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = str(tiny_merged)
        (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
        model_dir = tmp_path / "adapter"
    model, tokenizer = load_for_eval(model_dir, recipe, device="cpu")
    conversations = [c for c, _ in held_out_rows(recipe, 5)]
    before = generate_batch(model, tokenizer, [{"messages": m} for m in [c["messages"][:-1] for c in conversations]], 8)

    head_outputs: list[tuple[int, ...]] = []
    model.get_output_embeddings().register_forward_hook(lambda _m, _i, out: head_outputs.append(tuple(out.shape)))
    rows: list[int] = []
    for kernel in (ChunkedLogProbFunction, LabelledRowsLogProb):

        def spy(ctx, hidden, *args, _forward=kernel.forward):  # type: ignore[no-untyped-def]
            rows.append(int(hidden.shape[0]))
            return _forward(ctx, hidden, *args)

        monkeypatch.setattr(kernel, "forward", staticmethod(spy))
    losses = answer_losses(model, tokenizer, conversations)
    assert head_outputs == [], f"the LM head built logits {head_outputs}"
    assert rows == [sum(tokens for _, tokens in losses)] and rows[0] > 0
    assert all(total > 0 for total, _ in losses)
    monkeypatch.undo()
    after = generate_batch(model, tokenizer, [{"messages": m} for m in [c["messages"][:-1] for c in conversations]], 8)
    assert after == before and head_outputs, "generation uses the model's own head, as before"


def _sql_recipe(tmp_path: Path):  # type: ignore[no-untyped-def]
    recipe_file = tmp_path / "sql-batch.yaml"
    recipe_file.write_text(
        "name: sql-local\nmodel: {name_or_path: local:gemma3-270m}\n"
        "data: {task: text-to-sql, source: local, path: trainer/samples/text_to_sql.jsonl, eval_rows: 5}\n"
        "output: {dir: out}\n"
    )
    return load_recipe(str(recipe_file))


@pytest.fixture(scope="module")
def tiny_vision_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter (W2's spec: all-linear, vision tower too) on a tiny Gemma 3 vision model, as W2 saves it."""
    from peft import get_peft_model

    from tests.tiny_models import tiny_vision_model, tiny_vision_processor
    from trainer.modeling import lora_config

    root = tmp_path_factory.mktemp("vision-eval")
    processor = tiny_vision_processor()
    tiny_vision_model(processor).save_pretrained(root / "base")
    processor.save_pretrained(root / "base")
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(root / "base")  # the adapter records this base path
    lora = load_recipe("product-descriptions-gemma3-4b").lora.model_copy(update={"modules_to_save": []})
    model = get_peft_model(base, lora_config(lora, base))
    model.save_pretrained(root / "adapter")
    processor.save_pretrained(root / "adapter")
    return root


@pytest.mark.slow
def test_evaluate_product_descriptions_on_held_out_rows(tiny_vision_adapter: Path, tmp_path: Path) -> None:
    """W2's held-out rows: image + name + category in, a description out; ROUGE-L and held-out loss."""
    overrides = [
        f"model.name_or_path={tiny_vision_adapter / 'base'}",
        "model.dtype=float32",
        "quantization=null",
        "data.source=local",
        "data.path=trainer/samples/products.jsonl",
        "data.image_dir=trainer/samples",
        "data.eval_rows=4",
        "training.save_steps=1",
        "evaluation.max_new_tokens=6",
    ]
    recipe = load_recipe("product-descriptions-gemma3-4b", overrides)
    model, processor = load_for_eval(tiny_vision_adapter / "adapter", recipe, device="cpu")
    _assert_losses_match_one_row_at_a_time(model, processor, [c for c, _ in held_out_rows(recipe, 3)])
    results = evaluate(tiny_vision_adapter / "adapter", recipe, max_samples=3, out=tmp_path / "eval.json")
    assert results["samples"] == 3 and results["max_new_tokens"] == 6
    assert 0.0 <= results["rouge_l_f1"] <= 1.0
    assert results["held_out_loss"] > 0 and math.isfinite(results["held_out_perplexity"])
    assert all(p["reference"] and "<PRODUCT>" in p["prompt"] for p in results["predictions"])
    one_by_one = evaluate(
        tiny_vision_adapter / "adapter",
        load_recipe("product-descriptions-gemma3-4b", [*overrides, "evaluation.batch_size=1"]),
        max_samples=3,
        out=tmp_path / "eval1.json",
    )
    assert [p["prediction"] for p in one_by_one["predictions"]] == [p["prediction"] for p in results["predictions"]]
    assert one_by_one["held_out_loss"] == pytest.approx(results["held_out_loss"], rel=1e-5)
