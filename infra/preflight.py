"""Checks against the live project that run before any resource is declared, so `pulumi preview` fails too.

    pulumi preview --stack a4-gemma4     # stops here, naming the key, when the capacity cannot exist
    pulumi config set preflight warn     # report the same problems as warnings and go on

Decisions (why and sources: docs/program.md#preflight-asks-the-cloud)
- `infra.config` judges values on their own; preflight asks the cloud, through the provider's invokes
  (so it runs in previews and under mocks). `check(cfg)` reports every problem at once with its fix.
- `preflight`: `strict` (default) stops, `warn` logs, `off` skips; `check_cost_ceiling` always applies.
- `capacity: reservation`: a SPECIFIC reservation of the right machine type in the region, with at least
  `nodes` machines; one that is big enough but busy only warns (it may be this stack's own run).
- Otherwise the GPU quota of the capacity type must cover the run; a quota that cannot be read or found
  is "could not check", never "0". Limits only: usage by others is not seen.
Not here: prices and the ceiling (`infra.cost`); its permissions: infra/offline/api_permissions.py.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_gcp as gcp

from infra import cost
from infra.catalog import (
    CLOUD_RUN_GPU_QUOTA,
    CLOUD_RUN_QUOTA_SERVICE,
    GKE_ACCELERATORS,
    GKE_GPU_QUOTAS,
    GPUS_ALL_REGIONS,
    GpuQuota,
)
from infra.config import Capacity, PreflightMode, StackConfig, Workload

READ_ROLE = "roles/compute.viewer"
QUOTA_PERMISSION = "cloudquotas.quotas.get"
QUOTA_ROLE = "roles/cloudquotas.viewer"
QUOTA_API = "cloudquotas.googleapis.com"
# How long an increase takes: Google states no time; a large increase "can take longer to be approved"
# (https://docs.cloud.google.com/docs/quotas/help/request_increase). New projects have no Cloud Run GPU quota
# at all (https://cloud.google.com/run/docs/configuring/services/gpu-zonal-redundancy, "Request quota").
QUOTA_APPROVAL = "in no time Google states, longer for a large increase: a new project has none, so ask first"
WARN_FIX = "pulumi config set preflight warn"
# With user credentials (gcloud auth application-default login) the Cloud Quotas API answers 403 "The
# cloudquotas.googleapis.com API requires a quota project, which is not set by default" (reason
# SERVICE_DISABLED: cloud.google.com/docs/quotas/troubleshoot, "Set your quota project"): the provider's data
# source sends no X-Goog-User-Project (magic-modules data_source_google_cloud_quotas_quota_info.go calls
# SendRequest without a Project). Google's auth libraries take the quota project from this variable
# (googleapis/google-auth-library-python#1163), and the Google provider honours it: it even wins over
# `billing_project` (hashicorp/terraform-provider-google#17882); setting it "does seem to work" for pulumi-gcp
# (pulumi/pulumi-gcp#2032). Enabling the API, which the SERVICE_DISABLED reason suggests, does not help.
QUOTA_PROJECT_MISSING = "requires a quota project"
QUOTA_PROJECT_ENV = "GOOGLE_CLOUD_QUOTA_PROJECT"


class PreflightError(pulumi.RunError):
    """The stack's configuration cannot work in its project; raised before any resource is declared."""


@dataclass(frozen=True)
class FoundReservation:
    """The fields of a `getReservation` result the check reads (the zone as a name, not a URL)."""

    zone: str
    specific: bool
    machine_types: tuple[str, ...]
    count: int
    in_use: int
    shared_with: tuple[str, ...]
    share_type: str

    @staticmethod
    def parse(result: Any) -> FoundReservation | None:
        """None for the data source's empty not-found answer (no self link, no specific reservations)."""
        specifics = list(result.specific_reservations or [])
        if not result.self_link and not result.creation_timestamp and not specifics:
            return None
        machines = tuple(
            _last_segment(prop.machine_type)
            for spec in specifics
            for prop in (spec.instance_properties or [])
            if prop.machine_type
        )
        shared: list[str] = []
        share_type = ""
        for settings in result.share_settings or []:
            share_type = settings.share_type or share_type
            shared += list(settings.projects or [])
            shared += [m.project_id or m.id for m in settings.project_maps or []]
        return FoundReservation(
            zone=_last_segment(result.zone or ""),
            specific=bool(result.specific_reservation_required),
            machine_types=machines,
            count=sum(int(spec.count or 0) for spec in specifics),
            in_use=sum(int(spec.in_use_count or 0) for spec in specifics),
            shared_with=tuple(shared),
            share_type=share_type,
        )

    @property
    def free(self) -> int:
        return self.count - self.in_use


