"""Training data: load a recipe's rows, check them, split them reproducibly and format them for SFT.

    .venv/bin/python -c "from trainer.data import preview; preview('emoji-local')"
    .venv/bin/python -m trainer.data check my-recipe.yaml        # or a data file: check data.jsonl

Decisions (sources: docs/decisions/training-data-rows.md):
- Rows come from the Hub, or from local files and fsspec URLs (`gs://bucket/tickets/*.jsonl`) read by one
  function, `read_files`, so a `memory://` URL in a test takes the path a `gs://` one takes on the cluster.
- Before the model loads, the first CHECK_ROWS rows of a standard format are checked; a bad one stops the run
  with a `DataError` naming the file, the row and the field. Other bad rows are counted, skipped and reported.
- The split is reproducible: a seeded shuffle, then `max_rows`, then the FIRST `eval_rows` are held out.
- Rows go through `Dataset.map`; a tokenizer is fingerprinted by digest, not pickled whole, with the same reuse.
- `trainer.data` is this module (trainer/samples/ beside it has no __init__.py). It does not tokenise for
  training (trl's SFTTrainer does) or build vision batches (trainer/collators.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.data_files import REPO_ROOT, LoadedRows, RowOrigin, expand_url, read_files, resolve_local_path
from trainer.errors import DataError, RecipeError
from trainer.formatting import FormattingError, formatter_for, row_formatter
from trainer.recipe import USER_FORMATS, DataFormat, DataSource, DataSpec, Task, infer_source

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

_SKIP_COLUMN = "_skip_reason"
_RAW_IMAGES = "_row_images"
# how many rows of a standard format are checked before the model loads (each is formatted, its images opened
# and its length measured: a second or two for a hundred rows)
CHECK_ROWS = 100


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
    return read_rows(spec).dataset()


def read_rows(spec: DataSpec, head_rows: int = CHECK_ROWS) -> LoadedRows:
    """The rows of a Hub split, or of the files of a local path or URL (in order), with where each came from."""
    if spec.source is DataSource.HUB:
        import datasets

        rows = datasets.load_dataset(spec.path, split=spec.split, revision=spec.revision)
        label = f"Hub dataset {spec.path} (split {spec.split}, revision {spec.revision or 'main'})"
        head = rows.select(range(min(head_rows, len(rows)))).to_list()
        return LoadedRows(head, RowOrigin(((label, len(rows), ()),)), lambda: rows)
    if spec.source is DataSource.LOCAL:
        from fsspec.implementations.local import LocalFileSystem

        return read_files(LocalFileSystem(), [str(resolve_local_path(spec.path))], [spec.path], head_rows)
    fs, paths = expand_url(spec.path)
    return read_files(fs, paths, [fs.unstrip_protocol(p) for p in paths], head_rows)


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
    """Make datasets fingerprint this tokenizer's class by digest (docs/decisions/training-data-rows.md).

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
    task: Task | str | DataSpec,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_length: int | None = None,
    image_dir: str | None = None,
) -> tuple[Dataset, SkipReport]:
    """Format every row into a conversation; drop (and count) the rows that cannot be trained on.

    `task`: a tutorial task, or the recipe's DataSpec (any `data.format`)."""
    spec = task if isinstance(task, DataSpec) else None
    data_format = spec.format if spec is not None else DataFormat(str(task))
    has_images = _has_images(rows, data_format)
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


def check_first_rows(
    loaded: LoadedRows,
    spec: DataSpec,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_length: int | None = None,
    limit: int = CHECK_ROWS,
    text_only: bool | None = None,
) -> int:
    """Format the first `limit` rows as training will (images opened, length measured); DataError on a bad one.

    The error names the first bad row (file, row, field), what is wrong and the fix, and counts the others among
    the rows checked. `text_only`: the recipe's `model.text_only`, when the caller knows it (rows with images need
    a vision model). Returns how many rows were checked."""
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
    root = resolve_image_dir(spec.image_dir)
    bad: list[tuple[int, FormattingError]] = []
    for index, row in enumerate(head):
        try:
            example = _with_open_images(formatter(row), root)
            if tokenizer is not None and max_length is not None:
                length = conversation_length(tokenizer, example["messages"])
                if length > max_length:
                    raise FormattingError(
                        f"longer than max_length={max_length}",
                        f"{length} tokens once the chat template is applied; raise training.max_length or shorten "
                        "the row",
                        "(the whole row)",
                    )
        except FormattingError as exc:
            bad.append((index, exc))
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
        raise DataError(
            f"{loaded.origin.where(index)}, field {first.field or '(row)'}: {first.reason}{detail} [data.format="
            f"{spec.format.value}].{more} Fix the row (docs/own-data.md shows each format's rows); "
            f"`python -m trainer.data check RECIPE` checks the data on your machine"
        )
    return len(head)


