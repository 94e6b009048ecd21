"""Shared helpers for the infra tests: every test runs the real program under mocks.

The same run is made once: a test that cannot change what the program sees (no monkeypatch, temporary folder,
own recipe folder or captured output) gets a copy of an earlier test's identical run (`_run_once`). Within one
test each identical run after the first is made anew, so a test (or its function fixture) that compares two
identical runs compares two real ones; every other test, and every run that fails, runs the program anew.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import infra.offline.engine
from infra.offline.engine import MOCK_HF_TOKEN, REPO_ROOT, StackRun, is_secret, stack_names, unwrap_secrets

# fixtures through which a test can change what the program reads, or reads what a run printed
_CHANGES_THE_RUN = {"monkeypatch", "tmp_path", "tmp_path_factory", "own_dir", "capsys", "capfd", "caplog"}
_program_run = infra.offline.engine.run_stack
_runs: dict[str, StackRun] = {}
_reuse = False
_served: set[str] = set()  # the keys the current test was handed already


def _run_once(stack: str, *args: Any, **kwargs: Any) -> StackRun:
    """`run_stack`, its result reused for identical arguments while the current test allows it (see above)."""
    if not _reuse:
        return _program_run(stack, *args, **kwargs)
    key = repr((stack, args, sorted(kwargs.items())))  # a dict's order stays in the key: a bucket listing's matters
    if key in _served:
        return _program_run(stack, *args, **kwargs)
    _served.add(key)
    if key not in _runs:
        _runs[key] = _program_run(stack, *args, **kwargs)
    return copy.deepcopy(_runs[key])


# bound before the test modules are imported: their `from infra.offline.engine import run_stack` takes this one
infra.offline.engine.run_stack = _run_once
run_stack = _run_once


@pytest.fixture(autouse=True)
def _runs_reused_unless_the_test_can_change_them(request: pytest.FixtureRequest) -> Iterator[None]:
    global _reuse
    _reuse = not _CHANGES_THE_RUN & set(request.fixturenames)
    yield
    _reuse = False
    _served.clear()


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


@dataclass(frozen=True)
class Variant:
    """One configuration users will pick: a stack file plus the keys they change."""

    label: str
    stack: str
    overrides: dict[str, Any] = field(default_factory=dict)
    remove: tuple[str, ...] = ()
    hf_token: str | None = MOCK_HF_TOKEN
    assume_trained: bool = False
    existing_buckets: tuple[str, ...] = ()
    """Buckets already in the project, e.g. the stack's own, kept by `pulumi destroy` (the program imports it)."""

    def run(self) -> StackRun:
        return run_stack(
            self.stack,
            overrides=self.overrides,
            remove=self.remove,
            hf_token=self.hf_token,
            assume_trained=self.assume_trained,
            existing_buckets=self.existing_buckets,
        )


_NO_RESERVATION = ("reservationName",)
OWN_DATA_RECIPE = "trainer/recipes/templates/my-data-dev.yaml"
OWN_DATA_PATH = "data.path=gs://my-gcp-project-gft-data/tickets/train-*.jsonl"
SERVING_ON = {"servingEnabled": True, "servingInvokers": ["user:alice@example.com"]}
MOCK_API_KEY = "mock-vllm-api-key-not-a-real-credential"
BUDGET = {"billingAccount": "012345-6789AB-CDEF01", "budgetUsd": 500, "budgetEmails": ["alice@example.com"]}
ALERT_EMAILS = {"alertEmails": ["oncall@example.com"]}
# Every stack as committed, each capacity mode, one and two nodes, Ray ephemeral and standing, serving on
# (private, and public with the API key Pulumi.yaml asks for), each image build mode (the stack files build
# with Cloud Build), no HF token, a budget, run alerts by email (with a budget, and alone).
USER_VARIANTS: tuple[Variant, ...] = (
    Variant("dev", "dev"),
    Variant("dev, no token", "dev", {"recipe": "emoji-local"}, hf_token=None),
    Variant("dev, serving", "dev", SERVING_ON, assume_trained=True),
    Variant(
        "dev, serving public, API key",
        "dev",
        {"servingEnabled": True, "servingPublic": True, "servingApiKey": MOCK_API_KEY},
        assume_trained=True,
    ),
    Variant("dev, docker, serving", "dev", {**SERVING_ON, "imageBuild": "docker"}, assume_trained=True),
    # Serving on: a stack file with prebuilt images is its own group for the setup, which grants what serving needs.
    Variant("dev, prebuilt, serving", "dev", {**SERVING_ON, **PREBUILT}, assume_trained=True),
    # A stack file with a budget is its own group for the setup: serving on, so it holds every grant dev needs.
    Variant("dev, budget, serving", "dev", {**SERVING_ON, **BUDGET}, assume_trained=True),
    # The user's own recipe with its rows in another bucket of the project (infra/data_access.py): a prefix, a glob.
    Variant("dev, data in another bucket", "dev", {"recipe": OWN_DATA_RECIPE, "recipeOverrides": [OWN_DATA_PATH]}),
    Variant("a4 (reservation)", "a4-gemma4"),
    Variant("a4, spot", "a4-gemma4", {"capacity": "spot"}, _NO_RESERVATION),
    Variant("a4, flex-start", "a4-gemma4", {"capacity": "flex-start"}, _NO_RESERVATION),
    Variant("a4, on-demand", "a4-gemma4", {"capacity": "on-demand"}, _NO_RESERVATION),
    Variant("a4, 2 nodes", "a4-gemma4", {"nodes": 2, "recipeOverrides": ["distributed.world_size=16"]}),
    Variant("a4, docker", "a4-gemma4", {"imageBuild": "docker"}),
    Variant(
        "a4, spot, budget, alert emails", "a4-gemma4", {"capacity": "spot", **BUDGET, **ALERT_EMAILS}, _NO_RESERVATION
    ),
    Variant("ray (ephemeral, 2 nodes)", "ray-gemma3-vision"),
    Variant("ray, standing", "ray-gemma3-vision", {"rayCluster": "standing"}),
    Variant(
        "ray, spot, 1 node",
        "ray-gemma3-vision",
        {"capacity": "spot", "nodes": 1, "recipeOverrides": ["distributed.world_size=8"]},
        _NO_RESERVATION,
    ),
    Variant("ray, docker", "ray-gemma3-vision", {"imageBuild": "docker"}),
    Variant("ray, alert emails", "ray-gemma3-vision", ALERT_EMAILS),
)


@pytest.fixture(scope="session")
def user_variant_runs() -> list[tuple[Variant, StackRun]]:
    """One offline run per user variant, shared by the permission proof and the ordering invariants."""
    return [(v, v.run()) for v in USER_VARIANTS]


@pytest.fixture(scope="session")
def all_runs() -> list[StackRun]:
    """One offline run per variant, shared by the cross-stack invariant tests."""
    return [run_stack(stack, overrides=overrides, assume_trained=trained) for stack, overrides, trained in variants()]


__all__ = ["MOCK_HF_TOKEN", "PREBUILT", "contains", "plain_paths"]


@pytest.fixture
def own_dir() -> Iterator[Path]:
    """A folder of the repository outside trainer/recipes/ (under build/, which git ignores), for a user's recipe."""
    import shutil
    import uuid

    folder = REPO_ROOT / "build" / "own-recipe-tests" / uuid.uuid4().hex[:8]
    folder.mkdir(parents=True)
    yield folder
    shutil.rmtree(folder)
