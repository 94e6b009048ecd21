"""Whether this machine can build what Triton compiles at its first kernel launch, and trl's kernel choice by it.

Decision (docs/trainer.md#a-c-compiler-for-triton): the trainer image ships a C compiler and the Python headers,
so trl's Triton kernels run on a GPU (and Liger or `torch.compile` could). Triton 3.7.1 compiles its CUDA
driver stub (`triton/backends/nvidia/driver.c`, which includes `Python.h`) with
`triton/runtime/build.py` `_build` the first time a kernel launches: the compiler is `$CC`, else `gcc`,
else `clang` on PATH ("Failed to find C compiler" otherwise), and the headers come from
`sysconfig.get_paths(scheme)["include"]` (`posix_local` read as `posix_prefix`). trl 1.16 picks its
Triton kernel on `cuda`/`xpu` whenever the package is installed (`trl/kernels/chunked_logprob.py`
`_use_triton`), so an environment without them crashes at the first training step.

`use_triton_only_where_it_builds` keeps that from ever being a crash: where the compiler or `Python.h`
is missing, trl's kernel selection answers False and trl folds its tiles with torch ops (its own path for
devices without Triton; the same contract and numbers), with one warning that names what is missing.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# triton/runtime/build.py `_build`, in its order: $CC, then these on PATH
COMPILERS = ("gcc", "clang")
# what triton/backends/nvidia/driver.c includes from outside Triton's own include folder
PYTHON_HEADER = "Python.h"
TRITON_DEVICES = frozenset({"cuda", "xpu"})
_MARK = "_gemma_ft_builds_only"


def python_include_dir() -> Path:
    """The folder Triton passes as `-I` for Python.h (triton/runtime/build.py)."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":
        scheme = "posix_prefix"
    return Path(sysconfig.get_paths(scheme=scheme)["include"])


def missing_for_triton_build() -> list[str]:
    """What Triton's first-launch build would not find here; empty when it can build."""
    missing = []
    if os.environ.get("CC") is None and not any(shutil.which(name) for name in COMPILERS):
        missing.append(f"a C compiler ($CC, {' or '.join(COMPILERS)} on PATH)")
    if not (python_include_dir() / PYTHON_HEADER).is_file():
        missing.append(f"{python_include_dir() / PYTHON_HEADER}")
    return missing


@functools.cache
def triton_builds_here() -> bool:
    """`missing_for_triton_build()` is empty; looked up once per process, with one warning when it is not."""
    missing = missing_for_triton_build()
    if missing:
        log.warning("Triton cannot build its driver stub here (missing %s): trl's torch kernel is used", missing)
    return not missing


def use_triton_only_where_it_builds() -> None:
    """Make trl's `_use_triton` answer False on a Triton device when Triton could not build its stub (idempotent)."""
    from trl.kernels import chunked_logprob

    current = chunked_logprob._use_triton
    if getattr(current, _MARK, False):
        return

    @functools.wraps(current)
    def use_triton(device: torch.device) -> bool:
        return bool(current(device)) and (device.type not in TRITON_DEVICES or triton_builds_here())

    setattr(use_triton, _MARK, True)
    chunked_logprob._use_triton = use_triton  # type: ignore[attr-defined]
