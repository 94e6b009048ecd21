"""Stack `dev`: a Cloud Run GPU Job trains (the vLLM service, as on every stack, is infra/serving.py's).

Decisions (why: docs/cloud-run.md#training-starts-with-gcloud-run-jobs-execute)
- A run is `run_id`, 12 hex characters of its key (infra/run_identity.py; never the trainer image); it names
  the run folder on the mounted bucket, so each run resumes only its own checkpoints.
- `pulumi up` starts training with `gcloud run jobs execute --async`, triggered by `run_id` only (no execution
  token, a no-op `update`): a re-run by hand (`rerunTraining`) leaves the stack working.
- No Direct VPC egress; the Job never uses GPU zonal redundancy; its deadline defaults to 60 minutes.
"""

from __future__ import annotations

from typing import Any

import pulumi
import pulumi_command as command
import pulumi_gcp as gcp

from infra.catalog import CLOUD_RUN_GPUS
from infra.config import LoadedConfig, StackConfig
from infra.foundation import FINISHED_OUTPUT, Foundation, Identity
from infra.images import Images
from infra.pricing import HourlyPrice, cloud_run_instance_hour, cost_labels
from infra.run_identity import RunState

BUCKET_MOUNT = "/mnt/bucket"
JOB_CPU, JOB_MEMORY_GIB = 8, 32


# Starts one execution of the Job; --async returns once the execution is created (as the seed runs it).
# gcloud reference: https://cloud.google.com/sdk/gcloud/reference/run/jobs/execute
EXECUTE_SCRIPT = """set -euo pipefail
gcloud run jobs execute "$JOB" --project "$PROJECT" --region "$REGION" --async
"""


# What an in-place update of the execution step runs (pulumi-command reruns `create` when a Command has no `update`,
# provider/pkg/provider/local/commandController.go): a changed script or environment must not start an execution.
EXECUTE_UPDATE_SCRIPT = 'echo "the execution of this run id was started when it was created; nothing to do"'


def run_id(run: RunState) -> str:
    """The run's 12 hex characters: they change exactly when the run's identity does (`infra.run_identity`)."""
    return run.name.removeprefix(f"{run.inputs['recipe']}-")


def job_name(cfg: StackConfig) -> str:
    return f"gft-{cfg.stack}-train"


def execute_command(cfg: StackConfig) -> str:
    """The by-hand re-run of the current training run (it resumes the run's last complete checkpoint)."""
    return f"gcloud run jobs execute {job_name(cfg)} --region {cfg.region} --project {cfg.project}"


def run_prefix(cfg: StackConfig, rid: str) -> str:
    """Where one training run writes in the bucket (relative to the bucket root)."""
    return f"runs/{cfg.recipe}-{rid}"


def trainer_args(cfg: StackConfig, rid: str) -> list[str]:
    return [
        "-m",
        "trainer",
        "--recipe",
        cfg.recipe,
        "--set",
        f"output.dir={BUCKET_MOUNT}/{run_prefix(cfg, rid)}",
        *[arg for override in cfg.recipe_overrides for arg in ("--set", override)],
    ]


def instance_limits(gpu: str, cpu: int, memory_gib: int) -> dict[str, str]:
    """A Cloud Run GPU instance's limits: the CPU and memory asked for, raised to the GPU's minimum."""
    spec = CLOUD_RUN_GPUS[gpu]
    return {
        "cpu": str(max(cpu, spec.min_cpu)),
        "memory": f"{max(memory_gib, spec.min_memory_gib)}Gi",
        "nvidia.com/gpu": "1",
    }


def training_instance_hour(cfg: StackConfig) -> HourlyPrice | None:
    """The price of one training instance-hour (Jobs run without zonal redundancy), from the price table."""
    return cloud_run_instance_hour(cfg, cfg.gpu_type or "nvidia-l4", False, job_limits(cfg), serving=False)


def job_limits(cfg: StackConfig) -> dict[str, str]:
    """CPU, memory and GPU of the training instance (the price of an instance-hour follows them)."""
    return instance_limits(cfg.gpu_type or "nvidia-l4", JOB_CPU, JOB_MEMORY_GIB)


