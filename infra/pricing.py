"""The one price table: what an hour of a training node, a training instance or a serving instance costs.

    .venv/bin/python -m infra.pricing          # the table as Markdown (docs/costs.md shows this)

Every figure carries its source, the date the source stated it and how sure it is (`Status`: PUBLISHED,
SECONDARY, BOUND, UNCONFIRMED). Prices move, so a stack overrides them with `trainingHourPriceUsd` /
`servingHourPriceUsd`; a figure the table lacks must be overridden before a ceiling can be enforced.

Decisions (why and sources: docs/costs.md#the-ceiling-is-an-upper-bound)
- Units: a GKE node-hour (the whole machine) and a Cloud Run instance-hour; rounded UP to whole cents,
  so each stays an upper bound and fits the label the policy pack reads (`cost_labels`).
- Figures are for us-central1; Spot and flex-start fall back to on-demand where no figure of their own.
- The GKE cluster fee (`GKE_CLUSTER_HOUR`) is a row of its own; the free tier's credit is not subtracted.
Not here: the ceiling of a run (`infra.cost`), the Autopilot accelerator premium (size UNCONFIRMED), the
Ray head's CPU Pod, storage, egress and image builds.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from enum import StrEnum

from infra.catalog import GKE_ACCELERATORS
from infra.config import Capacity, StackConfig

PRICES_AS_OF = "2026-11-30"
PRICE_REGION = "us-central1"


class Status(StrEnum):
    PUBLISHED = "published"
    SECONDARY = "secondary"
    BOUND = "bound"
    UNCONFIRMED = "UNCONFIRMED"
    OVERRIDE = "stack override"


@dataclass(frozen=True)
class Price:
    """One figure of the table, with where it comes from."""

    usd: float
    unit: str
    source: str
    stated: str
    """When the source stated it (YYYY-MM or YYYY-MM-DD)."""
    status: Status
    note: str = ""


_SPOT_RULE = (
    "Spot is priced below on-demand, at a discount that moves (cloud.google.com/spot-vms/pricing: 'up to 91%'); "
    "a3-ultragpu-8g Spot is 60 % of on-demand in this table, so no fixed fraction bounds it"
)
_BILLING_TRANSCRIPT = (
    "Cloud Billing Catalog SKUs for us-central1 (Cloud Run, instance-based), transcribed in a public deployment "
    "guide; the GPU and memory rows of cloud.google.com/run/pricing were not readable here"
)
_A4_ON_DEMAND = Price(
    148.21,
    "USD per node-hour (a4-highgpu-8g, 8 x B200)",
    "a public GPU price comparison ('GCP a4-highgpu-8g: $148.21/hr'); no Google page with this figure was found",
    "2026",
    Status.UNCONFIRMED,
    "check cloud.google.com/compute/vm-instance-pricing (A4) and override with trainingHourPriceUsd",
)
_A3_HIGH_ON_DEMAND = Price(
    88.49,
    "USD per node-hour (a3-highgpu-8g, 8 x H100)",
    "github.com/Cyclenerd/google-cloud-pricing-cost-calculator pricing.yml (from the Cloud Billing Catalog)",
    "2026-02-12",
    Status.SECONDARY,
)
_A3_HIGH_SPOT = Price(
    35.40,
    "USD per node-hour (a3-highgpu-8g Spot)",
    "github.com/Cyclenerd/google-cloud-pricing-cost-calculator pricing.yml (from the Cloud Billing Catalog)",
    "2026-02-12",
    Status.SECONDARY,
    "Spot prices may change daily",
)
_A3_ULTRA_ON_DEMAND = Price(
    83.49,
    "USD per node-hour (a3-ultragpu-8g, 8 x H200: 8 x 10.4365)",
    "huggingface.co/datasets/tanod/cloud-gpu-list-prices (source: Cloud Billing Catalog API)",
    "2026-10-13",
    Status.SECONDARY,
)
_A3_ULTRA_SPOT = Price(
    50.09,
    "USD per node-hour (a3-ultragpu-8g Spot: 8 x 6.2607)",
    "huggingface.co/datasets/tanod/cloud-gpu-list-prices (source: Cloud Billing Catalog API)",
    "2026-10-13",
    Status.SECONDARY,
    "Spot prices may change daily",
)

GKE_CLUSTER_HOUR = Price(
    0.10,
    "USD per cluster-hour (GKE cluster management fee, Autopilot included)",
    "cloud.google.com/kubernetes-engine/pricing: 'A flat cluster management fee of $0.10 per cluster per hour "
    "(charged in 1 second increments) applies to all GKE clusters irrespective of the mode of operation'",
    "2026",
    Status.PUBLISHED,
    "the free tier's $74.40 monthly credit per billing account is not subtracted",
)
# What the policy pack adds per GKE cluster-hour (infra/policy/policies.py GKE_CLUSTER_FEE_CENTS, kept equal).
GKE_CLUSTER_FEE_CENTS = round(GKE_CLUSTER_HOUR.usd * 100)

# On-demand and (where known) Spot node-hour by (accelerator, GPUs per node). Missing: no figure was found.
GKE_NODE_HOUR: dict[tuple[str, int], dict[str, Price]] = {
    ("nvidia-b200", 8): {"on-demand": _A4_ON_DEMAND},
    ("nvidia-h100-80gb", 8): {"on-demand": _A3_HIGH_ON_DEMAND, "spot": _A3_HIGH_SPOT},
    ("nvidia-h200-141gb", 8): {"on-demand": _A3_ULTRA_ON_DEMAND, "spot": _A3_ULTRA_SPOT},
}

CLOUD_RUN_CPU_SECOND = Price(
    0.000018,
    "USD per vCPU-second (instance-based billing, jobs)",
    "cloud.google.com/run/pricing, Tier 1: 'Services with CPU always allocated / Jobs: $0.00001800 / vCPU-second'; "
    "the same figure in the Billing Catalog transcription of 2026-08",
    "2026-08",
    Status.PUBLISHED,
)
CLOUD_RUN_MEMORY_SECOND = Price(
    0.000002,
    "USD per GiB-second (instance-based billing, jobs)",
    _BILLING_TRANSCRIPT,
    "2026-08",
    Status.SECONDARY,
)
# GPU-second by (GPU, zonal redundancy). Jobs run without zonal redundancy (Cloud Run jobs GPU docs).
CLOUD_RUN_GPU_SECOND: dict[tuple[str, bool], Price] = {
    ("nvidia-l4", False): Price(
        0.0001867,
        "USD per GPU-second, L4 without zonal redundancy ($0.672/h)",
        _BILLING_TRANSCRIPT,
        "2026-08",
        Status.SECONDARY,
        "'roughly $0.67 per hour' for an L4 (brandonseppa.com, 2026-04) agrees",
    ),
    ("nvidia-l4", True): Price(
        0.0002909,
        "USD per GPU-second, L4 with zonal redundancy ($1.047/h)",
        _BILLING_TRANSCRIPT,
        "2026-08",
        Status.SECONDARY,
    ),
}


@dataclass(frozen=True)
class HourlyPrice:
    """The price of one node or instance for one hour, rounded up to whole cents, and what it rests on."""

    cents: int
    what: str
    basis: tuple[Price, ...]
    status: Status

    @property
    def usd(self) -> float:
        return self.cents / 100

    def describe(self) -> str:
        return f"${self.usd:,.2f}/h for {self.what} ({self.status}; prices as of {PRICES_AS_OF})"


def _cents(usd: float) -> int:
    return math.ceil(round(usd * 100, 6))


def _weakest(prices: list[Price], region: str) -> Status:
    order = [Status.UNCONFIRMED, Status.BOUND, Status.SECONDARY, Status.PUBLISHED]
    if region != PRICE_REGION:
        return Status.UNCONFIRMED
    return next(s for s in order if any(p.status is s for p in prices))


def _override(usd: float, what: str) -> HourlyPrice:
    basis = Price(usd, "USD per hour", "stack configuration", "", Status.OVERRIDE)
    return HourlyPrice(_cents(usd), what, (basis,), Status.OVERRIDE)


def gke_node_hour(cfg: StackConfig) -> HourlyPrice | None:
    """One GKE training node for an hour at the stack's capacity; None when the table has no figure."""
    assert cfg.gpu_type and cfg.gpus_per_node, "config validation guarantees these on GKE"
    machine = GKE_ACCELERATORS[cfg.gpu_type].machine_type(cfg.gpus_per_node)
    what = f"{machine} ({cfg.gpus_per_node} x {cfg.gpu_type}), {cfg.capacity}, {cfg.region}"
    if cfg.training_hour_price_usd is not None:
        return _override(cfg.training_hour_price_usd, what)
    rates = GKE_NODE_HOUR.get((cfg.gpu_type, cfg.gpus_per_node))
    if rates is None:
        return None
    on_demand = rates["on-demand"]
    basis: list[Price] = [on_demand]
    usd = on_demand.usd
    spot = rates.get("spot") if cfg.capacity is Capacity.SPOT else None
    # without a Spot figure, the on-demand one bounds it (docs/costs.md#the-ceiling-is-an-upper-bound)
    if spot is not None:
        basis = [spot]
        usd = spot.usd
    return HourlyPrice(_cents(usd), what, tuple(basis), _weakest(basis, cfg.region))


