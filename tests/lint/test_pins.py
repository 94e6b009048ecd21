"""What a build or a deploy fetches is pinned by digest or checksum: every base image of both images (their FROM
lines, through the ARG defaults they name), no `# syntax=` frontend pulled at build time, Cloud Build's steps, the
trainer's Python packages, and the Pulumi CLI the workflows install. A tag can be re-pushed (nvidia does), a digest
cannot. What is not pinned yet is listed in `NOT_YET_PINNED` with docs/ci.md's reason: a new unpinned fetch fails,
and pinning one fails until it leaves the list."""

from __future__ import annotations

import re

import pytest
import yaml

from infra.offline.engine import REPO_ROOT

DIGEST = re.compile(r"^[\w.\-/:]+@sha256:[0-9a-f]{64}$")


def base_images(dockerfile: str) -> list[str]:
    """The image each FROM names, with `${ARG}` replaced by the ARG's default; stage names are not images."""
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.MULTILINE))
    stages: set[str] = set()
    images = []
    for image, stage in re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", dockerfile, re.MULTILINE | re.IGNORECASE):
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m.group(1), m.group(0)), image)
        if image not in stages:
            images.append(image)
        if stage:
            stages.add(stage)
    return images


def unpinned(dockerfile: str) -> list[str]:
    problems = [f"FROM {image} is not pinned by digest" for image in base_images(dockerfile) if not DIGEST.match(image)]
    if re.match(r"#\s*syntax=", dockerfile) and not re.match(r"#\s*syntax=\S+@sha256:[0-9a-f]{64}", dockerfile):
        problems.append("a `# syntax=` frontend pulled by tag")
    return problems + unhashed_pip_installs(dockerfile)


def unhashed_pip_installs(dockerfile: str) -> list[str]:
    """Each `pip install` of a package named in the Dockerfile itself: pip checks no hash on it (a `-r` file's lines
    are `unhashed_requirements`' to check)."""
    joined = re.sub(r"\\\n", " ", dockerfile)
    problems = []
    for command in re.findall(r"pip install ([^;&|\n]*)", joined):
        named = [word.strip("\"'") for word in command.split() if not word.startswith("-") and "/" not in word]
        if named and "--require-hashes" not in command and "--hash=" not in command:
            problems.append(f"pip install {named[0].split('==')[0]} without a hash")
    return problems


@pytest.mark.parametrize("path", ["trainer/Dockerfile"])
def test_every_base_image_is_pinned_by_digest(path: str) -> None:
    text = (REPO_ROOT / path).read_text()
    assert base_images(text), path
    assert unpinned(text) == [], path


def test_the_check_fails_on_a_tag() -> None:
    assert unpinned("ARG B=nvidia/cuda:12.8.1-runtime\nFROM ${B} AS builder\nFROM builder\n") == [
        "FROM nvidia/cuda:12.8.1-runtime is not pinned by digest"
    ]
    assert unpinned("# syntax=docker/dockerfile:1.7\nFROM a@sha256:" + "0" * 64 + "\n") == [
        "a `# syntax=` frontend pulled by tag"
    ]


# Each entry is named in docs/ci.md, "Not pinned yet, and why".
NOT_YET_PINNED = {
    "serving/Dockerfile: FROM vllm/vllm-openai:v0.28.0-cu129 is not pinned by digest": "servingVllmImage",
    "serving/Dockerfile: pip install runai-model-streamer-gcs without a hash": "runai-model-streamer-gcs",
    "infra/cloudbuild.yaml: step gcr.io/cloud-builders/docker is not pinned by digest": "gcr.io/cloud-builders/docker",
    "trainer/requirements-gpu.txt: no --hash on torch==2.13.0+cu128": "trainer/requirements-gpu.txt",
    ".github/workflows: pulumi/actions installs the Pulumi CLI without a checksum": "pulumi-version",
}
DOCKERFILES = ["trainer/Dockerfile", "serving/Dockerfile"]


