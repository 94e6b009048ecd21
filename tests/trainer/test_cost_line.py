"""The cost line: the stack's price file, read from a local folder or a bucket URL, times the run's wall time; a
finished run records it in its summary and its run marker."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest

from trainer.cost_line import PRICE_FILE, SUMMARY_COST_KEY, cost_line, describe, read_price, run_cost_line

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

    def test_an_unreadable_price_file_leaves_the_price_out(self, tmp_path: Path) -> None:
        (tmp_path / PRICE_FILE).write_text("{not json")
        line = run_cost_line(tmp_path, wall_seconds=60)
        assert line["estimated_usd"] is None and "could not read" in line["note"]


@pytest.mark.slow
def test_a_finished_run_records_its_cost_line(
    tiny_gemma3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real (tiny) run whose output folder is a URL holding the stack's price file: the summary in the bucket and
    the run marker carry the cost line, priced from that file and the run's own wall time."""
    from tests.trainer.test_training import tiny_recipe
    from trainer.checkpoints import RUN_MARKER
    from trainer.train import SUMMARY_FILE, main

    remote = tmp_path / "bucket/runs/emoji"
    remote.mkdir(parents=True)
    (remote / PRICE_FILE).write_text(json.dumps(PRICE))  # what `pulumi up` writes (infra/cost.py)
    monkeypatch.setenv("GEMMA_FT_STAGING", str(tmp_path / "machine"))
    result = main(tiny_recipe(tiny_gemma3_dir, f"file://{remote}", "output.merge=false", "training.max_steps=1"))

    summary = json.loads((remote / SUMMARY_FILE).read_text())
    line = summary[SUMMARY_COST_KEY]
    assert line == result.summary[SUMMARY_COST_KEY]
    assert line["wall_seconds"] == pytest.approx(summary["wall_time_s"], abs=0.1)
    assert line["estimated_usd"] == pytest.approx(148.21 * 2 * line["wall_seconds"] / 3600, abs=0.01)
    assert (line["gpus"], line["nodes"], line["capacity"], line["hardware"]) == (
        16,
        2,
        "spot",
        PRICE["hardware"],
    )
    assert json.loads((remote / RUN_MARKER).read_text())["summary"][SUMMARY_COST_KEY] == line
