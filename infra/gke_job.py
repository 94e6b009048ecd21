"""The a4-gemma4 workload: a Kubernetes Job running `accelerate launch` (DDP or FSDP2) on whole A4 nodes.

    pulumi up --stack a4-gemma4                      # cluster, identity, secret, and the training Job
    kubectl logs -f job/<jobName> -n gft-<stack>   # the exact command is a stack output

Decisions (why and sources: docs/gke.md#the-training-job)
- Top to bottom: `declare` → `TrainingJob` → `render_training_job`, a pure function of a
  `gke_workload.GpuRun` to manifests (a headless Service when nodes > 1, the Job).
- Named `train-<recipe>-<key8>` by the run's key (infra/run_identity.py): a new trainer image or a move to spot
  replaces the Job under its name, and the run resumes.
- `pulumi up` does not wait for training (a `waitFor` met at creation); a delete waits for the pods
  (`DELETE_TIMEOUT`); the finished Job goes after 3 days; retries resume (preemption uses none), a deadline.
- Whole nodes, DDP over LoRA by the memory model (FSDP2 when a recipe asks); multi-node is an Indexed Job in
  one zone, rank 0 at `<job>-0.<job>:29500`.
Not here: JobSet, A4 RDMA / GPUDirect networking (NCCL over the pod network: correct, not fast), Kueue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pulumi
import pulumi_kubernetes as k8s

from infra.config import StackConfig
from infra.foundation import FINISHED_OUTPUT
from infra.gke_workload import (
    ADAPTER_SUBDIR,
    BUCKET_SLOT,
    CREATED_AWAIT,
    DELETE_TIMEOUT,
    IMAGE_SLOT,
    GkeBase,
    GpuRun,
    declare_gke_base,
    fill_slots,
    finished_logs_command,
    gpu_pod_template,
    gpu_run,
    trainer_container,
)
from infra.run_identity import GKE_JOB_NAME_MAX

if TYPE_CHECKING:
    from infra.config import LoadedConfig
    from infra.foundation import Foundation
    from infra.images import Images
    from infra.run_identity import RunState

JOB_NAME_MAX = GKE_JOB_NAME_MAX  # Indexed pods are named `<job>-<index>` as hostnames (63 characters at most)
MAIN_PROCESS_PORT = 29500
TTL_AFTER_FINISHED_S = 3 * 24 * 3600
SHM_SIZE = "64Gi"
NODE_RANK_ENV = "NODE_RANK"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
TENSORBOARD_SUBDIR = "logs"


def declare(
    cfg: StackConfig, loaded: LoadedConfig, foundation: Foundation, images: Images, run: RunState
) -> dict[str, pulumi.Input[Any]]:
    """The a4-gemma4 workload: cluster, namespace pieces, training Job; returns the stack outputs."""
    gke = declare_gke_base(cfg, loaded, foundation)
    job = TrainingJob(
        f"gft-{cfg.stack}",
        TrainingJobArgs(
            cfg=cfg,
            gke=gke,
            image=images.trainer_image,
            run=run,
            bucket_name=foundation.bucket_name,
        ),
    )
    ns, job_name = cfg.namespace, job.job_name
    status = f"kubectl get job {job_name} -n {ns} -o wide && kubectl get pods -n {ns} -l job-name={job_name}"
    return {
        **gke.outputs(),
        "jobName": job_name,
        "worldSize": cfg.total_gpus,
        # a finished run has no Job in this deployment: its pods' logs are in Cloud Logging
        "logs": finished_logs_command(cfg, job_name) if job.finished else f"kubectl logs -f job/{job_name} -n {ns}",
        "status": f"finished ({job.finished})" if job.finished else status,
        "runDir": job.run_dir,
        "tensorboardLogs": job.run_dir.apply(lambda d: f"{d}/{TENSORBOARD_SUBDIR}"),
        "tensorboard": job.run_dir.apply(lambda d: f"tensorboard --logdir {d}/{TENSORBOARD_SUBDIR}"),
        "adapter": job.run_dir.apply(lambda d: f"{d}/{ADAPTER_SUBDIR}"),
        **({FINISHED_OUTPUT: f"finished ({job.finished}): no Job started"} if job.finished else {}),
    }


@dataclass
class TrainingJobArgs:
    cfg: StackConfig
    """The validated stack configuration."""
    gke: GkeBase
    """The cluster (its provider), the namespace pieces and what the pods wait for besides: the APIs and
    every IAM grant to the trainer's and the nodes' service accounts (bucket access, image pulls)."""
    image: pulumi.Input[str]
    """The trainer image, pinned by digest."""
    run: RunState
    """This stack's run (`infra.run_identity.resolve`): its name, and whether it has finished (then no Job)."""
    bucket_name: pulumi.Input[str]
    """The stack's bucket: runs write under gs://BUCKET/runs/<job>."""


