"""Training data: load a recipe's rows, split them reproducibly and format them for SFT.

    .venv/bin/python -c "from trainer.data import preview; preview('emoji-local')"

Decisions:
- Rows come from the Hugging Face Hub (`datasets.load_dataset(path, split=…, revision=…)`, the
  cloud path) or from a local .jsonl/.json/.parquet file resolved against the repository root.
- The split is reproducible: a seeded shuffle, then `max_rows`, then the FIRST `eval_rows` are
  held out. The same recipe always trains and evaluates on the same rows.
- Bad rows never crash a run: rows with missing or empty fields, or longer than `max_length`
  tokens once the chat template is applied, are counted, skipped and reported in one line,
  e.g. `skipped 3 of 200 rows: 2 missing field 'emoji', 1 longer than max_length=128`.
- Formatting is lazy-friendly: rows go through `Dataset.map`, so a large Hub dataset is not
  materialised as a Python list.
- A tokenizer is fingerprinted by digest (`fingerprint_tokenizers_by_digest`). `Dataset.map` hashes
  its function and arguments to name its cache (datasets `fingerprint.update_fingerprint`), and
  datasets' own tokenizer reducer pickles the whole object: for Gemma's 262k vocabulary the
  vocabulary dict, the merges and the backend's JSON, ~28 MB, 12-15 s per map on a busy 2-core
  machine (ours and trl's maps in `SFTTrainer._prepare_dataset` alike). The digest covers the same
  state (the backend's JSON with truncation / padding off, as datasets does, the constructor
  arguments, every small attribute), so a cache is reused exactly when it was before.

This module does not tokenise for training (trl's SFTTrainer does) and does not build
vision batches (trainer/collators.py does).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.formatting import FormattingError, formatter_for
from trainer.recipe import REPO_ROOT, DataSource, DataSpec, RecipeError, Task, resolve_local_path

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

_SKIP_COLUMN = "_skip_reason"
_LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass
class SkipReport:
    """How many rows a formatting pass saw and why it dropped some of them."""

    total: int = 0
    reasons: Counter[str] = field(default_factory=Counter)

    @property
    def skipped(self) -> int:
        return sum(self.reasons.values())

    def merge(self, other: SkipReport) -> SkipReport:
        return SkipReport(self.total + other.total, self.reasons + other.reasons)

    def summary(self) -> str:
        if not self.skipped:
            return f"skipped 0 of {self.total} rows"
        parts = ", ".join(f"{count} {reason}" for reason, count in self.reasons.most_common())
        return f"skipped {self.skipped} of {self.total} rows: {parts}"


@dataclass
class DataSplit:
    """Formatted conversations ready for SFTTrainer, and what was dropped on the way."""

    train: Dataset
    eval: Dataset | None
    report: SkipReport


def load_rows(spec: DataSpec) -> Dataset:
    """The raw rows named by the recipe, before shuffling or formatting."""
    import datasets

    if spec.source is DataSource.HUB:
        return datasets.load_dataset(spec.path, split=spec.split, revision=spec.revision)
    path = resolve_local_path(spec.path)
    builder = _LOCAL_BUILDERS[path.suffix]
    return datasets.load_dataset(builder, data_files=str(path), split="train")


def split_rows(rows: Dataset, spec: DataSpec) -> tuple[Dataset, Dataset | None]:
    """Seeded shuffle, then `max_rows`, then the first `eval_rows` held out: (train, eval or None)."""
    rows = rows.shuffle(seed=spec.seed)
    if spec.max_rows is not None:
        rows = rows.select(range(min(spec.max_rows, len(rows))))
    if spec.eval_rows >= len(rows):
        raise RecipeError(
            f"data.eval_rows={spec.eval_rows} but the dataset has only {len(rows)} rows: lower data.eval_rows"
        )
    if spec.eval_rows == 0:
        return rows, None
    return rows.select(range(spec.eval_rows, len(rows))), rows.select(range(spec.eval_rows))


def conversation_length(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> int:
    """Tokens in the rendered conversation (text only: image tokens are added later by the processor)."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])


_HEAVY_TOKENIZER_STATE = ("_tokenizer", "_vocab", "_merges", "init_kwargs", "cache", "deprecation_warnings")


def _tokenizer_state_digest(tokenizer: Any) -> str:
    """sha256 of what datasets' reducer would pickle from the heavy attributes, without pickling them one by one.

    The `tokenizers` backend is serialised to its JSON (which holds the vocabulary and merges the
    `_vocab` / `_merges` constructor inputs were turned into) with truncation and padding switched
    off for the moment, as datasets' `_save_transformersPreTrainedTokenizerBase` does (datasets
    utils/_dill.py); `init_kwargs` are pickled as they are.
    """
    import hashlib
    import pickle

    digest = hashlib.sha256()
    backend = tokenizer.__dict__.get("_tokenizer")
    if backend is not None and hasattr(backend, "to_str"):
        truncation, padding = getattr(backend, "truncation", None), getattr(backend, "padding", None)
        if truncation is not None:
            backend.no_truncation()
        if padding is not None:
            backend.no_padding()
        try:
            digest.update(backend.to_str().encode())
        finally:
            if truncation is not None:
                backend.enable_truncation(**truncation)
            if padding is not None:
                backend.enable_padding(**padding)
    for key in ("_vocab", "_merges"):
        if key in tokenizer.__dict__ and backend is None:  # a slow tokenizer: these ARE its vocabulary
            digest.update(pickle.dumps(tokenizer.__dict__[key], protocol=4))
    try:
        digest.update(pickle.dumps(tokenizer.__dict__.get("init_kwargs"), protocol=4))
    except (pickle.PicklingError, TypeError, AttributeError):
        digest.update(repr(sorted(tokenizer.__dict__.get("init_kwargs", {}).items(), key=str)).encode())
    return digest.hexdigest()


