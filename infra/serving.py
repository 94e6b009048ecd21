"""Serving on every stack: the gated run in the stack's bucket, on a private vLLM Cloud Run GPU service.

    pulumi config set servingEnabled true && pulumi up     # any stack, once a run has finished

Decisions (why and sources: docs/serving.md)
- One Cloud Run GPU service per stack, whatever trained: scale to zero, one GPU, no Direct VPC egress; private
  unless `servingPublic: true`; with `servingApiKey` the key guards every route except /health (vLLM alone
  leaves /invocations keyless, so serving/api_key_guard.py closes it). `--max-num-seqs` = `servingConcurrency`.
- What (serving/served_model.py): each run's adapter on the base it staged in the bucket, streamed from gs://
  (`servingCompareRunIds` serves more runs, each under its own name), or the merged export where vLLM cannot.
- Which run: `servingRunId`, else the serving gate (infra/serving_gate.py) over the runs marked complete; the
  export's inventory, the adapters' configs and the staged base are checked against the bucket first.
- The probe follows the model's cold start (serving/startup.py `window_for`): for `dev`'s 1B, 30 s initial delay
  + 24 x 10 s = 270 s. GPU memory and the image's CUDA are config checks (infra/config.py `resolve_serving`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import pulumi
import pulumi_gcp as gcp

from infra.cloud_run import instance_limits
from infra.config import StackConfig, Workload
from infra.foundation import Foundation, Identity
from infra.run_identity import RUN_GENERATION_KEY, RunState, naming
from infra.serving_gate import RUN_SUMMARY, gate, run_eval
from serving.completion import ADAPTER, COMPLETION_MARKER, MODEL, IncompleteModelError, Inventory, check_inventory
from serving.memory import ServedMemory
from serving.served_model import MERGE_REASONS, ServedModel, lora_rank_for, served_model
from serving.startup import (
    COLD_START_VLLM,
    STARTUP_WINDOW,
    ColdStart,
    Loader,
    StartupWindow,
    cold_start,
    window_for,
)
from serving.vllm_args import ALLOWED_LORA_RANKS, VLLM_HEALTH_PATH, Dtype, VllmServerConfig, model_type_of, render_args
from trainer.base_weights import BASE_MARKER, BASE_SUBDIR
from trainer.base_weights import _key as staged_base_key
from trainer.export import SHARED_KV_VALUE_LORA
from trainer.memory_plan import model_shape
from trainer.recipe import REPO_ROOT, Recipe, load_recipe

SERVICE_CPU, SERVICE_MEMORY_GIB = 8, 32
VLLM_PORT = 8000
# Where the service mounts the stack's bucket (read-only): adapters and merged exports are read there.
MODEL_MOUNT = "/mnt/models"
RUNS = "runs"
# The Run:ai streamer reads the base in parallel ranges; the memory limit bounds its host buffers within the
# instance's memory, which Cloud Run's in-memory file system shares (vLLM's runai_streamer_loader.py accepts
# exactly `concurrency`, `memory_limit` and `distributed`, v0.28.0).
STREAMER_CONFIG: dict[str, int] = {"concurrency": 16, "memory_limit": 16 * 1024**3}
# Cloud Run keeps an idle instance for up to 15 minutes before scaling in (cloud.google.com/run/docs/
# about-instance-autoscaling), billed like a busy one with instance-based billing.
IDLE_BEFORE_SCALE_IN_S = 15 * 60
# Above this many GB of weights the engine's own start is estimated longer (serving/startup.py `cold_start`).
LARGE_MODEL_GB = 30


class Artefact(StrEnum):
    """What of a run the service loads: the merged export or the adapter (on the staged base)."""

    MERGED = "merged"
    ADAPTER = "adapter"


@dataclass(frozen=True)
class ServedLayout:
    """Where a stack's runs lie in its bucket and what of them is served: a pure function of the stack."""

    stem: str
    """Run folders are `runs/<stem>-<run id>`."""
    id_pattern: str
    artefact: Artefact
    why: str
    base_model: str
    """The recipe's base (a Hub id): the served adapters' base, the merged exports' origin."""
    revision: str | None
    language_model_only: bool
    follow: str
    """The command that shows the stack's current training run."""

    def folder(self, rid: str) -> str:
        return f"{RUNS}/{self.stem}-{rid}"

    @property
    def listing_prefix(self) -> str:
        return f"{RUNS}/{self.stem}-"

    @property
    def marker_glob(self) -> str:
        return f"{self.listing_prefix}*/{self.artefact}/{COMPLETION_MARKER}"

    @property
    def summary_glob(self) -> str:
        return f"{self.listing_prefix}*/{RUN_SUMMARY}"

    def marker_pattern(self) -> re.Pattern[str]:
        return re.compile(
            rf"^{re.escape(self.listing_prefix)}({self.id_pattern})/{self.artefact}/{re.escape(COMPLETION_MARKER)}$"
        )

    def base_folder(self, rid: str) -> str:
        """The base the run staged (trainer/base_weights.py: `<output.dir>/_base/<id>@<revision>`)."""
        return f"{self.folder(rid)}/{BASE_SUBDIR}/{staged_base_key(self.base_model, self.revision)}"

    def adapter_name(self, recipe: str, rid: str, primary: bool) -> str:
        """The model name clients send: the recipe for the gated run, `<recipe>-<run id>` for a compared one."""
        return recipe if primary else f"{recipe}-{rid}"


