"""Image contexts staged one process at a time: the offline tools and the test workers share build/image-context.

`make test` runs the scanners' plans (.ci/scan.py) beside pytest's workers, and every plan stages the trainer's and
the serving image's build contexts into the same folder (infra/images.py `stage_context`: remove, then copy); two at
once remove each other's files. Every offline caller takes this one lock; `pulumi up` runs one program and none.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from infra import images

LOCK = images.STAGED_CONTEXTS.parent / ".image-context.lock"


@contextlib.contextmanager
def contexts_staged_one_at_a_time() -> Iterator[None]:
    """While it lasts, `infra.images.stage_context` waits for the lock every offline process takes."""
    original = images.stage_context

    def locked(*args: Any, **kwargs: Any) -> Path:
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        with LOCK.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            return original(*args, **kwargs)

    images.stage_context = locked  # type: ignore[assignment]
    try:
        yield
    finally:
        images.stage_context = original  # type: ignore[assignment]