class TrainingJob(pulumi.ComponentResource):
    """The training Job (+ headless Service for multi-node) rendered by `render_training_job`."""

    job_name: str
    run_dir: pulumi.Output[str]
    job: k8s.batch.v1.Job | None
    """None when the run has finished already (`finished`): no pod, no GPU node."""
    service: k8s.core.v1.Service | None
    finished: str | None
    """The run's `_RUN_COMPLETE.json` when the kept bucket holds it (`RunState.finished`), else None."""

    def __init__(self, name: str, args: TrainingJobArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gemma-finetune:k8s:TrainingJob", name, None, opts)
        gke = args.gke
        run = gpu_run(args.cfg, gke.namespace, args.run.name)
        slots = {IMAGE_SLOT: args.image, BUCKET_SLOT: args.bucket_name}
        manifests: list[dict[str, Any]] = [fill_slots(m, slots) for m in render_training_job(run)]
        self.job_name = run.name
        self.run_dir = pulumi.Output.from_input(fill_slots(run.output_dir, slots))
        self.finished = args.run.finished
        self.service, self.job = None, None
        if self.finished is not None:
            self.register_outputs({"job_name": self.job_name, "run_dir": self.run_dir})
            return

        depends: list[pulumi.Resource] = [*gke.namespace.ready, *gke.after]
        provider = gke.cluster.provider
        if run.nodes > 1:
            service_manifest = manifests[0]
            self.service = k8s.core.v1.Service(
                f"{name}-svc",
                metadata=service_manifest["metadata"],
                spec=service_manifest["spec"],
                opts=pulumi.ResourceOptions(
                    parent=self, provider=provider, depends_on=depends, delete_before_replace=True
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
                provider=provider,
                depends_on=depends,
                # The name is the run's; a capacity change replaces the Job under the same name.
                delete_before_replace=True,
                custom_timeouts=pulumi.CustomTimeouts(delete=DELETE_TIMEOUT),
            ),
        )
        self.register_outputs({"job_name": self.job_name, "run_dir": self.run_dir})


def render_training_job(run: GpuRun) -> list[dict[str, Any]]:
    """The manifests of one training run: [headless Service (nodes > 1)], Job."""
    multi_node = run.nodes > 1
    container = trainer_container("trainer", run, run.resources)
    container["command"] = ["python", "-m", "trainer.launch"]
    container["args"] = launch_args(run)
    container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if multi_node:
        container["env"].append(
            {
                "name": NODE_RANK_ENV,
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}},
            }
        )
    template = gpu_pod_template(run, container, run.name)
    template["spec"]["restartPolicy"] = "Never"
    template["spec"]["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}}]
    if multi_node:
        template["spec"]["subdomain"] = run.name

    job_spec: dict[str, Any] = {
        "backoffLimit": run.retries * run.nodes,
        "activeDeadlineSeconds": run.timeout_seconds,
        "ttlSecondsAfterFinished": TTL_AFTER_FINISHED_S,
        "completions": run.nodes,
        "parallelism": run.nodes,
        "podFailurePolicy": {
            "rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
        },
        "template": template,
    }
    if multi_node:
        job_spec["completionMode"] = "Indexed"

    manifests: list[dict[str, Any]] = []
    if multi_node:
        manifests.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": run.name, "namespace": run.namespace, "labels": dict(run.labels)},
                "spec": {
                    "clusterIP": "None",
                    "selector": {"job-name": run.name},
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
                "name": run.name,
                "namespace": run.namespace,
                "labels": {**run.labels, **run.cost_labels},
                "annotations": dict(CREATED_AWAIT),
            },
            "spec": job_spec,
        }
    )
    return manifests


def main_process_ip(run: GpuRun) -> str:
    """Rank 0's stable DNS name: `<job>-<index>` hostname under the headless Service `<job>`."""
    return f"{run.name}-0.{run.name}"


def launch_args(run: GpuRun) -> list[str]:
    """Arguments of `python -m trainer.launch`: recipe, processes per node, rendezvous, overrides, output dir."""
    args = ["--recipe", run.recipe, "--nproc-per-node", str(run.gpus_per_node)]
    if run.nodes > 1:
        args += [
            "--nnodes",
            str(run.nodes),
            "--node-rank",
            f"$({NODE_RANK_ENV})",  # the kubelet expands it from the pod env (render_training_job)
            "--main-process-ip",
            main_process_ip(run),
            "--main-process-port",
            str(MAIN_PROCESS_PORT),
        ]
    for override in run.overrides:
        args += ["--set", override]
    # Last, so the stack's run directory always wins: the outputs below point there.
    args += ["--set", f"output.dir={run.output_dir}"]
    return args