def cloud_run_instance_hour(
    cfg: StackConfig, gpu: str, zonal_redundancy: bool, limits: dict[str, str], serving: bool
) -> HourlyPrice | None:
    """One Cloud Run GPU instance with these limits (`cpu`, `memory` in Gi) for an hour; None when the GPU
    has no figure in the table."""
    what = f"Cloud Run {gpu} + {limits['cpu']} vCPU + {limits['memory']}, {cfg.region}"
    override = cfg.serving_hour_price_usd if serving else cfg.training_hour_price_usd
    if override is not None:
        return _override(override, what)
    gpu_second = CLOUD_RUN_GPU_SECOND.get((gpu, zonal_redundancy))
    if gpu_second is None:
        return None
    cpu = float(limits["cpu"])
    memory_gib = float(limits["memory"].removesuffix("Gi"))
    usd = 3600 * (gpu_second.usd + cpu * CLOUD_RUN_CPU_SECOND.usd + memory_gib * CLOUD_RUN_MEMORY_SECOND.usd)
    basis = [gpu_second, CLOUD_RUN_CPU_SECOND, CLOUD_RUN_MEMORY_SECOND]
    return HourlyPrice(_cents(usd), what, tuple(basis), _weakest(basis, cfg.region))


# Labels on a training workload: the price the program used and the stack's limit. The policy pack reads them
# with the workload's own deadline, size and retries (infra/policy/policies.py `run_cost_within_limit`).
NODE_HOUR_CENTS_LABEL = "node-hour-cents"
MAX_RUN_COST_LABEL = "max-run-cost-usd"
K8S_LABEL_PREFIX = "gemma-finetune/"


