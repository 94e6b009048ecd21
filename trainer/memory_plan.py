"""Per-GPU memory of a LoRA run, and the data-parallel strategy recipe validation picks from it.

Decision: `distributed.strategy: auto` trains with the strategy that moves the fewest frozen bytes and still fits
one GPU (`distributed.gpu`): `ddp` (the base replicated, only LoRA gradients all-reduced), then `fsdp` with
`fsdp_reshard_after_forward: false` (each layer gathered once per micro-step), then `fsdp` resharding after
forward (gathered twice). An explicit `ddp` or `fsdp` is checked the same way and refused when it does not fit.
The estimate (`estimate`) is deliberately simple and conservative (bench/mfu_estimate.py prints it).

Model shapes come from the published config (`MODEL_SHAPES`, keyed by Hub id), else from a local folder's
config.json or the one the Hugging Face cache holds (`model_shape`); an unknown remote model has no shape, and a
stack refuses it (infra/config.py). Frozen weights are bf16, or 4-bit for QLoRA (`weight_bytes`); a Gemma 3
vision checkpoint adds its SigLIP tower and projector. Sources: docs/trainer.md#model-memory-refuse-what-the-gpus-cannot-hold.
Standard library only: recipe validation runs in the Pulumi program, which has no torch.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GB = 1e9
STRATEGIES = ("ddp", "fsdp-gathered", "fsdp")  # the order `auto` tries them in


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator: memory for the run, dense bf16 peak, NVLink bandwidth per direction, HBM bandwidth.

    The memory model needs `memory_gb` only; bench/mfu_estimate.py also the speeds, which are left None where
    they were not checked (it refuses such a GPU)."""

    name: str
    memory_gb: float
    bf16_dense_tflops: float | None
    nvlink_gb_s: float | None
    hbm_tb_s: float | None
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
    # The other GPUs a stack can train on (infra/catalog.py TRAINING_GPU), by the GPU memory Google lists for
    # them (cloud.google.com/compute/docs/gpus, "GPU models"): H100 80 GB (A3 High and A3 Mega), L4 24 GB (G2,
    # Cloud Run), RTX PRO 6000 96 GB (G4, Cloud Run). Their speeds are not needed here and were not checked.
    "h100": GpuSpec("H100", 80, None, None, None, "cloud.google.com/compute/docs/gpus (H100 80GB)"),
    "l4": GpuSpec("L4", 24, None, None, None, "cloud.google.com/compute/docs/gpus (L4)"),
    "rtx-pro-6000": GpuSpec("RTX PRO 6000", 96, None, None, None, "cloud.google.com/compute/docs/gpus (RTX PRO 6000)"),
}


@dataclass(frozen=True)
class VisionShape:
    """A Gemma 3 checkpoint's SigLIP vision tower (transformers models/siglip/modeling_siglip.py) and the projector
    into the decoder (models/gemma3/modeling_gemma3.py Gemma3MultiModalProjector)."""

    hidden: int
    intermediate: int
    layers: int
    patch_size: int
    image_size: int
    channels: int = 3
    tokens_per_image: int = 256  # mm_tokens_per_image: the decoder positions one image takes

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def projections(self) -> dict[str, tuple[int, int]]:
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, h), "k_proj": (h, h), "v_proj": (h, h), "out_proj": (h, h), "fc1": (h, i), "fc2": (i, h)}

    @property
    def linear_params(self) -> int:
        """The weights of its nn.Linear layers (4-bit under QLoRA)."""
        return self.layers * sum(a * b for a, b in self.projections().values())

    def other_params(self, text_hidden: int) -> int:
        """The rest, kept in bf16 under QLoRA: the linear layers' biases and the two LayerNorms of each layer, the
        patch and position embeddings, the last LayerNorm, and the projector's matrix and RMSNorm."""
        h, i = self.hidden, self.intermediate
        per_layer = 4 * h + i + h + 2 * 2 * h
        embeddings = self.channels * self.patch_size**2 * h + h + self.patches * h
        return self.layers * per_layer + embeddings + 2 * h + h * text_hidden + h

    def lora_params(self, r: int, targets: list[str] | str) -> int:
        per_layer = sum(
            r * (a + b) for name, (a, b) in self.projections().items() if targets == "all-linear" or name in targets
        )
        return self.layers * per_layer


