"""Checks against the live project that run before any resource is declared, so `pulumi preview` fails too.

    pulumi preview --stack a4-gemma4     # stops here, naming the key, when the capacity cannot exist

Decisions
- `infra.config` judges values on their own; preflight asks the cloud whether they can work, through the
  provider's invokes, so the same code runs in `pulumi preview`, in PR previews and under mocks in tests.
- One entry point, `check(cfg)`: every check in `CHECKS` runs and every problem is reported at once, each
  with the key, what was found, what is needed and the command that shows or fixes it. A check is a
  function `StackConfig -> list[str]`; quota and cost checks belong beside the reservation check, in
  `CHECKS`, not in a second mechanism.
- `capacity: reservation`: GKE Autopilot consumes SPECIFIC reservations only (CLOUD-FACTS §1), in the
  cluster's region, of the machine type that carries the stack's GPU (`infra.catalog`), with at least
  `nodes` machines. A placeholder or a typo would otherwise leave the GPU pods Pending until the
  training deadline, once per retry. Reservations are zonal and the data source needs the zone, so the
  check lists the region's zones (`gcp.compute.get_zones`) and looks in each
  (`gcp.compute.get_reservation`, pulumi-gcp 10.2: `specificReservationRequired`,
  `specificReservations[].count` / `inUseCount` / `instanceProperties[].machineType`, `shareSettings`).
  A reservation that is not found comes back either as an invoke error (404) or as an empty result
  (the Terraform data source reads through the resource's Read, which clears the id on 404 without an
  error: terraform-provider-google data_source_google_compute_reservation.go); both mean "not here".
- A reservation with fewer than `nodes` machines can never hold the run: that stops. One that is big
  enough but busy now (`count - inUseCount < nodes`) only warns: the machines in use may be this stack's
  own running training, which a second `pulumi up` leaves alone and a new run replaces first (the Job /
  RayJob is deleted before its successor), and every PR preview runs this check too. Stopping there
  would make `pulumi up` fail for as long as the stack trains. Machines held by other VMs leave the pods
  Pending until they are freed or the deadline ends the run; the warning says how to see who holds them.

Not here: GPU quota, prices and budgets (to be added to `CHECKS`), and credentials: the identity that runs
`pulumi preview` / `up` needs `compute.zones.list` and `compute.reservations.get` on the reservation's
project (both in roles/compute.viewer); any other invoke error stops with that hint.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_gcp as gcp

from infra.catalog import GKE_ACCELERATORS
from infra.config import Capacity, StackConfig, Workload

READ_ROLE = "roles/compute.viewer"


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
        f"gcloud projects add-iam-policy-binding {project} --role={READ_ROLE} --member=user:YOU@example.com"
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


Check = Callable[[StackConfig], list[str]]
CHECKS: tuple[Check, ...] = (check_reservation,)


def check(cfg: StackConfig, checks: tuple[Check, ...] = CHECKS) -> None:
    """Run every preflight check; raise `PreflightError` listing every problem (nothing is declared yet)."""
    problems = [problem for run_check in checks for problem in run_check(cfg)]
    if problems:
        lines = [f"stack {cfg.stack!r} cannot run in project {cfg.project} as configured (nothing was created):"]
        lines += [f"  - {problem}" for problem in problems]
        raise PreflightError("\n".join(lines))
