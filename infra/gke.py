"""The GKE Autopilot cluster both GKE stacks train on, and the Kubernetes provider that reaches it.

    pulumi up --stack a4-gemma4            # cluster + training Job
    gcloud container clusters get-credentials gft-a4-gemma4 --region us-central1 --project PROJECT

Decisions (why and sources: docs/gke.md#one-autopilot-cluster-one-keyless-provider, docs/gke.md#the-stacks-own-vpc-no-cloud-nat)
- Autopilot, regional: GKE adds the GPU nodes a Pod asks for and removes them after, so none idles.
- Workload Identity pool set explicitly; nodes run as the stack's node account; the Ray operator
  add-on only for the Ray workload; deletion protection off by default (a disposable stack).
- ONE Kubernetes provider, authenticated by the `gke-gcloud-auth-plugin` exec plugin (no credential in state),
  identified by the cluster it reaches (endpoint, CA): a replaced cluster replaces it and every object in it.
- No setting a user changes day to day feeds an input that replaces the cluster (docs/operations.md).
- The stack's own VPC and subnet, no firewall rule of ours, public nodes and no Cloud NAT.
Not here: node pools (Autopilot has none), private nodes and authorized networks (the public endpoint
is protected by IAM), Kubernetes objects (`infra.gke_workload`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_gcp as gcp
import pulumi_kubernetes as k8s
import yaml

from infra.config import StackConfig, Workload

# Node VMs reach Google APIs only through their service account's IAM roles (GKE docs, "Use least privilege IAM
# service accounts"), so the scope stays broad on purpose.
NODE_OAUTH_SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
# Installed with `gcloud components install gke-gcloud-auth-plugin`; kubectl and pulumi-kubernetes call it.
AUTH_PLUGIN = "gke-gcloud-auth-plugin"
AUTH_API_VERSION = "client.authentication.k8s.io/v1beta1"

# The subnet's ranges (RFC 1918), the sizes GoogleCloudPlatform/cluster-toolkit examples/gke-a4/gke-a4.yaml uses
# for A4: /18 for nodes, /14 for Pods, /20 for Services. Each stack has its own VPC and peers with nothing, so the
# stacks may share them.
NODE_RANGE = "192.168.0.0/18"
POD_RANGE_NAME = "pods"
POD_RANGE = "10.4.0.0/14"
SERVICE_RANGE_NAME = "services"
SERVICE_RANGE = "10.0.32.0/20"
# One region: regional dynamic routing is enough (no Cloud Router here); it is also Compute Engine's default.
ROUTING_MODE = "REGIONAL"
# The cluster's metric packages. The list replaces the cluster's whole set (GKE API MonitoringComponentConfig, as
# `gcloud ... --monitoring`), so it keeps the packages GKE turns on for a new cluster (system, kube state, cAdvisor
# and Kubelet: GoogleCloudPlatform/cluster-toolkit modules/scheduler/gke-cluster/main.tf default_monitoring_component)
# and adds the managed DCGM package (GPU utilisation and memory for the run's dashboard, infra/monitoring.py), which
# needs Managed Service for Prometheus. A change is an in-place cluster update (terraform-provider-google v7.45.0
# resource_container_cluster.go: monitoring_config is not ForceNew; Update sends DesiredMonitoringConfig).
DEFAULT_MONITORING_COMPONENTS = (
    "SYSTEM_COMPONENTS",
    "STORAGE",
    "HPA",
    "POD",
    "DAEMONSET",
    "DEPLOYMENT",
    "STATEFULSET",
    "CADVISOR",
    "KUBELET",
)
MONITORING_COMPONENTS = (*DEFAULT_MONITORING_COMPONENTS, "DCGM")


def cluster_name(cfg: StackConfig) -> str:
    """GKE cluster names are at most 40 characters; stack names are at most 20."""
    return f"gft-{cfg.stack}"


def network_name(cfg: StackConfig) -> str:
    """VPC and subnet names are at most 63 characters; stack names are at most 20."""
    return f"gft-{cfg.stack}-net"


def subnet_name(cfg: StackConfig) -> str:
    return f"gft-{cfg.stack}-nodes"


def cluster_description(cfg: StackConfig) -> str:
    """The cluster's description: `description` replaces the cluster when it changes (ForceNew in
    terraform-provider-google's container cluster), so it names the stack only, never a setting."""
    return f"gemma-finetune {cfg.stack}: GKE Autopilot training cluster"


