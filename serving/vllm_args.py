"""Typed vLLM server settings, rendered to the arguments of the official `vllm/vllm-openai` image.

The image's ENTRYPOINT is `vllm serve` (our serving/entrypoint.sh keeps that contract), so
the rendered list starts with the model path and never repeats `serve`:

    >>> from serving.vllm_args import VllmServerConfig, render_args
    >>> render_args(VllmServerConfig(model="/mnt/models/merged", max_model_len=4096))[:3]
    ['/mnt/models/merged', '--served-model-name', 'gemma']

Decisions (sources: docs/cloud-run.md#vllm-settings-are-typed-fields): every flag relied on is a typed field checked at
`pulumi preview` (`float16` for Gemma 2/3 refused, as vLLM would); `extra_args` refuses duplicates of a field,
credentials and `--middleware`, prefixes included; an API key brings `serving.api_key_guard.ApiKeyGuard`;
served sampling is greedy (`served_sampling_defaults()`, shared with demo/local_server.py); `max_num_seqs` is
always rendered, to match Cloud Run's concurrency. Only pydantic and the standard library are imported (the
Pulumi program imports this). It does not know where the model comes from and starts nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Written by the trainer as the last file of an export (serving/completion.py defines "complete").
from serving.completion import COMPLETION_MARKER as COMPLETION_MARKER

# The official image, pinned to an exact release, in its CUDA 12.9 build (see serving/README.md, "Base image"):
# since v0.20 the plain tag is the CUDA 13.0 build, which Cloud Run's L4 driver (535) cannot run.
VLLM_IMAGE = "vllm/vllm-openai:v0.28.0-cu129"
# Where the serving container sees the trainer's output (the bucket is mounted here).
MODEL_MOUNT_PATH = "/mnt/models"
DEFAULT_MODEL_PATH = f"{MODEL_MOUNT_PATH}/merged"
DEFAULT_SERVED_MODEL_NAME = "gemma"
DEFAULT_PORT = 8000
# The context the Cloud Run service serves by default (`--max-model-len`; the stack's servingMaxModelLen), which the
# local server applies too: a prompt vLLM refuses for its length is refused there as well.
SERVED_MAX_MODEL_LEN = 4096
# vLLM accepts only these values for --max-lora-rank (`MaxLoRARanks`, vllm/config/lora.py, v0.28.0).
ALLOWED_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The Gemma classes vLLM v0.28.0 serves LoRA adapters for: each subclasses SupportsLoRA (vllm/model_executor/models
# gemma3.py Gemma3ForCausalLM, gemma3_mm.py Gemma3ForConditionalGeneration, gemma4_mm.py
# Gemma4ForConditionalGeneration, which maps the checkpoint's `model.language_model.` to its own
# `language_model.model.`, for the adapter's weight names too: vllm/lora/utils.py parse_fine_tuned_lora_name).
VLLM_LORA_ARCHITECTURES = frozenset(
    {"Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Gemma4ForConditionalGeneration"}
)
# vLLM's `--load-format` values this project renders: `auto` reads safetensors from a folder, `runai_streamer`
# streams them from object storage (gs://, s3://) in parallel ranges (vllm/model_executor/model_loader/
# runai_streamer_loader.py); the extra config keys that loader accepts.
LoadFormat = Literal["auto", "runai_streamer"]
RUNAI_STREAMER_KEYS = frozenset({"concurrency", "memory_limit", "distributed"})

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
_LORA_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# vLLM v0.28.0 `SafetensorsLoadStrategy` (vllm/config/load.py), without "torchao" (a quantised-checkpoint path).
SafetensorsLoadStrategy = Literal["lazy", "eager", "prefetch"]


class VllmConfigError(ValueError):
    """Settings that cannot be served, with a message naming the field, the value and what is allowed."""


class Dtype(StrEnum):
    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


# vllm/config/model.py `_FLOAT16_NOT_SUPPORTED_MODELS` (model_type -> reason), the Gemma entries:
# vLLM raises "The model type 'gemma3_text' does not support float16. Reason: Numerical instability."
FLOAT16_UNSUPPORTED_MODEL_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text"})
_GEMMA_FAMILY = re.compile(r"gemma-?([23])(?![0-9])", re.IGNORECASE)


def model_type_of(name_or_path: str) -> str | None:
    """`gemma3` for google/gemma-3-1b-it or a run folder named after a Gemma 3 recipe; None when unknown."""
    match = _GEMMA_FAMILY.search(name_or_path)
    return f"gemma{match.group(1)}" if match else None


# vLLM's image tags (vllm-project/vllm#39878, "Switch default CUDA to 13.0", first released in v0.20.0): the
# plain tag `vX.Y.Z` (and its `-ubuntu2404` variant) is the CUDA 13.0 build and `vX.Y.Z-cu129` the CUDA 12.9
# one; before v0.20 the plain tag was CUDA 12.x and `-cu130` the variant. Third-party confirmations:
# vast-ai/base-image#158 (the live tag list of v0.20.0 holds `-cu129` and `-cu130`), llm-d/llm-d-kv-cache#584
# ("The plain :v0.20.2 tag now resolves to a cu130 build").
VLLM_REPOSITORIES = frozenset({"vllm/vllm-openai", "docker.io/vllm/vllm-openai"})
FIRST_CUDA13_DEFAULT = (0, 20)
_CUDA_SUFFIX = re.compile(r"(?:^|-)cu(?:da-?)?(\d{2})\.?(\d)?(?:-|$)")
_RELEASE_TAG = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)")


def _split_image(image: str) -> tuple[str, str]:
    """`vllm/vllm-openai:v0.28.0` -> ("vllm/vllm-openai", "v0.28.0"); a digest reference has no tag ("")."""
    if "@" in image:
        return image.split("@", 1)[0], ""
    repo, _, tag = image.rpartition(":")
    if not repo or "/" in tag:  # no tag, or the colon belonged to a registry port
        return image, ""
    return repo, tag


def image_cuda(image: str) -> tuple[int, int | None] | None:
    """The CUDA version an image's tag says it was built for, (12, 9) for `-cu129`, or None when the tag does not say.

    A `-cuNNN` suffix says so for any image (`-cu12` alone: minor unknown); a plain release tag of the official vLLM
    image means CUDA 13.0 from v0.20 on and CUDA 12 before (minor unknown). Digests and other tags (`gemma4`,
    nightlies, your own images) are unknown.
    """
    repo, tag = _split_image(image)
    suffix = _CUDA_SUFFIX.search(tag.lower())
    if suffix:
        minor = suffix.group(2)
        return int(suffix.group(1)), int(minor) if minor else None
    release = _RELEASE_TAG.match(tag)
    if repo in VLLM_REPOSITORIES and release:
        return (13, 0) if (int(release.group(1)), int(release.group(2))) >= FIRST_CUDA13_DEFAULT else (12, None)
    return None


def image_cuda_major(image: str) -> int | None:
    """The CUDA major version an image's tag says it was built for (12, 13), or None when the tag does not say."""
    found = image_cuda(image)
    return found[0] if found else None