def _last_segment(value: str) -> str:
    """`…/zones/us-central1-a` → `us-central1-a`; a plain name stays as it is."""
    return value.rstrip("/").rsplit("/", 1)[-1]


def _is_not_found(error: Exception) -> bool:
    text = str(error).lower()
    return "404" in text or "notfound" in text or "not found" in text


def _list_command(project: str, name: str) -> str:
    """Lists the reservation in every zone (its zone, count and in-use count); `describe` shows the rest."""
    return f"gcloud compute reservations list --project {project} --filter='name={name}'"


def _access_problem(project: str, what: str, error: Exception) -> str:
    return (
        f"preflight could not {what} in project {project}: {error}. The identity running pulumi needs "
        f"compute.zones.list and compute.reservations.get there ({READ_ROLE} has both): "
        f"gcloud projects add-iam-policy-binding {project} --role={READ_ROLE} --member=user:YOU@example.com; "
        f"or skip the check: {WARN_FIX}"
    )


def check_reservation(cfg: StackConfig) -> list[str]:
    """`capacity: reservation`: the named reservation exists in the region, is SPECIFIC, holds the GPU's machine
    type and at least `nodes` machines, warning when fewer are free now (shared with this project when another project owns it)."""
    if cfg.workload is Workload.CLOUD_RUN or cfg.capacity is not Capacity.RESERVATION:
        return []
    assert cfg.reservation_name and cfg.gpu_type and cfg.gpus_per_node, "config validation guarantees these"
    name, owner = cfg.reservation_name, cfg.reservation_project or cfg.project
    where = f"reservationName={name!r} (project {owner})"
    try:
        zones = list(gcp.compute.get_zones(project=owner, region=cfg.region).names or [])
    except Exception as error:  # the SDK raises a plain Exception for any failed invoke; report it with the fix
        return [_access_problem(owner, f"list the zones of {cfg.region}", error)]
    found: list[FoundReservation] = []
    for zone in zones:
        try:
            result = gcp.compute.get_reservation(name=name, zone=zone, project=owner)
        except Exception as error:  # a 404 means "not in this zone"; anything else is about access
            if _is_not_found(error):
                continue
            return [_access_problem(owner, f"read reservation {name} in {zone}", error)]
        reservation = FoundReservation.parse(result)
        if reservation is not None:
            found.append(reservation)
    if not found:
        return [
            f"{where} does not exist in region {cfg.region} (looked in {', '.join(zones) or 'no zones'}); "
            f"the cluster runs in gcp:region={cfg.region} and can only use a reservation in one of its zones. "
            f"Find yours and its zone with `{_list_command(owner, name)}`, then "
            f"`pulumi config set reservationName NAME` (and gcp:region to its region, or reservationProject "
            "to the project that owns it), or choose capacity spot | flex-start | on-demand"
        ]
    problems = [_judge(cfg, where, reservation) for reservation in found]
    usable = [reservation for reservation, problem in zip(found, problems, strict=True) if problem is None]
    if not usable:
        return [problem for problem in problems if problem]
    if all(reservation.free < cfg.nodes for reservation in usable):
        pulumi.log.warn(_busy(cfg, where, usable[0]))
    return []


def _busy(cfg: StackConfig, where: str, reservation: FoundReservation) -> str:
    assert cfg.reservation_name
    owner = cfg.reservation_project or cfg.project
    return (
        f"{where} in {reservation.zone}: {reservation.in_use} of its {reservation.count} machines are in use now and "
        f"nodes={cfg.nodes} needs {cfg.nodes} free. If this stack's own run holds them, nothing changes (or the new "
        "run replaces it); otherwise the training pods stay Pending until machines are freed. Who holds them: "
        f"gcloud compute instances list --project {owner} --filter='zone~{reservation.zone}' "
        f"--format='table(name,status,reservationAffinity.values)'"
    )


