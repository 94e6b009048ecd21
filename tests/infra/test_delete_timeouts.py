"""`pulumi destroy` (or a replacement) during a run waits long enough for the GPU pods to stop.

pulumi-kubernetes deletes in the foreground and waits 10 minutes by default (pulumi/pulumi-kubernetes
provider/pkg/await/await.go `Deletion`: `timeout := 10 * time.Minute` unless the resource's custom timeout
says otherwise): a Job, RayJob or Namespace is gone only once its pods are, and a GPU pod may take its whole
`terminationGracePeriodSeconds` (600 s: the trainer saves its step on SIGTERM) before the cascade even ends.
For a Job or a Namespace, `pulumi.com/skipAwait` also skips that wait (provider/pkg/metadata/overrides.go
`allowsSkipAwaitWithDelete`): a replacement under the same name would then create the new Job while the old one
still terminates, and fail with "already exists".
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest

from infra.gke_workload import DELETE_MARGIN_S, TERMINATION_GRACE_S
from infra.offline.engine import Recorded, StackRun, run_stack
from infra.offline.plan import k8s_manifest
from infra.policy.policies import walk

PULUMI_KUBERNETES_DELETE_AWAIT_S = 10 * 60
# pulumi-kubernetes overrides.go allowsSkipAwaitWithDelete: the kinds whose skipAwait also skips the delete await.
SKIP_AWAIT_SKIPS_DELETE = {"Namespace", "Pod", "ReplicationController", "DaemonSet", "Deployment", "StatefulSet", "Job"}
AWAITED = {"Job", "RayJob", "RayCluster", "Namespace"}
VARIANTS = {
    "a4-gemma4": {},
    "a4-gemma4, 2 nodes": {"nodes": 2, "recipeOverrides": ["distributed.world_size=16"]},
    "ray-gemma3-vision": {},
    "ray-gemma3-vision, standing": {"rayCluster": "standing"},
}


def seconds(duration: str) -> int:
    """A Pulumi custom timeout (a Go duration: "15m", "1h30m", "90s") in seconds."""
    parts = re.findall(r"(\d+)([hms])", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(int(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def longest_grace(run: StackRun) -> int:
    """The longest terminationGracePeriodSeconds of any pod template the stack applies (Kubernetes' default: 30)."""
    graces = [30]
    for r in run.resources:
        manifest = k8s_manifest(r)
        if manifest:
            graces += [int(v) for path, _, v in walk(manifest) if path.endswith("terminationGracePeriodSeconds")]
    return max(graces)


def kind(resource: Recorded) -> str:
    return resource.type.rsplit(":", 1)[-1]


def delete_problems(run: StackRun) -> list[str]:
    needed = longest_grace(run) + DELETE_MARGIN_S
    problems: list[str] = []
    for r in run.resources:
        if not r.type.startswith("kubernetes:") or kind(r) not in AWAITED:
            continue
        timeout = r.custom_timeouts.get("delete")
        if timeout is None or seconds(timeout) < needed:
            problems.append(f"{r.urn}: delete timeout {timeout or '10m (default)'} < grace + margin = {needed} s")
        annotations: dict[str, Any] = (r.plain_inputs().get("metadata") or {}).get("annotations") or {}
        if kind(r) in SKIP_AWAIT_SKIPS_DELETE and annotations.get("pulumi.com/skipAwait") == "true":
            problems.append(f"{r.urn}: skipAwait makes pulumi-kubernetes skip the delete await")
    return problems


@pytest.mark.parametrize("label", VARIANTS)
def test_deletes_outlast_the_pods_grace(label: str) -> None:
    run = run_stack(label.split(",")[0], overrides=VARIANTS[label])
    assert {kind(r) for r in run.resources} & AWAITED, label
    assert longest_grace(run) == TERMINATION_GRACE_S, "the GPU pods' grace is the one the timeouts are made for"
    assert delete_problems(run) == []


def test_the_numbers() -> None:
    """600 s of grace, 300 s for the cascade: 15 minutes, past pulumi-kubernetes' 10."""
    assert (TERMINATION_GRACE_S, DELETE_MARGIN_S) == (600, 300)
    assert TERMINATION_GRACE_S + DELETE_MARGIN_S > PULUMI_KUBERNETES_DELETE_AWAIT_S
    assert seconds("15m") == 900 and seconds("1h30m") == 5400


def test_the_check_can_fail() -> None:
    run = run_stack("a4-gemma4")
    short = [replace(r, custom_timeouts={"delete": "10m"}) if kind(r) == "Job" else r for r in run.resources]
    problems = delete_problems(replace(run, resources=short))
    assert len(problems) == 1 and "delete timeout 10m" in problems[0], problems
