"""Per-GPU memory of a LoRA run, and the data-parallel strategy recipe validation picks from it.

Decision: a recipe with `distributed.strategy: auto` trains with the strategy that moves the fewest
frozen bytes and still fits one GPU (`distributed.gpu`), in this order:
1. `ddp`: the frozen base replicated on every GPU; only the LoRA gradients are all-reduced, once per
   update. Nothing else crosses NVLink.
2. `fsdp` with `fsdp_reshard_after_forward: false`: the base sharded at rest, each layer gathered once
   per micro-step and kept until its backward (FSDP2 `reshard_after_forward=False`).
3. `fsdp` resharding after forward (the seed's): each layer gathered twice per micro-step.
An explicit `ddp` or `fsdp` is checked the same way and refused when it does not fit. The estimate
(`estimate`) is deliberately simple and conservative; bench/mfu_estimate.py prints it beside the
expected MFU of each choice, and bench/RESULTS.md records both.

Model shapes come from the published config (`MODEL_SHAPES`, keyed by Hub id) or from a local
folder's config.json. This module imports nothing beyond the standard library: recipe validation runs
in the Pulumi program, which has no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GB = 1e9
STRATEGIES = ("ddp", "fsdp-gathered", "fsdp")  # the order `auto` tries them in


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator: memory for the run, dense bf16 peak, NVLink bandwidth per direction, HBM bandwidth."""

    name: str
    memory_gb: float
    bf16_dense_tflops: float
    nvlink_gb_s: float
    hbm_tb_s: float
    source: str


GPUS = {
    # A4 (a4-highgpu-8g): 8 x B200 with 180 GB HBM3e each
    # (cloud.google.com/compute/docs/accelerator-optimized-machines). HGX B200: 36 PFLOPS bf16 for 8 GPUs
    # *with sparsity*, so 2.25 PFLOPS dense per GPU; NVLink 5: 1.8 TB/s per GPU (both directions);
    # HBM3e ~8 TB/s per GPU (nvidia.com/en-us/data-center/hgx/, HGX B200 specifications).
    "b200": GpuSpec("B200", 180, 2250, 900, 8.0, "nvidia.com/en-us/data-center/hgx/ (HGX B200)"),
    # H200 SXM: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS dense bf16 (1,979 with sparsity), NVLink 900 GB/s
    # both directions (nvidia.com/en-us/data-center/h200/).
    "h200": GpuSpec("H200", 141, 989, 450, 4.8, "nvidia.com/en-us/data-center/h200/"),
}