def _save_tokenizer_by_digest(pickler: Any, tokenizer: Any) -> None:
    state = {k: v for k, v in tokenizer.__dict__.items() if k not in _HEAVY_TOKENIZER_STATE}
    state["_heavy_state_sha256"] = _tokenizer_state_digest(tokenizer)
    pickler.save_reduce(type(tokenizer), (), state=state, obj=tokenizer)


def fingerprint_tokenizers_by_digest(tokenizer: Any) -> None:
    """Make datasets fingerprint this tokenizer's class by digest (module docstring); only its hashing changes.

    datasets' `Pickler` is used for fingerprints only (`datasets.fingerprint.Hasher`), and picks a
    reducer by the exact type (`utils/_dill.py` `pklregister`); ordinary pickling is untouched.
    """
    from datasets.utils._dill import pklregister

    text = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
    for each in {type(tokenizer), type(text)}:
        if hasattr(each, "apply_chat_template") and hasattr(each, "convert_tokens_to_ids"):
            pklregister(each)(_save_tokenizer_by_digest)


def format_rows(
    rows: Dataset,
    task: Task | str,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_length: int | None = None,
    image_dir: str | None = None,
) -> tuple[Dataset, SkipReport]:
    """Format every row into a conversation; drop (and count) the rows that cannot be trained on."""
    formatter = formatter_for(task)
    images_root = resolve_image_dir(image_dir)
    if tokenizer is not None:
        fingerprint_tokenizers_by_digest(tokenizer)

    def format_one(row: dict[str, Any]) -> dict[str, Any]:
        try:
            example = formatter(row)
        except FormattingError as exc:
            return {**_empty_example(task), _SKIP_COLUMN: exc.reason}
        if images_root is not None:
            example["images"] = [open_image(image, images_root) for image in example["images"]]
        if tokenizer is not None and max_length is not None:
            length = conversation_length(tokenizer, example["messages"])
            if length > max_length:
                return {**_empty_example(task), _SKIP_COLUMN: f"longer than max_length={max_length}"}
        return {**example, _SKIP_COLUMN: ""}

    mapped = rows.map(format_one, remove_columns=rows.column_names, desc="formatting")
    reasons = Counter(reason for reason in mapped[_SKIP_COLUMN] if reason)
    kept = mapped.filter(lambda reason: not reason, input_columns=[_SKIP_COLUMN]).remove_columns(_SKIP_COLUMN)
    return kept, SkipReport(total=len(rows), reasons=reasons)


def resolve_image_dir(image_dir: str | None) -> Path | None:
    if image_dir is None:
        return None
    path = Path(image_dir) if Path(image_dir).is_absolute() else REPO_ROOT / image_dir
    if not path.is_dir():
        raise RecipeError(f"data.image_dir={image_dir!r}: {path} is not a folder")
    return path


def open_image(image: Any, root: Path | None) -> Any:
    """Local rows name their image by a path relative to `data.image_dir`; Hub rows already carry images."""
    if not isinstance(image, str) or root is None:
        return image
    from PIL import Image

    return Image.open(root / image).convert("RGB")


def _empty_example(task: Task | str) -> dict[str, Any]:
    """A placeholder with the same columns as a real example, for rows that are filtered out right after."""
    if Task(task) is Task.PRODUCT_DESCRIPTION:
        return {"messages": [], "images": []}
    return {"messages": []}


def prepare_datasets(
    spec: DataSpec, tokenizer: PreTrainedTokenizerBase | None = None, max_length: int | None = None
) -> DataSplit:
    """Load, split and format the recipe's data; logs one summary line of skipped rows."""
    train_rows, eval_rows = split_rows(load_rows(spec), spec)
    train, report = format_rows(train_rows, spec.task, tokenizer, max_length, spec.image_dir)
    evaluation = None
    if eval_rows is not None:
        evaluation, eval_report = format_rows(eval_rows, spec.task, tokenizer, max_length, spec.image_dir)
        report = report.merge(eval_report)
    (log.warning if report.skipped else log.info)("%s", report.summary())
    if len(train) == 0:
        raise RecipeError(f"no training rows left for data.path={spec.path!r}: {report.summary()}")
    return DataSplit(train=train, eval=evaluation, report=report)


def preview(recipe_name: str, rows: int = 3) -> None:
    """Print the first formatted training conversations of a recipe (no tokenizer, no length check)."""
    from trainer.recipe import load_recipe

    split = prepare_datasets(load_recipe(recipe_name).data)
    for example in split.train.select(range(min(rows, len(split.train)))):
        print(example["messages"])
    print(split.report.summary())