def run_id_length(cfg: StackConfig) -> int:
    """The hex characters of a run id: 12 on Cloud Run (the runId output), 8 on GKE (the end of the run folder, which
    is the Job's or RayJob's name): `infra.run_identity.naming`."""
    return naming(cfg).digits


def base_staged(cfg: StackConfig) -> bool:
    """Whether this stack's runs stage their base in the bucket: only a gs:// output.dir does
    (trainer/base_weights.py); a Cloud Run Job writes to the mounted bucket, a local folder to the trainer."""
    return cfg.workload is not Workload.CLOUD_RUN


def stack_served_model(cfg: StackConfig, recipe: Recipe | None = None) -> ServedModel:
    """serving/served_model.py's decision for this stack's recipe."""
    recipe = recipe or load_recipe(cfg.recipe_source, cfg.recipe_overrides)
    return served_model(recipe, base_staged(cfg), len(cfg.serving_compare_run_ids))


def served_layout(cfg: StackConfig, recipe: Recipe | None = None) -> ServedLayout:
    """This stack's runs in its bucket and what of them the service loads."""
    model = stack_served_model(cfg, recipe)
    cloud = cfg.workload is Workload.CLOUD_RUN
    if cloud:
        follow = f"gcloud run jobs executions list --job gft-{cfg.stack}-train --region {cfg.region}"
    else:
        kind = "jobs" if cfg.workload is Workload.GKE_JOB else "rayjobs"
        follow = f"kubectl get {kind} -n {cfg.namespace}"
    return ServedLayout(
        stem=naming(cfg).stem,
        id_pattern=f"[0-9a-f]{{{run_id_length(cfg)}}}",
        artefact=Artefact(model.artefact),
        why=model.why,
        base_model=model.base_model,
        revision=model.revision,
        language_model_only=model.language_model_only,
        follow=follow,
    )


# --------------------------------------------------------------------------- memory and cold start (plan time)


def served_memory_of(cfg: StackConfig) -> ServedMemory:
    """The GPU memory estimate of what this stack serves on `servingGpuType` (serving/memory.py)."""
    return stack_served_model(cfg).memory(cfg.serving_gpu_type, cfg.serving_max_model_len, cfg.serving_max_concurrency)


def served_cold_start(cfg: StackConfig) -> ColdStart:
    """The cold start of this stack's service, from the request (serving/startup.py `cold_start`)."""
    model = stack_served_model(cfg)
    weights_gb = served_memory_of(cfg).weights_gb
    loader = Loader.STREAMER if model.artefact == Artefact.ADAPTER else Loader.MOUNT
    return cold_start(weights_gb, loader, large=weights_gb > LARGE_MODEL_GB)


