"""Training data: load a recipe's rows, check them, split them reproducibly and format them for SFT.

    .venv/bin/python -c "from trainer.data import preview; preview('emoji-local')"
    .venv/bin/python -m trainer.data check my-recipe.yaml        # or a data file: check data.jsonl

Decisions (sources: docs/trainer.md#training-rows):
- Rows come from the Hub or from files and fsspec URLs (trainer/data_files.py `read_files`); a mixture
  (`data.sources`) makes each source's first rows trl conversations and concatenates them (trl's fractions).
- Before the model loads, the first CHECK_ROWS rows of a standard format are checked; a bad one stops the run
  with a `DataError` naming the file, the row and the field. Other bad rows, and rows over `max_length`, are
  counted, dropped and reported.
- The split is reproducible: a seeded shuffle, then `max_rows`, then the FIRST `eval_rows` (or `eval_path`'s rows).
- Rows go through `Dataset.map`; a tokenizer is fingerprinted by digest, not pickled whole, with the same reuse.
- `trainer.data` is this module (trainer/samples/ has no __init__.py). It does not tokenise for training."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.data_files import REPO_ROOT, LoadedRows, RowOrigin, expand_url, read_files, resolve_local_path
from trainer.errors import DataError, RecipeError
from trainer.formatting import FormattingError, formatter_for, row_formatter
from trainer.recipe import (
    USER_FORMATS,
    DataFormat,
    DataSource,
    DataSpec,
    RowsSpec,
    SourceSpec,
    Task,
    infer_source,
    mixture_counts,
)

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

_SKIP_COLUMN = "_skip_reason"
_RAW_IMAGES = "_row_images"
# how many rows of a standard format are checked before the model loads (each is formatted, its images opened
# and its length measured: a second or two for a hundred rows)
CHECK_ROWS = 100
# the format of a mixture's rows once each source made them conversations
CONVERSATIONS = RowsSpec.model_construct(format=DataFormat.MESSAGES)


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


@dataclass
class MixedSource:
    """One source of a mixture: its key (`data.sources[1]`), spec and rows, how many it holds and the mix takes."""

    key: str
    spec: RowsSpec
    loaded: LoadedRows
    rows: int
    taken: int


@dataclass
class Mixture:
    """A mixture's rows: each source's first `taken` rows made trl conversations (`messages`, plus `images` when a
    source has images), in source order, and what formatting them skipped."""

    rows: Dataset
    sources: list[MixedSource]
    report: SkipReport


def load_rows(spec: DataSpec) -> Dataset:
    """The rows the split starts from, before shuffling: one source's raw rows, or a mixture's conversations."""
    return mix_sources(spec).rows if spec.sources is not None else read_rows(spec).dataset()


def read_rows(spec: RowsSpec, head_rows: int = CHECK_ROWS, key: str = "data") -> LoadedRows:
    """The rows of a Hub split, or of the files of a local path or URL (in order), with where each came from.
    `key`: the recipe key of the source (`data`, `data.sources[1]`), as errors name it."""
    path = str(spec.path)
    if spec.source is DataSource.HUB:
        import datasets

        rows = datasets.load_dataset(path, split=spec.split, revision=spec.revision)
        label = f"Hub dataset {path} (split {spec.split}, revision {spec.revision or 'main'})"
        if not len(rows):
            raise DataError(f"{label}: no rows. Fix: {key}.split names the split that holds the rows")
        head = rows.select(range(min(head_rows, len(rows)))).to_list()
        return LoadedRows(head, RowOrigin(((label, len(rows), ()),)), lambda: rows)
    if spec.source is DataSource.LOCAL:
        from fsspec.implementations.local import LocalFileSystem

        local = str(resolve_local_path(path, f"{key}.path"))
        return read_files(LocalFileSystem(), [local], [path], head_rows)
    fs, paths = expand_url(path, f"{key}.path")
    return read_files(fs, paths, [fs.unstrip_protocol(p) for p in paths], head_rows)


def mix_sources(
    spec: DataSpec,
    head_rows: int = CHECK_ROWS,
    check: Callable[[LoadedRows, RowsSpec, str], Any] | None = None,
) -> Mixture:
    """The mixture of `data.sources`: each source read, checked (`check(loaded, source, key)`, before anything is
    formatted), its first rows taken as `mixture_counts` says, and made conversations with its own format, so that
    sources of different formats become one dataset (trl's `concatenate_datasets` of one schema)."""
    from datasets import concatenate_datasets

    parts: list[MixedSource] = []
    for i, source in enumerate(spec.parts):
        key = spec.part_key(i)
        loaded = read_rows(source, head_rows, key)
        if check is not None:
            check(loaded, source, key)
        parts.append(MixedSource(key, source, loaded, loaded.origin.rows, 0))
    taken = mixture_counts([p.rows for p in parts], spec.sources or [])
    has_images = any("images" in p.loaded.dataset().column_names for p in parts)
    formatted, report = [], SkipReport()
    for part, count in zip(parts, taken, strict=True):
        part.taken = count
        rows = part.loaded.dataset().select(range(count))
        conversations, skipped = format_rows(rows, part.spec, image_dir=spec.image_dir, has_images=has_images)
        formatted.append(conversations)
        report = report.merge(skipped)
    # a text source's empty `images` lists take the image sources' feature
    with_images = [
        d.features for d in formatted if has_images and getattr(d.features["images"].feature, "dtype", "") != "null"
    ]
    if with_images:
        formatted = [d.cast(with_images[0]) for d in formatted]
    return Mixture(concatenate_datasets(formatted), parts, report)


def split_rows(rows: Dataset, spec: DataSpec, held_out: Dataset | None = None) -> tuple[Dataset, Dataset | None]:
    """Seeded shuffle, then `max_rows`, then the held-out rows: the first `eval_rows`, or `data.eval_path`'s rows
    in their file order (`held_out` when the caller already read them). Returns (train, eval or None)."""
    rows = rows.shuffle(seed=spec.seed)
    if spec.max_rows is not None:
        rows = rows.select(range(min(spec.max_rows, len(rows))))
    if spec.eval_path is not None:
        return rows, held_out if held_out is not None else read_rows(spec.eval_source, key="data.eval").dataset()
    if spec.eval_rows >= len(rows):
        raise RecipeError(
            f"data.eval_rows={spec.eval_rows} but the dataset has only {len(rows)} rows: lower data.eval_rows"
        )
    if spec.eval_rows == 0:
        return rows, None
    return rows.select(range(spec.eval_rows, len(rows))), rows.select(range(spec.eval_rows))


def held_out_raw(spec: DataSpec) -> Dataset | None:
    """The held-out rows before formatting, as `split_rows` holds them out: `data.eval_path`'s read alone (the
    training data is not read again for them), else the seeded slice of the data; None without held-out rows."""
    if spec.eval_path is not None:
        return read_rows(spec.eval_source, key="data.eval").dataset()
    return split_rows(load_rows(spec), spec)[1]


def held_out_identity(spec: DataSpec) -> dict[str, Any] | None:
    """Which rows a run holds out, as the run summary records it (`eval.held_out`): their count and the sha256 of
    their content in order (images by their bytes); None without held-out rows. Two runs with the same sha256 were
    scored on the same rows (the serving gate compares only those)."""
    rows = held_out_raw(spec)
    if rows is None:
        return None
    import hashlib
    import json

    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=_content_of, ensure_ascii=False).encode())
        digest.update(b"\n")
    where = f"data.eval_path={spec.eval_path}" if spec.eval_path else f"data.eval_rows={spec.eval_rows}"
    return {"rows": len(rows), "sha256": digest.hexdigest(), "from": where}


