"""Per-token log-probabilities of the few labelled rows on a CPU: one projection, kept for the backward.

Decision: trl 1.16's `ChunkedLogProbFunction` is built for thousands of GPU rows (it never holds the logits, so
its backward projects every row again). A CPU step's labelled rows (trainer/lm_head.py) are few: this function
projects once, keeps the shifted logits for the backward (up to `KEEP_LOGITS_BYTES`, else it projects again),
and multiplies in the orientation MKL runs fastest (`weight @ hidden.T`). Its contract is trl's: the same
arguments, five outputs and gradients (tests/trainer/test_cpu_logprob.py compares each). Sources:
docs/trainer.md#the-labels-only-lm-head; timings: bench/RESULTS.md.

Not done here: CUDA/XPU keep trl's Triton kernel; the logits are float32 from the rows' dtype (autocast's when
on, as trl).
"""

from __future__ import annotations

import contextvars
import os
from typing import Any

import torch
from trl.trainer.utils import maybe_gather_lm_head_ctx

# One projection holds at most this much float32 logits: 256 rows of Gemma's 262,144-token vocabulary
TILE_BYTES = 256 * 2**20
# The logits of every row are kept for the backward up to this size per machine (divided among its ranks),
# and only when a backward can follow (grad mode on); above it the backward projects again, as trl does
KEEP_LOGITS_BYTES = 2**30
OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")  # trl's OPTIONAL_OUTPUTS, in its order


# Whether a backward can follow this call: grad mode as the caller had it (inside `forward` autograd
# turns grad mode off, and `ctx.needs_input_grad` reads True even under no_grad), set by `project`
_BACKWARD_FOLLOWS: contextvars.ContextVar[bool] = contextvars.ContextVar("gemma_ft_backward_follows", default=True)


def project(hidden: torch.Tensor, *args: Any) -> Any:
    """`LabelledRowsLogProb.apply`, keeping no logits when no backward can follow (evaluation under no_grad)."""
    token = _BACKWARD_FOLLOWS.set(torch.is_grad_enabled())
    try:
        return LabelledRowsLogProb.apply(hidden, *args)
    finally:
        _BACKWARD_FOLLOWS.reset(token)


def keep_logits_bytes() -> int:
    """KEEP_LOGITS_BYTES for this process: the budget is the machine's, shared by its ranks (LOCAL_WORLD_SIZE)."""
    return KEEP_LOGITS_BYTES // max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))


