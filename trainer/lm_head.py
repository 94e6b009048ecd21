"""The LM head scores only the positions that carry a label, on every device.

Decision: trl 1.16's SFTTrainer already patches every model with a fused LM head that projects only the
labelled positions, but only with Triton on `cuda`/`xpu` (`_use_triton`); on a CPU (and MPS) it projects every
position and zeroes the unlabelled ones, wasted work since nothing is compiled there.
`score_labelled_positions_only` makes ONE model's fused head take trl's compact branch on those eager devices
too (a context variable, set only while that model's fused forward runs); loss, gradients and metrics are the
same numbers (tests/trainer/test_lm_head.py). On a CPU the labelled rows then go through trainer/cpu_logprob.py.
`new_sft_trainer` is the package's one SFTTrainer constructor, so every run gets it.

XLA/Neuron/HPU keep trl's full branch (recompilation); if a trl upgrade removes `_use_triton`, the patch warns
and does nothing. Sources: docs/decisions/labels-only-lm-head.md.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel
    from trl import SFTTrainer

log = logging.getLogger(__name__)

# Devices that run eagerly: a data-dependent number of rows costs nothing but the rows themselves.
EAGER_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps"})
_LABELS_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("gemma_ft_labels_only_lm_head", default=False)
_FULL_HEAD_FORWARD = "_gemma_ft_full_head_forward"
_SWITCH_MARK = "_gemma_ft_labels_only_switch"


def _install_switch() -> bool:
    """Let trl's compact-branch test also answer yes on an eager device while `_LABELS_ONLY` is set."""
    from trl.trainer import utils as trl_utils

    current = getattr(trl_utils, "_use_triton", None)
    if current is None:
        log.warning(
            "trl %s has no trl.trainer.utils._use_triton: the LM head scores every position on this device",
            getattr(__import__("trl"), "__version__", "?"),
        )
        return False
    if getattr(current, _SWITCH_MARK, False):
        return True

    @functools.wraps(current)
    def use_compact_branch(device: torch.device) -> bool:
        return bool(current(device)) or (_LABELS_ONLY.get() and device.type in EAGER_DEVICES)

    setattr(use_compact_branch, _SWITCH_MARK, True)
    trl_utils._use_triton = use_compact_branch  # type: ignore[attr-defined]
    return True


_KERNEL_MARK = "_gemma_ft_cpu_kernel_switch"


def _install_cpu_kernel() -> None:
    """While `_LABELS_ONLY` is set on a CPU, trl's fused head calls trainer/cpu_logprob.py's kernel instead of its own.

    trl's `_fused_forward` looks `_ChunkedLogProbFunction` up in trl.trainer.utils at every call; the
    replacement forwards every other call (another model, another device) to what was there.
    """
    from trl.trainer import utils as trl_utils

    current = trl_utils._ChunkedLogProbFunction
    if getattr(current, _KERNEL_MARK, False):
        return

    class CpuLabelledRowsOrTrl:
        @staticmethod
        def apply(hidden: torch.Tensor, *args: Any) -> Any:
            if _LABELS_ONLY.get() and hidden.device.type == "cpu":
                from trainer.cpu_logprob import project

                return project(hidden, *args)
            return current.apply(hidden, *args)

    setattr(CpuLabelledRowsOrTrl, _KERNEL_MARK, True)
    trl_utils._ChunkedLogProbFunction = CpuLabelledRowsOrTrl  # type: ignore[attr-defined, assignment, misc]


def _fused_head_owner(model: Any) -> PreTrainedModel:
    """The model trl patched: the base model inside a PEFT wrapper, else the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def score_labelled_positions_only(model: Any) -> bool:
    """Make `model`'s fused LM head (added by SFTTrainer) project only labelled positions; True when it does."""
    if not _install_switch():
        return False
    _install_cpu_kernel()
    owner = _fused_head_owner(model)
    if getattr(owner, _FULL_HEAD_FORWARD, None) is not None:
        return True
    full_head_forward = owner.forward

    @functools.wraps(full_head_forward)  # keeps the signature `generate` validates its kwargs against
    def labels_only_forward(*args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if not fused_lm_head:
            return full_head_forward(*args, **kwargs)
        token = _LABELS_ONLY.set(True)
        try:
            return full_head_forward(*args, fused_lm_head=True, **kwargs)
        finally:
            _LABELS_ONLY.reset(token)

    setattr(owner, _FULL_HEAD_FORWARD, full_head_forward)
    owner.forward = labels_only_forward  # type: ignore[method-assign]
    return True


def score_every_position(model: Any) -> None:
    """Undo `score_labelled_positions_only`: trl's own choice again (the benchmark's ablation)."""
    owner = _fused_head_owner(model)
    full_head_forward = getattr(owner, _FULL_HEAD_FORWARD, None)
    if full_head_forward is not None:
        owner.forward = full_head_forward  # type: ignore[method-assign]
        delattr(owner, _FULL_HEAD_FORWARD)


def new_sft_trainer(**kwargs: Any) -> SFTTrainer:
    """trl's SFTTrainer with the labels-only LM head: the one place this package builds a trainer.

    trl's Triton kernels run only where Triton can build its driver stub (trainer/triton_build.py);
    under FSDP2 the LoRA gradients are reduced in fp32 and checkpoints gather no base weights (trainer/fsdp.py).
    """
    from trl import SFTTrainer

    from trainer.fsdp import checkpoints_without_the_base, reduce_gradients_in_fp32
    from trainer.triton_build import use_triton_only_where_it_builds

    use_triton_only_where_it_builds()
    trainer = SFTTrainer(**kwargs)
    reduce_gradients_in_fp32(getattr(trainer.accelerator.state, "fsdp_plugin", None))  # before prepare() shards
    checkpoints_without_the_base(trainer)
    score_labelled_positions_only(trainer.model)
    return trainer
