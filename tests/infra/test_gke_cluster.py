"""The GKE Autopilot cluster and the Kubernetes provider it hands out, under mocks with the real stack files."""

from __future__ import annotations

import ipaddress
from functools import cache
from typing import Any

import pytest
import yaml
from pulumi.runtime.rpc import UNKNOWN

from infra.offline.engine import StackRun, is_secret, is_unknown, run_stack, unwrap_secrets
from infra.offline.impact import kubernetes_provider
from tests.infra.conftest import PREBUILT

CLUSTER = "gcp:container/cluster:Cluster"
PROVIDER = "pulumi:providers:kubernetes"
NETWORK = "gcp:compute/network:Network"
SUBNET = "gcp:compute/subnetwork:Subnetwork"


@pytest.fixture(scope="module")
def a4() -> StackRun:
    return run_stack("a4-gemma4", overrides=PREBUILT)


@cache
def planned(stack: str) -> StackRun:
    return run_stack(stack, overrides=PREBUILT)


def cluster_inputs(stack_run: StackRun) -> dict[str, Any]:
    return stack_run.one(CLUSTER).plain_inputs()


class TestClusterArguments:
    def test_autopilot_regional_with_workload_identity(self, a4: StackRun) -> None:
        inputs = cluster_inputs(a4)
        assert inputs["enableAutopilot"] is True
        assert inputs["location"] == "us-central1", "regional, in the reservation's region"
        assert inputs["name"] == "gft-a4-gemma4" and len(inputs["name"]) <= 40
        assert inputs["workloadIdentityConfig"] == {"workloadPool": "my-gcp-project.svc.id.goog"}
        assert inputs["releaseChannel"] == {"channel": "REGULAR"}
        assert inputs["resourceLabels"]["stack"] == "a4-gemma4"

    def test_deletion_protection_off_by_default(self, a4: StackRun) -> None:
        assert cluster_inputs(a4)["deletionProtection"] is False, "`pulumi destroy` must work"

    def test_config_reaches_the_cluster(self) -> None:
        inputs = cluster_inputs(
            run_stack("a4-gemma4", overrides={**PREBUILT, "deletionProtection": True, "releaseChannel": "RAPID"})
        )
        assert inputs["deletionProtection"] is True
        assert inputs["releaseChannel"] == {"channel": "RAPID"}

    def test_no_ray_add_on_for_the_job_stack(self, a4: StackRun) -> None:
        addons = cluster_inputs(a4).get("addonsConfig") or {}
        assert not addons.get("rayOperatorConfigs")

    def test_waits_for_the_container_api(self, a4: StackRun) -> None:
        cluster = a4.one(CLUSTER)
        api = a4.by_name("gft-a4-gemma4-api-container")
        assert api.urn in cluster.dependencies

    def test_component(self, a4: StackRun) -> None:
        assert a4.one(CLUSTER).parent.endswith("gemma-finetune:gcp:AutopilotCluster::gft-a4-gemma4")


@pytest.mark.parametrize("stack", ["a4-gemma4", "ray-gemma3-vision"])
class TestOwnNetwork:
    """The cluster sits in the stack's own VPC and subnet, never in the project's `default` network (which
    `compute.skipDefaultNetworkCreation` leaves out, and whose 0.0.0.0/0 SSH/RDP/ICMP rules reach every VM)."""

    def test_custom_mode_vpc_named_for_the_stack(self, stack: str) -> None:
        run = planned(stack)
        network = run.one(NETWORK).plain_inputs()
        assert network["name"] == f"gft-{stack}-net" and len(network["name"]) <= 63
        assert network["autoCreateSubnetworks"] is False, "auto mode would add a subnet in every region"
        assert network["routingMode"] == "REGIONAL"
        assert network["project"] == "my-gcp-project"

    def test_regional_subnet_with_pod_and_service_ranges(self, stack: str) -> None:
        run = planned(stack)
        subnet = run.one(SUBNET).plain_inputs()
        assert subnet["name"] == f"gft-{stack}-nodes"
        assert subnet["network"] == f"projects/my-gcp-project/global/networks/gft-{stack}-net"
        assert subnet["region"] == cluster_inputs(run)["location"], "the regional cluster's region"
        assert subnet["privateIpGoogleAccess"] is True
        ranges = {r["rangeName"]: ipaddress.ip_network(r["ipCidrRange"]) for r in subnet["secondaryIpRanges"]}
        nodes = ipaddress.ip_network(subnet["ipCidrRange"])
        assert set(ranges) == {"pods", "services"}
        every = [nodes, *ranges.values()]
        assert all(n.is_private for n in every)
        assert not any(a.overlaps(b) for i, a in enumerate(every) for b in every[i + 1 :]), "ranges must not overlap"

    def test_cluster_names_the_stack_network_subnet_and_ranges(self, stack: str) -> None:
        run = planned(stack)
        inputs = cluster_inputs(run)
        assert inputs["network"] == f"projects/my-gcp-project/global/networks/gft-{stack}-net"
        assert inputs["subnetwork"] == f"projects/my-gcp-project/regions/us-central1/subnetworks/gft-{stack}-nodes"
        names = {r["rangeName"] for r in run.one(SUBNET).plain_inputs()["secondaryIpRanges"]}
        policy = inputs["ipAllocationPolicy"]
        assert policy == {"clusterSecondaryRangeName": "pods", "servicesSecondaryRangeName": "services"}
        assert set(policy.values()) <= names, "the cluster names ranges the subnet has"

    def test_no_default_network_anywhere(self, stack: str) -> None:
        run = planned(stack)
        for r in run.resources:
            for key in ("network", "subnetwork"):
                value = str(r.plain_inputs().get(key) or "")
                assert value.rsplit("/", 1)[-1] != "default", f"{r.urn} {key}={value!r}"
        assert cluster_inputs(run).get("network"), "an absent network is the default network"

    def test_network_and_subnet_wait_for_the_compute_api(self, stack: str) -> None:
        run = planned(stack)
        api = run.by_name(f"gft-{stack}-api-compute")
        for typ in (NETWORK, SUBNET):
            resource = run.one(typ)
            assert api.urn in resource.dependencies, typ
            assert resource.parent.endswith(f"gemma-finetune:gcp:AutopilotCluster::gft-{stack}")


