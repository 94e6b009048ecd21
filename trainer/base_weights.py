"""The base model's weights staged once per run in the bucket: a restart reads them there, not from the Hub.

Decision: when `output.dir` is a URL and `model.name_or_path` a Hub id, the first process on each node to take
the node's file lock (`fcntl.flock`: the process group does not exist yet, so no collective can order the
ranks) fetches the model folder into the node's staging folder: from `<output.dir>/_base/<id>@<revision>/`
when that holds its marker, else from the Hub (`huggingface_hub.snapshot_download`, every node in parallel).
Global rank 0 (`RANK`, set by torchrun and by Ray Train: ray/train/torch/config.py) then copies its folder
to the bucket, marker last (trainer/checkpoints.py `upload_dir`). The node's other ranks find the folder
complete once they hold the lock. A retried pod (a new node, an empty disk) so reads the bucket instead of
the Hub.

The model is loaded from that folder, but keeps the Hub id as its `name_or_path` (`hub_name`), so peft writes
the Hub id as the adapter's `base_model_name_or_path` (peft/peft_model.py `save_pretrained`), which serving and
evaluation read.

Bounds: on the first start the other ranks wait for node 0's Hub download and bucket upload in
`init_process_group` (bounded by `ddp_timeout`, 30 min, trainer/train.py). A restart still makes peft's own
vocabulary check at each adapter save (peft utils/save_and_load.py `get_peft_model_state_dict`: does the
base's config.json exist on the Hub), a few hundred bytes, as before. The final merge (`output.merge`,
`export.merge_and_export`) still loads the base by its Hub id.

Not staged: local folders, `local:` models, runs with a local `output.dir`, and `HF_HUB_OFFLINE=1` without
a staged copy (transformers then reads its own cache, as before).
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


def hub_name(model: Any, name: str) -> None:
    """Make a model loaded from a staged folder carry its Hub id (what the adapter config records)."""
    model.name_or_path = name
    model.config._name_or_path = name
