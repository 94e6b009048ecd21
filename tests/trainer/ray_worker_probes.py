"""Worker-side instruments for the interrupted-then-resumed Ray run (tests/trainer/test_ray_entry.py).

`InterruptedRun` is the train loop handed to TorchTrainer: it wraps `trainer.ray_entry.train_loop_per_worker`
and, on every worker, records every `ray.train.report` (rank, attempt, step, each file's SHA-256), the adapter
weights in memory when checkpoint N is saved and when training begins (after a restore), the global steps
each attempt ran, and every upload (`trainer.checkpoints.upload_dir`) and Ray checkpoint download
(`Checkpoint.to_directory`) with the worker's Ray node.

On the first attempt rank 0 is a slow writer of checkpoint N (its `optimizer.pt` stays half on disk for
`slow_write_s`) and the other ranks start their part only once that half is there, so a rank that copies
without waiting copies it half-written, every time (docs/distributed.md#ray-checkpoints-reported-once-complete). Once every rank
has reported checkpoint N it raises: FailureConfig restarts the group, which must resume from checkpoint N.

Everything is written under `record_dir` (workers are other processes); imported by the Ray workers
(PYTHONPATH is the repository), so it imports nothing from pytest.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

ATTEMPT_FILE = "attempt-{attempt}-rank-{rank}.json"
REPORT_FILE = "report-attempt-{attempt}-rank-{rank}-step-{step}.json"
SAVED_WEIGHTS = "saved-rank-{rank}-step-{step}.safetensors"
BEGIN_WEIGHTS = "begin-attempt-{attempt}-rank-{rank}.safetensors"
HALF_WRITTEN_FLAG = "rank-0-is-writing-step-{step}"
UPLOADS_FILE = "uploads-attempt-{attempt}-rank-{rank}.jsonl"  # trainer.checkpoints.upload_dir calls
DOWNLOADS_FILE = "downloads-attempt-{attempt}-rank-{rank}.jsonl"  # ray.train.Checkpoint.to_directory calls
NODE_FILE = "node-attempt-{attempt}-rank-{rank}.txt"  # the Ray node the worker ran on


class Interrupted(RuntimeError):
    """The test's interruption (Ray counts it as a worker failure)."""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _trainable_state(model: Any) -> dict[str, Any]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def _probe_callback(run: InterruptedRun, attempt: int, rank: int) -> Any:
    from safetensors.torch import save_file
    from transformers import TrainerCallback

    record = Path(run.record_dir)
    steps: list[int] = []

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
            save_file(_trainable_state(model), str(record / BEGIN_WEIGHTS.format(attempt=attempt, rank=rank)))
            self._write(state.global_step)

        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if attempt == 1 and state.global_step == run.interrupt_after_step:
                import torch.distributed as dist

                dist.barrier()  # every rank has handed checkpoint N to Ray before anyone fails
                raise Interrupted(f"interrupted after checkpoint-{run.interrupt_after_step}")

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            steps.append(state.global_step)
            self._write(None)

        def on_save(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
            if attempt == 1 and state.global_step == run.interrupt_after_step:
                path = record / SAVED_WEIGHTS.format(rank=rank, step=state.global_step)
                save_file(_trainable_state(model), str(path))

        def _write(self, start: int | None) -> None:
            path = record / ATTEMPT_FILE.format(attempt=attempt, rank=rank)
            data = json.loads(path.read_text()) if path.exists() else {}
            if start is not None:
                data["start_step"] = start
            data["steps"] = list(steps)
            path.write_text(json.dumps(data))

    return Probe()


class InterruptedRun:
    """A picklable train loop: the product's loop, observed, interrupted once after checkpoint N."""

    def __init__(self, record_dir: str, interrupt_after_step: int, slow_write_s: float) -> None:
        self.record_dir = record_dir
        self.interrupt_after_step = interrupt_after_step
        self.slow_write_s = slow_write_s

    def __call__(self, config: dict[str, Any]) -> None:
        import ray.train
        import transformers

        from trainer.ray_entry import train_loop_per_worker

        context = ray.train.get_context()
        rank = context.get_world_rank()
        attempt = 1 if ray.train.get_checkpoint() is None else 2
        original_report = ray.train.report
        original_save = transformers.Trainer._save_optimizer_and_scheduler
        original_rng = transformers.Trainer._save_rng_state
        run = self
        record = Path(self.record_dir)

        def recording_report(metrics: dict[str, Any], checkpoint: Any = None, **kwargs: Any) -> Any:
            files = {}
            if checkpoint is not None:
                root = Path(checkpoint.path)
                files = {p.relative_to(root).as_posix(): sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}
            step = int(metrics.get("step", -1))
            name = REPORT_FILE.format(attempt=attempt, rank=rank, step=step)
            (Path(run.record_dir) / name).write_text(json.dumps({"files": files}))
            return original_report(metrics, checkpoint=checkpoint, **kwargs)

        def slow_save(trainer: Any, output_dir: str) -> None:
            original_save(trainer, output_dir)
            step = trainer.state.global_step
            if attempt == 1 and step == run.interrupt_after_step and trainer.is_world_process_zero():
                optimizer = Path(output_dir) / "optimizer.pt"
                data = optimizer.read_bytes()
                with open(optimizer, "wb") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                    (record / HALF_WRITTEN_FLAG.format(step=step)).touch()
                    time.sleep(run.slow_write_s)
                    f.write(data[len(data) // 2 :])

        def rng_after_rank_0_started(trainer: Any, output_dir: str) -> None:
            step = trainer.state.global_step
            if attempt == 1 and step == run.interrupt_after_step and not trainer.is_world_process_zero():
                deadline = time.monotonic() + 300
                while not (record / HALF_WRITTEN_FLAG.format(step=step)).exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            original_rng(trainer, output_dir)

        def _append(name: str, entry: dict[str, Any]) -> None:
            with open(record / name.format(attempt=attempt, rank=rank), "a") as f:
                f.write(json.dumps(entry) + "\n")

        import ray

        import trainer.checkpoints as checkpoints

        original_upload = checkpoints.upload_dir
        original_to_directory = ray.train.Checkpoint.to_directory
        (record / NODE_FILE.format(attempt=attempt, rank=rank)).write_text(ray.get_runtime_context().get_node_id())

        def recording_upload(local: Path, url: str, marker: str | None = None) -> None:
            _append(UPLOADS_FILE, {"local": str(local), "url": url})
            original_upload(local, url, marker=marker)

        def recording_to_directory(checkpoint: Any, path: str | None = None) -> str:
            _append(DOWNLOADS_FILE, {"checkpoint": str(checkpoint.path), "to": path})
            return original_to_directory(checkpoint, path)

        checkpoints.upload_dir = recording_upload
        ray.train.Checkpoint.to_directory = recording_to_directory  # type: ignore[method-assign]
        ray.train.report = recording_report
        transformers.Trainer._save_optimizer_and_scheduler = slow_save  # type: ignore[method-assign]
        transformers.Trainer._save_rng_state = rng_after_rank_0_started  # type: ignore[method-assign]
        try:
            train_loop_per_worker(config, extra_callbacks=[_probe_callback(self, attempt, rank)])
        finally:
            checkpoints.upload_dir = original_upload
            ray.train.Checkpoint.to_directory = original_to_directory  # type: ignore[method-assign]
            ray.train.report = original_report
            transformers.Trainer._save_optimizer_and_scheduler = original_save  # type: ignore[method-assign]
            transformers.Trainer._save_rng_state = original_rng  # type: ignore[method-assign]


PREEMPT_STEPS_FILE = "preempt-attempt-{attempt}-rank-{rank}.json"


class SlowStepsRun:
    """A picklable train loop: the product's loop with each step `step_delay_s` longer, its steps recorded.

    For the preemption test: the first attempt's steps are slow so that the pod's preStop notice lands mid-run;
    the restarted attempt's steps race nothing, so they run at full speed.
    """

    def __init__(self, record_dir: str, step_delay_s: float) -> None:
        self.record_dir = record_dir
        self.step_delay_s = step_delay_s

    def __call__(self, config: dict[str, Any]) -> None:
        import ray.train
        from transformers import TrainerCallback

        from trainer.ray_entry import train_loop_per_worker

        rank = ray.train.get_context().get_world_rank()
        attempt = 1 if ray.train.get_checkpoint() is None else 2
        path = Path(self.record_dir) / PREEMPT_STEPS_FILE.format(attempt=attempt, rank=rank)
        delay = self.step_delay_s if attempt == 1 else 0.0
        record: dict[str, Any] = {"start_step": None, "steps": []}

        class Slow(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
                record["start_step"] = state.global_step
                path.write_text(json.dumps(record))

            def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
                if delay:
                    time.sleep(delay)
                record["steps"].append(state.global_step)
                path.write_text(json.dumps(record))

        train_loop_per_worker(config, extra_callbacks=[Slow()])