def _judge(cfg: StackConfig, where: str, reservation: FoundReservation) -> str | None:
    """None when this reservation can hold the run; otherwise every reason it cannot, in one message."""
    assert cfg.gpu_type and cfg.gpus_per_node and cfg.reservation_name
    owner = cfg.reservation_project or cfg.project
    accelerator = GKE_ACCELERATORS[cfg.gpu_type]
    machine = accelerator.machine_type(cfg.gpus_per_node)
    reasons: list[str] = []
    zone_region = reservation.zone.rsplit("-", 1)[0]
    if zone_region != cfg.region:
        reasons.append(f"it is in zone {reservation.zone}, not in gcp:region={cfg.region}")
    if not reservation.specific:
        reasons.append(
            "it is not SPECIFIC (specificReservationRequired=false); GKE Autopilot consumes specific "
            "reservations only: create one with `gcloud compute reservations create … --require-specific-reservation`"
        )
    if reservation.machine_types and not any(fnmatch.fnmatch(m, machine) for m in reservation.machine_types):
        reasons.append(
            f"it reserves {', '.join(reservation.machine_types)}, but gpuType={cfg.gpu_type} with "
            f"gpusPerNode={cfg.gpus_per_node} runs on {machine}"
        )
    if reservation.count < cfg.nodes:
        reasons.append(
            f"it holds {reservation.count} machines ({reservation.in_use} in use), and nodes={cfg.nodes} needs "
            f"{cfg.nodes}; lower nodes or use a larger reservation"
        )
    if owner != cfg.project and cfg.project not in reservation.shared_with:
        reasons.append(
            f"project {owner} owns it but does not share it with gcp:project={cfg.project} "
            f"(share type {reservation.share_type or 'LOCAL'}): "
            f"`gcloud compute reservations update {cfg.reservation_name} --zone {reservation.zone} "
            f"--project {owner} --add-share-with {cfg.project}`"
        )
    if not reasons:
        return None
    return (
        f"{where} in {reservation.zone} cannot hold this run: " + "; ".join(reasons) + ". "
        f"Reservations: `{_list_command(owner, cfg.reservation_name)}`"
    )


@dataclass(frozen=True)
class QuotaNeed:
    """GPUs one quota must cover, and the settings that ask for them."""

    quota: GpuQuota
    needed: int
    because: str


def gpu_quota_needs(cfg: StackConfig) -> list[QuotaNeed]:
    """The quotas this stack draws GPUs from, and how many it needs of each (none for a reservation)."""
    if cfg.workload is Workload.CLOUD_RUN:
        return _cloud_run_needs(cfg)
    needs = _serving_needs(cfg, {})  # every stack serves on Cloud Run (infra/serving.py)
    if cfg.capacity is Capacity.RESERVATION:
        return needs
    assert cfg.gpu_type and cfg.gpus_per_node
    preemptible = cfg.capacity in (Capacity.SPOT, Capacity.FLEX_START)
    needed = cfg.nodes * cfg.gpus_per_node
    because = f"capacity={cfg.capacity} with nodes={cfg.nodes} x gpusPerNode={cfg.gpus_per_node} ({cfg.gpu_type})"
    needs.append(QuotaNeed(GKE_GPU_QUOTAS[(cfg.gpu_type, preemptible)], needed, because))
    if not preemptible:
        needs.append(QuotaNeed(GPUS_ALL_REGIONS, needed, because))
    return needs


def _cloud_run_needs(cfg: StackConfig) -> list[QuotaNeed]:
    job = CLOUD_RUN_GPU_QUOTA[(cfg.gpu_type or "nvidia-l4", False)]
    return _serving_needs(cfg, {job: [(1, f"the training Job (gpuType={cfg.gpu_type}, 1 task)")]})


def _serving_needs(cfg: StackConfig, needs: dict[str, list[tuple[int, str]]]) -> list[QuotaNeed]:
    """`needs` (Cloud Run quota id -> GPUs and why) plus the vLLM service's, as QuotaNeeds."""
    if cfg.serving_enabled:
        service = CLOUD_RUN_GPU_QUOTA[(cfg.serving_gpu_type, cfg.gpu_zonal_redundancy)]
        instances = cfg.serving_max_instances + 1
        needs.setdefault(service, []).append(
            (
                instances,
                f"the vLLM service (servingGpuType={cfg.serving_gpu_type}, gpuZonalRedundancy="
                f"{str(cfg.gpu_zonal_redundancy).lower()}: servingMaxInstances={cfg.serving_max_instances} + 1 "
                "while a new revision starts)",
            )
        )
    return [
        QuotaNeed(
            GpuQuota(CLOUD_RUN_QUOTA_SERVICE, quota_id), sum(n for n, _ in parts), " + ".join(w for _, w in parts)
        )
        for quota_id, parts in needs.items()
    ]