def test_cloud_run_stack_declares_no_network() -> None:
    run = planned("dev")
    assert not run.of_type(NETWORK) and not run.of_type(SUBNET)


class TestProvider:
    def test_kubeconfig_is_secret(self, a4: StackRun) -> None:
        assert is_secret(a4.one(PROVIDER).inputs["kubeconfig"])

    def test_kubeconfig_authenticates_through_the_exec_plugin(self, a4: StackRun) -> None:
        config = yaml.safe_load(unwrap_secrets(a4.one(PROVIDER).inputs["kubeconfig"]))
        (cluster,) = config["clusters"]
        assert cluster["cluster"]["server"] == "https://192.0.2.10"
        assert cluster["cluster"]["certificate-authority-data"] == "bW9jay1jYQ=="
        (user,) = config["users"]
        assert set(user["user"]) == {"exec"}, "no token, password or client certificate in the kubeconfig"
        assert user["user"]["exec"]["command"] == "gke-gcloud-auth-plugin"
        assert user["user"]["exec"]["apiVersion"] == "client.authentication.k8s.io/v1beta1"
        assert config["current-context"] == config["contexts"][0]["name"]

    def test_one_provider_for_all_workload_objects(self, a4: StackRun) -> None:
        provider = a4.one(PROVIDER)
        assert provider.parent.endswith("gemma-finetune:gcp:AutopilotCluster::gft-a4-gemma4")
        k8s = [r for r in a4.resources if r.type.startswith("kubernetes:")]
        assert k8s and all(r.provider.startswith(provider.urn) for r in k8s)


class TestRayAddOn:
    def test_ray_operator_with_logging_and_monitoring(self) -> None:
        inputs = cluster_inputs(run_stack("ray-gemma3-vision", overrides=PREBUILT))
        assert inputs["enableAutopilot"] is True
        assert inputs["addonsConfig"]["rayOperatorConfigs"] == [
            {
                "enabled": True,
                "rayClusterLoggingConfig": {"enabled": True},
                "rayClusterMonitoringConfig": {"enabled": True},
            }
        ], "a LIST in pulumi-gcp"


class TestProviderFollowsTheCluster:
    """pulumi-kubernetes decides its provider's replacement (and with it every object's) from the kubeconfig: the
    transcription of `DiffConfig` in infra/offline/impact.py, on the provider's real inputs."""

    def test_an_update_of_the_cluster_keeps_the_provider(self, a4: StackRun) -> None:
        """A preview of an in-place update keeps the cluster's endpoint and CA known (the bridge's Update in a
        preview returns the planned state, pulumi-terraform-bridge pkg/tfbridge/provider.go): same cluster."""
        updated = run_stack("a4-gemma4", overrides={**PREBUILT, "releaseChannel": "RAPID"})
        action, _ = kubernetes_provider(a4.one(PROVIDER).plain_inputs(), updated.one(PROVIDER).plain_inputs())
        assert action == "unchanged"

    def test_an_unknown_kubeconfig_replaces_the_provider(self, a4: StackRun) -> None:
        """What a preview shows for a cluster being created or replaced: its endpoint is not known yet."""
        preview = run_stack("a4-gemma4", overrides=PREBUILT, preview=True)
        news = preview.one(PROVIDER).plain_inputs()
        assert is_unknown(news["kubeconfig"]), "the case under test: the endpoint is not known yet"
        assert kubernetes_provider(a4.one(PROVIDER).plain_inputs(), news)[0] == "replace"

    def test_another_cluster_replaces_the_provider(self, a4: StackRun) -> None:
        olds = a4.one(PROVIDER).plain_inputs()
        news = dict(olds, kubeconfig=olds["kubeconfig"].replace("192.0.2.10", "192.0.2.99"))
        assert kubernetes_provider(olds, news)[0] == "replace", "objects must follow the cluster to its new home"

    def test_the_provider_has_no_cluster_identifier(self, a4: StackRun) -> None:
        """A `clusterIdentifier` that is set and unchanged drops every replacement DiffConfig decides: the objects of a
        cluster replaced under the same name would stay in state while gone from the cluster."""
        olds = a4.one(PROVIDER).plain_inputs()
        assert "clusterIdentifier" not in olds
        pinned = {**olds, "clusterIdentifier": "projects/p/locations/r/clusters/c"}
        assert kubernetes_provider(pinned, {**pinned, "kubeconfig": UNKNOWN})[0] == "update", "the check can fail"
