"""The ray-gemma3-vision workload: a KubeRay RayJob on GKE Autopilot with the Ray operator add-on.

    pulumi up --stack ray-gemma3-vision   # cluster (+ Ray add-on), identity, secret, RayJob; outputs: kubectl commands

Decisions (why and sources: docs/gke.md#the-rayjob, docs/distributed.md#ray-workers-save-on-a-prestop-hook)
- Top to bottom: `declare` → `RayTraining` → pure renderers of a `RayRunSpec` (a `gke_workload.GpuRun`
  plus Ray's fields) to manifests, validated offline against KubeRay's schema and rules.
- `rayCluster: ephemeral` (default): the RayJob brings its cluster, deleted 60 s after the job ends;
  `standing`: a RayCluster `gemma-tuning` stays up (and bills) and the RayJob targets it.
- One GPU worker per node, in one zone, saving on preemption (preStop, trainer/preemption.py); a small head.
- Named by the run's key (infra/run_identity.py); what the run runs (entrypoint, cluster spec) replaces it,
  its limits (deadline, retries, TTL) change in place (`RESTARTING_FIELDS`, infra/offline/kuberay_crds.py).
- Waits for the KubeRay CRDs (`infra.crd_wait.CrdWait`) and every IAM grant; never for the training. Ingress
  beyond the namespace's pods: the job API from KubeRay (via konnectivity), metrics (`ray_network_policy`).
Not here: Ray autoscaling, RayService / serving, Kueue.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import pulumi
import pulumi_kubernetes as k8s

from infra.config import RayClusterMode, StackConfig
from infra.crd_wait import KUBERAY_CRDS, CrdWait, CrdWaitArgs
from infra.foundation import FINISHED_OUTPUT
from infra.gke import POD_RANGE
from infra.gke_workload import (
    ADAPTER_SUBDIR,
    AUTOMOUNT_SERVICE_ACCOUNT_TOKEN,
    BUCKET_SLOT,
    DELETE_TIMEOUT,
    IMAGE_SLOT,
    POD_SECURITY_CONTEXT,
    RUN_LABEL,
    SKIP_AWAIT,
    TERMINATION_GRACE_S,
    GkeBase,
    GpuRun,
    declare_gke_base,
    fill_slots,
    finished_logs_command,
    gpu_pod_template,
    gpu_run,
    trainer_container,
)
from trainer.preemption import prestop_command

if TYPE_CHECKING:
    from infra.config import LoadedConfig
    from infra.foundation import Foundation
    from infra.images import Images
    from infra.run_identity import RunState

RAY_API_VERSION = "ray.io/v1"
STANDING_CLUSTER_NAME = "gemma-tuning"
WORKER_GROUP = "gpu-group"
RAY_STORAGE_PREFIX = "ray"
CLUSTER_TTL_AFTER_FINISHED_S = 60
HEAD_RESOURCES = {"cpu": "8", "memory": "32Gi", "ephemeral-storage": "9Gi"}
HEAD_PORTS = [
    {"name": "gcs-server", "containerPort": 6379},
    {"name": "dashboard", "containerPort": 8265},
    {"name": "client", "containerPort": 10001},
]
# The spec fields whose change must restart the run (a replacement). KubeRay's RayJob controller reads the rest on
# every reconcile (ray-project/kuberay v1.5.2 ray-operator/controllers/ray/rayjob_controller.go: activeDeadlineSeconds,
# backoffLimit, shutdownAfterJobFinishes, ttlSecondsAfterFinished), so they change in place. Every field the
# renderers set is in one list or the other (tests/infra/test_kuberay_defaults.py).
RESTARTING_FIELDS = {
    "RayJob": ("entrypoint", "submissionMode", "rayClusterSpec", "clusterSelector"),
    "RayCluster": ("rayVersion", "enableInTreeAutoscaling", "headGroupSpec", "workerGroupSpecs"),
}
IN_PLACE_FIELDS = {
    "RayJob": ("activeDeadlineSeconds", "backoffLimit", "shutdownAfterJobFinishes", "ttlSecondsAfterFinished"),
    "RayCluster": (),
}
# A standing cluster holds its GPUs until deleted, by the user's choice (rayCluster: standing): the policy pack's
# deadline rule passes such a workload only with this label (infra/policy/policies.py LONG_RUNNING_LABEL).
LONG_RUNNING_LABEL = "gemma-finetune/gpu-long-running"
DASHBOARD_PORT = 8265
# GKE's control plane (and the KubeRay operator GKE runs there) reaches a pod through the konnectivity agents, pods in
# kube-system: that traffic has a Pod address (tigera/operator PR #5212: "On AKS and GKE the apiserver proxies
# admission calls through those pods"), so an ipBlock outside the Pod range alone never admits it.
CONTROL_PLANE_TUNNEL = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
    "podSelector": {"matchLabels": {"k8s-app": "konnectivity-agent"}},
}
# Ray's metrics export port, which KubeRay names `metrics` on every Ray pod; GKE's Ray monitoring scrapes it with
# Google Cloud Managed Service for Prometheus, whose collectors run in gke-gmp-system when GKE manages them (Autopilot)
# and in gmp-system when installed by hand.
METRICS_PORT = 8080
METRICS_NAMESPACES = ("gke-gmp-system", "gmp-system")


def declare(
    cfg: StackConfig, loaded: LoadedConfig, foundation: Foundation, images: Images, run: RunState
) -> dict[str, pulumi.Input[Any]]:
    """The ray-gemma3-vision workload: cluster with the Ray add-on, namespace pieces, RayJob; returns outputs."""
    base = f"gft-{cfg.stack}"
    gke = declare_gke_base(cfg, loaded, foundation)
    cluster = gke.cluster
    crds = CrdWait(base, CrdWaitArgs(kubeconfig=cluster.kubeconfig, crds=KUBERAY_CRDS, depends_on=[cluster.cluster]))
    training = RayTraining(
        base,
        RayTrainingArgs(
            cfg=cfg,
            gke=gke,
            image=images.trainer_image,
            run=run,
            bucket_name=foundation.bucket_name,
            crds=crds.command,
        ),
    )
    ns, job_name = cfg.namespace, training.job_name
    standing = STANDING_CLUSTER_NAME if cfg.ray_cluster is RayClusterMode.STANDING else None
    outputs: dict[str, pulumi.Input[Any]] = {
        **gke.outputs(),
        "rayJobName": job_name,
        "rayWorkers": cfg.total_gpus,
        "rayJobStatus": f"finished ({training.finished})"
        if training.finished
        else f"kubectl get rayjob {job_name} -n {ns}",
        # the submitter Job carries the RayJob's name and prints the driver's output
        "logs": finished_logs_command(cfg, job_name)
        if training.finished
        else f"kubectl logs -f job/{job_name} -n {ns}",
        "dashboard": dashboard_command(ns, job_name, standing),
        "checkpoints": training.checkpoints,
        "runDir": training.run_dir,
        "adapter": training.run_dir.apply(lambda d: f"{d}/{ADAPTER_SUBDIR}"),
    }
    if standing is not None:
        outputs["rayCluster"] = standing
    if training.finished is not None:
        outputs[FINISHED_OUTPUT] = f"finished ({training.finished}): no RayJob started"
    return outputs


@dataclass
class RayTrainingArgs:
    cfg: StackConfig
    """The validated stack configuration."""
    gke: GkeBase
    """The cluster (its provider; its Ray add-on installs the KubeRay CRDs), the namespace pieces the Ray
    pods use, and what they wait for besides: the APIs and every IAM grant to the trainer's and nodes' accounts."""
    image: pulumi.Input[str]
    """The trainer image (with Ray inside), pinned by digest."""
    run: RunState
    """This stack's run (`infra.run_identity.resolve`): its name, and whether it has finished (then no RayJob)."""
    bucket_name: pulumi.Input[str]
    """The stack's bucket: Ray checkpoints under gs://BUCKET/ray, the adapter under gs://BUCKET/runs."""
    crds: pulumi.Resource
    """The step that waits until the KubeRay CRDs are Established (`infra.crd_wait`)."""


