"""The GPU check's W1 measurements (bench/gpu_check.py runs each in a process of its own; `--dry-run` on a CPU).

- `block_stack`: Gemma 4 31B's decoder at its real widths (`step_ops.w1_text_config`: 5 sliding : 1 global, 512-wide
  global heads, keys as values, the 262,144-token head), 6 and 12 layers with random bf16 weights, trained through
  the trainer's own build_trainer with W1's recipe (packed 1,024-token rows, LoRA r16 on 7 projections), eager or
  with `training.compile: regional`, sdpa or flex attention. Reports the time per micro-step at each depth, the
  per-layer and full-model (60 layers) extrapolation and the MFU it implies, the GPU-busy fraction and the attention
  kernels from torch.profiler, and the SDPA backend torch picks for a global and a sliding layer.
- `ddp_wrapper`: the same 6-layer stack without a wrapper, in DDP as this trainer sets it, and in DDP as
  transformers sets it for a PeftModel (find_unused_parameters, broadcast_buffers): one rank, NCCL (gloo in the dry
  run), through the Trainer's loop.
- `qlora`: W3's recipe on the Gemma 3 1B shape (random weights saved once) in 4 bit: the adapters' dtype, tokens/s.

The model and tokenizer are built here, all else (sft_config, LoRA, new_sft_trainer, compiling, DDP's settings) is
the trainer's. Loss values are meaningless (random weights); times are not.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import step_ops  # noqa: E402

DEPTHS = (6, 12)
# the first update is warm-up (compilation, allocator), the last is profiled, the ones between are timed: the
# profiler's own work per operation (a few µs) would slow a host-bound eager step and flatter the compiled one
UPDATES = 4
MICRO_STEPS = 4  # per update (W1 accumulates 16)
DRY_RUN_STEPS = (3, 2)  # updates, micro-steps per update on a CPU: plumbing, not timing


def _device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def stack_model(layers: int, dry_run: bool, attn: str = "sdpa") -> Any:
    """A random Gemma4ForConditionalGeneration (W1's class) with Gemma 4 31B's decoder, `layers` deep: real widths
    in bf16 on the GPU, or (dry run) the CPU counter's 1/64 widths in fp32."""
    import torch
    from transformers import Gemma4ForConditionalGeneration

    from tests.tiny_models import gemma4_config, tiny_tokenizer

    image_token = tiny_tokenizer().convert_tokens_to_ids("<start_of_image>")
    text = step_ops.w1_text_config(
        layers, 64 if dry_run else 1, 4 if dry_run else 1, vocab=None if dry_run else 262_144
    )
    config = gemma4_config(600 if dry_run else 262_144, image_token, **text)
    config._attn_implementation = attn
    dtype = torch.float32 if dry_run else torch.bfloat16
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(_device()):
            model = Gemma4ForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(default)
    model.config._attn_implementation = attn
    return model


@contextlib.contextmanager
def model_in_place_of_loading(model: Any) -> Iterator[None]:
    """trainer.train's load_model returns `model` (random, already built) instead of reading weights."""
    from trainer import modeling

    loader = modeling.load_model
    modeling.load_model = lambda *args, **kwargs: model  # type: ignore[assignment]
    try:
        yield
    finally:
        modeling.load_model = loader  # type: ignore[assignment]


def tokenizer_dir(workdir: Path) -> Path:
    """The tests' tiny tokenizer with Gemma 4's chat template: its ids fit any Gemma embedding."""
    from tests.tiny_models import tiny_tokenizer
    from trainer.local_model import trl_chat_template

    folder = workdir / "tokenizer"
    if not folder.is_dir():
        tokenizer = tiny_tokenizer()
        tokenizer.chat_template = trl_chat_template("gemma4")
        tokenizer.save_pretrained(folder)
    return folder


def update_timer(profile_update: int | None) -> Any:
    """A TrainerCallback timing each update (the GPU synchronised at its ends) and profiling one of them."""
    import torch
    from transformers import TrainerCallback

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class UpdateTimer(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.profile: Any = None
            self.events: Any = None
            self._started = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            sync()
            if state.global_step == profile_update:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.profile = torch.profiler.profile(activities=activities)
                self.profile.__enter__()
            self._started = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            sync()
            self.seconds.append(time.perf_counter() - self._started)
            if self.profile is not None:
                self.profile.__exit__(None, None, None)
                self.events = self.profile.events()
                self.profile = None

    return UpdateTimer()


def gpu_profile(events: Any, wall_s: float) -> dict[str, Any]:
    """The GPU time of one profiled update over `wall_s` (an unprofiled update's: the profiler slows the host), its
    kernel count and the attention kernels that ran."""
    from torch.autograd import DeviceType

    kernels = [e for e in events or [] if getattr(e, "device_type", None) == DeviceType.CUDA]
    if not kernels:
        return {"gpu_busy_fraction": None, "gpu_kernels": 0, "attention_kernels": []}
    busy_us = sum(e.self_device_time_total for e in kernels)
    names = sorted(
        {
            e.name[:80]
            for e in kernels
            if any(k in e.name.lower() for k in ("fmha", "flash", "attention", "cudnn", "sdpa"))
        }
    )
    return {
        "gpu_busy_fraction": round(busy_us / 1e6 / wall_s, 3),
        "gpu_kernels": len(kernels),
        "attention_kernels": names[:8],
    }


def sdpa_backends(model: Any, rows: int) -> dict[str, str]:
    """The backend torch's dispatcher picks for a global and a sliding layer of `model` with a packed block mask."""
    import torch
    from torch.nn.attention import SDPBackend

    picked = {}
    attention = [m for m in model.modules() if hasattr(m, "is_sliding") and hasattr(m, "k_proj")]
    for kind, sliding in (("global", False), ("sliding", True)):
        layer = next(m for m in attention if m.is_sliding is sliding)
        head_dim, heads = layer.head_dim, layer.q_proj.out_features // layer.head_dim
        kv = layer.k_proj.out_features // head_dim
        dtype = layer.q_proj.weight.dtype
        q = torch.randn(1, heads, rows, head_dim, device=_device(), dtype=dtype)
        k = torch.randn(
            1, heads, rows, head_dim, device=_device(), dtype=dtype
        )  # the kv heads repeated, as sdpa gets them
        mask = torch.ones(rows, rows, device=_device(), dtype=torch.bool).tril()[None, None]
        choice = torch._fused_sdp_choice(q, k, k, mask, 0.0, False)
        picked[kind] = f"{SDPBackend(choice).name} (head_dim {head_dim}, {kv} kv heads)"
    return picked


def _w1_recipe(workdir: Path, tag: str, extra: tuple[str, ...], updates: int, micro_steps: int) -> Any:
    from trainer.recipe import load_recipe

    overrides = step_ops.w1_overrides(tokenizer_dir(workdir), workdir / f"run-{tag}", updates, extra)
    overrides = [o for o in overrides if not o.startswith(("model.dtype", "training.gradient_accumulation_steps"))]
    overrides.append(f"training.gradient_accumulation_steps={micro_steps}")
    return load_recipe(step_ops.W1, overrides)


def train_stack(
    model: Any, workdir: Path, tag: str, extra: tuple[str, ...] = (), wrap: Any = None, dry_run: bool = False
) -> dict[str, Any]:
    """W1's trainer on `model`: seconds per micro-step after the warm-up update, tokens per micro-step, profile."""
    from trainer.checkpoints import OutputLocation
    from trainer.train import build_trainer, ddp_settings

    updates, micro_steps = DRY_RUN_STEPS if dry_run else (UPDATES, MICRO_STEPS)
    recipe = _w1_recipe(workdir, tag, extra, updates, micro_steps)
    timer = update_timer(profile_update=updates - 1)
    with model_in_place_of_loading(model):
        trainer, _ = build_trainer(recipe, OutputLocation.from_dir(recipe.output.dir), [timer])
    if wrap is not None:
        trainer.model_wrapped = wrap(trainer)
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    timed = timer.seconds[1:-1]  # not the warm-up, not the profiled update
    micro = statistics.fmean(timed) / micro_steps
    tokens = trainer.state.num_input_tokens_seen / (updates * micro_steps)
    return {
        "seconds_per_micro_step": round(micro, 4),
        "first_update_s": round(timer.seconds[0], 1),
        "tokens_per_micro_step": round(tokens, 1),
        "tokens_per_second": round(tokens / micro, 1),
        "wall_s": round(wall, 1),
        "ddp": ddp_settings(trainer.model_wrapped),
        "profiled_update_s": round(timer.seconds[-1], 3),
        # the profiled update's GPU time over an unprofiled update's wall time (the same work, rows aside)
        **gpu_profile(timer.events, statistics.fmean(timed)),
    }


def full_model_mfu(per_depth: dict[int, dict[str, Any]], peak_tflops: float) -> dict[str, Any]:
    """The 60-layer micro-step from two depths (time = outside + layers x per-layer) and the MFU it implies at W1's
    useful FLOPs per token (bench/mfu_estimate.py's count)."""
    from bench.mfu_estimate import useful_flops_per_token

    (shallow, a), (deep, b) = sorted(per_depth.items())
    per_layer = (b["seconds_per_micro_step"] - a["seconds_per_micro_step"]) / (deep - shallow)
    outside = a["seconds_per_micro_step"] - shallow * per_layer
    layers = step_ops.W1_SHAPE.layers
    full_s = outside + layers * per_layer
    from trainer.recipe import load_recipe, sample_token_lengths

    recipe = load_recipe(step_ops.W1)
    lengths = sample_token_lengths()["tasks"][recipe.data.task.value]["conversation"]
    mean_len = statistics.fmean(n for n in lengths if n <= recipe.training.max_length)  # Gemma's tokenizer's count
    tokens = a["tokens_per_micro_step"]
    lora = step_ops.W1_SHAPE.lora_params(recipe.lora.r, recipe.lora.target_modules)
    flops = tokens * useful_flops_per_token(step_ops.W1_SHAPE, lora, mean_len)
    return {
        "per_layer_ms": round(per_layer * 1e3, 3),
        "outside_layers_ms": round(outside * 1e3, 2),
        "full_model_micro_step_ms": round(full_s * 1e3, 1),
        "full_model_mfu": round(flops / (full_s * peak_tflops * 1e12), 4) if full_s > 0 else None,
    }


def block_stack(spec: dict[str, Any]) -> dict[str, Any]:
    """The real-width stack at two depths (`variant`: eager | compiled | flex)."""
    import gc

    import torch

    from trainer import regional_compile

    dry_run, variant = spec["dry_run"], spec["variant"]
    workdir = Path(spec["out_dir"])
    extra = (f"training.compile={'regional' if variant == 'compiled' else 'none'}",)
    if dry_run and variant == "compiled":
        regional_compile.BACKEND = "eager"  # Dynamo's capture only: inductor's C++ build takes minutes on a CPU
    attn = "flex_attention" if variant == "flex" else "sdpa"
    per_depth: dict[int, dict[str, Any]] = {}
    result: dict[str, Any] = {"variant": variant, "attention": attn}
    for layers in DEPTHS:
        model = stack_model(layers, dry_run, attn)
        if layers == DEPTHS[0]:
            result["sdpa_backend"] = sdpa_backends(model, 1024)
        per_depth[layers] = train_stack(model, workdir, f"{variant}-{layers}", extra, dry_run=dry_run)
        del model
        gc.collect()
        if torch.cuda.is_available():
            result[f"peak_memory_gib_{layers}"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    result["depths"] = {str(k): v for k, v in per_depth.items()}
    result |= full_model_mfu(per_depth, spec["peak_tflops"])
    shallow = per_depth[DEPTHS[0]]
    result["tokens_per_second"] = shallow["tokens_per_second"]
    return result


def ddp_wrap(find_unused: bool, broadcast: bool, backend: str) -> Any:
    """`train_stack`'s `wrap`: the trainer's model in DDP with these settings on a one-rank group, as accelerate's
    `prepare_model` wraps it with several ranks: first its own preparation without the DDP step (autocast to the
    run's mixed precision, the device), then DDP. The Trainer's loop then keeps the wrapper and prepares only the
    optimizer, so a bare DDP(model) would run without autocast: LoRA in fp32 and casts the no-wrapper run has not.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    def wrap(trainer: Any) -> Any:
        # what the run asks for, so the trainer's own check (trainer/train.py ddp_check) accepts the wrapper
        trainer.args.ddp_find_unused_parameters, trainer.args.ddp_broadcast_buffers = find_unused, broadcast
        if not dist.is_initialized():
            dist.init_process_group(backend, rank=0, world_size=1)
        model = trainer.accelerator.prepare_model(trainer.model, evaluation_mode=True)  # autocast, device; no DDP
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else None
        return DistributedDataParallel(
            model, device_ids=devices, find_unused_parameters=find_unused, broadcast_buffers=broadcast
        )

    return wrap


def ddp_wrapper(spec: dict[str, Any]) -> dict[str, Any]:
    """The 6-layer stack with no wrapper, in DDP with this trainer's settings and with transformers' for a PeftModel,
    one rank (NCCL on a GPU), each through the Trainer's loop."""
    import os
    import socket

    import torch
    import torch.distributed as dist

    dry_run = spec["dry_run"]
    workdir = Path(spec["out_dir"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    backend = "nccl" if torch.cuda.is_available() else "gloo"

    runs = {}
    for name, wrap in (
        ("no wrapper", None),
        ("ddp, this trainer's settings", ddp_wrap(False, False, backend)),
        ("ddp, transformers' settings for a PeftModel", ddp_wrap(True, True, backend)),
    ):
        model = stack_model(DEPTHS[0], dry_run)
        tag = name.split(",")[0].replace(" ", "-") + str(len(runs))
        runs[name] = train_stack(model, workdir, tag, ("training.compile=none",), wrap=wrap, dry_run=dry_run)
        del model
    if dist.is_initialized():
        dist.destroy_process_group()
    base = runs["no wrapper"]["seconds_per_micro_step"]
    return {
        "backend": backend,
        "runs": runs,
        "overhead_vs_no_wrapper": {k: round(v["seconds_per_micro_step"] / base, 3) for k, v in runs.items()},
        "tokens_per_second": runs["ddp, this trainer's settings"]["tokens_per_second"],
        "note": "one rank: DDP reduces every micro-step (accelerate's no_sync applies only with several processes)",
    }


def qlora(spec: dict[str, Any]) -> dict[str, Any]:
    """W3's QLoRA recipe on the Gemma 3 1B shape (random weights saved once; a tiny Gemma 3 in the dry run)."""
    import importlib.util

    import torch
    from transformers import Gemma3ForCausalLM, TrainerCallback

    from tests.tiny_models import gemma3_text_config, tiny_tokenizer
    from trainer.recipe import load_recipe
    from trainer.train import main

    if importlib.util.find_spec("bitsandbytes") is None:
        raise RuntimeError("bitsandbytes is not installed: carry it in the wheelhouse (bench/prepare_wheelhouse.py)")
    dry_run = spec["dry_run"]
    workdir = Path(spec["out_dir"])
    folder = workdir / "gemma3-1b-shape"
    tokenizer = tiny_tokenizer()
    if dry_run:
        config = gemma3_text_config(len(tokenizer))
    else:
        config = gemma3_text_config(
            262_144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
            num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
            layer_types=["full_attention" if (n + 1) % 6 == 0 else "sliding_attention" for n in range(26)],
        )  # fmt: skip  # google/gemma-3-1b-it's config.json (trainer/memory_plan.py _GEMMA3)
    torch.manual_seed(0)
    with torch.device(_device()):
        Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    dtypes: dict[str, Any] = {}

    class AdapterDtypes(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            trainable = [p for n, p in model.named_parameters() if p.requires_grad]
            dtypes["trainable"] = sorted({str(p.dtype) for p in trainable})
            dtypes["loaded_in_4bit"] = bool(getattr(model, "is_loaded_in_4bit", False))

    overrides = [o for o in spec["overrides"] if not o.startswith("model.name_or_path=")]
    recipe = load_recipe("emoji-gemma3-1b", [*overrides, f"model.name_or_path={folder}"])
    summary = main(recipe, callbacks=[AdapterDtypes()]).summary
    if dtypes.get("trainable") != ["torch.float32"] or not dtypes.get("loaded_in_4bit"):
        raise RuntimeError(f"QLoRA's adapters are not float32 on a 4-bit base: {dtypes}")
    return {"adapters": dtypes, **{k: summary.get(k) for k in ("steps", "tokens_per_second")}}


MODES = {"block-stack": block_stack, "ddp-wrapper": ddp_wrapper, "qlora": qlora}
