"""The serving gate (`dev`): the vLLM Service moves to a newly finished run only when it is not worse.

Decisions
- The score is the run's held-out loss: `eval_loss` in the run's `run_summary.json` (trainer/train.py
  `run_summary`: the trainer evaluates the held-out rows after training, for every format). Lower is better.
  The run summary is published before the merged model and its completion marker (trainer/train.py
  `_publish`), so a run whose marker is listed has its summary in the bucket.
- No state is read: the served run is replayed from the bucket. Walking the finished runs oldest first, the
  served run moves to the next one when that one's loss is not higher than the served run's; this is what a
  `pulumi up` after each finished run would have served, from any checkout and after a lost state.
- `servingMaxEvalLoss`, when set, replaces the comparison: the newest finished run whose loss is at most that
  value is served, and none at all is an error with the fix.
- A run without a score (no held-out rows: `data.eval_rows: 0`) is not gated: serving moves to it, as before
  the gate, and the log says so; `servingRunId` always wins.
- When the newest finished run is not the one served, `pulumi up` warns with both losses and the override
  (`pulumi config set servingRunId RUN`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

RUN_SUMMARY = "run_summary.json"  # trainer/train.py SUMMARY_FILE (tests/infra/test_serving_gate.py checks it)
SCORE_KEY = "eval_loss"


def run_loss(summary_text: str | None) -> float | None:
    """The held-out loss in a run summary's text, or None (no summary, no held-out rows, not a number)."""
    try:
        value = json.loads(summary_text or "null")
    except ValueError:
        return None
    loss = value.get(SCORE_KEY) if isinstance(value, dict) else None
    return float(loss) if isinstance(loss, int | float) and not isinstance(loss, bool) else None


def _shown(loss: float | None) -> str:
    return "no held-out loss" if loss is None else f"held-out loss {loss:.4f}"


@dataclass(frozen=True)
class GateDecision:
    served: str
    warning: str | None = None
    note: str | None = None


def gate(finished: list[str], losses: dict[str, float | None], max_loss: float | None) -> GateDecision:
    """The run to serve among `finished` (oldest first, at least one) and what `pulumi up` says about it."""
    newest = finished[-1]
    override = f"To serve it anyway: pulumi config set servingRunId {newest}"
    if max_loss is not None:
        passing = [r for r in finished if losses.get(r) is None or float(losses[r] or 0) <= max_loss]
        if not passing:
            raise ValueError(
                f"no finished run has a held-out loss at most servingMaxEvalLoss={max_loss}: "
                + ", ".join(f"{r} {_shown(losses.get(r))}" for r in reversed(finished))
                + f". Fix: pulumi config set servingMaxEvalLoss VALUE, or pulumi config set servingRunId {newest}"
            )
        served = passing[-1]
        if served == newest:
            return GateDecision(served)
        return GateDecision(
            served,
            f"serving keeps run {served} ({_shown(losses.get(served))}): the newest finished run {newest} has "
            f"{_shown(losses.get(newest))}, above servingMaxEvalLoss={max_loss}. {override}",
        )
    served, note = finished[0], None
    for rid in finished[1:]:
        new, old = losses.get(rid), losses.get(served)
        if new is None or old is None:
            note = f"run {rid} moved serving without a comparison ({_shown(new)}; served run {served}: {_shown(old)})"
            served = rid
        elif new <= old:
            served = rid
    if served == newest:
        return GateDecision(served, note=note)
    return GateDecision(
        served,
        f"serving keeps run {served} ({_shown(losses.get(served))}): the newest finished run {newest} has "
        f"{_shown(losses.get(newest))}, worse. {override}",
    )