class RayTraining(pulumi.ComponentResource):
    """The RayJob (+ a standing RayCluster when rayCluster=standing)."""

    job_name: str
    checkpoints: pulumi.Output[str]
    run_dir: pulumi.Output[str]
    ray_job: k8s.apiextensions.CustomResource | None
    """None when the run has finished already (`finished`): KubeRay starts no cluster for it."""
    ray_cluster: k8s.apiextensions.CustomResource | None
    network_policy: k8s.networking.v1.NetworkPolicy
    """What reaches the Ray pods beyond the namespace's own pods (`ray_network_policy`)."""
    finished: str | None
    """The run's `_RUN_COMPLETE.json` when the kept bucket holds it (`RunState.finished`), else None."""

    def __init__(self, name: str, args: RayTrainingArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gemma-finetune:k8s:RayTraining", name, None, opts)
        cfg, gke = args.cfg, args.gke
        spec = RayRunSpec(
            run=gpu_run(cfg, gke.namespace, args.run.name),
            ray_version=cfg.ray_version,
            storage_path=f"gs://{BUCKET_SLOT}/{RAY_STORAGE_PREFIX}",
            standing_cluster=STANDING_CLUSTER_NAME if cfg.ray_cluster is RayClusterMode.STANDING else None,
        )
        slots = {IMAGE_SLOT: args.image, BUCKET_SLOT: args.bucket_name}
        self.job_name = spec.run.name
        self.checkpoints = pulumi.Output.from_input(fill_slots(f"{spec.storage_path}/{spec.run.name}", slots))
        self.run_dir = pulumi.Output.from_input(fill_slots(spec.run.output_dir, slots))

        depends: list[pulumi.Resource] = [gke.cluster.cluster, *gke.namespace.ready, args.crds, *gke.after]
        group = spec.standing_cluster or spec.run.name
        self.network_policy = k8s.networking.v1.NetworkPolicy(
            f"{name}-ray-ingress",
            metadata=k8s.meta.v1.ObjectMetaArgs(
                name=f"{group}-ray", namespace=spec.run.namespace, labels=spec.run.labels
            ),
            spec=cast(Any, ray_network_policy(group)),  # a plain manifest dict, as the tests read it
            opts=pulumi.ResourceOptions(parent=self, provider=gke.cluster.provider, depends_on=gke.namespace.ready),
        )
        depends = [*depends, self.network_policy]
        self.ray_cluster = None
        if spec.standing_cluster is not None:
            self.ray_cluster = self._custom_resource(
                f"{name}-raycluster", fill_slots(render_ray_cluster(spec), slots), gke.cluster.provider, depends
            )
            depends = [*depends, self.ray_cluster]
        # A finished run (an `up` after `destroy` with the bucket kept) gets no RayJob: its ephemeral cluster would
        # take the GPU nodes only for the entry point to find the marker and exit.
        self.finished = args.run.finished
        self.ray_job = None
        if self.finished is None:
            self.ray_job = self._custom_resource(
                f"{name}-rayjob", fill_slots(render_ray_job(spec), slots), gke.cluster.provider, depends
            )
        self.register_outputs({"job_name": self.job_name, "checkpoints": self.checkpoints, "run_dir": self.run_dir})

    def _custom_resource(
        self, name: str, manifest: dict[str, Any], provider: k8s.Provider, depends: list[pulumi.Resource]
    ) -> k8s.apiextensions.CustomResource:
        """A KubeRay object. KubeRay ignores edits to a started job and does not roll a cluster's pods on
        template edits, so a change of what the run runs replaces the object (deleted first: it keeps its name);
        the limits KubeRay reads on every reconcile change in place (`RESTARTING_FIELDS`)."""
        return k8s.apiextensions.CustomResource(
            name,
            api_version=RAY_API_VERSION,
            kind=manifest["kind"],
            metadata=manifest["metadata"],
            spec=manifest["spec"],
            opts=pulumi.ResourceOptions(
                parent=self,
                provider=provider,
                depends_on=depends,
                replace_on_changes=[f"spec.{field}" for field in RESTARTING_FIELDS[manifest["kind"]]],
                delete_before_replace=True,
                # Past pulumi-kubernetes' 10-minute delete await: the GPU pods' grace, then the cascade
                # (infra/gke_workload.py DELETE_TIMEOUT).
                custom_timeouts=pulumi.CustomTimeouts(delete=DELETE_TIMEOUT),
            ),
        )


@dataclass(frozen=True)
class RayRunSpec:
    """Everything the Ray manifests depend on, as plain values: the GPU run and what Ray adds to it."""

    run: GpuRun
    ray_version: str
    storage_path: str
    standing_cluster: str | None = None


def ray_network_policy(group: str) -> dict[str, Any]:
    """NetworkPolicy spec added to the namespace's own-pods-only rule for one Ray cluster's pods: the head's job
    API from GKE's KubeRay operator (through the konnectivity agents, or directly from outside the Pod range; no
    other pod), and the metrics port from Managed Prometheus's collectors."""
    outside_pods = {"ipBlock": {"cidr": "0.0.0.0/0", "except": [POD_RANGE]}}
    collectors = {
        "namespaceSelector": {
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": list(METRICS_NAMESPACES)}
            ]
        }
    }
    return {
        "podSelector": {"matchLabels": {RUN_LABEL: group}},
        "policyTypes": ["Ingress"],
        "ingress": [
            {
                "from": [outside_pods, dict(CONTROL_PLANE_TUNNEL)],
                "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}],
            },
            {"from": [collectors], "ports": [{"protocol": "TCP", "port": METRICS_PORT}]},
        ],
    }


