"""Stack runs and helpers for the policy-pack tests: the real program under mocks, checked as the engine would."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pytest
from pulumi_policy import PolicyCustomTimeouts, PolicyResourceOptions, ResourceValidationArgs
from pulumi_policy.proxy import unknown_checking_proxy

from infra.offline.engine import Recorded, StackRun, run_stack, stack_names
from infra.policy import policies

SERVING_PRIVATE = "dev+serving"
SERVING_PUBLIC = "dev+serving-public"


def variants() -> dict[str, tuple[str, dict[str, Any], bool]]:
    """Every stack file as committed, plus dev serving (private, and public by choice) after training."""
    cases: dict[str, tuple[str, dict[str, Any], bool]] = {stack: (stack, {}, False) for stack in stack_names()}
    if "dev" in stack_names():
        cases[SERVING_PRIVATE] = ("dev", {"servingEnabled": True, "servingInvokers": ["user:alice@example.com"]}, True)
        cases[SERVING_PUBLIC] = ("dev", {"servingEnabled": True, "servingPublic": True}, True)
    return cases


@pytest.fixture(scope="session")
def stack_runs() -> dict[str, StackRun]:
    """One offline run per variant, shared by the policy tests."""
    return {
        key: run_stack(stack, overrides=overrides, assume_trained=trained)
        for key, (stack, overrides, trained) in variants().items()
    }


@pytest.fixture(scope="session")
def preview_runs() -> dict[str, StackRun]:
    """The same variants as a first `pulumi preview` sees them (as a PR preview does): images are not built
    (`build_on_preview=False`), so every digest is unknown, and so is everything else the cloud computes."""
    return {
        key: run_stack(stack, overrides=overrides, assume_trained=trained, preview=True)
        for key, (stack, overrides, trained) in variants().items()
    }


def props_of(resource: Recorded) -> dict[str, Any]:
    """What the engine hands a policy: the inputs, camelCase, secrets unwrapped (a deep copy, free to mutate)."""
    return copy.deepcopy(resource.plain_inputs())


def find(runs: Mapping[str, StackRun], resource_type: str) -> Recorded:
    """The first resource of a type in any variant (the bad-input tests start from real resources)."""
    for run in runs.values():
        for resource in run.resources:
            if resource.type == resource_type:
                return resource
    pytest.fail(f"no {resource_type} in any stack: {sorted(runs)}")


def engine_args(resource_type: str, props: Mapping[str, Any], urn: str = "urn:test", name: str = "test") -> Any:
    """ResourceValidationArgs as the analyzer builds them: props behind the unknown-checking proxy."""
    options = PolicyResourceOptions(False, [], None, [], PolicyCustomTimeouts(0, 0, 0), [])
    return ResourceValidationArgs(resource_type, unknown_checking_proxy(dict(props)), urn, name, options, None)


def run_pack(resource_type: str, props: Mapping[str, Any]) -> dict[str, list[str]]:
    """Every policy of the pack, called the way the engine calls it; violations by policy name."""
    found: dict[str, list[str]] = {}
    for policy in policies.resource_policies():
        reported: list[str] = []
        policy.validate(
            engine_args(resource_type, props), lambda message, _urn=None, into=reported: into.append(message)
        )
        if reported:
            found[policy.name] = reported
    return found
