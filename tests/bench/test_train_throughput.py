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
    assert result["eval_rows_scored"] >= train_throughput.MIN_PARITY_ROWS, "parity judged on too few rows"
    assert result["recipe"] == "text-to-sql-gemma4-31b" and result["seed_workload"] == "W1"
    assert result["ours"]["config"]["labels_only_head"] and not result["seed"]["config"]["labels_only_head"]


def _side(held_out: float, train: float = 0.85) -> dict[str, float]:
    return {"held_out_loss": held_out, "mean_train_loss_last_5": train}


def test_loss_parity_is_one_sided_on_enough_rows() -> None:
    """Why: the benchmark exited 1 when ours trained BETTER (held-out 0.313 vs the seed's 0.387, a two-sided
    check on 2 rows); only ours being worse by more than the tolerance may fail it, on >= 20 held-out rows."""
    better = train_throughput.parity(_side(0.387), _side(0.313, 0.862), 0.05, 5, eval_rows=20)
    assert better["ok"] and better["held_out_loss_rel_diff"] < 0, better
    slightly_worse = train_throughput.parity(_side(0.387), _side(0.387 * 1.04), 0.05, 5, eval_rows=20)
    assert slightly_worse["ok"], slightly_worse
    worse = train_throughput.parity(_side(0.387), _side(0.387 * 1.06), 0.05, 5, eval_rows=20)
    assert not worse["ok"] and "+6.00%" in worse["reason"], worse
    too_few = train_throughput.parity(_side(0.387), _side(0.313), 0.05, 5, eval_rows=2)
    assert not too_few["ok"] and "at least 20 rows" in too_few["reason"], too_few
    missing = train_throughput.parity({"held_out_loss": None}, _side(0.313), 0.05, 5, eval_rows=20)
    assert not missing["ok"]


def test_default_held_out_set_is_large_enough() -> None:
    """Why: the default command must produce a parity verdict, not a 2-row coin toss."""
    for device, model in (("cpu", "tiny"), ("cpu", "gemma3-270m")):
        args = train_throughput.parse_args(["--device", device, "--model", model])
        assert args.eval_rows >= train_throughput.MIN_PARITY_ROWS


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
    """Why: each recipe is compared with its own workload's seed (its source tutorial, docs/seeds.md), through plain SFTTrainer."""
    from trainer.recipe import load_recipe

    w1 = train_throughput.seed_config(load_recipe("text-to-sql-gemma4-31b"), 4)
    assert (w1.micro_batch, w1.grad_accum, w1.gradient_checkpointing, w1.optim) == (2, 2, True, "adamw_torch")
    assert w1.lora["r"] == 16 and len(w1.lora["target_modules"]) == 7 and not w1.labels_only_head
    w3 = train_throughput.seed_config(load_recipe("emoji-gemma3-1b"), 4)
    assert (w3.micro_batch, w3.grad_accum, w3.gradient_checkpointing) == (1, 4, False)
    assert w3.lora["target_modules"] == ["q_proj", "v_proj"] and not w3.packing and not w3.labels_only_head