def render_ray_job(spec: RayRunSpec) -> dict[str, Any]:
    """The RayJob: with its own cluster (ephemeral) or on the standing one (clusterSelector)."""
    run = spec.run
    job_spec: dict[str, Any] = {
        "entrypoint": entrypoint(spec),
        "submissionMode": "K8sJobMode",
        "activeDeadlineSeconds": run.timeout_seconds,
    }
    if spec.standing_cluster is None:
        job_spec["backoffLimit"] = run.retries
        job_spec["rayClusterSpec"] = render_ray_cluster_spec(spec)
        job_spec["shutdownAfterJobFinishes"] = True
        job_spec["ttlSecondsAfterFinished"] = CLUSTER_TTL_AFTER_FINISHED_S
    else:
        # KubeRay rejects a TTL without shutdownAfterJobFinishes (a standing cluster is never shut down by a job),
        # and from v1.6 any backoffLimit > 0 with clusterSelector (validation.go ValidateRayJobSpec, PR #4527).
        job_spec["clusterSelector"] = {"ray.io/cluster": spec.standing_cluster}
        job_spec["shutdownAfterJobFinishes"] = False
    return {
        "apiVersion": RAY_API_VERSION,
        "kind": "RayJob",
        "metadata": {
            "name": run.name,
            "namespace": run.namespace,
            "labels": {**run.labels, **run.cost_labels},
            "annotations": dict(SKIP_AWAIT),
        },
        "spec": job_spec,
    }


