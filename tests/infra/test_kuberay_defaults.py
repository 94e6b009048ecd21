"""A second `pulumi up` with nothing changed leaves a Ray run alone, and only a change of what it runs restarts it.

The API server stores a RayJob / RayCluster through KubeRay's CRD schema: unknown fields are dropped, absent
fields with a `default:` are filled. pulumi-kubernetes then diffs that live object, pruned to the program's
inputs, against the next inputs; under `replace_on_changes` any difference is a restart of the run. The schemas
are KubeRay's own at each version the GKE Ray operator add-on runs on the GKE minors the stack can use
(infra/offline/kuberay_crds.json, read from ray-project/kuberay ray-operator/config/crd/bases at v1.2.2 to v1.5.2).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from infra import ray_job
from infra.offline import impact, kuberay_crds
from infra.offline.engine import StackRun, run_stack
from infra.offline.plan import k8s_manifest

RAYJOB = "kubernetes:ray.io/v1:RayJob"
VARIANTS = {
    "ephemeral": {},
    "standing": {"rayCluster": "standing"},
    "one node": {"nodes": 1, "recipeOverrides": ["distributed.world_size=8"]},
}


@pytest.fixture(scope="module")
def planned() -> dict[str, StackRun]:
    return {label: run_stack("ray-gemma3-vision", overrides=o) for label, o in VARIANTS.items()}


def ray_manifests(run: StackRun) -> list[dict[str, Any]]:
    return [m for m in (k8s_manifest(r) for r in run.resources) if m and m["apiVersion"] == "ray.io/v1"]


@pytest.mark.parametrize("version", sorted(set(kuberay_crds.ADDON_KUBERAY.values())))
@pytest.mark.parametrize("label", VARIANTS)
def test_the_api_server_keeps_every_field_the_program_sets(
    planned: dict[str, StackRun], label: str, version: str
) -> None:
    manifests = ray_manifests(planned[label])
    assert manifests
    for manifest in manifests:
        assert kuberay_crds.differences(manifest, version) == [], (label, manifest["kind"])


def test_the_check_can_fail(planned: dict[str, StackRun]) -> None:
    """KubeRay 1.1 (GKE 1.29-1.30) had no `backoffLimit`: the server would drop it, and the diff would see it."""
    data = copy.deepcopy(kuberay_crds.load())
    del data["versions"]["v1.2.2"]["RayJob"]["properties"]["backoffLimit"]
    (job,) = [m for m in ray_manifests(planned["ephemeral"]) if m["kind"] == "RayJob"]
    assert kuberay_crds.differences(job, "v1.2.2", data) == ["spec.backoffLimit"]


def test_defaults_fill_only_what_the_program_leaves_out() -> None:
    schema = {"properties": {"a": {"type": "integer", "default": 0}, "b": {"type": "string", "default": "x"}}}
    assert kuberay_crds.served(schema, {"a": 5}) == {"a": 5, "b": "x"}
    assert kuberay_crds.prune_to_inputs(kuberay_crds.served(schema, {"a": 5}), {"a": 5}) == {"a": 5}


def test_every_spec_field_restarts_the_run_or_changes_in_place(planned: dict[str, StackRun]) -> None:
    for run in planned.values():
        for manifest in ray_manifests(run):
            kind = manifest["kind"]
            decided = set(ray_job.RESTARTING_FIELDS[kind]) | set(ray_job.IN_PLACE_FIELDS[kind])
            assert set(manifest["spec"]) <= decided, (kind, sorted(set(manifest["spec"]) - decided))


def test_replace_on_changes_names_the_restarting_fields_only(planned: dict[str, StackRun]) -> None:
    job = planned["ephemeral"].one(RAYJOB)
    assert job.replace_on_changes == [f"spec.{f}" for f in ray_job.RESTARTING_FIELDS["RayJob"]]
    assert "spec" not in job.replace_on_changes


@pytest.mark.parametrize(
    ("change", "action"),
    [
        ({"trainingTimeoutMinutes": 600}, "update"),
        ({"trainingRetries": 3}, "update"),
        ({"capacity": "spot"}, "replace"),
    ],
)
def test_limits_change_in_place_and_placement_restarts(
    planned: dict[str, StackRun], change: dict[str, Any], action: str
) -> None:
    before = planned["ephemeral"]
    remove = ("reservationName",) if change.get("capacity") == "spot" else ()
    after = run_stack("ray-gemma3-vision", overrides=change, remove=remove)
    assert impact.classify(before, after)[before.one(RAYJOB).urn].action == action
