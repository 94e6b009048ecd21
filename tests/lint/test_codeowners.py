"""CODEOWNERS names an owner for everything that decides what CI may do, and for what runs with deploy rights or
into what runs with them: the Pulumi program (every infra/*.py), the project and stack files, what `pulumi up`
installs, the Dockerfiles, the GPU requirements and the Cloud Build config.

GitHub reads `.github/CODEOWNERS`; the last pattern that matches a path decides its owners, and a pattern with no
owner leaves the path unowned (docs.github.com, "About code owners"). The patterns are matched here with the
same rules for the paths that matter: a leading `/` anchors at the root, a trailing `/` covers the folder, and `*`
matches any characters but `/` (gitignore's rule, which CODEOWNERS follows).
"""

from __future__ import annotations

import fnmatch
import re

import pytest

from infra.offline.engine import REPO_ROOT

CODEOWNERS = REPO_ROOT / ".github" / "CODEOWNERS"
GUARDED = [
    ".github/workflows/deploy.yml",
    ".github/workflows/preview.yml",
    ".github/CODEOWNERS",
    ".ci/pulumi-run.sh",
    ".ci/requirements.lock",
    "infra/bootstrap/ci-identities.yaml",
    "infra/bootstrap/ci-setup.sh",
    "infra/policy/policies.py",
    "infra/policy/PulumiPolicy.yaml",
    # the program and what `pulumi up` installs and builds (deploy rights)
    "infra/requirements.txt",
    "requirements.txt",
    "infra/cloudbuild.yaml",
    "trainer/Dockerfile",
    "trainer/requirements-gpu.txt",
    "serving/Dockerfile",
    # every module of the program and every project / stack file, as the tree has them now
    *sorted(path.relative_to(REPO_ROOT).as_posix() for path in (REPO_ROOT / "infra").glob("*.py")),
    *sorted(path.name for path in REPO_ROOT.glob("Pulumi*.yaml")),
]


def rules() -> list[tuple[str, list[str]]]:
    found = []
    for line in CODEOWNERS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pattern, *owners = line.split()
            found.append((pattern, owners))
    return found


def matches(pattern: str, path: str) -> bool:
    """The subset of gitignore-style matching the file uses: /folder/, /file, /glob (`*` within one segment),
    folder/ anywhere."""
    anchored = pattern.startswith("/")
    body = pattern.strip("/")
    if pattern.endswith("/"):
        return path.startswith(body + "/") if anchored else f"/{body}/" in f"/{path}"
    if "*" in body or "?" in body:
        segments, parts = body.split("/"), path.split("/")
        if not anchored:
            parts = parts[-len(segments) :]
        return len(parts) == len(segments) and all(map(fnmatch.fnmatchcase, parts, segments))
    return path == body if anchored else path.endswith("/" + body) or path == body


def owners_of(path: str) -> list[str]:
    owners: list[str] = []
    for pattern, its_owners in rules():
        if matches(pattern, path):
            owners = its_owners
    return owners


@pytest.mark.parametrize("path", GUARDED)
def test_every_path_that_decides_what_ci_may_do_has_an_owner(path: str) -> None:
    assert (REPO_ROOT / path).exists(), f"{path} moved: guard its new place"
    owners = owners_of(path)
    assert owners, f"{path} has no code owner in .github/CODEOWNERS"
    assert all(re.fullmatch(r"@[\w.-]+(/[\w.-]+)?|[^@\s]+@[^@\s]+", owner) for owner in owners), owners


def test_the_matcher_can_fail() -> None:
    assert not owners_of("trainer/train.py") and not matches("/.ci/", "x/.ci/run")
    # `*` stays within one folder: the program's modules, not its offline tools or its tests
    assert matches("/infra/*.py", "infra/gke.py") and not matches("/infra/*.py", "infra/offline/plan.py")
    assert not matches("/Pulumi*.yaml", "infra/policy/PulumiPolicy.yaml")
