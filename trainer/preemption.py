"""A SIGTERM (a Spot or flex-start preemption, a node drain, a deleted Job) saves a resumable checkpoint, then stops.

Decision: Kubernetes sends SIGTERM to the container's main process, then SIGKILL after the pod's
`terminationGracePeriodSeconds` (infra/gke_job.py; GCE gives a Spot VM ~30 s). In the a4-gemma4 Job that
process is torchrun's agent (`trainer.launch` execs `accelerate launch`), which sends the signal on to every
rank and kills them after `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` (30 s by default, torch/distributed/launcher/api.py);
`trainer.launch` raises that so the pod's grace period is the only bound. Each rank's handler only sets a flag;
at the end of the optimizer step in progress the ranks agree (a one-element all-reduce, MAX, every step: they
may see the signal at different steps) and the Trainer saves that step's checkpoint (mirrored to the bucket,
marker last, trainer/checkpoints.py) and stops. `trainer.train.main` then raises `Preempted`: no final
adapter, no `_RUN_COMPLETE.json`; `python -m trainer` exits 143 (128 + SIGTERM) and the retried pod resumes
from that step.

Not done here: a signal while the model loads or the data is prepared stops the process as before (there is
no step to keep); Ray workers (trainer/ray_entry.py) are stopped by Ray.
"""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import TrainerCallback

log = logging.getLogger(__name__)

EXIT_CODE = 128 + signal.SIGTERM


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


def preemption_callback() -> TrainerCallback:
    """A TrainerCallback that turns a SIGTERM into 'save this step, then stop'; `install()` / `uninstall()` the handler."""
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
            if self.stopped_at is None and _any_rank(self.signalled, args.device):
                self.stopped_at = state.global_step
                control.should_save = True
                control.should_training_stop = True
            return control

    return SaveOnSigterm()
