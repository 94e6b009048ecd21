"""What both GKE workloads call down into: the cluster and namespace, one run's values, its GPU pod.

Flow of a workload (`infra.gke_job`, `infra.ray_job`): `declare_gke_base` (cluster, namespace, what pods
wait for) → `gpu_run` (name, placement, labels; image and bucket as slots) → its own renderer, built on
`trainer_container` and `gpu_pod_template` → `fill_slots` → `GkeBase.outputs`. Nothing here calls back.
Decisions (why and sources: docs/gke.md#namespace-workload-identity-placement)
- One namespace per stack (default `gft-<stack>`), so its Workload Identity principal is the stack's own;
  pods act as the trainer's Google service account (bound on that account only, bucket access only).
- The HF token is the Kubernetes Secret `hf-secret`, read only through `secretKeyRef`.
- Capacity by nodeSelectors (accelerator, count, driver; reservation, spot or flex-start labels); no
  tolerations (Autopilot adds them). A multi-node run's GPU pods share a zone.
- The run's name comes from `infra.run_identity` (what the user asked for); image and bucket are slots.
- Pods: no capability, RuntimeDefault seccomp, no service-account token (nothing calls the API), ingress from
  the namespace only (`NAMESPACE_INGRESS_POLICY`); the namespace comes after the preview fence (`infra.admission`).
Not here: Kueue, the GCS FUSE CSI driver (the trainer writes gs:// URIs itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import pulumi
import pulumi_gcp as gcp
import pulumi_kubernetes as k8s

from infra.admission import PreviewFence, PreviewFenceArgs
from infra.config import Capacity, LoadedConfig, StackConfig
from infra.foundation import Identity, iam_propagation_wait
from infra.gke import AutopilotCluster, AutopilotClusterArgs
from infra.pricing import cost_labels, gke_node_hour
from infra.run_identity import RUNS_PREFIX

if TYPE_CHECKING:
    from infra.foundation import Foundation

TRAINER_KSA = "trainer"
HF_SECRET_NAME = "hf-secret"
HF_SECRET_KEY = "hf_api_token"
HF_TOKEN_ENV = "HF_TOKEN"

ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"
ACCELERATOR_COUNT_LABEL = "cloud.google.com/gke-accelerator-count"
DRIVER_LABEL = "cloud.google.com/gke-gpu-driver-version"
RESERVATION_NAME_LABEL = "cloud.google.com/reservation-name"
RESERVATION_AFFINITY_LABEL = "cloud.google.com/reservation-affinity"
RESERVATION_PROJECT_LABEL = "cloud.google.com/reservation-project"
SPOT_LABEL = "cloud.google.com/gke-spot"
FLEX_START_LABEL = "cloud.google.com/gke-flex-start"
GSA_ANNOTATION = "iam.gke.io/gcp-service-account"
# The RayJob / RayCluster: `pulumi up` does not wait for training; runs write under gs://BUCKET/runs/<run>.
SKIP_AWAIT = {"pulumi.com/skipAwait": "true"}
# The Job: `pulumi up` returns once it exists, through a `waitFor` condition met at creation, not `skipAwait`, which
# for a Job (and a Namespace) also skips the delete await (pulumi-kubernetes provider/pkg/metadata/overrides.go
# `allowsSkipAwaitWithDelete`): a replacement under the same name would create the new Job while the old one still
# terminates, and fail with "already exists".
CREATED_AWAIT = {"pulumi.com/waitFor": "jsonpath={.metadata.uid}"}
ADAPTER_SUBDIR = "adapter"
# A GPU pod's grace: the trainer saves the step it is on before SIGTERM's deadline (trainer/preemption.py).
TERMINATION_GRACE_S = 600
# pulumi-kubernetes waits 10 minutes for a delete unless told otherwise, and deletes in the foreground (provider/pkg/
# await/await.go `Deletion`): a Job, RayJob or Namespace is gone once its pods are, and a GPU pod may take its whole
# grace. Their delete timeouts leave the grace and a margin for the cascade (pods, then the owner; the RayCluster
# of a RayJob; the objects of a namespace).
DELETE_MARGIN_S = 300
DELETE_TIMEOUT_S = TERMINATION_GRACE_S + DELETE_MARGIN_S
DELETE_TIMEOUT = f"{DELETE_TIMEOUT_S // 60}m"
# The trainer image runs as uid 1000 (trainer/Dockerfile); Kubernetes checks it, nothing escalates, no capability
# is kept (the trainer binds no low port, changes no owner, opens no raw socket), and the syscall filter is the
# runtime's default (which Autopilot applies anyway: stated, so a scanner and a reader see it).
POD_SECURITY_CONTEXT: dict[str, Any] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
# No pod of ours calls the Kubernetes API (the trainer, Ray with in-tree autoscaling off), and Workload Identity does
# not need the token: the GKE metadata server maps a pod's address to its service account.
AUTOMOUNT_SERVICE_ACCOUNT_TOKEN = False
# Every pod of the namespace accepts connections only from pods of the same namespace: the Job's ranks, the Ray
# cluster's head, workers and KubeRay's submitter. Ray's job API (8265) and client (10001) are unauthenticated.
NAMESPACE_INGRESS_POLICY = "same-namespace-only"


@dataclass(frozen=True)
class PerGpuShare:
    """CPU, memory (GiB) and ephemeral storage (GiB) a pod asks for per GPU it holds."""

    cpu: int
    memory_gib: int
    ephemeral_gib: int


# The largest Autopilot pod on each GPU machine is UNCONFIRMED (GKE's autopilot-resource-requests table could not be read), so these stay well
# below the machines: 8 x B200 -> 96 vCPU / 1200Gi / 352Gi of an a4-highgpu-8g's 224 vCPU / 3,968 GB /
# 12,000 GiB local SSD (1200Gi memory and ~350Gi disk are what the seed tutorial ran with).
# Autopilot bills GPU pods per node, so asking for less than the node costs nothing extra.
GPU_SHARE: dict[str, PerGpuShare] = {
    "nvidia-b200": PerGpuShare(cpu=12, memory_gib=150, ephemeral_gib=44),
    "nvidia-h200-141gb": PerGpuShare(cpu=12, memory_gib=150, ephemeral_gib=44),
    "nvidia-h100-mega-80gb": PerGpuShare(cpu=11, memory_gib=100, ephemeral_gib=44),
    "nvidia-h100-80gb": PerGpuShare(cpu=11, memory_gib=100, ephemeral_gib=44),
    "nvidia-l4": PerGpuShare(cpu=8, memory_gib=32, ephemeral_gib=40),
    "nvidia-rtx-pro-6000": PerGpuShare(cpu=20, memory_gib=80, ephemeral_gib=100),
}


def gpu_pod_resources(cfg: StackConfig) -> dict[str, dict[str, str]]:
    """Requests = limits for a pod holding all `gpus_per_node` GPUs of one node (Autopilot sets requests to
    limits anyway; stating both keeps the intent visible)."""
    assert cfg.gpu_type and cfg.gpus_per_node, "config validation guarantees a GKE accelerator shape"
    share = GPU_SHARE[cfg.gpu_type]
    n = cfg.gpus_per_node
    amounts = {
        "cpu": str(share.cpu * n),
        "memory": f"{share.memory_gib * n}Gi",
        "ephemeral-storage": f"{share.ephemeral_gib * n}Gi",
        "nvidia.com/gpu": str(n),
    }
    return {"requests": dict(amounts), "limits": dict(amounts)}


def gpu_node_selector(cfg: StackConfig) -> dict[str, str]:
    """nodeSelector for a pod that takes a whole GPU node of `cfg.gpu_type` under the chosen capacity mode."""
    assert cfg.gpu_type and cfg.gpus_per_node, "config validation guarantees a GKE accelerator shape"
    selector = {
        ACCELERATOR_LABEL: cfg.gpu_type,
        ACCELERATOR_COUNT_LABEL: str(cfg.gpus_per_node),
        DRIVER_LABEL: "latest",
    }
    if cfg.capacity is Capacity.RESERVATION:
        assert cfg.reservation_name, "config validation guarantees reservationName with capacity=reservation"
        selector[RESERVATION_NAME_LABEL] = cfg.reservation_name
        selector[RESERVATION_AFFINITY_LABEL] = "specific"
        if cfg.reservation_project and cfg.reservation_project != cfg.project:
            selector[RESERVATION_PROJECT_LABEL] = cfg.reservation_project
    elif cfg.capacity is Capacity.SPOT:
        selector[SPOT_LABEL] = "true"
    elif cfg.capacity is Capacity.FLEX_START:
        selector[FLEX_START_LABEL] = "true"
    return selector


def hf_token_env(secret_name: str | None) -> list[dict[str, Any]]:
    """The HF_TOKEN env entry (a secretKeyRef, never a value), or nothing when the recipe needs no token."""
    if secret_name is None:
        return []
    return [{"name": HF_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": HF_SECRET_KEY}}}]


RUN_LABEL = "gemma-finetune/run"
# Carried only by the pods that hold GPUs; the zone affinity selects on it and on nothing else.
GPU_GROUP_LABEL = "gemma-finetune/gpu-group"
ZONE_TOPOLOGY = "topology.kubernetes.io/zone"


def gpu_pod_labels(run: str) -> dict[str, str]:
    """Labels of every GPU pod of a run: the run, and the GPU group the zone affinity selects."""
    return {RUN_LABEL: run, GPU_GROUP_LABEL: run}


def gpu_pods_same_zone(run: str) -> dict[str, Any]:
    """Keep the GPU pods of one multi-node run in one zone: NCCL across zones is slow and pays for egress.

    The selector matches GPU pods only (`GPU_GROUP_LABEL`), never the small CPU pods of the same run (the
    Ray head): the scheduler places a pod with a required pod affinity only in a zone that already runs a
    matching pod, unless no pod matches yet and the pod matches its own terms (kubernetes/kubernetes
    pkg/scheduler/framework/plugins/interpodaffinity/filtering.go, `satisfyPodAffinity`). Selecting the
    head would pin every GPU worker to whatever zone the head landed in first, and a zonal reservation in
    another zone would never be used. So the first GPU pod goes wherever its capacity is; the rest follow
    it. (For spot / flex-start / on-demand a later pod waits for capacity in that zone rather than
    spilling into another.)"""
    return {
        "podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {GPU_GROUP_LABEL: run}}, "topologyKey": ZONE_TOPOLOGY}
            ]
        }
    }


# Placeholders for values that are Outputs (the image digest, the bucket name): the renderers stay pure
# functions of plain strings, and `fill_slots` puts each Output back at the leaves that mention it, so a
# preview that cannot know the digest still sees every other field of the manifests. Shell-safe
# characters only, so `shlex.join` leaves them (and the bucket names that replace them) unquoted.
IMAGE_SLOT = "__gft_image__"
BUCKET_SLOT = "__gft_bucket__"


def fill_slots(value: Any, slots: Mapping[str, pulumi.Input[str]]) -> Any:
    """A copy of `value` in which every string that mentions a slot is an Output of that string with the
    slots' values in; every other leaf stays plain."""
    if isinstance(value, dict):
        return {key: fill_slots(item, slots) for key, item in value.items()}
    if isinstance(value, list):
        return [fill_slots(item, slots) for item in value]
    if not isinstance(value, str):
        return value
    used = [slot for slot in slots if slot in value]
    if not used:
        return value

    def fill(values: list[Any], text: str = value) -> str:
        for slot, filled in zip(used, values, strict=True):
            text = text.replace(slot, str(filled))
        return text

    return pulumi.Output.all(*[slots[slot] for slot in used]).apply(fill)