def cuda12_variant(image: str) -> str:
    """The CUDA 12.9 build of the same vLLM release (`…:v0.28.0` -> `…:v0.28.0-cu129`), else the default image."""
    repo, tag = _split_image(image)
    release = _RELEASE_TAG.match(tag)
    if repo in VLLM_REPOSITORIES and release and (int(release.group(1)), int(release.group(2))) >= FIRST_CUDA13_DEFAULT:
        return f"{repo}:v{release.group(1)}.{release.group(2)}.{release.group(3)}-cu129"
    return VLLM_IMAGE


# What vLLM's own API key check (`--api-key`, or VLLM_API_KEY as the service sets it) guards in the releases this
# image pins: a path-prefix test, `GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")` in
# vllm/entrypoints/serve/utils/server_utils.py (`AuthenticationMiddleware`; the same rule in 0.27.1 and 0.29.0,
# vllm-project/vllm#58144). On its own it leaves every other route open: /health, /ping, /load, /version,
# /metrics, /tokenize, /detokenize, /pooling, /classify, /score, /rerank, and /invocations, the SageMaker
# route that serves the same chat and completion requests as /v1 (the `--api-key` help in
# vllm/entrypoints/openai/cli_args.py says so; #58144 measured full completions there without a key).
# That is why a key never goes to vLLM alone: `api_key_guard` adds serving/api_key_guard.py, which asks for the
# key on every route but the health check.
VLLM_API_KEY_GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
VLLM_KEYLESS_INFERENCE_ROUTE = "/invocations"
# vLLM's health route (the startup probe's path): the one path serving/api_key_guard.py leaves open.
VLLM_HEALTH_PATH = "/health"
# The import path vLLM's `--middleware` takes (FrontendArgs.middleware in vllm/entrypoints/openai/cli_args.py: "If a
# class is provided, vLLM will add it to the server using `app.add_middleware()`"). It resolves in the serving
# image because serving/Dockerfile copies the package to /opt/gemma-serving/serving and puts /opt/gemma-serving
# on PYTHONPATH; here it is the repository's own serving/api_key_guard.py.
API_KEY_GUARD_MIDDLEWARE = "serving.api_key_guard.ApiKeyGuard"