def _content_of(value: Any) -> str:
    """What a row's non-JSON value (an image, bytes) is, for a digest: the sha256 of its bytes."""
    import hashlib

    if isinstance(value, bytes | bytearray):
        return hashlib.sha256(value).hexdigest()
    if hasattr(value, "tobytes") and hasattr(value, "size"):  # a PIL image: its pixels
        return f"{getattr(value, 'mode', '')}{value.size}:" + hashlib.sha256(value.tobytes()).hexdigest()
    return repr(value)


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
    """Make datasets fingerprint this tokenizer's class by digest (docs/trainer.md#training-rows).

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
    task: Task | str | RowsSpec,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_length: int | None = None,
    image_dir: str | None = None,
    has_images: bool | None = None,
) -> tuple[Dataset, SkipReport]:
    """Format every row into a conversation; drop (and count) the rows that cannot be trained on, rows longer than
    `max_length` tokens among them (dropped, not truncated: a cut row loses its answer).

    `task`: a tutorial task, or the recipe's data (or a source of it: any `data.format`); `has_images`: whether
    the conversations carry content parts and `images` (default: whether the rows have an `images` column)."""
    spec = task if isinstance(task, RowsSpec) else None
    data_format = spec.format if spec is not None else DataFormat(str(task))
    has_images = _has_images(rows, data_format) if has_images is None else has_images
    formatter = row_formatter(spec, has_images) if spec is not None else formatter_for(Task(str(task)))
    images_root = resolve_image_dir(image_dir)
    user_format = data_format in USER_FORMATS
    if tokenizer is not None:
        fingerprint_tokenizers_by_digest(tokenizer)

    # An output column named like an input one keeps the input's type inference: PIL images written back into
    # a column of path strings become {bytes, path} structs instead of datasets' Image feature (datasets 5.2).
    if "images" in rows.column_names:
        rows = rows.rename_column("images", _RAW_IMAGES)

    def format_one(row: dict[str, Any]) -> dict[str, Any]:
        if _RAW_IMAGES in row:
            row = {**row, "images": row.pop(_RAW_IMAGES)}
        try:
            example = formatter(row)
            if images_root is not None or user_format:
                example = _with_open_images(example, images_root)
        except FormattingError as exc:
            return {**_empty_example(has_images), _SKIP_COLUMN: exc.reason}
        if tokenizer is not None and max_length is not None:
            length = conversation_length(tokenizer, example["messages"])
            if length > max_length:
                return {**_empty_example(has_images), _SKIP_COLUMN: f"longer than max_length={max_length}"}
        return {**example, _SKIP_COLUMN: ""}

    mapped = rows.map(format_one, remove_columns=rows.column_names, desc="formatting")
    reasons = Counter(reason for reason in mapped[_SKIP_COLUMN] if reason)
    kept = mapped.filter(lambda reason: not reason, input_columns=[_SKIP_COLUMN]).remove_columns(_SKIP_COLUMN)
    return kept, SkipReport(total=len(rows), reasons=reasons)


def _has_images(rows: Dataset, data_format: DataFormat) -> bool:
    """The vision tutorial always carries images; a standard format does when its rows have an `images` column."""
    if data_format is DataFormat.PRODUCT_DESCRIPTION:
        return True
    return data_format in USER_FORMATS and "images" in rows.column_names


def _with_open_images(example: dict[str, Any], root: Path | str | None) -> dict[str, Any]:
    if "images" not in example:
        return example
    opened = []
    for i, image in enumerate(example["images"]):
        try:
            opened.append(open_image(image, root))
        except FormattingError as exc:
            raise FormattingError(exc.reason, exc.detail, f"images[{i}]") from None
        except Exception as exc:  # PIL's UnidentifiedImageError, a missing file, a fsspec error: the image is bad
            raise FormattingError("image does not open", f"{image!r}: {exc}", f"images[{i}]") from None
    return {**example, "images": opened}


def resolve_image_dir(image_dir: str | None) -> Path | str | None:
    """`data.image_dir`: a URL as it is, else a local folder (absolute, or relative to the repository root)."""
    if image_dir is None:
        return None
    if "://" in image_dir:
        return image_dir.rstrip("/")
    path = Path(image_dir) if Path(image_dir).is_absolute() else REPO_ROOT / image_dir
    if not path.is_dir():
        raise RecipeError(f"data.image_dir={image_dir!r}: {path} is not a folder")
    return path


def open_image(image: Any, root: Path | str | None) -> Any:
    """An image of a row, opened: a PIL image as it is; `{bytes, path}` (a parquet Image column) from its bytes;
    a path string absolute, a URL through fsspec, else relative to `data.image_dir`.

    Hub rows of the vision tutorial already carry PIL images (and keep them as they are)."""
    from PIL import Image

    if isinstance(image, dict) and image.get("bytes"):
        import io

        return _loaded(Image.open(io.BytesIO(image["bytes"])))
    if isinstance(image, dict) and image.get("path"):
        image = image["path"]
    if not isinstance(image, str):
        return image
    if "://" in image or (isinstance(root, str) and not Path(image).is_absolute()):
        import fsspec

        url = image if "://" in image else f"{root}/{image}"
        with fsspec.open(url, "rb") as handle:
            return _loaded(Image.open(handle))
    if Path(image).is_absolute():
        return _loaded(Image.open(image))
    if root is None:
        raise FormattingError("relative image path without data.image_dir", f"{image!r}: set data.image_dir")
    return _loaded(Image.open(Path(root) / image))


def _loaded(image: Any) -> Any:
    """Decoded now (PIL opens lazily): a truncated file fails here, in the check, not in the collator."""
    return image.convert("RGB")


def _empty_example(has_images: bool) -> dict[str, Any]:
    """A placeholder with the same columns as a real example, for rows that are filtered out right after."""
    return {"messages": [], "images": []} if has_images else {"messages": []}


@dataclass(frozen=True)
class Checked:
    """What checking a source's first rows found: how many were checked, and how many of them are longer than
    `training.max_length` (None: not measured, no tokenizer), the longest first."""

    rows: int
    too_long: int | None = None
    longest: tuple[str, int] | None = None  # (where, tokens) of the longest row over the limit

    def length_line(self, max_length: int | None) -> str | None:
        """`3 of the 64 rows checked are longer than ...` or None when nothing was measured."""
        if self.too_long is None or max_length is None:
            return None
        if not self.too_long:
            return f"all {self.rows} rows checked fit training.max_length={max_length}"
        where, tokens = self.longest or ("", 0)
        return (
            f"{self.too_long} of the {self.rows} rows checked are longer than training.max_length={max_length} "
            f"(the longest: {where}, {tokens} tokens): the trainer drops such rows (trainer/data.py format_rows), "
            "it does not truncate them"
        )


def check_first_rows(
    loaded: LoadedRows,
    spec: RowsSpec,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_length: int | None = None,
    limit: int = CHECK_ROWS,
    text_only: bool | None = None,
    image_dir: str | None = None,
    key: str = "data",
) -> Checked:
    """Format the first `limit` rows as training will (images opened, length measured); DataError on a bad one.

    The error names the first bad row (file, row, field), what is wrong and the fix, and counts the others among
    the rows checked. A row longer than `max_length` is not bad: it is counted (the trainer drops it), and only
    when every checked row is too long is that an error. `text_only`: the recipe's `model.text_only`, when the
    caller knows it (rows with images need a vision model). `key`: the source's recipe key (`data.sources[1]`)."""
    head = loaded.head[:limit]
    has_images = spec.format is DataFormat.PRODUCT_DESCRIPTION or any("images" in row for row in head)
    with_images = next((i for i, row in enumerate(head) if row.get("images")), None)
    if text_only and with_images is not None:
        raise DataError(
            f"{loaded.origin.where(with_images)}, field images: the rows carry images but model.text_only is true "
            "(the text model never sees them). Fix: model.text_only: false with a Gemma 3 4B+ or Gemma 4 checkpoint, "
            "or drop the images column"
        )
    formatter = row_formatter(spec, has_images)
    root = resolve_image_dir(image_dir)
    measure = tokenizer is not None and max_length is not None
    bad: list[tuple[int, FormattingError]] = []
    too_long: list[tuple[int, int]] = []
    for index, row in enumerate(head):
        try:
            example = _with_open_images(formatter(row), root)
        except FormattingError as exc:
            bad.append((index, exc))
            continue
        if measure:
            length = conversation_length(tokenizer, example["messages"])
            if max_length is not None and length > max_length:
                too_long.append((length, index))
    if bad:
        index, first = bad[0]
        others = Counter(exc.reason for _, exc in bad[1:])
        more = (
            f" {len(bad) - 1} more of the first {len(head)} rows fail too ("
            + ", ".join(f"{n} {reason}" for reason, n in others.most_common())
            + ")."
            if others
            else ""
        )
        detail = f" ({first.detail})" if first.detail else ""
        keys = "data" if key == "data.eval_path" else key  # the held-out file is read with the data level's keys
        fix = "Fix the row (docs/own-data.md shows each format's rows)"
        if len(head) > 1 and len(bad) == len(head) and not others.keys() - {first.reason}:
            # every row fails the same way: the recipe does not describe the rows, the rows are not to blame
            more = (
                f" And every one of the {len(head)} rows checked fails alike: {keys}.format={spec.format.value} "
                "does not describe these rows."
            )
            fix = (
                f"Fix: {keys}.format and its keys (columns: {keys}.columns; chat turns under other names: "
                f"{keys}.field_messages, {keys}.message_property_mappings, {keys}.roles; docs/own-data.md), or "
                "`python -m trainer.data check FILE` reads a file's format from its fields"
            )
            if key == "data.eval_path":
                fix = (
                    "Fix: data.eval_path is read with the data level's format keys: write the held-out rows in the "
                    "training rows' format (with data.sources, the data level's keys describe data.eval_path alone: "
                    "set them to its format)"
                )
        raise DataError(
            f"{loaded.origin.where(index)}, field {first.field or '(row)'}: {first.reason}{detail} [{keys}.format="
            f"{spec.format.value}].{more} {fix}; `python -m trainer.data check RECIPE` checks the data on your machine"
        )
    longest = max(too_long, default=None)
    checked = Checked(
        len(head),
        len(too_long) if measure else None,
        (loaded.origin.where(longest[1]), longest[0]) if longest else None,
    )
    if head and len(too_long) == len(head):
        raise DataError(
            f"every one of the {len(head)} rows checked of {key} is longer than training.max_length={max_length} "
            f"tokens (the longest: {checked.longest[0] if checked.longest else ''}, {longest[0] if longest else 0} "
            "tokens once the chat template is applied): the trainer drops such rows, so nothing would train. "
            "Fix: raise training.max_length, or shorten the rows"
        )
    return checked


