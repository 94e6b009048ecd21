"""Operations and host-device syncs in one training micro-step of W1's trainer, counted by torch.profiler on a CPU.

    make step-ops                 # all three configurations into bench/step_ops.json (the compiled one: minutes)
    .venv/bin/python bench/step_ops.py --only "trl as shipped,eager"     # trl's SFTTrainer as it ships, ours

A count, not a time. W1's recipe runs through the trainer's own `build_trainer` (sft_config, LoRA on the 7
projections, new_sft_trainer) on Gemma 4 31B's decoder (`w1_text_config`: its 5 sliding : 1 global pattern, head
counts' ratios, keys-as-values and window) at 1/64 of its widths and 1/4 of its heads, so a micro-step is quick
on a CPU: the number of operations does not depend on the widths or head counts. The window is the first micro-step of an update (from
`on_step_begin` to `on_substep_end`, gradient accumulation 2): forward, loss, backward and the loop's own work,
no optimizer, no data loading. Counted: leaf aten operations that run a kernel (views and allocations left out;
`KERNEL_FREE`) and inductor's compiled kernels (`cpp_fused_*`; Triton kernels on a GPU): about one GPU launch
each. Syncs: operations that make the host wait for a GPU (`SYNC_OPS`: `.item()`/`bool()`, `nonzero`,
`masked_select`, ...), each attributed to the line that caused it. Per layer: the difference between 12 and 6
layers, over 6. A CPU cannot show the time a launch costs; bench/mfu_estimate.py prices the counts.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from trainer import memory_plan  # noqa: E402

W1 = "text-to-sql-gemma4-31b"
W1_SHAPE = memory_plan.MODEL_SHAPES["google/gemma-4-31b-it"]
SAMPLE = "trainer/samples/text_to_sql.jsonl"
# Leaf operations that launch no kernel: views, metadata, allocations, a no-op `to`, and `item`'s wrapper.
KERNEL_FREE = frozenset(
    "aten::" + name
    for name in (
        "view", "t", "transpose", "as_strided", "expand", "unsqueeze", "squeeze", "reshape", "_reshape_alias",
        "slice", "select", "detach", "detach_", "alias", "permute", "_unsafe_view", "unbind", "split", "narrow",
        "lift_fresh", "resolve_conj", "resolve_neg", "result_type", "view_as", "expand_as", "chunk", "set_", "empty",
        "empty_strided", "empty_like", "resize_", "to", "contiguous", "flatten", "is_nonzero", "item",
        "_local_scalar_dense", "numpy_T", "split_with_sizes", "movedim", "unflatten", "_nested_tensor_from_mask",
        "is_same_size", "size", "stride", "sym_size", "sym_stride", "dim",
    )
)  # fmt: skip
# Operations whose result the host needs before it can go on: on a GPU each waits for the queue to drain.
SYNC_OPS = frozenset(
    "aten::" + name
    for name in ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive", "equal")
)
_OUR_CODE = ("trainer/", "transformers/", "trl/", "peft/", "accelerate/", "torch/nn/")
# Code that runs on a CPU only: on a GPU trl's head kernel (Triton) takes these rows and reads nothing back
CPU_ONLY_SITES = ("trainer/cpu_logprob.py",)


def w1_text_config(
    layers: int = 6, divisor: int = 1, head_divisor: int = 1, vocab: int | None = None
) -> dict[str, Any]:
    """Gemma 4 31B's text decoder (trainer/memory_plan.py's published shape), `layers` deep in its 5 sliding : 1
    global pattern, its widths divided by `divisor` and its head counts by `head_divisor`; no per-layer embeddings,
    no shared KV."""
    s, d, h = W1_SHAPE, divisor, head_divisor
    assert s.global_head_dim is not None and s.global_kv_heads is not None
    config: dict[str, Any] = {
        "hidden_size": s.hidden // d, "intermediate_size": s.intermediate // d, "num_hidden_layers": layers,
        "num_attention_heads": s.heads // h, "num_key_value_heads": s.kv_heads // h, "head_dim": s.head_dim // d,
        "global_head_dim": s.global_head_dim // d, "num_global_key_value_heads": s.global_kv_heads // h,
        "attention_k_eq_v": s.k_eq_v, "sliding_window": s.sliding_window, "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0, "max_position_embeddings": 4096,
        "layer_types": [s.layer_types[n % len(s.layer_types)] for n in range(layers)],
    }  # fmt: skip
    if vocab is not None:
        config |= {"vocab_size": vocab, "vocab_size_per_layer_input": vocab}
    return config


def save_w1_block_model(directory: Path, layers: int, divisor: int = 64, head_divisor: int = 4) -> Path:
    """A random Gemma 4 in W1's class (Gemma4ForConditionalGeneration) with `w1_text_config` (by default 1/64 of the
    widths and 1/4 of the heads: a 1,024-token row's attention squares stay small on a CPU), and the tests' tiny
    tokenizer, as a folder a recipe names."""
    from tests.tiny_models import save_tiny_model

    return save_tiny_model(directory, "gemma4", **w1_text_config(layers, divisor, head_divisor))


def w1_overrides(model_dir: Path, out_dir: Path, updates: int, extra: tuple[str, ...] = ()) -> list[str]:
    """W1's recipe on one process and the bundled sample, 2 micro-steps per update, fp32 (a CPU)."""
    return [
        f"model.name_or_path={model_dir}", "model.dtype=float32", "data.source=local", f"data.path={SAMPLE}",
        "data.max_rows=60", "data.eval_rows=0", "training.gradient_accumulation_steps=2",
        f"training.max_steps={updates}", "training.logging_steps=1000", "training.save_steps=1000",
        "training.report_to=[]", "evaluation.enabled=false", "distributed.world_size=1", "distributed.strategy=none",
        "output.merge=false", f"output.dir={out_dir}", *extra,
    ]  # fmt: skip


