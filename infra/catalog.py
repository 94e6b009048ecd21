"""What Google Cloud offers, as the stack configuration checks it.

Facts come from Google's docs (GKE "Deploy GPU workloads in Autopilot", how-to/autopilot-gpus; the Cloud Run GPU pages, run/docs/configuring/services/gpu and jobs/gpu);
each entry names the machine family so an error can tell the user what they asked for.
The tables are data, not behaviour: adding a GPU is adding a row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GkeAccelerator:
    """A GPU that GKE Autopilot schedules, with the GPU counts one node can have."""

    value: str
    counts: tuple[int, ...]
    machine: str
    note: str = ""

    def machine_type(self, gpus_per_node: int) -> str:
        """The Compute Engine machine type of a node with that many of these GPUs (an fnmatch pattern where
        several fit, e.g. `g2-standard-*`)."""
        return self.machine.format(n=gpus_per_node)


@dataclass(frozen=True)
class CloudRunGpu:
    """A GPU that Cloud Run attaches (one per instance), with the minimum CPU and memory it needs and the driver its
    instances run (the CUDA version that driver supports; the GPU's compute capability as 89 for sm_89)."""

    value: str
    min_cpu: int
    min_memory_gib: int
    regions: tuple[str, ...]
    driver: str
    driver_cuda: tuple[int, int]
    compute_capability: int


GKE_ACCELERATORS: dict[str, GkeAccelerator] = {
    a.value: a
    for a in (
        GkeAccelerator("nvidia-b200", (8,), "a4-highgpu-8g", "GKE >= 1.32.2-gke.1422000"),
        GkeAccelerator("nvidia-h200-141gb", (8,), "a3-ultragpu-8g", "GKE >= 1.31.4-gke.1183000"),
        GkeAccelerator("nvidia-h100-mega-80gb", (8,), "a3-megagpu-8g"),
        GkeAccelerator("nvidia-h100-80gb", (1, 2, 4, 8), "a3-highgpu-{n}g"),
        GkeAccelerator("nvidia-l4", (1, 2, 4, 8), "g2-standard-*"),
        GkeAccelerator("nvidia-rtx-pro-6000", (1, 2, 4, 8), "g4-standard-*", "GKE >= 1.34.1-gke.1829001"),
    )
}

CLOUD_RUN_GPUS: dict[str, CloudRunGpu] = {
    g.value: g
    for g in (
        # The driver of each: "L4 GPU with the current NVIDIA driver version: 535.216.03 (12.2)", "NVIDIA RTX PRO 6000
        # Blackwell GPU with the current NVIDIA driver version: 580.x.x (13.0)" (Cloud Run GPU pages for services and
        # worker pools, 2026).
        CloudRunGpu(
            "nvidia-l4",
            4,
            16,
            ("us-central1", "us-east4", "europe-west1", "europe-west4", "asia-southeast1", "asia-south1"),
            "535.216.03",
            (12, 2),
            89,
        ),
        CloudRunGpu(
            "nvidia-rtx-pro-6000",
            20,
            80,
            ("us-central1", "europe-west4", "asia-southeast1", "asia-south2"),
            "580.x",
            (13, 0),
            120,
        ),
    )
}

# The memory model's name of each training GPU (trainer/memory_plan.py GPUS: its memory), for the fit check of
# infra/config.py: both H100 machine shapes carry the 80 GB part.
TRAINING_GPU: dict[str, str] = {
    "nvidia-b200": "b200",
    "nvidia-h200-141gb": "h200",
    "nvidia-h100-mega-80gb": "h100",
    "nvidia-h100-80gb": "h100",
    "nvidia-l4": "l4",
    "nvidia-rtx-pro-6000": "rtx-pro-6000",
}

# Quota each Cloud Run GPU setting draws on (run.googleapis.com; the `region` dimension); see docs/cloud-path.md
# "Cloud Run GPU quota". Sources: Cloud Run docs "GPU zonal redundancy for services"
# (cloud.google.com/run/docs/configuring/services/gpu-zonal-redundancy: one quota with zonal redundancy, one
# without, requested separately); the ids as Cloud Run's own errors and public code quote them ("You do not have
# quota for using GPUs without zonal redundancy. Quota ID NvidiaL4GpuAllocNoZonalRedundancyPerProjectRegion"; a
# QUOTA_ID_MAP with NvidiaRtxPro6000GpuAlloc[NoZonalRedundancy]PerProjectRegion). UNCONFIRMED: that code reads
# the RTX PRO 6000 values as milli-GPUs; were that so, the check here would pass a quota it should stop on,
# never stop a run that fits.
CLOUD_RUN_QUOTA_SERVICE = "run.googleapis.com"
CLOUD_RUN_GPU_QUOTA = {
    ("nvidia-l4", False): "NvidiaL4GpuAllocNoZonalRedundancyPerProjectRegion",
    ("nvidia-l4", True): "NvidiaL4GpuAllocPerProjectRegion",
    ("nvidia-rtx-pro-6000", False): "NvidiaRtxPro6000GpuAllocNoZonalRedundancyPerProjectRegion",
    ("nvidia-rtx-pro-6000", True): "NvidiaRtxPro6000GpuAllocPerProjectRegion",
}


@dataclass(frozen=True)
class GpuQuota:
    """One Cloud Quotas entry (`gcp.cloudquota.get_s_quota_info`): the service, the quota id and the dimensions
    besides `region` that select the row (e.g. the GPU family of the unified per-family quota)."""

    service: str
    quota_id: str
    dimensions: tuple[tuple[str, str], ...] = ()
    regional: bool = True

    def dimension_flag(self, region: str) -> str:
        """`--dimensions=` of `gcloud beta quotas preferences create` for this row."""
        dims = ([("region", region)] if self.regional else []) + list(self.dimensions)
        return ",".join(f"{key}={value}" for key, value in dims)


_COMPUTE = "compute.googleapis.com"
_FAMILY_QUOTA = "GPUS-PER-GPU-FAMILY-per-project-region"


def _family(family: str) -> GpuQuota:
    return GpuQuota(_COMPUTE, _FAMILY_QUOTA, (("gpu_family", family),))


def _preemptible(model: str) -> GpuQuota:
    return GpuQuota(_COMPUTE, f"PREEMPTIBLE-NVIDIA-{model}-GPUS-per-project-region")


# GPU quota a GKE node draws on, by accelerator and capacity (Compute Engine quotas: Autopilot nodes are
# Compute Engine VMs). On-demand: the newest families (B200, H100, H200, RTX PRO 6000) have no per-model
# quota id, only the unified `GPUS-PER-GPU-FAMILY-per-project-region` with a `gpu_family` dimension; L4 keeps
# its per-model id. Spot and flex-start (which draws on preemptible quota, GKE docs "Run a small batch
# workload with GPUs and Flex-start VMs") use `PREEMPTIBLE-NVIDIA-<MODEL>-GPUS-per-project-region`.
# Sources (Google publishes no list of quota ids; these are Cloud Quotas listings quoted in public code, found
# with the code search of this project, 2026-11-30):
# - `GPUS-PER-GPU-FAMILY-per-project-region` + `gpu_family` NVIDIA_B200 / NVIDIA_H100 / NVIDIA_RTX_PRO_6000, and
#   `NVIDIA-L4-GPUS-per-project-region`: a Terraform `google_cloud_quotas_quota_preference` module ("Quota IDs
#   verified against the Cloud Quotas API on a test GCP project (2026-06-29) ... RTX PRO 6000 has NO dedicated
#   per-SKU quota ... governed by the unified GPUS-PER-GPU-FAMILY-per-project-region quota, scoped by a
#   gpu_family dimension"), and quota-tool fixtures ("There is no `NVIDIA-H100-GPUS-...` row on a real project").
# - `PREEMPTIBLE-NVIDIA-{B200,H200,H100,H100-MEGA,L4}-GPUS-per-project-region`: a table of Cloud Quotas defaults
#   ("PREEMPTIBLE-NVIDIA-B200-GPUS-per-project-region | 64 | Spot B200 quota") and scripts mapping a4-* machines
#   to it.
# - `GPUS-ALL-REGIONS-per-project`: Compute Engine's own error text ("Quota 'GPUS_ALL_REGIONS' exceeded ...
#   limit name = GPUS-ALL-REGIONS-per-project").
# UNCONFIRMED: the family tokens NVIDIA_H200 and NVIDIA_H100_MEGA (named by analogy with NVIDIA_B200 /
# NVIDIA_H100), and PREEMPTIBLE-NVIDIA-RTX-PRO-6000 (by analogy); also that a real project's family quota names
# every family in a row of its own (preflight relies on it). A wrong id comes back from the data source as an
# EMPTY result, not a 404 error (the provider's HandleNotFoundError clears the id and returns no error), and a
# wrong family token matches no row: preflight reports both as "could not check" with the listing command
# (`gcloud beta quotas info list`), never as a quota of 0 (`infra.preflight.quota_limit`).
GKE_GPU_QUOTAS: dict[tuple[str, bool], GpuQuota] = {
    ("nvidia-b200", False): _family("NVIDIA_B200"),
    ("nvidia-b200", True): _preemptible("B200"),
    ("nvidia-h200-141gb", False): _family("NVIDIA_H200"),
    ("nvidia-h200-141gb", True): _preemptible("H200"),
    ("nvidia-h100-mega-80gb", False): _family("NVIDIA_H100_MEGA"),
    ("nvidia-h100-mega-80gb", True): _preemptible("H100-MEGA"),
    ("nvidia-h100-80gb", False): _family("NVIDIA_H100"),
    ("nvidia-h100-80gb", True): _preemptible("H100"),
    ("nvidia-l4", False): GpuQuota(_COMPUTE, "NVIDIA-L4-GPUS-per-project-region"),
    ("nvidia-l4", True): _preemptible("L4"),
    ("nvidia-rtx-pro-6000", False): _family("NVIDIA_RTX_PRO_6000"),
    ("nvidia-rtx-pro-6000", True): _preemptible("RTX-PRO-6000"),
}
# The project-wide cap on on-demand GPUs in every region together (preemptible GPUs are not counted in it).
GPUS_ALL_REGIONS = GpuQuota(_COMPUTE, "GPUS-ALL-REGIONS-per-project", regional=False)

# Roles that grant far more than any workload here needs; never bound by this program.
BASIC_ROLES = frozenset({"roles/owner", "roles/editor", "roles/viewer"})
PUBLIC_MEMBERS = frozenset({"allUsers", "allAuthenticatedUsers"})
