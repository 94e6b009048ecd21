"""The GKE stacks' NetworkPolicies, replayed on the connections a training run makes.

`admitted` decides one connection the way the Kubernetes NetworkPolicy API defines it (kubernetes.io,
"Network Policies"; networking.k8s.io/v1 NetworkPolicySpec): a pod that some policy selects for Ingress admits
only what one of those policies' rules allows (a peer and a port); a podSelector peer alone means pods of the
policy's namespace, a namespaceSelector and a podSelector in one peer mean both, an ipBlock matches addresses.
GKE Autopilot enforces NetworkPolicy (Dataplane V2, always on in Autopilot).

What must connect: a Ray cluster's pods with each other on any port (GCS 6379, the raylets' and object
managers' ports, the training collective's NCCL ports), KubeRay's submitter to the job API, GKE's KubeRay
operator (Google-managed, outside the cluster's pods) to the job API, and Managed Prometheus's collectors to
Ray's metrics port; a multi-node Job's ranks with each other (rendezvous 29500, NCCL on any port). On GKE the
control plane reaches a pod through the konnectivity agents, pods in kube-system, so that traffic comes from a
Pod address (tigera/operator PR #5212: "On AKS and GKE the apiserver proxies admission calls through those
pods, so they arrived with a pod source IP"); on Autopilot the collectors run in gke-gmp-system.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

import pytest

from infra import ray_job
from infra.gke import POD_RANGE
from infra.gke_workload import RUN_LABEL
from infra.offline.engine import StackRun, run_stack
from tests.infra.conftest import PREBUILT
from tests.infra.k8s_validate import manifest, pod_templates

POLICY = "kubernetes:networking.k8s.io/v1:NetworkPolicy"
RAY_STACK, JOB_STACK = "ray-gemma3-vision", "a4-gemma4"


@dataclass(frozen=True)
class Source:
    namespace: str | None
    """None: not a pod (an address outside the cluster's Pod range)."""
    ip: str
    labels: dict[str, str] = field(default_factory=dict)


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not ok:
            return False
    return True


def _peer_matches(peer: dict[str, Any], policy_namespace: str, source: Source) -> bool:
    if "ipBlock" in peer:
        address = ipaddress.ip_address(source.ip)
        block = peer["ipBlock"]
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(cidr) for cidr in block.get("except", [])
        )
    if source.namespace is None:
        return False
    if "namespaceSelector" in peer:
        namespace_labels = {"kubernetes.io/metadata.name": source.namespace}
        if not _selects(peer["namespaceSelector"], namespace_labels):
            return False
    elif source.namespace != policy_namespace:
        return False
    return _selects(peer.get("podSelector", {}), source.labels)


def _port_matches(ports: list[dict[str, Any]] | None, port: int) -> bool:
    if not ports:
        return True
    return any(
        p.get("protocol", "TCP") == "TCP"
        and (p.get("port") is None or p["port"] <= port <= p.get("endPort", p["port"]))
        for p in ports
    )


def admitted(policies: list[dict[str, Any]], namespace: str, labels: dict[str, str], source: Source, port: int) -> bool:
    """Whether a pod (namespace, labels) accepts a TCP connection from `source` on `port`."""
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == namespace
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and _selects(p["spec"]["podSelector"], labels)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from") or [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"namespaceSelector": {}}]
            if _port_matches(rule.get("ports"), port) and any(_peer_matches(peer, namespace, source) for peer in peers):
                return True
    return False


def pod_ip(n: int) -> str:
    return str(ipaddress.ip_network(POD_RANGE)[n])


KONNECTIVITY = Source("kube-system", pod_ip(7), {"k8s-app": "konnectivity-agent"})
OTHER_KUBE_SYSTEM_POD = Source("kube-system", pod_ip(8), {"k8s-app": "kube-dns"})
COLLECTOR = Source("gke-gmp-system", pod_ip(9), {"app.kubernetes.io/name": "collector"})
OTHER_NAMESPACE_POD = Source("default", pod_ip(10), {"app": "anything"})
OUTSIDE = Source(None, "203.0.113.7")


def policies_of(stack_run: StackRun) -> list[dict[str, Any]]:
    found = [manifest(r) for r in stack_run.of_type(POLICY)]
    assert found
    return found


@pytest.fixture(scope="module", params=["ephemeral", "standing"])
def ray(request: pytest.FixtureRequest) -> StackRun:
    overrides = {"rayCluster": "standing"} if request.param == "standing" else {}
    return run_stack(RAY_STACK, overrides={**PREBUILT, **overrides})