def prepare_datasets(
    spec: DataSpec, tokenizer: PreTrainedTokenizerBase | None = None, max_length: int | None = None
) -> DataSplit:
    """Load, check (a standard format's first rows, of each source), split and format the recipe's data; logs the
    rows checked, the rows too long and the rows skipped."""

    def check(loaded: LoadedRows, source: RowsSpec, key: str) -> None:
        if source.format not in USER_FORMATS:
            return
        checked = check_first_rows(loaded, source, tokenizer, max_length, image_dir=spec.image_dir, key=key)
        log.info(
            "%s: %d rows from %s; the first %d are well-formed", key, loaded.origin.rows, source.path, checked.rows
        )
        if checked.too_long:
            log.warning("%s: %s", key, checked.length_line(max_length))

    report = SkipReport()
    if spec.sources is not None:
        mixture = mix_sources(spec, check=check)
        rows, report, train_format = mixture.rows, mixture.report, CONVERSATIONS
        log.info("data: a mixture of %s", ", ".join(f"{s.taken} rows of {s.key}" for s in mixture.sources))
        for source in mixture.sources:
            _log_declared_rows(source.spec, source.key, source.rows)
    else:
        loaded = read_rows(spec)
        check(loaded, spec, "data")
        rows, train_format = loaded.dataset(), spec
        _log_declared_rows(spec, "data", len(rows))
    held_out = None
    if spec.eval_path is not None:
        eval_loaded = read_rows(spec.eval_source, key="data.eval")
        check(eval_loaded, spec.eval_source, "data.eval_path")
        held_out = eval_loaded.dataset()
    train_rows, eval_rows = split_rows(rows, spec, held_out)
    train, train_report = format_rows(train_rows, train_format, tokenizer, max_length, spec.image_dir)
    # a mixture's rows were counted when its sources were formatted: this pass adds only what it drops
    report = report.merge(train_report if spec.sources is None else SkipReport(0, train_report.reasons))
    evaluation = None
    if eval_rows is not None:
        eval_format = spec.eval_source if spec.eval_path is not None else train_format
        evaluation, eval_report = format_rows(eval_rows, eval_format, tokenizer, max_length, spec.image_dir)
        mixed = spec.sources is not None and spec.eval_path is None
        report = report.merge(SkipReport(0, eval_report.reasons) if mixed else eval_report)
    (log.warning if report.skipped else log.info)("%s", report.summary())
    if len(train) == 0:
        raise RecipeError(f"no training rows left for {spec.label}: {report.summary()}")
    return DataSplit(train=train, eval=evaluation, report=report)


