"""What a build pulls is pinned by digest: every base image of the trainer image (its FROM lines, through the ARG
defaults they name), and no `# syntax=` frontend pulled at build time. A tag can be re-pushed (nvidia does), a digest
cannot."""

from __future__ import annotations

import re

import pytest

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