class CloudRunTraining(pulumi.ComponentResource):
    """The Cloud Run GPU Job that runs one recipe, and the command that starts one execution per run."""

    job: gcp.cloudrunv2.Job
    execution: command.local.Command | None
    """None when the run has finished already (`finished`): nothing is started."""
    run_id: str
    finished: str | None
    """The run's `_RUN_COMPLETE.json` when the kept bucket holds it (`RunState.finished`), else None."""

    def __init__(
        self,
        name: str,
        cfg: StackConfig,
        foundation: Foundation,
        image: pulumi.Output[str],
        run: RunState,
        opts=None,
    ) -> None:
        super().__init__("gemma-finetune:gcp:CloudRunTraining", name, None, opts)
        self.run_id = run_id(run)
        self.finished = run.finished
        envs: list[gcp.cloudrunv2.JobTemplateTemplateContainerEnvArgs] = []
        if foundation.hf_secret is not None and foundation.hf_secret_version is not None:
            envs.append(
                gcp.cloudrunv2.JobTemplateTemplateContainerEnvArgs(
                    name="HF_TOKEN",
                    value_source=gcp.cloudrunv2.JobTemplateTemplateContainerEnvValueSourceArgs(
                        secret_key_ref=gcp.cloudrunv2.JobTemplateTemplateContainerEnvValueSourceSecretKeyRefArgs(
                            secret=foundation.hf_secret.secret_id,
                            version=foundation.hf_secret_version.version,
                        )
                    ),
                )
            )
        # The Job is created with its identity's grants in place: Cloud Run refuses a Job whose secret its
        # account cannot read yet (terraform-provider-google #13786), and the first execution starts at once.
        depends: list[pulumi.Resource] = [*foundation.apis, foundation.bucket, foundation.trainer_account]
        depends += foundation.grants_to(Identity.TRAINER)
        if foundation.hf_secret_version is not None:
            depends.append(foundation.hf_secret_version)
        self.job = gcp.cloudrunv2.Job(
            f"{name}-job",
            project=cfg.project,
            location=cfg.region,
            name=job_name(cfg),
            deletion_protection=False,
            # The price per instance-hour and the stack's limit, for the policy pack's cost rule.
            labels={**cfg.resource_labels, **cost_labels(cfg, training_instance_hour(cfg), kubernetes=False)},
            template=gcp.cloudrunv2.JobTemplateArgs(
                task_count=1,
                parallelism=1,
                labels=cfg.resource_labels,
                template=gcp.cloudrunv2.JobTemplateTemplateArgs(
                    service_account=foundation.trainer_account.email,
                    timeout=f"{cfg.timeout_minutes * 60}s",
                    max_retries=cfg.training_retries,
                    gpu_zonal_redundancy_disabled=True,
                    node_selector=gcp.cloudrunv2.JobTemplateTemplateNodeSelectorArgs(
                        accelerator=cfg.gpu_type or "nvidia-l4"
                    ),
                    containers=[
                        gcp.cloudrunv2.JobTemplateTemplateContainerArgs(
                            image=image,
                            commands=["python"],
                            args=trainer_args(cfg, self.run_id),
                            envs=envs,
                            resources=gcp.cloudrunv2.JobTemplateTemplateContainerResourcesArgs(limits=job_limits(cfg)),
                            volume_mounts=[
                                gcp.cloudrunv2.JobTemplateTemplateContainerVolumeMountArgs(
                                    name="bucket", mount_path=BUCKET_MOUNT
                                )
                            ],
                        )
                    ],
                    volumes=[
                        gcp.cloudrunv2.JobTemplateTemplateVolumeArgs(
                            name="bucket",
                            gcs=gcp.cloudrunv2.JobTemplateTemplateVolumeGcsArgs(
                                bucket=foundation.bucket_name, read_only=False
                            ),
                        )
                    ],
                ),
            ),
            opts=pulumi.ResourceOptions(parent=self, depends_on=depends),
        )
        # One execution per run id, after the Job (and so its template) is in place. `triggers` replaces the
        # command when the run changes; the environment is stable, so nothing else re-runs it. A run that has
        # finished (an `up` after `destroy` with the bucket kept) starts no execution: no GPU for a run that is done.
        self.execution = None
        if self.finished is None:
            self.execution = command.local.Command(
                f"{name}-execution",
                create=EXECUTE_SCRIPT,
                update=EXECUTE_UPDATE_SCRIPT,
                interpreter=["/bin/bash", "-c"],
                environment={"JOB": self.job.name, "PROJECT": cfg.project, "REGION": cfg.region},
                triggers=[self.run_id],
                opts=pulumi.ResourceOptions(parent=self, depends_on=[self.job]),
            )
        self.register_outputs({"job_name": self.job.name, "run_id": self.run_id})


def declare(
    cfg: StackConfig, loaded: LoadedConfig, foundation: Foundation, images: Images, run: RunState
) -> dict[str, Any]:
    """The `cloud-run` workload: the training Job and its outputs."""
    name = f"gft-{cfg.stack}"
    training = CloudRunTraining(name, cfg, foundation, images.trainer_image, run)
    run_uri = foundation.bucket_uri.apply(lambda uri: f"{uri}/{run_prefix(cfg, training.run_id)}")
    outputs: dict[str, Any] = {
        "trainingJob": training.job.name,
        "runId": training.run_id,
        "runUri": run_uri,
        "modelUri": run_uri.apply(lambda u: f"{u}/merged"),
        "followTraining": f"gcloud run jobs executions list --job {job_name(cfg)} --region {cfg.region} "
        f"--project {cfg.project}",
        "trainingLogs": f"gcloud beta run jobs logs read {job_name(cfg)} --region {cfg.region} --project {cfg.project}",
        # Safe by hand: the Job carries no execution token, so `pulumi up` / `pulumi refresh` stay clean after it.
        "rerunTraining": execute_command(cfg),
    }
    if training.finished is not None:
        outputs[FINISHED_OUTPUT] = f"finished ({training.finished}): no execution started"
    return outputs