@dataclass(frozen=True)
class ModelShape:
    """The text decoder's widths, enough to count weights, LoRA parameters and activations."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    global_head_dim: int | None = None  # Gemma 4's full-attention layers
    global_kv_heads: int | None = None
    k_eq_v: bool = False  # Gemma 4 31B's full-attention layers use the keys as values (no v_proj)
    tied_embeddings: bool = True
    source: str = ""

    def is_global(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "full_attention"

    def attention_widths(self, layer: int) -> tuple[int, int, bool]:
        """(query width, key/value width, has v_proj) of one layer."""
        if self.is_global(layer) and self.global_head_dim:
            kv = (self.global_kv_heads or self.kv_heads) * self.global_head_dim
            return self.heads * self.global_head_dim, kv, not self.k_eq_v
        return self.heads * self.head_dim, self.kv_heads * self.head_dim, True

    def projections(self, layer: int) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear projection of one layer."""
        q, kv, has_v = self.attention_widths(layer)
        h, i = self.hidden, self.intermediate
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "o_proj": (q, h)}
        if has_v:
            shapes["v_proj"] = (h, kv)
        shapes |= {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        return shapes

    @property
    def layer_params(self) -> list[int]:
        return [sum(a * b for a, b in self.projections(n).values()) for n in range(self.layers)]

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Frozen weights held in memory (norms are negligible and left out; a tied head is the embedding)."""
        head = 0 if self.tied_embeddings else self.embedding_params
        return sum(self.layer_params) + self.embedding_params + head

    def lora_params(self, r: int, targets: list[str] | str) -> int:
        total = 0
        for layer in range(self.layers):
            for name, (a, b) in self.projections(layer).items():
                if targets == "all-linear" or name in targets:
                    total += r * (a + b)
        return total


_GEMMA4_31B = ModelShape(
    hidden=5376,
    intermediate=21504,
    layers=60,
    heads=32,
    kv_heads=16,
    head_dim=256,
    vocab=262_144,
    sliding_window=1024,
    layer_types=tuple((["sliding_attention"] * 5 + ["full_attention"]) * 10),
    global_head_dim=512,
    global_kv_heads=4,
    k_eq_v=True,
    source="huggingface.co/google/gemma-4-31B-it/blob/main/config.json (text_config)",
)
MODEL_SHAPES = {"google/gemma-4-31b-it": _GEMMA4_31B, "google/gemma-4-31b": _GEMMA4_31B}


def shape_from_config(config: dict[str, Any], source: str) -> ModelShape:
    """A ModelShape from a transformers config.json (its text_config when it has one)."""
    text = config.get("text_config") or config
    layers = int(text["num_hidden_layers"])
    heads = int(text["num_attention_heads"])
    return ModelShape(
        hidden=int(text["hidden_size"]),
        intermediate=int(text["intermediate_size"]),
        layers=layers,
        heads=heads,
        kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or text["hidden_size"] // heads),
        vocab=int(text["vocab_size"]),
        sliding_window=text.get("sliding_window"),
        layer_types=tuple(text.get("layer_types") or ()),
        global_head_dim=text.get("global_head_dim"),
        global_kv_heads=text.get("num_global_key_value_heads"),
        k_eq_v=bool(text.get("attention_k_eq_v", False)),
        tied_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
        source=source,
    )


def model_shape(name_or_path: str, repo_root: Path) -> ModelShape | None:
    """The published shape of a known Hub model, else a local folder's config.json, else None."""
    known = MODEL_SHAPES.get(name_or_path.lower())
    if known is not None:
        return known
    for folder in (Path(name_or_path), repo_root / name_or_path):
        config = folder / "config.json"
        if config.is_file():
            return shape_from_config(json.loads(config.read_text()), str(config))
    return None


# Bytes autograd keeps per token per decoder layer (bf16 activations, fp32 LoRA r16 with dropout on the 7
# projections, sdpa, no checkpointing): a + b*hidden + c*intermediate + d*q_width + e*kv_width, fitted to
# bench/activation_memory.py (one Gemma decoder layer, its saved tensors counted) at four small widths; at
# Gemma 3 27B's widths the fit gives 688,035 B against 688,048 B measured. Fewer LoRA targets save less.
_ACT = (1008.0, 56.5, 14.0, 16.06, 8.03)
CUDA_RESERVE_GB = 10.0  # CUDA context, NCCL buffers, the allocator's own
USABLE_FRACTION = 0.9  # the caching allocator fragments: plan for 90% of the GPU


def activation_bytes_per_token(shape: ModelShape, layer: int) -> float:
    q, kv, _ = shape.attention_widths(layer)
    a, b, c, d, e = _ACT
    return a + b * shape.hidden + c * shape.intermediate + d * q + e * kv


@dataclass(frozen=True)
class Estimate:
    """Per-GPU memory of one strategy, term by term (GB), against what the GPU offers."""

    strategy: str
    terms: dict[str, float] = field(default_factory=dict)
    usable_gb: float = 0.0

    @property
    def total_gb(self) -> float:
        return sum(self.terms.values())

    @property
    def fits(self) -> bool:
        return self.total_gb <= self.usable_gb

    def line(self) -> str:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self.terms.items())
        return f"{self.strategy}: ~{self.total_gb:.0f} GB of {self.usable_gb:.0f} usable ({parts})"


def estimate(
    shape: ModelShape,
    gpu: GpuSpec,
    strategy: str,
    *,
    world_size: int,
    tokens_per_micro_batch: int,
    lora_r: int,
    lora_targets: list[str] | str,
    modules_to_save_params: int = 0,
    gradient_checkpointing: bool = False,
) -> Estimate:
    """Peak bytes per GPU of a LoRA step (bf16 base, fp32 adapters, AdamW) under `strategy`.

    `fsdp-gathered` is FSDP2 with reshard_after_forward=False: every layer stays unsharded from its
    forward to its backward, so at the turn of the step the whole base is unsharded on each GPU.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: one of {STRATEGIES}")
    weights = shape.params * 2 / GB
    shard = weights / world_size
    if strategy == "ddp":
        frozen = weights
    elif strategy == "fsdp-gathered":
        frozen = shard + weights
    else:  # two layers in flight (the one computing, the one prefetched) and the embedding / head when used
        frozen = shard + (2 * max(shape.layer_params) + shape.embedding_params) * 2 / GB
    trainable = shape.lora_params(lora_r, lora_targets) + modules_to_save_params
    # fp32 weight + grad + AdamW m and v = 16 B; DDP adds its fp32 gradient buckets, FSDP shards all of it
    state = trainable * (20 if strategy == "ddp" else 16 / world_size) / GB
    per_layer = [activation_bytes_per_token(shape, n) for n in range(shape.layers)]
    # with checkpointing each layer keeps only its input, and one layer's activations at a time are recomputed
    act_per_token = shape.layers * 2 * shape.hidden + max(per_layer) if gradient_checkpointing else sum(per_layer)
    activations = act_per_token * tokens_per_micro_batch / GB
    head = tokens_per_micro_batch * shape.vocab * 4 * 2 / GB  # at most fp32 logits and their gradient
    terms = {
        "frozen weights": frozen,
        "LoRA state": state,
        "activations": activations,
        "LM head": head,
        "CUDA/NCCL": CUDA_RESERVE_GB,
    }
    return Estimate(strategy, terms, gpu.memory_gb * USABLE_FRACTION)


def choose(estimates: dict[str, Estimate]) -> str | None:
    """The first strategy in STRATEGIES that fits, or None."""
    return next((s for s in STRATEGIES if s in estimates and estimates[s].fits), None)
