"""A preempted 3-rank W1 run, through the real launcher: killed after a checkpoint, resumed on a fresh machine.

Why it matters: the a4-gemma4 Job runs 8 ranks on one node sharing one local staging folder; the retry after a
lost node lands on an EMPTY staging folder and resumes from the bucket. Two things broke that: every rank
downloaded the checkpoint into the same folder at once (now local rank 0 downloads, the others wait), and rank
0 marked a checkpoint before the other ranks had written their `rng_state_<rank>.pth` (now a barrier first).
docs/trainer.md#checkpoints-mirrored-with-markers has the rules.

W1 on a tiny Gemma 4, 3 processes of `python -m trainer.launch --cpu` (gloo on loopback), a `file://` bucket.
A sitecustomize module delays the real functions: ranks 1 and 2 save their RNG state 1.5 s late (transformers'
`Trainer._save_rng_state`), and on the second machine each bucket read takes 0.5 s (fsspec's
`LocalFileSystem.get_file`). The first launch is SIGKILLed, launcher and ranks at once, as soon as a
checkpoint is marked; the second, on a new empty staging folder, must resume from it and finish.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.trainer.inject import AFTER_IMPORT, launch_argv, launch_env, w1_overrides
from trainer.checkpoints import CHECKPOINT_MARKER, RUN_MARKER, checkpoint_step

REPO = Path(__file__).resolve().parents[2]
NPROC = 3  # local rank 0 and two ranks that wait for its download and write their RNG state late
# killed at checkpoint-2; the retry resumes there and marks checkpoint-4, its own slowed RNG save included
MAX_STEPS = 4
SAVE_STEPS = 2
SLOW_RNG_SAVE_S = 1.5
SLOW_BUCKET_READ_S = 0.5

# Imported by every Python process of the run (it is first on PYTHONPATH); only the torchrun
# workers (LOCAL_RANK set) are slowed, and only in the real code paths:
# - SLOW_RNG_SAVE_S: ranks other than local rank 0 write their RNG state late (a slow disk);
# - SLOW_BUCKET_READ_S: every file read from the bucket takes that long (a slow network), so the
#   ranks of a machine that all look for the checkpoint at start-up do overlap, as 8 real ranks
#   downloading gigabytes do.
SLOW_MACHINE = (
    AFTER_IMPORT
    + """
import os

if "LOCAL_RANK" in os.environ:
    import time

    def _delay(cls, method, seconds):
        original = getattr(cls, method)

        def delayed(self, *args, **kwargs):
            time.sleep(seconds)
            return original(self, *args, **kwargs)

        setattr(cls, method, delayed)

    if os.environ["LOCAL_RANK"] != "0" and os.environ.get("SLOW_RNG_SAVE_S"):
        seconds = float(os.environ["SLOW_RNG_SAVE_S"])
        _after_import("transformers.trainer", lambda m, s=seconds: _delay(m.Trainer, "_save_rng_state", s))
    if os.environ.get("SLOW_BUCKET_READ_S"):
        seconds = float(os.environ["SLOW_BUCKET_READ_S"])
        _after_import("fsspec.implementations.local", lambda m, s=seconds: _delay(m.LocalFileSystem, "get_file", s))
"""
)


def launch_command(model_dir: Path, url: str, config_out: Path) -> list[str]:
    overrides = [*w1_overrides(model_dir, url, NPROC, MAX_STEPS, SAVE_STEPS), "training.save_total_limit=null"]
    return launch_argv("text-to-sql-gemma4-31b", NPROC, config_out, overrides)


def run_env(tmp_path: Path, staging: Path, slow_bucket: bool) -> dict[str, str]:
    return launch_env(
        tmp_path,
        SLOW_MACHINE,
        GEMMA_FT_STAGING=str(staging),
        SLOW_RNG_SAVE_S=str(SLOW_RNG_SAVE_S),
        SLOW_BUCKET_READ_S=str(SLOW_BUCKET_READ_S) if slow_bucket else None,
    )


def marked_checkpoints(remote: Path) -> dict[int, Path]:
    found = {}
    for path in (remote / "checkpoints").glob("checkpoint-*"):
        step = checkpoint_step(path)
        if step is not None and (path / CHECKPOINT_MARKER).is_file():
            found[step] = path
    return found


def kill_tree(pid: int) -> list[psutil.Process]:
    """SIGKILL a process and every descendant: torchrun starts each worker in a session of its own,
    so killing the launcher's process group would leave the ranks training (a lost node leaves nothing)."""
    root = psutil.Process(pid)
    tree = [*root.children(recursive=True), root]
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    return tree


