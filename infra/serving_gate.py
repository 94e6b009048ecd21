"""The serving gate (every stack): the vLLM Service moves to a newly finished run only when it is not worse.

Decisions (sources and the publication order they rely on: docs/cloud-run.md#the-serving-gate)
- A run's evaluation is its `run_summary.json`: the held-out loss `eval_loss` (lower is better) and, where the run
  answered held-out rows, its score `eval.after[eval.score]` (higher is better; trainer/run_eval.py).
- No state is read: walking the finished runs oldest first, the served run moves to the next one when its loss is not
  higher and, with the same score metric, its score not lower (what an `up` after each run would have served).
- `servingMaxEvalLoss` / `servingMinScore` replace the comparison (the newest run meeting both; none is an error with
  the fix). A run without a loss is not gated; one without a score is judged on its loss and never meets
  `servingMinScore`. `servingRunId` always wins, and alone serves a run without its summary (`publish_run`).
- Only runs scored on the same held-out rows (`eval.held_out.sha256`) are compared; a run on other rows must not be
  worse than its own base model on them (`eval.before`). A loss or score that is not finite (`NaN`) is worse than any.
- When the newest finished run is not the one served, `pulumi up` warns with both runs' numbers, what was worse,
  and the override (`pulumi config set servingRunId RUN`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

RUN_SUMMARY = "run_summary.json"  # trainer/train.py SUMMARY_FILE (tests/infra/test_serving_gate.py checks it)
SCORE_KEY = "eval_loss"
EVAL_KEY = "eval"  # trainer/run_eval.py: {"score": NAME, "after": {NAME: value, ...}, ...}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _summary(summary_text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(summary_text or "null")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def run_loss(summary_text: str | None) -> float | None:
    """The held-out loss in a run summary's text, or None (no summary, no held-out rows, not a number)."""
    return _number(_summary(summary_text).get(SCORE_KEY))


@dataclass(frozen=True)
class RunEval:
    """What the gate knows of a finished run: its held-out loss and its score (name, value), each maybe missing."""

    loss: float | None = None
    score_name: str | None = None
    score: float | None = None
    held_out: str | None = None  # sha256 of the held-out rows it was scored on
    base_loss: float | None = None  # the base model's on the same rows (`eval.before`)
    base_score: float | None = None

    def shown(self) -> str:
        loss = "no held-out loss" if self.loss is None else f"held-out loss {self.loss:.4f}"
        return loss if self.score is None else f"{loss}, {self.score_name} {self.score:.4f}"

    def other_rows(self, other: RunEval) -> bool:
        """Scored on other held-out rows than `other` (both summaries name theirs, and they differ)."""
        return None not in (self.held_out, other.held_out) and self.held_out != other.held_out


def run_eval(summary_text: str | None) -> RunEval:
    """The held-out loss and the score of a run summary's text (trainer/run_eval.py's `eval`)."""
    summary = _summary(summary_text)
    evaluation = summary.get(EVAL_KEY)
    name, score, rows, base_loss, base_score = None, None, None, None, None
    if isinstance(evaluation, dict) and isinstance(evaluation.get("score"), str):
        after = evaluation.get("after")
        score = _number(after.get(evaluation["score"])) if isinstance(after, dict) else None
        name = evaluation["score"] if score is not None else None
    if isinstance(evaluation, dict) and isinstance(evaluation.get("held_out"), dict):
        rows = evaluation["held_out"].get("sha256")
    before = evaluation.get("before") if isinstance(evaluation, dict) else None
    if isinstance(before, dict):
        base_loss = _number(before.get("loss"))
        base_score = _number(before.get(name)) if name is not None else None
    return RunEval(
        _number(summary.get(SCORE_KEY)), name, score, rows if isinstance(rows, str) else None, base_loss, base_score
    )


def _higher(value: float, than: float) -> bool:
    """`value > than`, with a value that is not a finite number (NaN, inf) higher than any number."""
    return not math.isfinite(value) or (math.isfinite(than) and value > than)


def _lower(value: float, than: float) -> bool:
    """`value < than`, with a value that is not a finite number lower than any number."""
    return not math.isfinite(value) or (math.isfinite(than) and value < than)


@dataclass(frozen=True)
class GateDecision:
    served: str
    warning: str | None = None
    note: str | None = None


def _worse(new: RunEval, old: RunEval) -> tuple[bool, list[str]]:
    """(comparable, what is worse) of `new` against `old`: the loss when both have one, the score when both have
    the same one; nothing when they were scored on different held-out rows."""
    comparable, worse = False, []
    if new.other_rows(old):
        return False, []
    if new.loss is not None and old.loss is not None:
        comparable = True
        if _higher(new.loss, old.loss):
            worse.append("held-out loss higher")
    if new.score is not None and old.score is not None and new.score_name == old.score_name:
        comparable = True
        if _lower(new.score, old.score):
            worse.append(f"{new.score_name} lower")
    return comparable, worse


def _worse_than_base(run: RunEval) -> list[str]:
    """What is worse in `run` than in its own base model on the same rows (`eval.before`): the one comparison left
    for a run scored on other held-out rows than the served one."""
    base = RunEval(run.base_loss, run.score_name if run.base_score is not None else None, run.base_score)
    return _worse(run, base)[1]


