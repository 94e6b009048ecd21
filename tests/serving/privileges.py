"""Run a check as an unprivileged user: root passes every permission check, so tests that need a refusal drop to 65534."""

from __future__ import annotations

import os
from collections.abc import Callable


def in_child_as_nobody(check: Callable[[], object]) -> str:
    """Run `check()` in a forked child as uid/gid 65534; return "ok" or the error message."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        os.close(read_end)
        try:
            os.setgid(65534)
            os.setuid(65534)
            check()
            result = "ok"
        except BaseException as exc:
            result = f"{type(exc).__name__}: {exc}"
        os.write(write_end, result.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        result = pipe.read()
    os.waitpid(pid, 0)
    return result
