"""The throughput benchmark: end to end on a tiny random Gemma 3 (both sides train, the JSON is complete), and its
OURS side built from the shipped recipe.

.venv/bin/python -m pytest -q tests/bench/test_train_throughput.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import train_throughput


@pytest.mark.slow
def test_tiny_benchmark_writes_both_sides(tmp_path: Path) -> None:
    """Why: the benchmark is the evidence for recipe changes, so its report must stay complete and sane."""
    out = tmp_path / "result.json"
    rc = train_throughput.main(["--device", "cpu", "--model", "tiny", "--steps", "3", "--out", str(out)])
    result = json.loads(out.read_text())

    for side in ("seed", "ours"):
        assert result[side]["tokens_per_second"] > 0, f"{side}: no throughput measured"
        assert result[side]["optimizer_steps"] == 3, f"{side}: ran {result[side]['optimizer_steps']} steps"
        assert result[side]["peak_memory_gib"] > 0, f"{side}: memory probe failed"
    assert result["ours"]["padding_fraction"] < result["seed"]["padding_fraction"]
    assert result["ours"]["real_tokens_total"] == result["seed"]["real_tokens_total"], "not the same data"
    assert result["ratio_ours_over_seed"]["tokens_per_second"] > 0
    assert result["packing_isolation_max_abs_logit_diff"] < 1e-3, "packed sequences attend to each other"
    assert result["loss_parity"]["ok"] and rc == 0, result["loss_parity"]
    assert result["recipe"] == "text-to-sql-gemma4-31b" and result["seed_workload"] == "W1"
    assert result["ours"]["config"]["labels_only_head"] and not result["seed"]["config"]["labels_only_head"]


def test_pack_length_gives_the_requested_rows() -> None:
    """Why: the same number of optimizer steps on both sides rests on this sizing."""
    lengths = [400, 380, 450, 420, 390, 410, 430, 440]
    length = train_throughput.choose_pack_length(lengths, target_rows=4)
    assert length >= max(lengths)
    assert train_throughput.packed_rows(lengths, length) <= 4
    assert train_throughput.packed_rows(lengths, length - 8) > 4


@pytest.mark.parametrize("name", ["text-to-sql-gemma4-31b", "emoji-gemma3-1b"])
def test_ours_is_the_shipped_recipe(name: str) -> None:
    """Why: the ratio must be about what we ship; a recipe's settings reach the benchmark's side unchanged."""
    from trainer.recipe import load_recipe

    recipe = load_recipe(name)
    t = recipe.training
    ours = train_throughput.ours_config(recipe, "cpu", 4, None)
    assert (ours.attn_implementation, ours.packing, ours.padding_free) == (
        recipe.model.attn_implementation,
        t.packing,
        t.padding_free,
    )
    assert (ours.gradient_checkpointing, ours.optim, ours.micro_batch) == (
        t.gradient_checkpointing,
        t.optim,
        t.per_device_train_batch_size,
    )
    assert ours.lora == recipe.lora.model_dump() and ours.labels_only_head
    if not t.packing:
        assert ours.micro_batch * ours.grad_accum == 4, "the seed's sequences per step"

    changed = load_recipe(
        name, ["training.gradient_checkpointing=true", "training.optim=adamw_torch", "model.attn_implementation=eager"]
    )
    follows = train_throughput.ours_config(changed, "cpu", 4, None)
    assert (follows.gradient_checkpointing, follows.optim, follows.attn_implementation) == (
        True,
        "adamw_torch",
        "eager",
    )


def test_seed_side_is_the_workloads_seed() -> None:
    """Why: each recipe is compared with its own workload's seed (../shared/SEEDS.md), through plain SFTTrainer."""
    from trainer.recipe import load_recipe

    w1 = train_throughput.seed_config(load_recipe("text-to-sql-gemma4-31b"), 4)
    assert (w1.micro_batch, w1.grad_accum, w1.gradient_checkpointing, w1.optim) == (2, 2, True, "adamw_torch")
    assert w1.lora["r"] == 16 and len(w1.lora["target_modules"]) == 7 and not w1.labels_only_head
    w3 = train_throughput.seed_config(load_recipe("emoji-gemma3-1b"), 4)
    assert (w3.micro_batch, w3.grad_accum, w3.gradient_checkpointing) == (1, 4, False)
    assert w3.lora["target_modules"] == ["q_proj", "v_proj"] and not w3.packing and not w3.labels_only_head
