"""Entry point for `pulumi up --stack <name>`: the program itself lives in infra/program.py."""

import sys
from pathlib import Path

# The program needs Python 3.11 (enum.StrEnum, datetime.UTC), the version CI runs. Pulumi builds `.venv` with
# $PULUMI_PYTHON_CMD, else the `python3` on PATH, and never rebuilds an existing one (pulumi/pulumi
# sdk/python/toolchain/pip.go `CommandPath`, `EnsureVenv`). This check is what 3.10 (Ubuntu 22.04) sees; on 3.9
# (macOS) pip refuses pulumi itself (Requires-Python >=3.10) and this file never runs (docs/cloud-path.md).
MIN_PYTHON = (3, 11)
if sys.version_info < MIN_PYTHON:
    raise SystemExit(
        f"gemma-finetune needs Python {'.'.join(map(str, MIN_PYTHON))} or newer; Pulumi runs the program with "
        f"Python {'.'.join(map(str, sys.version_info[:3]))} ({sys.executable}). Fix: remove .venv and run "
        "`PULUMI_PYTHON_CMD=python3.11 pulumi up` (any python3.11+ on PATH), see docs/cloud-path.md."
    )

import pulumi  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: infra/, trainer/, serving/

from infra.program import run  # noqa: E402

for key, value in run().items():
    pulumi.export(key, value)
