"""The base model's weights staged once per run in the bucket: a restart reads them there, not from the Hub.

Decision (docs/trainer.md#base-weights-staged-in-the-bucket): when `output.dir` is a URL and the model a Hub id,
the first process on each node to take the node's file lock (`fcntl.flock`: no process group exists yet)
fetches the model into the node's staging folder, from `<output.dir>/_base/<id>@<revision>/` when that holds
its marker, else from the Hub; global rank 0 then copies it to the bucket, marker last. A retried pod (a new
node, an empty disk) so reads the bucket. The model keeps the Hub id as its `name_or_path` (`hub_name`), so
the adapter names its base by that id.

Bounds: the first start's other ranks wait in `init_process_group` (`ddp_timeout`, 30 min); peft's small
vocabulary check still reaches the Hub at each adapter save, and the final merge loads the base by its Hub id.
Not staged: local folders, `local:` models, a local `output.dir`, `HF_HUB_OFFLINE=1` without a staged copy.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.checkpoints import OutputLocation

BASE_SUBDIR = "_base"
BASE_MARKER = "_BASE_COMPLETE.json"
log = logging.getLogger(__name__)


def is_hub_id(name_or_path: str) -> bool:
    """An `org/name` (or `name`) Hub id, not a folder on this machine, a URL or a `local:` model."""
    if ":" in name_or_path or Path(name_or_path).expanduser().exists() or name_or_path.startswith((".", "/", "~")):
        return False
    return re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name_or_path) is not None


def _key(name: str, revision: str | None) -> str:
    return f"{name.replace('/', '--')}@{revision or 'main'}"


def stage_base_model(name: str, revision: str | None, location: OutputLocation) -> str:
    """The folder to load `name` from on this node (staged as the module says), or `name` itself when not staged."""
    from trainer.checkpoints import _remote, download_dir, upload_dir, write_json_atomic

    if location.base_weights_url is None or not is_hub_id(name):
        return name
    key = _key(name, revision)
    remote = f"{location.base_weights_url}/{key}"
    local = location.local / BASE_SUBDIR / key
    local.parent.mkdir(parents=True, exist_ok=True)
    fs, root = _remote(remote)
    with open(local.parent / f".{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        in_bucket = fs.exists(f"{root}/{BASE_MARKER}")
        if not (local / BASE_MARKER).is_file():
            started = time.perf_counter()
            if in_bucket:
                download_dir(remote, local)
                source = remote
            elif os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}:
                return name
            else:
                from huggingface_hub import snapshot_download

                shutil.rmtree(local, ignore_errors=True)
                snapshot_download(name, revision=revision, local_dir=local)
                shutil.rmtree(local / ".cache", ignore_errors=True)  # huggingface_hub's download metadata
                write_json_atomic(local / BASE_MARKER, {"repo_id": name, "revision": revision or "main"})
                source = "the Hub"
            log.info("staged %s from %s in %.0f s", name, source, time.perf_counter() - started)
        if not in_bucket and os.environ.get("RANK", "0") == "0":
            upload_dir(local, remote, marker=BASE_MARKER)
            log.info("staged %s in %s: a restart reads it there", name, remote)
    return str(local)


def merge_base(name: str, revision: str | None, location: OutputLocation) -> str:
    """What the merge at a run's end reloads the base from: the folder staged for this run on this node (no Hub
    download while the run's nodes wait, no Hub outage that kills a trained run), else `name` itself."""
    from trainer.model_files import resolve_model_path

    return stage_base_model(resolve_model_path(name), revision, location)


def hub_name(model: Any, name: str) -> None:
    """Make a model loaded from a staged folder carry its Hub id (what the adapter config records)."""
    model.name_or_path = name
    model.config._name_or_path = name
