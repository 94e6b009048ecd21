"""Required pod (anti-)affinity, evaluated with the scheduler's semantics over the rendered manifests.

A zone affinity that also selects a pod without GPUs (the Ray head) pins every GPU pod to that pod's zone, so a
zonal reservation elsewhere is never used. A pod whose required affinity matches nothing is placed only if it
matches its own terms ("the first pod in a series that have affinity to themselves": kubernetes/kubernetes
pkg/scheduler/framework/plugins/interpodaffinity/filtering.go `satisfyPodAffinity` /
`podMatchesAllAffinityTerms`); otherwise it stays Pending for ever in a fresh zone.

The checks run over every stack and every variant users pick (each capacity mode, nodes 1 and 2, Ray ephemeral
and standing), on the planned manifests, and evaluate label selectors as Kubernetes does
(k8s.io/apimachinery pkg/apis/meta/v1/helpers.go `LabelSelectorAsSelector`, pkg/labels/selector.go
`Requirement.Matches`): a null selector selects nothing, `{}` everything, every `matchLabels` and
`matchExpressions` entry must hold, `NotIn` holds when the key is absent. A term's namespaces default to the
pod's own; `namespaceSelector: {}` means all.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest

from infra.offline.engine import StackRun, run_stack
from tests.infra.conftest import PREBUILT
from tests.infra.k8s_validate import k8s_resources, manifest, pod_templates

GPU = "nvidia.com/gpu"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
CAPACITY: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "reservation": ({}, ()),
    "spot": ({"capacity": "spot"}, ("reservationName",)),
    "flex-start": ({"capacity": "flex-start"}, ("reservationName",)),
    "on-demand": ({"capacity": "on-demand"}, ("reservationName",)),
}


# --- Kubernetes semantics ------------------------------------------------------------------------


def requirement_holds(expression: dict[str, Any], labels: dict[str, str]) -> bool:
    key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
    if operator == "In":
        return key in labels and labels[key] in values
    if operator == "NotIn":
        return key not in labels or labels[key] not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    raise ValueError(f"{operator!r} is not a label selector operator")


def selector_matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """metav1.LabelSelector: null selects nothing, {} everything, every clause must hold."""
    if selector is None:
        return False
    if not selector.get("matchLabels") and not selector.get("matchExpressions"):
        return True
    if any(labels.get(key) != value for key, value in (selector.get("matchLabels") or {}).items()):
        return False
    return all(requirement_holds(e, labels) for e in selector.get("matchExpressions") or [])


@dataclass(frozen=True)
class Pod:
    """One pod template of a run, where it sits, and the namespace its pods land in."""

    where: str
    namespace: str
    labels: dict[str, str]
    spec: dict[str, Any]

    @property
    def gpus(self) -> int:
        total = 0
        for container in [*self.spec.get("containers", []), *self.spec.get("initContainers", [])]:
            resources = container.get("resources") or {}
            amount = (resources.get("limits") or {}).get(GPU) or (resources.get("requests") or {}).get(GPU) or 0
            total += int(float(amount))
        return total

    def required_terms(self, kind: str) -> list[dict[str, Any]]:
        return list(((self.spec.get("affinity") or {}).get(kind) or {}).get(REQUIRED) or [])


def effective_selector(term: dict[str, Any], owner: Pod) -> dict[str, Any] | None:
    """The term's labelSelector with matchLabelKeys / mismatchLabelKeys merged in from the owner's labels, as the
    API server does when it admits the pod (KEP-3633)."""
    selector = copy.deepcopy(term.get("labelSelector"))
    extra = [
        {"key": k, "operator": "In", "values": [owner.labels[k]]}
        for k in term.get("matchLabelKeys") or []
        if k in owner.labels
    ] + [
        {"key": k, "operator": "NotIn", "values": [owner.labels[k]]}
        for k in term.get("mismatchLabelKeys") or []
        if k in owner.labels
    ]
    if selector is None or not extra:
        return selector
    selector["matchExpressions"] = [*(selector.get("matchExpressions") or []), *extra]
    return selector


def term_matches(term: dict[str, Any], owner: Pod, pod: Pod, namespace_labels: dict[str, dict[str, str]]) -> bool:
    """Whether `pod` counts for `owner`'s affinity term: in one of the term's namespaces, and selected."""
    namespaces = term.get("namespaces") or []
    ns_selector = term.get("namespaceSelector")
    if namespaces or ns_selector is not None:
        labels = {**namespace_labels.get(pod.namespace, {}), "kubernetes.io/metadata.name": pod.namespace}
        in_scope = pod.namespace in namespaces or (ns_selector is not None and selector_matches(ns_selector, labels))
    else:
        in_scope = pod.namespace == owner.namespace
    return in_scope and selector_matches(effective_selector(term, owner), pod.labels)


def run_pods(objects: list[dict[str, Any]]) -> list[Pod]:
    """Every pod template the run's objects create (Jobs, Ray head / workers / submitter, plain Pods)."""
    pods: list[Pod] = []
    for obj in objects:
        namespace = obj["metadata"].get("namespace", "default")
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in ("RayJob", "RayCluster"):
            templates = pod_templates(obj)
        elif obj["kind"] == "Pod":
            templates = [("pod", {"metadata": obj["metadata"], "spec": obj["spec"]})]
        elif "template" in (obj.get("spec") or {}):
            templates = [("template", obj["spec"]["template"])]
        else:
            continue
        for where, template in templates:
            labels = dict((template.get("metadata") or {}).get("labels") or {})
            pods.append(Pod(f"{name}:{where}", namespace, labels, template["spec"]))
    return pods


