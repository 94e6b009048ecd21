"""The serving gate on `dev` (infra/serving_gate.py): serving moves to a newly finished run only when its evaluation
is not worse than the served run's (held-out loss not higher, score not lower), or passes `servingMaxEvalLoss` /
`servingMinScore`; else `pulumi up` keeps the served run and warns with the override. The real program under the
project's mocks, with runs in the mocked bucket."""

from __future__ import annotations

import json

import pulumi
import pytest

from infra.config import ConfigError, validate
from infra.offline.engine import run_stack
from infra.serving_gate import RUN_SUMMARY, RunEval, gate, run_eval, run_loss
from tests.infra.test_cloud_run import BUCKET, SERVING, completed_run, served_path
from tests.infra.test_config import CLOUD_RUN

A, B, C = "a" * 12, "b" * 12, "c" * 12


def finished(rid: str, eval_loss: float | None, score: float | None = None, rows: str | None = None) -> dict[str, str]:
    """A finished run of the dev recipe: its summary (published before the export) and its export. With `score`,
    the summary's `eval` as trainer/run_eval.py writes it (emoji_f1 after training; the base model's before);
    with `rows`, the sha256 of the held-out rows it names (trainer/data.py `held_out_identity`)."""
    summary: dict = {"recipe": "emoji-gemma3-1b", "steps": 10, "eval_loss": eval_loss}
    if score is not None:
        summary["eval"] = {
            "score": "emoji_f1",
            **({"held_out": {"rows": 50, "sha256": rows, "from": "data.eval_path=x"}} if rows else {}),
            "generated_rows": 32,
            "max_new_tokens": 32,
            "before": {"loss": 3.0, "exact_match": 0.0, "rouge_l_f1": 0.0, "emoji_f1": 0.05},
            "after": {"loss": eval_loss, "exact_match": score / 2, "rouge_l_f1": 0.0, "emoji_f1": score},
            "examples": [],
        }
    return {
        f"{BUCKET}/runs/emoji-gemma3-1b-{rid}/{RUN_SUMMARY}": json.dumps(summary),
        **completed_run(rid, summary=False),
    }


def _served(run) -> str:  # type: ignore[no-untyped-def]
    return served_path(run).removesuffix("/merged").rsplit("-", 1)[1]


def test_a_worse_new_run_is_not_served_and_up_says_why() -> None:
    run = run_stack("dev", overrides=SERVING, bucket_objects={**finished(A, 0.80), **finished(B, 0.95)})
    assert _served(run) == A and run.outputs["servingRunId"] == A
    (warning,) = [w for w in run.warnings if "serving keeps run" in w]
    assert f"serving keeps run {A} (held-out loss 0.8000)" in warning and f"{B} has held-out loss 0.9500" in warning
    assert f"pulumi config set servingRunId {B}" in warning


def test_a_new_run_that_is_not_worse_is_served() -> None:
    for loss in (0.80, 0.60):
        run = run_stack("dev", overrides=SERVING, bucket_objects={**finished(A, 0.80), **finished(B, loss)})
        assert _served(run) == B, loss
        assert not [w for w in run.warnings if "serving keeps run" in w]


def test_the_served_run_is_replayed_from_every_finished_run() -> None:
    """A 0.9, B 0.7 (served), C 0.8 (worse than B): B stays, as after an `up` following each run."""
    objects = {**finished(A, 0.9), **finished(B, 0.7), **finished(C, 0.8)}
    assert _served(run_stack("dev", overrides=SERVING, bucket_objects=objects)) == B


def test_the_override_serves_the_worse_run() -> None:
    objects = {**finished(A, 0.80), **finished(B, 0.95)}
    assert _served(run_stack("dev", overrides={**SERVING, "servingRunId": B}, bucket_objects=objects)) == B