def _bars(max_loss: float | None, min_score: float | None) -> str:
    parts = [f"a held-out loss at most servingMaxEvalLoss={max_loss}"] if max_loss is not None else []
    parts += [f"a score at least servingMinScore={min_score}"] if min_score is not None else []
    return " and ".join(parts)


def _misses(run: RunEval, max_loss: float | None, min_score: float | None) -> list[str]:
    """The bars `run` misses. A run without a loss is not gated on servingMaxEvalLoss; a run without a score (one
    trained before runs scored themselves, or with evaluation.generate_rows 0) misses servingMinScore: it cannot
    show the score the bar asks for, and an old unscored run must not win over newer scored ones."""
    misses = []
    if max_loss is not None and run.loss is not None and _higher(run.loss, max_loss):
        misses.append(f"above servingMaxEvalLoss={max_loss}")
    if min_score is not None and run.score is None:
        misses.append(f"no score for servingMinScore={min_score}")
    elif min_score is not None and run.score is not None and _lower(run.score, min_score):
        misses.append(f"below servingMinScore={min_score}")
    return misses


def gate(
    finished: list[str], evals: dict[str, RunEval], max_loss: float | None, min_score: float | None = None
) -> GateDecision:
    """The run to serve among `finished` (oldest first, at least one) and what `pulumi up` says about it.

    `evals` holds the runs whose summary was read; a finished run missing from it is not a candidate."""
    newest = finished[-1]
    override = f"To serve it anyway: pulumi config set servingRunId {newest}"
    unscored = [r for r in finished if r not in evals]
    finished = [r for r in finished if r in evals]
    if not finished:
        raise ValueError(
            f"no finished run has its {RUN_SUMMARY} ({', '.join(reversed(unscored))}): the trainer writes it before "
            "any completion marker, so these runs were cut off at their end or made by an older trainer, and the "
            f"gate serves no run it cannot score. Fix: pulumi config set servingRunId {newest} (served unscored), "
            "or train again"
        )
    decision = _gate(finished, evals, max_loss, min_score)
    if newest in unscored:
        skipped = (
            f"the newest finished run {newest} has no {RUN_SUMMARY} (cut off after its export, or an older trainer): "
            f"not served. {override}"
        )
        return GateDecision(
            decision.served, f"{decision.warning} {skipped}" if decision.warning else skipped, decision.note
        )
    return decision


def _gate(
    finished: list[str], evals: dict[str, RunEval], max_loss: float | None, min_score: float | None
) -> GateDecision:
    """`gate` over runs that all have a summary."""
    newest = finished[-1]
    override = f"To serve it anyway: pulumi config set servingRunId {newest}"

    def of(rid: str) -> RunEval:
        return evals.get(rid) or RunEval()

    if max_loss is not None or min_score is not None:
        passing = [r for r in finished if not _misses(of(r), max_loss, min_score)]
        if not passing:
            setting = "servingMaxEvalLoss" if max_loss is not None else "servingMinScore"
            raise ValueError(
                f"no finished run has {_bars(max_loss, min_score)}: "
                + ", ".join(f"{r} {of(r).shown()}" for r in reversed(finished))
                + f". Fix: pulumi config set {setting} VALUE, or pulumi config set servingRunId {newest}"
            )
        served, note = passing[-1], None
        if served == newest:
            return GateDecision(served, note=note)
        return GateDecision(
            served,
            f"serving keeps run {served} ({of(served).shown()}): the newest finished run {newest} has "
            f"{of(newest).shown()}, {' and '.join(_misses(of(newest), max_loss, min_score))}. {override}",
            note,
        )
    served, note, why, rows_differ = finished[0], None, "", None
    for rid in finished[1:]:
        new, old = of(rid), of(served)
        if new.other_rows(old):
            # no comparison between the two: the run is checked against its own base model on its own rows
            rows = (
                f"{rid} was scored on other held-out rows than {served} (sha256 {(new.held_out or '')[:12]} vs "
                f"{(old.held_out or '')[:12]}), so the gate cannot compare them"
            )
            fix = "the same data.eval_path in both recipes keeps runs comparable"
            base_worse = _worse_than_base(new)
            if base_worse:
                why = f"{rows}, and it is worse than its base model on its own held-out rows: {', '.join(base_worse)}"
                continue
            if rid == newest:
                rows_differ = (
                    f"runs {served} and {rid} were scored on different held-out rows (sha256 {(old.held_out or '')[:12]} "
                    f"vs {(new.held_out or '')[:12]}), so the gate could not compare them; {rid} is not worse than its "
                    f"base model on its rows, and serving moved to it ({new.shown()}; {served}: {old.shown()}). "
                    f"Fix: {fix}; to serve {served}: pulumi config set servingRunId {served}"
                )
            served = rid
            continue
        comparable, worse = _worse(new, old)
        if not comparable:
            note = f"run {rid} moved serving without a comparison ({new.shown()}; served run {served}: {old.shown()})"
            served = rid
        elif not worse:
            served = rid
        else:
            why = f"worse: {' and '.join(worse)}"
    if served == newest:
        return GateDecision(served, warning=rows_differ, note=None if rows_differ else note)
    return GateDecision(
        served,
        f"serving keeps run {served} ({of(served).shown()}): the newest finished run {newest} has "
        f"{of(newest).shown()}, {why}. {override}",
    )