def affinity_problems(objects: list[dict[str, Any]]) -> tuple[list[str], int]:
    """Problems of every GPU pod's required pod (anti-)affinity, and how many terms were evaluated."""
    namespace_labels = {
        o["metadata"]["name"]: dict(o["metadata"].get("labels") or {}) for o in objects if o["kind"] == "Namespace"
    }
    pods = run_pods(objects)
    problems: list[str] = []
    evaluated = 0
    for owner in (p for p in pods if p.gpus):
        for kind in ("podAffinity", "podAntiAffinity"):
            for term in owner.required_terms(kind):
                evaluated += 1
                for other in pods:
                    if not other.gpus and term_matches(term, owner, other, namespace_labels):
                        problems.append(
                            f"{owner.where}: required {kind} ({term['topologyKey']}) selects {other.where}, which "
                            "holds no GPU: the GPU pods would be placed by where that pod landed"
                        )
        terms = owner.required_terms("podAffinity")
        if terms and not all(term_matches(t, owner, owner, namespace_labels) for t in terms):
            problems.append(
                f"{owner.where}: its required podAffinity does not match the pod itself, so in a zone where no "
                "matching pod runs yet it can never be scheduled"
            )
    return problems, evaluated


def objects_of(stack_run: StackRun) -> list[dict[str, Any]]:
    return [manifest(r) for r in k8s_resources(stack_run.resources)]


# --- the semantics, checked on their own ------------------------------------------------------------


class TestSelectorSemantics:
    """The evaluator agrees with Kubernetes' documented rules; otherwise the invariants below prove little."""

    @pytest.mark.parametrize(
        ("selector", "labels", "expected"),
        [
            (None, {"a": "1"}, False),
            ({}, {}, True),
            ({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"}, True),
            ({"matchLabels": {"a": "1", "b": "3"}}, {"a": "1", "b": "2"}, False),
            ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]}, {"a": "2"}, True),
            ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}]}, {}, False),
            ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {}, True),
            ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {"a": "1"}, False),
            ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {"a": ""}, True),
            ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {"a": "x"}, False),
            (
                {"matchLabels": {"a": "1"}, "matchExpressions": [{"key": "b", "operator": "Exists"}]},
                {"a": "1"},
                False,
            ),
        ],
    )
    def test_label_selector(self, selector: dict[str, Any] | None, labels: dict[str, str], expected: bool) -> None:
        assert selector_matches(selector, labels) is expected

    def test_namespaces_default_to_the_pods_own(self) -> None:
        term = {"labelSelector": {}, "topologyKey": "z"}
        owner = Pod("a", "ns1", {}, {})
        assert term_matches(term, owner, Pod("b", "ns1", {}, {}), {})
        assert not term_matches(term, owner, Pod("c", "ns2", {}, {}), {})
        assert term_matches({**term, "namespaceSelector": {}}, owner, Pod("c", "ns2", {}, {}), {})
        assert term_matches({**term, "namespaces": ["ns2"]}, owner, Pod("c", "ns2", {}, {}), {})

    def test_match_label_keys_take_the_owners_value(self) -> None:
        term = {"labelSelector": {}, "matchLabelKeys": ["run"], "topologyKey": "z"}
        owner = Pod("a", "ns", {"run": "r1"}, {})
        assert term_matches(term, owner, Pod("b", "ns", {"run": "r1"}, {}), {})
        assert not term_matches(term, owner, Pod("c", "ns", {"run": "r2"}, {}), {})