@dataclass(frozen=True)
class ModelShape:
    """The text decoder's widths, enough to count weights, LoRA parameters and activations (and a vision tower's)."""

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
    vision: VisionShape | None = None  # a vision checkpoint's tower: loaded with the decoder, text_only or not
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

    @functools.cached_property
    def layer_params(self) -> tuple[int, ...]:
        """Each layer's projection weights (counted once per shape: config validation asks for every variant)."""
        return tuple(sum(a * b for a, b in self.projections(n).values()) for n in range(self.layers))

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """The text decoder's weights (norms are negligible and left out; a tied head is the embedding)."""
        head = 0 if self.tied_embeddings else self.embedding_params
        return sum(self.layer_params) + self.embedding_params + head

    @property
    def vision_params(self) -> int:
        return self.vision.linear_params + self.vision.other_params(self.hidden) if self.vision else 0

    @property
    def total_params(self) -> int:
        """Every weight the checkpoint loads: the decoder and, for a vision checkpoint, its tower and projector."""
        return self.params + self.vision_params

    def weight_bytes(self, quantization: Quantization | None = None) -> float:
        """Bytes of the frozen weights: bf16, or under QLoRA every nn.Linear but the head in 4 bit and the rest bf16.

        transformers' bitsandbytes quantizer converts the nn.Linear modules except the output embedding and tied
        weights (quantizers/base.py `get_keys_to_not_convert`); embeddings, norms and the vision tower's
        biases, patch/position embeddings and projector stay in the compute dtype."""
        if quantization is None:
            return self.total_params * 2
        linear = sum(self.layer_params) + (self.vision.linear_params if self.vision else 0)
        rest = self.total_params - linear
        return linear * quantization.bytes_per_weight + rest * 2

    def layer_bytes(self, layer: int, quantization: Quantization | None = None) -> float:
        return self.layer_params[layer] * (quantization.bytes_per_weight if quantization else 2)

    def lora_params(self, r: int, targets: list[str] | str, vision_tower: bool = False) -> int:
        total = 0
        for layer in range(self.layers):
            for name, (a, b) in self.projections(layer).items():
                if targets == "all-linear" or name in targets:
                    total += r * (a + b)
        if vision_tower and self.vision:
            total += self.vision.lora_params(r, targets)
        return total


@dataclass(frozen=True)
class Quantization:
    """QLoRA's 4-bit storage (bitsandbytes 0.50 functional.py `quantize_4bit`): two weights per byte and one fp32
    absmax per block of 64; with double quantization the absmaxes are themselves quantized to 8 bit in blocks of
    256 (`compress_statistics`: one byte each plus an fp32 absmax per 256)."""

    double_quant: bool = False

    @property
    def bytes_per_weight(self) -> float:
        return 0.5 + (1 / 64 + 4 / (64 * 256) if self.double_quant else 4 / 64)


def _hub(model_id: str) -> str:
    return f"https://huggingface.co/google/{model_id}/blob/main/config.json"


# Gemma 3's SigLIP tower, as every Gemma 3 vision checkpoint's config.json gives it (vision_config: hidden_size 1152,
# intermediate_size 4304, num_hidden_layers 27, patch_size 14, image_size 896; mm_tokens_per_image 256).
_SIGLIP = VisionShape(hidden=1152, intermediate=4304, layers=27, patch_size=14, image_size=896)


def _gemma3(model_id: str, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int,
            vocab: int, window: int, vision: bool) -> ModelShape:  # fmt: skip
    """A Gemma 3 shape from its config.json (text_config for the vision checkpoints): five sliding-window layers
    to one global, tied embeddings."""
    return ModelShape(
        hidden=hidden,
        intermediate=intermediate,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        sliding_window=window,
        layer_types=tuple("full_attention" if (n + 1) % 6 == 0 else "sliding_attention" for n in range(layers)),
        vision=_SIGLIP if vision else None,
        source=_hub(model_id) + (" (text_config, vision_config)" if vision else ""),
    )


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
    source=_hub("gemma-4-31B-it")
    + " (text_config; its vision tower is not counted: docs/trainer.md#model-memory-refuse-what-the-gpus-cannot-hold)",
)

