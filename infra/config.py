"""One typed, validated stack configuration, read from `pulumi.Config`.

Every key the program reads is a field of `StackConfig`, spelled as in the stack file
(`gemma-finetune:gpuType` → `gpu_type`) and declared with its type, default and
description in `Pulumi.yaml` (a test keeps the two in step). Validation runs before any
resource is declared: a bad stack fails with every problem listed, each naming the key,
the value, what is allowed and the command that fixes it.

Decisions (docs/program.md#one-typed-configuration-checked-first)
- Keys are flat (Pulumi's project config types no maps): labels are arrays of `key=value`. Defaults that
  depend on the workload (GPU type, GPUs per node, timeouts) are computed here, not in `Pulumi.yaml`.
- The recipe must be sized for the ranks the stack starts (nodes x gpusPerNode) and its run must fit the
  stack's GPUs (trainer/memory_plan.py); each failure lists the settings that fix it (the recipeOverrides
  that re-size it, `memory_fixes`).
- The Hugging Face token never enters this model, only whether it is set: it stays a secret Output (`load`).
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import pulumi
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from infra.catalog import CLOUD_RUN_GPUS, GKE_ACCELERATORS, TRAINING_GPU
from serving.vllm_args import SERVED_MAX_MODEL_LEN, VLLM_IMAGE, cuda12_variant, extra_arg_problem, image_cuda
from trainer.memory_plan import GPUS
from trainer.ray_entry import RAY_VERSION
from trainer.recipe import (
    REPO_ROOT,
    MemoryVerdict,
    Recipe,
    RecipeError,
    list_recipes,
    load_recipe,
    memory_verdict,
    parse_recipe,
    world_size_problem,
)

PROJECT_NAMESPACE = "gemma-finetune"


class ConfigError(pulumi.RunError):
    """Bad stack configuration; raised before any resource is declared."""


class Workload(StrEnum):
    GKE_JOB = "gke-job"
    GKE_RAY = "gke-ray"
    CLOUD_RUN = "cloud-run"


class Capacity(StrEnum):
    ON_DEMAND = "on-demand"
    SPOT = "spot"
    FLEX_START = "flex-start"
    RESERVATION = "reservation"


class ImageBuild(StrEnum):
    DOCKER = "docker"
    CLOUD_BUILD = "cloud-build"
    PREBUILT = "prebuilt"


class RayClusterMode(StrEnum):
    EPHEMERAL = "ephemeral"
    STANDING = "standing"


class PreflightMode(StrEnum):
    """What the checks that ask the cloud (reservation, GPU quota; `infra.preflight`) do with a problem."""

    STRICT = "strict"
    WARN = "warn"
    OFF = "off"


_LABEL_KEY = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")
_DIGEST_REF = re.compile(r"^[a-z0-9.-]+(:\d+)?/[^@\s]+@sha256:[0-9a-f]{64}$")
_STACK_NAME = re.compile(r"^[a-z][a-z0-9-]{0,19}$")
_NAMESPACE = re.compile(r"^(?=.{1,63}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_BILLING_ACCOUNT = re.compile(r"^[0-9A-F]{6}-[0-9A-F]{6}-[0-9A-F]{6}$")
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
# A budget sends to at most 5 Monitoring notification channels (Budget allUpdatesRule, pulumi-gcp 10.2 docs).
MAX_BUDGET_EMAILS = 5
_RUN_ID = re.compile(r"^(?:[0-9a-f]{12}|[0-9a-f]{8})$")
_IMAGE_REF = re.compile(
    r"^[a-z0-9][a-z0-9._/-]*(:\d+/[a-z0-9._/-]+)?(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}|@sha256:[0-9a-f]{64})$"
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Set by the program itself, or reserved by Cloud Run (container contract: PORT, K_SERVICE, K_REVISION, K_CONFIGURATION).
# Each with what sets it instead (for the refusal message).
_STARTUP_ENV = (
    "serving/startup.py (the startup window; the marker wait is 0 and not a stack setting: `pulumi up` serves "
    "only a run whose completion marker it has listed)"
)
RESERVED_SERVING_ENV: dict[str, str] = {
    "PORT": "Cloud Run",
    "K_SERVICE": "Cloud Run",
    "K_REVISION": "Cloud Run",
    "K_CONFIGURATION": "Cloud Run",
    "HF_HUB_OFFLINE": "the program (weights come from the bucket, never the Hub)",
    "VLLM_API_KEY": "servingApiKey (pulumi config set --secret servingApiKey KEY)",
    "GEMMA_FT_WAIT_FOR_MODEL_S": _STARTUP_ENV,
    "GEMMA_FT_STARTUP_WINDOW_S": _STARTUP_ENV,
    "GEMMA_FT_MAX_MARKER_WAIT_S": _STARTUP_ENV,
    "GEMMA_FT_SKIP_MODEL_CHECK": "nobody: the served model is always checked",
    "LD_LIBRARY_PATH": "the image (vLLM's Dockerfile sets LD_LIBRARY_PATH=/usr/local/cuda/lib64:…, which a value here "
    "would replace). For CUDA forward compatibility set VLLM_ENABLE_CUDA_COMPATIBILITY=1 instead: from v0.28 vLLM "
    "puts the image's compat libraries first itself, before torch loads (vllm/env_override.py, vllm PR #33992)",
}
# vLLM switches that add routes every caller of the service could use (vLLM v0.28.0): refused in servingEnv.
UNSAFE_SERVING_ENV: dict[str, str] = {
    "VLLM_SERVER_DEV_MODE": "it adds vLLM's development routes (register_vllm_dev_api_routers in "
    "vllm/entrypoints/serve/__init__.py: /collective_rpc, which calls any method on the engine's workers, "
    "/sleep, /wake_up, /pause, /reset_prefix_cache, /server_info; vLLM logs 'This should NOT be used in production')",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "it adds /v1/load_lora_adapter and /v1/unload_lora_adapter "
    "(vllm/entrypoints/serve/lora/api_router.py: 'This should ONLY be used for local development'), with which a "
    "caller loads weights from any path the container can read and serves them under a name of its choosing",
}
_SECRET_LIKE = re.compile(r"TOKEN|SECRET|PASSWORD|API_KEY|CREDENTIAL", re.IGNORECASE)
# vLLM's default max_num_seqs for the OpenAI server: 256 on GPUs under 70 GiB, 1024 above
# (EngineArgs.get_batch_defaults, vllm/engine/arg_utils.py); Cloud Run allows at most 1000 concurrent requests.
DEFAULT_SERVING_CONCURRENCY = {"nvidia-l4": 256, "nvidia-rtx-pro-6000": 1000}


def _set(key: str, value: object = "VALUE", secret: bool = False) -> str:
    """The command that sets a key, for error messages."""
    flag = "--secret " if secret else ""
    shown = json.dumps(value) if not isinstance(value, str) else value
    return f"pulumi config set {flag}{key} {shown}"


class StackConfig(BaseModel):
    """Everything a stack decides. Field aliases are the keys of `Pulumi.<stack>.yaml`."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    stack: str = Field(description="the Pulumi stack name; part of every resource name")
    project: str = Field(alias="gcp:project", description="Google Cloud project id")
    region: str = Field(alias="gcp:region", description="region for the cluster, bucket, registry and Cloud Run")

    workload: Workload = Field(description="gke-job | gke-ray | cloud-run")
    recipe: str = Field(
        description="a recipe under trainer/recipes/ (file stem), or a repository-relative recipe file "
        "(path/to/recipe.yaml: after validation `recipe` is its stem and `recipe_file` the path)"
    )
    recipe_overrides: list[str] = Field(default_factory=list, alias="recipeOverrides")
    run_generation: int = Field(
        0,
        alias="runGeneration",
        ge=0,
        description="raise it to train the same recipe, data and overrides again (infra/run_identity.py)",
    )

    gpu_type: str | None = Field(None, alias="gpuType")
    gpus_per_node: int | None = Field(None, alias="gpusPerNode", gt=0)
    nodes: int = Field(1, gt=0, le=64)
    capacity: Capacity = Capacity.ON_DEMAND
    reservation_name: str | None = Field(None, alias="reservationName")
    reservation_project: str | None = Field(None, alias="reservationProject")

    hf_token_set: bool = Field(False, description="whether gemma-finetune:hfToken is set (the value stays secret)")

    serving_enabled: bool = Field(False, alias="servingEnabled")
    serving_gpu_type: str = Field(
        "",
        alias="servingGpuType",
        description="the service's Cloud Run GPU; unset: the one with the least memory that holds the served model",
    )
    serving_public: bool = Field(False, alias="servingPublic")
    serving_invokers: list[str] = Field(default_factory=list, alias="servingInvokers")
    serving_max_instances: int = Field(1, alias="servingMaxInstances", gt=0, le=10)
    serving_max_model_len: int = Field(SERVED_MAX_MODEL_LEN, alias="servingMaxModelLen", gt=0)
    serving_extra_args: list[str] = Field(default_factory=list, alias="servingExtraArgs")
    serving_run_id: str | None = Field(None, alias="servingRunId")
    serving_compare_run_ids: list[str] = Field(default_factory=list, alias="servingCompareRunIds", max_length=3)
    serving_max_eval_loss: float | None = Field(None, alias="servingMaxEvalLoss", gt=0)
    serving_min_score: float | None = Field(None, alias="servingMinScore")
    serving_vllm_image: str = Field(VLLM_IMAGE, alias="servingVllmImage")
    serving_env: list[str] = Field(default_factory=list, alias="servingEnv")
    serving_concurrency: int | None = Field(None, alias="servingConcurrency", gt=0, le=1000)
    serving_api_key_set: bool = Field(False, description="whether gemma-finetune:servingApiKey is set (stays secret)")

    image_build: ImageBuild = Field(ImageBuild.DOCKER, alias="imageBuild")
    trainer_image: str | None = Field(None, alias="trainerImage")
    serving_image: str | None = Field(None, alias="servingImage")

    labels: list[str] = Field(default_factory=list)
    bucket_force_destroy: bool = Field(False, alias="bucketForceDestroy")
    bucket_soft_delete_days: int = Field(0, alias="bucketSoftDeleteDays")
    deletion_protection: bool = Field(False, alias="deletionProtection")
    release_channel: str = Field("REGULAR", alias="releaseChannel")
    namespace: str = Field(
        "",
        description="Kubernetes namespace of the GKE workload; default gft-<stack>: the Workload Identity principal "
        "PROJECT.svc.id.goog[NAMESPACE/KSA] is one per project, whatever the cluster, so each stack needs its own",
    )
    ray_cluster: RayClusterMode = Field(RayClusterMode.EPHEMERAL, alias="rayCluster")
    ray_version: str = Field(RAY_VERSION, alias="rayVersion")
    training_timeout_minutes: int | None = Field(None, alias="trainingTimeoutMinutes", gt=0)
    training_retries: int = Field(2, alias="trainingRetries", ge=0, le=10)
    gpu_zonal_redundancy: bool = Field(False, alias="gpuZonalRedundancy")

    preflight: PreflightMode = PreflightMode.STRICT
    max_run_cost_usd: int | None = Field(None, alias="maxRunCostUsd", gt=0)
    training_hour_price_usd: float | None = Field(None, alias="trainingHourPriceUsd", gt=0)
    serving_hour_price_usd: float | None = Field(None, alias="servingHourPriceUsd", gt=0)
    billing_account: str | None = Field(None, alias="billingAccount")
    budget_usd: int | None = Field(None, alias="budgetUsd", gt=0)
    budget_emails: list[str] = Field(default_factory=list, alias="budgetEmails")
    alert_emails: list[str] = Field(default_factory=list, alias="alertEmails")
    alert_stall_minutes: int = Field(15, alias="alertStallMinutes", ge=5, le=1440)
    alert_run_minutes: int | None = Field(None, alias="alertRunMinutes", gt=0)

    @model_validator(mode="before")
    @classmethod
    def _namespace_per_stack(cls, data: Any) -> Any:
        """No namespace set: `gft-<stack>`. Workload Identity names a pod's principal by namespace and Kubernetes
        service account only, in one pool per project (GKE docs, 'About Workload Identity Federation for GKE': identity
        sameness), so two stacks sharing a namespace could each act as the other's trainer account."""
        if isinstance(data, dict) and not data.get("namespace") and isinstance(data.get("stack"), str):
            return {**data, "namespace": f"gft-{data['stack']}"}
        return data

    # --- single-field checks ---------------------------------------------------------

    @field_validator("namespace")
    @classmethod
    def _namespace_name(cls, v: str) -> str:
        if not _NAMESPACE.match(v):
            raise ValueError(
                f"namespace={v!r} is not a Kubernetes namespace name: 1-63 lowercase letters, digits or '-', starting "
                f"and ending with a letter or digit. Fix: {_set('namespace', 'gft-STACK')} (or leave it unset: "
                "gft-<stack>, one Workload Identity principal per stack)"
            )
        return v

    @field_validator("stack")
    @classmethod
    def _stack_name(cls, v: str) -> str:
        if not _STACK_NAME.match(v):
            raise ValueError(
                f"stack name {v!r} must be 1-20 lowercase letters, digits or '-', starting with a letter "
                "(it prefixes service account ids, which are at most 30 characters)"
            )
        return v

    _recipe_file: str | None = PrivateAttr(None)

    @property
    def recipe_file(self) -> str | None:
        """The user's recipe file, relative to the repository root (`pulumi config set recipe PATH`), or None."""
        return self._recipe_file

    @property
    def recipe_source(self) -> str:
        """What `load_recipe` / `recipe_sha256` read: the recipe file (absolute) or the shipped name."""
        return str(REPO_ROOT / self._recipe_file) if self._recipe_file else self.recipe

    @model_validator(mode="wrap")
    @classmethod
    def _recipe_file_to_name(cls, data: Any, handler: Any) -> StackConfig:
        """A recipe file becomes its stem in `recipe` (run names, GCS prefixes, labels, the served model name)
        and travels as `trainer/recipes/<stem>.yaml` in the trainer image (infra/images.py `trainer_spec`)."""
        cfg = handler(data)
        if not cfg.recipe.endswith(RECIPE_FILE_SUFFIXES):
            return cfg
        named = cfg.model_copy(update={"recipe": Path(cfg.recipe).stem})
        named._recipe_file = Path(cfg.recipe).as_posix()
        return named

    @field_validator("recipe")
    @classmethod
    def _recipe_exists(cls, v: str) -> str:
        if v.endswith(RECIPE_FILE_SUFFIXES):
            problem = recipe_file_problem(v)
            if problem:
                raise ValueError(problem)
            return v
        if v not in list_recipes():
            close = difflib.get_close_matches(v, list_recipes(), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"recipe={v!r} is not a file under trainer/recipes/. Allowed: {', '.join(list_recipes())}.{hint} "
                f"Fix: {_set('recipe', close[0] if close else 'emoji-gemma3-1b')}"
            )
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: list[str]) -> list[str]:
        for item in v:
            key, sep, value = item.partition("=")
            if not sep or not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value):
                raise ValueError(
                    f"labels entry {item!r} must be key=value with lowercase letters, digits, '_' or '-' "
                    "(key starts with a letter, each at most 63 characters), e.g. team=ml-platform"
                )
        return v

    @field_validator("serving_invokers")
    @classmethod
    def _invokers(cls, v: list[str]) -> list[str]:
        for member in v:
            if member in {"allUsers", "allAuthenticatedUsers"}:
                raise ValueError(
                    f"servingInvokers contains {member!r}: a public endpoint is chosen with servingPublic=true, "
                    "never through the invoker list"
                )
            if not re.match(r"^(user|serviceAccount|group|domain|principal|principalSet):.+", member):
                raise ValueError(
                    f"servingInvokers entry {member!r} is not an IAM member; use user:alice@example.com, "
                    "serviceAccount:ci@PROJECT.iam.gserviceaccount.com, group:… or domain:…"
                )
        return v

    @field_validator("trainer_image", "serving_image")
    @classmethod
    def _digest(cls, v: str | None) -> str | None:
        if v is not None and not _DIGEST_REF.match(v):
            raise ValueError(
                f"image {v!r} is not pinned by digest; give REGISTRY/PATH@sha256:<64 hex> "
                "(find it with `gcloud artifacts docker images describe IMAGE:TAG --format='value(image_summary.digest)'`)"
            )
        return v

    @field_validator("bucket_soft_delete_days")
    @classmethod
    def _soft_delete_days(cls, v: int) -> int:
        if v != 0 and not 7 <= v <= 90:
            raise ValueError(
                f"bucketSoftDeleteDays={v} is not 0 (soft delete off) or 7 to 90 days, the retention Cloud Storage "
                f"allows. Fix: {_set('bucketSoftDeleteDays', '7')}, or pulumi config rm bucketSoftDeleteDays (off)"
            )
        return v

    @field_validator("billing_account")
    @classmethod
    def _billing_account(cls, v: str | None) -> str | None:
        if v is not None and not _BILLING_ACCOUNT.match(v):
            raise ValueError(
                f"billingAccount={v!r} is not a billing account id (XXXXXX-XXXXXX-XXXXXX, digits and A-F). "
                "Find it with `gcloud billing accounts list` or `gcloud billing projects describe PROJECT`, then "
                f"{_set('billingAccount', '012345-6789AB-CDEF01')}"
            )
        return v

    @field_validator("budget_emails")
    @classmethod
    def _budget_emails(cls, v: list[str]) -> list[str]:
        bad = [e for e in v if not _EMAIL.match(e)]
        if bad:
            raise ValueError(f"budgetEmails entries {bad} are not email addresses, e.g. alice@example.com")
        if len(v) > MAX_BUDGET_EMAILS:
            raise ValueError(
                f"budgetEmails has {len(v)} addresses; a budget notifies at most {MAX_BUDGET_EMAILS} channels. "
                "Use a group address for more people"
            )
        return v

    @field_validator("alert_emails")
    @classmethod
    def _alert_emails(cls, v: list[str]) -> list[str]:
        bad = [e for e in v if not _EMAIL.match(e)]
        if bad:
            raise ValueError(
                f"alertEmails entries {bad} are not email addresses. "
                "Fix: pulumi config set --path 'alertEmails[0]' oncall@example.com"
            )
        return v

    @field_validator("serving_run_id")
    @classmethod
    def _run_id(cls, v: str | None) -> str | None:
        if v is not None and not _RUN_ID.match(v):
            raise ValueError(
                f"servingRunId={v!r} is not a run id (12 lowercase hex characters on cloud-run, the runId output of "
                "a training run; 8 on GKE, the end of its run folder runs/<job name>). List completed runs with "
                "`gcloud storage ls 'gs://BUCKET/runs/*/*/_COMPLETE.json'`. Fix: pulumi config set servingRunId "
                "0123456789ab, or pulumi config rm servingRunId to serve the run the serving gate picks"
            )
        return v

    @field_validator("serving_compare_run_ids")
    @classmethod
    def _compare_run_ids(cls, v: list[str]) -> list[str]:
        bad = [rid for rid in v if not _RUN_ID.match(rid)]
        if bad or len(set(v)) != len(v):
            raise ValueError(
                f"servingCompareRunIds={v!r}: each entry a run id (12 hex characters on cloud-run, 8 on GKE), each "
                "once. Fix: pulumi config set --path 'servingCompareRunIds[0]' RUN_ID"
            )
        return v

    @field_validator("serving_min_score")
    @classmethod
    def _min_score(cls, v: float | None) -> float | None:
        if v is not None and not 0 <= v <= 1:
            raise ValueError(
                f"servingMinScore={v!r} is not a score: the serving gate compares a run's score (emoji_f1, "
                "execution_match or ROUGE-L F1 in its run_summary.json eval), a number from 0 to 1. "
                f"Fix: {_set('servingMinScore', '0.5')}, or pulumi config rm servingMinScore (serve a run when it is "
                "not worse than the served one)"
            )
        return v

    @field_validator("serving_vllm_image")
    @classmethod
    def _vllm_image(cls, v: str) -> str:
        if not _IMAGE_REF.match(v) or v.endswith(":latest"):
            raise ValueError(
                f"servingVllmImage={v!r} must be an image with an exact tag or digest (never latest), e.g. "
                f"{VLLM_IMAGE} or vllm/vllm-openai@sha256:<64 hex> (find it with `docker buildx imagetools "
                f"inspect {VLLM_IMAGE}`). Fix: {_set('servingVllmImage', VLLM_IMAGE)}"
            )
        return v

    @field_validator("serving_extra_args")
    @classmethod
    def _serving_extra_args(cls, v: list[str]) -> list[str]:
        for i, arg in enumerate(v):
            problem = extra_arg_problem(arg)  # the one rule serving/vllm_args.py applies; never repeats a value
            if problem is not None:
                raise ValueError(
                    f"servingExtraArgs[{i}] is vLLM's {problem}. Allowed there: flags without credentials that the "
                    f"stack does not set (a prefix of one counts as that flag); a credential already in this stack's "
                    f"config file is plain text there: rotate it. "
                    f"Fix: pulumi config rm --path 'servingExtraArgs[{i}]' (and its value, if it is the next entry)"
                )
        return v

    @field_validator("serving_env")
    @classmethod
    def _serving_env(cls, v: list[str]) -> list[str]:
        names: set[str] = set()
        for item in v:
            name, sep, _ = item.partition("=")
            if not sep or not _ENV_NAME.match(name):
                raise ValueError(f"servingEnv entry {item!r} must be NAME=value, e.g. VLLM_LOGGING_LEVEL=DEBUG")
            if name in RESERVED_SERVING_ENV:
                raise ValueError(
                    f"servingEnv sets {name}, which the program or Cloud Run sets itself; it comes from "
                    f"{RESERVED_SERVING_ENV[name]}. Fix: remove it from servingEnv"
                )
            if name in UNSAFE_SERVING_ENV:
                raise ValueError(
                    f"servingEnv sets {name}: {UNSAFE_SERVING_ENV[name]}; every invoker of the service could call "
                    f"them. Fix: pulumi config rm --path 'servingEnv[{v.index(item)}]' (try it on a local vLLM instead)"
                )
            if _SECRET_LIKE.search(name):
                raise ValueError(
                    f"servingEnv sets {name}: values there are plain text in the stack's state and the revision; "
                    "secrets belong in Secret Manager (servingApiKey for vLLM's API key)"
                )
            if name in names:
                raise ValueError(f"servingEnv sets {name} twice")
            names.add(name)
        return v

    @field_validator("release_channel")
    @classmethod
    def _channel(cls, v: str) -> str:
        if v not in {"RAPID", "REGULAR", "STABLE", "EXTENDED"}:
            raise ValueError(f"releaseChannel={v!r}: use RAPID, REGULAR, STABLE or EXTENDED")
        return v

    # --- cross-field checks ----------------------------------------------------------

    @model_validator(mode="after")
    def _cross_checks(self) -> StackConfig:
        problems: list[str] = []
        if self.workload is Workload.CLOUD_RUN:
            problems += self._check_cloud_run()
        else:
            problems += self._check_gke()
        if self.image_build is ImageBuild.PREBUILT:
            missing = [
                k for k, v in (("trainerImage", self.trainer_image), ("servingImage", self.serving_image)) if not v
            ]
            if not self.serving_enabled:
                missing = [k for k in missing if k != "servingImage"]
            if self.recipe_file or self.recipe.endswith(RECIPE_FILE_SUFFIXES):  # after or before the renaming
                problems.append(
                    f"recipe={self.recipe_file or self.recipe!r} is a recipe file, which only an image this stack builds carries "
                    f"(infra/images.py trainer_spec). Fix: {_set('imageBuild', 'cloud-build')}, or a shipped recipe"
                )
            if missing:
                problems.append(
                    f"imageBuild=prebuilt needs {', '.join(missing)} (an image pinned by digest). "
                    f"Fix: {_set(missing[0], 'REGION-docker.pkg.dev/PROJECT/REPO/NAME@sha256:…')}, "
                    "or use imageBuild=docker / cloud-build"
                )
        problems += self._check_serving_keys()
        problems += self._check_budget()
        problems += self._check_alerts()
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _check_budget(self) -> list[str]:
        if (self.billing_account is None) != (self.budget_usd is None):
            given, missing = (
                ("billingAccount", "budgetUsd") if self.billing_account else ("budgetUsd", "billingAccount")
            )
            return [
                f"{given} is set but {missing} is not: a budget needs both. "
                f"Fix: {_set(missing, 500 if missing == 'budgetUsd' else '012345-6789AB-CDEF01')}, or "
                f"pulumi config rm {given}"
            ]
        if self.budget_emails and self.budget_usd is None:
            return [
                "budgetEmails is set but no budget is (billingAccount + budgetUsd). "
                f"Fix: {_set('budgetUsd', 500)} and {_set('billingAccount', '012345-6789AB-CDEF01')}"
            ]
        return []

    def _check_alerts(self) -> list[str]:
        """An alert after the training deadline would never fire: the deadline stops the run first."""
        deadline = self.timeout_minutes
        return [
            f"{key}={minutes} is not below the training deadline ({deadline} min, trainingTimeoutMinutes): the "
            f"deadline stops the run before it alerts. Fix: {_set(key, fix)}"
            for key, minutes, fix in (
                ("alertStallMinutes", self.alert_stall_minutes, min(15, deadline - 1)),
                ("alertRunMinutes", self.alert_run_minutes, deadline * 3 // 4),
            )
            if minutes is not None and minutes >= deadline
        ]

    def _check_cloud_run(self) -> list[str]:
        problems = []
        gpu = self.gpu_type
        if gpu not in CLOUD_RUN_GPUS:
            problems.append(
                f"gpuType={gpu!r} is not offered by Cloud Run (workload cloud-run). Cloud Run offers: "
                f"{', '.join(CLOUD_RUN_GPUS)}. Fix: {_set('gpuType', 'nvidia-l4')}, or use workload gke-job for "
                "A4/B200-class GPUs"
            )
        else:
            regions = CLOUD_RUN_GPUS[gpu].regions
            if self.region not in regions:
                problems.append(
                    f"gcp:region={self.region!r} has no Cloud Run {gpu} GPUs. Regions with them: {', '.join(regions)}. "
                    f"Fix: {_set('gcp:region', regions[0])}"
                )
        if self.gpus_per_node != 1:
            problems.append(
                f"gpusPerNode={self.gpus_per_node} but Cloud Run attaches exactly one GPU per instance. "
                f"Fix: {_set('gpusPerNode', 1)}"
            )
        if self.nodes != 1:
            problems.append(f"nodes={self.nodes}: a Cloud Run training job runs one task. Fix: {_set('nodes', 1)}")
        if self.capacity is not Capacity.ON_DEMAND:
            problems.append(
                f"capacity={self.capacity} does not apply to Cloud Run (GPU quota is per region). "
                f"Fix: pulumi config rm capacity"
            )
        return problems

    def _check_serving_keys(self) -> list[str]:
        """The serving keys that need no recipe (the GPU's fit and the image's CUDA are `serving_problems`)."""
        problems = []
        if self.serving_gpu_type and self.serving_gpu_type not in CLOUD_RUN_GPUS:
            problems.append(
                f"servingGpuType={self.serving_gpu_type!r} is not offered by Cloud Run, which serves every stack. "
                f"Cloud Run offers: {', '.join(CLOUD_RUN_GPUS)}. Fix: {_set('servingGpuType', 'nvidia-l4')}, or "
                "pulumi config rm servingGpuType (the smallest GPU the served model fits)"
            )
        if self.serving_enabled and self.serving_gpu_type in CLOUD_RUN_GPUS:
            regions = CLOUD_RUN_GPUS[self.serving_gpu_type].regions
            if self.region not in regions:
                problems.append(
                    f"gcp:region={self.region!r} has no Cloud Run {self.serving_gpu_type} GPUs for the vLLM service. "
                    f"Regions with them: {', '.join(regions)}. Fix: {_set('gcp:region', regions[0])}, or another "
                    "servingGpuType"
                )
        length = 12 if self.workload is Workload.CLOUD_RUN else 8
        ids = [*([self.serving_run_id] if self.serving_run_id else []), *self.serving_compare_run_ids]
        wrong = [rid for rid in ids if len(rid) != length]
        if wrong:
            problems.append(
                f"servingRunId / servingCompareRunIds {wrong}: a run id of workload {self.workload} has {length} hex "
                f"characters ({'the runId output' if length == 12 else 'the end of the run folder runs/<job name>'}). "
                "Fix: pulumi config set servingRunId RUN_ID"
            )
        return problems

    def _check_gke(self) -> list[str]:
        problems = []
        acc = GKE_ACCELERATORS.get(self.gpu_type or "")
        if acc is None:
            problems.append(
                f"gpuType={self.gpu_type!r} is not a GKE Autopilot accelerator. Allowed: {', '.join(GKE_ACCELERATORS)}. "
                f"Fix: {_set('gpuType', 'nvidia-b200')}"
            )
        elif self.gpus_per_node not in acc.counts:
            problems.append(
                f"gpusPerNode={self.gpus_per_node} is not a machine shape for {acc.value} ({acc.machine}); "
                f"allowed counts: {', '.join(map(str, acc.counts))}. Fix: {_set('gpusPerNode', acc.counts[-1])}"
            )
        if self.capacity is Capacity.RESERVATION and not self.reservation_name:
            problems.append(
                "capacity=reservation needs reservationName (GKE Autopilot consumes specific reservations only). "
                "Find it with `gcloud compute reservations list --project PROJECT`. "
                f"Fix: {_set('reservationName', 'my-a4-reservation')}, or choose capacity spot | flex-start | on-demand"
            )
        if self.capacity is not Capacity.RESERVATION and self.reservation_name:
            problems.append(
                f"reservationName={self.reservation_name!r} is set but capacity={self.capacity}; "
                f"Fix: {_set('capacity', 'reservation')} or pulumi config rm reservationName"
            )
        return problems

    # --- derived values --------------------------------------------------------------

    @property
    def total_gpus(self) -> int:
        return (self.gpus_per_node or 1) * self.nodes

    @property
    def resource_labels(self) -> dict[str, str]:
        """Labels on every labelled resource: cost attribution by app, stack and workload."""
        labels = {"app": "gemma-finetune", "stack": self.stack, "workload": str(self.workload)}
        labels.update(dict(item.split("=", 1) for item in self.labels))
        return labels

    @property
    def serving_max_concurrency(self) -> int:
        """Requests Cloud Run sends one vLLM instance at once = the sequences vLLM batches (`--max-num-seqs`)."""
        return self.serving_concurrency or DEFAULT_SERVING_CONCURRENCY.get(self.serving_gpu_type, 256)

    @property
    def timeout_minutes(self) -> int:
        if self.training_timeout_minutes:
            return self.training_timeout_minutes
        return {Workload.GKE_JOB: 8 * 60, Workload.GKE_RAY: 4 * 60, Workload.CLOUD_RUN: 60}[self.workload]


_WORKLOAD_DEFAULTS: dict[str, dict[str, Any]] = {
    Workload.GKE_JOB: {"gpuType": "nvidia-b200", "gpusPerNode": 8},
    Workload.GKE_RAY: {"gpuType": "nvidia-b200", "gpusPerNode": 8},
    Workload.CLOUD_RUN: {"gpuType": "nvidia-l4", "gpusPerNode": 1},
}

RECIPE_FILE_SUFFIXES = (".yaml", ".yml")
_RECIPE_STEM = re.compile(r"^[a-z][a-z0-9-]{0,39}$")  # a GCS prefix, a Kubernetes name part and label value


def recipe_file_problem(value: str) -> str | None:
    """Why `recipe=PATH` cannot run in a stack, or None. The file must lie in this repository, named by a path
    relative to its root (the image carries it and the run id hashes it: the same from any checkout), with a
    stem that can name runs, and every local file its data needs under trainer/ (the image's build context)."""
    fix = _set("recipe", "path/to/recipe.yaml") + " (a path relative to the repository root)"
    path = Path(value)
    full = (REPO_ROOT / path).resolve()
    if path.is_absolute() or not full.is_relative_to(REPO_ROOT.resolve()):
        return f"recipe={value!r} is not inside this repository: the trainer image carries repository files only. Fix: {fix}"
    if not full.is_file():
        return f"recipe={value!r}: no such file under the repository root {REPO_ROOT}. Fix: {fix}"
    if not _RECIPE_STEM.match(path.stem):
        return (
            f"recipe={value!r}: the file name {path.stem!r} names the runs (bucket prefixes, Kubernetes names), so it "
            "must be 1-40 lowercase letters, digits or '-', starting with a letter. Fix: rename the file"
        )
    shipped = REPO_ROOT / "trainer" / "recipes" / f"{path.stem}.yaml"
    if path.stem in list_recipes() and full != shipped.resolve():
        return f"recipe={value!r} has the name of the shipped recipe {path.stem!r}. Fix: rename the file"
    try:
        outside = _data_outside_image(parse_recipe(str(full)))
    except RecipeError as exc:
        return f"recipe={value!r}: {exc}"
    if outside:
        return f"recipe={value!r} reads {outside}"
    return None


def _data_outside_image(recipe: Recipe) -> str | None:
    """The local files the recipe's data reads outside trainer/ (the trainer image's build context), with the fix;
    None when every one travels in the image. RecipeError when a local file is missing."""
    trainer_dir = (REPO_ROOT / "trainer").resolve()
    outside = [str(f) for f in recipe.data.repository_files() if not f.resolve().is_relative_to(trainer_dir)]
    if not outside:
        return None
    return (
        f"{', '.join(outside)}, outside trainer/: the trainer image carries trainer/ only. "
        "Fix: move the data under trainer/samples/ (and point data.path, data.sources or data.eval_path there), or "
        "upload it to a bucket (data.path: gs://BUCKET/PREFIX/*.jsonl with data.rows)"
    )


def _override_data_problem(cfg: StackConfig) -> str | None:
    """`recipe_file_problem` for the data the overrides name: a file outside trainer/ plans, then stops the job."""
    if not cfg.recipe_overrides:
        return None
    try:
        outside = _data_outside_image(parse_recipe(cfg.recipe_source, cfg.recipe_overrides))
    except RecipeError:
        return None  # _hf_token_problem reports it
    return f"recipeOverrides make recipe {cfg.recipe!r} read {outside}" if outside else None


def _url_rows_problem(cfg: StackConfig) -> str | None:
    """Data behind a URL needs `data.rows`: without it the recipe counts the rows through fsspec at load, which the
    program cannot do (no gcsfs, no read grant for whoever previews)."""
    try:
        data = parse_recipe(cfg.recipe_source, cfg.recipe_overrides).data
    except RecipeError:
        return None  # _hf_token_problem reports it
    buckets = sorted({bucket for bucket, _ in data.gcs_read_scopes})
    if len(buckets) > 1:
        return (
            f"recipe {cfg.recipe!r} reads data from {len(buckets)} buckets ({', '.join(buckets)}): a stack grants "
            "the trainer read access on one (infra/data_access.py). Fix: keep data.path, every data.sources path, "
            "data.eval_path and data.image_dir in one bucket"
        )
    if data.undeclared_urls:
        key, url = data.undeclared_urls[0]
        return (
            f"recipe {cfg.recipe!r} reads {url} without {key}: a stack plans the optimizer steps "
            f"before the bucket can be read. Fix: {key}: N in the recipe (the row count of the files), or "
            f"`pulumi config set --path 'recipeOverrides[{len(cfg.recipe_overrides)}]' {key}=N`"
        )
    return None


_LIST_FIELDS = {
    "recipeOverrides",
    "servingInvokers",
    "servingExtraArgs",
    "servingEnv",
    "servingCompareRunIds",
    "labels",
    "budgetEmails",
    "alertEmails",
}
_SECRET_KEYS = {"hfToken": "hf_token", "servingApiKey": "serving_api_key"}


# servingApiKey: what every client can send in `Authorization: Bearer KEY` and vLLM compares exactly. HTTP
# header values are bytes that Starlette decodes as latin-1 (starlette/datastructures.py Headers), so a
# non-ASCII key sent as UTF-8 never equals vLLM's str: the guard may match it while vLLM's own /v1 check
# answers 401. Whitespace is trimmed from header values by the HTTP parser (h11, RFC 9110 5.5). Hence visible
# ASCII only; at least 16 characters (the key guards a GPU endpoint), at most 256 (well inside header limits).
API_KEY_MIN_LEN, API_KEY_MAX_LEN = 16, 256
_API_KEY_CHARS = re.compile(r"[\x21-\x7e]+")


def _serving_api_key_problem(key: object) -> str | None:
    """Why servingApiKey cannot work as a vLLM API key, or None; the message never contains the key."""
    if key in (None, ""):
        return None
    fix = 'Fix: pulumi config set --secret servingApiKey "$(openssl rand -hex 32)" (and give clients the new key)'
    if not isinstance(key, str):
        return f"servingApiKey must be a string of visible ASCII characters. {fix}"
    bad = sum(1 for c in key if not _API_KEY_CHARS.fullmatch(c))
    if bad or not API_KEY_MIN_LEN <= len(key) <= API_KEY_MAX_LEN:
        return (
            f"servingApiKey (value not shown) has {len(key)} characters, {bad} of them not visible ASCII: allowed "
            f"are {API_KEY_MIN_LEN} to {API_KEY_MAX_LEN} characters from '!' to '~' (no spaces, no non-ASCII: "
            f"clients send it in an HTTP header and vLLM compares it byte for byte). {fix}"
        )
    return None


def config_keys() -> dict[str, str]:
    """Stack-file key -> field name, for every key a user may set (hfToken included)."""
    keys = {
        (f.alias or name): name
        for name, f in StackConfig.model_fields.items()
        if name not in {"stack", "hf_token_set", "serving_api_key_set"}
    }
    keys.update(_SECRET_KEYS)
    return keys


@dataclass(frozen=True)
class LoadedConfig:
    """The validated configuration plus the secret that must stay an Output."""

    cfg: StackConfig
    hf_token: pulumi.Output[str] | None
    serving_api_key: pulumi.Output[str] | None = None


def validate(raw: dict[str, Any], stack: str, hf_token_set: bool) -> StackConfig:
    """Validate raw stack values (keys as in the stack file, without namespace) or raise ConfigError."""
    problems: list[str] = []
    known = config_keys()
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(f"unknown key {PROJECT_NAMESPACE}:{key}{hint} (allowed keys are declared in Pulumi.yaml)")
    key_problem = _serving_api_key_problem(raw.get("servingApiKey"))
    if key_problem:
        problems.append(key_problem)
    values = {k: v for k, v in raw.items() if k in known and k not in _SECRET_KEYS}
    for key in _LIST_FIELDS & values.keys():
        if isinstance(values[key], str):
            try:
                values[key] = json.loads(values[key])
            except json.JSONDecodeError:
                problems.append(f"{key} must be a list, e.g. `pulumi config set --path '{key}[0]' VALUE`")
    workload = values.get("workload")
    for key, default in _WORKLOAD_DEFAULTS.get(workload or "", {}).items():
        values.setdefault(key, default)
    if problems:
        raise ConfigError(_render(stack, problems))
    try:
        cfg = StackConfig.model_validate(
            {
                **values,
                "stack": stack,
                "hf_token_set": hf_token_set,
                "serving_api_key_set": raw.get("servingApiKey") not in (None, ""),
            }
        )
    except ValidationError as exc:
        raise ConfigError(_render(stack, [_describe(e) for e in exc.errors()])) from None
    token_problem = (
        _override_data_problem(cfg)
        or _url_rows_problem(cfg)
        or _memory_problem(cfg)
        or _hf_token_problem(cfg)
        or _world_size_problem(cfg)
    )
    if token_problem:
        raise ConfigError(_render(stack, [token_problem]))
    cfg, serving = resolve_serving(cfg)
    if serving:
        raise ConfigError(_render(stack, serving))
    return cfg


# What a CUDA build needs of a GPU without PTX JIT: SASS for its architecture. sm_120 (RTX PRO 6000 Blackwell) is a
# target from CUDA 12.8 on (NVIDIA CUDA 12.8 release notes: "added support for SM_120"); an older build can reach
# it only as PTX, JIT-compiled by the driver.
FIRST_CUDA_FOR_CC = {120: (12, 8), 89: (11, 8)}
# What of vLLM v0.28.0 reaches sm_120 only as PTX (compute_80), read from the fatbins of the PyPI wheel's .so files
# (its CUDA 13.0 build; docs/serving.md, "An image the GPU's driver can run"): vllm_flash_attn/_vllm_fa2_C (every
# kernel: SASS sm_80 + PTX compute_80), 5 kernel groups of _C_stable_libtorch and 1 of _moe_C. sm_89 (L4) has SASS
# in every generic kernel (sm_80/86/89), and Triton compiles its kernels to SASS with its own ptxas (12.8 below
# sm_100, 13.1 from sm_100: triton 3.7.1 backends/nvidia/compiler.py `get_ptxas`).
PTX_ONLY_ON = {120: "FlashAttention 2 and 6 kernel groups of vLLM v0.28.0 carry sm_120 only as PTX (compute_80)"}


def image_driver_problem(image: str, gpu: str) -> str | None:
    """Why a vLLM image cannot run on a Cloud Run GPU's driver, or None (also when the tag does not say its CUDA).

    NVIDIA's rules (docs.nvidia.com/deploy/cuda-compatibility): a build for a newer CUDA major than the driver's does
    not run; a build for a newer minor of the same major runs by minor-version compatibility, which has no PTX JIT, so
    every kernel must carry SASS for the GPU; a build older than the GPU's architecture can only JIT it."""
    found = image_cuda(image)
    spec = CLOUD_RUN_GPUS.get(gpu)
    if found is None or spec is None:
        return None
    major, minor = found
    built = f"CUDA {major}.{minor}" if minor is not None else f"CUDA {major}"
    driver = f"Cloud Run's {gpu} driver is {spec.driver} (CUDA {spec.driver_cuda[0]}.{spec.driver_cuda[1]})"
    fix_cuda12 = _set("servingVllmImage", cuda12_variant(image))
    if major > spec.driver_cuda[0]:
        return (
            f"servingVllmImage={image!r} is a CUDA {major} build (from vLLM v0.20 on, a tag without a suffix is the CUDA "
            f"13.0 build: vllm-project/vllm#39878), but {driver}: a newer CUDA major needs a newer driver (NVIDIA "
            f"CUDA minor version compatibility covers one major only). Allowed on {gpu}: a CUDA "
            f"{spec.driver_cuda[0]} build, i.e. a `-cu129` tag (vllm/vllm-openai:vX.Y.Z-cu129), a release before "
            f"v0.20, or a digest. Fix: {fix_cuda12}, or {_set('servingGpuType', 'nvidia-rtx-pro-6000')} (driver 580)"
        )
    first = FIRST_CUDA_FOR_CC.get(spec.compute_capability)
    if first and minor is not None and (major, minor) < first:
        return (
            f"servingVllmImage={image!r} is a {built} build: CUDA {first[0]}.{first[1]} is the first that compiles for "
            f"sm_{spec.compute_capability} ({gpu}), so its kernels would reach this GPU only by PTX JIT, if at all. "
            f"Fix: {_set('servingVllmImage', VLLM_IMAGE)}"
        )
    if major == spec.driver_cuda[0] and minor is not None and minor > spec.driver_cuda[1]:
        ptx_only = PTX_ONLY_ON.get(spec.compute_capability)
        if ptx_only:
            return (
                f"servingVllmImage={image!r} is a {built} build and {driver}: it runs by minor-version compatibility, "
                f"which has no PTX JIT, and {ptx_only}. Fix: {_set('servingVllmImage', VLLM_IMAGE)} (CUDA 12.9, "
                "which the 580 driver runs natively, JIT included)"
            )
    return None


def resolve_serving(cfg: StackConfig) -> tuple[StackConfig, list[str]]:
    """The stack with `servingGpuType` chosen when unset (the GPU with the least memory that holds the served model),
    and, with serving on, what cannot be served: a model its GPU cannot hold, a merged export the recipe does not
    write, runs compared where only merged exports are served, an image the GPU's driver cannot run."""
    from serving.memory import UnknownModelError
    from serving.served_model import MERGED, served_model

    recipe = load_recipe(cfg.recipe_source, cfg.recipe_overrides)  # loads: _hf_token_problem checked it
    model = served_model(recipe, cfg.workload is not Workload.CLOUD_RUN, len(cfg.serving_compare_run_ids))
    length, seqs = cfg.serving_max_model_len, cfg.serving_concurrency
    gpu = cfg.serving_gpu_type
    if not gpu:
        try:
            gpu = model.smallest_gpu(length, seqs) or max(
                CLOUD_RUN_GPUS, key=lambda g: CLOUD_RUN_GPUS[g].min_memory_gib
            )
        except UnknownModelError:
            gpu = "nvidia-l4"
        cfg = cfg.model_copy(update={"serving_gpu_type": gpu})
    if not cfg.serving_enabled:
        return cfg, []
    problems = []
    n = len(cfg.recipe_overrides)
    if model.artefact == MERGED and not recipe.writes_merged:
        problems.append(
            f"servingEnabled=true serves the merged export of recipe {cfg.recipe!r} ({model.why}), but its "
            f"output.merge is false. Fix: pulumi config set --path 'recipeOverrides[{n}]' output.merge=true (a new run)"
        )
    if model.artefact == MERGED and cfg.serving_compare_run_ids:
        problems.append(
            f"servingCompareRunIds serves other runs' adapters beside the served one, but this stack serves merged "
            f"exports ({model.why}). Fix: pulumi config rm servingCompareRunIds"
        )
    try:
        estimate = model.memory(gpu, length, seqs)
    except UnknownModelError as exc:
        if cfg.preflight is PreflightMode.STRICT:
            problems.append(
                f"{exc}: whether the served model fits servingGpuType={gpu} cannot be checked. Fix: a Gemma the memory "
                "model knows, or pulumi config set preflight warn"
            )
        estimate = None
    if estimate is not None and not estimate.fits:
        fixes = [
            f"{_set('servingGpuType', other)} ({model.memory(other, length, seqs).line()})"
            for other in CLOUD_RUN_GPUS
            if other != gpu and model.memory(other, length, seqs).fits
        ]
        from serving.memory import longest_context_that_fits

        longest = longest_context_that_fits(estimate)
        if longest:
            fixes.append(f"{_set('servingMaxModelLen', longest)} (the longest context whose one request fits)")
        problems.append(
            f"servingGpuType={gpu} cannot hold the served model: {estimate.line()}. Fix: "
            + ("; or ".join(fixes) if fixes else "a smaller Gemma (docs/own-data.md, 'Which Gemma fits')")
        )
    driver = image_driver_problem(cfg.serving_vllm_image, gpu)
    if driver:
        problems.append(driver)
    return cfg, problems


def _world_size_problem(cfg: StackConfig) -> str | None:
    """The stack starts `total_gpus` data-parallel ranks (gke-job: nodes x gpusPerNode processes, gke-ray: one Ray
    Train worker per GPU, cloud-run: one process); the recipe must be sized for that many (the trainer refuses
    another count at start, trainer.recipe.world_size_problem: here it fails before a GPU is rented)."""
    recipe = load_recipe(cfg.recipe_source, cfg.recipe_overrides)  # loads: _hf_token_problem checked it
    ranks = cfg.total_gpus
    problem = world_size_problem(
        recipe, ranks, f"this stack (nodes={cfg.nodes} x gpusPerNode={cfg.gpus_per_node or 1})"
    )
    if problem is None:
        return None
    per_node = cfg.gpus_per_node or 1
    nodes = recipe.distributed.world_size // per_node if recipe.distributed.world_size % per_node == 0 else None
    back = f"{_set('nodes', nodes)}, or " if nodes else ""
    return (
        f"{problem}. Fix: {back}size the recipe for {ranks} with "
        f"`pulumi config set --path 'recipeOverrides[{len(cfg.recipe_overrides)}]' distributed.world_size={ranks}`"
    )


def stack_memory_verdict(cfg: StackConfig, recipe: Recipe | None = None) -> MemoryVerdict | None:
    """The memory model's verdict on the stack's recipe over its GPUs (None for a gpuType it does not know).

    gke-job runs the strategy the recipe resolves to (trainer/launch.py renders it); a RayJob's workers and a Cloud
    Run task each hold a whole replica, whatever the recipe says."""
    gpu = TRAINING_GPU.get(cfg.gpu_type or "")
    if gpu is None:
        return None
    recipe = recipe or parse_recipe(cfg.recipe_source, cfg.recipe_overrides)
    return memory_verdict(recipe, gpu, cfg.total_gpus, replicated=cfg.workload is not Workload.GKE_JOB)


def _override(cfg: StackConfig, items: list[str]) -> list[str]:
    n = len(cfg.recipe_overrides)
    return [f"pulumi config set --path 'recipeOverrides[{n + i}]' {item}" for i, item in enumerate(items)]


def memory_fixes(cfg: StackConfig, recipe: Recipe) -> list[str]:
    """Settings that make the recipe's run fit, each with its estimate, in this order: another gpuType, QLoRA or
    gradient checkpointing on this GPU, more nodes (gke-job, FSDP), a shorter training.max_length."""
    t = recipe.training
    per_node = cfg.gpus_per_node or 1
    quantized = recipe.quantization is not None and recipe.quantization.load_in_4bit
    ladder = [x for x, done in (("training.gradient_checkpointing=true", t.gradient_checkpointing),
                                ("quantization.load_in_4bit=true", quantized)) if not done]  # fmt: skip
    changes = [[], *([x] for x in ladder), *([ladder] if len(ladder) == 2 else [])]

    def attempt(gpu_type: str, nodes: int, extra: list[str]) -> tuple[MemoryVerdict, list[str]] | None:
        gpu = TRAINING_GPU[gpu_type]
        candidate = parse_recipe(cfg.recipe_source, [*cfg.recipe_overrides, *extra])
        if candidate.distributed.gpu not in (None, gpu):
            extra = [*extra, f"distributed.gpu={gpu}"]
            candidate = parse_recipe(cfg.recipe_source, [*cfg.recipe_overrides, *extra])
        replicated = cfg.workload is not Workload.GKE_JOB
        verdict = memory_verdict(candidate, gpu, per_node * nodes, replicated=replicated)
        return (verdict, extra) if verdict.fits else None

    def first_fit(gpu_type: str, nodes: int, base: list[str]) -> tuple[MemoryVerdict, list[str]] | None:
        return next((found for c in changes if (found := attempt(gpu_type, nodes, [*base, *c]))), None)

    def shown(sets: list[str], found: tuple[MemoryVerdict, list[str]]) -> str:
        verdict, extra = found
        e = verdict.estimate
        return f"{' && '.join([*sets, *_override(cfg, extra)])} (~{e.total_gb:.0f} GB of {e.usable_gb:.0f} usable)"

    gpu_here = TRAINING_GPU[cfg.gpu_type or ""]
    fixes = []
    offered = CLOUD_RUN_GPUS if cfg.workload is Workload.CLOUD_RUN else GKE_ACCELERATORS
    bigger = [g for g in offered if GPUS[TRAINING_GPU[g]].memory_gb > GPUS[gpu_here].memory_gb]
    for gpu_type in sorted(bigger, key=lambda g: GPUS[TRAINING_GPU[g]].memory_gb):  # the smallest that fits
        if cfg.workload is not Workload.CLOUD_RUN and per_node not in GKE_ACCELERATORS[gpu_type].counts:
            continue
        found = first_fit(gpu_type, cfg.nodes, [])
        if found:
            fixes.append(shown([_set("gpuType", gpu_type)], found))
            break
    here = changes[1:]
    if cfg.workload is Workload.GKE_JOB and cfg.total_gpus > 1 and recipe.distributed.strategy != "auto":
        auto = ["distributed.strategy=auto", *([] if recipe.distributed.gpu else [f"distributed.gpu={gpu_here}"])]
        here = [auto, *here, *([*auto, *c] for c in here)]
    found = next((f for c in here if (f := attempt(cfg.gpu_type or "", cfg.nodes, c))), None)
    if found:
        fixes.append(shown([], found))
    if cfg.workload is Workload.GKE_JOB:
        fsdp = [] if recipe.distributed.strategy in {"fsdp", "auto"} else ["distributed.strategy=fsdp"]
        for nodes in range(cfg.nodes + 1, 9):
            found = first_fit(cfg.gpu_type or "", nodes, [f"distributed.world_size={nodes * per_node}", *fsdp])
            if found:
                fixes.append(
                    shown([_set("nodes", nodes)], found) + ": more ranks, more rows per update (scale "
                    "training.gradient_accumulation_steps down to keep them)"
                )
                break
    length = t.max_length // 2
    while length >= 128:
        found = attempt(cfg.gpu_type or "", cfg.nodes, [f"training.max_length={length}"])
        if found:
            fixes.append(shown([], found) + f": rows longer than {length} tokens are skipped")
            break
        length //= 2
    return fixes


def _memory_problem(cfg: StackConfig) -> str | None:
    """The recipe's run must fit the stack's GPUs; see `stack_memory_verdict` and `memory_fixes`."""
    gpu = TRAINING_GPU.get(cfg.gpu_type or "")
    if gpu is None:
        return None
    try:  # the schema only: a run whose strategy does not fit its own distributed.gpu is reported here, with fixes
        recipe = parse_recipe(cfg.recipe_source, cfg.recipe_overrides)
    except RecipeError:
        return None  # _hf_token_problem reports it
    if recipe.distributed.world_size != cfg.total_gpus:
        return None  # _world_size_problem reports it
    if recipe.distributed.gpu not in (None, gpu):
        return (
            f"recipe {cfg.recipe!r} sizes its run for distributed.gpu={recipe.distributed.gpu}, but this stack trains "
            f"on gpuType={cfg.gpu_type} ({gpu}): its strategy and memory check would be for another GPU. "
            f"Fix: {_override(cfg, [f'distributed.gpu={gpu}'])[0]}"
        )
    verdict = stack_memory_verdict(cfg, recipe)
    if verdict is None or verdict.fits:
        return None
    where = f"{cfg.total_gpus} x {cfg.gpu_type} (nodes={cfg.nodes} x gpusPerNode={cfg.gpus_per_node or 1})"
    if verdict.shape is None:
        if cfg.preflight is not PreflightMode.STRICT:
            return None  # the program warns that the fit was not checked
        name = recipe.model.name_or_path
        return (
            f"model.name_or_path={name!r}: {verdict.source}, so whether it fits {where} cannot be checked. Fix: a Gemma "
            f"the memory model knows (docs/own-data.md, 'Which Gemma fits'); or its config.json in the Hugging Face "
            f"cache of the machine that runs Pulumi (`hf download {name} config.json`); or, to go on unchecked (a run "
            "that does not fit then fails at its first step), pulumi config set preflight warn"
        )
    fixes = memory_fixes(cfg, recipe)
    fix = (
        "; or ".join(fixes)
        if fixes
        else "none of another gpuType, QLoRA, more nodes or a shorter max_length fits: a smaller Gemma "
        "(docs/own-data.md, 'Which Gemma fits')"
    )
    return f"recipe {cfg.recipe!r} does not fit {where}: {verdict.line()}. Fix: {fix}"


def _hf_token_problem(cfg: StackConfig) -> str | None:
    try:
        recipe = load_recipe(cfg.recipe_source, cfg.recipe_overrides)
    except RecipeError as exc:
        return f"recipeOverrides do not apply to recipe {cfg.recipe!r}: {exc}"
    reason = recipe.hf_token_reason()
    if reason and not cfg.hf_token_set:
        return (
            f"hfToken is missing and recipe {cfg.recipe!r} needs it: {reason}. "
            f"Fix: {_set('hfToken', 'hf_…', secret=True)} (a token from https://huggingface.co/settings/tokens)"
        )
    return None


def _describe(err: Any) -> str:
    loc = ".".join(str(x) for x in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not loc:
        return msg
    if err["type"] == "enum" or err["type"].endswith("_parsing") or err["type"].startswith(("greater", "less")):
        return f"{loc}={err.get('input')!r}: {msg}. Fix: {_set(loc)}"
    if err["type"] == "missing":
        return f"{loc} is required. Fix: {_set(loc)}"
    return msg if loc in msg else f"{loc}: {msg}"


def _render(stack: str, problems: list[str]) -> str:
    lines = [f"stack {stack!r} has invalid configuration (nothing was created):"]
    for p in problems:
        lines.extend(f"  - {line}" for line in p.splitlines())
    return "\n".join(lines)


def load() -> LoadedConfig:
    """Read this stack's configuration from Pulumi and validate it."""
    raw: dict[str, Any] = {}
    all_config = pulumi.runtime.config.CONFIG.get()
    prefix = f"{PROJECT_NAMESPACE}:"
    for full_key, value in all_config.items():
        if full_key.startswith(prefix):
            raw[full_key[len(prefix) :]] = value
    gcp = pulumi.Config("gcp")
    project, region = gcp.get("project"), gcp.get("region")
    if project is not None:
        raw["gcp:project"] = project
    if region is not None:
        raw["gcp:region"] = region
    hf_token_set = raw.get("hfToken") not in (None, "")
    cfg = validate(raw, pulumi.get_stack(), hf_token_set)
    token = pulumi.Config(PROJECT_NAMESPACE).get_secret("hfToken") if hf_token_set else None
    api_key = pulumi.Config(PROJECT_NAMESPACE).get_secret("servingApiKey") if cfg.serving_api_key_set else None
    return LoadedConfig(cfg=cfg, hf_token=token, serving_api_key=api_key)