def _log_declared_rows(spec: RowsSpec, key: str, held: int) -> None:
    """A URL's declared `rows` that differ from what its files hold: the step plan (and a mixture's shares) counted
    the declared number, the run trains on what is there."""
    if spec.rows is not None and spec.source is not DataSource.HUB and spec.rows != held:
        log.warning(
            "%s.rows=%d but %s holds %d rows: the recipe's step plan counted %d (%s)",
            key,
            spec.rows,
            spec.path,
            held,
            spec.rows,
            "the run trains on all of them" if key == "data" else "the mix takes its share of the rows there",
        )


def preview(recipe_name: str, rows: int = 3) -> None:
    """Print the first formatted training conversations of a recipe (no tokenizer, no length check)."""
    from trainer.recipe import load_recipe

    split = prepare_datasets(load_recipe(recipe_name).data)
    for example in split.train.select(range(min(rows, len(split.train)))):
        print(example["messages"])
    print(split.report.summary())


# --------------------------------------------------------------------------------------
# `python -m trainer.data check RECIPE_OR_FILE`: the trainer's data checks, on a laptop


def spec_for_file(path: str, data_format: str | None) -> DataSpec:
    """A DataSpec for a bare data file or URL: `data_format` as given, else read from the rows' fields (`messages`,
    ShareGPT's `conversations`, or `prompt` + `completion`: `detect_format`)."""
    from pydantic import ValidationError

    try:
        DataSpec(format=data_format or DataFormat.MESSAGES, path=path)  # the path's checks, before it is read
        keys = detect_format(path, data_format)
        return DataSpec(**keys, path=path, source=infer_source(path))
    except ValidationError as exc:
        problems = "; ".join(error["msg"].removeprefix("Value error, ") for error in exc.errors())
        raise DataError(f"{path}: {problems}") from None