@dataclass
class MicroStep:
    """One micro-step's counts (the mean over the profiled micro-steps)."""

    kernels_forward: float
    kernels_backward: float
    syncs: float
    compiled_calls: float = 0.0  # compiled regions entered, forward and backward
    sync_sites: dict[str, float] = field(default_factory=dict)
    kernel_names: dict[str, float] = field(default_factory=dict)

    @property
    def kernels(self) -> float:
        return self.kernels_forward + self.kernels_backward


def _ancestors(event: Any) -> list[Any]:
    chain, parent = [], event.cpu_parent
    while parent is not None:
        chain.append(parent)
        parent = parent.cpu_parent
    return chain


def _site(event: Any, chain: list[Any]) -> str:
    """Where a sync came from: the innermost Python frame of our code or a library's, or the autograd node of the
    backward it runs in."""
    for text in [*(getattr(event, "stack", None) or []), *(p.name for p in chain)]:
        if text.startswith("autograd::engine::evaluate_function: "):
            return "backward of " + text.split(": ", 1)[1]
        short = text.split("site-packages/")[-1].split(str(REPO_ROOT) + "/")[-1]
        if short.startswith(_OUR_CODE) and "(" in short:
            return short
    return " < ".join(p.name for p in chain[:3]) or event.name


def _is_kernel(event: Any, memo: dict[int, bool]) -> bool:
    """An aten operation that launches a kernel itself: not kernel-free, and none of its callees launches one."""
    key = id(event)
    if key not in memo:
        memo[key] = event.name not in KERNEL_FREE and not any(
            _is_kernel(child, memo) for child in event.cpu_children if child.name.startswith("aten::")
        )
    return memo[key]


