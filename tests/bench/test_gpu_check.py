"""bench/gpu_check.sh: the prepared GPU check's plumbing, run here on the CPU in its dry mode (not its timing).

.venv/bin/python -m pytest -q tests/bench/test_gpu_check.py
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench import gpu_check, prepare_wheelhouse
from trainer.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("check", gpu_check.CHECKS, ids=lambda c: c.name)
def test_every_checks_recipe_passes_validation(check: gpu_check.Check, tmp_path: Path) -> None:
    """Why: a check whose overrides the recipe validation refuses would waste the lent GPU's minutes."""
    sets = gpu_check.recipe_overrides(check, "local:gemma3-270m", tmp_path / "out", dry_run=False)
    recipe = load_recipe(check.recipe, sets)
    assert recipe.distributed.world_size == 1 and recipe.training.max_steps == check.steps
    assert recipe.training.save_steps == (2 if check.mode in {"resume", "launch-fsdp-resume"} else check.steps)
    strategy = {"launch-fsdp": "fsdp", "launch-fsdp-resume": "fsdp", "launch-ddp": "ddp"}.get(check.mode)
    if strategy:
        assert recipe.distributed.strategy == strategy


def test_every_recipe_is_checked_on_cuda_with_tiny_and_real_models() -> None:
    names = {c.recipe for c in gpu_check.CHECKS}
    assert names == {"emoji-gemma3-1b", "product-descriptions-gemma3-4b", "text-to-sql-gemma4-31b"}
    modes = {c.mode for c in gpu_check.CHECKS}
    assert {"launch-fsdp", "launch-ddp", "resume", "bench", "vision", "train"} <= modes
    assert {c.model for c in gpu_check.CHECKS if c.gpu_only} >= {"gemma3-270m"}
    assert sum(c.timeout_s for c in gpu_check.CHECKS) > gpu_check.BUDGET_S  # the budget, not the sum, bounds it
    assert gpu_check.BUDGET_S < 600


# one check of each kind of plumbing (in-process train + resume, vision trainer, the launcher); the other tiny
# checks differ from these only in recipe or strategy (test_every_checks_recipe_passes_validation)
DRY_RUN_CHECKS = (
    "w3-emoji-tiny-save-resume", "w2-products-tiny", "w1-sql-tiny-fsdp", "w3-emoji-270m",
    "w1-stack-compiled", "w1-ddp-wrapper", "w3-qlora-1b-shape",
)  # fmt: skip


@pytest.mark.slow
def test_dry_run_trains_the_tiny_checks_and_writes_the_results(tmp_path: Path) -> None:
    """The shell entry point end to end on the CPU: each tiny check trains, the resume check resumes
    at its step-2 checkpoint, the launch renders an FSDP2 config, a GPU-only check is listed as planned."""
    out = tmp_path / "results.json"
    only = [arg for name in DRY_RUN_CHECKS for arg in ("--only", name)]
    # the script's own budget and hard stop end inside this test's timeout: a slow CI stops the checks, not only
    # the `timeout` wrapper, and their ranks do not train on beside the rest of the suite
    done = subprocess.run(
        ["bench/gpu_check.sh", "--dry-run", "--budget-s", "900", "--out", str(out), *only],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1080,
        env={**os.environ, "GPU_CHECK_HARD_STOP_S": "960"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(out.read_text())
    results = {r["name"]: r for r in document["results"]}
    assert set(results) == set(DRY_RUN_CHECKS)
    assert results["w3-emoji-270m"]["status"] == "planned"
    for name in DRY_RUN_CHECKS[:3]:
        r = results[name]
        assert r["status"] == "ok", r
        assert r["steps"] and r["tokens_per_second"] > 0 and r["lm_head_kernel"] == "torch", r
    resumed = results["w3-emoji-tiny-save-resume"]
    assert (resumed["resumed_from_step"], resumed["steps"]) == (2, 4)
    assert "distributed_type: FSDP" in results["w1-sql-tiny-fsdp"]["extra"]["accelerate"]
    assert "fsdp_reshard_after_forward: true" in results["w1-sql-tiny-fsdp"]["extra"]["accelerate"]
    assert document["environment"]["cuda"] is False and "w3-emoji-tiny-save-resume: ok" in done.stdout
    # W1 at (here: a small) Gemma 4 31B width, its layers compiled (Dynamo's capture on a CPU): two depths, the
    # full-model extrapolation, the attention backend torch picks
    stack = results["w1-stack-compiled"]
    assert stack["status"] == "ok" and set(stack["extra"]["depths"]) == {"6", "12"}, stack
    assert stack["extra"]["full_model_micro_step_ms"] is not None and set(stack["extra"]["sdpa_backend"]) == {
        "global",
        "sliding",
    }
    # DDP through the wrapper (gloo here, NCCL there): the trainer's settings and transformers' side by side
    runs = results["w1-ddp-wrapper"]["extra"]["runs"]
    assert runs["no wrapper"]["ddp"] is None
    assert runs["ddp, this trainer's settings"]["ddp"] == {"find_unused_parameters": False, "broadcast_buffers": False}
    assert runs["ddp, transformers' settings for a PeftModel"]["ddp"]["find_unused_parameters"] is True
    # QLoRA in 4 bit (bitsandbytes' CPU kernels here): float32 adapters
    qlora = results["w3-qlora-1b-shape"]
    assert qlora["status"] == "ok" and qlora["extra"]["adapters"] == {
        "trainable": ["torch.float32"],
        "loaded_in_4bit": True,
    }
    assert set(document["environment"]["image_pins"]) >= {"torch", "transformers", "trl", "peft", "bitsandbytes"}


def test_wheelhouse_parts_each_fit_one_carry(tmp_path: Path) -> None:
    """Why: the device tool carries 64 MiB per call and pyarrow alone is 55 MB: the parts must each fit."""
    sizes = {"pyarrow.whl": 55, "pandas.whl": 12, "trl.whl": 1, "datasets.whl": 1}
    for name, mib in sizes.items():
        (tmp_path / name).write_bytes(b"\0" * (mib * 2**20))
    limit = prepare_wheelhouse.CARRY_LIMIT_BYTES - 2**20
    parts = prepare_wheelhouse.split_into_parts(tmp_path, limit)
    assert len(parts) == 2 and not list(tmp_path.glob("*.whl"))
    assert all(sum(f.stat().st_size for f in part.iterdir()) <= limit for part in parts)
    assert sorted(f.name for part in parts for f in part.iterdir()) == sorted(sizes)
