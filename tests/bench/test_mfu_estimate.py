"""bench/mfu_estimate.py: W1's expected MFU from the shape, the GPU specs, the memory model and the host's launches."""

from __future__ import annotations

import json
from pathlib import Path

from bench import mfu_estimate, step_ops


def _estimate(tmp_path: Path) -> dict:
    out = tmp_path / "mfu.json"
    assert mfu_estimate.main(["--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_w1_estimate_picks_ddp_and_it_moves_no_frozen_weights(tmp_path: Path) -> None:
    """Why: the strategy recipe validation picks must be the one the estimate expects to use the GPUs best."""
    result = _estimate(tmp_path)
    rows = result["strategies"]
    assert result["picked"] == "ddp" and result["gpu"] == "B200" and result["world_size"] == 8
    assert rows["fsdp"]["communication_ms"] == 2 * rows["fsdp-gathered"]["communication_ms"]  # two gathers vs one
    assert rows["ddp"]["communication_ms"] < 1  # the LoRA gradients, once per 16 micro-steps
    assert rows["ddp"]["mfu_serial"] >= 0.45 > rows["fsdp"]["mfu_overlapped"]
    assert rows["fsdp-gathered"]["mfu_serial"] < rows["ddp"]["mfu_serial"]
    # 62 GB of bf16 base, ~30.7B parameters: every rank all-gathers 7/8 of it per gather at ~720 GB/s
    assert 120 < rows["fsdp"]["communication_ms"] < 180


def test_with_the_host_eager_w1_waits_for_launches_and_compiled_w1_for_the_gpu(tmp_path: Path) -> None:
    """Why: the GPU-only estimate (51 %) hid ~23,000 eager launches per micro-step; the counts come from
    bench/step_ops.json (make step-ops), each assumption states its source and a range."""
    result = _estimate(tmp_path)
    host = result["with_the_host"]
    assert set(host) == set(step_ops.CONFIGURATIONS)
    eager, compiled = host["eager"], host["compiled layers"]
    assert eager["central"]["bound"] == "host" and eager["central"]["mfu"] < 0.3
    assert compiled["central"]["bound"] == "GPU" and compiled["central"]["mfu"] >= 0.5
    assert compiled["kernels_per_micro_step"] < eager["kernels_per_micro_step"] / 4
    for run in host.values():
        assert run["optimistic"]["mfu"] >= run["central"]["mfu"] >= run["pessimistic"]["mfu"]
    for name, assumption in result["assumptions"].items():
        if isinstance(assumption, dict):
            assert assumption["source"] and set(assumption) >= {"optimistic", "central", "pessimistic"}, name
    assert result["left_out"]


def test_the_committed_counts_add_up() -> None:
    """bench/step_ops.json: 60 layers = outside + 60 x (forward + backward), and only the compiled run has calls."""
    document = json.loads(mfu_estimate.STEP_OPS.read_text())
    for name, run in document["configurations"].items():
        layer = run["per_layer"]
        total = layer["outside_layers"] + 60 * (layer["forward"] + layer["backward"])
        assert abs(run["per_micro_step_at_60_layers"] - total) <= 1, name
        assert (run["compiled_calls_at_60_layers"] > 0) is run["compiled"], name
    assert document["configurations"]["trl as shipped"]["syncs_per_micro_step"] > 10
    assert document["configurations"]["eager"]["syncs_per_micro_step"] == 1
