"""Export markers, checkpoint discovery and mirroring: a half-written folder is never mistaken for a finished one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from trainer.checkpoints import (
    CHECKPOINT_MARKER,
    RUN_MARKER,
    OutputLocation,
    download_dir,
    upload_dir,
    write_json_atomic,
)
from trainer.export import COMPLETION_MARKER, is_complete, merge_and_export
from trainer.local_model import LocalModelError, _move_into_place, is_built, resolve_model_path
from trainer.recipe import REPO_ROOT


def test_marker_name_is_what_the_serving_image_checks() -> None:
    assert COMPLETION_MARKER == "_COMPLETE.json"


def test_folder_without_marker_is_not_complete(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"half")
    assert not is_complete(tmp_path)
    write_json_atomic(tmp_path / COMPLETION_MARKER, {})
    assert is_complete(tmp_path)
    assert not is_complete(tmp_path / "missing")


def test_is_complete_reads_urls() -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe("/export-check/model.safetensors", b"x")
    assert not is_complete("memory://export-check")
    fs.pipe(f"/export-check/{COMPLETION_MARKER}", b"{}")
    assert is_complete("memory://export-check")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_export_writes_the_marker_last_and_lists_the_files(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir), LoraConfig(target_modules=["q_proj"]))
    model.save_pretrained(adapter)
    out = merge_and_export(str(tiny_gemma3_dir), adapter, tmp_path / "merged")
    marker = out / COMPLETION_MARKER
    record = json.loads(marker.read_text())
    listed = {f["path"] for f in record["files"]}
    assert {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "chat_template.jinja",
    } <= listed
    assert record["base_model"] == str(tiny_gemma3_dir) and record["adapter"] == str(adapter)
    newest_other = max(p.stat().st_mtime_ns for p in out.iterdir() if p.name != COMPLETION_MARKER)
    assert marker.stat().st_mtime_ns >= newest_other


def test_failed_re_export_removes_the_stale_marker_first(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "merged"
    out.mkdir()
    write_json_atomic(out / COMPLETION_MARKER, {"files": []})
    with pytest.raises((OSError, ValueError)):
        merge_and_export(str(tiny_gemma3_dir), tmp_path / "no-such-adapter", out)
    assert not is_complete(out)


def test_upload_puts_the_marker_last_and_clears_a_stale_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = tmp_path / "checkpoint-4"
    local.mkdir()
    for name in ("z_weights.bin", CHECKPOINT_MARKER, "a_state.json"):
        (local / name).write_text(name)
    fs = fsspec.filesystem("memory")
    fs.pipe(f"/upload-order/ckpt/{CHECKPOINT_MARKER}", b"stale")
    order: list[str] = []
    original = MemoryFileSystem.put_file

    def recording_put_file(self, lpath, rpath, *args, **kwargs):  # type: ignore[no-untyped-def]
        order.append(Path(rpath).name)
        assert not fs.exists(f"/upload-order/ckpt/{CHECKPOINT_MARKER}"), "stale marker visible during upload"
        return original(self, lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "put_file", recording_put_file)
    upload_dir(local, "memory://upload-order/ckpt", marker=CHECKPOINT_MARKER)
    assert order[-1] == CHECKPOINT_MARKER and len(order) == 3
    download_dir("memory://upload-order/ckpt", tmp_path / "copy")
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == sorted(p.name for p in local.iterdir())


def test_latest_checkpoint_ignores_unmarked_and_prefers_the_newest_remote(tmp_path: Path) -> None:
    remote = tmp_path / "bucket"
    location = OutputLocation.from_dir(f"file://{remote}", staging_root=tmp_path / "staging")
    assert location.latest_checkpoint() is None
    for step, marked in ((2, True), (4, True), (6, False)):
        path = location.checkpoints_dir / f"checkpoint-{step}"
        path.mkdir(parents=True)
        (path / "adapter_model.safetensors").write_text(str(step))
        if marked:
            location.mark_checkpoint(path, step)
    assert location.latest_checkpoint() == location.checkpoints_dir / "checkpoint-4"
    remote_only = remote / "checkpoints/checkpoint-8"
    remote_only.mkdir(parents=True)
    (remote_only / "adapter_model.safetensors").write_text("8")
    (remote_only / CHECKPOINT_MARKER).write_text("{}")
    latest = location.latest_checkpoint()
    assert latest == location.checkpoints_dir / "checkpoint-8"
    assert (latest / "adapter_model.safetensors").read_text() == "8"


def test_only_the_downloading_rank_fetches_a_remote_checkpoint(tmp_path: Path) -> None:
    """Ranks other than local rank 0 look with download=False: after rank 0's download it is a no-op, before it an error."""
    remote = tmp_path / "bucket"
    location = OutputLocation.from_dir(f"file://{remote}", staging_root=tmp_path / "staging")
    remote_only = remote / "checkpoints/checkpoint-6"
    remote_only.mkdir(parents=True)
    (remote_only / "rng_state_1.pth").write_text("6")
    (remote_only / CHECKPOINT_MARKER).write_text("{}")
    with pytest.raises(RuntimeError, match="local rank 0"):
        location.latest_checkpoint(download=False)
    assert not location.checkpoints_dir.exists()
    downloaded = location.latest_checkpoint()
    (downloaded / "rng_state_1.pth").write_text("local copy")
    assert location.latest_checkpoint(download=False) == downloaded
    assert (downloaded / "rng_state_1.pth").read_text() == "local copy"  # not fetched again


