"""Expected MFU of a recipe's data-parallel strategies, from the model's shape, the GPU's specs and the host's launches.

    .venv/bin/python bench/mfu_estimate.py                            # text-to-sql-gemma4-31b on 8 x B200
    .venv/bin/python bench/mfu_estimate.py --json build/bench/mfu.json

An estimate, not a measurement (bench/RESULTS.md keeps the two apart), given as a range: every assumption has an
optimistic, a central and a pessimistic value (`ASSUMPTIONS`, each with its source), and the range is all
optimistic to all pessimistic. Per micro-step of one rank: the useful LoRA FLOPs (the count of
bench/train_throughput.py's `flops_per_token`); the GPU's time for them (GEMMs, attention as sdpa computes a packed
row: the whole square, element-wise traffic at HBM bandwidth); the host's time to launch them (the kernels per
micro-step bench/step_ops.py counted, eager or with `training.compile: regional`, in bench/step_ops.json, times the
host's cost per launch, plus the syncs); and DDP's or FSDP2's traffic at NVLink bandwidth. The step takes the longer
of the GPU's and the host's time (the host queues kernels ahead of the GPU until a sync). The memory column is
trainer/memory_plan.py's per-GPU estimate. The model in full: bench/README.md, "The estimates".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from trainer import memory_plan  # noqa: E402
from trainer.recipe import load_recipe, resolve_strategy, sample_token_lengths, step_plan  # noqa: E402

STEP_OPS = REPO_ROOT / "bench" / "step_ops.json"  # bench/step_ops.py's counts, committed (make step-ops)


@dataclass(frozen=True)
class Assumption:
    optimistic: float
    central: float
    pessimistic: float
    source: str

    def pick(self, case: str) -> float:
        return float(getattr(self, case))


ASSUMPTIONS = {
    "gemm_efficiency": Assumption(
        0.8, 0.7, 0.6, "fraction of dense bf16 peak large GEMMs reach (cuBLAS on 1,024 x 5,376 x 21,504 shapes)"
    ),
    "attention_efficiency": Assumption(
        0.4,
        0.25,
        0.15,
        "fraction of dense peak sdpa reaches with a mask: with a mask and Gemma 4's 512-wide global heads torch "
        "dispatches its memory-efficient (CUTLASS, sm80-generation) kernel (aten/src/ATen/native/transformers/cuda/"
        "sdp_utils.cpp: flash takes no mask and <= 256, cuDNN <= 256); FlashAttention-1-class kernels reach 25-40% "
        "of an A100's peak (FlashAttention-2 paper, arXiv 2307.08691, abstract), less of a B200's",
    ),
    "nvlink_efficiency": Assumption(0.9, 0.8, 0.7, "fraction of NVLink bandwidth NCCL's collectives reach"),
    "host_us_per_eager_op": Assumption(
        5.0,
        10.0,
        25.0,
        "host time per eager PyTorch operation on the GPU path: Python, autograd, dispatcher, launch; "
        "'~5-25 us of CPU-side work per op' (jiahuanglin.xyz, 'From PyTorch op to kernel launch')",
    ),
    "host_us_per_compiled_kernel": Assumption(
        3.0, 5.0, 10.0, "inductor's wrapper launching a Triton kernel or an extern GEMM: no autograd or dispatcher"
    ),
    "host_us_per_compiled_call": Assumption(
        20.0, 50.0, 100.0, "one compiled region's call: Dynamo's guards and AOTAutograd's wrappers, forward or backward"
    ),
    "gpu_idle_us_per_sync": Assumption(
        10.0, 20.0, 50.0, "a sync empties the GPU's queue: it idles until the host has launched the next kernel"
    ),
}
CASES = ("optimistic", "central", "pessimistic")


def useful_flops_per_token(shape: memory_plan.ModelShape, lora_params: int, mean_len: float) -> float:
    matmul = sum(shape.layer_params) + shape.embedding_params  # the (tied) LM head once; no embedding lookup
    attention = 0.0
    for layer in range(shape.layers):
        q, _, _ = shape.attention_widths(layer)
        window = shape.sliding_window if not shape.is_global(layer) and shape.sliding_window else mean_len
        attention += 12 * q * min(mean_len, window)
    return 4 * matmul + 6 * lora_params + attention


def launch_counts(path: Path = STEP_OPS) -> dict[str, dict[str, float]]:
    """Kernels and syncs per micro-step of W1 at 60 layers, per configuration, as bench/step_ops.py counted them."""
    document = json.loads(path.read_text())
    return {
        name: {
            "kernels": float(run["per_micro_step_at_60_layers"]),
            "syncs": float(run["syncs_per_micro_step"]),
            "compiled_calls": float(run.get("compiled_calls_at_60_layers", 0)),
            "compiled": float(run.get("compiled", False)),
        }
        for name, run in document["configurations"].items()
    }


def host_ms(counts: dict[str, float], case: str) -> float:
    per_kernel = ASSUMPTIONS["host_us_per_compiled_kernel" if counts["compiled"] else "host_us_per_eager_op"]
    return (
        counts["kernels"] * per_kernel.pick(case)
        + counts["compiled_calls"] * ASSUMPTIONS["host_us_per_compiled_call"].pick(case)
    ) / 1e3


def estimate(recipe_name: str, args: argparse.Namespace) -> dict[str, Any]:
    recipe = load_recipe(recipe_name)
    d, t = recipe.distributed, recipe.training
    shape = memory_plan.model_shape(recipe.model.name_or_path, REPO_ROOT)
    if shape is None or d.gpu is None:
        raise SystemExit(f"{recipe_name}: needs a known model shape and distributed.gpu")
    gpu = memory_plan.GPUS[d.gpu]
    if gpu.bf16_dense_tflops is None or gpu.nvlink_gb_s is None or gpu.hbm_tb_s is None:
        raise SystemExit(f"{recipe_name}: trainer/memory_plan.py has no speeds for {gpu.name} (memory only)")
    plan = step_plan(recipe)
    lengths = [n for n in sample_token_lengths()["tasks"][recipe.data.task.value]["conversation"] if n <= t.max_length]
    mean_len = statistics.fmean(lengths)
    row_tokens = min(plan.conversations_per_sequence * mean_len, t.max_length) * t.per_device_train_batch_size
    lora = shape.lora_params(recipe.lora.r, recipe.lora.target_modules)
    useful = row_tokens * useful_flops_per_token(shape, lora, mean_len)
    matmul = row_tokens * (4 * (sum(shape.layer_params) + shape.embedding_params) + 6 * lora)
    row = t.max_length * t.per_device_train_batch_size  # sdpa computes the packed row's whole square
    attention_computed = row_tokens * sum(12 * shape.attention_widths(n)[0] * row for n in range(shape.layers))
    peak = gpu.bf16_dense_tflops * 1e12
    elementwise = 3 * row_tokens * sum(memory_plan.activation_bytes_per_token(shape, n) for n in range(shape.layers))
    world = d.world_size
    base_bytes, lora_grad_bytes = shape.params * 2, lora * 4

    def gpu_seconds(case: str) -> float:
        return (
            matmul / (peak * ASSUMPTIONS["gemm_efficiency"].pick(case))
            + attention_computed / (peak * ASSUMPTIONS["attention_efficiency"].pick(case))
            + elementwise / (gpu.hbm_tb_s * 1e12)
        )

    def comm_seconds(case: str) -> dict[str, float]:
        link = gpu.nvlink_gb_s * 1e9 * ASSUMPTIONS["nvlink_efficiency"].pick(case)
        return {
            "ddp": 2 * (world - 1) / world * lora_grad_bytes / link / t.gradient_accumulation_steps,
            "fsdp-gathered": (world - 1) / world * base_bytes / link,
            "fsdp": 2 * (world - 1) / world * base_bytes / link,
        }

    chosen = resolve_strategy(recipe)
    compute_s, comm_s = gpu_seconds("central"), comm_seconds("central")
    rows = {}
    for strategy, comm in comm_s.items():
        rows[strategy] = {
            "memory_gb": round(chosen.estimates[strategy].total_gb, 1),
            "fits": chosen.estimates[strategy].fits,
            "compute_ms": round(compute_s * 1e3, 1),
            "communication_ms": round(comm * 1e3, 1),
            "mfu_overlapped": round(useful / (max(compute_s, comm) * peak), 3),
            "mfu_serial": round(useful / ((compute_s + comm) * peak), 3),
        }
    # the picked strategy with the host in the loop: the step is the longer of the GPU's and the host's time
    host_bound: dict[str, Any] = {}
    counts = launch_counts(args.step_ops) if args.step_ops.is_file() else {}
    for name, count in counts.items():
        cases = {}
        for case in CASES:
            gpu_s = gpu_seconds(case) + comm_seconds(case)[chosen.key]  # DDP's all-reduce is not overlapped here
            host_s = host_ms(count, case) / 1e3
            step_s = max(gpu_s, host_s) + count["syncs"] * ASSUMPTIONS["gpu_idle_us_per_sync"].pick(case) / 1e6
            cases[case] = {
                "gpu_ms": round(gpu_s * 1e3, 1),
                "host_ms": round(host_s * 1e3, 1),
                "step_ms": round(step_s * 1e3, 1),
                "mfu": round(useful / (step_s * peak), 3),
                "bound": "host" if host_s > gpu_s else "GPU",
            }
        host_bound[name] = {"kernels_per_micro_step": count["kernels"], "syncs": count["syncs"], **cases}
    return {
        "recipe": recipe.name,
        "model": recipe.model.name_or_path,
        "shape_source": shape.source,
        "gpu": gpu.name,
        "gpu_source": gpu.source,
        "world_size": world,
        "picked": chosen.key,
        "params_frozen": shape.params,
        "params_lora": lora,
        "real_tokens_per_micro_step": round(row_tokens, 1),
        "useful_tflop_per_micro_step": round(useful / 1e12, 2),
        "attention_tflop_computed_per_micro_step": round(attention_computed / 1e12, 2),
        "assumptions": {
            "peak_bf16_dense_tflops": gpu.bf16_dense_tflops,
            "nvlink_gb_s_per_direction": gpu.nvlink_gb_s,
            "hbm_tb_s": gpu.hbm_tb_s,
            **{name: {c: a.pick(c) for c in CASES} | {"source": a.source} for name, a in ASSUMPTIONS.items()},
        },
        "strategies": rows,
        "with_the_host": host_bound,
        "left_out": [
            "the optimizer step, gradient clipping and the data loader (once per 16 micro-steps)",
            "evaluation during training (eval_steps) and checkpoint saves",
            "rank-to-rank skew at DDP's all-reduce (rows of different lengths)",
            "Python garbage collection and allocator stalls",
        ],
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['recipe']} on {result['world_size']} x {result['gpu']} (picked: {result['picked']}); "
        f"{result['real_tokens_per_micro_step']:.0f} real tokens and {result['useful_tflop_per_micro_step']} useful "
        "TFLOP per micro-step",
        "GPU-bound (central assumptions, no host):",
        f"{'strategy':16}{'GB/GPU':>8}{'fits':>6}{'compute ms':>12}{'comm ms':>10}{'MFU overlap':>13}{'MFU serial':>12}",
    ]
    for name, r in result["strategies"].items():
        lines.append(
            f"{name:16}{r['memory_gb']:>8.1f}{'yes' if r['fits'] else 'no':>6}{r['compute_ms']:>12.1f}"
            f"{r['communication_ms']:>10.1f}{r['mfu_overlapped']:>13.1%}{r['mfu_serial']:>12.1%}"
        )
    if result["with_the_host"]:
        lines.append(
            f"{result['picked']} with the host's launches (bench/step_ops.json), optimistic / central / pessimistic:"
        )
        for name, r in result["with_the_host"].items():
            cells = " / ".join(f"{r[c]['mfu']:.1%} ({r[c]['bound']}, {r[c]['step_ms']:.0f} ms)" for c in CASES)
            lines.append(f"  {name:22}{r['kernels_per_micro_step']:>8.0f} kernels  MFU {cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="text-to-sql-gemma4-31b")
    p.add_argument("--step-ops", type=Path, default=STEP_OPS, help="bench/step_ops.py's counts (JSON)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    result = estimate(args.recipe, args)
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
