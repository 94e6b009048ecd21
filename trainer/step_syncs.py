"""A micro-step reads the device once (the LM head's labelled rows), the logging numbers once per optimizer step.

Decision: transformers 5.23's `Trainer` and trl 1.16's `SFTTrainer` read device values on the host in every
micro-step, for logging: the token count (`Trainer._track_num_input_tokens`: a gather and `.item()`), trl's entropy,
token accuracy and token count (`SFTTrainer.compute_loss`: four gathers, two `> 0` tests, three `.item()`), the NaN
filter of the logged loss (`torch.isnan(loss) or torch.isinf(loss)`), and transformers' packed-sequence detection
(`masking_utils.find_packed_sequence_indices`: `.all()`, once per mask type). Each read waits for the GPU to drain
its queue. Here the counts and metrics stay on the device and are gathered and read ONCE per optimizer step
(`flush_step_metrics`: the same numbers, tests/trainer/test_step_syncs.py), the NaN filter is off (sft_config), and
inside the fused-head forward the packed-sequence mask is used without asking whether the row holds one sequence
(a packed mask of a single sequence is the causal mask itself). What stays: trainer/lm_head.py's one read.

Not changed: evaluation, custom loss functions, label smoothing, MoE auxiliary losses and sequence parallelism take
trl's own `compute_loss`. Counted with torch.profiler: bench/step_ops.py, bench/RESULTS.md.
"""

from __future__ import annotations

import contextvars
import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Set while the fused-head forward of a model `new_sft_trainer` built runs (trainer/lm_head.py)
IN_FUSED_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("gemma_ft_in_fused_forward", default=False)
_PACKED_MARK = "_gemma_ft_packed_without_read"
_CLASS: type | None = None


def install_packed_detection_without_read() -> None:
    """transformers' `find_packed_sequence_indices` without its `.all()` while `IN_FUSED_FORWARD` is set.

    transformers returns None for a row that holds one sequence, to let sdpa use `is_causal`; deciding that reads
    the device. A padding-free row of this trainer almost always holds several conversations, and when it holds
    one the packed mask built from it equals the causal mask, so the answer is not needed. Elsewhere (generation,
    evaluation outside the fused head) the function is transformers' own.
    """
    from transformers import masking_utils

    current = masking_utils.find_packed_sequence_indices
    if getattr(current, _PACKED_MARK, False):
        return

    @functools.wraps(current)
    def packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if not IN_FUSED_FORWARD.get():
            return current(position_ids)
        import torch

        first = position_ids[:, :1] - 1
        return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)

    setattr(packed_sequence_indices, _PACKED_MARK, True)
    masking_utils.find_packed_sequence_indices = packed_sequence_indices