# vLLM's neutral sampling defaults for a parameter a request omits, when the generation config adds none
# (`_DEFAULT_SAMPLING_PARAMS` of ChatCompletionRequest and CompletionRequest in vLLM v0.28.0).
VLLM_NEUTRAL_SAMPLING: dict[str, float] = {
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}
# What the service overrides: greedy unless the request asks otherwise (rendered as --override-generation-config).
SERVED_SAMPLING_OVERRIDE: dict[str, float] = {"temperature": 0.0}
# Where vLLM takes its defaults from: "vllm" = its neutral defaults, never the model's generation_config.json.
SERVED_GENERATION_CONFIG = "vllm"


def served_sampling_defaults() -> dict[str, float]:
    """The sampling a request gets for each parameter it omits, on the service and on the local server."""
    return {**VLLM_NEUTRAL_SAMPLING, **SERVED_SAMPLING_OVERRIDE}


def vllm_api_key_guards(path: str) -> bool:
    """Whether vLLM's own check asks for the API key on `path` (its test: `path.startswith(GUARDED_PREFIX)`)."""
    return path.startswith(VLLM_API_KEY_GUARDED_PREFIXES)


# typed field -> the vLLM flags (and aliases) that set it; used to reject duplicates in extra_args
_TYPED_FLAGS: dict[str, tuple[str, ...]] = {
    "model": ("--model",),
    "served_model_name": ("--served-model-name",),
    "max_model_len": ("--max-model-len",),
    "dtype": ("--dtype",),
    "gpu_memory_utilization": ("--gpu-memory-utilization",),
    "tensor_parallel_size": ("--tensor-parallel-size", "-tp"),
    "host": ("--host",),
    "port": ("--port",),
    "enforce_eager": ("--enforce-eager", "--no-enforce-eager"),
    "safetensors_load_strategy": ("--safetensors-load-strategy",),
    "lora_modules": ("--enable-lora", "--no-enable-lora", "--lora-modules"),
    "max_lora_rank": ("--max-lora-rank",),
    "max_loras": ("--max-loras",),
    "max_num_seqs": ("--max-num-seqs",),
    "load_format": ("--load-format",),
    "model_loader_extra_config": ("--model-loader-extra-config",),
    "language_model_only": ("--language-model-only", "--no-language-model-only", "--limit-mm-per-prompt"),
    # vLLM appends every `--middleware` (make_arg_parser in vllm/entrypoints/openai/cli_args.py:
    # frontend_kwargs["middleware"]["action"] = "append") and build_app calls app.add_middleware for each in
    # order; Starlette's add_middleware inserts at the front, so the last one added is the outermost and sees
    # every request before the API key guard (it could answer without the key). Hence refused, not replaced.
    "api_key_guard": ("--middleware",),
    # the served sampling defaults (SERVED_GENERATION_CONFIG, SERVED_SAMPLING_OVERRIDE): one decision, not a knob
    "sampling_defaults": ("--generation-config", "--override-generation-config"),
}
_FLAG_TO_FIELD = {flag: field for field, flags in _TYPED_FLAGS.items() for flag in flags}