def detect_format(path: str, data_format: str | None = None) -> dict[str, Any]:
    """The data keys that read a file's rows, from their fields: {format: messages} for trl's `messages`, plus
    `field_messages` and `message_property_mappings` for ShareGPT's `conversations` of {from, value} (axolotl's
    chat_template keys), {format: prompt-completion} for `prompt` + `completion`. `data_format` given: that format
    (with the chat keys the rows need, for messages)."""
    from trainer.formatting import chat_fields_of

    probe = RowsSpec.model_construct(format=DataFormat.MESSAGES, path=path, source=infer_source(path))
    head = read_rows(probe).head
    chat = next((keys for row in head if (keys := chat_fields_of(row)) is not None), None)
    fields = sorted({name for row in head for name in row})
    if data_format not in (None, DataFormat.MESSAGES.value):
        return {"format": data_format}
    if chat is not None:
        return {"format": DataFormat.MESSAGES.value, **chat}
    if data_format is None and {"prompt", "completion"} <= set(fields):
        return {"format": DataFormat.PROMPT_COMPLETION.value}
    if data_format is not None:
        return {"format": data_format}
    raise DataError(
        f"{path}: its rows have {fields}: neither `messages` (trl), `conversations` of {{from, value}} (ShareGPT) "
        "nor `prompt` + `completion`. Fix: pass --format, or check a recipe that maps them: data.columns for a flat "
        "table, data.field_messages and data.message_property_mappings for turns under other names (docs/own-data.md)"
    )


