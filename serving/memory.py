"""The GPU memory vLLM needs to serve a model on one GPU, from the memory model's shapes (trainer/memory_plan.py).

    from serving.memory import served_memory
    served_memory("google/gemma-4-31B-it", "nvidia-rtx-pro-6000", max_model_len=4096, lora_rank=16, loras=1).line()

Decision: a served model fits when, inside vLLM's share of the GPU (`--gpu-memory-utilization`), its bf16 weights,
the LoRA slots vLLM reserves, the peak of its start-up profiling pass and the memory outside torch leave room for
the KV cache of one request of the served context: vLLM refuses to start otherwise (`check_enough_kv_cache_memory`,
vllm/v1/core/kv_cache_utils.py, v0.28.0). Deliberately simple and on the safe side; what it assumes and leaves out
is `ASSUMPTIONS`. Standard library only: config validation runs it in the Pulumi program.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.memory_plan import GB, GPUS, ModelShape, model_shape
from trainer.recipe import REPO_ROOT

GIB = 1024**3
BF16 = 2
# The Cloud Run GPUs by the memory model's name (infra/catalog.py TRAINING_GPU has the same pairs).
SERVING_GPUS = {"nvidia-l4": "l4", "nvidia-rtx-pro-6000": "rtx-pro-6000"}
# vLLM's batch defaults for its OpenAI server: 8192 tokens / 1024 sequences on GPUs of at least 70 GiB (not A100),
# 2048 / 256 below (EngineArgs.get_batch_defaults, vllm/engine/arg_utils.py, v0.28.0).
LARGE_GPU_GIB = 70
# CUDA context, cuBLAS workspaces and NCCL's buffers: outside torch's allocator, not in the profile.
NON_TORCH_GB = 1.5
ASSUMPTIONS = (
    "weights in bf16 (the merged export and the staged base are bf16); the KV cache in bf16 with keys and values on "
    "every layer (vLLM fills both slots of Gemma 4's k_eq_v layers); sliding-window layers keep window + one batch "
    "of tokens; the profiling pass holds one batch of activations (4 x hidden + 3 x intermediate per token) and "
    "two fp32 logit rows per scheduled sequence; LoRA: every linear layer of the decoder gets max_loras slots of "
    f"the max rank; {NON_TORCH_GB} GB outside torch. Left out: CUDA graphs (the service runs --enforce-eager), "
    "a vision tower the shape does not count (Gemma 4's), and fragmentation"
)


@dataclass(frozen=True)
class ServedMemory:
    """The estimate for one model on one GPU, in GB (1e9 bytes), and whether vLLM would start."""

    model: str
    gpu: str
    memory_gb: float
    utilization: float
    max_model_len: int
    weights_gb: float
    lora_gb: float
    activation_gb: float
    kv_per_request_gb: float
    kv_per_token_bytes: float

    @property
    def budget_gb(self) -> float:
        return self.memory_gb * self.utilization

    @property
    def kv_room_gb(self) -> float:
        """What is left for the KV cache after weights, LoRA slots, the profiling peak and the non-torch overhead."""
        return self.budget_gb - self.weights_gb - self.lora_gb - self.activation_gb - NON_TORCH_GB

    @property
    def fits(self) -> bool:
        return self.kv_room_gb >= self.kv_per_request_gb

    @property
    def full_context_requests(self) -> int:
        """How many requests of the whole served context the KV cache holds at once."""
        return max(0, int(self.kv_room_gb // self.kv_per_request_gb)) if self.kv_per_request_gb else 0

    def line(self) -> str:
        verdict = (
            f"fits: {self.kv_room_gb:.1f} GB left for the KV cache, {self.full_context_requests} request(s) of "
            f"{self.max_model_len} tokens at once"
            if self.fits
            else f"does NOT fit: {self.kv_room_gb:.1f} GB left for the KV cache, one request of {self.max_model_len} "
            f"tokens needs {self.kv_per_request_gb:.2f} GB"
        )
        lora = f" + LoRA slots {self.lora_gb:.1f}" if self.lora_gb else ""
        return (
            f"{self.model} on {self.gpu} ({self.memory_gb:.0f} GB x {self.utilization:g} = {self.budget_gb:.1f} GB for "
            f"vLLM): weights {self.weights_gb:.1f}{lora} + profiling peak {self.activation_gb:.1f} + "
            f"{NON_TORCH_GB} outside torch; {verdict}"
        )


class UnknownModelError(ValueError):
    """The memory model has no shape for the served model."""


def batch_defaults(gpu: str) -> tuple[int, int]:
    """vLLM's (max_num_batched_tokens, max_num_seqs) for its OpenAI server on this GPU."""
    memory_gib = GPUS[SERVING_GPUS[gpu]].memory_gb * GB / GIB
    return (8192, 1024) if memory_gib >= LARGE_GPU_GIB else (2048, 256)


