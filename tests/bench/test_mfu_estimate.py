"""bench/mfu_estimate.py: the expected MFU of W1's strategies, from the shape, the GPU specs and the memory model."""

from __future__ import annotations

import json
from pathlib import Path

from bench import mfu_estimate


def test_w1_estimate_picks_ddp_and_it_moves_no_frozen_weights(tmp_path: Path) -> None:
    """Why: the strategy recipe validation picks must be the one the estimate expects to use the GPUs best."""
    out = tmp_path / "mfu.json"
    assert mfu_estimate.main(["--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["strategies"]
    assert result["picked"] == "ddp" and result["gpu"] == "B200" and result["world_size"] == 8
    assert rows["fsdp"]["communication_ms"] == 2 * rows["fsdp-gathered"]["communication_ms"]  # two gathers vs one
    assert rows["ddp"]["communication_ms"] < 1  # the LoRA gradients, once per 16 micro-steps
    assert rows["ddp"]["mfu_serial"] >= 0.45 > rows["fsdp"]["mfu_overlapped"]
    assert rows["fsdp-gathered"]["mfu_serial"] < rows["ddp"]["mfu_serial"]
    # 62 GB of bf16 base, ~30.7B parameters: every rank all-gathers 7/8 of it per gather at ~720 GB/s
    assert 120 < rows["fsdp"]["communication_ms"] < 180
