"""One JSON line per logging step on the container's stdout: what the stack's log-based metrics read.

    {"severity":"INFO","message":"step 20/400 loss 1.2345","gft_event":"train","run":"emoji-gemma3-1b-…","step":20,…}

GKE's and Cloud Run's agents parse a single-line JSON object on stdout into the entry's `jsonPayload`;
infra/monitoring.py declares one metric per field below (meaning and sources: docs/operations.md, "Watching a run").
Decisions
- `train` at each logging step (loss, step, epoch, tokens/s since the previous line, cost so far), `eval` at each
  evaluation, `heartbeat` every HEARTBEAT_S from the process's start to train end (seconds since the last step, or
  before training since the current start-up phase began): the alerts read it; a finished run no longer writes it.
- The heartbeat is a thread: a rank blocked in a collective or a data loader waits with the GIL released.
- World rank 0 only: one line is one observation of the whole run. Cost = the stack's price file x wall time.
- A Ray worker's stdout is a file of Ray's: in a pod the Ray entry sends the lines to the container's own stdout.
Not here: the metrics, dashboard and alerts (infra/monitoring.py); TensorBoard (trainer/train.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from trainer.cost_line import cost_line, read_price

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from trainer.recipe import Recipe

log = logging.getLogger(__name__)

# The jsonPayload fields the log-based metrics read (infra/monitoring.py imports these names).
EVENT = "gft_event"
RUN = "run"
TRAIN_EVENT, EVAL_EVENT, HEARTBEAT_EVENT = "train", "eval", "heartbeat"
STEP, MAX_STEPS, EPOCH, LOSS = "step", "max_steps", "epoch", "loss"
TOKENS_PER_SECOND, COST_USD = "tokens_per_second", "cost_usd"
EVAL_LOSS, BASE_EVAL_LOSS = "eval_loss", "eval_before_loss"  # trainer/run_eval.py BEFORE_PREFIX: the base model
SINCE_STEP_S, ELAPSED_S = "since_step_s", "elapsed_s"
HEARTBEAT_S = 60.0
# A Kubernetes container's stdout, as its first process holds it: what the kubelet collects and GKE's agent reads.
CONTAINER_STDOUT = "/proc/1/fd/1"
# Set in every container of a pod (Kubernetes docs, "Container environment": service environment variables).
_IN_A_POD = "KUBERNETES_SERVICE_HOST"
_IMPORTED_AT = time.time()
_stream_path: str | None = None
_stream_lock = threading.Lock()


def send_to_container_stdout() -> str | None:
    """In a Kubernetes pod, write the lines to the container's stdout rather than this process's (a Ray worker's
    goes to a file of Ray's); elsewhere (a laptop, a local Ray cluster) change nothing. Returns the path used."""
    global _stream_path
    if os.environ.get(_IN_A_POD) and _writable(CONTAINER_STDOUT):
        _stream_path = CONTAINER_STDOUT
    return _stream_path


def _writable(path: str) -> bool:
    """Whether this process may open `path` to write. /proc/1/fd/1 of a first process owned by another user (a
    shared process namespace, an image whose init runs as root) refuses even a stat: EACCES, which
    `Path.exists()` raises instead of answering False, and the worker would die of it."""
    try:
        return os.access(path, os.W_OK)
    except (OSError, ValueError):
        return False


def _write(line: str) -> None:
    """One whole line per call, under a lock: the heartbeat thread and the training loop never interleave."""
    with _stream_lock:
        if _stream_path is not None:
            try:
                with open(_stream_path, "a", encoding="utf-8") as stream:
                    stream.write(line + "\n")
                return
            except OSError as error:  # no access to the container's stdout: this process's is better than none
                log.warning("cannot write metric lines to %s (%s): writing them to stdout", _stream_path, error)
        out: IO[str] = sys.stdout
        out.write(line + "\n")
        out.flush()


def process_started_at() -> float:
    """When this process started (its cost runs from there: model download and loading included)."""
    try:
        import psutil  # accelerate's dependency

        return float(psutil.Process().create_time())
    except Exception:  # a missing or failing psutil costs the model-loading minutes, not the run
        return _IMPORTED_AT


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def run_name(output_dir: str) -> str:
    """The run's folder name (`runs/<recipe>-<run id>` on a stack): the `run` label of every metric."""
    return Path(str(output_dir).rstrip("/")).name or str(output_dir)


class MetricLines:
    """The lines of one run, built from what the Trainer reports; `clock` and `write` are injectable for tests."""

    def __init__(self, output_dir: str, started_at: float, clock: Any = time.time, write: Any = _write) -> None:
        self.output_dir = output_dir
        self.run = run_name(output_dir)
        self.started_at = started_at
        self.clock = clock
        self.write = write
        self.price: dict[str, Any] | None = None
        self.step = 0
        self.max_steps: int | None = None
        self.last_step_at = started_at
        self._tokens: tuple[float, int] | None = None  # (time, tokens seen) at the previous train line
        self.phase: str | None = None  # a start-up phase (StartupHeartbeat), None once training runs

    def load_price(self) -> None:
        try:
            self.price = read_price(self.output_dir)
        except (OSError, ValueError) as error:  # as trainer/cost_line.py run_cost_line: the run goes on without it
            log.warning("no cost in the metric lines: cannot read the price file in %s (%s)", self.output_dir, error)

    def _emit(self, event: str, message: str, fields: Mapping[str, Any]) -> None:
        now = self.clock()
        elapsed = now - self.started_at
        line: dict[str, Any] = {"severity": "INFO", "message": message, EVENT: event, RUN: self.run}
        line.update({key: value for key, value in fields.items() if value is not None})
        line[ELAPSED_S] = round(elapsed, 1)
        if self.price:
            line[COST_USD] = cost_line(self.price, elapsed)["estimated_usd"]
        self.write(json.dumps(line, separators=(",", ":")))

    def stepped(self, step: int) -> None:
        self.step = step
        self.last_step_at = self.clock()

    def train(self, logs: Mapping[str, Any], step: int, epoch: float | None) -> None:
        now = self.clock()
        tokens = _number(logs.get("num_input_tokens_seen"))
        rate = _number(logs.get("train_tokens_per_second"))  # transformers' average since this session began
        if tokens is not None and self._tokens is not None and now > self._tokens[0]:
            rate = round((tokens - self._tokens[1]) / (now - self._tokens[0]), 2)
        if tokens is not None:
            self._tokens = (now, int(tokens))
        loss = _number(logs.get(LOSS))
        of = f"/{self.max_steps}" if self.max_steps else ""
        shown = f" loss {loss:.4f}" if loss is not None else ""
        fields = {
            STEP: step,
            MAX_STEPS: self.max_steps,
            EPOCH: _number(epoch),
            LOSS: loss,
            "learning_rate": _number(logs.get("learning_rate")),
            "grad_norm": _number(logs.get("grad_norm")),
            "tokens_seen": tokens,
            TOKENS_PER_SECOND: rate,
        }
        self._emit(TRAIN_EVENT, f"step {step}{of}{shown}", fields)

    def evaluated(self, metrics: Mapping[str, Any], step: int) -> None:
        losses = {key: _number(value) for key, value in metrics.items() if key.startswith("eval_")}
        shown = ", ".join(f"{key} {value:.4f}" for key, value in losses.items() if key.endswith("_loss") and value)
        self._emit(EVAL_EVENT, f"evaluation at step {step}: {shown}", {STEP: step, **losses})

    def heartbeat(self) -> None:
        since = max(0.0, self.clock() - self.last_step_at)
        message = (
            f"starting: {self.phase}, {since:.0f} s in it"
            if self.phase
            else f"step {self.step}, {since:.0f} s since the last step"
        )
        self._emit(HEARTBEAT_EVENT, message, {STEP: self.step, SINCE_STEP_S: round(since, 1)})


class _Heartbeat(threading.Thread):
    """Calls `lines.heartbeat()` every `interval` s until stopped, or until the callback that owns it is gone
    (a run that raised never reaches on_train_end: its trainer's collection stops the thread)."""

    def __init__(self, owner: Any, interval: float) -> None:
        super().__init__(name="gft-metrics-heartbeat", daemon=True)
        self._owner = weakref.ref(owner)
        self.interval = interval
        self.stopped = threading.Event()

    def run(self) -> None:
        while True:
            owner = self._owner()
            if owner is None or self.stopped.is_set():
                return
            owner.lines.heartbeat()
            del owner
            if self.stopped.wait(self.interval):
                return


def is_world_rank_zero() -> bool:
    """Before torch.distributed exists: the launcher's RANK (torchrun, accelerate launch), none for one process."""
    return os.environ.get("RANK", "0") == "0"


class StartupHeartbeat:
    """The heartbeat from the process's start to `on_train_begin` (world rank 0): staging and loading the weights,
    the rendezvous of the ranks. Each phase that begins is progress, so a stall alert names a stuck start-up (a
    rank that never joins, a download that hangs) as it names a stuck step, instead of burning GPUs silently."""

    def __init__(self, recipe: Recipe, interval: float | None = None, enabled: bool | None = None) -> None:
        self.lines = MetricLines(recipe.output.dir, process_started_at())
        self.phase = self.lines.phase = "start"
        self.interval = HEARTBEAT_S if interval is None else interval
        self._thread: _Heartbeat | None = None
        if is_world_rank_zero() if enabled is None else enabled:
            self.lines.load_price()
            self._thread = _Heartbeat(self, self.interval)
            self._thread.start()

    def progress(self, phase: str) -> None:
        """A start-up phase begins (trainer/train.py `Phases`)."""
        self.phase = self.lines.phase = phase
        self.lines.stepped(0)

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.stopped.set()
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=5)
            self._thread = None