def finished_logs_command(cfg: StackConfig, job_name: str) -> str:
    """Where a finished run's logs are once its Job (a GKE Job, or a RayJob's submitter Job) is gone: Cloud
    Logging, by the pods' `job-name` label (GKE writes pod labels as `labels."k8s-pod/<key>"`)."""
    query = (
        f'resource.type="k8s_container" AND resource.labels.namespace_name="{cfg.namespace}" '
        f'AND labels."k8s-pod/job-name"="{job_name}"'
    )
    return f"gcloud logging read '{query}' --project {cfg.project} --order asc --format 'value(textPayload)'"


def workload_identity_member(project: str, namespace: str, ksa: str) -> str:
    return f"serviceAccount:{project}.svc.id.goog[{namespace}/{ksa}]"


def common_labels(cfg: StackConfig, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "gemma-finetune",
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "pulumi",
        "gemma-finetune/stack": cfg.stack,
    }


@dataclass
class TrainingNamespaceArgs:
    cfg: StackConfig
    """The validated stack configuration (namespace, project)."""
    provider: k8s.Provider
    """The cluster's Kubernetes provider (from `AutopilotCluster`)."""
    cluster: pulumi.Resource
    """The GKE cluster: the Workload Identity pool exists only once it does."""
    trainer_account: gcp.serviceaccount.Account
    """The trainer's Google service account (object access on the stack's bucket only)."""
    hf_token: pulumi.Output[str] | None
    """The Hugging Face token as a secret Output, or None when the recipe needs none."""
    fence: list[pulumi.Resource] = field(default_factory=list)
    """What the Namespace waits for: the preview fence (`infra.admission`), so nothing here exists unfenced."""


