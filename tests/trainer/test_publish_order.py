"""A run's summary (its scores) is written before any completion marker, on a local or mounted folder and in a bucket.

Before, `merge_and_export` marked `merged/` complete and only then was `run_summary.json` written: a `pulumi up` in
that gap, or a job killed there, made the serving gate serve an unscored run "without a comparison". Each marker
is now written by trainer/export.py `publish_run`, after the summary; the tests run the real trainer on a tiny model
and look at what existed when each marker appeared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem

from trainer import export
from trainer.export import COMPLETION_MARKER, SUMMARY_FILE

pytestmark = pytest.mark.slow


def _record_markers(monkeypatch: pytest.MonkeyPatch, run_dir: Path) -> list[tuple[str, bool]]:
    """(folder, whether the summary existed) for every completion marker the trainer writes."""
    seen: list[tuple[str, bool]] = []
    original = export.write_completion_marker

    def recording(directory: Path, **details: object) -> Path:
        seen.append((Path(directory).name, (run_dir / SUMMARY_FILE).is_file()))
        return original(directory, **details)

    monkeypatch.setattr(export, "write_completion_marker", recording)
    return seen


def test_a_local_run_writes_its_summary_before_each_marker(
    tiny_gemma3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Cloud Run Job's case: output.dir is the bucket mounted as a folder, where each file appears as written."""
    from tests.trainer.test_training import tiny_recipe
    from trainer.train import main

    run_dir = tmp_path / "run"
    seen = _record_markers(monkeypatch, run_dir)
    result = main(tiny_recipe(tiny_gemma3_dir, str(run_dir), "training.max_steps=1"))
    assert sorted(seen) == [("adapter", True), ("merged", True)], seen
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    assert summary == result.summary and "eval" in summary, "the summary carries the run's evaluation"
    marker = json.loads((run_dir / "adapter" / COMPLETION_MARKER).read_text())
    assert marker["base_model"] == str(tiny_gemma3_dir) and marker["kind"] == "adapter"
    assert "adapter_config.json" in {f["path"] for f in marker["files"]}


def test_a_bucket_gets_the_summary_before_any_marker(
    tiny_gemma3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GKE stacks' case: output.dir is gs://; every upload is recorded in order (a file:// URL stands in)."""
    from tests.trainer.test_training import tiny_recipe
    from trainer.train import main

    uploads: list[str] = []
    original = LocalFileSystem.put_file

    def recording(self, lpath, rpath, *args, **kwargs):  # type: ignore[no-untyped-def]
        uploads.append(str(rpath))
        return original(self, lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "put_file", recording)
    monkeypatch.setenv("GEMMA_FT_STAGING", str(tmp_path / "machine"))
    remote = tmp_path / "bucket" / "runs" / "r"
    main(tiny_recipe(tiny_gemma3_dir, f"file://{remote}", "training.max_steps=1"))
    summary_at = next(i for i, u in enumerate(uploads) if u.endswith(f"/{SUMMARY_FILE}"))
    markers = [i for i, u in enumerate(uploads) if u.endswith(f"/{COMPLETION_MARKER}") and "/checkpoints/" not in u]
    assert {Path(uploads[i]).parent.name for i in markers} == {"adapter", "merged"}
    assert all(summary_at < i for i in markers), uploads
    for kind in ("adapter", "merged"):  # each marker the last file of its folder
        folder = [i for i, u in enumerate(uploads) if f"/{kind}/" in u]
        assert uploads[max(folder)].endswith(f"/{kind}/{COMPLETION_MARKER}")