# vLLM flags whose value is a credential (vllm/entrypoints/openai/cli_args.py `FrontendArgs.api_key`;
# vllm/config/model.py `ModelConfig.hf_token`, "the token to use as HTTP bearer authorization for remote
# files"). As container args they would be plain text in the Pulumi state and the Cloud Run revision.
SECRET_FLAGS: dict[str, str] = {
    "--api-key": "servingApiKey (pulumi config set --secret servingApiKey KEY: Secret Manager, then VLLM_API_KEY)",
    "--hf-token": "nothing: the service reads the merged weights from the bucket with HF_HUB_OFFLINE=1 "
    "(hfToken, a secret, is for training)",
}


# vLLM flags that add routes meant for local development (vLLM v0.28.0), which every caller of the service could use:
# refused in extra_args, like VLLM_SERVER_DEV_MODE and VLLM_ALLOW_RUNTIME_LORA_UPDATING in servingEnv (infra/config.py).
_PROFILE_ROUTES = (
    "/start_profile and /stop_profile, with which any caller starts a profile written to the instance's in-memory "
    "disk (vllm/entrypoints/serve/profile/api_router.py attaches them whenever a profiler is configured: 'This should "
    "ONLY be used for local development!')"
)
_FAULT_TOLERANCE_ROUTES = (
    "/fault_tolerance/apply, with which any caller sends the engine recovery instructions "
    "(vllm/entrypoints/serve/fault_tolerance/api_router.py, registered by build_app when fault tolerance is on)"
)
DEVELOPMENT_ROUTE_FLAGS: dict[str, str] = {
    "--profiler-config": _PROFILE_ROUTES,
    "--enable-fault-tolerance": _FAULT_TOLERANCE_ROUTES,
    "--fault-tolerance-config": _FAULT_TOLERANCE_ROUTES,
}


def _expansions(name: str, flags: Iterable[str]) -> list[str]:
    """The flags among `flags` that `name` stands for: itself, or every flag it is a prefix of.

    vLLM's FlexibleArgumentParser keeps argparse's `allow_abbrev=True` (vllm/utils/argparse_utils.py does
    not turn it off), so `--api-k SECRET` is `--api-key SECRET` and `--po 9` is `--port 9`; an ambiguous prefix
    is an argparse error at startup. Either way it must be refused like the flag it abbreviates. Only
    long options (`--x`) are expanded here; argparse's prefix matching of single-dash options is not.
    """
    flags = list(flags)
    if name in flags:
        return [name]
    if not name.startswith("--") or len(name) <= 2:
        return []
    return sorted(flag for flag in flags if flag.startswith(name))


def secret_flag(arg: str) -> str | None:
    """The secret-bearing vLLM flag `arg` sets (`--api-key`, `--api_key=…`, `--api-k`, `--hf-t`), or None."""
    matches = _expansions(_flag_name(arg), SECRET_FLAGS)
    return matches[0] if matches else None


def typed_flag(arg: str) -> tuple[str, str] | None:
    """(`field`, flag) when `arg` sets, or abbreviates, a flag a typed field (or the API key guard) renders."""
    matches = _expansions(_flag_name(arg), _FLAG_TO_FIELD)
    return (_FLAG_TO_FIELD[matches[0]], matches[0]) if matches else None


