"""A GKE cluster is replaced only when the stack moves, and then everything in it is replaced with it.

terraform-provider-google forces a new cluster when its `description` (or name, location, network…) changes
(google/services/container/resource_container_cluster.go), and with an explicit name the bridge deletes it first.
If a setting users change fed one of those inputs, changing it would delete the cluster and its running run. And
if the Kubernetes provider survived a replaced cluster (pulumi-kubernetes `DiffConfig` keeps it while a
`clusterIdentifier` stays the same), the Namespace, service account and Secret would stay in state but not in the
new cluster: the next Job would be created into a namespace that does not exist.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from infra.offline import impact
from infra.offline.engine import StackRun, run_stack

CLUSTER = "gcp:container/cluster:Cluster"
PROVIDER = "pulumi:providers:kubernetes"
GKE = ("a4-gemma4", "ray-gemma3-vision")
# The change that replaced the cluster (its description named the GPU); every other everyday key is checked on the
# committed plans of `make impact` (tests/infra/test_change_impact.py TestSafetyRules).
GPU_CHANGE = next(c for c in impact.CHANGES if c.key == "gpuType" and "a4-gemma4" in c.stacks)


@pytest.mark.parametrize("stack", GKE)
def test_a_gpu_type_change_feeds_no_input_that_replaces_the_cluster(stack: str) -> None:
    """The cluster's inputs minus its `ignore_changes` change only at paths its provider updates in place."""
    rule = impact.rules()[CLUSTER]
    for change in (GPU_CHANGE,):
        before, after = impact.plan(change, stack)
        old, new = before.one(CLUSTER), after.one(CLUSTER)
        ignored = set(new.ignore_changes)
        olds = {k: v for k, v in old.plain_inputs().items() if k not in ignored}
        news = {k: v for k, v in new.plain_inputs().items() if k not in ignored}
        forced = [p for p in impact.diff_paths(olds, news) if impact.covers(rule.replace, p)]
        assert forced == [], f"{change.label} on {stack} changes {forced}: the cluster would be replaced"


def test_the_description_names_no_setting() -> None:
    described = {
        run_stack("a4-gemma4", overrides=o, remove=r).one(CLUSTER).plain_inputs()["description"]
        for o, r in (({}, ()), ({"gpuType": "nvidia-h200-141gb", "capacity": "spot",
                                  "recipeOverrides": ["distributed.gpu=h200"]}, ("reservationName",)))
    }  # fmt: skip
    assert len(described) == 1, described
    assert "description" in run_stack("a4-gemma4").one(CLUSTER).ignore_changes, "set once: older clusters keep theirs"


@pytest.fixture(scope="module", params=GKE)
def up(request: pytest.FixtureRequest) -> StackRun:
    return run_stack(request.param, existing_buckets=(f"my-gcp-project-gft-{request.param}",))


def replaced_cluster(run: StackRun) -> StackRun:
    """The next plan with the cluster replaced in place of its old one (a forced input changed, the name kept)."""
    resources = [
        replace(r, inputs={**r.inputs, "enableAutopilot": False}) if r.type == CLUSTER else r for r in run.resources
    ]
    return replace(run, resources=resources)


def test_a_replaced_cluster_replaces_the_provider_and_every_kubernetes_object(up: StackRun) -> None:
    impacts = impact.classify(up, replaced_cluster(up))
    assert impacts[up.one(CLUSTER).urn].action == "replace"
    assert impacts[up.one(PROVIDER).urn].action == "replace", impacts[up.one(PROVIDER).urn]
    objects = [r for r in up.resources if r.type.startswith("kubernetes:")]
    assert {r.type.rsplit(":", 1)[-1] for r in objects} >= {"Namespace", "ServiceAccount", "Secret"}
    kept = [r.urn for r in objects if impacts[r.urn].action != "replace"]
    assert kept == [], f"left in state, gone from the new cluster: {kept}"


def test_an_update_of_the_cluster_replaces_nothing_in_it(up: StackRun) -> None:
    after = run_stack(
        up.stack, overrides={"releaseChannel": "RAPID", "labels": ["team=x"]}, existing_buckets=up_buckets(up)
    )
    impacts = impact.classify(up, after)
    assert impacts[up.one(CLUSTER).urn].action == "update"
    assert impacts[up.one(PROVIDER).urn].action == "unchanged"
    assert [i.name for i in impacts.values() if i.type.startswith("kubernetes:") and i.action == "replace"] == []


def up_buckets(run: StackRun) -> tuple[str, ...]:
    return (str(run.outputs["bucket"]).removeprefix("gs://"),)
