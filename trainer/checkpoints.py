"""Checkpoints that survive a lost machine: train locally, mirror to the output URL, resume from the latest.

    .venv/bin/python -c "from trainer.checkpoints import OutputLocation;         print(OutputLocation.from_dir('gs://bucket/runs/emoji').latest_checkpoint())"

Decisions (docs/trainer.md#checkpoints-mirrored-with-markers):
- `output.dir` is a local folder or an fsspec URL (`gs://…`); training writes to a LOCAL staging folder, each
  checkpoint is mirrored to the remote and marked complete LAST (`_CHECKPOINT_COMPLETE.json`); a resume takes
  the latest marked checkpoint, local or remote, and ignores unmarked ones.
- Ranks sharing a staging folder: a checkpoint is marked after a barrier (every rank has written it), and a
  remote one is downloaded by local rank 0 alone.
- A finished run leaves `_RUN_COMPLETE.json`, written last; `finished_run()` keeps it from training again.
It does not decide when to save (SFTConfig.save_steps does). With several nodes only node 0's staging folder
is mirrored (the other nodes' RNG states are not uploaded).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem
    from transformers import TrainerCallback

log = logging.getLogger(__name__)

CHECKPOINT_MARKER = "_CHECKPOINT_COMPLETE.json"
RUN_MARKER = "_RUN_COMPLETE.json"
CHECKPOINTS_SUBDIR = "checkpoints"
STAGING_ENV = "GEMMA_FT_STAGING"
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


def is_url(path: str) -> bool:
    return "://" in path


def checkpoint_step(path: str | Path) -> int | None:
    match = _CHECKPOINT_NAME.match(Path(str(path).rstrip("/")).name)
    return int(match.group(1)) if match else None


def write_json_atomic(path: Path, payload: dict[str, Any], sort_keys: bool = True) -> None:
    """Write JSON to a temporary file in the same folder, then rename: readers never see half a file. `sort_keys`
    False keeps the payload's order where it means something (a summary's phases, in the order they ran)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=sort_keys))
    os.replace(tmp, path)


def _remote(url: str) -> tuple[AbstractFileSystem, str]:
    from fsspec.core import url_to_fs

    return url_to_fs(url)


# Files copied at once by upload_dir / download_dir: a 62 GB checkpoint of 5 GB shards is one stream per file
TRANSFER_WORKERS = 8


def _copy_all(copy: Any, pairs: list[tuple[str, str]]) -> None:
    """`copy(source, target)` for every pair, TRANSFER_WORKERS at a time; the first error is raised."""
    if len(pairs) <= 1:
        for source, target in pairs:
            copy(source, target)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(TRANSFER_WORKERS, len(pairs))) as pool:
        for done in [pool.submit(copy, source, target) for source, target in pairs]:
            done.result()


def upload_dir(local: Path, url: str, marker: str | None = None) -> None:
    """Copy every file of `local` to `url`, several at once; the file named `marker` (if present) is copied last,
    after every other file is there.

    A stale marker at the destination is removed FIRST, so a folder being rewritten never looks complete.
    """
    fs, root = _remote(url)
    if marker and fs.exists(f"{root}/{marker}"):
        fs.rm(f"{root}/{marker}")
    files = sorted(p for p in local.rglob("*") if p.is_file())
    pairs = [(str(path), f"{root}/{path.relative_to(local).as_posix()}") for path in files]
    for folder in sorted({target.rsplit("/", 1)[0] for _, target in pairs}):
        fs.makedirs(folder, exist_ok=True)
    _copy_all(fs.put_file, [pair for pair, path in zip(pairs, files, strict=True) if path.name != marker])
    _copy_all(fs.put_file, [pair for pair, path in zip(pairs, files, strict=True) if path.name == marker])


def download_dir(url: str, local: Path) -> None:
    """Copy a remote folder to `local` (replacing it), several files at once, through a temporary sibling and a
    rename."""
    fs, root = _remote(url)
    staging = Path(tempfile.mkdtemp(prefix=f".{local.name}.download-", dir=local.parent))
    try:
        prefix = root.rstrip("/") + "/"
        pairs = [(remote_file, str(staging / remote_file.removeprefix(prefix))) for remote_file in fs.find(root)]
        for _, target in pairs:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
        _copy_all(fs.get_file, pairs)
        if local.exists():
            shutil.rmtree(local)
        os.replace(staging, local)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@dataclass(frozen=True)
