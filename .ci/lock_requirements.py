#!/usr/bin/env python3
"""Write a hashed lock of a requirements file: what the CI jobs that hold a cloud identity install.

    python .ci/lock_requirements.py requirements.txt .ci/requirements.lock
    python .ci/lock_requirements.py infra/policy/requirements.txt .ci/policy-requirements.lock

A job with `id-token: write` installs with `pip install --require-hashes --only-binary :all: -r LOCK`, so
no unreviewed release runs with its identity. The lock pins each distribution by version and the sha256
of its wheel, from `pip download --only-binary :all:`; run it with CPython 3.11 on Linux x86_64 (the
runners' platform) after changing the requirements (tests/lint/test_requirements_lock.py fails until
then). Why: docs/ci.md#hashed-locks.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename


def lock_lines(requirements: Path) -> list[str]:
    """`name==version --hash=sha256:…` for every wheel the requirements resolve to here, sorted by name."""
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--only-binary",
                ":all:",
                "-d",
                folder,
                "-r",
                str(requirements),
            ],
            check=True,
        )
        lines = []
        for wheel in sorted(Path(folder).glob("*.whl")):
            name, version, _, _ = parse_wheel_filename(wheel.name)
            sha256 = hashlib.sha256(wheel.read_bytes()).hexdigest()
            lines.append(f"{canonicalize_name(name)}=={version} --hash=sha256:{sha256}")
        return sorted(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    requirements, lock = Path(argv[0]), Path(argv[1])
    header = [
        f"# Hashed lock of {requirements.as_posix()}, written by .ci/lock_requirements.py (CPython "
        f"{sys.version_info.major}.{sys.version_info.minor}, {sys.platform}); do not edit, rerun it.",
        f"# pip install --require-hashes --only-binary :all: -r {lock.as_posix()}",
    ]
    lock.write_text("\n".join([*header, *lock_lines(requirements)]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