def cost_labels(cfg: StackConfig, hourly: HourlyPrice | None, kubernetes: bool) -> dict[str, str]:
    """`node-hour-cents` (when the price is known) and `max-run-cost-usd` (when the stack sets one)."""
    prefix = K8S_LABEL_PREFIX if kubernetes else ""
    labels: dict[str, str] = {}
    if hourly is not None:
        labels[prefix + NODE_HOUR_CENTS_LABEL] = str(hourly.cents)
    if cfg.max_run_cost_usd is not None:
        labels[prefix + MAX_RUN_COST_LABEL] = str(cfg.max_run_cost_usd)
    return labels


def all_prices() -> list[tuple[str, Price]]:
    """Every figure of the table with the row it prices (the docs/costs.md table and its test)."""
    rows: list[tuple[str, Price]] = []
    for (gpu, count), rates in GKE_NODE_HOUR.items():
        machine = GKE_ACCELERATORS[gpu].machine_type(count)
        rows += [(f"GKE {machine}, {capacity}", price) for capacity, price in rates.items()]
    rows += [
        (f"Cloud Run {gpu} GPU{' (zonal redundancy)' if zr else ''}", p)
        for (gpu, zr), p in CLOUD_RUN_GPU_SECOND.items()
    ]
    rows.append(("GKE cluster management fee", GKE_CLUSTER_HOUR))
    rows += [("Cloud Run vCPU", CLOUD_RUN_CPU_SECOND), ("Cloud Run memory", CLOUD_RUN_MEMORY_SECOND)]
    return rows


# How a capacity without its own figure is priced (rendered under the docs/costs.md table).
RULES = (
    f"Spot without a figure: the on-demand figure, an upper bound ({_SPOT_RULE}).",
    "Flex-start (DWS): the on-demand figure, an upper bound (its own rate was not found; Google describes it as "
    "cheaper than on-demand).",
    "Reservation: the on-demand figure of the reserved machines (a reservation bills whether used or not).",
    "Another region: the us-central1 figure, reported as UNCONFIRMED for that region.",
    "GKE: the cluster management fee is added once per cluster for the whole run window (deadline + node "
    "release, each attempt).",
    "Not included: the Autopilot premium on accelerator nodes (size UNCONFIRMED), the Ray head's CPU Pod, "
    "storage, egress, builds.",
)


def _figure(usd: float) -> str:
    return f"{usd:.7f}".rstrip("0").rstrip(".") if usd < 1 else f"{usd:,.2f}"


def markdown() -> str:
    lines = [
        f"Prices in USD for {PRICE_REGION}, table assembled {PRICES_AS_OF} (`infra/pricing.py`).",
        "",
        "| what | price | unit | status | source (stated) |",
        "|---|---|---|---|---|",
    ]
    for what, price in all_prices():
        note = f" {price.note}." if price.note else ""
        lines.append(
            f"| {what} | {_figure(price.usd)} | {price.unit} | {price.status} | {price.source} ({price.stated}).{note} |"
        )
    lines += ["", *[f"- {rule}" for rule in RULES]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    print(markdown())


if __name__ == "__main__":
    main()
