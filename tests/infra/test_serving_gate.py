"""The serving gate on `dev` (infra/serving_gate.py): serving moves to a newly finished run only when its held-out
loss is not worse than the served run's (or at most `servingMaxEvalLoss`); else `pulumi up` keeps the served run
and warns with the override. The real program under the project's mocks, with runs in the mocked bucket."""

from __future__ import annotations

import json

import pulumi
import pytest

from infra.offline.engine import run_stack
from infra.serving_gate import RUN_SUMMARY, gate, run_loss
from tests.infra.test_cloud_run import BUCKET, SERVING, completed_run, served_path

A, B, C = "a" * 12, "b" * 12, "c" * 12


def finished(rid: str, eval_loss: float | None) -> dict[str, str]:
    """A finished run of the dev recipe: its summary (published before the export) and its export."""
    summary = {"recipe": "emoji-gemma3-1b", "steps": 10, "eval_loss": eval_loss}
    return {f"{BUCKET}/runs/emoji-gemma3-1b-{rid}/{RUN_SUMMARY}": json.dumps(summary), **completed_run(rid)}


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
    """No held-out rows, or a run without a listed summary: serving moves as before the gate (the newest)."""
    objects = {**finished(A, 0.5), **finished(B, None)}
    assert _served(run_stack("dev", overrides=SERVING, bucket_objects=objects)) == B
    no_summary = {**finished(A, 0.5), **completed_run(B)}
    assert _served(run_stack("dev", overrides=SERVING, bucket_objects=no_summary)) == B


def test_the_gate_reads_the_trainers_summary_and_its_loss() -> None:
    from trainer.train import SUMMARY_FILE

    assert RUN_SUMMARY == SUMMARY_FILE
    assert (
        run_loss('{"eval_loss": 0.25}') == 0.25 and run_loss('{"eval_loss": null}') is None and run_loss(None) is None
    )
    assert gate([A], {A: 9.0}, None).served == A