def service_window(cfg: StackConfig) -> StartupWindow:
    return window_for(served_cold_start(cfg))


def service_limits(cfg: StackConfig) -> dict[str, str]:
    """CPU, memory and GPU of one vLLM instance (the GPU's minimum where it asks for more)."""
    return instance_limits(cfg.serving_gpu_type, SERVICE_CPU, SERVICE_MEMORY_GIB)


# --------------------------------------------------------------------------- which runs (from the bucket listing)


def _field(obj: Any, name: str) -> str:
    """A field of a listed object: a typed result (attribute) or, from an output invoke, a plain dict."""
    value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    return "" if value is None else str(value)


def _updated(value: str | None) -> datetime:
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return datetime.min.replace(tzinfo=UTC)


def finished_runs(layout: ServedLayout, markers: list[Any]) -> list[str]:
    """The run ids whose export the listing shows marked complete, oldest first."""
    pattern, runs = layout.marker_pattern(), {}
    for obj in markers:
        match = pattern.match(_field(obj, "name"))
        if match:
            runs[match.group(1)] = _updated(_field(obj, "updated"))
    return sorted(runs, key=lambda r: (runs[r], r))


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def _no_run(cfg: StackConfig, layout: ServedLayout, bucket: str, run: RunState | None) -> pulumi.RunError:
    """No export of this recipe is marked complete: the run is still going, or (its `_RUN_COMPLETE.json` there) it
    finished without the export this stack serves, as runs did before the trainer wrote it (docs/serving.md)."""
    if run is not None and run.finished is not None:
        again = run.inputs["generation"] + 1
        return pulumi.RunError(
            f"servingEnabled=true but run {run.name} finished without {_article(layout.artefact)} {layout.artefact} "
            "export: no "
            f"gs://{bucket}/{layout.marker_glob} ({layout.why}; a run made before the trainer wrote that export). "
            f"Fix: pulumi config set {RUN_GENERATION_KEY} {again} && pulumi up (one paid run, which writes it), or "
            "pulumi config set servingEnabled false"
        )
    return pulumi.RunError(
        f"servingEnabled=true but no training run of recipe {cfg.recipe} has finished yet: no "
        f"gs://{bucket}/{layout.marker_glob}. Follow the current run with `{layout.follow}`, then run `pulumi up` "
        "again. To skip serving for now: pulumi config set servingEnabled false"
    )


def pinned(cfg: StackConfig, layout: ServedLayout, finished: list[str], rid: str, bucket: str, key: str) -> str:
    """`rid` if its export is listed complete, else the error naming the finished runs and the fix."""
    if rid in finished:
        return rid
    listed = ", ".join(reversed(finished)) or "none"
    raise pulumi.RunError(
        f"{key}={rid} has no complete model: gs://{bucket}/{layout.folder(rid)}/{layout.artefact}/{COMPLETION_MARKER} "
        f"is not there (the run has not finished, failed, or belongs to another recipe). Completed runs of "
        f"{cfg.recipe}: {listed}. Fix: pulumi config set {key} RUN_ID, or pulumi config rm {key}"
    )


def gated(cfg: StackConfig, finished: list[str], summaries: dict[str, str]) -> str:
    """The run the serving gate serves among `finished`; runs without a listed summary are not candidates."""
    evals = {rid: run_eval(text) for rid, text in summaries.items() if rid in finished}
    try:
        decision = gate(finished, evals, cfg.serving_max_eval_loss, cfg.serving_min_score)
    except ValueError as exc:
        raise pulumi.RunError(str(exc)) from None
    if decision.warning:
        pulumi.log.warn(decision.warning)
    if decision.note:
        pulumi.log.info(decision.note)
    return decision.served