def _rows_per_tile(vocab: int) -> int:
    return max(1, TILE_BYTES // (4 * max(1, vocab)))


class _Head:
    """The projection and the logit transform trl applies: z = softcap * tanh(y * scale / softcap) / temperature."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype, kernel: dict[str, Any]
    ):
        self.weight, self.bias, self.compute_dtype = weight, bias, compute_dtype
        self.scale = float(kernel["logit_scale"])
        self.softcap = float(kernel["softcap"]) if kernel["HAS_SOFTCAP"] else None
        self.inv_t = float(kernel["inv_t"])

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """`[vocab, rows]` float32 logits of these hidden rows, after the transform."""
        z = torch.mm(self.weight.to(self.compute_dtype), rows.to(self.compute_dtype).t()).float()
        if self.bias is not None:
            z.add_(self.bias.float().unsqueeze(-1))
        z.mul_(self.scale)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z.mul_(self.inv_t)

    def transform_grad_(self, grad: torch.Tensor, shifted: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
        """dL/dy from dL/dz in place: through the temperature, the softcap (1 - tanh^2) and the scale."""
        grad.mul_(self.inv_t)
        if self.softcap is not None:
            tanh = (shifted + row_max).div_(self.softcap * self.inv_t)
            grad.mul_(tanh.mul_(tanh).neg_().add_(1))
        return grad.mul_(self.scale)


def _first_maximum_is(z: torch.Tensor, row_max: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`z.argmax(0) == targets` (argmax's first maximum, as trl counts a tie) without argmax over a [V, rows] tile.

    argmax along the vocabulary of this layout is a strided scan of the whole tile; the target's own logit
    against the row's maximum is one gather, and only a row whose target
    reaches the maximum is scanned for an earlier word with the same logit.
    """
    top = z.gather(0, targets.unsqueeze(0)).squeeze(0) == row_max
    for column in top.nonzero().flatten().tolist():
        target = int(targets[column])
        if target and bool((z[:target, column] == row_max[column]).any()):
            top[column] = False
    return top


# Below this many rows `grad.T @ weight` is the fast orientation of the hidden states' gradient; from it up,
# `(weight.T @ grad).T`. Measured on the 2 AMD EPYC cores (MKL, fp32, 262,144 x 640): 2-8 rows took
# 1.3-1.9 s as `(weight.T @ grad).T` and 0.16 s as `grad.T @ weight`; 12-128 rows 0.11-0.36 s as
# `(weight.T @ grad).T`, the faster one there (up to 1.7x at 48 rows). A batch of one short
# conversation (the emoji recipe's micro-batch) has ~10 labelled rows.
SMALL_ROWS = 12


def _hidden_grad(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """`[rows, H]` gradient of the hidden rows from the `[V, rows]` gradient of their logits."""
    if grad.shape[1] < SMALL_ROWS:
        return torch.mm(grad.t(), weight)
    return torch.mm(weight.t(), grad).t()


class LabelledRowsLogProb(torch.autograd.Function):
    """trl's `ChunkedLogProbFunction` contract for a CPU: per-token log p(target) and the requested extras."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,  # [N, H]
        weight: torch.Tensor,  # [V, H]
        bias: torch.Tensor | None,  # [V]
        targets: torch.Tensor,  # [N]
        temperature: float,
        chunk_size: int,  # trl's vocabulary tile width: unused, the whole vocabulary is one tile here
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: tuple[str, ...] = OUTPUTS,
    ) -> tuple[torch.Tensor | None, ...]:
        ctx.set_materialize_grads(False)
        n, vocab = hidden.shape[0], weight.shape[0]
        autocast = torch.is_autocast_enabled(hidden.device.type)
        compute_dtype = torch.get_autocast_dtype(hidden.device.type) if autocast else hidden.dtype
        kernel = {
            "logit_scale": logit_scale,
            "softcap": final_logit_softcapping or 1.0,
            "inv_t": 1 / temperature,
            "HAS_SOFTCAP": final_logit_softcapping is not None,
        }
        head = _Head(weight, bias, compute_dtype, kernel)
        keep = _BACKWARD_FOLLOWS.get() and n * vocab * 4 <= keep_logits_bytes()
        f32 = torch.float32
        logprobs, row_max, log_sum = (hidden.new_empty(n, dtype=f32) for _ in range(3))
        entropy = hidden.new_empty(n, dtype=f32) if "entropy" in outputs else None
        log_sum_sq = hidden.new_empty(n, dtype=f32) if "log_sum_sq_probs" in outputs else None
        mean_logits = hidden.new_empty(n, dtype=f32) if "mean_logits" in outputs else None
        is_top1 = hidden.new_empty(n, dtype=torch.bool) if "is_top1" in outputs else None
        kept: list[torch.Tensor] = []
        step = _rows_per_tile(vocab)
        for start in range(0, n, step):
            rows = slice(start, min(start + step, n))
            z = head.logits(hidden[rows])  # [V, rows]
            target = targets[rows].unsqueeze(0)
            if mean_logits is not None:
                mean_logits[rows] = z.mean(0)
            m = z.amax(0)
            if is_top1 is not None:
                is_top1[rows] = _first_maximum_is(z, m, targets[rows])
            z.sub_(m)  # shifted: every exp below is <= 1
            e = torch.exp(z)
            s = e.sum(0)
            log_s = torch.log(s)
            row_max[rows], log_sum[rows] = m, log_s
            logprobs[rows] = z.gather(0, target).squeeze(0) - log_s
            if entropy is not None:
                entropy[rows] = log_s - torch.linalg.vecdot(e, z, dim=0) / s
            if log_sum_sq is not None:
                log_sum_sq[rows] = torch.log(torch.linalg.vecdot(e, e, dim=0)) - 2 * log_s
            del e
            if keep:
                kept.append(z)
        ctx.save_for_backward(
            hidden, weight, bias, targets, row_max, log_sum, entropy if entropy is not None else log_sum
        )
        ctx.kept, ctx.kernel, ctx.compute_dtype, ctx.has_entropy = kept, kernel, compute_dtype, entropy is not None
        ctx.step = step
        ctx.mark_non_differentiable(*(x for x in (log_sum_sq, mean_logits, is_top1) if x is not None))
        return logprobs, entropy, log_sum_sq, mean_logits, is_top1

    @staticmethod
    @torch.autograd.function.once_differentiable  # no graph of the backward: a second derivative is an error
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None, *_: Any) -> Any:  # type: ignore[override]
        hidden, weight, bias, targets, row_max, log_sum, entropy = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        n, f32, step = hidden.shape[0], torch.float32, ctx.step  # the forward's tiles, whatever the weight reads as now
        if grad_entropy is not None and not ctx.has_entropy:
            grad_entropy = None
        with maybe_gather_lm_head_ctx(weight, bias):  # shapes only inside: a ZeRO-3 weight is gathered here
            vocab = weight.shape[0]
            grad_hidden = hidden.new_zeros(hidden.shape, dtype=f32) if needs_hidden else None
            grad_weight = hidden.new_zeros(weight.shape, dtype=f32) if needs_weight else None
            grad_bias = hidden.new_zeros(vocab, dtype=f32) if needs_bias and bias is not None else None
            head = _Head(weight, bias, ctx.compute_dtype, ctx.kernel)
            for index, start in enumerate(range(0, n, step)):
                rows = slice(start, min(start + step, n))
                if ctx.kept:
                    z = ctx.kept[index]
                else:
                    z = head.logits(hidden[rows])
                    z.sub_(row_max[rows])
                log_p = z - log_sum[rows]  # [V, rows]
                p = torch.exp(log_p)
                if grad_logprobs is not None:
                    # d log p_target / dz_j = 1[j = target] - p_j
                    g = grad_logprobs[rows].float()
                    grad = p * g.neg()
                    grad.scatter_add_(0, targets[rows].unsqueeze(0), g.unsqueeze(0))
                else:
                    grad = torch.zeros_like(p)
                if grad_entropy is not None:
                    # d entropy / dz_j = -p_j (log p_j + entropy)
                    grad.sub_(p.mul_(log_p.add_(entropy[rows])).mul_(grad_entropy[rows].float()))
                del p, log_p
                head.transform_grad_(grad, z, row_max[rows])
                grad_c = grad.to(ctx.compute_dtype)
                if grad_hidden is not None:
                    grad_hidden[rows] = _hidden_grad(weight.to(ctx.compute_dtype), grad_c).float()
                if grad_weight is not None:
                    grad_weight.addmm_(grad, hidden[rows].float())
                if grad_bias is not None:
                    grad_bias.add_(grad.sum(1))
        ctx.kept = []
        return (
            grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None,
            None,
            None,
            None,
            None,
            None,
        )