class OutputLocation:
    """Where a run's results go (`remote`, a URL, or None) and where it trains (`local`, always a folder)."""

    local: Path
    remote: str | None
    # where the base model is staged (trainer/base_weights.py); `<remote>/_base` unless set
    base_remote: str | None = None

    @property
    def base_weights_url(self) -> str | None:
        return self.base_remote or (f"{self.remote}/_base" if self.remote else None)

    @classmethod
    def from_dir(cls, output_dir: str, staging_root: str | Path | None = None) -> OutputLocation:
        """A plain folder is used directly; a URL gets a stable local staging folder (same URL, same folder)."""
        if not is_url(output_dir):
            return cls(local=Path(output_dir).expanduser().resolve(), remote=None)
        remote = output_dir.rstrip("/")
        root = Path(staging_root or os.environ.get(STAGING_ENV) or Path(tempfile.gettempdir()) / "gemma-finetune")
        digest = hashlib.sha256(remote.encode()).hexdigest()[:12]
        return cls(local=root / digest, remote=remote)

    @property
    def checkpoints_dir(self) -> Path:
        return self.local / CHECKPOINTS_SUBDIR

    def remote_path(self, relative: str) -> str | None:
        return f"{self.remote}/{relative}" if self.remote else None

    def mark_checkpoint(self, checkpoint: Path, step: int) -> None:
        """Write the local completion marker of a checkpoint, then mirror the checkpoint (marker last)."""
        write_json_atomic(checkpoint / CHECKPOINT_MARKER, {"step": step, "completed_at": time.time()})
        remote = self.remote_path(f"{CHECKPOINTS_SUBDIR}/{checkpoint.name}")
        if remote:
            upload_dir(checkpoint, remote, marker=CHECKPOINT_MARKER)
            log.info("mirrored %s to %s", checkpoint.name, remote)

    def prune_remote(self, keep: set[str]) -> None:
        """Delete remote checkpoints that no longer exist locally (transformers rotated them out); marker first."""
        remote = self.remote_path(CHECKPOINTS_SUBDIR)
        if not remote:
            return
        fs, root = _remote(remote)
        if not fs.exists(root):
            return
        for entry in fs.ls(root, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if checkpoint_step(name) is not None and name not in keep:
                if fs.exists(f"{entry}/{CHECKPOINT_MARKER}"):
                    fs.rm(f"{entry}/{CHECKPOINT_MARKER}")
                fs.rm(entry, recursive=True)

    def local_checkpoints(self) -> dict[int, Path]:
        """Complete local checkpoints by step."""
        if not self.checkpoints_dir.is_dir():
            return {}
        found = {}
        for path in self.checkpoints_dir.iterdir():
            step = checkpoint_step(path)
            if step is not None and (path / CHECKPOINT_MARKER).is_file():
                found[step] = path
        return found

    def remote_checkpoints(self) -> dict[int, str]:
        """Complete remote checkpoints by step (URL of each)."""
        remote = self.remote_path(CHECKPOINTS_SUBDIR)
        if not remote:
            return {}
        fs, root = _remote(remote)
        if not fs.exists(root):
            return {}
        found = {}
        for entry in fs.ls(root, detail=False):
            step = checkpoint_step(entry)
            if step is not None and fs.exists(f"{entry.rstrip('/')}/{CHECKPOINT_MARKER}"):
                found[step] = f"{remote}/checkpoint-{step}"
        return found

    def latest_checkpoint(self, download: bool = True) -> Path | None:
        """The newest complete checkpoint as a LOCAL folder (downloaded first if only the remote has it).

        With `download=False` (the ranks that are not local rank 0) a checkpoint that is only remote
        is an error: local rank 0 should have downloaded it already, and ranks that resumed from
        different steps would train different models.
        """
        local, remote = self.local_checkpoints(), self.remote_checkpoints()
        if not local and not remote:
            return None
        step = max(set(local) | set(remote))
        if step in local:
            return local[step]
        target = self.checkpoints_dir / f"checkpoint-{step}"
        if not download:
            raise RuntimeError(
                f"checkpoint-{step} is complete at {remote[step]} but not in {target}, which local rank 0 "
                "should have downloaded before the other ranks looked: check local rank 0's log"
            )
        self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
        log.info("downloading checkpoint-%d from %s", step, remote[step])
        download_dir(remote[step], target)
        return target

    def finished_run(self) -> dict[str, Any] | None:
        """The run marker's contents when this output already holds a finished run, else None."""
        if self.remote:
            fs, root = _remote(self.remote)
            marker = f"{root}/{RUN_MARKER}"
            return json.loads(fs.cat_file(marker)) if fs.exists(marker) else None
        marker_path = self.local / RUN_MARKER
        return json.loads(marker_path.read_text()) if marker_path.is_file() else None

    def mark_run_complete(self, details: dict[str, Any]) -> None:
        """Write the run marker locally, then (for a URL) upload it. Call it after everything else is published."""
        marker = self.local / RUN_MARKER
        write_json_atomic(marker, {**details, "completed_at": time.time()})
        if self.remote:
            fs, root = _remote(self.remote)
            fs.makedirs(root, exist_ok=True)
            fs.put_file(str(marker), f"{root}/{RUN_MARKER}")


def _wait_for_every_rank() -> None:
    """A barrier over all ranks when torch.distributed runs with more than one; nothing otherwise."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def mirror_callback(location: OutputLocation) -> TrainerCallback:
    """A TrainerCallback that marks (and mirrors) each checkpoint once every rank has finished writing it."""
    from transformers import TrainerCallback

    class MirrorCheckpoints(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            # Every rank runs on_save right after its own part of the save (its rng_state_<rank>.pth
            # included); none has passed this barrier before all have written theirs.
            _wait_for_every_rank()
            if state.is_world_process_zero:
                checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
                if checkpoint.is_dir():
                    location.mark_checkpoint(checkpoint, state.global_step)
                    location.prune_remote({p.name for p in Path(args.output_dir).glob("checkpoint-*")})
            return control

    return MirrorCheckpoints()