def check_listed_export(
    cfg: StackConfig, layout: ServedLayout, rid: str, marker_text: str, listed: list[Any], bucket: str
) -> None:
    """serving/completion.py's inventory check against a listing of the run's export folder."""
    folder = f"{layout.folder(rid)}/{layout.artefact}/"
    where = f"gs://{bucket}/{folder.rstrip('/')}"
    kind = ADAPTER if layout.artefact is Artefact.ADAPTER else MODEL
    try:
        inventory = Inventory.from_marker(json.loads(marker_text or "null"), where)
        names = {_field(obj, "name")[len(folder) :]: None for obj in listed}
        check_inventory(inventory, names, where, kind)
    except (IncompleteModelError, ValueError) as exc:
        raise pulumi.RunError(
            f"the export of run {rid} is not servable: {exc}. Train again (change the recipe, or rerun the stack's "
            f"training), or pin another run with pulumi config set servingRunId RUN_ID"
        ) from None


@dataclass(frozen=True)
class AdapterFacts:
    """What serving needs from a listed adapter's adapter_config.json."""

    rank: int
    base: str


def adapter_facts(cfg: StackConfig, layout: ServedLayout, rid: str, text: str | None) -> AdapterFacts:
    """The rank and base of a run's adapter, or the error when vLLM could not load it on this stack's base."""
    where = f"{layout.folder(rid)}/adapter/adapter_config.json"
    try:
        config = json.loads(text or "null")
    except ValueError:
        config = None
    if not isinstance(config, dict) or not isinstance(config.get("r"), int):
        raise pulumi.RunError(f"{where} is missing or has no rank `r`: the adapter of run {rid} cannot be served")
    problems = []
    if config.get("modules_to_save"):
        problems.append(MERGE_REASONS["modules_to_save"].format(modules=", ".join(config["modules_to_save"])))
    if config.get("use_dora"):
        problems.append("it is a DoRA adapter ('vLLM does not yet support DoRA', vllm/lora/peft_helper.py)")
    base = str(config.get("base_model_name_or_path") or "")
    if base != layout.base_model:
        problems.append(f"it was trained on {base or 'an unnamed base'}, the service loads {layout.base_model}")
    if config["r"] > ALLOWED_LORA_RANKS[-1]:
        problems.append(f"its rank {config['r']} is above vLLM's largest --max-lora-rank {ALLOWED_LORA_RANKS[-1]}")
    if problems:
        raise pulumi.RunError(
            f"run {rid}'s adapter cannot be served on this stack's base: {'; '.join(problems)}. Fix: pin another "
            "run (pulumi config set servingRunId RUN_ID) or remove it from servingCompareRunIds"
        )
    return AdapterFacts(rank=int(config["r"]), base=base)


def check_shared_kv_value_lora(layout: ServedLayout, rid: str, marker_text: str, run: RunState | None) -> None:
    """Refuse an adapter on a base with shared keys and values (Gemma 4 31B) that was published without the v_proj
    LoRA vLLM reads there (trainer/export.py `add_shared_kv_value_lora`): served, its values would miss the k_proj
    LoRA the run trained on every full-attention layer."""
    shape = model_shape(layout.base_model, REPO_ROOT)
    if shape is None or not shape.k_eq_v:
        return
    marker = json.loads(marker_text or "null")
    if isinstance(marker, dict) and SHARED_KV_VALUE_LORA in marker:
        return
    again = (
        f"pulumi config set {RUN_GENERATION_KEY} {run.inputs['generation'] + 1} && pulumi up (one paid run)"
        if run
        else ("train again")
    )
    raise pulumi.RunError(
        f"run {rid}'s adapter was published before the trainer wrote the value LoRA vLLM needs on "
        f"{layout.base_model}'s shared-kv layers ({SHARED_KV_VALUE_LORA} is not in its {COMPLETION_MARKER}; "
        f"docs/serving.md, 'Adapters, not copies'): served, its values would miss the k_proj LoRA the run trained. "
        f"Fix: {again}, or pin another run with pulumi config set servingRunId RUN_ID"
    )


@dataclass(frozen=True)
class ServedRuns:
    """The runs the service loads: the gated (or pinned) one first, then the compared ones."""

    primary: str
    compared: tuple[str, ...] = ()
    ranks: dict[str, int] = field(default_factory=dict)

    @property
    def all(self) -> tuple[str, ...]:
        return (self.primary, *self.compared)