def test_serving_max_eval_loss_replaces_the_comparison() -> None:
    objects = {**finished(A, 0.40), **finished(B, 0.55)}
    run = run_stack("dev", overrides={**SERVING, "servingMaxEvalLoss": 0.5}, bucket_objects=objects)
    assert _served(run) == A
    assert any("above servingMaxEvalLoss=0.5" in w and f"servingRunId {B}" in w for w in run.warnings)
    better_than_a = {**finished(A, 0.40), **finished(B, 0.45)}
    assert (
        _served(run_stack("dev", overrides={**SERVING, "servingMaxEvalLoss": 0.5}, bucket_objects=better_than_a)) == B
    )
    with pytest.raises(pulumi.RunError, match=r"no finished run has a held-out loss at most servingMaxEvalLoss=0\.3"):
        run_stack("dev", overrides={**SERVING, "servingMaxEvalLoss": 0.3}, bucket_objects=objects)


def test_runs_without_a_score_are_not_gated() -> None:
    """No held-out rows (a summary without a loss): serving moves as before the gate (the newest)."""
    objects = {**finished(A, 0.5), **finished(B, None)}
    assert _served(run_stack("dev", overrides=SERVING, bucket_objects=objects)) == B


def test_a_run_without_its_summary_is_never_chosen_by_the_gate() -> None:
    """A run cut off between its export's marker and its summary (or made by an older trainer) slipped past the gate
    "without a comparison"; now only servingRunId serves it, and `pulumi up` says why it was skipped."""
    no_summary = {**finished(A, 0.5), **completed_run(B, summary=False)}
    run = run_stack("dev", overrides=SERVING, bucket_objects=no_summary)
    assert _served(run) == A
    (warning,) = [w for w in run.warnings if "has no run_summary.json" in w]
    assert f"newest finished run {B}" in warning and f"pulumi config set servingRunId {B}" in warning
    assert _served(run_stack("dev", overrides={**SERVING, "servingRunId": B}, bucket_objects=no_summary)) == B
    with pytest.raises(pulumi.RunError, match=rf"no finished run has its run_summary.json \({B}\).*servingRunId {B}"):
        run_stack("dev", overrides=SERVING, bucket_objects=completed_run(B, summary=False))


def test_the_gate_reads_the_trainers_summary_and_its_loss() -> None:
    from trainer.train import SUMMARY_FILE

    assert RUN_SUMMARY == SUMMARY_FILE
    assert (
        run_loss('{"eval_loss": 0.25}') == 0.25 and run_loss('{"eval_loss": null}') is None and run_loss(None) is None
    )
    assert gate([A], {A: RunEval(9.0)}, None).served == A


def test_the_gate_reads_the_runs_score_from_its_eval() -> None:
    """trainer/run_eval.py's shape, from a real run's summary keys: the score named by eval.score, after training."""
    from trainer.run_eval import BEFORE_PREFIX  # the trainer module that writes `eval` (imported: it exists)

    assert BEFORE_PREFIX
    text = json.dumps({"eval_loss": 0.5, "eval": {"score": "rouge_l_f1", "after": {"loss": 0.5, "rouge_l_f1": 0.25}}})
    assert run_eval(text) == RunEval(0.5, "rouge_l_f1", 0.25)
    assert run_eval('{"eval_loss": 0.5}') == RunEval(0.5) and run_eval("not json") == RunEval()
    assert run_eval('{"eval_loss": 0.5, "eval": null}') == RunEval(0.5)  # no held-out rows to answer


def test_a_lower_score_is_not_served_though_the_loss_is_lower() -> None:
    objects = {**finished(A, 0.80, score=0.60), **finished(B, 0.70, score=0.40)}
    run = run_stack("dev", overrides=SERVING, bucket_objects=objects)
    assert _served(run) == A and run.outputs["servingRunId"] == A
    (warning,) = [w for w in run.warnings if "serving keeps run" in w]
    assert f"serving keeps run {A} (held-out loss 0.8000, emoji_f1 0.6000)" in warning
    assert f"{B} has held-out loss 0.7000, emoji_f1 0.4000, worse: emoji_f1 lower" in warning
    assert f"pulumi config set servingRunId {B}" in warning


def test_a_higher_loss_is_not_served_though_the_score_is_higher() -> None:
    objects = {**finished(A, 0.80, score=0.40), **finished(B, 0.90, score=0.60)}
    run = run_stack("dev", overrides=SERVING, bucket_objects=objects)
    assert _served(run) == A
    assert any("worse: held-out loss higher" in w and f"servingRunId {B}" in w for w in run.warnings)