def render_ray_cluster(spec: RayRunSpec) -> dict[str, Any]:
    """The standing RayCluster (rayCluster: standing): long-running by choice, and labelled so."""
    assert spec.standing_cluster is not None
    run = spec.run
    return {
        "apiVersion": RAY_API_VERSION,
        "kind": "RayCluster",
        "metadata": {
            "name": spec.standing_cluster,
            "namespace": run.namespace,
            "labels": {**run.labels, **run.cost_labels, LONG_RUNNING_LABEL: "true"},
            "annotations": dict(SKIP_AWAIT),
        },
        "spec": render_ray_cluster_spec(spec),
    }


def entrypoint(spec: RayRunSpec) -> str:
    """The command KubeRay submits: the trainer's Ray adapter with one Ray Train worker per GPU."""
    run = spec.run
    args = ["python", "-m", "trainer.ray_entry", "--recipe", run.recipe, "--num-workers", str(run.world_size)]
    args += ["--use-gpu", "--storage-path", spec.storage_path, "--name", run.name]
    for override in run.overrides:
        args += ["--set", override]
    args += ["--set", f"output.dir={run.output_dir}"]
    return shlex.join(args)


def render_ray_cluster_spec(spec: RayRunSpec) -> dict[str, Any]:
    """A fixed-size Ray cluster: a small CPU head and one whole-node GPU worker per node."""
    run = spec.run
    group = spec.standing_cluster or run.name
    # No command: KubeRay writes `ray start …` from rayStartParams. It also mounts /dev/shm itself.
    head = trainer_container("ray-head", run, {"requests": dict(HEAD_RESOURCES), "limits": dict(HEAD_RESOURCES)})
    head["ports"] = [dict(p) for p in HEAD_PORTS]
    worker = trainer_container("ray-worker", run, run.resources)
    # Preemption: the hook holds SIGTERM back until the trainer saved the step (trainer/preemption.py).
    worker["lifecycle"] = {"preStop": {"exec": {"command": prestop_command(wait_s=TERMINATION_GRACE_S - 30)}}}
    return {
        "rayVersion": spec.ray_version,
        "enableInTreeAutoscaling": False,
        "headGroupSpec": {
            # Strings only; num-cpus "0" keeps Ray tasks off the head (the driver still runs there).
            "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
            "template": {
                # The head carries the run's label but not the GPU group's: it pins no GPU worker's zone.
                "metadata": {"labels": {**run.labels, RUN_LABEL: group}},
                "spec": {
                    "serviceAccountName": run.service_account,
                    "automountServiceAccountToken": AUTOMOUNT_SERVICE_ACCOUNT_TOKEN,
                    "securityContext": dict(POD_SECURITY_CONTEXT),
                    "containers": [head],
                },
            },
        },
        "workerGroupSpecs": [
            {
                "groupName": WORKER_GROUP,
                "replicas": run.nodes,
                "minReplicas": run.nodes,
                "maxReplicas": run.nodes,
                "rayStartParams": {},
                "template": gpu_pod_template(run, worker, group),
            }
        ],
    }


def dashboard_command(namespace: str, job_name: str, standing_cluster: str | None) -> str:
    """Port-forward to the Ray dashboard; an ephemeral cluster's name is in the RayJob's status."""
    if standing_cluster is not None:
        return f"kubectl port-forward -n {namespace} service/{standing_cluster}-head-svc 8265:8265"
    cluster = f"$(kubectl get rayjob {job_name} -n {namespace} -o jsonpath='{{.status.rayClusterName}}')"
    return f"kubectl port-forward -n {namespace} service/{cluster}-head-svc 8265:8265"