def served_runs(
    cfg: StackConfig, layout: ServedLayout, bucket: pulumi.Output[str], run: RunState | None = None
) -> pulumi.Output[ServedRuns]:
    """The runs to serve, each verified complete in the bucket, or a `pulumi.RunError` that says what to do (`run`:
    the stack's training run, named in the error when none is servable)."""
    markers = gcp.storage.get_bucket_objects_output(
        bucket=bucket, prefix=layout.listing_prefix, match_glob=layout.marker_glob
    ).bucket_objects
    # the gate reads the finished runs' summaries: listed first, since reading an object that is not there fails
    # the data source with a 404
    summaries = gcp.storage.get_bucket_objects_output(
        bucket=bucket, prefix=layout.listing_prefix, match_glob=layout.summary_glob
    ).bucket_objects

    def choose(parts: list[Any]) -> pulumi.Output[ServedRuns]:
        listing, bucket_name, listed_summaries = parts
        finished = finished_runs(layout, listing)
        if not finished:
            raise _no_run(cfg, layout, bucket_name, run)
        compared = tuple(
            pinned(cfg, layout, finished, rid, bucket_name, "servingCompareRunIds")
            for rid in cfg.serving_compare_run_ids
        )
        if cfg.serving_run_id is not None:
            return verify(
                pinned(cfg, layout, finished, cfg.serving_run_id, bucket_name, "servingRunId"), compared, bucket_name
            )
        names = {_field(obj, "name") for obj in listed_summaries}
        with_summary = [r for r in finished if f"{layout.folder(r)}/{RUN_SUMMARY}" in names]
        texts = [
            gcp.storage.get_bucket_object_content_output(
                bucket=bucket_name, name=f"{layout.folder(r)}/{RUN_SUMMARY}"
            ).content
            for r in with_summary
        ]

        def decide(read: list[str | None]) -> pulumi.Output[ServedRuns]:
            primary = gated(cfg, finished, dict(zip(with_summary, [t or "" for t in read], strict=True)))
            return verify(primary, compared, bucket_name)

        return pulumi.Output.all(*texts).apply(decide)

    def verify(primary: str, compared: tuple[str, ...], bucket_name: str) -> pulumi.Output[ServedRuns]:
        runs = (primary, *(r for r in compared if r != primary))
        checks: list[pulumi.Output[Any]] = []
        for rid in runs:
            folder = f"{layout.folder(rid)}/{layout.artefact}/"
            marker = gcp.storage.get_bucket_object_content_output(bucket=bucket_name, name=folder + COMPLETION_MARKER)
            files = gcp.storage.get_bucket_objects_output(bucket=bucket_name, prefix=folder).bucket_objects
            adapter_config: pulumi.Output[Any] = pulumi.Output.from_input(None)
            if layout.artefact is Artefact.ADAPTER:
                adapter_config = gcp.storage.get_bucket_object_content_output(
                    bucket=bucket_name, name=folder + "adapter_config.json"
                ).content
            checks.append(pulumi.Output.all(marker.content, files, adapter_config))
        base_listing: pulumi.Output[Any] = pulumi.Output.from_input([])
        if layout.artefact is Artefact.ADAPTER:
            base_listing = gcp.storage.get_bucket_objects_output(
                bucket=bucket_name, prefix=f"{layout.base_folder(primary)}/{BASE_MARKER}"
            ).bucket_objects

        def conclude(parts: list[Any]) -> ServedRuns:
            *per_run, base_objects = parts
            ranks = {}
            for rid, (marker_text, listed, config_text) in zip(runs, per_run, strict=True):
                check_listed_export(cfg, layout, rid, marker_text, listed, bucket_name)
                if layout.artefact is Artefact.ADAPTER:
                    ranks[rid] = adapter_facts(cfg, layout, rid, config_text).rank
                    check_shared_kv_value_lora(layout, rid, marker_text, run)
            if layout.artefact is Artefact.ADAPTER and not base_objects:
                raise pulumi.RunError(
                    f"run {primary} has no staged base: gs://{bucket_name}/{layout.base_folder(primary)}/{BASE_MARKER} "
                    "is not there (trainer/base_weights.py writes it when the run starts). The adapter's base is read "
                    "from the bucket, never the Hub. Fix: pin a run that staged it (pulumi config set servingRunId "
                    "RUN_ID), or train again"
                )
            return ServedRuns(primary=primary, compared=runs[1:], ranks=ranks)

        return pulumi.Output.all(*checks, base_listing).apply(conclude)

    return pulumi.Output.all(markers, bucket, summaries).apply(choose)