def ray_pods(stack_run: StackRun) -> tuple[str, dict[str, str], dict[str, str]]:
    """The Ray cluster's namespace and the labels of its head and of a worker (KubeRay adds its own to them)."""
    kind = "RayCluster" if stack_run.of_type("kubernetes:ray.io/v1:RayCluster") else "RayJob"
    obj = manifest(stack_run.one(f"kubernetes:ray.io/v1:{kind}"))
    templates = dict(pod_templates(obj))
    head = {**templates["head"]["metadata"]["labels"], "ray.io/node-type": "head"}
    worker = {**templates[ray_job.WORKER_GROUP]["metadata"]["labels"], "ray.io/node-type": "worker"}
    return obj["metadata"]["namespace"], head, worker


class TestRayCluster:
    def test_its_pods_reach_each_other_on_every_port(self, ray: StackRun) -> None:
        policies = policies_of(ray)
        namespace, head, worker = ray_pods(ray)
        worker_pod, head_pod = Source(namespace, pod_ip(20), worker), Source(namespace, pod_ip(21), head)
        for port in (6379, 8265, 10001, 8076, 29500, 45123):  # GCS, job API, client, object manager, NCCL
            assert admitted(policies, namespace, head, worker_pod, port), port
            assert admitted(policies, namespace, worker, head_pod, port), port
            assert admitted(policies, namespace, worker, worker_pod, port), port

    def test_kuberay_submitter_and_operator_reach_the_job_api(self, ray: StackRun) -> None:
        policies = policies_of(ray)
        namespace, head, _ = ray_pods(ray)
        submitter = Source(namespace, pod_ip(30), {"batch.kubernetes.io/job-name": "x", "ray.io/originated-from": "x"})
        assert admitted(policies, namespace, head, submitter, ray_job.DASHBOARD_PORT)
        # the Google-managed operator, through the control plane's konnectivity agents (a Pod address) or directly
        assert admitted(policies, namespace, head, KONNECTIVITY, ray_job.DASHBOARD_PORT)
        assert admitted(policies, namespace, head, OUTSIDE, ray_job.DASHBOARD_PORT)

    def test_managed_prometheus_scrapes_the_metrics_port(self, ray: StackRun) -> None:
        policies = policies_of(ray)
        namespace, head, worker = ray_pods(ray)
        assert admitted(policies, namespace, head, COLLECTOR, ray_job.METRICS_PORT)
        assert admitted(policies, namespace, worker, COLLECTOR, ray_job.METRICS_PORT)

    def test_nothing_else_reaches_the_unauthenticated_ray_ports(self, ray: StackRun) -> None:
        policies = policies_of(ray)
        namespace, head, worker = ray_pods(ray)
        for port in (6379, 8265, 10001):
            assert not admitted(policies, namespace, head, OTHER_NAMESPACE_POD, port), port
            assert not admitted(policies, namespace, head, OTHER_KUBE_SYSTEM_POD, port), port
        for port in (6379, 10001):
            assert not admitted(policies, namespace, head, KONNECTIVITY, port), port
            assert not admitted(policies, namespace, head, OUTSIDE, port), port
        assert not admitted(policies, namespace, worker, COLLECTOR, 6379)
        assert not admitted(policies, namespace, head, COLLECTOR, ray_job.DASHBOARD_PORT)


class TestMultiNodeJob:
    @pytest.fixture(scope="class")
    def multi(self) -> StackRun:
        return run_stack(
            JOB_STACK, overrides={**PREBUILT, "nodes": 2, "recipeOverrides": ["distributed.world_size=16"]}
        )

    def test_the_ranks_reach_each_other_and_nothing_else_reaches_them(self, multi: StackRun) -> None:
        policies = policies_of(multi)
        job = manifest(multi.one("kubernetes:batch/v1:Job"))
        namespace, labels = job["metadata"]["namespace"], job["spec"]["template"]["metadata"]["labels"]
        assert RUN_LABEL in labels
        rank1 = Source(namespace, pod_ip(40), {**labels, "batch.kubernetes.io/job-completion-index": "1"})
        for port in (29500, 45123):  # rendezvous, NCCL
            assert admitted(policies, namespace, labels, rank1, port), port
            assert not admitted(policies, namespace, labels, OTHER_NAMESPACE_POD, port), port
            assert not admitted(policies, namespace, labels, OUTSIDE, port), port


def test_the_replay_follows_the_api_on_a_peer_with_both_selectors() -> None:
    """One peer with namespaceSelector and podSelector means both; two peers mean either."""
    both = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}, "podSelector": {}}
    policy = {
        "metadata": {"namespace": "ns"},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{"from": [both]}]},
    }
    assert admitted([policy], "ns", {}, OTHER_KUBE_SYSTEM_POD, 80)
    assert not admitted([policy], "ns", {}, OTHER_NAMESPACE_POD, 80)
    both["podSelector"] = {"matchLabels": {"k8s-app": "konnectivity-agent"}}
    assert admitted([policy], "ns", {}, KONNECTIVITY, 80)
    assert not admitted([policy], "ns", {}, OTHER_KUBE_SYSTEM_POD, 80)
    assert admitted([], "ns", {}, OTHER_NAMESPACE_POD, 80), "a pod no policy selects admits everything"
