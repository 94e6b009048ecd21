"""A SIGTERM (a Spot or flex-start preemption, a node drain, a deleted Job) saves a resumable checkpoint, then stops.

Decision (docs/distributed.md#sigterm-saves-the-step): each rank's handler only sets a flag; at the end of the optimizer
step in progress the ranks agree (an all-reduce MAX, every step), the Trainer saves that step's checkpoint
(mirrored, marker last: trainer/checkpoints.py) and stops; `trainer.train.main` raises `Preempted`, `python -m
trainer` exits 143 and the retried pod resumes from that step. torchrun's agent passes the signal on, and
`trainer.launch` raises its shutdown timeout so the pod's grace period is the only bound.

Ray workers cannot be reached by the signal (docs/distributed.md#ray-workers-save-on-a-prestop-hook): their pods get a preStop hook
(`prestop_command`, infra/ray_job.py) that writes a notice file, which the same callback reads at each step end
(`notice=`), and waits for the trainer's acknowledgement that the checkpoint is with Ray (`ACK_SUFFIX`).

Not done here: a signal while the model loads or the data is prepared stops the process as before.
"""

from __future__ import annotations

import logging
import shlex
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import TrainerCallback

log = logging.getLogger(__name__)

EXIT_CODE = 128 + signal.SIGTERM
# The preStop hook's notice in a Ray worker container (its own /tmp: one per pod); the trainer's
# acknowledgement is the same path + ACK_SUFFIX.
NOTICE_FILE = "/tmp/gemma-finetune-preemption"
ACK_SUFFIX = ".saved"


def prestop_command(notice: str = NOTICE_FILE, wait_s: int = 25) -> list[str]:
    """The preStop exec: write the notice, wait (at most `wait_s`) for the trainer's acknowledgement, clean up.

    Kubernetes sends SIGTERM only once the hook returns (or the grace period ends), so the Ray processes of
    the pod live until the checkpoint of the step in progress has been handed to Ray.
    """
    n, ack = shlex.quote(notice), shlex.quote(notice + ACK_SUFFIX)
    script = (
        f"touch {n}; i=0; while [ ! -e {ack} ] && [ $i -lt {wait_s * 5} ]; do sleep 0.2; i=$((i+1)); done; "
        f"test -e {ack}; rc=$?; rm -f {n} {ack}; exit $rc"
    )
    return ["/bin/sh", "-c", script]


def acknowledge(notice: str | Path) -> None:
    """Tell the waiting preStop hook the checkpoint is saved (it then lets Kubernetes send SIGTERM)."""
    Path(f"{notice}{ACK_SUFFIX}").touch()


class Preempted(RuntimeError):
    """Training stopped on SIGTERM after saving checkpoint-`step`."""

    def __init__(self, step: int):
        super().__init__(f"stopped by SIGTERM after saving checkpoint-{step}; a restart resumes from it")
        self.step = step


def _any_rank(flag: bool, device: Any) -> bool:
    """True on every rank when it is True on one (all-reduce MAX); the flag itself without several ranks."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return flag
    backend = dist.get_backend()
    tensor = torch.tensor([int(flag)], device=device if backend != "gloo" else "cpu")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def preemption_callback(notice: str | Path | None = None) -> TrainerCallback:
    """A TrainerCallback that turns a SIGTERM into 'save this step, then stop'; `install()` / `uninstall()` the handler.

    With `notice`, the file's existence counts as the signal (the Ray path: a preStop hook writes it).
    """
    from transformers import TrainerCallback

    class SaveOnSigterm(TrainerCallback):
        def __init__(self) -> None:
            self.signalled = False
            self.stopped_at: int | None = None
            self._previous: Any = None

        def install(self) -> None:
            def handler(signum: int, _frame: Any) -> None:
                if not self.signalled:
                    log.warning("SIGTERM: saving a checkpoint at the end of this step, then stopping")
                self.signalled = True

            self._previous = signal.signal(signal.SIGTERM, handler)

        def uninstall(self) -> None:
            if self._previous is not None:
                signal.signal(signal.SIGTERM, self._previous)
                self._previous = None

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if notice is not None and not self.signalled and Path(notice).exists():
                log.warning("preemption notice %s: saving a checkpoint at the end of this step, then stopping", notice)
                self.signalled = True
            if self.stopped_at is None and _any_rank(self.signalled, args.device):
                self.stopped_at = state.global_step
                control.should_save = True
                control.should_training_stop = True
            return control

    return SaveOnSigterm()