class TrainingNamespace(pulumi.ComponentResource):
    """Namespace, Workload Identity-bound Kubernetes service account and the HF token Secret."""

    namespace: str
    service_account_name: str
    hf_secret_name: str | None
    ready: list[pulumi.Resource]
    """Everything a training pod needs to exist first."""

    def __init__(self, name: str, args: TrainingNamespaceArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gemma-finetune:k8s:TrainingNamespace", name, None, opts)
        cfg = args.cfg
        k8s_opts = pulumi.ResourceOptions(parent=self, provider=args.provider)
        labels = common_labels(cfg, "training")
        self.namespace = cfg.namespace
        self.service_account_name = TRAINER_KSA

        namespace = k8s.core.v1.Namespace(
            f"{name}-ns",
            metadata=k8s.meta.v1.ObjectMetaArgs(name=cfg.namespace, labels=labels),
            # Deleting it deletes every pod in it: each may take its grace (DELETE_TIMEOUT).
            opts=pulumi.ResourceOptions.merge(
                k8s_opts,
                pulumi.ResourceOptions(
                    depends_on=list(args.fence), custom_timeouts=pulumi.CustomTimeouts(delete=DELETE_TIMEOUT)
                ),
            ),
        )
        in_namespace = pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=[namespace])
        ingress = k8s.networking.v1.NetworkPolicy(
            f"{name}-ingress",
            metadata=k8s.meta.v1.ObjectMetaArgs(name=NAMESPACE_INGRESS_POLICY, namespace=cfg.namespace, labels=labels),
            spec=cast(Any, namespace_ingress_spec()),  # a plain manifest dict, as the tests read it
            opts=in_namespace,
        )

        ksa = k8s.core.v1.ServiceAccount(
            f"{name}-ksa",
            metadata=k8s.meta.v1.ObjectMetaArgs(
                name=TRAINER_KSA,
                namespace=cfg.namespace,
                labels=labels,
                annotations={GSA_ANNOTATION: args.trainer_account.email},
            ),
            opts=in_namespace,
        )
        binding = gcp.serviceaccount.IAMMember(
            f"{name}-wi",
            service_account_id=args.trainer_account.name,
            role="roles/iam.workloadIdentityUser",
            member=workload_identity_member(cfg.project, cfg.namespace, TRAINER_KSA),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[args.cluster]),
        )
        # The pods act as the trainer account from their first second: wait for the binding to propagate.
        self.ready = [namespace, ingress, ksa, binding, iam_propagation_wait(f"{name}-wi", [binding], parent=self)]

        self.hf_secret_name = None
        if args.hf_token is not None:
            token: pulumi.Output[str] = pulumi.Output.secret(args.hf_token)
            secret = k8s.core.v1.Secret(
                f"{name}-hf",
                metadata=k8s.meta.v1.ObjectMetaArgs(name=HF_SECRET_NAME, namespace=cfg.namespace, labels=labels),
                type="Opaque",
                string_data={HF_SECRET_KEY: token},
                opts=in_namespace,
            )
            self.hf_secret_name = HF_SECRET_NAME
            self.ready.append(secret)

        self.register_outputs(
            {
                "namespace": self.namespace,
                "service_account": self.service_account_name,
                "hf_secret": self.hf_secret_name,
            }
        )