def extra_arg_problem(arg: str) -> str | None:
    """Why `arg` may not be an extra vLLM arg (a credential, a development route, `--middleware`, a typed field's flag).

    The message names the flag as written (before any `=`), never the value: it may be a secret.
    """
    written = arg.split("=", 1)[0]
    flag = secret_flag(arg)
    if flag is not None:
        return f"{flag}, whose value would be plain text in the container's arguments; use {SECRET_FLAGS[flag]}"
    development = _expansions(_flag_name(arg), DEVELOPMENT_ROUTE_FLAGS)
    if development:
        flag = development[0]
        return f"{flag}, which adds {DEVELOPMENT_ROUTE_FLAGS[flag]}; every caller of the service could use them"
    typed = typed_flag(arg)
    if typed is None:
        return None
    field, flag = typed
    as_written = repr(written) if written == flag else f"{written!r} (argparse expands it to {flag})"
    if field == "api_key_guard":
        return (
            f"{as_written}: vLLM adds every --middleware and the one added last is the outermost, so it would see "
            f"every request before the API key guard ({API_KEY_GUARD_MIDDLEWARE}) and could answer without the key; "
            "other middleware is not supported, remove it"
        )
    if field == "sampling_defaults":
        return (
            f"{as_written}: the served sampling defaults are fixed (greedy, `served_sampling_defaults()` in "
            "serving/vllm_args.py) so the service and the local server answer a request alike; pass `temperature` "
            "and `top_p` in the request instead"
        )
    return f"{as_written}, which duplicates the typed field `{field}`: set `{field}` instead"


def _flag_name(arg: str) -> str:
    """`--max_model_len=8` -> `--max-model-len` (vLLM accepts both spellings); `--x.key` -> `--x`.

    vLLM's FlexibleArgumentParser.parse_args (vllm/utils/argparse_utils.py, v0.28.0) reads `--NAME.key VALUE` as
    `--NAME '{"key": VALUE}'` and appends it after every other arg, so it sets (and, being last, wins over) `--NAME`.
    """
    name = arg.split("=", 1)[0]
    if name.startswith("--"):
        name = "--" + name[2:].split(".", 1)[0].replace("_", "-")
    return name


