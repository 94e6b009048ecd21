"""The a4-gemma4 workload: a Kubernetes Job running `accelerate launch` (FSDP2) on whole A4 nodes.

    pulumi up --stack a4-gemma4                      # cluster, identity, secret, and the training Job
    kubectl logs -f job/<jobName> -n gft-<stack>   # the exact command is a stack output

Decisions (why and sources: docs/decisions/gke-training-job.md)
- `render_training_job` is a pure function to manifests (a headless Service when nodes > 1, the Job).
- Named `train-<recipe>-<hash8>` over image content, recipe, overrides and shape: same inputs, no change;
  a new image or recipe, a new run. Capacity is not in the hash (a move to spot resumes the run).
- `pulumi up` does not wait for training (`skipAwait`); the finished Job is removed after 3 days, so run
  `pulumi refresh` before changing a setting of a finished run.
- Retries resume from the latest checkpoint; preemption and maintenance use none; a deadline bounds it.
- Whole nodes; multi-node is an Indexed Job in one zone, rank 0 at `<job>-0.<job>:29500`.
Not here: JobSet, A4 RDMA / GPUDirect networking (NCCL over the pod network: correct, not fast), Kueue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pulumi
import pulumi_kubernetes as k8s

from infra.config import StackConfig
from infra.foundation import Identity, finished_run
from infra.gke_workload import (
    ADAPTER_SUBDIR,
    BUCKET_SLOT,
    CONTAINER_SECURITY_CONTEXT,
    IMAGE_SLOT,
    POD_SECURITY_CONTEXT,
    RUNS_PREFIX,
    SKIP_AWAIT,
    TERMINATION_GRACE_S,
    TrainingNamespace,
    common_labels,
    declare_gke_base,
    fill_slots,
    gpu_node_selector,
    gpu_pod_labels,
    gpu_pod_resources,
    gpu_pods_same_zone,
    hf_token_env,
    run_name,
)
from infra.pricing import cost_labels, gke_node_hour

if TYPE_CHECKING:
    from infra.config import LoadedConfig
    from infra.foundation import Foundation
    from infra.images import Images

JOB_NAME_PREFIX = "train"
# Indexed pods are named `<job>-<index>` as hostnames (63 characters at most).
JOB_NAME_MAX = 56
MAIN_PROCESS_PORT = 29500
TTL_AFTER_FINISHED_S = 3 * 24 * 3600
SHM_SIZE = "64Gi"
NODE_RANK_ENV = "NODE_RANK"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
TENSORBOARD_SUBDIR = "logs"


@dataclass(frozen=True)
class TrainingJobSpec:
    """Everything the training Job's manifests depend on, as plain values."""

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
    """Price and limit labels, on the Job's metadata only: a new price must not replace a running Job."""

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    @property
    def main_process_ip(self) -> str:
        """Rank 0's stable DNS name: `<job>-<index>` hostname under the headless Service `<job>`."""
        return f"{self.name}-0.{self.name}"

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def run_dir(bucket: str, job: str) -> str:
    return f"gs://{bucket}/{RUNS_PREFIX}/{job}"


def launch_args(spec: TrainingJobSpec) -> list[str]:
    """Arguments of `python -m trainer.launch`: recipe, processes per node, rendezvous, overrides, output dir."""
    args = ["--recipe", spec.recipe, "--nproc-per-node", str(spec.gpus_per_node)]
    if spec.multi_node:
        args += [
            "--nnodes",
            str(spec.nodes),
            "--node-rank",
            f"$({NODE_RANK_ENV})",  # expanded by the kubelet from the env var below
            "--main-process-ip",
            spec.main_process_ip,
            "--main-process-port",
            str(MAIN_PROCESS_PORT),
        ]
    for override in spec.overrides:
        args += ["--set", override]
    # Last, so the stack's run directory always wins: the outputs below point there.
    args += ["--set", f"output.dir={spec.output_dir}"]
    return args


