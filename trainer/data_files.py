"""Data files: where a recipe's rows lie and how one file is read or counted, below the recipe and the loader.

The recipe (trainer/recipe.py) counts rows here to plan its optimizer steps; the loader (trainer/data.py) reads
them here. This module imports neither: it knows files, URLs and rows, not formats or recipes.

Decisions (docs/trainer.md#training-rows):
- Local files and fsspec URLs (`gs://bucket/tickets/*.jsonl`) go through one function, `read_files`, so a
  `memory://` URL in a test takes the path a `gs://` one takes on the cluster; a glob's matches are read in name
  order. Parquet is read as Arrow tables (and counted from its footer); JSON Lines, JSON and CSV as records.
- A file set without a single row is a `DataError` ("no rows"), not an empty dataset the trainer finds later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.errors import DataError, RecipeError

if TYPE_CHECKING:
    from datasets import Dataset

REPO_ROOT = Path(__file__).resolve().parents[1]
_GLOB = ("*", "?", "[")


def resolve_local_path(path: str, key: str = "data.path") -> Path:
    """A local data file: absolute, else relative to the repository root, else to the working directory."""
    candidates = [Path(path)] if Path(path).is_absolute() else [REPO_ROOT / path, Path.cwd() / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise RecipeError(f"{key}={path!r}: no such file (looked in {', '.join(str(c) for c in candidates)})")


def expand_url(url: str, key: str = "data.path") -> tuple[Any, list[str]]:
    """The fsspec filesystem of `url` and the files it names (a glob's matches, sorted); DataError if none."""
    from fsspec.core import url_to_fs

    try:
        fs, root = url_to_fs(url)
    except (ImportError, ValueError) as exc:  # an unknown protocol, or its package (gcsfs) is not installed
        raise DataError(f"{key}={url!r}: fsspec cannot open it ({exc})") from None
    paths = sorted(fs.glob(root)) if any(c in root for c in _GLOB) else ([root] if fs.isfile(root) else [])
    if not paths:
        raise DataError(f"{key}={url!r} names no file. Fix: check the URL (ls it: fsspec `ls` / gcloud storage ls)")
    return fs, paths


def suffix_of(path: str) -> str:
    """`.jsonl` of `a/b.JSONL`; empty without one."""
    return "." + path.rsplit(".", 1)[-1].lower() if "." in path.rsplit("/", 1)[-1] else ""


def count_rows_in(handle: Any, suffix: str) -> int:
    """Rows of one open (binary) data file, counted the way `read_files` reads it (parquet from its footer)."""
    if suffix == ".jsonl":
        return sum(1 for line in handle if line.strip())
    if suffix == ".json":
        import json

        text = handle.read().decode("utf-8")
        data = json.loads(text) if text.strip() else []
        return len(data) if isinstance(data, list) else len(next(iter(data.values()), []))
    if suffix == ".csv":
        import csv
        import io

        return sum(1 for _ in csv.DictReader(io.TextIOWrapper(handle, encoding="utf-8", newline="")))
    import pyarrow.parquet as pq

    return int(pq.read_metadata(handle).num_rows)


def count_local_rows(path: Path) -> int:
    """Rows of a local .jsonl/.json/.parquet/.csv data file (pyarrow only for parquet)."""
    with path.open("rb") as handle:
        return count_rows_in(handle, path.suffix.lower())


def count_url_rows(url: str, key: str = "data.path") -> int:
    """Rows behind a URL, counted as `read_files` reads them."""
    fs, paths = expand_url(url, key)
    total = 0
    for path in paths:
        with fs.open(path, "rb") as handle:
            total += count_rows_in(handle, suffix_of(path))
    return total


@dataclass(frozen=True)
class RowOrigin:
    """Where a loaded dataset's rows came from, in order: (label, rows, first JSON Lines line numbers) per file."""

    parts: tuple[tuple[str, int, tuple[int, ...]], ...]

    def where(self, index: int) -> str:
        """`FILE row N` (1-based; `line L` too for JSON Lines) for the row at `index` of the whole dataset."""
        for label, count, lines in self.parts:
            if index < count:
                line = f" (line {lines[index]})" if index < len(lines) else ""
                return f"{label} row {index + 1}{line}"
            index -= count
        return f"row {index + 1}"

    @property
    def rows(self) -> int:
        return sum(count for _, count, _ in self.parts)


@dataclass
class LoadedRows:
    """The rows of one source: the first ones as they were read (`head`: Python values, a missing field missing),
    where every row came from, and the Arrow dataset, built on first use (`dataset()`).

    A check reads `head`, not the dataset: rows that do not share one schema cannot become one Arrow table, and
    a malformed row is exactly such a row."""

    head: list[dict[str, Any]]
    origin: RowOrigin
    _build: Any = field(repr=False)
    _dataset: Any = field(default=None, repr=False)

    def dataset(self) -> Dataset:
        if self._dataset is None:
            self._dataset = self._build()
        return self._dataset


def read_files(fs: Any, paths: list[str], labels: list[str], head_rows: int) -> LoadedRows:
    """Every row of `paths` on `fs`, in order: parquet as Arrow tables; JSON Lines, JSON and CSV as records.

    A JSON Lines line that is not JSON is a DataError naming the file and line; CSV values stay strings; files
    with no row at all are a DataError ("no rows").
    """
    import pyarrow as pa

    tables: list[Any] = []
    records: list[dict[str, Any]] = []
    parts: list[tuple[str, int, tuple[int, ...]]] = []
    head: list[dict[str, Any]] = []
    for path, label in zip(paths, labels, strict=True):
        suffix = suffix_of(path)
        lines: tuple[int, ...] = ()
        with fs.open(path, "rb") as handle:
            if suffix == ".parquet":
                import pyarrow.parquet as pq

                table = pq.read_table(handle)
                tables.append(table)
                count = table.num_rows
                head.extend(table.slice(0, max(head_rows - len(head), 0)).to_pylist())
            else:
                rows, lines = _read_records(handle, suffix, label)
                records.extend(rows)
                count = len(rows)
                head.extend(rows[: max(head_rows - len(head), 0)])
        parts.append((label, count, lines[:head_rows]))
    if tables and records:
        raise DataError(f"data.path mixes parquet and other files ({labels}): use one kind")
    if not any(count for _, count, _ in parts):
        raise DataError(
            f"{', '.join(labels)}: no rows (the {'file is' if len(labels) == 1 else 'files are'} empty). "
            "Fix: point the recipe at the file that holds the rows"
        )

    def build() -> Dataset:
        from datasets import Dataset

        try:
            if tables:
                return Dataset(pa.concat_tables(tables, promote_options="default"))
            return Dataset.from_list(records)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
            raise DataError(
                f"the rows of {', '.join(labels)} do not share one schema ({exc}). Fix: give every row the same "
                "fields with the same types (a turn's content is either always a string or always a list of parts)"
            ) from None

    return LoadedRows(head, RowOrigin(tuple(parts)), build)


def _read_records(handle: Any, suffix: str, label: str) -> tuple[list[dict[str, Any]], tuple[int, ...]]:
    import io
    import json

    if suffix == ".csv":
        import csv

        return list(csv.DictReader(io.TextIOWrapper(handle, encoding="utf-8", newline=""))), ()
    if suffix == ".json":
        text = handle.read().decode("utf-8")
        data = json.loads(text) if text.strip() else []
        if isinstance(data, dict):  # {"column": [values]}: the column-oriented JSON datasets also reads
            data = [dict(zip(data, values, strict=True)) for values in zip(*data.values(), strict=True)]
        return list(data), ()
    if suffix != ".jsonl":
        raise DataError(f"{label}: cannot read a {suffix or 'suffix-less'} file; use .jsonl, .json, .parquet or .csv")
    rows, lines = [], []
    for number, line in enumerate(handle, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{label} line {number}: not valid JSON ({exc.msg}). Fix: one JSON object per line"
            ) from None
        if not isinstance(row, dict):
            raise DataError(f"{label} line {number}: a {type(row).__name__}, not a JSON object ({{...}} per line)")
        rows.append(row)
        lines.append(number)
    return rows, tuple(lines)
