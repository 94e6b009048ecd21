"""Stack `dev`: a Cloud Run GPU Job trains, a vLLM Cloud Run GPU Service serves.

Decisions (why: docs/decisions/cloud-run-training-start.md, docs/decisions/cloud-run-serving.md)
- A run is `run_id`, 12 hex characters of its key (infra/run_identity.py; never the trainer image); it names
  the run folder on the mounted bucket, so each run resumes only its own checkpoints.
- `pulumi up` starts training with `gcloud run jobs execute --async`, triggered by `run_id` only (no execution
  token, a no-op `update`): a re-run by hand (`rerunTraining`) leaves the stack working.
- Serving (`servingEnabled`) serves a pinned, finished run: `servingRunId`, else the run the serving gate
  picks among the finished ones (infra/serving_gate.py).
- Startup probe: serving/startup.py's window, 30 s initial delay + 24 x 10 s = 270 s.
- vLLM's `--max-num-seqs` equals Cloud Run's `servingConcurrency`; scale to zero.
- Private unless `servingPublic: true`; with `servingApiKey` the key guards every route except /health
  (vLLM alone leaves /invocations keyless, so serving/api_key_guard.py closes it).
- No Direct VPC egress; the Job never uses GPU zonal redundancy; its deadline defaults to 60 minutes.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
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
from infra.serving_gate import RUN_SUMMARY, gate, run_eval
from serving.completion import COMPLETION_MARKER, IncompleteModelError, Inventory, check_inventory
from serving.startup import COLD_START_VLLM, STARTUP_WINDOW
from serving.vllm_args import VLLM_HEALTH_PATH, Dtype, VllmServerConfig, model_type_of, render_args
from trainer.recipe import load_recipe

BUCKET_MOUNT = "/mnt/bucket"
MODEL_MOUNT = "/mnt/models"
JOB_CPU, JOB_MEMORY_GIB = 8, 32
SERVICE_CPU, SERVICE_MEMORY_GIB = 8, 32
VLLM_PORT = 8000


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


def _resources(gpu: str, cpu: int, memory_gib: int) -> dict[str, str]:
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
    return _resources(cfg.gpu_type or "nvidia-l4", JOB_CPU, JOB_MEMORY_GIB)


def service_limits(cfg: StackConfig) -> dict[str, str]:
    """CPU, memory and GPU of one vLLM instance."""
    return _resources(cfg.serving_gpu_type, SERVICE_CPU, SERVICE_MEMORY_GIB)


def vllm_config(cfg: StackConfig, rid: str) -> VllmServerConfig:
    base_model = load_recipe(cfg.recipe_source, cfg.recipe_overrides).model.name_or_path
    return VllmServerConfig(
        model=f"{MODEL_MOUNT}/{run_prefix(cfg, rid)}/merged",
        served_model_name=cfg.recipe,
        max_model_len=cfg.serving_max_model_len,
        dtype=Dtype.BFLOAT16,
        model_type=model_type_of(base_model),
        port=VLLM_PORT,
        max_num_seqs=cfg.serving_max_concurrency,
        # the key (VLLM_API_KEY, see VllmService._envs) on every route but /health, not only vLLM's /v1 prefixes
        api_key_guard=cfg.serving_api_key_set,
        extra_args=cfg.serving_extra_args,
        # --enforce-eager and whole-file weight reads: the cold start serving/startup.py expects (EXPECTED_START)
        **COLD_START_VLLM,
    )


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


def _marker_pattern(cfg: StackConfig) -> re.Pattern[str]:
    return re.compile(rf"^runs/{re.escape(cfg.recipe)}-([0-9a-f]{{12}})/merged/{re.escape(COMPLETION_MARKER)}$")


def _field(obj: Any, name: str) -> str:
    """A field of a listed object: a typed result (attribute) or, from an output invoke, a plain dict."""
    value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    return "" if value is None else str(value)


def _updated(value: str | None) -> datetime:
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return datetime.min.replace(tzinfo=UTC)


def _follow(cfg: StackConfig) -> str:
    return f"gcloud run jobs executions list --job gft-{cfg.stack}-train --region {cfg.region}"


def choose_served_run(cfg: StackConfig, markers: list[Any], training_run: str, bucket: str) -> str:
    """The run to serve: `servingRunId` if its marker is listed, else the newest listed marker of this recipe."""
    pattern = _marker_pattern(cfg)
    runs: dict[str, datetime] = {}
    for obj in markers:
        match = pattern.match(_field(obj, "name"))
        if match:
            runs[match.group(1)] = _updated(_field(obj, "updated"))
    finished = ", ".join(sorted(runs, key=lambda r: runs[r], reverse=True)) or "none"
    if cfg.serving_run_id is not None:
        if cfg.serving_run_id not in runs:
            raise pulumi.RunError(
                f"servingRunId={cfg.serving_run_id} has no complete model: gs://{bucket}/"
                f"{run_prefix(cfg, cfg.serving_run_id)}/merged/{COMPLETION_MARKER} is not there (the run has not "
                f"finished, failed, or belongs to another recipe). Completed runs of {cfg.recipe}: {finished}. "
                f"Fix: pulumi config set servingRunId RUN_ID, or pulumi config rm servingRunId to serve the latest one"
            )
        return cfg.serving_run_id
    if not runs:
        raise pulumi.RunError(
            f"servingEnabled=true but no training run of recipe {cfg.recipe} has finished yet: no "
            f"gs://{bucket}/runs/{cfg.recipe}-*/merged/{COMPLETION_MARKER}. The current run is {training_run}; "
            f"follow it with `{_follow(cfg)}`, then run `pulumi up` again. To skip serving for now: "
            "pulumi config set servingEnabled false"
        )
    return max(runs, key=lambda r: (runs[r], r))


def check_listed_export(cfg: StackConfig, rid: str, marker_text: str, listed: list[Any], bucket: str) -> str:
    """serving/completion.py's inventory check against a listing of the run's folder; returns the run id."""
    folder = f"{run_prefix(cfg, rid)}/merged/"
    where = f"gs://{bucket}/{folder.rstrip('/')}"
    try:
        inventory = Inventory.from_marker(json.loads(marker_text or "null"), where)
        names = {_field(obj, "name")[len(folder) :]: None for obj in listed}
        check_inventory(inventory, names, where)
    except (IncompleteModelError, ValueError) as exc:
        raise pulumi.RunError(
            f"the export of run {rid} is not servable: {exc}. Run the training again (change the recipe, or "
            f"`gcloud run jobs execute gft-{cfg.stack}-train --region {cfg.region}`), or pin another run with "
            "pulumi config set servingRunId RUN_ID"
        ) from None
    return rid


def finished_runs(cfg: StackConfig, markers: list[Any]) -> list[str]:
    """The run ids of the listed completion markers of this recipe, oldest first."""
    pattern, runs = _marker_pattern(cfg), {}
    for obj in markers:
        match = pattern.match(_field(obj, "name"))
        if match:
            runs[match.group(1)] = _updated(_field(obj, "updated"))
    return sorted(runs, key=lambda r: (runs[r], r))


def gated(cfg: StackConfig, finished: list[str], summaries: list[str | None]) -> str:
    """The run the serving gate serves; warns (with the override) when it is not the newest finished run."""
    evals = {rid: run_eval(text) for rid, text in zip(finished, summaries, strict=True)}
    try:
        decision = gate(finished, evals, cfg.serving_max_eval_loss, cfg.serving_min_score)
    except ValueError as exc:
        raise pulumi.RunError(str(exc)) from None
    if decision.warning:
        pulumi.log.warn(decision.warning)
    if decision.note:
        pulumi.log.info(decision.note)
    return decision.served


def served_run(cfg: StackConfig, bucket: pulumi.Output[str], training_run: pulumi.Output[str]) -> pulumi.Output[str]:
    """The pinned run id, verified complete in the bucket, or a `pulumi.RunError` that says what to do."""
    markers = gcp.storage.get_bucket_objects_output(
        bucket=bucket,
        prefix=f"runs/{cfg.recipe}-",
        match_glob=f"runs/{cfg.recipe}-*/merged/{COMPLETION_MARKER}",
    ).bucket_objects

    # the serving gate (infra/serving_gate.py) reads the finished runs' summaries: listed first, since reading an
    # object that is not there fails the data source with a 404
    summaries = gcp.storage.get_bucket_objects_output(
        bucket=bucket, prefix=f"runs/{cfg.recipe}-", match_glob=f"runs/{cfg.recipe}-*/{RUN_SUMMARY}"
    ).bucket_objects

    def verified(parts: list[Any]) -> pulumi.Output[str]:
        listing, current, bucket_name, listed = parts
        rid = choose_served_run(cfg, listing, current, bucket_name)
        if cfg.serving_run_id is not None:
            return check(rid, bucket_name)
        finished = finished_runs(cfg, listing)
        names = {_field(obj, "name") for obj in listed}
        texts = [
            gcp.storage.get_bucket_object_content_output(bucket=bucket_name, name=name).content
            if name in names
            else None
            for name in (f"{run_prefix(cfg, r)}/{RUN_SUMMARY}" for r in finished)
        ]
        return pulumi.Output.all(*texts).apply(lambda read: check(gated(cfg, finished, read), bucket_name))

    def check(rid: str, bucket_name: str) -> pulumi.Output[str]:
        folder = f"{run_prefix(cfg, rid)}/merged/"
        marker = gcp.storage.get_bucket_object_content_output(bucket=bucket_name, name=folder + COMPLETION_MARKER)
        files = gcp.storage.get_bucket_objects_output(bucket=bucket_name, prefix=folder).bucket_objects
        return pulumi.Output.all(marker.content, files).apply(
            lambda p: check_listed_export(cfg, rid, p[0], p[1], bucket_name)
        )

    return pulumi.Output.all(markers, training_run, bucket, summaries).apply(verified)


class VllmService(pulumi.ComponentResource):
    """The vLLM Cloud Run GPU Service over the merged model of a pinned, completed training run."""

    service: gcp.cloudrunv2.Service
    url: pulumi.Output[str]
    run_id: pulumi.Output[str]

    def __init__(
        self,
        name: str,
        cfg: StackConfig,
        foundation: Foundation,
        image: pulumi.Output[str],
        training_run: pulumi.Output[str],
        opts=None,
    ) -> None:
        super().__init__("gemma-finetune:gcp:VllmService", name, None, opts)
        assert foundation.serving_account is not None, "the foundation creates a serving account when serving is on"
        child = pulumi.ResourceOptions(parent=self)
        self.run_id = served_run(cfg, foundation.bucket_name, training_run)
        vllm_args = self.run_id.apply(lambda rid: render_args(vllm_config(cfg, rid)))
        envs = self._envs(cfg, foundation)
        self.service = gcp.cloudrunv2.Service(
            f"{name}-service",
            project=cfg.project,
            location=cfg.region,
            name=f"gft-{cfg.stack}-vllm",
            deletion_protection=False,
            ingress="INGRESS_TRAFFIC_ALL",
            invoker_iam_disabled=cfg.serving_public,
            # The policy pack allows a disabled invoker check only on a service labelled public=true.
            labels={**cfg.resource_labels, "public": "true"} if cfg.serving_public else cfg.resource_labels,
            template=gcp.cloudrunv2.ServiceTemplateArgs(
                service_account=foundation.serving_account.email,
                gpu_zonal_redundancy_disabled=not cfg.gpu_zonal_redundancy,
                node_selector=gcp.cloudrunv2.ServiceTemplateNodeSelectorArgs(accelerator=cfg.serving_gpu_type),
                max_instance_request_concurrency=cfg.serving_max_concurrency,
                timeout="600s",
                scaling=gcp.cloudrunv2.ServiceTemplateScalingArgs(
                    min_instance_count=0, max_instance_count=cfg.serving_max_instances
                ),
                containers=[
                    gcp.cloudrunv2.ServiceTemplateContainerArgs(
                        image=image,
                        args=vllm_args,
                        ports=gcp.cloudrunv2.ServiceTemplateContainerPortsArgs(container_port=VLLM_PORT),
                        envs=envs,
                        resources=gcp.cloudrunv2.ServiceTemplateContainerResourcesArgs(
                            limits=_resources(cfg.serving_gpu_type, SERVICE_CPU, SERVICE_MEMORY_GIB),
                            cpu_idle=False,
                            startup_cpu_boost=True,
                        ),
                        # serving/startup.py states the window and why (STARTUP_WINDOW: first probe at 30 s, 270 s in all)
                        startup_probe=gcp.cloudrunv2.ServiceTemplateContainerStartupProbeArgs(
                            initial_delay_seconds=STARTUP_WINDOW.initial_delay_s,
                            period_seconds=STARTUP_WINDOW.period_s,
                            timeout_seconds=STARTUP_WINDOW.timeout_s,
                            failure_threshold=STARTUP_WINDOW.failure_threshold,
                            # the one path serving/api_key_guard.py leaves open: the probe sends no key
                            http_get=gcp.cloudrunv2.ServiceTemplateContainerStartupProbeHttpGetArgs(
                                path=VLLM_HEALTH_PATH, port=VLLM_PORT
                            ),
                        ),
                        volume_mounts=[
                            gcp.cloudrunv2.ServiceTemplateContainerVolumeMountArgs(
                                name="models", mount_path=MODEL_MOUNT
                            )
                        ],
                    )
                ],
                volumes=[
                    gcp.cloudrunv2.ServiceTemplateVolumeArgs(
                        name="models",
                        gcs=gcp.cloudrunv2.ServiceTemplateVolumeGcsArgs(
                            bucket=foundation.bucket_name, read_only=True, mount_options=["implicit-dirs"]
                        ),
                    )
                ],
            ),
            opts=pulumi.ResourceOptions(
                parent=self,
                # A Service that references a secret fails to create without the accessor grant (terraform-provider-google #13786, #13828):
                # the key's grant is one of grants_to(SERVING).
                depends_on=[
                    *foundation.apis,
                    foundation.serving_account,
                    *foundation.grants_to(Identity.SERVING),
                    *([foundation.api_key_secret_version] if foundation.api_key_secret_version else []),
                ],
            ),
        )
        for i, member in enumerate(cfg.serving_invokers):
            gcp.cloudrunv2.ServiceIamMember(
                f"{name}-invoker-{i}",
                project=cfg.project,
                location=cfg.region,
                name=self.service.name,
                role="roles/run.invoker",
                member=member,
                opts=child,
            )
        self.url = self.service.uri
        self.register_outputs({"url": self.url, "run_id": self.run_id})

    @staticmethod
    def _envs(cfg: StackConfig, foundation: Foundation) -> list[gcp.cloudrunv2.ServiceTemplateContainerEnvArgs]:
        """The container's environment: fixed settings, the startup window, servingEnv, and the API key by reference."""
        env = gcp.cloudrunv2.ServiceTemplateContainerEnvArgs
        envs = [
            env(name="HF_HUB_OFFLINE", value="1"),
            env(name="GEMMA_FT_STARTUP_WINDOW_S", value=str(STARTUP_WINDOW.total_s)),
            env(name="GEMMA_FT_WAIT_FOR_MODEL_S", value=str(STARTUP_WINDOW.marker_wait_s)),
            env(name="GEMMA_FT_MAX_MARKER_WAIT_S", value=str(STARTUP_WINDOW.max_marker_wait_s)),
            *(env(name=k, value=v) for k, _, v in (item.partition("=") for item in cfg.serving_env)),
        ]
        if foundation.api_key_secret is not None and foundation.api_key_secret_version is not None:
            envs.append(
                env(
                    name="VLLM_API_KEY",
                    value_source=gcp.cloudrunv2.ServiceTemplateContainerEnvValueSourceArgs(
                        secret_key_ref=gcp.cloudrunv2.ServiceTemplateContainerEnvValueSourceSecretKeyRefArgs(
                            secret=foundation.api_key_secret.secret_id,
                            version=foundation.api_key_secret_version.version,
                        )
                    ),
                )
            )
        return envs