class QuotaNotFound(Exception):
    """The Cloud Quotas API has no entry (or no row) for the quota the catalog names: nothing could be checked."""


def quota_limit(result: Any, quota: GpuQuota, region: str) -> int | None:
    """The limit in effect for `region` (and the quota's other dimensions); None when unlimited, 0 when no row
    of the quota applies there.

    Raises `QuotaNotFound` when the answer is the data source's empty not-found result (no `name`, no
    `dimensionsInfos`: data_source_google_cloud_quotas_quota_info.go reads through HandleNotFoundError, which
    clears the id and returns no error), and when the quota selects a row by a dimension besides `region`
    (`gpu_family`) and no row names our value: the default row would then be read for a family that may not
    exist (catalog ids marked UNCONFIRMED), and a check against it would mean nothing."""
    rows = list(result.dimensions_infos or [])
    if not result.name and not rows:
        raise QuotaNotFound(f"the Cloud Quotas API has no quota {quota.quota_id} for {quota.service}")
    for key, value in quota.dimensions:
        if not any(dict(info.dimensions or {}).get(key) == value for info in rows):
            raise QuotaNotFound(
                f"no row of quota {quota.quota_id} names {key}={value} (the catalog's value may not exist; the rows "
                f"name {sorted({dict(i.dimensions or {}).get(key, '(default)') for i in rows})})"
            )
    wanted = dict(quota.dimensions)
    if quota.regional:
        wanted["region"] = region
    best: tuple[int, int] | None = None
    for info in rows:
        dims = dict(info.dimensions or {})
        if any(wanted.get(key) != value for key, value in dims.items()):
            continue
        locations = list(info.applicable_locations or [])
        if quota.regional and locations and region not in locations and "global" not in locations:
            continue
        details = list(info.details or [])
        if not details or details[0].value in (None, ""):
            continue
        candidate = (len(dims), int(details[0].value))
        if best is None or candidate[0] > best[0]:
            best = candidate
    if best is None:
        return 0
    return None if best[1] < 0 else best[1]


def _list_quotas(cfg: StackConfig, need: QuotaNeed) -> str:
    return f"gcloud beta quotas info list --service={need.quota.service} --project={cfg.project} --filter='quotaId~GPU'"


def _quota_fix(cfg: StackConfig, need: QuotaNeed) -> str:
    flags = f"--dimensions={need.quota.dimension_flag(cfg.region)} " if need.quota.dimension_flag(cfg.region) else ""
    return (
        f"gcloud beta quotas preferences create --service={need.quota.service} --quota-id={need.quota.quota_id} "
        f"--preferred-value={need.needed} {flags}--project={cfg.project} --email=YOU@example.com, or "
        f"https://console.cloud.google.com/iam-admin/quotas?project={cfg.project}"
    )


def _quota_unreadable(cfg: StackConfig, need: QuotaNeed, error: Exception) -> str:
    text = str(error)
    where = f"GPU quota {need.quota.quota_id} ({need.quota.service}) in project {cfg.project}"
    # user ADC: Cloud Quotas bills the call to a quota project (docs/program.md#preflight-asks-the-cloud)
    if QUOTA_PROJECT_MISSING in text:
        fix = (
            f"the Cloud Quotas API needs a quota project with user credentials: export "
            f"{QUOTA_PROJECT_ENV}={cfg.project} (then run pulumi again in that shell)"
        )
    elif "SERVICE_DISABLED" in text or "has not been used" in text or "is disabled" in text:
        fix = f"enable the Cloud Quotas API: gcloud services enable {QUOTA_API} --project {cfg.project}"
    elif _is_not_found(error):
        fix = f"the quota id may not exist for this project; list the GPU quotas with `{_list_quotas(cfg, need)}`"
    else:
        fix = (
            f"the identity running pulumi needs {QUOTA_PERMISSION} on the project ({QUOTA_ROLE} has it): gcloud "
            f"projects add-iam-policy-binding {cfg.project} --role={QUOTA_ROLE} --member=user:YOU@example.com"
        )
    return f"preflight could not read {where}: {error}. Fix: {fix}; or report instead of stop: {WARN_FIX}"


