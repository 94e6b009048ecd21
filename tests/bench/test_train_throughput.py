"""The throughput benchmark end to end on a tiny random Gemma 3: both sides train, the JSON is complete.

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


def test_pack_length_gives_the_requested_rows() -> None:
    """Why: the same number of optimizer steps on both sides rests on this sizing."""
    lengths = [400, 380, 450, 420, 390, 410, 430, 440]
    length = train_throughput.choose_pack_length(lengths, target_rows=4)
    assert length >= max(lengths)
    assert train_throughput.packed_rows(lengths, length) <= 4
    assert train_throughput.packed_rows(lengths, length - 8) > 4