def sft_trainer_class() -> type:
    """trl's SFTTrainer whose micro-steps keep their logging numbers on the device (built once per process)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _build_class()
    return _CLASS


def _build_class() -> type:
    import torch
    from trl import SFTTrainer

    class DeferredMetricsSFTTrainer(SFTTrainer):  # type: ignore[misc]
        """SFTTrainer with the per-micro-step reads of its logging numbers moved to the log (module docstring)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._pending_rows: list[torch.Tensor] = []  # per micro-step: labelled, entropy sum, top-1, tokens
            self._pending_input_tokens: list[torch.Tensor] = []
            self.add_callback(_flush_each_update(self))  # before any on_step_end reads the state

        def _defers(self, return_outputs: bool) -> bool:
            parallelism = getattr(self.accelerator, "parallelism_config", None)
            return (
                self.model.training
                and not return_outputs
                and self.compute_loss_func is None
                and self.label_smoother is None
                and not self.aux_loss_enabled
                and self.args.loss_type in ("nll", "dft")
                and not (parallelism is not None and getattr(parallelism, "sp_enabled", False))
            )

        def compute_loss(
            self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
        ) -> Any:
            """trl's loss on its default path (the fused head's log-probabilities); the metrics stay on the device."""
            if not self._defers(return_outputs):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            inputs["use_cache"] = False
            outputs = model(**inputs, fused_lm_head=True)
            per_token_loss = -outputs.log_probs  # zero on ignored positions
            if self.args.loss_type == "dft":
                per_token_loss = per_token_loss * outputs.log_probs.exp().detach()
            num_tokens = outputs.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
            loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * (self.accelerator.num_processes // self.get_tp_size())
            mask = outputs.label_mask
            if "attention_mask" in inputs:
                tokens = inputs["attention_mask"].sum()
            else:  # padding-free: the row's length, known here
                tokens = mask.new_full((), inputs["position_ids"].size(1), dtype=torch.float32)
            row = torch.stack(
                [
                    mask.sum().float(),
                    outputs.entropy.detach().sum().float(),
                    outputs.is_top1.sum().float(),
                    tokens.float(),
                ]
            )
            self._pending_rows.append(row)
            return loss

        def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
            """Trainer's count of the micro-step's input tokens (all or non-padding), added at the next flush."""
            mode = self.args.include_num_input_tokens_seen
            if mode == "no":
                return
            name = getattr(self.model, "main_input_name", "input_ids")
            if name not in inputs:
                return super()._track_num_input_tokens(inputs)  # its warning, once it reads nothing
            pad = getattr(self.processing_class, "pad_token_id", None)
            if mode == "non_padding" and "attention_mask" in inputs:
                count: Any = inputs["attention_mask"].sum()
            elif mode == "non_padding" and pad is not None:
                count = (inputs[name] != pad).sum()
            else:
                count = inputs[name].numel()
            self._pending_input_tokens.append(torch.as_tensor(count, device=self.args.device, dtype=torch.int64))

        def flush_step_metrics(self) -> None:
            """Gather the pending micro-steps' numbers once, read them once, and book them as trl and Trainer do.

            Called at each optimizer step, log and save, on every rank with the same number of pending micro-steps
            (they run in lockstep), so the gather matches; with nothing pending nothing is gathered (a rank-0 log)."""
            if not self._pending_rows and not self._pending_input_tokens:
                return
            device = self.args.device
            rows = torch.stack(self._pending_rows) if self._pending_rows else torch.zeros(0, 4, device=device)
            tokens = (
                torch.stack(self._pending_input_tokens).sum().double()
                if self._pending_input_tokens
                else torch.zeros((), device=device, dtype=torch.float64)
            )
            local = torch.cat([rows.to(device, torch.float64).flatten(), tokens.view(1).to(device)])
            summed = self.accelerator.gather(local).view(-1, local.numel()).sum(0).tolist()
            self._pending_rows, self._pending_input_tokens = [], []
            metrics = self._metrics["train"]
            for step in range(rows.shape[0]):
                labelled, entropy, top1, step_tokens = summed[4 * step : 4 * step + 4]
                metrics["entropy"].append(entropy / labelled if labelled > 0 else 0.0)
                metrics["mean_token_accuracy"].append(top1 / labelled if labelled > 0 else 0.0)
                self._total_train_tokens += int(step_tokens) // self._tp_size
            if rows.shape[0]:
                metrics["num_tokens"] = [self._total_train_tokens]
            self.state.num_input_tokens_seen += int(summed[-1])

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            self.flush_step_metrics()
            super().log(logs, start_time)

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            self.flush_step_metrics()  # trainer_state.json carries num_input_tokens_seen
            super()._save_checkpoint(model, trial)

    return DeferredMetricsSFTTrainer


def _flush_each_update(trainer: Any) -> Any:
    """A callback that books the pending numbers once per optimizer step (`on_optimizer_step`, every rank): callbacks
    that read `state.num_input_tokens_seen` at `on_step_end` (Ray's report, the benchmark) see every step's."""
    from transformers import TrainerCallback

    class FlushEachUpdate(TrainerCallback):  # type: ignore[misc]
        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            trainer.flush_step_metrics()

    return FlushEachUpdate()