def namespace_ingress_spec() -> dict[str, Any]:
    """NetworkPolicy spec: every pod of the namespace admits connections from the namespace's pods only."""
    return {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": {}}]}]}


@dataclass(frozen=True)
class GpuRun:
    """One training run on whole GPU nodes, as plain values (the image and bucket as slots): what both
    workloads render their manifests from."""

    name: str
    namespace: str
    image: str
    recipe: str
    output_dir: str
    gpus_per_node: int
    nodes: int
    node_selector: dict[str, str]
    resources: dict[str, dict[str, str]]
    service_account: str
    hf_secret_name: str | None
    retries: int
    timeout_seconds: int
    overrides: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    cost_labels: dict[str, str] = field(default_factory=dict)
    """Price and limit labels, on the workload object's metadata only: a new price must not replace a run."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def gpu_run(cfg: StackConfig, namespace: TrainingNamespace, name: str) -> GpuRun:
    """This stack's run `name` (`infra.run_identity.resolve`), placed by `gpu_node_selector` and `gpu_pod_resources`,
    writing under gs://BUCKET/runs/<name>."""
    assert cfg.gpus_per_node is not None, "config validation guarantees gpusPerNode on GKE"
    return GpuRun(
        name=name,
        namespace=cfg.namespace,
        image=IMAGE_SLOT,
        recipe=cfg.recipe,
        output_dir=f"gs://{BUCKET_SLOT}/{RUNS_PREFIX}/{name}",
        gpus_per_node=cfg.gpus_per_node,
        nodes=cfg.nodes,
        node_selector=gpu_node_selector(cfg),
        resources=gpu_pod_resources(cfg),
        service_account=namespace.service_account_name,
        hf_secret_name=namespace.hf_secret_name,
        retries=cfg.training_retries,
        timeout_seconds=cfg.timeout_minutes * 60,
        overrides=tuple(cfg.recipe_overrides),
        labels={**common_labels(cfg, "training"), "gemma-finetune/recipe": cfg.recipe[:63]},
        cost_labels=cost_labels(cfg, gke_node_hour(cfg), kubernetes=True),
    )


def trainer_container(name: str, run: GpuRun, resources: dict[str, dict[str, str]]) -> dict[str, Any]:
    """A container of the trainer image: unbuffered logs, the HF token by reference, no escalation."""
    return {
        "name": name,
        "image": run.image,
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}, *hf_token_env(run.hf_secret_name)],
        "resources": resources,
        "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
    }