def test_a_run_not_worse_on_either_is_served() -> None:
    for loss, score in ((0.80, 0.60), (0.70, 0.70)):
        objects = {**finished(A, 0.80, score=0.60), **finished(B, loss, score=score)}
        run = run_stack("dev", overrides=SERVING, bucket_objects=objects)
        assert _served(run) == B, (loss, score)
        assert not [w for w in run.warnings if "serving keeps run" in w]


def test_a_run_without_a_score_is_compared_on_the_loss() -> None:
    """An older summary (eval_loss only) against a scored one: the loss decides, both ways."""
    assert (
        _served(run_stack("dev", overrides=SERVING, bucket_objects={**finished(A, 0.8), **finished(B, 0.7, 0.1)})) == B
    )
    assert (
        _served(run_stack("dev", overrides=SERVING, bucket_objects={**finished(A, 0.7, 0.9), **finished(B, 0.8)})) == A
    )


def test_serving_min_score_replaces_the_comparison() -> None:
    objects = {**finished(A, 0.80, score=0.60), **finished(B, 0.70, score=0.45)}
    bar = {**SERVING, "servingMinScore": "0.5"}  # Pulumi config values are strings (Pulumi.yaml: type string)
    run = run_stack("dev", overrides=bar, bucket_objects=objects)
    assert _served(run) == A
    assert any("below servingMinScore=0.5" in w and f"servingRunId {B}" in w for w in run.warnings)
    # a lower score than the served run's, but above the bar: served (the bar replaces the comparison)
    lower_but_passing = {**finished(A, 0.80, score=0.60), **finished(B, 0.70, score=0.55)}
    assert _served(run_stack("dev", overrides=bar, bucket_objects=lower_but_passing)) == B
    with pytest.raises(pulumi.RunError, match=r"no finished run has a score at least servingMinScore=0\.7: "):
        run_stack("dev", overrides={**SERVING, "servingMinScore": "0.7"}, bucket_objects=objects)
    both = {**SERVING, "servingMinScore": "0.5", "servingMaxEvalLoss": "0.75"}
    with pytest.raises(pulumi.RunError, match=r"servingMaxEvalLoss=0\.75 and a score at least servingMinScore=0\.5"):
        run_stack("dev", overrides=both, bucket_objects=objects)


def test_an_unscored_run_does_not_pass_serving_min_score() -> None:
    """A run from before runs scored themselves (no `eval`) cannot show the score the bar asks for: with newer
    scored runs below the bar it must not be served, the bar's error names it, and scored runs above it win."""
    old_unscored = {**finished(A, 1.20), **finished(B, 0.80, score=0.60), **finished(C, 0.70, score=0.65)}
    with pytest.raises(pulumi.RunError, match=rf"servingMinScore=0\.7: .*{A} .*Fix: "):
        run_stack("dev", overrides={**SERVING, "servingMinScore": "0.7"}, bucket_objects=old_unscored)
    assert _served(run_stack("dev", overrides={**SERVING, "servingMinScore": "0.6"}, bucket_objects=old_unscored)) == C


def test_the_override_serves_a_run_with_a_lower_score() -> None:
    objects = {**finished(A, 0.80, score=0.60), **finished(B, 0.70, score=0.40)}
    for extra in ({}, {"servingMinScore": "0.5"}):
        run = run_stack("dev", overrides={**SERVING, **extra, "servingRunId": B}, bucket_objects=objects)
        assert _served(run) == B and not [w for w in run.warnings if "serving keeps run" in w]


@pytest.mark.parametrize("value", ["1.5", "-0.1", "high"])
def test_serving_min_score_is_a_number_from_0_to_1(value: str) -> None:
    with pytest.raises(ConfigError, match=r"servingMinScore=.*Fix: pulumi config set servingMinScore"):
        validate({**CLOUD_RUN, "servingMinScore": value}, "dev", True)
    assert validate({**CLOUD_RUN, "servingMinScore": "0.5"}, "dev", True).serving_min_score == 0.5


SAME, OTHER = "1" * 64, "2" * 64


