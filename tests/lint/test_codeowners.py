"""CODEOWNERS names an owner for everything that decides what CI may do (issue 23 item 7).

GitHub reads `.github/CODEOWNERS`; the last pattern that matches a path decides its owners, and a pattern with no
owner leaves the path unowned (docs.github.com, "About code owners"). The patterns are matched here with the
same rules for the paths that matter: a leading `/` anchors at the root, a trailing `/` covers the folder.
"""

from __future__ import annotations

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
    """The subset of gitignore-style matching the file uses: /folder/, /file, folder/ anywhere."""
    anchored = pattern.startswith("/")
    body = pattern.strip("/")
    if pattern.endswith("/"):
        return path.startswith(body + "/") if anchored else f"/{body}/" in f"/{path}"
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