def gpu_pod_template(run: GpuRun, container: dict[str, Any], group: str) -> dict[str, Any]:
    """The template of a pod that takes one whole GPU node: labelled with the run and its GPU `group`,
    placed by the run's nodeSelector, and with nodes > 1 kept in the zone of the group's first pod."""
    spec: dict[str, Any] = {
        "serviceAccountName": run.service_account,
        "automountServiceAccountToken": AUTOMOUNT_SERVICE_ACCOUNT_TOKEN,
        "nodeSelector": dict(run.node_selector),
        "securityContext": dict(POD_SECURITY_CONTEXT),
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "containers": [container],
    }
    if run.nodes > 1:
        spec["affinity"] = gpu_pods_same_zone(group)
    return {"metadata": {"labels": {**run.labels, **gpu_pod_labels(group)}}, "spec": spec}


@dataclass
class GkeBase:
    """What both GKE workloads stand on: the Autopilot cluster, the training namespace, and what their
    pods wait for besides (the foundation's APIs and every grant to the trainer's and nodes' accounts)."""

    cluster: AutopilotCluster
    namespace: TrainingNamespace
    after: list[pulumi.Resource]
    fence: PreviewFence

    def outputs(self) -> dict[str, pulumi.Input[Any]]:
        return {
            "clusterName": self.cluster.name,
            "getCredentials": self.cluster.get_credentials,
            "namespace": self.namespace.namespace,
        }


def declare_gke_base(cfg: StackConfig, loaded: LoadedConfig, foundation: Foundation) -> GkeBase:
    """The cluster (after the foundation's APIs) and the namespace with identity and HF Secret."""
    base = f"gft-{cfg.stack}"
    assert foundation.node_account is not None, "the foundation creates a node account for GKE workloads"
    cluster = AutopilotCluster(
        base,
        AutopilotClusterArgs(
            cfg=cfg,
            depends_on=[*foundation.apis, *foundation.grants_to(Identity.NODES)],
            apis=list(foundation.apis),
            node_service_account=foundation.node_account.email,
        ),
    )
    fence = PreviewFence(base, PreviewFenceArgs(cfg=cfg, kubeconfig=cluster.kubeconfig, depends_on=[cluster.cluster]))
    namespace = TrainingNamespace(
        base,
        TrainingNamespaceArgs(
            cfg=cfg,
            provider=cluster.provider,
            cluster=cluster.cluster,
            trainer_account=foundation.trainer_account,
            hf_token=loaded.hf_token,
            fence=[fence.command],
        ),
    )
    after = [*foundation.apis, *foundation.grants_to(Identity.TRAINER), *foundation.grants_to(Identity.NODES)]
    return GkeBase(cluster=cluster, namespace=namespace, after=after, fence=fence)