def unpinned_steps(cloudbuild: str) -> list[str]:
    return [
        f"step {step['name']} is not pinned by digest"
        for step in yaml.safe_load(cloudbuild)["steps"]
        if not DIGEST.match(step["name"])
    ]


def unhashed_requirements(requirements: str) -> list[str]:
    """The first requirement without `--hash` (pip's hash-checking mode needs one on every line, or none)."""
    lines = [line.split("#")[0].strip() for line in requirements.splitlines()]
    unhashed = [line for line in lines if line and not line.startswith("-") and "--hash=" not in line]
    return [f"no --hash on {unhashed[0]}"] if unhashed else []


def unchecked_cli(workflow: str) -> bool:
    """pulumi/actions downloads the CLI by version and checks no checksum (pulumi/actions v7.0.0
    src/libs/pulumi-cli.ts); a workflow that installs it so has an unpinned fetch."""
    return any("pulumi-version" in (step.get("with") or {}) for step in _steps(yaml.safe_load(workflow)))


def _steps(workflow: dict[str, object]) -> list[dict[str, object]]:
    jobs = workflow.get("jobs") or {}
    assert isinstance(jobs, dict)
    return [step for job in jobs.values() for step in job.get("steps", [])]


def every_unpinned_fetch() -> list[str]:
    found = [f"{path}: {p}" for path in DOCKERFILES for p in unpinned((REPO_ROOT / path).read_text())]
    found += [f"infra/cloudbuild.yaml: {p}" for p in unpinned_steps((REPO_ROOT / "infra/cloudbuild.yaml").read_text())]
    requirements = (REPO_ROOT / "trainer/requirements-gpu.txt").read_text()
    found += [f"trainer/requirements-gpu.txt: {p}" for p in unhashed_requirements(requirements)]
    workflows = sorted((REPO_ROOT / ".github/workflows").glob("*.yml"))
    if any(unchecked_cli(path.read_text()) for path in workflows):
        found.append(".github/workflows: pulumi/actions installs the Pulumi CLI without a checksum")
    return found


def test_nothing_is_fetched_unpinned_but_what_docs_ci_lists() -> None:
    assert sorted(every_unpinned_fetch()) == sorted(NOT_YET_PINNED)
    ci = (REPO_ROOT / "docs/ci.md").read_text().split("Not pinned yet, and why")[1].split("\n## ")[0]
    for what in NOT_YET_PINNED.values():
        assert what in ci, f"docs/ci.md does not say why {what} is not pinned"


def test_the_checks_fail_on_a_tag_a_missing_hash_and_an_unchecked_cli() -> None:
    assert unpinned_steps("steps:\n  - name: gcr.io/cloud-builders/docker\n") == [
        "step gcr.io/cloud-builders/docker is not pinned by digest"
    ]
    assert unpinned_steps("steps:\n  - name: gcr.io/cloud-builders/docker@sha256:" + "0" * 64 + "\n") == []
    assert unhashed_requirements("--extra-index-url https://x\na==1 --hash=sha256:00\nb==2  # why\n") == [
        "no --hash on b==2"
    ]
    assert unhashed_requirements("a==1 --hash=sha256:00\n") == []
    assert unhashed_pip_installs('RUN python3 -m pip install --no-cache-dir \\\n    "b==$(v)" && true\n') == [
        "pip install b without a hash"
    ]
    assert unhashed_pip_installs("RUN pip install --only-binary=:all: -r /tmp/r.txt\n") == []
    workflow = {"jobs": {"j": {"steps": [{"uses": "pulumi/actions@x", "with": {"pulumi-version": "3.272.0"}}]}}}
    assert unchecked_cli(yaml.safe_dump(workflow))
    assert not unchecked_cli(yaml.safe_dump({"jobs": {"j": {"steps": [{"run": "pulumi version"}]}}}))