# Hub id (lower case) -> shape. Each entry's numbers are its config.json's (the copies they were checked against:
# docs/trainer.md#model-memory-refuse-what-the-gpus-cannot-hold); -pt and -it checkpoints of a size share one config.
_GEMMA3 = {
    "gemma-3-270m": (640, 2048, 18, 4, 1, 256, 262_144, 512, False),
    "gemma-3-1b": (1152, 6912, 26, 4, 1, 256, 262_144, 512, False),
    "gemma-3-4b": (2560, 10240, 34, 8, 4, 256, 262_208, 1024, True),
    "gemma-3-12b": (3840, 15360, 48, 16, 8, 256, 262_208, 1024, True),
    "gemma-3-27b": (5376, 21504, 62, 32, 16, 128, 262_208, 1024, True),
}
MODEL_SHAPES: dict[str, ModelShape] = {"google/gemma-4-31b-it": _GEMMA4_31B, "google/gemma-4-31b": _GEMMA4_31B}
for _size, _dims in _GEMMA3.items():
    for _suffix in ("-it", "-pt") if _size != "gemma-3-270m" else ("", "-it"):
        MODEL_SHAPES[f"google/{_size}{_suffix}"] = _gemma3(f"{_size}{_suffix}", *_dims)
# the 270M this machine builds from a PyPI package (trainer/local_model.py): Gemma 3 270M's shape
MODEL_SHAPES["local:gemma3-270m"] = _gemma3("gemma-3-270m", *_GEMMA3["gemma-3-270m"])


class ShapeError(ValueError):
    """A config.json whose model the formulas here cannot count (the message says what it has)."""


# Text-config keys of architectures these formulas do not count: mixture of experts, per-layer input embeddings
# (Gemma 3n, Gemma 4 E2B/E4B), layers sharing another layer's KV cache.
_UNCOUNTED = (
    "num_experts",
    "num_local_experts",
    "enable_moe_block",
    "hidden_size_per_layer_input",
    "num_kv_shared_layers",
)


def shape_from_config(config: dict[str, Any], source: str) -> ModelShape:
    """A ModelShape from a transformers config.json (its text_config when it has one; a SigLIP vision_config too).

    Raises ShapeError for an architecture the formulas do not count (`_UNCOUNTED`)."""
    text = config.get("text_config") or config
    found = [key for key in _UNCOUNTED if text.get(key)]
    if found:
        raise ShapeError(
            f"{source} has {', '.join(f'{k}={text[k]}' for k in found)}: the memory model counts dense decoders "
            "without per-layer embeddings or shared KV layers only"
        )
    layers = int(text["num_hidden_layers"])
    heads = int(text["num_attention_heads"])
    vision_config = config.get("vision_config") or {}
    vision = None
    if "siglip" in str(vision_config.get("model_type", "")):
        vision = VisionShape(
            hidden=int(vision_config["hidden_size"]),
            intermediate=int(vision_config["intermediate_size"]),
            layers=int(vision_config["num_hidden_layers"]),
            patch_size=int(vision_config["patch_size"]),
            image_size=int(vision_config["image_size"]),
            channels=int(vision_config.get("num_channels", 3)),
            tokens_per_image=int(config.get("mm_tokens_per_image") or 256),
        )
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
        vision=vision,
        source=source,
    )


_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def hub_cache_dir() -> Path:
    """Where huggingface_hub caches downloads: $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub,
    else ~/.cache/huggingface/hub (huggingface_hub 2.4 constants.py)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def cached_config(repo_id: str, revision: str | None = None) -> Path | None:
    """The Hub model's config.json in the local Hugging Face cache, or None: `models--ORG--NAME/snapshots/<commit>/`,
    the commit read from `refs/<revision>` (default `main`) unless the revision is the commit itself
    (huggingface_hub 2.4 file_download.py `repo_folder_name`, `try_to_load_from_cache`)."""
    if not _HUB_ID.match(repo_id):
        return None
    folder = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    ref = folder / "refs" / (revision or "main")
    commit = ref.read_text().strip() if ref.is_file() else (revision or "")
    config = folder / "snapshots" / commit / "config.json" if commit else None
    return config if config is not None and config.is_file() else None


def find_shape(name_or_path: str, repo_root: Path, revision: str | None = None) -> tuple[ModelShape | None, str]:
    """The model's shape and where it came from, or None and why there is none.

    In order: the published shape of a known Hub id (`MODEL_SHAPES`), a local folder's config.json (absolute, or
    relative to the working directory or `repo_root`), the config.json the Hugging Face cache holds for a Hub id."""
    known = MODEL_SHAPES.get(name_or_path.lower())
    if known is not None:
        return known, known.source
    configs = [folder / "config.json" for folder in (Path(name_or_path), repo_root / name_or_path)]
    cached = cached_config(name_or_path, revision)
    for config in [*configs, *([cached] if cached else [])]:
        if config.is_file():
            try:
                return shape_from_config(json.loads(config.read_text()), str(config)), str(config)
            except (ShapeError, KeyError, TypeError, ValueError) as exc:
                return None, f"{config} cannot be counted ({type(exc).__name__}: {exc})"
    return None, (
        f"{name_or_path} is not a Gemma the memory model knows (trainer/memory_plan.py MODEL_SHAPES), not a folder "
        f"with a config.json, and the Hugging Face cache ({hub_cache_dir()}) has no config.json for it"
    )


def model_shape(name_or_path: str, repo_root: Path, revision: str | None = None) -> ModelShape | None:
    """The published shape of a known Hub model, else a local (or cached) config.json's, else None (`find_shape`)."""
    return find_shape(name_or_path, repo_root, revision)[0]


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


