"""Expected MFU of a recipe's data-parallel strategies, from the model's shape and the GPU's published specs.

    .venv/bin/python bench/mfu_estimate.py                            # text-to-sql-gemma4-31b on 8 x B200
    .venv/bin/python bench/mfu_estimate.py --gemm-efficiency 0.6 --json build/bench/mfu.json

An estimate, not a measurement (bench/RESULTS.md keeps the two apart). Per micro-step of one rank it
counts the useful LoRA FLOPs (the count of bench/train_throughput.py's `flops_per_token`), the compute
time at the given GEMM / attention efficiencies and HBM bandwidth, and the DDP or FSDP2 communication at
NVLink bandwidth; MFU is bounded by perfect overlap and none. The memory column is
trainer/memory_plan.py's per-GPU estimate. The model in full: bench/README.md, "The estimates".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from trainer import memory_plan  # noqa: E402
from trainer.recipe import load_recipe, resolve_strategy, sample_token_lengths, step_plan  # noqa: E402


def useful_flops_per_token(shape: memory_plan.ModelShape, lora_params: int, mean_len: float) -> float:
    matmul = sum(shape.layer_params) + shape.embedding_params  # the (tied) LM head once; no embedding lookup
    attention = 0.0
    for layer in range(shape.layers):
        q, _, _ = shape.attention_widths(layer)
        window = shape.sliding_window if not shape.is_global(layer) and shape.sliding_window else mean_len
        attention += 12 * q * min(mean_len, window)
    return 4 * matmul + 6 * lora_params + attention


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
    compute_s = (
        matmul / (peak * args.gemm_efficiency)
        + attention_computed / (peak * args.attention_efficiency)
        + elementwise / (gpu.hbm_tb_s * 1e12)
    )
    link = gpu.nvlink_gb_s * 1e9 * args.nvlink_efficiency
    world = d.world_size
    base_bytes = shape.params * 2
    lora_grad_bytes = lora * 4
    comm_s = {
        "ddp": 2 * (world - 1) / world * lora_grad_bytes / link / t.gradient_accumulation_steps,
        "fsdp-gathered": (world - 1) / world * base_bytes / link,
        "fsdp": 2 * (world - 1) / world * base_bytes / link,
    }
    chosen = resolve_strategy(recipe)
    estimates = chosen.estimates
    rows = {}
    for strategy, comm in comm_s.items():
        rows[strategy] = {
            "memory_gb": round(estimates[strategy].total_gb, 1),
            "fits": estimates[strategy].fits,
            "compute_ms": round(compute_s * 1e3, 1),
            "communication_ms": round(comm * 1e3, 1),
            "mfu_overlapped": round(useful / (max(compute_s, comm) * peak), 3),
            "mfu_serial": round(useful / ((compute_s + comm) * peak), 3),
        }
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
        "assumptions": {
            "peak_bf16_dense_tflops": gpu.bf16_dense_tflops,
            "nvlink_gb_s_per_direction": gpu.nvlink_gb_s,
            "hbm_tb_s": gpu.hbm_tb_s,
            "gemm_efficiency": args.gemm_efficiency,
            "attention_efficiency": args.attention_efficiency,
            "nvlink_efficiency": args.nvlink_efficiency,
        },
        "strategies": rows,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['recipe']} on {result['world_size']} x {result['gpu']} (picked: {result['picked']}); "
        f"{result['real_tokens_per_micro_step']:.0f} real tokens and {result['useful_tflop_per_micro_step']} useful "
        "TFLOP per micro-step",
        f"{'strategy':16}{'GB/GPU':>8}{'fits':>6}{'compute ms':>12}{'comm ms':>10}{'MFU overlap':>13}{'MFU serial':>12}",
    ]
    for name, r in result["strategies"].items():
        lines.append(
            f"{name:16}{r['memory_gb']:>8.1f}{'yes' if r['fits'] else 'no':>6}{r['compute_ms']:>12.1f}"
            f"{r['communication_ms']:>10.1f}{r['mfu_overlapped']:>13.1%}{r['mfu_serial']:>12.1%}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="text-to-sql-gemma4-31b")
    p.add_argument("--gemm-efficiency", type=float, default=0.7, help="fraction of dense peak large bf16 GEMMs reach")
    p.add_argument("--attention-efficiency", type=float, default=0.4, help="the same for sdpa with a mask")
    p.add_argument("--nvlink-efficiency", type=float, default=0.8, help="fraction of NVLink bandwidth NCCL reaches")
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