def workload_pool(project: str) -> str:
    return f"{project}.svc.id.goog"


def get_credentials_command(cfg: StackConfig) -> str:
    return (
        f"gcloud container clusters get-credentials {cluster_name(cfg)} --region {cfg.region} --project {cfg.project}"
    )


def render_kubeconfig(name: str, endpoint: str, ca_certificate: str) -> str:
    """A kubeconfig for one cluster whose user is the gke-gcloud-auth-plugin exec plugin (no credentials inside)."""
    context = f"gke-{name}"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": context,
                "cluster": {"server": f"https://{endpoint}", "certificate-authority-data": ca_certificate},
            }
        ],
        "contexts": [{"name": context, "context": {"cluster": context, "user": context}}],
        "current-context": context,
        "users": [
            {
                "name": context,
                "user": {
                    "exec": {
                        "apiVersion": AUTH_API_VERSION,
                        "command": AUTH_PLUGIN,
                        "installHint": f"Install {AUTH_PLUGIN}: gcloud components install {AUTH_PLUGIN}",
                        "provideClusterInfo": True,
                    }
                },
            }
        ],
    }
    return yaml.safe_dump(config, sort_keys=False)


@dataclass
class AutopilotClusterArgs:
    cfg: StackConfig
    """The validated stack configuration (region, release channel, deletion protection, workload)."""
    depends_on: list[pulumi.Resource] = field(default_factory=list)
    """The foundation's API enablements (the cluster cannot be created before container.googleapis.com is on,
    the network before compute.googleapis.com) and the node account's grants (nodes log and pull images from
    their first minute)."""
    apis: list[pulumi.Resource] | None = None
    """What the network and subnet wait for: compute.googleapis.com among them (None: `depends_on`). Without the
    grants they are created while the grants propagate."""
    node_service_account: pulumi.Input[str] | None = None
    """Email of the service account the nodes run as; None keeps GKE's default (Compute Engine's)."""


