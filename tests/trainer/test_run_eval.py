"""The training run scores the base model and the tuned one on its held-out rows, for any format (trainer/run_eval.py).

Why it matters: a run of the user's own data must say whether training helped, in the summary the serving gate
reads, and "before" must really be the base model: it is computed with the adapter switched off, so it is checked
here against the evaluator run on the base model's own folder, and "after" against the saved adapter's.
The 2-rank FSDP2 case (`test_two_fsdp_ranks_share_the_answers_and_rank_0_writes_them_all`) is in
tests/trainer/test_fsdp_checkpoint.py: it checks that file's uninterrupted launch, which answers held-out rows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.trainer.test_own_data import own_recipe
from trainer.evaluate import exact_match, rouge_l_f1, text_scores
from trainer.recipe import Task, load_recipe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _turns(prompt: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


class TestMetrics:
    def test_exact_match_ignores_runs_of_whitespace_only(self) -> None:
        assert exact_match("billing", "billing") == 1.0
        assert exact_match("  the  red\nmug ", "the red mug") == 1.0
        assert exact_match("Billing", "billing") == 0.0 and exact_match("billing.", "billing") == 0.0
        assert exact_match("theredmug", "the red mug") == 0.0
        assert exact_match("🍌 😋", "🍌😋", Task.EMOJI) == 1.0  # emoji: any whitespace

    def test_scores_of_a_few_answers_by_hand(self) -> None:
        # ROUGE-L F1: "a red mug" vs itself 1; "a sturdy red enamel mug" vs "a red mug for camp": LCS 3 of 5 and 5
        # words, F1 0.6; "blue lamp" vs "red mug" 0. Exact match: 1 of 3.
        answers = [
            ("a red mug", _turns("q1", "a red mug"), {}),
            ("a sturdy red enamel mug", _turns("q2", "a red mug for camp"), {}),
            ("blue lamp", _turns("q3", "red mug"), {}),
        ]
        scores = text_scores(None, answers)
        assert scores == pytest.approx({"exact_match": 1 / 3, "rouge_l_f1": (1 + 0.6 + 0) / 3})
        assert rouge_l_f1("the cat sat on the mat", "the cat on a mat") == pytest.approx(
            2 * 0.8 * 4 / 6 / (0.8 + 4 / 6)
        )

    def test_a_tutorial_task_adds_its_own_metric(self) -> None:
        # emoji F1 of {🍌,😋} vs {😋}: P 1/2, R 1, F1 2/3; the generic scores come too
        scores = text_scores(Task.EMOJI, [("🍌😋", _turns("banana yum", "😋"), {})])
        assert scores == pytest.approx({"exact_match": 0.0, "rouge_l_f1": 1.0, "emoji_f1": 2 / 3})

    def test_the_budget_is_a_recipe_key(self) -> None:
        assert load_recipe("emoji-gemma3-1b").evaluation.generate_rows == 32
        assert load_recipe("emoji-local").evaluation.generate_rows == 4  # the CPU demo answers a few
        assert load_recipe("emoji-local", ["evaluation.generate_rows=0"]).evaluation.generate_rows == 0


def test_evaluation_off_evaluates_nothing() -> None:
    """`evaluation.enabled: false` (the GPU check's timed runs): no held-out loss, no answers, no forward at all."""
    from trainer.run_eval import run_evaluation

    class NoForward:
        eval_dataset = ("a held-out row",)

        def evaluate(self, *args: object, **kwargs: object) -> None:
            raise AssertionError("evaluated although evaluation.enabled is false")

    recipe = load_recipe("emoji-local", ["evaluation.enabled=false"])
    assert run_evaluation(NoForward(), recipe, None) is None  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_messages_run_summary_holds_the_base_and_the_tuned_scores(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    from trainer.evaluate import evaluate
    from trainer.train import SUMMARY_FILE, main

    settings = ["evaluation.generate_rows=3", "evaluation.max_new_tokens=6", "evaluation.batch_size=2"]
    recipe = own_recipe(tiny_gemma3_dir, tmp_path / "run", "training.learning_rate=0.05", *settings)
    summary = main(recipe).summary
    assert json.loads((tmp_path / "run" / SUMMARY_FILE).read_text()) == summary
    run_eval = summary["eval"]
    assert run_eval["score"] == "rouge_l_f1" and run_eval["generated_rows"] == 3 and run_eval["max_new_tokens"] == 6
    before, after = run_eval["before"], run_eval["after"]
    assert set(before) == set(after) == {"loss", "exact_match", "rouge_l_f1"}
    assert after["loss"] == summary["eval_loss"] and math.isfinite(before["loss"])
    assert after["loss"] < before["loss"]  # 2 steps at a high learning rate on 4-word answers
    assert all(0.0 <= side[k] <= 1.0 for side in (before, after) for k in ("exact_match", "rouge_l_f1"))

    # "before" is the base model's folder scored by the evaluator, "after" the saved adapter's
    base = evaluate(tiny_gemma3_dir, recipe, max_samples=3, out=tmp_path / "base.json")
    tuned = evaluate(tmp_path / "run" / "adapter", recipe, max_samples=3, out=tmp_path / "tuned.json")
    examples = run_eval["examples"]
    assert [e["before"] for e in examples] == [p["prediction"] for p in base["predictions"]]
    assert [e["after"] for e in examples] == [p["prediction"] for p in tuned["predictions"]]
    assert [e["reference"] for e in examples] == [p["reference"] for p in base["predictions"]]
    assert examples[0]["before"] != examples[0]["after"]  # the adapter is on for one and off for the other
    for side, scored in ((before, base), (after, tuned)):
        assert side["rouge_l_f1"] == pytest.approx(scored["rouge_l_f1"])
        assert side["exact_match"] == pytest.approx(scored["exact_match"])


@pytest.mark.slow
def test_no_generated_rows_keeps_the_loss_on_both_sides(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    from trainer.train import main

    summary = main(own_recipe(tiny_gemma3_dir, tmp_path / "run", "evaluation.generate_rows=0")).summary
    assert summary["eval"]["generated_rows"] == 0 and summary["eval"]["examples"] == []
    assert set(summary["eval"]["before"]) == set(summary["eval"]["after"]) == {"loss"}