def classify(events: Any, micro_steps: int) -> MicroStep:
    """Kernels (forward, backward) and syncs per micro-step from a profile of `micro_steps` micro-steps. Syncs in
    CPU-only code (`CPU_ONLY_SITES`) are listed apart and not counted."""
    forward = backward = syncs = calls = 0
    sites: collections.Counter[str] = collections.Counter()
    names: collections.Counter[str] = collections.Counter()
    memo: dict[int, bool] = {}
    for event in events:
        name = event.name
        calls += name in ("CompiledFunction", "CompiledFunctionBackward")
        compiled = "cpp_fused" in name or name.startswith("triton_")
        if not (name.startswith("aten::") or compiled):
            continue
        chain = _ancestors(event)
        if name in SYNC_OPS and not any(p.name in SYNC_OPS for p in chain):
            site = _site(event, chain)
            cpu_only = any(part in site for part in CPU_ONLY_SITES)
            syncs += 0 if cpu_only else 1
            sites[f"{'(CPU only) ' if cpu_only else ''}{name.removeprefix('aten::')} at {site}"] += 1
        if compiled or _is_kernel(event, memo):
            names["compiled kernel" if compiled else name] += 1
            if any(p.name.startswith("autograd::engine::evaluate_function") for p in chain):
                backward += 1
            else:
                forward += 1
    per = 1 / micro_steps
    return MicroStep(
        kernels_forward=forward * per,
        kernels_backward=backward * per,
        syncs=syncs * per,
        compiled_calls=calls * per,
        sync_sites={k: v * per for k, v in sorted(sites.items())},
        kernel_names={k: round(v * per, 2) for k, v in names.most_common(25)},
    )


def profile_window(skip_updates: int, updates: int) -> Any:
    """A TrainerCallback that profiles the first micro-step of updates skip..skip+updates-1 (gradient accumulation
    must be at least 2: the window ends at `on_substep_end`)."""
    import torch
    from transformers import TrainerCallback

    class MicroStepProfile(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.events: list[Any] = []
            self.micro_steps = 0
            self._profile: Any = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if skip_updates <= state.global_step < skip_updates + updates:
                self._profile = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True
                )
                self._profile.__enter__()

        def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self._profile is not None:
                self._profile.__exit__(None, None, None)
                self.events.extend(self._profile.events())
                self._profile = None
                self.micro_steps += 1

    return MicroStepProfile()


def count_micro_step(
    model_dir: Path,
    workdir: Path,
    *,
    compile_layers: bool = False,
    stock: bool = False,
    extra: tuple[str, ...] = (),
    skip: int = 2,
    updates: int = 2,
) -> MicroStep:
    """W1's micro-step through build_trainer on the model in `model_dir`: the first micro-step of `updates` updates
    after `skip` updates of warm-up (compilation, a new row length), profiled.

    `stock`: trl's SFTTrainer with trl's and transformers' own logging settings and trl's compact LM-head branch
    as a Triton device takes it (`_use_triton` answering yes), i.e. the per-step reads this trainer removes."""
    import torch
    from transformers import set_seed

    from trainer.checkpoints import OutputLocation
    from trainer.recipe import load_recipe
    from trainer.train import build_trainer

    torch.set_num_threads(1)  # tiny matrices: a second thread only spins
    if compile_layers:
        import torch._inductor.config as inductor

        inductor.cpp.enable_kernel_profile = True  # each generated C++ kernel shows in the profile
    extra = (*extra, f"training.compile={'regional' if compile_layers else 'none'}")
    out = workdir / f"run-{time.monotonic_ns()}"
    recipe = load_recipe(W1, w1_overrides(model_dir, out, skip + updates, extra))
    window = profile_window(skip, updates)
    set_seed(0)
    if stock:
        with _stock_trl():
            trainer, _ = build_trainer(recipe, OutputLocation.from_dir(recipe.output.dir), [window])
            trainer.args.logging_nan_inf_filter = True  # transformers' default
            trainer.train()
    else:
        trainer, _ = build_trainer(recipe, OutputLocation.from_dir(recipe.output.dir), [window])
        trainer.train()
    assert window.micro_steps == updates, f"profiled {window.micro_steps} micro-steps, wanted {updates}"
    return classify(window.events, window.micro_steps)