class VllmServerConfig(BaseModel):
    """What the vLLM OpenAI-compatible server is started with. Field names follow vLLM's flags."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(DEFAULT_MODEL_PATH, description="model folder (the merged export) or a Hub id")
    served_model_name: str | None = Field(
        DEFAULT_SERVED_MODEL_NAME, description="the `model` clients send; null serves it under its path"
    )
    max_model_len: int | None = Field(None, description="context length; null uses the model's own")
    dtype: Dtype = Field(
        Dtype.AUTO,
        description="auto | bfloat16 | float16 (auto: bf16 for Gemma 3 on L4; float16 is refused for Gemma 2/3)",
    )
    model_type: str | None = Field(
        None,
        description="the model's config.json model_type (e.g. gemma3_text); only used to refuse what vLLM would "
        "refuse, never rendered. Unset: inferred from the model's name",
    )
    gpu_memory_utilization: float = Field(0.90, description="share of GPU memory vLLM may take, 0 < x <= 1")
    tensor_parallel_size: int = Field(1, description="GPUs per model replica (Cloud Run has one)")
    host: str = Field("0.0.0.0", description="listen address inside the container")
    port: int = Field(DEFAULT_PORT, description="listen port; Cloud Run's container port must match")
    enforce_eager: bool = Field(
        False, description="skip torch.compile and CUDA-graph capture: faster cold start, slower decode"
    )
    safetensors_load_strategy: SafetensorsLoadStrategy | None = Field(
        None,
        description="lazy | eager | prefetch (vLLM's LoadConfig.safetensors_load_strategy): eager reads each file "
        "whole before loading, for network mounts; null keeps vLLM's default (lazy mmap, prefetch only on NFS)",
    )
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="adapter name -> folder, served on the base `model` instead of a merge"
    )
    max_lora_rank: int | None = Field(None, description=f"largest adapter rank, one of {ALLOWED_LORA_RANKS}")
    max_loras: int | None = Field(None, description="adapters active in one batch")
    max_num_seqs: int | None = Field(
        None, description="sequences vLLM schedules at once (its continuous batch); null keeps vLLM's default"
    )
    load_format: LoadFormat | None = Field(
        None, description="auto | runai_streamer (a gs:// model, read in parallel); null keeps vLLM's default"
    )
    model_loader_extra_config: dict[str, int | bool] | None = Field(
        None, description=f"the runai_streamer loader's settings, keys {sorted(RUNAI_STREAMER_KEYS)}"
    )
    language_model_only: bool = Field(
        False, description="a multimodal checkpoint served for text only: no image input, no encoder profiling"
    )
    api_key_guard: bool = Field(
        False,
        description=f"load {API_KEY_GUARD_MIDDLEWARE} (`--middleware`): with VLLM_API_KEY set, every route but "
        f"{VLLM_HEALTH_PATH} needs the key. Set it whenever the server gets a key: vLLM alone leaves /invocations open",
    )
    extra_args: list[str] = Field(default_factory=list, description="other `vllm serve` flags, passed as given")

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        if not v or v != v.strip() or any(c.isspace() for c in v):
            raise ValueError(
                f"model={v!r}: give a folder path such as {DEFAULT_MODEL_PATH} or a Hub id, without spaces"
            )
        if v.startswith("-"):
            raise ValueError(f"model={v!r} looks like a flag: give the model folder or Hub id")
        return v

    @field_validator("served_model_name")
    @classmethod
    def _served_name(cls, v: str | None) -> str | None:
        if v is not None and not _NAME.match(v):
            raise ValueError(
                f"served_model_name={v!r}: use letters, digits and . _ - : / (no spaces), e.g. {DEFAULT_SERVED_MODEL_NAME!r}"
            )
        return v

    @field_validator("max_model_len")
    @classmethod
    def _max_len(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError(f"max_model_len={v}: must be a positive number of tokens (e.g. 4096), or null")
        return v

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _gpu_mem(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError(f"gpu_memory_utilization={v}: must be a fraction with 0 < x <= 1 (e.g. 0.9)")
        return v

    @field_validator("tensor_parallel_size")
    @classmethod
    def _tp(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"tensor_parallel_size={v}: must be at least 1 (the number of GPUs per replica)")
        return v

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        if not v or any(c.isspace() for c in v):
            raise ValueError(f"host={v!r}: give an address such as 0.0.0.0 (container) or 127.0.0.1 (local)")
        return v

    @field_validator("port")
    @classmethod
    def _port(cls, v: int) -> int:
        if not 1 <= v <= 65535:
            raise ValueError(f"port={v}: must be between 1 and 65535 (vLLM's default is {DEFAULT_PORT})")
        return v

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules(cls, v: dict[str, str]) -> dict[str, str]:
        for name, path in v.items():
            if not _LORA_NAME.match(name):
                raise ValueError(
                    f"lora_modules name {name!r}: use letters, digits and . _ - (it becomes `name=path` on the command line)"
                )
            if not path or any(c.isspace() for c in path):
                raise ValueError(f"lora_modules[{name!r}]={path!r}: give the adapter folder, without spaces")
        return v

    @field_validator("max_lora_rank")
    @classmethod
    def _rank(cls, v: int | None) -> int | None:
        if v is not None and v not in ALLOWED_LORA_RANKS:
            raise ValueError(
                f"max_lora_rank={v}: vLLM allows {list(ALLOWED_LORA_RANKS)}; pick the smallest one >= your LoRA r"
            )
        return v

    @field_validator("max_loras")
    @classmethod
    def _max_loras(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"max_loras={v}: must be at least 1, or null for vLLM's default")
        return v

    @field_validator("extra_args")
    @classmethod
    def _extra(cls, v: list[str]) -> list[str]:
        if v and v[0] == "serve":
            raise ValueError("extra_args starts with 'serve': the image's entrypoint is already `vllm serve`; drop it")
        for arg in v:
            problem = extra_arg_problem(arg)  # never echoes `arg`'s value: it may be a secret
            if problem is not None:
                raise ValueError(f"extra_args contains {problem}")
        return v

    @field_validator("max_num_seqs")
    @classmethod
    def _max_num_seqs(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"max_num_seqs={v}: must be at least 1, or null for vLLM's default")
        return v

    @model_validator(mode="after")
    def _no_float16_for_gemma(self) -> VllmServerConfig:
        model_type = self.model_type or model_type_of(self.model)
        if self.dtype is Dtype.FLOAT16 and model_type in FLOAT16_UNSUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"dtype=float16 with model_type {model_type!r}: vLLM refuses float16 for Gemma 2/3 (numerical "
                "instability; vllm/config/model.py). Use dtype=bfloat16 (or auto on a GPU with bf16, such as the L4)"
            )
        return self

    @model_validator(mode="after")
    def _streamer_settings(self) -> VllmServerConfig:
        remote = self.model.startswith(("gs://", "s3://"))
        if remote and self.load_format != "runai_streamer":
            raise ValueError(
                f"model={self.model!r} is in object storage: vLLM reads it only with load_format=runai_streamer"
            )
        if self.model_loader_extra_config is not None:
            if self.load_format != "runai_streamer":
                raise ValueError("model_loader_extra_config is set without load_format=runai_streamer")
            unknown = set(self.model_loader_extra_config) - RUNAI_STREAMER_KEYS
            if unknown:
                raise ValueError(
                    f"model_loader_extra_config has {sorted(unknown)}: vLLM's runai_streamer loader accepts only "
                    f"{sorted(RUNAI_STREAMER_KEYS)}"
                )
        return self

    @model_validator(mode="after")
    def _lora_settings_need_adapters(self) -> VllmServerConfig:
        if not self.lora_modules:
            for field in ("max_lora_rank", "max_loras"):
                if getattr(self, field) is not None:
                    raise ValueError(
                        f"{field}={getattr(self, field)} is set but lora_modules is empty: "
                        "add adapters to lora_modules or remove the setting"
                    )
        return self


def load_config(data: dict[str, Any]) -> VllmServerConfig:
    """Validate plain data (e.g. from a stack file) into a config, or raise `VllmConfigError` listing every problem."""
    try:
        return VllmServerConfig.model_validate(data)
    except ValidationError as exc:
        lines = ["vLLM server settings are invalid:"]
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = f"unknown setting (allowed: {', '.join(VllmServerConfig.model_fields)})"
            elif err["type"] == "enum":
                msg = f"{err['input']!r} is not allowed; use one of {[d.value for d in Dtype]}"
            lines.append(f"  {loc}: {msg}")
        raise VllmConfigError("\n".join(lines)) from None


def _number(value: float) -> str:
    return format(value, "g")


def render_args(cfg: VllmServerConfig) -> list[str]:
    """The container `args` for `vllm serve`: the model first, then flags, then `extra_args` verbatim."""
    args = [cfg.model]
    if cfg.served_model_name is not None:
        args += ["--served-model-name", cfg.served_model_name]
    if cfg.max_model_len is not None:
        args += ["--max-model-len", str(cfg.max_model_len)]
    args += [
        "--dtype",
        cfg.dtype.value,
        "--gpu-memory-utilization",
        _number(cfg.gpu_memory_utilization),
        "--tensor-parallel-size",
        str(cfg.tensor_parallel_size),
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
    ]
    args += [
        "--generation-config",
        SERVED_GENERATION_CONFIG,
        "--override-generation-config",
        json.dumps(SERVED_SAMPLING_OVERRIDE, separators=(",", ":")),
    ]
    if cfg.max_num_seqs is not None:
        args += ["--max-num-seqs", str(cfg.max_num_seqs)]
    if cfg.enforce_eager:
        args.append("--enforce-eager")
    if cfg.safetensors_load_strategy is not None:
        args += ["--safetensors-load-strategy", cfg.safetensors_load_strategy]
    if cfg.load_format is not None:
        args += ["--load-format", cfg.load_format]
    if cfg.model_loader_extra_config is not None:
        args += ["--model-loader-extra-config", json.dumps(cfg.model_loader_extra_config, separators=(",", ":"))]
    if cfg.language_model_only:
        args.append("--language-model-only")
    if cfg.api_key_guard:
        args += ["--middleware", API_KEY_GUARD_MIDDLEWARE]
    if cfg.lora_modules:
        args += ["--enable-lora", "--lora-modules", *(f"{name}={path}" for name, path in cfg.lora_modules.items())]
        if cfg.max_lora_rank is not None:
            args += ["--max-lora-rank", str(cfg.max_lora_rank)]
        if cfg.max_loras is not None:
            args += ["--max-loras", str(cfg.max_loras)]
    return args + list(cfg.extra_args)