def format_overrides(keys: dict[str, Any]) -> list[str]:
    """`--set` overrides that give a recipe these data keys (`detect_format`'s), values in YAML's JSON form."""
    import json

    return [f"data.{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in keys.items()]


def check_tokenizer(recipe: Any, tokenizer: str | None) -> tuple[Any, str]:
    """The tokenizer the length check uses, and a note: `--tokenizer`, else the recipe's model if it is on this
    machine (a folder, the built local 270M, or a Hub id in the local cache); never a download. transformers (and
    torch with it) is imported only when there is a tokenizer to load: a file check without one needs neither."""
    from trainer.model_files import LocalModelError, resolve_model_path

    if tokenizer is None and recipe is not None:
        try:
            tokenizer = resolve_model_path(recipe.model.name_or_path)
        except LocalModelError:  # the local model is not built here (python -m trainer builds it)
            return None, (
                f"lengths not measured ({recipe.model.name_or_path} is not built on this machine: "
                "`python -m trainer.local_model` builds it, or pass --tokenizer MODEL_OR_FOLDER)"
            )
    if tokenizer is None:
        return None, "lengths not measured (no tokenizer: pass --tokenizer MODEL_OR_FOLDER)"
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    except (OSError, ValueError) as exc:
        return None, f"lengths not measured ({tokenizer} is not on this machine: {type(exc).__name__})"
    if not loaded.chat_template:
        from trainer.model_files import trl_chat_template

        loaded.chat_template = trl_chat_template(recipe.model.chat_template if recipe else "gemma3")
    return loaded, f"lengths measured with {tokenizer}'s tokenizer"


def check(
    target: str,
    overrides: list[str] | None = None,
    data_format: str | None = None,
    tokenizer: str | None = None,
    limit: int = CHECK_ROWS,
) -> str:
    """What `python -m trainer.data check` prints on success; a DataError / RecipeError otherwise: each source's
    rows and its share of a mixture, the held-out rows, the rows longer than `training.max_length`, the steps."""
    from trainer.recipe import check_run, parse_recipe, step_plan

    is_recipe = target.endswith((".yaml", ".yml")) or ("/" not in target and "." not in target)
    recipe = parse_recipe(target, overrides or []) if is_recipe else None
    spec = recipe.data if recipe is not None else spec_for_file(target, data_format)
    max_length = recipe.training.max_length if recipe is not None else None
    text_only = recipe.model.text_only if recipe is not None else None
    measurer, note = check_tokenizer(recipe, tokenizer)
    if recipe is None and measurer is not None:
        note += " (no max_length: check a recipe to compare)"
    lengths: list[str] = []

    def checked(loaded: LoadedRows, source: RowsSpec, key: str) -> str:
        loaded.dataset()  # rows that share no schema fail here, as in training
        if source.format not in USER_FORMATS:
            return "bad rows are skipped"
        result = check_first_rows(loaded, source, measurer, max_length, limit, text_only, spec.image_dir, key)
        if (line := result.length_line(max_length)) is not None:
            lengths.append(f"{key}: {line}" if spec.sources is not None or key == "data.eval_path" else line)
        return f"the first {result.rows} checked"

    if spec.sources is None:
        loaded = read_rows(spec, limit)
        what = checked(loaded, spec, "data")
        kind = "tutorial task " if spec.task is not None else ""
        lines = [f"ok: {loaded.origin.rows} rows in {spec.path} ({kind}{spec.described()}); {what}"]
        if recipe is None and not spec.chat.is_default:
            keys = {k: getattr(spec, k) for k in ("format", "field_messages", "message_property_mappings")}
            lines.append(f"  read as ShareGPT; in a recipe: data: {_flow(keys)}")
    else:
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()  # the mix is formatted here: the lines below say what it holds
        whats: dict[str, str] = {}
        mixture = mix_sources(spec, limit, check=lambda lr, s, k: whats.__setitem__(k, checked(lr, s, k)))
        total = sum(s.taken for s in mixture.sources)
        lines = [f"ok: a mixture of {len(mixture.sources)} sources, {total} rows"]
        for s in mixture.sources:
            share = f"{s.taken} ({100 * s.taken / max(total, 1):.0f}% of the mix)"
            caps = (s.spec.max_rows, s.spec.fraction) if isinstance(s.spec, SourceSpec) else (None, None)
            how = [f"max_rows {caps[0]}"] if caps[0] else []
            how += [f"fraction {caps[1]:g}"] if caps[1] else []
            lines.append(
                f"  {s.key}: {s.rows} rows in {s.spec.path} ({s.spec.described().removeprefix('.')}), takes "
                f"{share}{' by ' + ' and '.join(how) if how else ''}; {whats[s.key]}"
            )
        if mixture.report.skipped:
            lines.append(f"  formatting the mix {mixture.report.summary()}")
    if spec.eval_path is not None:
        held = read_rows(spec.eval_source, limit, "data.eval")
        what = checked(held, spec.eval_source, "data.eval_path")
        lines.append(f"  held out: the {held.origin.rows} rows of data.eval_path={spec.eval_path}; {what}")
    elif spec.eval_rows:
        lines.append(f"  held out: data.eval_rows={spec.eval_rows} rows of a seeded shuffle (data.eval_path: a file)")
    lines += [f"  {line}" for line in lengths]
    lines.append(f"  {note}")
    if recipe is not None:
        problems = check_run(recipe)
        if problems:
            raise RecipeError("\n".join([f"recipe {target} is invalid:", *(f"  {p}" for p in problems)]))
        plan = step_plan(recipe)
        lines.append(f"  {plan.train_rows} training rows, {plan.total_updates} optimizer steps")
    return "\n".join(lines)


def _flow(value: Any) -> str:
    """A YAML flow mapping of plain keys and values: {format: messages, field_messages: conversations}."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m trainer.data", description="Check training data before a run.")
    commands = parser.add_subparsers(dest="command", required=True)
    checking = commands.add_parser("check", help="check a recipe's data, or a data file / URL, as the trainer would")
    checking.add_argument("target", metavar="RECIPE_OR_FILE", help="a recipe (name or .yaml path) or a data file/URL")
    checking.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    checking.add_argument(
        "--format",
        choices=[DataFormat.MESSAGES.value, DataFormat.PROMPT_COMPLETION.value],
        help="a data file's format (default: read from its fields; a column mapping needs a recipe: data.columns)",
    )
    checking.add_argument("--tokenizer", help="model id or folder whose tokenizer measures the rows (local only)")
    checking.add_argument("--rows", type=int, default=CHECK_ROWS, help="how many of the first rows to check")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        print(check(args.target, args.overrides, args.format, args.tokenizer, args.rows))
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # runpy executes this file as __main__, a second copy of the module: run the imported one's main instead
    from trainer.data import main as _main

    raise SystemExit(_main())