class _stock_trl:
    """`new_sft_trainer` building trl's plain SFTTrainer, whose compact head branch runs as on a Triton device."""

    def __enter__(self) -> None:
        from trl import SFTTrainer
        from trl.trainer import utils as trl_utils

        from trainer import lm_head

        self._saved = (lm_head.new_sft_trainer, trl_utils._use_triton)
        lm_head.new_sft_trainer = lambda **kwargs: SFTTrainer(**kwargs)  # type: ignore[assignment]
        trl_utils._use_triton = lambda device: True  # type: ignore[attr-defined]

    def __exit__(self, *exc: Any) -> None:
        from trl.trainer import utils as trl_utils

        from trainer import lm_head

        lm_head.new_sft_trainer, trl_utils._use_triton = self._saved  # type: ignore[assignment]


def per_layer(shallow: MicroStep, deep: MicroStep, layers: tuple[int, int]) -> dict[str, float]:
    """Kernels (and compiled calls) per decoder layer, the mean of the 5:1 pattern, and outside the layers, from two
    depths."""
    extra = layers[1] - layers[0]
    forward = (deep.kernels_forward - shallow.kernels_forward) / extra
    backward = (deep.kernels_backward - shallow.kernels_backward) / extra
    calls = (deep.compiled_calls - shallow.compiled_calls) / extra
    return {
        "forward": round(forward, 1),
        "backward": round(backward, 1),
        "outside_layers": round(shallow.kernels - layers[0] * (forward + backward), 1),
        "compiled_calls": round(calls, 2),
    }


# name -> count_micro_step's switches; the compiled one takes minutes on a CPU (inductor's C++ code generation)
CONFIGURATIONS: dict[str, dict[str, bool]] = {
    "trl as shipped": {"stock": True},
    "eager": {},
    "compiled layers": {"compile_layers": True},
}


def measure_configuration(name: str, workdir: Path, depths: tuple[int, int] = (6, 12)) -> dict[str, Any]:
    steps = {}
    for layers in depths:
        model_dir = workdir / f"w1-{layers}"
        if not model_dir.is_dir():
            save_w1_block_model(model_dir, layers)
        steps[layers] = count_micro_step(model_dir, workdir, **CONFIGURATIONS[name])
    layer = per_layer(steps[depths[0]], steps[depths[1]], depths)
    full = W1_SHAPE.layers
    return {
        "per_layer": layer,
        "per_micro_step_at_60_layers": round(layer["outside_layers"] + full * (layer["forward"] + layer["backward"])),
        "compiled_calls_at_60_layers": round(full * layer["compiled_calls"]),
        "compiled": bool(CONFIGURATIONS[name].get("compile_layers")),
        "syncs_per_micro_step": steps[depths[0]].syncs,
        "sync_sites": steps[depths[0]].sync_sites,
        "micro_steps": {str(k): asdict(v) for k, v in steps.items()},
    }


def measure(names: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="step-ops-") as tmp:
        configurations = {name: measure_configuration(name, Path(tmp)) for name in names}
    return {
        "model": "Gemma 4 31B's decoder at 1/64 width and 1/4 heads, 6 and 12 layers (5 sliding : 1 global), "
        "W1's recipe (LoRA r16 on 7 projections, packed 1,024-token rows, gradient accumulation 2)",
        "counted": "leaf aten operations that launch a kernel and inductor's compiled kernels, per micro-step; "
        "syncs outside CPU-only code",
        "configurations": configurations,
        "environment": _environment(),
    }


def _environment() -> dict[str, Any]:
    import platform

    import torch
    import transformers
    import trl

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", default=",".join(CONFIGURATIONS), help=f"configurations, comma-separated: {', '.join(CONFIGURATIONS)}"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    names = [name for name in args.only.split(",") if name]
    unknown = set(names) - set(CONFIGURATIONS)
    if unknown:
        parser.error(f"--only {sorted(unknown)}: the configurations are {list(CONFIGURATIONS)}")
    result = measure(names)
    for name, run in result["configurations"].items():
        layer = run["per_layer"]
        print(
            f"{name}: per layer {layer['forward']} forward + {layer['backward']} backward kernels, "
            f"{layer['outside_layers']} outside the layers; {run['per_micro_step_at_60_layers']} per micro-step at "
            f"60 layers; {run['syncs_per_micro_step']:g} syncs per micro-step"
        )
        for site, count in run["sync_sites"].items():
            print(f"  {count:g} x {site}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