class AutopilotCluster(pulumi.ComponentResource):
    """A regional GKE Autopilot cluster (+ Ray operator add-on for gke-ray) in the stack's own VPC, and its
    Kubernetes provider."""

    network: gcp.compute.Network
    subnet: gcp.compute.Subnetwork
    cluster: gcp.container.Cluster
    name: pulumi.Output[str]
    kubeconfig: pulumi.Output[str]
    provider: k8s.Provider
    workload_pool: str
    get_credentials: str

    def __init__(self, name: str, args: AutopilotClusterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gemma-finetune:gcp:AutopilotCluster", name, None, opts)
        cfg = args.cfg
        self.workload_pool = workload_pool(cfg.project)
        self.get_credentials = get_credentials_command(cfg)

        after_apis = pulumi.ResourceOptions(parent=self, depends_on=args.depends_on if args.apis is None else args.apis)
        self.network = gcp.compute.Network(
            f"{name}-net",
            name=network_name(cfg),
            project=cfg.project,
            description=f"gemma-finetune {cfg.stack}: the GKE cluster's network",
            auto_create_subnetworks=False,
            routing_mode=ROUTING_MODE,
            opts=after_apis,
        )
        self.subnet = gcp.compute.Subnetwork(
            f"{name}-nodes",
            name=subnet_name(cfg),
            project=cfg.project,
            region=cfg.region,
            network=self.network.id,
            description=f"gemma-finetune {cfg.stack}: GKE nodes, with the Pod and Service ranges",
            ip_cidr_range=NODE_RANGE,
            secondary_ip_ranges=[
                gcp.compute.SubnetworkSecondaryIpRangeArgs(range_name=POD_RANGE_NAME, ip_cidr_range=POD_RANGE),
                gcp.compute.SubnetworkSecondaryIpRangeArgs(range_name=SERVICE_RANGE_NAME, ip_cidr_range=SERVICE_RANGE),
            ],
            private_ip_google_access=True,
            opts=after_apis,
        )

        addons = None
        if cfg.workload is Workload.GKE_RAY:
            addons = gcp.container.ClusterAddonsConfigArgs(
                ray_operator_configs=[
                    gcp.container.ClusterAddonsConfigRayOperatorConfigArgs(
                        enabled=True,
                        ray_cluster_logging_config=(
                            gcp.container.ClusterAddonsConfigRayOperatorConfigRayClusterLoggingConfigArgs(enabled=True)
                        ),
                        ray_cluster_monitoring_config=(
                            gcp.container.ClusterAddonsConfigRayOperatorConfigRayClusterMonitoringConfigArgs(
                                enabled=True
                            )
                        ),
                    )
                ]
            )

        autoscaling = None
        if args.node_service_account is not None:
            autoscaling = gcp.container.ClusterClusterAutoscalingArgs(
                auto_provisioning_defaults=gcp.container.ClusterClusterAutoscalingAutoProvisioningDefaultsArgs(
                    service_account=args.node_service_account,
                    oauth_scopes=list(NODE_OAUTH_SCOPES),
                )
            )

        self.cluster = gcp.container.Cluster(
            f"{name}-cluster",
            name=cluster_name(cfg),
            project=cfg.project,
            location=cfg.region,
            description=cluster_description(cfg),
            enable_autopilot=True,
            network=self.network.id,
            subnetwork=self.subnet.id,
            ip_allocation_policy=gcp.container.ClusterIpAllocationPolicyArgs(
                cluster_secondary_range_name=POD_RANGE_NAME, services_secondary_range_name=SERVICE_RANGE_NAME
            ),
            workload_identity_config=gcp.container.ClusterWorkloadIdentityConfigArgs(workload_pool=self.workload_pool),
            release_channel=gcp.container.ClusterReleaseChannelArgs(channel=cfg.release_channel),
            deletion_protection=cfg.deletion_protection,
            resource_labels=cfg.resource_labels,
            addons_config=addons,
            cluster_autoscaling=autoscaling,
            monitoring_config=gcp.container.ClusterMonitoringConfigArgs(
                enable_components=list(MONITORING_COMPONENTS),
                managed_prometheus=gcp.container.ClusterMonitoringConfigManagedPrometheusArgs(enabled=True),
            ),
            opts=pulumi.ResourceOptions(
                parent=self,
                depends_on=args.depends_on,
                # Regional Autopilot creation usually takes 5-10 minutes; leave room for slow days.
                custom_timeouts=pulumi.CustomTimeouts(create="45m", update="45m", delete="45m"),
                # Set once, at creation: a cluster created by an earlier version of this program carries another
                # text (it named the GPU), and a new one would replace that cluster with its running run.
                ignore_changes=["description"],
            ),
        )
        self.name = self.cluster.name

        self.kubeconfig = pulumi.Output.secret(
            pulumi.Output.all(
                self.cluster.name,
                self.cluster.endpoint,
                self.cluster.master_auth.apply(lambda auth: auth.cluster_ca_certificate or ""),
            ).apply(lambda parts: render_kubeconfig(parts[0], parts[1], parts[2]))
        )
        self.provider = k8s.Provider(
            f"{name}-k8s",
            kubeconfig=self.kubeconfig,
            # No `cluster_identifier`: while one is set and unchanged, pulumi-kubernetes keeps the provider (and so
            # every Namespace, Secret and Job in state) over a cluster replaced under the same name. Without it the
            # provider is replaced exactly when the kubeconfig's cluster (endpoint, CA) changes or becomes unknown, as
            # it does for a cluster being replaced (docs/gke.md#one-autopilot-cluster-one-keyless-provider).
            # Objects are applied server-side (the v4 default) so fields set by GKE's admission
            # (Autopilot adds tolerations and resource defaults) do not show as drift.
            enable_server_side_apply=True,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.cluster]),
        )

        self.register_outputs(
            {"name": self.name, "kubeconfig": self.kubeconfig, "get_credentials": self.get_credentials}
        )