# --- the invariants, over every stack and variant ----------------------------------------------------


def _cases() -> list[Any]:
    cases = []
    for capacity in CAPACITY:
        for nodes in (1, 2):
            cases.append(pytest.param("a4-gemma4", {}, capacity, nodes, id=f"a4-{capacity}-{nodes}node"))
            for cluster in ("ephemeral", "standing"):
                cases.append(
                    pytest.param(
                        "ray-gemma3-vision",
                        {"rayCluster": cluster},
                        capacity,
                        nodes,
                        id=f"ray-{cluster}-{capacity}-{nodes}node",
                    )
                )
    return cases


@pytest.mark.parametrize(("stack", "extra", "capacity", "nodes"), _cases())
def test_gpu_pods_follow_only_gpu_pods_and_can_start(
    stack: str, extra: dict[str, Any], capacity: str, nodes: int
) -> None:
    overrides, remove = CAPACITY[capacity]
    sized = {"a4-gemma4": 8, "ray-gemma3-vision": 16}[stack] == 8 * nodes  # the recipe's distributed.world_size
    resize = {} if sized else {"recipeOverrides": [f"distributed.world_size={8 * nodes}"]}
    stack_run = run_stack(stack, overrides={**PREBUILT, **extra, **overrides, **resize, "nodes": nodes}, remove=remove)
    objects = objects_of(stack_run)
    pods = run_pods(objects)
    assert any(p.gpus for p in pods), f"{stack}: no GPU pod found among {[p.where for p in pods]}"
    problems, evaluated = affinity_problems(objects)
    assert not problems, "\n".join(problems)
    if nodes > 1:
        assert evaluated, f"{stack} with nodes={nodes}: the GPU pods must be kept in one zone by a required affinity"


class TestTheCheckCatchesTheDefect:
    """The invariant fails on the affinity this project used to render, and on one that cannot start."""

    @pytest.fixture(scope="class")
    def ray_objects(self) -> list[dict[str, Any]]:
        return objects_of(run_stack("ray-gemma3-vision", overrides=PREBUILT))

    def _worker_term(self, objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
        (job,) = [o for o in objects if o["kind"] == "RayJob"]
        worker = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]
        (term,) = worker["spec"]["affinity"]["podAffinity"][REQUIRED]
        return worker, term

    def test_selecting_the_run_label_pins_workers_to_the_head(self, ray_objects: list[dict[str, Any]]) -> None:
        objects = copy.deepcopy(ray_objects)
        worker, term = self._worker_term(objects)
        term["labelSelector"] = {
            "matchLabels": {"gemma-finetune/run": worker["metadata"]["labels"]["gemma-finetune/run"]}
        }
        problems, _ = affinity_problems(objects)
        assert any("holds no GPU" in p and ":head" in p for p in problems), problems

    def test_an_affinity_that_misses_itself_cannot_start(self, ray_objects: list[dict[str, Any]]) -> None:
        objects = copy.deepcopy(ray_objects)
        _, term = self._worker_term(objects)
        term["labelSelector"] = {"matchLabels": {"gemma-finetune/gpu-group": "another-run"}}
        problems, _ = affinity_problems(objects)
        assert any("does not match the pod itself" in p for p in problems), problems