def metrics_log_callback(recipe: Recipe, interval: float | None = None) -> TrainerCallback:
    """The TrainerCallback that writes the run's metric lines (world rank 0 only; see the module docstring)."""
    from transformers import TrainerCallback

    beat_every = HEARTBEAT_S if interval is None else interval

    class MetricLinesCallback(TrainerCallback):
        def __init__(self) -> None:
            self.lines = MetricLines(recipe.output.dir, process_started_at())
            self.heartbeat: _Heartbeat | None = None

        def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.is_world_process_zero:
                self.lines.load_price()
                self.lines.max_steps = state.max_steps or None
                self.lines.stepped(state.global_step)
                self.heartbeat = _Heartbeat(self, beat_every)
                self.heartbeat.start()
            return control

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.is_world_process_zero:
                self.lines.stepped(state.global_step)
            return control

        def on_prediction_step(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.is_world_process_zero:  # an evaluation's batches are progress too
                self.lines.stepped(state.global_step)
            return control

        def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            if state.is_world_process_zero and logs and LOSS in logs:
                self.lines.train(logs, state.global_step, state.epoch)
            return control

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):  # type: ignore[no-untyped-def]
            if state.is_world_process_zero and metrics:
                self.lines.stepped(state.global_step)
                self.lines.evaluated(metrics, state.global_step)
            return control

        def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.stop()
            return control

        def stop(self) -> None:
            if self.heartbeat is not None:
                self.heartbeat.stopped.set()
                if self.heartbeat is not threading.current_thread():
                    self.heartbeat.join(timeout=5)
                self.heartbeat = None

    return MetricLinesCallback()
