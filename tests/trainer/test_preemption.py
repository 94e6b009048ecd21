"""A SIGTERM to a 2-rank W1 run (through the real launcher) saves the step it had; the restart resumes at that step.

Why it matters: a Spot or flex-start preemption (or a node drain) gives the pod SIGTERM and a grace period;
without a handler every rank died at once and the retry lost up to `save_steps` updates. Kubernetes signals
the container's main process: here that is the launcher's process (`trainer.launch` execs `accelerate launch`,
whose torchrun agent passes the signal to the ranks). The run is the W1 recipe on a tiny Gemma 4, 2 processes
over gloo (`--cpu`), output to a `file://` bucket, `save_steps` beyond the run so that only the SIGTERM saves.
A sitecustomize module makes each optimizer step take 0.3 s longer and records the steps reached, so the
signal lands mid-run. The first launch must exit 143 after marking the checkpoint of the step in progress
(not finishing the run); the second launch, from an empty staging folder, resumes from that step and finishes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.trainer.inject import AFTER_IMPORT, launch_argv, launch_env, w1_overrides
from tests.trainer.test_multirank_resume import marked_checkpoints
from trainer.checkpoints import RUN_MARKER

REPO = Path(__file__).resolve().parents[2]
NPROC = 2
# beyond the step the signal is asserted to save (SIGNAL_AT_STEP + 2) by 7 steps of >= 0.3 s: the poll that sends
# it runs every 0.05 s. The restart trains the rest, so every step past that margin only costs time.
MAX_STEPS = 12
SAVE_STEPS = 1000  # no scheduled checkpoint: only the SIGTERM saves
SIGNAL_AT_STEP = 3

SLOW_STEPS = (
    AFTER_IMPORT
    + """
import os

if "LOCAL_RANK" in os.environ and os.environ.get("STEP_LOG"):
    import time

    def _slow(module):
        on_step_end = module.DefaultFlowCallback.on_step_end

        def slow_step_end(self, args, state, control, **kwargs):
            time.sleep(0.3)
            with open(os.environ["STEP_LOG"], "a") as out:
                out.write(f"{os.environ['RANK']} {state.global_step}\\n")
            return on_step_end(self, args, state, control, **kwargs)

        module.DefaultFlowCallback.on_step_end = slow_step_end

    _after_import("transformers.trainer_callback", _slow)