def render_training_job(spec: TrainingJobSpec) -> list[dict[str, Any]]:
    """The manifests of one training run: [headless Service (nodes > 1)], Job."""
    env: list[dict[str, Any]] = [{"name": "PYTHONUNBUFFERED", "value": "1"}, *hf_token_env(spec.hf_secret_name)]
    if spec.multi_node:
        env.append(
            {
                "name": NODE_RANK_ENV,
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}},
            }
        )
    pod_spec: dict[str, Any] = {
        "serviceAccountName": spec.service_account,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "nodeSelector": dict(spec.node_selector),
        "securityContext": dict(POD_SECURITY_CONTEXT),
        "containers": [
            {
                "name": "trainer",
                "image": spec.image,
                "command": ["python", "-m", "trainer.launch"],
                "args": launch_args(spec),
                "env": env,
                "resources": spec.resources,
                "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
                "securityContext": dict(CONTAINER_SECURITY_CONTEXT),
            }
        ],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}}],
    }
    if spec.multi_node:
        pod_spec["subdomain"] = spec.name
        pod_spec["affinity"] = gpu_pods_same_zone(spec.name)

    job_spec: dict[str, Any] = {
        "backoffLimit": spec.retries * spec.nodes,
        "activeDeadlineSeconds": spec.timeout_seconds,
        "ttlSecondsAfterFinished": TTL_AFTER_FINISHED_S,
        "completions": spec.nodes,
        "parallelism": spec.nodes,
        "podFailurePolicy": {
            "rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
        },
        "template": {"metadata": {"labels": {**spec.labels, **gpu_pod_labels(spec.name)}}, "spec": pod_spec},
    }
    if spec.multi_node:
        job_spec["completionMode"] = "Indexed"

    manifests: list[dict[str, Any]] = []
    if spec.multi_node:
        manifests.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": dict(spec.labels)},
                "spec": {
                    "clusterIP": "None",
                    "selector": {"job-name": spec.name},
                    # Peers resolve each other while they start, before any readiness.
                    "publishNotReadyAddresses": True,
                    "ports": [{"name": "rendezvous", "port": MAIN_PROCESS_PORT, "targetPort": MAIN_PROCESS_PORT}],
                },
            }
        )
    manifests.append(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": spec.name,
                "namespace": spec.namespace,
                "labels": {**spec.labels, **spec.cost_labels},
                "annotations": dict(SKIP_AWAIT),
            },
            "spec": job_spec,
        }
    )
    return manifests


def job_spec_for(
    cfg: StackConfig, image_content: str, image: str, bucket: str, service_account: str, hf_secret: str | None
) -> TrainingJobSpec:
    """The plain values for this stack's Job; the name derives from `image_content`, not from `image`."""
    assert cfg.gpus_per_node is not None, "config validation guarantees gpusPerNode on GKE"
    name = run_name(JOB_NAME_PREFIX, cfg, image_content, JOB_NAME_MAX)
    return TrainingJobSpec(
        name=name,
        namespace=cfg.namespace,
        image=image,
        recipe=cfg.recipe,
        output_dir=run_dir(bucket, name),
        gpus_per_node=cfg.gpus_per_node,
        nodes=cfg.nodes,
        node_selector=gpu_node_selector(cfg),
        resources=gpu_pod_resources(cfg),
        service_account=service_account,
        hf_secret_name=hf_secret,
        retries=cfg.training_retries,
        timeout_seconds=cfg.timeout_minutes * 60,
        overrides=tuple(cfg.recipe_overrides),
        labels={**common_labels(cfg, "training"), "gemma-finetune/recipe": cfg.recipe[:63]},
        cost_labels=cost_labels(cfg, gke_node_hour(cfg), kubernetes=True),
    )


@dataclass
class TrainingJobArgs:
    cfg: StackConfig
    """The validated stack configuration."""
    provider: k8s.Provider
    """The cluster's Kubernetes provider."""
    namespace: TrainingNamespace
    """Namespace, service account and HF Secret the pods use (created first)."""
    image: pulumi.Input[str]
    """The trainer image, pinned by digest."""
    image_content: str
    """`Images.trainer_content`: what the Job's name derives from (known in a preview)."""
    bucket_name: pulumi.Input[str]
    """The stack's bucket: runs write under gs://BUCKET/runs/<job>."""
    after: list[pulumi.Resource] = field(default_factory=list)
    """What the pods need in place besides the namespace pieces: the APIs and every IAM grant to the
    trainer's and the nodes' service accounts (bucket access, image pulls)."""
    bucket_kept: bool = False
    """`Foundation.bucket_kept`: the bucket may hold this run finished (then no Job is declared)."""


