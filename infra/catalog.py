"""What Google Cloud offers, as the stack configuration checks it.

Facts come from shared/CLOUD-FACTS.md (GKE Autopilot GPU table, Cloud Run GPU pages);
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
    """A GPU that Cloud Run attaches (one per instance), with the minimum CPU and memory it needs."""

    value: str
    min_cpu: int
    min_memory_gib: int
    regions: tuple[str, ...]


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
        CloudRunGpu(
            "nvidia-l4",
            4,
            16,
            ("us-central1", "us-east4", "europe-west1", "europe-west4", "asia-southeast1", "asia-south1"),
        ),
        CloudRunGpu("nvidia-rtx-pro-6000", 20, 80, ("us-central1", "europe-west4", "asia-southeast1", "asia-south2")),
    )
}

# Quota each Cloud Run GPU setting draws on (run.googleapis.com); see README "Cloud Run GPU quota".
CLOUD_RUN_GPU_QUOTA = {
    ("nvidia-l4", False): "NvidiaL4GpuAllocNoZonalRedundancyPerProjectRegion",
    ("nvidia-l4", True): "NvidiaL4GpuAllocPerProjectRegion",
    ("nvidia-rtx-pro-6000", False): "NvidiaRtxPro6000GpuAllocNoZonalRedundancyPerProjectRegion",
    ("nvidia-rtx-pro-6000", True): "NvidiaRtxPro6000GpuAllocPerProjectRegion",
}

# Roles that grant far more than any workload here needs; never bound by this program.
BASIC_ROLES = frozenset({"roles/owner", "roles/editor", "roles/viewer"})
PUBLIC_MEMBERS = frozenset({"allUsers", "allAuthenticatedUsers"})
