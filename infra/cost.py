"""What one training run can cost at most, and what serving costs per hour, from the one price table.

    runCostCeilingUsd = (hourly price x nodes + cluster fee) x (deadline + tail) x attempts

Decisions (why and sources: docs/costs.md#the-ceiling-is-an-upper-bound)
- The ceiling follows each workload's real deadline and retries: gke-job 1 attempt (its deadline covers
  retries); gke-ray `backoffLimit` + 1, plus the cluster TTL; cloud-run `maxRetries` + 1, no tail.
- GKE nodes outlive their Pods: `NODE_RELEASE_S` per attempt; GKE runs add the cluster fee for the window.
- A standing Ray cluster has no deadline, so no ceiling (`maxRunCostUsd` refuses it).
- Serving: every instance `servingMaxInstances` allows awake for an hour; one cold start from the request
  (serving/startup.py) and an idle instance until scale-in, both billed (instance-based billing).
- Each run's price goes to a file in its output folder (`price_document`), not to the pod template,
  where a new price would replace a running Job.
Not here: the prices (`infra.pricing`), enforcing the limit (`infra.preflight`, the policy pack's
`run-cost-within-limit`, which a test keeps equal to this).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_gcp as gcp

from infra import cloud_run, ray_job, serving
from infra.config import RayClusterMode, StackConfig, Workload
from infra.pricing import (
    CLOUD_RUN_CPU_SECOND,
    CLOUD_RUN_MEMORY_SECOND,
    GKE_CLUSTER_FEE_CENTS,
    PRICES_AS_OF,
    HourlyPrice,
    cloud_run_instance_hour,
    gke_node_hour,
)
from trainer.cost_line import PRICE_FILE, SUMMARY_COST_KEY

NODE_RELEASE_S = 600


@dataclass(frozen=True)
class RunCeiling:
    """The most one training run can cost, as a product of the settings that move it."""

    hourly: HourlyPrice | None
    nodes: int
    deadline_s: int
    tail_s: int
    attempts: int
    bounded: bool = True
    """False for a standing Ray cluster: it bills until it is switched off."""
    unit: str = "node"
    """What the hourly price is for: a GKE node or a Cloud Run instance."""
    fee_cents: int = 0
    """Per hour on top of the nodes: the GKE cluster management fee (none on Cloud Run)."""

    @property
    def usd(self) -> float | None:
        if self.hourly is None or not self.bounded:
            return None
        cents_per_hour = self.hourly.cents * self.nodes + self.fee_cents
        return round(cents_per_hour * self.attempts * (self.deadline_s + self.tail_s) / 3600 / 100, 2)

    @property
    def per_hour_usd(self) -> float | None:
        return None if self.hourly is None else round((self.hourly.cents * self.nodes + self.fee_cents) / 100, 2)

    def formula(self) -> str:
        price = f"${self.hourly.usd:,.2f}/h" if self.hourly else "unknown $/h"
        hours = (self.deadline_s + self.tail_s) / 3600
        per_hour = f"{price} x {self.nodes} {self.unit}(s)"
        if self.fee_cents:
            per_hour = f"({per_hour} + ${self.fee_cents / 100:,.2f}/h cluster fee)"
        return (
            f"{per_hour} x {hours:.2f} h (deadline {self.deadline_s // 60} min + "
            f"{self.tail_s // 60} min release) x {self.attempts} attempt(s)"
        )


def training_hour(cfg: StackConfig) -> HourlyPrice | None:
    """The hourly price of one training node (GKE) or instance (Cloud Run), as the workload labels it."""
    if cfg.workload is Workload.CLOUD_RUN:
        return cloud_run.training_instance_hour(cfg)
    return gke_node_hour(cfg)


def serving_hour(cfg: StackConfig) -> HourlyPrice | None:
    """The hourly price of one vLLM instance, as the service is sized."""
    limits = serving.service_limits(cfg)
    return cloud_run_instance_hour(cfg, cfg.serving_gpu_type, cfg.gpu_zonal_redundancy, limits, serving=True)


def serving_cold_start_text(cfg: StackConfig) -> str:
    """One cold start from the request, its parts, and what it and an idle instance until scale-in cost."""
    cold = serving.served_cold_start(cfg)
    low, high = cold.from_request_s()
    hourly = serving_hour(cfg)
    idle_min = serving.IDLE_BEFORE_SCALE_IN_S // 60
    idle_s = serving.IDLE_BEFORE_SCALE_IN_S
    if hourly is None:
        limits = serving.service_limits(cfg)
        per_s = (
            float(limits["cpu"]) * CLOUD_RUN_CPU_SECOND.usd
            + float(limits["memory"].removesuffix("Gi")) * CLOUD_RUN_MEMORY_SECOND.usd
        )
        price = (
            f"at least {low * per_s:,.2f}-{high * per_s:,.2f} USD per cold start and {idle_s * per_s:,.2f} USD for an "
            f"idle instance until scale-in ({idle_min} min), for its {limits['cpu']} vCPU and {limits['memory']} alone: "
            f"the price table has no Cloud Run {cfg.serving_gpu_type} GPU figure; set the instance's with "
            "`pulumi config set servingHourPriceUsd 12.34`"
        )
    else:
        per_s = hourly.usd / 3600
        price = (
            f"{low * per_s:,.2f}-{high * per_s:,.2f} USD per cold start, {idle_s * per_s:,.2f} USD for an idle "
            f"instance until scale-in ({idle_min} min; scale to zero is not free on a GPU), at {hourly.describe()}"
        )
    return f"{low}-{high} s from the request ({'; '.join(cold.lines())}); {price}"


def run_ceiling(cfg: StackConfig) -> RunCeiling:
    deadline = cfg.timeout_minutes * 60
    hourly = training_hour(cfg)
    if cfg.workload is Workload.CLOUD_RUN:
        return RunCeiling(hourly, 1, deadline, 0, cfg.training_retries + 1, unit="instance")
    fee = GKE_CLUSTER_FEE_CENTS
    if cfg.workload is Workload.GKE_JOB:
        return RunCeiling(hourly, cfg.nodes, deadline, NODE_RELEASE_S, 1, fee_cents=fee)
    standing = cfg.ray_cluster is RayClusterMode.STANDING
    tail = NODE_RELEASE_S + (0 if standing else ray_job.CLUSTER_TTL_AFTER_FINISHED_S)
    return RunCeiling(hourly, cfg.nodes, deadline, tail, cfg.training_retries + 1, bounded=not standing, fee_cents=fee)


def serving_per_hour_usd(cfg: StackConfig) -> float | None:
    hourly = serving_hour(cfg)
    return None if hourly is None else round(hourly.cents * cfg.serving_max_instances / 100, 2)


def outputs(cfg: StackConfig) -> dict[str, object]:
    """The stack outputs about cost: the ceiling (a number, or None), how it is made, and serving per hour."""
    ceiling = run_ceiling(cfg)
    out: dict[str, object] = {
        "runCostCeilingUsd": ceiling.usd,
        "runCostCeiling": _ceiling_text(cfg, ceiling),
    }
    if cfg.serving_enabled:
        out["servingCostPerHourUsd"] = serving_per_hour_usd(cfg)
        out["servingColdStart"] = serving_cold_start_text(cfg)
        out["servingMemory"] = serving.served_memory_of(cfg).line()
    return out


def _ceiling_text(cfg: StackConfig, ceiling: RunCeiling) -> str:
    if ceiling.hourly is None:
        return (
            "unknown: the price table has no figure for this hardware; "
            "set one with `pulumi config set trainingHourPriceUsd 12.34`"
        )
    if not ceiling.bounded:
        return (
            f"unbounded: the standing Ray cluster bills {ceiling.per_hour_usd:,.2f} USD/h for its GPU nodes until "
            "rayCluster is set back to ephemeral"
        )
    limit = f"; maxRunCostUsd={cfg.max_run_cost_usd}" if cfg.max_run_cost_usd is not None else ""
    return f"{ceiling.usd:,.2f} USD = {ceiling.formula()}; {ceiling.hourly.describe()}{limit}"


def price_document(cfg: StackConfig) -> dict[str, Any] | None:
    """What the trainer needs for its cost line (`trainer.cost_line`); None when the table has no price."""
    hourly = training_hour(cfg)
    if hourly is None:
        return None
    cloud = cfg.workload is Workload.CLOUD_RUN
    return {
        "hourly_usd": hourly.usd,
        "unit": "instance" if cloud else "node",
        "units": 1 if cloud else cfg.nodes,
        "gpus": cfg.total_gpus,
        "nodes": 1 if cloud else cfg.nodes,
        "capacity": "cloud-run" if cloud else str(cfg.capacity),
        "hardware": hourly.what,
        "price_status": str(hourly.status),
        "prices_as_of": PRICES_AS_OF,
        "stack": cfg.stack,
    }


def declare_price_file(
    name: str, cfg: StackConfig, bucket: pulumi.Input[str], run_dir: pulumi.Input[str], after: list[pulumi.Resource]
) -> gcp.storage.BucketObject | None:
    """The run's price document at `<run_dir>/_PRICE.json` (run_dir = gs://BUCKET/PATH), where the trainer reads it
    when the run ends. Retained on delete: a run folder belongs to its run, so neither `pulumi destroy` nor the
    next run id (a replacement under a new name) takes the price from a run that may still be training."""
    document = price_document(cfg)
    if document is None:
        return None
    path = pulumi.Output.all(run_dir, bucket).apply(
        lambda parts: f"{parts[0].removeprefix(f'gs://{parts[1]}/').rstrip('/')}/{PRICE_FILE}"
    )
    return gcp.storage.BucketObject(
        f"{name}-price",
        bucket=bucket,
        name=path,
        content=json.dumps(document, indent=2, sort_keys=True),
        content_type="application/json",
        opts=pulumi.ResourceOptions(depends_on=after, retain_on_delete=True),
    )


def cost_line_command(run_dir: str) -> str:
    """Prints the cost line of the stack's current (latest) run, once it has finished."""
    return (
        f"gcloud storage cat {run_dir}/run_summary.json | python3 -c "
        f"\"import json, sys; print(json.dumps(json.load(sys.stdin)['{SUMMARY_COST_KEY}'], indent=2))\""
    )
