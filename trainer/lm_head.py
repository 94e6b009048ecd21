"""The LM head scores only the positions that carry a label, on every device, with one read of the device.

Decision: trl 1.16's SFTTrainer patches every model with a fused LM head. On Triton devices it projects only the
labelled positions (`hidden_states[mask]`, `labels[mask]`, then `masked_scatter`: four host-device syncs per
micro-step, forward and backward); elsewhere it projects every position. For ONE model (a context variable, set
only while that model's fused forward runs) `score_labelled_positions_only` makes trl take its full branch, which
reads nothing back, and the kernel call then keeps the labelled rows itself: one `nonzero` (the micro-step's only
read, trainer/step_syncs.py), `index_select` in, `index_copy` out. Loss, gradients and metrics are the same numbers
(tests/trainer/test_lm_head.py). On a CPU the labelled rows go through trainer/cpu_logprob.py, elsewhere through
trl's kernel (Triton where it builds). `new_sft_trainer` is the package's one SFTTrainer constructor.

XLA/Neuron/HPU keep trl's full branch (recompilation); if a trl upgrade removes `_use_triton`, the patch warns and
does nothing. Sources: docs/trainer.md#the-labels-only-lm-head.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from typing import TYPE_CHECKING, Any

from trainer.step_syncs import IN_FUSED_FORWARD, install_packed_detection_without_read, sft_trainer_class

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel
    from trl import SFTTrainer

log = logging.getLogger(__name__)

# Devices that run eagerly: a data-dependent number of rows costs nothing but the rows themselves.
EAGER_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps"})
# The flattened next-token label mask of the fused forward running now (None outside one)
_LABEL_MASK: contextvars.ContextVar[Any] = contextvars.ContextVar("gemma_ft_label_mask", default=None)
_FULL_HEAD_FORWARD = "_gemma_ft_full_head_forward"
_SWITCH_MARK = "_gemma_ft_labels_only_switch"


def _install_switch() -> bool:
    """Let trl's compact-branch test answer no on an eager device inside our fused forward: trl then passes every
    row, reading nothing back, and `_install_kernel`'s call keeps the labelled ones."""
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
        if _LABEL_MASK.get() is not None and device.type in EAGER_DEVICES:
            return False
        return bool(current(device))

    setattr(use_compact_branch, _SWITCH_MARK, True)
    trl_utils._use_triton = use_compact_branch  # type: ignore[attr-defined]
    return True


_KERNEL_MARK = "_gemma_ft_labelled_rows_kernel"


def _install_kernel() -> None:
    """Inside our fused forward, trl's head kernel sees only the labelled rows; every other call is trl's own.

    trl's `_fused_forward` looks `_ChunkedLogProbFunction` up in trl.trainer.utils at every call. The rows arrive
    in trl's full branch (every position, targets clamped to >= 0); the label mask set by the forward picks the
    labelled ones with one `nonzero`, and the results go back in place with zeros elsewhere, as trl's compact
    branch returns them. On a CPU the rows go to trainer/cpu_logprob.py's kernel.
    """
    from trl.trainer import utils as trl_utils

    current = trl_utils._ChunkedLogProbFunction
    if getattr(current, _KERNEL_MARK, False):
        return

    class LabelledRowsOnly:
        @staticmethod
        def apply(hidden: torch.Tensor, weight: Any, bias: Any, targets: torch.Tensor, *args: Any) -> Any:
            mask = _LABEL_MASK.get()
            if mask is None or hidden.device.type not in EAGER_DEVICES or mask.numel() != hidden.shape[0]:
                return current.apply(hidden, weight, bias, targets, *args)
            rows = mask.to(hidden.device).nonzero().squeeze(1)  # the micro-step's one host read: how many rows
            kept_hidden, kept_targets = hidden.index_select(0, rows), targets.index_select(0, rows)
            if hidden.device.type == "cpu":
                from trainer.cpu_logprob import project

                per_token = project(kept_hidden, weight, bias, kept_targets, *args)
            else:
                per_token = current.apply(kept_hidden, weight, bias, kept_targets, *args)
            total = hidden.shape[0]
            return tuple(None if x is None else x.new_zeros(total).index_copy(0, rows, x) for x in per_token)

    setattr(LabelledRowsOnly, _KERNEL_MARK, True)
    trl_utils._ChunkedLogProbFunction = LabelledRowsOnly  # type: ignore[attr-defined, assignment, misc]