def kv_bytes_per_token(shape: ModelShape, layer: int) -> int:
    """Keys and values of one token in one layer, bf16."""
    if shape.is_global(layer) and shape.global_head_dim:
        return 2 * (shape.global_kv_heads or shape.kv_heads) * shape.global_head_dim * BF16
    return 2 * shape.kv_heads * shape.head_dim * BF16


def kv_bytes_per_request(shape: ModelShape, max_model_len: int, batch_tokens: int) -> float:
    """One request of `max_model_len` tokens: full layers hold all of them, sliding layers window + one batch
    (vLLM's SlidingWindowSpec.max_memory_usage_bytes)."""
    total = 0.0
    for layer in range(shape.layers):
        tokens = max_model_len
        if shape.sliding_window and not shape.is_global(layer):
            tokens = min(max_model_len, shape.sliding_window + batch_tokens)
        total += tokens * kv_bytes_per_token(shape, layer)
    return total


def served_memory(
    model: str,
    gpu: str,
    max_model_len: int,
    *,
    utilization: float = 0.9,
    lora_rank: int | None = None,
    loras: int = 0,
    language_model_only: bool = False,
    max_num_seqs: int | None = None,
    untied_head: bool = False,
) -> ServedMemory:
    """The estimate for `model` (a Hub id or a folder the memory model reads) served by vLLM on `gpu`; `untied_head`:
    a merged export whose head was trained apart from the embeddings (`modules_to_save`), a tensor of its own."""
    shape = model_shape(model, REPO_ROOT)
    if shape is None:
        raise UnknownModelError(f"no shape for {model!r} in trainer/memory_plan.py (MODEL_SHAPES) or a config.json")
    batch_tokens, default_seqs = batch_defaults(gpu)
    seqs = min(max_num_seqs or default_seqs, default_seqs * 4)
    params = shape.params + (0 if language_model_only else shape.vision_params)
    if untied_head and shape.tied_embeddings:
        params += shape.embedding_params
    lora = 0.0
    if lora_rank and loras:
        lora = shape.lora_params(lora_rank, "all-linear") * BF16 * loras
    activation = batch_tokens * (4 * shape.hidden + 3 * shape.intermediate) * BF16 + 2 * seqs * shape.vocab * 4
    kv = kv_bytes_per_request(shape, max_model_len, batch_tokens)
    return ServedMemory(
        model=model,
        gpu=gpu,
        memory_gb=GPUS[SERVING_GPUS[gpu]].memory_gb,
        utilization=utilization,
        max_model_len=max_model_len,
        weights_gb=params * BF16 / GB,
        lora_gb=lora / GB,
        activation_gb=activation / GB,
        kv_per_request_gb=kv / GB,
        kv_per_token_bytes=sum(kv_bytes_per_token(shape, n) for n in range(shape.layers)),
    )


def longest_context_that_fits(estimate: ServedMemory, step: int = 512) -> int | None:
    """The longest served context (a multiple of `step`) one request of which still fits, or None when none does."""
    shape = model_shape(estimate.model, REPO_ROOT)
    assert shape is not None, "served_memory found it"
    batch_tokens, _ = batch_defaults(estimate.gpu)
    room = estimate.kv_room_gb * GB
    low, high = 0, (1 << 20) // step  # in steps; the answer lies in [low, high]
    while low < high:
        mid = (low + high + 1) // 2
        if kv_bytes_per_request(shape, mid * step, batch_tokens) <= room:
            low = mid
        else:
            high = mid - 1
    return low * step or None
