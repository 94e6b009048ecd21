"""The hashed locks CI installs from (.ci/lock_requirements.py): they pin every distribution by version and hash,
satisfy the requirements they were made from, and pip really refuses a file whose hash is not the locked one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from infra.offline.engine import REPO_ROOT

LOCKS = {
    REPO_ROOT / "requirements.txt": REPO_ROOT / ".ci" / "requirements.lock",
    REPO_ROOT / "infra" / "policy" / "requirements.txt": REPO_ROOT / ".ci" / "policy-requirements.lock",
}
PAIRS = [pytest.param(req, lock, id=lock.name) for req, lock in LOCKS.items()]


def pins(lock: Path) -> dict[str, tuple[Version, str]]:
    found: dict[str, tuple[Version, str]] = {}
    for line in lock.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        requirement, _, digest = line.partition(" --hash=sha256:")
        name, _, version = requirement.partition("==")
        assert name and version and len(digest) == 64, f"{lock.name}: `{line}` is not name==version --hash=sha256:…"
        assert canonicalize_name(name) not in found, f"{lock.name}: {name} twice"
        found[canonicalize_name(name)] = (Version(version), digest)
    return found


def requirements(path: Path) -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


@pytest.mark.parametrize(("source", "lock"), PAIRS)
def test_the_lock_satisfies_its_requirements(source: Path, lock: Path) -> None:
    pinned = pins(lock)
    for requirement in requirements(source):
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{source.name}: {requirement} is not in {lock.name}: rerun .ci/lock_requirements.py"
        assert requirement.specifier.contains(pinned[name][0], prereleases=True), (
            f"{lock.name} pins {name}=={pinned[name][0]}, outside {requirement}: rerun .ci/lock_requirements.py"
        )


def _dry_run(lock: Path) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--require-hashes"]
    command += ["--only-binary", ":all:", "-q", "-r", str(lock)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


TAMPERED = "tampered.lock"


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """pip's dry run of each lock and of a lock whose first hash is wrong, by the lock's name: the three run at once
    (each mostly waits on the index and the downloads), each its own pip process."""
    lock = LOCKS[REPO_ROOT / "infra" / "policy" / "requirements.txt"]
    _, (_, digest) = next(iter(pins(lock).items()))
    tampered = tmp_path_factory.mktemp("locks") / TAMPERED
    tampered.write_text(lock.read_text().replace(digest, "0" * 64))
    started = {path.name: _dry_run(path) for path in [*LOCKS.values(), tampered]}
    done = {}
    for name, process in started.items():
        try:
            stdout, stderr = process.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        done[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return done


@pytest.mark.slow
@pytest.mark.parametrize(("source", "lock"), PAIRS)
def test_pip_installs_the_lock_in_hash_checking_mode(
    source: Path, lock: Path, dry_runs: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    """Every dependency is pinned with a hash (pip's hash-checking mode refuses an unpinned one) and each hash is
    that of the wheel pip downloads."""
    result = dry_runs[lock.name]
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_a_wrong_hash_is_refused(dry_runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    lock = LOCKS[REPO_ROOT / "infra" / "policy" / "requirements.txt"]
    name = next(iter(pins(lock)))
    result = dry_runs[TAMPERED]
    assert result.returncode != 0 and "THESE PACKAGES DO NOT MATCH THE HASHES" in result.stdout + result.stderr, name


def _lock_jobs() -> list[tuple[str, str, str, Path]]:
    """(workflow, job, setup-python's python-version, lock) for every job step that installs from a hashed lock."""
    found = []
    for workflow in sorted((REPO_ROOT / ".github" / "workflows").glob("*.yml")):
        for name, job in yaml.safe_load(workflow.read_text())["jobs"].items():
            steps = job.get("steps", [])
            versions = [
                str(step["with"]["python-version"])
                for step in steps
                if str(step.get("uses", "")).startswith("actions/setup-python@")
            ]
            for step in steps:
                for lock in sorted(set(re.findall(r"--require-hashes .*?-r (\S+\.lock)", str(step.get("run", ""))))):
                    found.append((workflow.name, name, versions[0] if versions else "", REPO_ROOT / lock))
    return found


def test_every_job_installs_its_lock_with_the_python_it_was_made_for() -> None:
    """A lock holds one wheel per distribution, for the CPython it was made with (its header): grpcio, pydantic-core,
    PyYAML and the other compiled wheels are per CPython minor version, so a job on another Python fails its
    install (cp312 wheels have other hashes) before it ever authenticates."""
    jobs = _lock_jobs()
    assert {job for _, job, _, _ in jobs} >= {"preview", "preview-gke", "apply"}, jobs
    for workflow, job, version, lock in jobs:
        made_with = re.search(r"\(CPython (\d+\.\d+), linux\)", lock.read_text().splitlines()[0])
        assert made_with, f"{lock.name}: the header names no CPython version"
        assert version == made_with.group(1), (
            f"{workflow} {job}: setup-python {version!r}, but {lock.name} was made with CPython {made_with.group(1)}: "
            "rerun .ci/lock_requirements.py with the job's Python, or set the job's python-version"
        )