# --------------------------------------------------------------------------- the vLLM server's settings


def vllm_config(cfg: StackConfig, layout: ServedLayout, runs: ServedRuns, bucket: str) -> VllmServerConfig:
    """What `vllm serve` gets: the merged export over the mount, or the staged base from gs:// with each adapter."""
    common: dict[str, Any] = {
        "max_model_len": cfg.serving_max_model_len,
        "dtype": Dtype.BFLOAT16,
        "model_type": model_type_of(layout.base_model),
        "port": VLLM_PORT,
        "max_num_seqs": cfg.serving_max_concurrency,
        # the key (VLLM_API_KEY, see VllmService._envs) on every route but /health, not only vLLM's /v1 prefixes
        "api_key_guard": cfg.serving_api_key_set,
        "extra_args": cfg.serving_extra_args,
        "language_model_only": layout.language_model_only,
        # --enforce-eager (no compile, no CUDA graphs on a fresh instance): the start serving/startup.py estimates
        "enforce_eager": COLD_START_VLLM["enforce_eager"],
    }
    if layout.artefact is Artefact.MERGED:
        return VllmServerConfig(
            model=f"{MODEL_MOUNT}/{layout.folder(runs.primary)}/merged",
            served_model_name=cfg.recipe,
            safetensors_load_strategy=COLD_START_VLLM["safetensors_load_strategy"],
            **common,
        )
    adapters = {
        layout.adapter_name(cfg.recipe, rid, rid == runs.primary): f"{MODEL_MOUNT}/{layout.folder(rid)}/adapter"
        for rid in runs.all
    }
    return VllmServerConfig(
        model=f"gs://{bucket}/{layout.base_folder(runs.primary)}",
        served_model_name=f"{cfg.recipe}-base",
        load_format="runai_streamer",
        model_loader_extra_config=dict(STREAMER_CONFIG),
        lora_modules=adapters,
        max_lora_rank=lora_rank_for(max(runs.ranks.values())),
        max_loras=len(adapters),
        **common,
    )


# --------------------------------------------------------------------------- the service