class TrainingJob(pulumi.ComponentResource):
    """The training Job (+ headless Service for multi-node) rendered by `render_training_job`."""

    job_name: str
    run_dir: pulumi.Output[str]
    job: k8s.batch.v1.Job | None
    """None when the run has finished already (`finished`): no pod, no GPU node."""
    service: k8s.core.v1.Service | None
    finished: str | None
    """The run's `_RUN_COMPLETE.json` when the kept bucket holds it (foundation.finished_run), else None."""

    def __init__(self, name: str, args: TrainingJobArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gemma-finetune:k8s:TrainingJob", name, None, opts)
        cfg = args.cfg
        ns = args.namespace
        spec = job_spec_for(
            cfg, args.image_content, IMAGE_SLOT, BUCKET_SLOT, ns.service_account_name, ns.hf_secret_name
        )
        slots = {IMAGE_SLOT: args.image, BUCKET_SLOT: args.bucket_name}
        manifests: list[dict[str, Any]] = [fill_slots(m, slots) for m in render_training_job(spec)]
        self.job_name = spec.name
        self.run_dir = pulumi.Output.from_input(fill_slots(spec.output_dir, slots))
        self.finished = finished_run(cfg, args.bucket_kept, f"{RUNS_PREFIX}/{spec.name}")
        self.service, self.job = None, None
        if self.finished is not None:
            self.register_outputs({"job_name": self.job_name, "run_dir": self.run_dir})
            return

        depends: list[pulumi.Resource] = [*ns.ready, *args.after]
        if cfg.nodes > 1:
            service_manifest = manifests[0]
            self.service = k8s.core.v1.Service(
                f"{name}-svc",
                metadata=service_manifest["metadata"],
                spec=service_manifest["spec"],
                opts=pulumi.ResourceOptions(
                    parent=self, provider=args.provider, depends_on=depends, delete_before_replace=True
                ),
            )
            depends = [*depends, self.service]

        job_manifest = manifests[-1]
        self.job = k8s.batch.v1.Job(
            f"{name}-job",
            metadata=job_manifest["metadata"],
            spec=job_manifest["spec"],
            opts=pulumi.ResourceOptions(
                parent=self,
                provider=args.provider,
                depends_on=depends,
                # The name is fixed by content; a capacity change replaces the Job under the same name.
                delete_before_replace=True,
            ),
        )
        self.register_outputs({"job_name": self.job_name, "run_dir": self.run_dir})


def declare(
    cfg: StackConfig, loaded: LoadedConfig, foundation: Foundation, images: Images
) -> dict[str, pulumi.Input[Any]]:
    """The a4-gemma4 workload: cluster, namespace pieces, training Job; returns the stack outputs."""
    base = f"gft-{cfg.stack}"
    gke = declare_gke_base(cfg, loaded, foundation)
    cluster, namespace = gke.cluster, gke.namespace
    job = TrainingJob(
        base,
        TrainingJobArgs(
            cfg=cfg,
            provider=cluster.provider,
            namespace=namespace,
            image=images.trainer_image,
            image_content=images.trainer_content,
            bucket_name=foundation.bucket_name,
            after=[*foundation.apis, *foundation.grants_to(Identity.TRAINER), *foundation.grants_to(Identity.NODES)],
            bucket_kept=foundation.bucket_kept,
        ),
    )
    ns, job_name = cfg.namespace, job.job_name
    return {
        **gke.outputs(cfg),
        "jobName": job_name,
        "worldSize": cfg.total_gpus,
        "logs": f"kubectl logs -f job/{job_name} -n {ns}",
        "status": f"kubectl get job {job_name} -n {ns} -o wide && kubectl get pods -n {ns} -l job-name={job_name}",
        "runDir": job.run_dir,
        "tensorboardLogs": job.run_dir.apply(lambda d: f"{d}/{TENSORBOARD_SUBDIR}"),
        "tensorboard": job.run_dir.apply(lambda d: f"tensorboard --logdir {d}/{TENSORBOARD_SUBDIR}"),
        "adapter": job.run_dir.apply(lambda d: f"{d}/{ADAPTER_SUBDIR}"),
        **({"trainingState": f"finished ({job.finished}): no Job started"} if job.finished else {}),
    }
