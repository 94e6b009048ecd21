"""The local Gemma 3 270M's first build, as shipped and with transformers parsing the GGUF on each of its reads.

    .venv/bin/python bench/local_model_build.py

Both sides build from the same package into fresh caches, one after the other in this process (run it on an idle
machine; transformers is imported before either is timed), and the folders they write are compared file by file.
"each read" replaces `_gguf_parsed_once` with a context that does nothing: the build as it was before the reader
was kept for the build (trainer/local_model.py).
"""

from __future__ import annotations

import contextlib
import filecmp
import json
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `trainer` importable
    sys.path.insert(0, str(REPO_ROOT))

from trainer import local_model  # noqa: E402


def timed_build(cache: Path) -> float:
    started = time.perf_counter()
    local_model.ensure_local_model(cache)
    return time.perf_counter() - started


def main() -> None:
    import transformers  # noqa: F401 - imported before either side is timed, so neither pays for it

    with tempfile.TemporaryDirectory(prefix="local-model-bench-") as scratch:
        shipped_cache, each_read_cache = Path(scratch) / "shipped", Path(scratch) / "each-read"
        shipped_s = timed_build(shipped_cache)
        parsed_once = local_model._gguf_parsed_once
        local_model._gguf_parsed_once = contextlib.nullcontext  # type: ignore[assignment]
        try:
            each_read_s = timed_build(each_read_cache)
        finally:
            local_model._gguf_parsed_once = parsed_once
        names = sorted(p.name for p in (shipped_cache / local_model.LOCAL_MODEL_NAME).iterdir())
        _, mismatch, errors = filecmp.cmpfiles(
            shipped_cache / local_model.LOCAL_MODEL_NAME,
            each_read_cache / local_model.LOCAL_MODEL_NAME,
            names,
            shallow=False,
        )
    print(json.dumps({
        "shipped_s": round(shipped_s, 1),
        "gguf_parsed_on_each_read_s": round(each_read_s, 1),
        "ratio": round(each_read_s / shipped_s, 2),
        "files_compared": names,
        "files_that_differ": mismatch + errors,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