"""
)


def command(model_dir: Path, url: str, tmp_path: Path, name: str) -> list[str]:
    overrides = w1_overrides(model_dir, url, NPROC, MAX_STEPS, SAVE_STEPS)
    return launch_argv("text-to-sql-gemma4-31b", NPROC, tmp_path / f"accelerate-{name}.yaml", overrides)


def environment(tmp_path: Path, staging: Path, step_log: Path | None) -> dict[str, str]:
    return launch_env(
        tmp_path,
        SLOW_STEPS,
        GEMMA_FT_STAGING=str(staging),
        STEP_LOG=None if step_log is None else str(step_log),
        TORCH_ELASTIC_SHUTDOWN_TIMEOUT=None,  # the launcher's own setting
    )


def steps_reached(step_log: Path) -> int:
    """The step every rank has finished (the minimum over the ranks' latest)."""
    latest: dict[str, int] = {}
    if step_log.exists():
        for line in step_log.read_text().splitlines():
            rank, step = line.split()
            latest[rank] = max(latest.get(rank, 0), int(step))
    return min(latest.values()) if len(latest) == NPROC else 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_saves_the_step_it_had_and_the_restart_resumes_there(tiny_gemma4_dir: Path, tmp_path: Path) -> None:
    remote = tmp_path / "bucket" / "run"
    url = f"file://{remote}"
    step_log = tmp_path / "steps.log"
    first_log = tmp_path / "first.log"

    # 1. SIGTERM to the launcher's process (the container's main process) once every rank passed step 3
    with first_log.open("w") as out:
        proc = subprocess.Popen(
            command(tiny_gemma4_dir, url, tmp_path, "first"),
            cwd=REPO,
            env=environment(tmp_path, tmp_path / "node-1", step_log),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 420
        while steps_reached(step_log) < SIGNAL_AT_STEP:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(
                    f"the run did not reach step {SIGNAL_AT_STEP} (rc {proc.poll()}):\n{first_log.read_text()[-6000:]}"
                )
            time.sleep(0.05)
        signalled_at = steps_reached(step_log)
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    log = first_log.read_text()
    assert rc != 0, log[-4000:]
    assert "preempted: stopped by SIGTERM after saving checkpoint-" in log, log[-6000:]
    assert not (remote / RUN_MARKER).exists(), "the preempted run must not look finished"

    # the checkpoint of the step in progress when the signal came, marked (complete) in the bucket
    marked = marked_checkpoints(remote)
    assert len(marked) == 1, sorted(marked)
    (saved,) = marked
    assert signalled_at <= saved <= signalled_at + 2 < MAX_STEPS, (signalled_at, saved)
    files = {p.name for p in marked[saved].iterdir()}
    assert {"adapter_model.safetensors", "optimizer.pt", "trainer_state.json"} <= files
    assert {f"rng_state_{rank}.pth" for rank in range(NPROC)} <= files

    # 2. The retried pod, on a new node: resumes at that step and finishes
    done = subprocess.run(
        command(tiny_gemma4_dir, url, tmp_path, "second"),
        cwd=REPO,
        env=environment(tmp_path, tmp_path / "node-2", None),
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-8000:]
    summary = json.loads((remote / "run_summary.json").read_text())
    assert summary["resumed_from_step"] == saved and summary["steps"] == MAX_STEPS, summary
    assert (remote / RUN_MARKER).is_file()


def test_a_sigterm_asks_the_trainer_to_save_and_stop_at_the_step_end() -> None:
    """One process: the handler only records the signal; the step end turns it into save + stop, once."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from trainer.preemption import preemption_callback

    callback = preemption_callback()
    args = TrainingArguments(output_dir="unused", report_to="none", use_cpu=True)
    state, control = TrainerState(global_step=7), TrainerControl()
    before = signal.getsignal(signal.SIGTERM)
    callback.install()
    try:
        callback.on_step_end(args, state, control)
        assert not (control.should_save or control.should_training_stop)  # no signal, no change
        os.kill(os.getpid(), signal.SIGTERM)  # the process lives on: the handler only sets the flag
        callback.on_step_end(args, state, control)
    finally:
        callback.uninstall()
    assert control.should_save and control.should_training_stop and callback.stopped_at == 7
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the run's only


def test_the_ray_pods_prestop_notice_saves_and_stops_and_its_acknowledgement_frees_the_hook(tmp_path: Path) -> None:
    """The worker pod's preStop command (infra/ray_job.py) writes the notice and holds SIGTERM back until the
    trainer acknowledges the saved step; the callback treats the notice as the signal."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from trainer.preemption import acknowledge, preemption_callback, prestop_command

    notice = tmp_path / "preemption"
    callback = preemption_callback(notice)
    args = TrainingArguments(output_dir="unused", report_to="none", use_cpu=True)
    state, control = TrainerState(global_step=4), TrainerControl()
    callback.on_step_end(args, state, control)
    assert not (control.should_save or control.should_training_stop)

    hook = subprocess.Popen(prestop_command(str(notice), wait_s=60))
    try:
        deadline = time.monotonic() + 10
        while not notice.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        state.global_step = 5
        callback.on_step_end(args, state, control)
        assert control.should_save and control.should_training_stop and callback.stopped_at == 5
        assert hook.poll() is None, "the hook waits for the saved step"
        acknowledge(notice)
        assert hook.wait(timeout=10) == 0
    finally:
        if hook.poll() is None:
            hook.kill()
    assert not notice.exists() and not Path(f"{notice}.saved").exists()
