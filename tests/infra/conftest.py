"""Shared helpers for the infra tests: every test runs the real program under mocks."""

from __future__ import annotations

from typing import Any

import pytest

from infra.offline import MOCK_HF_TOKEN, StackRun, is_secret, run_stack, stack_names, unwrap_secrets

PREBUILT = {
    "imageBuild": "prebuilt",
    "trainerImage": "us-central1-docker.pkg.dev/p/r/trainer@sha256:" + "1" * 64,
    "servingImage": "us-central1-docker.pkg.dev/p/r/serving@sha256:" + "2" * 64,
}


def plain_paths(value: Any, needle: str, path: str = "") -> list[str]:
    """Paths where `needle` appears in plain text, i.e. not inside a secret wrapper."""
    if is_secret(value):
        return []
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in plain_paths(v, needle, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in plain_paths(v, needle, f"{path}[{i}]")]
    return [path or "."] if isinstance(value, str) and needle in value else []


def contains(value: Any, needle: str) -> bool:
    plain = unwrap_secrets(value)
    if isinstance(plain, dict):
        return any(contains(v, needle) for v in plain.values())
    if isinstance(plain, list):
        return any(contains(v, needle) for v in plain)
    return isinstance(plain, str) and needle in plain


def variants() -> list[tuple[str, dict[str, Any], bool]]:
    """Every stack file as committed, plus the dev stack with serving on (public and private)."""
    cases: list[tuple[str, dict[str, Any], bool]] = [(s, {}, False) for s in stack_names()]
    if "dev" in stack_names():
        cases.append(("dev", {"servingEnabled": True, "servingInvokers": ["user:alice@example.com"]}, True))
        cases.append(("dev", {"servingEnabled": True, "servingPublic": True}, True))
    return cases


@pytest.fixture(scope="session")
def all_runs() -> list[StackRun]:
    """One offline run per variant, shared by the cross-stack invariant tests."""
    return [run_stack(stack, overrides=overrides, assume_trained=trained) for stack, overrides, trained in variants()]


__all__ = ["MOCK_HF_TOKEN", "PREBUILT", "contains", "plain_paths"]
