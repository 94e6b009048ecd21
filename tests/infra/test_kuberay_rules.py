"""KubeRay's own admission rules (ported from ray-project/kuberay v1.7.0
ray-operator/controllers/ray/utils/validation.go into infra/offline/validate_manifests.py) over every Ray variant the
program plans, and each rule seen failing on a manifest that breaks it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.offline import validate_manifests as vm
from infra.offline.engine import run_stack
from infra.offline.plan import k8s_manifest

from .conftest import PREBUILT

RAY_VARIANTS = {
    "ephemeral": {},
    "standing": {"rayCluster": "standing"},
    "standing, two nodes": {"rayCluster": "standing", "nodes": 2},
    "ephemeral, two nodes": {"nodes": 2},
}


@pytest.fixture(scope="module")
def ray_manifests() -> dict[str, list[dict[str, Any]]]:
    planned = {}
    for label, overrides in RAY_VARIANTS.items():
        run = run_stack("ray-gemma3-vision", overrides={**PREBUILT, **overrides})
        planned[label] = [
            m for m in (k8s_manifest(r) for r in run.resources) if m and m["apiVersion"].startswith("ray.io/")
        ]
    return planned


@pytest.mark.parametrize("label", list(RAY_VARIANTS))
def test_every_ray_variant_passes_kuberays_rules(ray_manifests: dict[str, list[dict[str, Any]]], label: str) -> None:
    manifests = ray_manifests[label]
    assert {m["kind"] for m in manifests} == ({"RayJob", "RayCluster"} if "standing" in label else {"RayJob"})
    for manifest in manifests:
        assert vm.kuberay_rule_errors(manifest) == [], (label, manifest["kind"])


def test_the_standing_rayjob_has_no_backoff_limit(ray_manifests: dict[str, list[dict[str, Any]]]) -> None:
    [job] = [m for m in ray_manifests["standing"] if m["kind"] == "RayJob"]
    assert job["spec"]["clusterSelector"] and "backoffLimit" not in job["spec"]
    [ephemeral] = ray_manifests["ephemeral"]
    assert ephemeral["spec"]["backoffLimit"] >= 1  # trainingRetries still applies where KubeRay allows it


def test_make_lint_plans_and_validates_the_standing_variant(tmp_path: Path) -> None:
    folders = vm.plan_all(tmp_path)
    assert "ray-gemma3-vision+standing" in folders
    files = vm.manifest_files(tmp_path, ["ray-gemma3-vision+standing"])
    kinds = {yaml.safe_load(f.read_text())["kind"] for f in files}
    assert {"RayJob", "RayCluster"} <= kinds
    outcomes = [o for f in files for o in vm.validate_file(f, tmp_path)]
    assert all(o.status == "valid" for o in outcomes), [(o.where, o.errors) for o in outcomes if o.errors]


def _standing(ray_manifests: dict[str, list[dict[str, Any]]], kind: str) -> dict[str, Any]:
    [found] = [m for m in ray_manifests["standing"] if m["kind"] == kind]
    return copy.deepcopy(found)


def test_clusterselector_with_backofflimit_is_refused_as_kuberay_1_6_does(
    ray_manifests: dict[str, list[dict[str, Any]]],
) -> None:
    job = _standing(ray_manifests, "RayJob")
    job["spec"]["backoffLimit"] = 2  # what the program rendered before
    errors = vm.kuberay_rule_errors(job)
    assert errors == [
        "spec.backoffLimit: BackoffLimit is incompatible with ClusterSelector mode (v1.6, kuberay PR #4527)"
    ]
    job["spec"]["backoffLimit"] = 0  # KubeRay only refuses a limit above 0
    assert vm.kuberay_rule_errors(job) == []
    outcome = vm.validate_document({**job, "spec": {**job["spec"], "backoffLimit": 1}}, "x")
    assert outcome.status == "invalid" and any("KubeRay v1.7.0 rule" in e for e in outcome.errors), outcome


BROKEN_JOB = [
    ("spec.ttlSecondsAfterFinished", lambda s: s.update(ttlSecondsAfterFinished=60)),
    ("spec.suspend", lambda s: s.update(suspend=True)),
    ("cluster name (ray.io/cluster)", lambda s: s.update(clusterSelector={"ray.io/cluster": ""})),
    ("rayClusterSpec or clusterSelector", lambda s: s.pop("clusterSelector")),
    ("activeDeadlineSeconds: must be a positive", lambda s: s.update(activeDeadlineSeconds=0)),
    (
        "InteractiveMode",
        lambda s: (
            s.pop("clusterSelector"),
            s.update(submissionMode="InteractiveMode", backoffLimit=1, rayClusterSpec={}),
        ),
    ),
    ("runtimeEnvYAML: not valid YAML", lambda s: s.update(runtimeEnvYAML="pip: [a")),
]


@pytest.mark.parametrize("needle,breaks", BROKEN_JOB, ids=[n for n, _ in BROKEN_JOB])
def test_each_rayjob_rule_fails_a_job_that_breaks_it(
    ray_manifests: dict[str, list[dict[str, Any]]], needle: str, breaks: Any
) -> None:
    job = _standing(ray_manifests, "RayJob")
    breaks(job["spec"])
    errors = vm.kuberay_rule_errors(job)
    assert any(needle in e for e in errors), errors


def test_rayjob_name_and_cluster_rules(ray_manifests: dict[str, list[dict[str, Any]]]) -> None:
    job = _standing(ray_manifests, "RayJob")
    job["metadata"]["name"] = "x" * 48  # 47 at most: KubeRay appends a suffix for the cluster
    assert any("no more than 47 characters" in e for e in vm.kuberay_rule_errors(job))
    cluster = _standing(ray_manifests, "RayCluster")
    group = cluster["spec"]["workerGroupSpecs"][0]
    group.pop("maxReplicas")  # v1.6: both bounds when autoscaling is off
    assert any("must set both minReplicas and maxReplicas" in e for e in vm.kuberay_rule_errors(cluster))
    group["maxReplicas"], group["minReplicas"] = 1, 2
    assert any("greater than maxReplicas 1" in e for e in vm.kuberay_rule_errors(cluster))
    cluster = _standing(ray_manifests, "RayCluster")
    cluster["spec"]["headGroupSpec"]["rayStartParams"]["labels"] = "a=b"
    cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "RAY_ENABLE_AUTOSCALER_V2", "value": "1"}
    ]
    errors = vm.kuberay_rule_errors(cluster)
    assert any("rayStartParams.labels" in e for e in errors) and any("RAY_ENABLE_AUTOSCALER_V2" in e for e in errors)
    cluster = _standing(ray_manifests, "RayCluster")
    cluster["spec"]["workerGroupSpecs"][0]["suspend"] = True  # in the schema; an operator without the gate refuses it
    assert vm.validate_document(cluster, "x").status == "invalid"
    assert any("RayJobDeletionPolicy feature gate" in e for e in vm.kuberay_rule_errors(cluster))
