"""bench/time_to_model.py: W1's wait from `pulumi up` to the adapter, phase by phase, each with its source."""

from __future__ import annotations

import json
from pathlib import Path

from bench import time_to_model


def test_every_phase_has_a_source_and_the_totals_add_up(tmp_path: Path) -> None:
    out = tmp_path / "ttm.json"
    assert time_to_model.main(["--json", str(out)]) == 0
    result = json.loads(out.read_text())
    eager = result["configurations"]["eager"]
    phases = [time_to_model.Phase(**{**p, "seconds": tuple(p["seconds"])}) for p in eager["phases"]]
    assert all(p.source and p.seconds[0] <= p.seconds[1] <= p.seconds[2] for p in phases)
    names = [p.name for p in phases]
    assert "training" in names and "weights from the Hub (first run)" in names
    # the cluster and the image are built side by side: the first `pulumi up` counts the longer of the two
    grouped = [p for p in phases if p.group]
    serial = sum(p.seconds[1] for p in phases if not p.group)
    assert eager["first_up_minutes"][1] == round((serial + max(p.seconds[1] for p in grouped)) / 60, 1)
    later = sum(p.seconds[1] for p in phases if not p.first_up_only)
    assert eager["later_run_minutes"][1] == round(later / 60, 1) < eager["first_up_minutes"][1]
    compiled = result["configurations"]["compiled layers"]["phases"]
    assert "compiling the decoder layers" in [p["name"] for p in compiled]
    assert "compiling the decoder layers" not in names