def test_run_marker_round_trip(tmp_path: Path) -> None:
    for output in (str(tmp_path / "folder"), f"file://{tmp_path / 'bucket'}"):
        location = OutputLocation.from_dir(output, staging_root=tmp_path / "staging")
        assert location.finished_run() is None
        location.local.mkdir(parents=True, exist_ok=True)
        location.mark_run_complete({"summary": {"steps": 3}})
        finished = location.finished_run()
        assert finished is not None and finished["summary"] == {"steps": 3} and finished["completed_at"] > 0
    assert (tmp_path / "bucket" / RUN_MARKER).is_file() and (tmp_path / "folder" / RUN_MARKER).is_file()


def test_same_url_same_staging_folder(tmp_path: Path) -> None:
    first = OutputLocation.from_dir("gs://bucket/runs/a", staging_root=tmp_path)
    assert first == OutputLocation.from_dir("gs://bucket/runs/a/", staging_root=tmp_path)
    assert first.local != OutputLocation.from_dir("gs://bucket/runs/b", staging_root=tmp_path).local
    assert OutputLocation.from_dir(str(tmp_path / "plain")).remote is None


def test_unfinished_local_model_build_is_replaced(tmp_path: Path) -> None:
    target, staging = tmp_path / "gemma3-270m", tmp_path / ".building"
    target.mkdir()
    (target / "model.safetensors").write_text("truncated")  # a crash left this, without the build marker
    staging.mkdir()
    (staging / "_BUILD_COMPLETE.json").write_text("{}")
    _move_into_place(staging, target)
    assert is_built(target) and not (target / "model.safetensors").exists()


def test_unknown_local_model_is_a_clear_error() -> None:
    with pytest.raises(LocalModelError, match="local:gemma3-270m"):
        resolve_model_path("local:gemma2-2b")
    assert resolve_model_path("google/gemma-3-1b-it") == "google/gemma-3-1b-it"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--recipe", "emoji-local", "--set", "training.max_stepz=1"], "training.max_stepz"),
        (["--recipe", "emoji-local", "--set", "lora.r=-1"], "lora.r"),
        (["--recipe", "no-such-recipe"], "unknown recipe"),
    ],
)
def test_cli_prints_user_errors_without_traceback(args: list[str], expected: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert expected in proc.stderr and "Traceback" not in proc.stderr
