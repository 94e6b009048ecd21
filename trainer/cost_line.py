"""A cost line for every run: wall time, GPUs, nodes, capacity and what the run cost, from the stack's price.

    .venv/bin/python -c "from trainer.cost_line import cost_line; print(cost_line(None, 3600.0))"

Decisions
- The price comes from the stack, never from this package: `pulumi up` writes `PRICE_FILE` into the run's output
  folder (infra/cost.py `price_document`, from infra/pricing.py): one billed unit's hourly price, the units, GPUs,
  capacity and how sure the price is. A file, not an env var or argument: those live in the pod template, and a
  new price there would replace a running Job.
- estimated_usd = hourly price x units x this attempt's wall time: earlier attempts, node start-up and release
  are not in it (the ceiling, `runCostCeilingUsd`, bounds all of them). Without the file, no price. With the
  run's phases (trainer/train.py `Phases`), each phase's seconds and, priced, its share of the cost.
- `run_cost_line` is what the trainer calls at a run's end (trainer/train.py `run_summary`: run_summary.json and
  `_RUN_COMPLETE.json`, accelerate and Ray runs alike); a price file it cannot read costs the run its price, never
  the run. Not here: prices, writing the marker or the summary.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PRICE_FILE = "_PRICE.json"
# The key of the cost line in the completion marker and in run_summary.json.
SUMMARY_COST_KEY = "cost"
PRICE_KEYS = ("hourly_usd", "unit", "units", "gpus", "nodes", "capacity", "hardware", "price_status", "prices_as_of")


def read_price(output_dir: str | Path) -> dict[str, Any] | None:
    """The stack's price document in `output_dir` (a local folder or an fsspec URL); None when there is none."""
    directory = str(output_dir).rstrip("/")
    if "://" in directory:
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(directory)
        path = f"{root}/{PRICE_FILE}"
        if not fs.exists(path):
            return None
        text = fs.cat_file(path).decode()
    else:
        local = Path(directory) / PRICE_FILE
        if not local.is_file():
            return None
        text = local.read_text()
    document = json.loads(text)
    return document if isinstance(document, dict) else None


def cost_line(
    price: dict[str, Any] | None, wall_seconds: float, phases_s: dict[str, float] | None = None
) -> dict[str, Any]:
    """The cost line of one run: its wall time and, with the stack's price, what that time (and each phase) cost."""
    line: dict[str, Any] = {"wall_seconds": round(wall_seconds, 1)}
    if phases_s:
        line["phase_seconds"] = dict(phases_s)
    if not price:
        line["estimated_usd"] = None
        line["note"] = f"no {PRICE_FILE} in the output folder (not run by a stack): no price"
        return line
    line.update({key: price.get(key) for key in PRICE_KEYS})
    hourly, units = float(price["hourly_usd"]), int(price["units"])
    line["estimated_usd"] = round(hourly * units * wall_seconds / 3600, 2)
    line["formula"] = f"{hourly:,.2f} USD/h x {units} {price.get('unit', 'unit')}(s) x {wall_seconds / 3600:.2f} h"
    if phases_s:
        line["phase_usd"] = {name: round(hourly * units * seconds / 3600, 2) for name, seconds in phases_s.items()}
    return line


def describe(line: dict[str, Any]) -> str:
    """One sentence for logs and `python -m trainer`."""
    hours = line["wall_seconds"] / 3600
    if line.get("estimated_usd") is None:
        return f"cost: {hours:.2f} h wall time; {line.get('note', 'no price')}"
    return (
        f"cost: about {line['estimated_usd']:,.2f} USD = {line['formula']} on {line['hardware']} "
        f"({line['gpus']} GPUs, {line['nodes']} node(s), {line['capacity']}; price {line['price_status']}, "
        f"as of {line['prices_as_of']})"
    )


def run_cost_line(
    output_dir: str | Path, wall_seconds: float, phases_s: dict[str, float] | None = None
) -> dict[str, Any]:
    """The cost line of the run in `output_dir`, logged; an unreadable price file leaves the price out."""
    try:
        price = read_price(output_dir)
    except (OSError, ValueError) as error:  # a missing grant or a damaged file must not fail a finished run
        line = cost_line(None, wall_seconds, phases_s)
        line["note"] = f"could not read {PRICE_FILE} in {output_dir}: {error}"
    else:
        line = cost_line(price, wall_seconds, phases_s)
    log.info("%s", describe(line))
    return line