def declare(
    cfg: StackConfig, loaded: LoadedConfig, foundation: Foundation, images: Images, run: RunState
) -> dict[str, Any]:
    """The `cloud-run` workload: the training Job and, when enabled, the vLLM Service."""
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
    if cfg.serving_enabled:
        assert images.serving_image is not None
        if cfg.serving_public and not cfg.serving_api_key_set:
            pulumi.log.warn(
                "servingPublic=true without servingApiKey: anyone with the URL can use this GPU service and bill "
                "up to servingMaxInstances instances; set one with `pulumi config set --secret servingApiKey …`"
            )
        service = VllmService(
            name,
            cfg,
            foundation,
            images.serving_image,
            pulumi.Output.from_input(training.run_id),
        )
        outputs["servingUrl"] = service.url
        outputs["servingRunId"] = service.run_id
        outputs["servedModelUri"] = pulumi.Output.all(foundation.bucket_uri, service.run_id).apply(
            lambda p: f"{p[0]}/{run_prefix(cfg, p[1])}/merged"
        )
        outputs["query"] = service.url.apply(
            lambda url: (
                # GEMMA_FT_URL is the client's token allowlist: identity tokens go only to the stack's servingUrl
                f'GEMMA_FT_URL={url} python -m serving.client --model {cfg.recipe} "Translate to emoji: I ate a banana '
                "for breakfast, later I'm thinking of having soup!\""
            )
        )
    else:
        outputs["nextStep"] = (
            "when the training execution has succeeded: pulumi config set servingEnabled true && pulumi up"
        )
    return outputs
