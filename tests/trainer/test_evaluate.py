"""Evaluation: the emoji F1 definition, and real scoring of a (tiny) merged model on held-out rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.evaluate import _score, emoji_f1, evaluate, extract_emoji
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
        json.loads(line)["emoji"] for line in (REPO_ROOT / "trainer/data/emoji.jsonl").read_text().splitlines()
    }


def test_evaluate_text_to_sql(tiny_merged: Path, tmp_path: Path) -> None:
    recipe_file = tmp_path / "sql.yaml"
    recipe_file.write_text(
        "name: sql-local\nmodel: {name_or_path: local:gemma3-270m}\n"
        "data: {task: text-to-sql, source: local, path: trainer/data/text_to_sql.jsonl, eval_rows: 5}\n"
        "training: {max_length: 512}\noutput: {dir: out}\nevaluation: {max_new_tokens: 4}\n"
    )
    results = evaluate(tiny_merged, load_recipe(str(recipe_file)), max_samples=2, out=tmp_path / "sql.json")
    assert results["samples"] == 2 and results["execution_match"] == 0.0  # an untrained tiny model writes no SQL