class VllmService(pulumi.ComponentResource):
    """The vLLM Cloud Run GPU Service over the stack's served runs."""

    service: gcp.cloudrunv2.Service
    url: pulumi.Output[str]
    runs: pulumi.Output[ServedRuns]

    def __init__(
        self,
        name: str,
        cfg: StackConfig,
        foundation: Foundation,
        image: pulumi.Output[str],
        run: RunState | None = None,
        opts=None,
    ) -> None:
        super().__init__("gemma-finetune:gcp:VllmService", name, None, opts)
        assert foundation.serving_account is not None, "the foundation creates a serving account when serving is on"
        child = pulumi.ResourceOptions(parent=self)
        layout = served_layout(cfg)
        window = service_window(cfg)
        self.runs = served_runs(cfg, layout, foundation.bucket_name, run)
        vllm_args = pulumi.Output.all(self.runs, foundation.bucket_name).apply(
            lambda parts: render_args(vllm_config(cfg, layout, parts[0], parts[1]))
        )
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
                        envs=self._envs(cfg, foundation, window),
                        resources=gcp.cloudrunv2.ServiceTemplateContainerResourcesArgs(
                            limits=service_limits(cfg), cpu_idle=False, startup_cpu_boost=True
                        ),
                        # serving/startup.py fits the window to the served model's cold start (`window_for`)
                        startup_probe=gcp.cloudrunv2.ServiceTemplateContainerStartupProbeArgs(
                            initial_delay_seconds=window.initial_delay_s,
                            period_seconds=window.period_s,
                            timeout_seconds=window.timeout_s,
                            failure_threshold=window.failure_threshold,
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
                # A Service that references a secret fails to create without the accessor grant (terraform-provider-google
                # #13786, #13828): the key's grant is one of grants_to(SERVING).
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
        self.register_outputs({"url": self.url})

    @staticmethod
    def _envs(
        cfg: StackConfig, foundation: Foundation, window: StartupWindow
    ) -> list[gcp.cloudrunv2.ServiceTemplateContainerEnvArgs]:
        """The container's environment: fixed settings, the startup window, servingEnv, and the API key by reference."""
        env = gcp.cloudrunv2.ServiceTemplateContainerEnvArgs
        envs = [
            env(name="HF_HUB_OFFLINE", value="1"),
            env(name="GEMMA_FT_STARTUP_WINDOW_S", value=str(window.total_s)),
            env(name="GEMMA_FT_WAIT_FOR_MODEL_S", value=str(window.marker_wait_s)),
            env(name="GEMMA_FT_MAX_MARKER_WAIT_S", value=str(window.max_marker_wait_s)),
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


# A request each stack's model answers (the recipe's task), for the `query` output.
_SAMPLE_PROMPTS = {
    "emoji": "Translate to emoji: I ate a banana for breakfast, later I'm thinking of having soup!",
    "text-to-sql": "How many orders were placed in 2024? <SCHEMA>CREATE TABLE orders (id INT, placed_on DATE)</SCHEMA>",
}


def declare(
    cfg: StackConfig, foundation: Foundation, serving_image: pulumi.Output[str] | None, run: RunState | None = None
) -> dict[str, Any]:
    """The serving part of any stack: the service and its outputs, or the next step when serving is off (`run`: the
    stack's training run, `infra.run_identity.resolve`)."""
    if not cfg.serving_enabled:
        return {"nextStep": "when a training run has finished: pulumi config set servingEnabled true && pulumi up"}
    assert serving_image is not None, "the images component builds the serving image when serving is on"
    if cfg.serving_public and not cfg.serving_api_key_set:
        pulumi.log.warn(
            "servingPublic=true without servingApiKey: anyone with the URL can use this GPU service and bill "
            "up to servingMaxInstances instances; set one with `pulumi config set --secret servingApiKey …`"
        )
    name = f"gft-{cfg.stack}"
    layout = served_layout(cfg)
    service = VllmService(name, cfg, foundation, serving_image, run)
    names = service.runs.apply(
        lambda runs: (
            [layout.adapter_name(cfg.recipe, rid, rid == runs.primary) for rid in runs.all]
            if layout.artefact is Artefact.ADAPTER
            else [cfg.recipe]
        )
    )
    recipe = load_recipe(cfg.recipe_source, cfg.recipe_overrides)
    prompt = _SAMPLE_PROMPTS.get(str(recipe.data.task), "Hello")
    image = " --image PRODUCT.jpg" if not recipe.model.text_only else ""
    # the client waits the 270 s window plus one --timeout for a cold service: longer for a longer window
    window = service_window(cfg).total_s
    timeout = f" --timeout {window - STARTUP_WINDOW.total_s + 120}" if window > STARTUP_WINDOW.total_s else ""
    return {
        "servingUrl": service.url,
        "servingRunId": service.runs.apply(lambda runs: runs.primary),
        "servedModels": names,
        "servedArtefact": f"{layout.artefact}: {layout.why}",
        "servedModelUri": pulumi.Output.all(foundation.bucket_uri, service.runs).apply(
            lambda p: f"{p[0]}/{layout.folder(p[1].primary)}/{layout.artefact}"
        ),
        "query": service.url.apply(
            # GEMMA_FT_URL is the client's token allowlist: identity tokens go only to the stack's servingUrl
            lambda url: f'GEMMA_FT_URL={url} python -m serving.client --model {cfg.recipe}{timeout}{image} "{prompt}"'
        ),
    }