def check_gpu_quota(cfg: StackConfig) -> list[str]:
    """The GPU quota of the stack's capacity type (GKE) or Cloud Run GPU setting covers what the run needs."""
    problems: list[str] = []
    for need in gpu_quota_needs(cfg):
        try:
            result = gcp.cloudquota.get_s_quota_info(
                parent=f"projects/{cfg.project}", service=need.quota.service, quota_id=need.quota.quota_id
            )
        except Exception as error:  # the SDK raises a plain Exception for any failed invoke; report it with the fix
            problems.append(_quota_unreadable(cfg, need, error))
            continue
        try:
            limit = quota_limit(result, need.quota, cfg.region)
        except QuotaNotFound as missing:
            problems.append(
                f"preflight could not check GPU quota {need.quota.quota_id} ({need.quota.service}) in project "
                f"{cfg.project}, which {need.because} needs {need.needed} of: {missing}. A service's quotas are "
                f"listed only once it is enabled: gcloud services enable {need.quota.service} --project "
                f"{cfg.project}. Then find the quota that holds these GPUs with `{_list_quotas(cfg, need)}`; or "
                f"report instead of stop: {WARN_FIX}"
            )
            continue
        if limit is not None and limit < need.needed:
            scope = f"region {cfg.region}" if need.quota.regional else "all regions"
            problems.append(
                f"GPU quota {need.quota.quota_id} ({need.quota.service}, {scope}) is {limit}, and {need.because} "
                f"needs {need.needed}. Request more: {_quota_fix(cfg, need)} (Google reviews the request and "
                f"answers by email, {QUOTA_APPROVAL}); or lower the settings that ask for GPUs, or choose another "
                "capacity"
            )
    return problems


def check_cost_ceiling(cfg: StackConfig) -> list[str]:
    """`maxRunCostUsd`: the most one training run can cost (`infra.cost`) stays within the stack's limit."""
    if cfg.max_run_cost_usd is None:
        return []
    limit = cfg.max_run_cost_usd
    ceiling = cost.run_ceiling(cfg)
    if ceiling.hourly is None:
        return [
            f"maxRunCostUsd={limit} cannot be checked: the price table (infra/pricing.py) has no figure for "
            f"gpuType={cfg.gpu_type} x gpusPerNode={cfg.gpus_per_node} in this workload. Fix: pulumi config set "
            "trainingHourPriceUsd PRICE (one node or instance per hour), or pulumi config rm maxRunCostUsd"
        ]
    if not ceiling.bounded:
        return [
            f"maxRunCostUsd={limit} cannot hold with rayCluster=standing: the standing cluster has no deadline and "
            f"bills {ceiling.per_hour_usd:,.2f} USD/h until it is switched off. Fix: pulumi config set rayCluster "
            "ephemeral, or pulumi config rm maxRunCostUsd"
        ]
    usd = ceiling.usd
    assert usd is not None
    if usd <= limit:
        return []
    moves = {
        Workload.GKE_JOB: f"trainingTimeoutMinutes, nodes, capacity (now {cfg.capacity})",
        Workload.GKE_RAY: f"trainingTimeoutMinutes, nodes, capacity (now {cfg.capacity}), trainingRetries",
        Workload.CLOUD_RUN: "trainingTimeoutMinutes, trainingRetries, gpuType",
    }[cfg.workload]
    return [
        f"runCostCeilingUsd={usd:,.2f} exceeds maxRunCostUsd={limit}: {ceiling.formula()}; "
        f"{ceiling.hourly.describe()}. Lower what moves it ({moves}), correct the price with "
        "trainingHourPriceUsd, or raise the limit: pulumi config set maxRunCostUsd "
        f"{int(usd) + 1}"
    ]


Check = Callable[[StackConfig], list[str]]
CLOUD_CHECKS: tuple[Check, ...] = (check_reservation, check_gpu_quota)


def check(cfg: StackConfig, checks: tuple[Check, ...] = CLOUD_CHECKS) -> None:
    """Run every preflight check; raise `PreflightError` listing every problem (nothing is declared yet).

    With `preflight: warn` the problems of `checks` are logged as warnings instead; with `off` they are not
    looked for. The cost ceiling applies in every mode."""
    problems: list[str] = []
    if cfg.preflight is not PreflightMode.OFF:
        found = [problem for run_check in checks for problem in run_check(cfg)]
        if cfg.preflight is PreflightMode.WARN:
            for problem in found:
                pulumi.log.warn(f"preflight (warn): {problem}")
        else:
            problems += found
    problems += check_cost_ceiling(cfg)
    if problems:
        lines = [f"stack {cfg.stack!r} cannot run in project {cfg.project} as configured (nothing was created):"]
        lines += [f"  - {problem}" for problem in problems]
        raise PreflightError("\n".join(lines))
