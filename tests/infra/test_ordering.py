"""Ordering invariants, over every stack and user variant, on the dependency graph the program registers.

Whatever runs as an identity (the Cloud Run Job and Service, the GKE Job, the RayJob and RayCluster, a
Cloud Build run) is created only after, directly or transitively:
- every IAM grant to each identity it runs as (its service account, the Kubernetes service account its
  pods use through Workload Identity, the GKE nodes' account that pulls its image),
- the secret it reads (Secret Manager version or Kubernetes Secret),
- every API the stack enables,
- for a custom kind (RayJob, RayCluster), a step that waits until the kind's CRD is Established,
- for each of those grants, a step that waits for it to propagate (IAM: typically 2 minutes) and comes after it.

The graph is the one the engine orders by: each registration's dependencies (explicit `depends_on` and
the resources its inputs come from; `depends_on` a component reaches only the children it had then) plus
its provider. A component's own `depends_on` does not count: it orders none of its children.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from itertools import pairwise
from typing import Any

import pytest

from infra.foundation import IAM_PROPAGATION_S
from infra.foundation import IAM_WAIT_SCRIPT as IAM_WAIT
from infra.offline.engine import MOCK_PROJECT_NUMBER, Recorded, StackRun, run_stack
from tests.infra.conftest import Variant

CLOUD_RUN_JOB = "gcp:cloudrunv2/job:Job"
CLOUD_RUN_SERVICE = "gcp:cloudrunv2/service:Service"
K8S_JOB = "kubernetes:batch/v1:Job"
CUSTOM_KINDS = ("kubernetes:ray.io/v1:RayJob", "kubernetes:ray.io/v1:RayCluster")
BUILD = "command:local:Command"
GRANTS_TO_PEOPLE = {"gcp:cloudrunv2/serviceIamMember:ServiceIamMember"}


def dependency_graph(run: StackRun) -> dict[str, set[str]]:
    """URN -> the URNs the engine creates first: its dependencies and its provider (a provider
    reference is "<provider URN>::<provider ID>")."""
    graph: dict[str, set[str]] = {}
    for r in run.resources:
        graph[r.urn] = set(r.dependencies) | ({r.provider.rsplit("::", 1)[0]} if r.provider else set())
    return graph


def ancestors(graph: dict[str, set[str]], urn: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph.get(urn, ()))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def pod_specs(workload: Recorded) -> list[dict[str, Any]]:
    spec = workload.plain_inputs().get("spec") or {}
    if workload.type == K8S_JOB:
        return [spec["template"]["spec"]]
    cluster = spec.get("rayClusterSpec", spec) if workload.type.endswith("RayJob") else spec
    if "headGroupSpec" not in cluster:
        return []  # a RayJob on a standing cluster: its pods are the RayCluster's
    groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
    return [g["template"]["spec"] for g in groups]


def containers(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from spec.get("initContainers", [])
    yield from spec.get("containers", [])


class Needs:
    """What one registered resource that runs as an identity must come after."""

    def __init__(self, run: StackRun, runner: Recorded) -> None:
        self.run = run
        self.runner = runner
        self.members: set[str] = set()
        self.secrets: set[str] = set()
        self.crds: set[str] = set()
        if runner.type in (CLOUD_RUN_JOB, CLOUD_RUN_SERVICE):
            self._cloud_run()
        elif runner.type == BUILD:
            self.members.add(f"serviceAccount:{runner.plain_inputs()['environment']['BUILD_SERVICE_ACCOUNT']}")
        else:
            self._kubernetes()

    def _cloud_run(self) -> None:
        inputs = self.runner.plain_inputs()
        template = inputs["template"]["template"] if self.runner.type == CLOUD_RUN_JOB else inputs["template"]
        self.members.add(f"serviceAccount:{template['serviceAccount']}")
        for container in template["containers"]:
            for env in container.get("envs") or []:
                ref = ((env.get("valueSource") or {}).get("secretKeyRef")) or {}
                if ref:
                    self.secrets |= {
                        v.urn
                        for v in self.run.of_type("gcp:secretmanager/secretVersion:SecretVersion")
                        if v.plain_inputs()["secret"].endswith(f"/secrets/{ref['secret']}")
                    }
                    assert self.secrets, f"{self.runner.urn} reads secret {ref['secret']}, which no version holds"

    def _kubernetes(self) -> None:
        meta = self.runner.plain_inputs()["metadata"]
        namespace = meta["namespace"]
        if self.runner.type in CUSTOM_KINDS:
            _, group_version, kind = self.runner.type.split(":")
            self.crds.add(f"{kind.lower()}s.{group_version.split('/')[0]}")
        specs = pod_specs(self.runner)
        for spec in specs:
            ksa = spec.get("serviceAccountName", "default")
            self.members.add(f"serviceAccount:{self._project()}.svc.id.goog[{namespace}/{ksa}]")
            for account in self.run.of_type("kubernetes:core/v1:ServiceAccount"):
                ksa_meta = account.plain_inputs()["metadata"]
                if (ksa_meta["name"], ksa_meta["namespace"]) == (ksa, namespace):
                    gsa = (ksa_meta.get("annotations") or {}).get("iam.gke.io/gcp-service-account")
                    if gsa:
                        self.members.add(f"serviceAccount:{gsa}")
            for container in containers(spec):
                for env in container.get("env") or []:
                    name = ((env.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
                    if name:
                        self.secrets |= {
                            s.urn
                            for s in self.run.of_type("kubernetes:core/v1:Secret")
                            if (s.plain_inputs()["metadata"]["name"], s.plain_inputs()["metadata"]["namespace"])
                            == (name, namespace)
                        }
        if specs:
            self.members.add(self._node_account())

    def _project(self) -> str:
        return str(self.run.one("gcp:container/cluster:Cluster").plain_inputs()["project"])

    def _node_account(self) -> str:
        """The nodes pull the image: their account is the cluster's, or GKE's default (Compute Engine's)."""
        cluster = self.run.one("gcp:container/cluster:Cluster").plain_inputs()
        defaults = (cluster.get("clusterAutoscaling") or {}).get("autoProvisioningDefaults") or {}
        email = defaults.get("serviceAccount") or f"{MOCK_PROJECT_NUMBER}-compute@developer.gserviceaccount.com"
        return f"serviceAccount:{email}"

    def grants(self) -> set[str]:
        return {
            r.urn
            for r in self.run.resources
            if r.custom
            and "iam" in r.type.lower()
            and r.type not in GRANTS_TO_PEOPLE
            and r.plain_inputs().get("member") in self.members
        }


def runners(run: StackRun) -> list[Recorded]:
    found = [r for r in run.resources if r.type in (CLOUD_RUN_JOB, CLOUD_RUN_SERVICE, K8S_JOB, *CUSTOM_KINDS)]
    found += [r for r in run.of_type(BUILD) if "BUILD_SERVICE_ACCOUNT" in (r.plain_inputs().get("environment") or {})]
    return found


def crd_waits(run: StackRun, crd: str) -> set[str]:
    """Steps that return only once `crd` is Established."""
    return {
        r.urn
        for r in run.of_type(BUILD)
        if crd in (r.plain_inputs().get("environment") or {}).get("CRDS", "").split()
        and "kubectl wait --for=condition=Established" in r.plain_inputs().get("create", "")
    }


def violations(run: StackRun) -> list[str]:
    graph = dependency_graph(run)
    apis = {r.urn for r in run.of_type("gcp:projects/service:Service")}
    problems: list[str] = []
    for runner in runners(run):
        needs = Needs(run, runner)
        before = ancestors(graph, runner.urn)
        grants = needs.grants()
        for label, required in (("IAM grant", grants), ("secret", needs.secrets), ("API", apis)):
            problems += [f"{runner.urn} does not wait for {label} {urn}" for urn in sorted(required - before)]
        for crd in sorted(needs.crds):
            if not crd_waits(run, crd) & before:
                problems.append(f"{runner.urn} does not wait for crd/{crd} to be Established")
        waits = propagation_waits(run, graph)
        for grant in sorted(grants):
            if not any(grant in granted and wait in before for wait, granted in waits.items()):
                problems.append(f"{runner.urn} does not wait for IAM grant {grant} to propagate")
    return problems


def propagation_waits(run: StackRun, graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each step that waits for IAM propagation (infra.foundation.iam_propagation_wait) -> what it comes after."""
    return {r.urn: ancestors(graph, r.urn) for r in run.of_type(BUILD) if r.plain_inputs().get("create") == IAM_WAIT}


# The 16 variant runs (a shared session fixture) take about 15 s on 2 busy cores.
@pytest.mark.slow
class TestOrdering:
    def test_every_runner_waits_for_its_grants_secrets_apis_and_crds(
        self, user_variant_runs: list[tuple[Variant, StackRun]]
    ) -> None:
        problems = [f"[{variant.label}] {p}" for variant, run in user_variant_runs for p in violations(run)]
        assert problems == [], "\n".join(problems)

    def test_every_variant_has_runners_with_identities_and_grants(
        self, user_variant_runs: list[tuple[Variant, StackRun]]
    ) -> None:
        """Guards the check above against finding nothing to check."""
        for variant, run in user_variant_runs:
            found = runners(run)
            assert found, f"[{variant.label}] no workload found"
            for runner in found:
                needs = Needs(run, runner)
                if runner.type == "kubernetes:ray.io/v1:RayJob" and not pod_specs(runner):
                    assert needs.crds == {"rayjobs.ray.io"}, runner.urn
                    continue
                assert needs.grants(), f"[{variant.label}] {runner.urn}: no grant to {needs.members}"
            if variant.hf_token is not None:
                assert any(Needs(run, r).secrets for r in found), f"[{variant.label}] no workload reads the token"


@pytest.mark.slow
class TestTheCheckCanFail:
    def test_a_missing_edge_is_reported(self, user_variant_runs: list[tuple[Variant, StackRun]]) -> None:
        run = next(r for v, r in user_variant_runs if v.stack == "ray-gemma3-vision")
        assert violations(run) == []
        crd_steps = crd_waits(run, "rayjobs.ray.io")
        cut = [
            replace(r, dependencies=[d for d in r.dependencies if d not in crd_steps])
            if r.type == "kubernetes:ray.io/v1:RayJob"
            else r
            for r in run.resources
        ]
        problems = violations(replace(run, resources=cut))
        assert problems and all("crd/rayjobs.ray.io" in p for p in problems), problems

    def test_a_workload_that_does_not_wait_for_propagation_is_reported(
        self, user_variant_runs: list[tuple[Variant, StackRun]]
    ) -> None:
        run = next(r for v, r in user_variant_runs if v.stack == "dev")
        assert violations(run) == [] and IAM_PROPAGATION_S >= 120  # IAM docs: typically 2 minutes
        waits = set(propagation_waits(run, dependency_graph(run)))
        cut = [replace(r, dependencies=[d for d in r.dependencies if d not in waits]) for r in run.resources]
        problems = violations(replace(run, resources=cut))
        assert problems and all("to propagate" in p for p in problems), problems


def wait_triggers(run: StackRun) -> dict[str, list[str]]:
    """Each propagation wait's name -> its triggers (the IDs of the grants it waits for)."""
    return {
        r.name: r.plain_inputs()["triggers"] for r in run.of_type(BUILD) if r.plain_inputs().get("create") == IAM_WAIT
    }


class TestAMovedGrantIsWaitedForAgain:
    """pulumi-command runs a step again only when its triggers change; a replaced grant keeps its URN."""

    def test_data_in_another_bucket_makes_the_trainer_wait_again(self) -> None:
        from tests.infra.conftest import OWN_DATA_RECIPE

        def waits(bucket: str) -> dict[str, list[str]]:
            data = f"data.path=gs://{bucket}/tickets/train-*.jsonl"
            return wait_triggers(run_stack("dev", overrides={"recipe": OWN_DATA_RECIPE, "recipeOverrides": [data]}))

        before, after = waits("team-data-a"), waits("team-data-b")
        assert set(before) == set(after) and "gft-dev-train-iam-propagation" in before, sorted(before)
        changed = {name for name in before if before[name] != after[name]}
        assert changed == {"gft-dev-train-iam-propagation"}, changed

    def test_another_namespace_makes_the_pods_wait_for_their_binding_again(self) -> None:
        before = wait_triggers(run_stack("a4-gemma4"))
        after = wait_triggers(run_stack("a4-gemma4", overrides={"namespace": "tuning-two"}))
        changed = {name for name in before if before[name] != after[name]}
        assert changed and all(name.endswith("-wi-iam-propagation") for name in changed), changed

    def test_an_unchanged_stack_does_not_wait_again(self) -> None:
        assert wait_triggers(run_stack("a4-gemma4")) == wait_triggers(run_stack("a4-gemma4"))


NETWORK = "gcp:compute/network:Network"
SUBNET = "gcp:compute/subnetwork:Subnetwork"
CLUSTER = "gcp:container/cluster:Cluster"


def network_order_problems(run: StackRun) -> list[str]:
    """`up` creates the compute API, then the VPC, then its subnet, then the cluster in it."""
    graph = dependency_graph(run)
    (network,), (subnet,), (cluster,) = run.of_type(NETWORK), run.of_type(SUBNET), run.of_type(CLUSTER)
    api = next(
        r
        for r in run.of_type("gcp:projects/service:Service")
        if r.plain_inputs()["service"] == "compute.googleapis.com"
    )
    chain = [api, network, subnet, cluster]
    return [
        f"{later.urn} is not created after {earlier.urn}"
        for earlier, later in pairwise(chain)
        if earlier.urn not in ancestors(graph, later.urn)
    ]


@pytest.mark.slow
class TestNetworkOrder:
    def test_api_then_network_then_subnet_then_cluster(self, user_variant_runs: list[tuple[Variant, StackRun]]) -> None:
        gke = [(v, r) for v, r in user_variant_runs if r.of_type(CLUSTER)]
        assert gke, "no GKE variant to check"
        problems = [f"[{v.label}] {p}" for v, r in gke for p in network_order_problems(r)]
        assert problems == [], "\n".join(problems)

    def test_a_cluster_that_names_no_subnet_is_reported(
        self, user_variant_runs: list[tuple[Variant, StackRun]]
    ) -> None:
        run = next(r for v, r in user_variant_runs if r.of_type(CLUSTER))
        subnet = run.one(SUBNET).urn
        cut = [replace(r, dependencies=[d for d in r.dependencies if d != subnet]) for r in run.resources]
        problems = network_order_problems(replace(run, resources=cut))
        assert problems and all("Cluster" in p.split(" is not")[0] for p in problems), problems