def vision_activation_bytes_per_image(vision: VisionShape, gradient_checkpointing: bool) -> float:
    """What autograd keeps of one image in an adapted vision tower: each patch through each layer, by the decoder
    layer's fit at the tower's widths (an approximation: SigLIP's MLP has two projections, not three)."""
    shape = ModelShape(vision.hidden, vision.intermediate, 1, 1, 1, vision.hidden, 1)
    per_layer = activation_bytes_per_token(shape, 0)
    per_patch = vision.layers * 2 * vision.hidden + per_layer if gradient_checkpointing else vision.layers * per_layer
    return per_patch * vision.patches


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
    quantization: Quantization | None = None,
    images_per_micro_batch: int = 0,
    vision_tower_lora: bool = False,
) -> Estimate:
    """Peak bytes per GPU of a LoRA step (bf16 or 4-bit base, fp32 adapters, bf16 saved modules, AdamW) under `strategy`.

    `fsdp-gathered` is FSDP2 with reshard_after_forward=False: every layer stays unsharded from its
    forward to its backward, so at the turn of the step the whole base is unsharded on each GPU. Under QLoRA one
    projection at a time is dequantized to bf16 for its matmul. Each image of a vision checkpoint's micro-batch
    takes `tokens_per_image` decoder positions beside `tokens_per_micro_batch`.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: one of {STRATEGIES}")
    weights = shape.weight_bytes(quantization) / GB
    shard = weights / world_size
    if strategy == "ddp":
        frozen = weights
    elif strategy == "fsdp-gathered":
        frozen = shard + weights
    else:  # two layers in flight (the one computing, the one prefetched) and the embedding / head when used
        biggest = max(shape.layer_bytes(n, quantization) for n in range(shape.layers))
        frozen = shard + (2 * biggest + shape.embedding_params * 2) / GB
    if quantization is not None:
        frozen += max(a * b for a, b in shape.projections(0).values()) * 2 / GB
    lora = shape.lora_params(lora_r, lora_targets, vision_tower_lora)
    # LoRA adapters in fp32, QLoRA's too (trainer/lm_head.py `adapters_in_fp32`): weight + grad + AdamW m and v =
    # 16 B, and DDP's fp32 gradient bucket. Saved full modules (`lora.modules_to_save`) train in the model's bf16:
    # weight + grad 4 B, AdamW's moments in the parameter's dtype 4 B, DDP's bf16 bucket 2 B. FSDP shards it all.
    state = (lora * 20 + modules_to_save_params * 10 if strategy == "ddp" else
             (lora * 16 + modules_to_save_params * 8) / world_size) / GB  # fmt: skip
    per_layer = [activation_bytes_per_token(shape, n) for n in range(shape.layers)]
    # with checkpointing each layer keeps only its input, and one layer's activations at a time are recomputed
    act_per_token = shape.layers * 2 * shape.hidden + max(per_layer) if gradient_checkpointing else sum(per_layer)
    tokens = tokens_per_micro_batch + (images_per_micro_batch * shape.vision.tokens_per_image if shape.vision else 0)
    activations = act_per_token * tokens / GB
    if shape.vision and vision_tower_lora:
        activations += (
            images_per_micro_batch * vision_activation_bytes_per_image(shape.vision, gradient_checkpointing) / GB
        )
    head = tokens * shape.vocab * 4 * 2 / GB  # at most fp32 logits and their gradient
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