def _fused_head_owner(model: Any) -> PreTrainedModel:
    """The model trl patched: the base model inside a PEFT wrapper, else the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def score_labelled_positions_only(model: Any) -> bool:
    """Make `model`'s fused LM head (added by SFTTrainer) project only labelled positions; True when it does."""
    if not _install_switch():
        return False
    _install_kernel()
    install_packed_detection_without_read()
    owner = _fused_head_owner(model)
    if getattr(owner, _FULL_HEAD_FORWARD, None) is not None:
        return True
    full_head_forward = owner.forward

    @functools.wraps(full_head_forward)  # keeps the signature `generate` validates its kwargs against
    def labels_only_forward(*args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if not fused_lm_head:
            return full_head_forward(*args, **kwargs)
        shifted = kwargs.get("shift_labels")
        if shifted is None and kwargs.get("labels") is not None:
            shifted = kwargs["labels"][:, 1:]  # trl shifts the same way when no shift_labels are given
        mask = _LABEL_MASK.set(None if shifted is None else (shifted != -100).reshape(-1))
        fused = IN_FUSED_FORWARD.set(True)
        try:
            return full_head_forward(*args, fused_lm_head=True, **kwargs)
        finally:
            IN_FUSED_FORWARD.reset(fused)
            _LABEL_MASK.reset(mask)

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


def adapters_in_fp32(model: Any) -> int:
    """LoRA's A and B matrices back to float32 where trl 1.16 made them bf16 (a quantized base); the number cast.

    trl's SFTTrainer casts every trainable parameter of a 4/8-bit model to bf16 (sft_trainer.py, "When using QLoRA,
    the PEFT adapter weights are converted to bf16"), and AdamW then keeps its moments and updates in bf16: an update
    below 1/256 of a weight is lost. In float32 the adapters keep a master copy, and the matrix products still run in
    bf16 under autocast (peft's bnb `Linear4bit` casts only without autocast). Saved full-width modules
    (`lora.modules_to_save`) stay as trl leaves them: their embeddings feed the bf16 layers directly."""
    import torch

    cast = 0
    for name, param in model.named_parameters():
        if param.requires_grad and "lora_" in name and param.dtype != torch.float32:
            param.data = param.data.float()
            cast += 1
    return cast


def new_sft_trainer(**kwargs: Any) -> SFTTrainer:
    """trl's SFTTrainer with the labels-only LM head and its logging read once per update (trainer/step_syncs.py): the
    one place this package builds a trainer.

    trl's Triton kernels run only where Triton can build its driver stub (trainer/triton_build.py); QLoRA's adapters
    train in float32 (`adapters_in_fp32`); under FSDP2 the LoRA gradients are reduced in fp32 and checkpoints gather no base weights (trainer/fsdp.py).
    """

    from trainer.fsdp import checkpoints_without_the_base, reduce_gradients_in_fp32
    from trainer.triton_build import use_triton_only_where_it_builds

    use_triton_only_where_it_builds()
    trainer: SFTTrainer = sft_trainer_class()(**kwargs)
    adapters_in_fp32(trainer.model)
    reduce_gradients_in_fp32(getattr(trainer.accelerator.state, "fsdp_plugin", None))  # before prepare() shards
    checkpoints_without_the_base(trainer)
    score_labelled_positions_only(trainer.model)
    return trainer
