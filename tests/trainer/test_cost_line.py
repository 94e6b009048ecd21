"""The cost line: the stack's price file, read from a local folder or a bucket URL, times the run's wall time."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest

from trainer.cost_line import PRICE_FILE, cost_line, describe, read_price

PRICE = {
    "hourly_usd": 148.21,
    "unit": "node",
    "units": 2,
    "gpus": 16,
    "nodes": 2,
    "capacity": "spot",
    "hardware": "a4-highgpu-8g (8 x nvidia-b200), spot, us-central1",
    "price_status": "UNCONFIRMED",
    "prices_as_of": "2026-11-30",
    "stack": "ray-gemma3-vision",
}


class TestCostLine:
    def test_price_times_units_times_wall_time(self, tmp_path: Path) -> None:
        (tmp_path / PRICE_FILE).write_text(json.dumps(PRICE))
        line = cost_line(read_price(tmp_path), wall_seconds=5400)
        assert line["estimated_usd"] == pytest.approx(148.21 * 2 * 1.5, abs=0.01)
        assert (line["gpus"], line["nodes"], line["capacity"]) == (16, 2, "spot")
        assert "about 444.63 USD = 148.21 USD/h x 2 node(s) x 1.50 h" in describe(line)

    def test_from_a_bucket_url(self) -> None:
        """The GKE workloads write to gs://; any fsspec URL reads the same way (memory:// stands in)."""
        fs = fsspec.filesystem("memory")
        fs.pipe(f"/cost-test/runs/r1/{PRICE_FILE}", json.dumps(PRICE).encode())
        assert read_price("memory://cost-test/runs/r1/") == PRICE
        assert read_price("memory://cost-test/runs/other") is None

    def test_without_a_price(self, tmp_path: Path) -> None:
        line = cost_line(read_price(tmp_path), wall_seconds=60)
        assert line["estimated_usd"] is None and line["wall_seconds"] == 60
        assert "no price" in describe(line)