def run_until_first_mark_then_kill(command: list[str], env: dict[str, str], remote: Path, log: Path) -> int:
    """Start the launch; SIGKILL it and all its processes once a checkpoint is marked in the bucket."""
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 420
        try:
            while not marked_checkpoints(remote):
                if proc.poll() is not None:
                    pytest.fail(f"the first launch ended (rc {proc.returncode}) before any checkpoint was marked:\n"
                                + log.read_text()[-6000:])  # fmt: skip
                if time.monotonic() > deadline:
                    pytest.fail("no checkpoint was marked in time:\n" + log.read_text()[-6000:])
                time.sleep(0.05)
        finally:
            tree = kill_tree(proc.pid)
            proc.wait(timeout=60)
            _gone, alive = psutil.wait_procs(tree, timeout=30)
            assert not alive, f"processes survived the kill: {alive}"
    return proc.returncode


EXPECTED_FILES = {f"rng_state_{rank}.pth" for rank in range(NPROC)} | {
    "adapter_model.safetensors",
    "optimizer.pt",
    "scheduler.pt",
    "trainer_state.json",
}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_three_rank_run_resumes_on_an_empty_machine(tiny_gemma4_dir: Path, tmp_path: Path) -> None:
    remote = tmp_path / "bucket" / "run"
    url = f"file://{remote}"

    # 1. The first node: killed outright right after the first checkpoint is marked in the bucket.
    first_log = tmp_path / "first.log"
    command = launch_command(tiny_gemma4_dir, url, tmp_path / "acc-1.yaml")
    rc = run_until_first_mark_then_kill(
        command, run_env(tmp_path, tmp_path / "node-1", slow_bucket=False), remote, first_log
    )
    assert rc == -signal.SIGKILL, first_log.read_text()[-4000:]
    assert not (remote / RUN_MARKER).exists(), "the first launch finished before it was killed"

    # A mark means complete: every rank's RNG state and the trainer's files are there.
    marked = marked_checkpoints(remote)
    assert marked
    for step, path in marked.items():
        missing = EXPECTED_FILES - {p.name for p in path.iterdir()}
        assert not missing, f"checkpoint-{step} is marked complete without {sorted(missing)}"
    resume_step = max(marked)
    assert resume_step < MAX_STEPS

    # 2. The retry, on a new node: an empty staging folder, the same command.
    second_staging = tmp_path / "node-2"
    assert not second_staging.exists()
    command = launch_command(tiny_gemma4_dir, url, tmp_path / "acc-2.yaml")
    done = subprocess.run(
        command,
        cwd=REPO,
        env=run_env(tmp_path, second_staging, slow_bucket=True),
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    (tmp_path / "second.log").write_text(output)
    assert done.returncode == 0, output[-8000:]

    summary = json.loads((remote / "run_summary.json").read_text())
    assert summary["resumed_from_step"] == resume_step and summary["steps"] == MAX_STEPS, summary
    # accelerate wrapped the 3 ranks in DDP with the trainer's settings (tests/trainer/test_ddp_settings.py)
    assert summary["ddp"] == {"find_unused_parameters": False, "broadcast_buffers": False}, summary["ddp"]
    assert summary["phases_s"]["train"] > 0 and summary["phases_s"]["find_checkpoint"] >= 0
    assert (remote / RUN_MARKER).is_file()
    # one download on the machine, every rank resumed from it, and every rank found its RNG state
    downloads = output.count(f"downloading checkpoint-{resume_step}")
    assert downloads == 1, f"{downloads} ranks downloaded checkpoint-{resume_step} into one staging folder"
    assert output.count(f"resuming from {second_staging}") == NPROC, output[-8000:]
    downloaded = next(second_staging.glob(f"*/checkpoints/checkpoint-{resume_step}"))
    assert {p.name for p in downloaded.iterdir()} >= EXPECTED_FILES
    for step, path in marked_checkpoints(remote).items():
        missing = EXPECTED_FILES - {p.name for p in path.iterdir()}
        assert not missing, f"checkpoint-{step} is marked complete without {sorted(missing)}"
    assert MAX_STEPS in marked_checkpoints(remote)
    # the metric lines (trainer/metrics_log.py) are one observation of the whole run: one line a step, not one a rank
    steps = [json.loads(line)["step"] for line in done.stdout.splitlines() if '"gft_event":"train"' in line]
    assert steps == list(range(resume_step + 1, MAX_STEPS + 1)), steps