def test_runs_scored_on_different_held_out_rows_are_not_compared_and_up_says_so() -> None:
    """B is worse on paper, but scored on other rows than A: the gate cannot compare them; serving moves to the
    newer run, and `pulumi up` warns with both sha256s and the fix (one data.eval_path for both)."""
    objects = {**finished(A, 0.80, 0.6, rows=SAME), **finished(B, 0.95, 0.4, rows=OTHER)}
    run = run_stack("dev", overrides=SERVING, bucket_objects=objects)
    assert _served(run) == B
    (warning,) = [w for w in run.warnings if "different held-out rows" in w]
    assert f"runs {A} and {B} were scored on different held-out rows (sha256 {SAME[:12]} vs {OTHER[:12]})" in warning
    assert "the same data.eval_path" in warning and f"pulumi config set servingRunId {A}" in warning


def test_runs_scored_on_the_same_held_out_rows_are_compared() -> None:
    objects = {**finished(A, 0.80, 0.6, rows=SAME), **finished(B, 0.95, 0.4, rows=SAME)}
    run = run_stack("dev", overrides=SERVING, bucket_objects=objects)
    assert _served(run) == A and not [w for w in run.warnings if "different held-out rows" in w]
    # a run from before summaries named their rows compares as it always did
    assert gate([A, B], {A: RunEval(0.8, "emoji_f1", 0.6), B: RunEval(0.95, "emoji_f1", 0.4, OTHER)}, None).served == A


def test_the_gate_reads_the_held_out_rows_from_the_summary() -> None:
    text = finished(A, 0.8, 0.6, rows=SAME)[f"{BUCKET}/runs/emoji-gemma3-1b-{A}/{RUN_SUMMARY}"]
    assert run_eval(text).held_out == SAME
    assert (
        run_eval(json.dumps({"eval_loss": 0.8, "eval": {"score": "x", "held_out": "not a mapping"}})).held_out is None
    )


def test_a_run_on_other_held_out_rows_that_is_worse_than_its_own_base_model_is_not_served() -> None:
    """Why: runs scored on other rows cannot be compared with each other, and a seeded slice changes with any edit
    of the data, so a diverged run on new data would be served unchecked. Its own summary still compares it with
    the base model on its own rows (`eval.before`): a run worse than the untuned model keeps the served one."""
    diverged = finished(B, 3.5, 0.01, rows=OTHER)  # the base model's loss is 3.0 and its emoji_f1 0.05
    run = run_stack("dev", overrides=SERVING, bucket_objects={**finished(A, 0.80, 0.6, rows=SAME), **diverged})
    assert _served(run) == A
    (warning,) = [w for w in run.warnings if "serving keeps run" in w]
    assert f"{B} was scored on other held-out rows than {A} (sha256 {OTHER[:12]} vs {SAME[:12]})" in warning
    assert "worse than its base model on its own held-out rows: held-out loss higher, emoji_f1 lower" in warning
    assert f"pulumi config set servingRunId {B}" in warning
    # one worse on either number is held too; one better than its base on both moves serving (and says so)
    assert (
        gate([A, B], {A: RunEval(0.8, held_out=SAME), B: RunEval(0.9, held_out=OTHER, base_loss=0.7)}, None).served == A
    )
    moved = gate([A, B], {A: RunEval(0.8, held_out=SAME), B: RunEval(0.9, held_out=OTHER, base_loss=2.0)}, None)
    assert moved.served == B and moved.warning is not None and "different held-out rows" in moved.warning


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_run_whose_loss_is_not_a_number_is_never_served(bad: float) -> None:
    """Why: a diverged run's summary holds `"eval_loss": NaN` (json writes it, json reads it back), and every
    comparison with NaN is false, so it was 'not worse' and met servingMaxEvalLoss."""
    text = json.dumps({"eval_loss": bad})
    assert run_eval(text).loss is not None
    evals = {A: RunEval(0.8), B: run_eval(text)}
    assert gate([A, B], evals, None).served == A
    assert gate([A, B], evals, 1.0).served == A
    assert gate([B, A], {**evals}, None).served == A  # a finite run after a NaN one moves serving