def prepare_datasets(
    spec: DataSpec, tokenizer: PreTrainedTokenizerBase | None = None, max_length: int | None = None
) -> DataSplit:
    """Load, check (a standard format's first rows), split and format the recipe's data; logs skipped rows."""
    loaded = read_rows(spec)
    checked = check_first_rows(loaded, spec, tokenizer, max_length) if spec.format in USER_FORMATS else 0
    rows = loaded.dataset()
    if checked:
        log.info("data: %d rows from %s; the first %d are well-formed", len(rows), spec.path, checked)
    if spec.rows is not None and spec.source is not DataSource.HUB and spec.rows != len(rows):
        log.warning(
            "data.rows=%d but %s holds %d rows: the recipe's step plan counted %d (the run trains on all of them)",
            spec.rows,
            spec.path,
            len(rows),
            spec.rows,
        )
    train_rows, eval_rows = split_rows(rows, spec)
    train, report = format_rows(train_rows, spec, tokenizer, max_length, spec.image_dir)
    evaluation = None
    if eval_rows is not None:
        evaluation, eval_report = format_rows(eval_rows, spec, tokenizer, max_length, spec.image_dir)
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


# --------------------------------------------------------------------------------------
# `python -m trainer.data check RECIPE_OR_FILE`: the trainer's data checks, on a laptop


def spec_for_file(path: str, data_format: str | None) -> DataSpec:
    """A DataSpec for a bare data file or URL: `data_format` as given, else read from the first row's fields."""
    from pydantic import ValidationError

    try:
        return _spec_for_file(path, data_format)
    except ValidationError as exc:
        problems = "; ".join(error["msg"].removeprefix("Value error, ") for error in exc.errors())
        raise DataError(f"{path}: {problems}") from None


def _spec_for_file(path: str, data_format: str | None) -> DataSpec:
    if data_format is None:
        probe = DataSpec(format=DataFormat.MESSAGES, path=path, source=infer_source(path))  # for its files only
        fields = {name for row in read_rows(probe).head for name in row}
        if "messages" in fields:
            data_format = DataFormat.MESSAGES
        elif {"prompt", "completion"} <= fields:
            data_format = DataFormat.PROMPT_COMPLETION
        else:
            raise DataError(
                f"{path}: its rows have {sorted(fields)}, neither `messages` nor `prompt` + `completion`. Fix: pass "
                "--format, or check a recipe whose data.columns maps these fields (docs/own-data.md)"
            )
    return DataSpec(format=DataFormat(data_format), path=path, source=infer_source(path))


def check_tokenizer(recipe: Any, tokenizer: str | None) -> tuple[Any, str]:
    """The tokenizer the length check uses, and a note: `--tokenizer`, else the recipe's model if it is on this
    machine (a folder, the built local 270M, or a Hub id in the local cache); never a download. transformers (and
    torch with it) is imported only when there is a tokenizer to load: a file check without one needs neither."""
    from trainer.model_files import LocalModelError, resolve_model_path

    if tokenizer is None and recipe is not None:
        try:
            tokenizer = resolve_model_path(recipe.model.name_or_path)
        except LocalModelError:
            tokenizer = None  # the local model is not built here: the lengths are not measured
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
    """What `python -m trainer.data check` prints on success; a DataError / RecipeError otherwise."""
    from trainer.recipe import check_run, parse_recipe, step_plan

    is_recipe = target.endswith((".yaml", ".yml")) or ("/" not in target and "." not in target)
    recipe = parse_recipe(target, overrides or []) if is_recipe else None
    spec = recipe.data if recipe is not None else spec_for_file(target, data_format)
    max_length = recipe.training.max_length if recipe is not None else None
    loaded, note = check_tokenizer(recipe, tokenizer)
    if recipe is None and loaded is not None:
        note += " (no max_length: check a recipe to compare)"
    rows = read_rows(spec, limit)
    if spec.format in USER_FORMATS:
        text_only = recipe.model.text_only if recipe is not None else None
        checked = check_first_rows(rows, spec, loaded, max_length, limit, text_only)
        count = len(rows.dataset())
        lines = [f"ok: {count} rows in {spec.path} (data.format={spec.format.value}); the first {checked} checked"]
    else:
        count = len(rows.dataset())
        lines = [f"ok: {count} rows in {spec.path} (tutorial task {spec.format.value}: bad rows are skipped)"]
    lines.append(f"  {note}")
    if recipe is not None:
        problems = check_run(recipe)
        if problems:
            raise RecipeError("\n".join([f"recipe {target} is invalid:", *(f"  {p}" for p in problems)]))
        plan = step_plan(recipe)
        lines.append(f"  {plan.train_rows} training rows, {plan.total_updates} optimizer steps")
    return "\n".join(lines)


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
        help="a data file's format (a column mapping needs a recipe: data.columns)",
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
