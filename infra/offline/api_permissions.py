"""Which permission each cloud call of `pulumi preview` / `up` / `destroy` of this program needs, and on which resource.

The permission proof (`infra.offline.permissions`) derives what the CI identities need from these tables and from
what the program declares under mocks: `preview_needs(run)` for an identity that only previews, `deploy_needs(run)`
for the one that previews, applies and destroys. A resource type, provider function or command step without a row
here fails the proof, so the CI grants cannot drift from the program.

    .venv/bin/python -m infra.offline.permissions --stack dev    # every need of every identity of a stack, with its call

Decisions (why and sources: docs/identities.md#every-grant-proven-from-role-data)
- Data, one row per kind of call with its source: `RESOURCES`, `INVOKES`, `COMMANDS`, `KUBERNETES`.
- A preview reads only resources with an `import_` ID, runs every invoke and Kubernetes dry runs, no commands.
- `read` counts for `pulumi up`; engine options (`retain_on_delete`, `import_`, `ignore_changes`) remove calls.
Not here: which identity may do what (`infra.offline.permissions`), the state backend's needs (listed there).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from infra.admission import FENCE_SCRIPT
from infra.cloud_run import EXECUTE_SCRIPT
from infra.config import StackConfig
from infra.crd_wait import WAIT_SCRIPT
from infra.data_access import data_read_scopes
from infra.foundation import (
    IAM_WAIT_SCRIPT,
    Identity,
    account_email,
    api_key_secret_id,
    bucket_name,
    hf_secret_id,
    repository_id,
    staging_bucket_name,
)
from infra.images import CLOUD_BUILD_SCRIPT
from infra.monitoring import DESCRIPTOR_WAIT_SCRIPT
from infra.offline.engine import Recorded, StackRun


class Scope(StrEnum):
    """Where a permission is needed (or a role granted)."""

    PROJECT = "the project"
    RESERVATION_PROJECT = "the project that owns the reservation (reservationProject)"
    BUCKET = "the stack's bucket"
    BUILD_STAGING = "the build staging bucket"
    DATA = "the bucket of the recipe's gs:// data (infra/data_access.py)"
    HF_SECRET = "the HF token secret"
    API_KEY_SECRET = "the vLLM API key secret"
    REGISTRY = "the image repository"
    TRAINER_ACCOUNT = "the trainer's service account"
    SERVING_ACCOUNT = "the serving service account"
    NODE_ACCOUNT = "the GKE node service account"
    BUILD_ACCOUNT = "the Cloud Build builder account"
    BILLING_ACCOUNT = "the billing account of the budget (billingAccount)"
    STATE_BUCKET = "the Pulumi state bucket"
    STATE_KEY = "the Cloud KMS key of the stack secrets"
    STATE_LOCKS = "the stack lock objects in the Pulumi state bucket"


ACCOUNT_SCOPES = {
    Identity.TRAINER: Scope.TRAINER_ACCOUNT,
    Identity.SERVING: Scope.SERVING_ACCOUNT,
    Identity.NODES: Scope.NODE_ACCOUNT,
    Identity.BUILD: Scope.BUILD_ACCOUNT,
}


@dataclass(frozen=True)
class Need:
    permission: str
    scope: Scope
    why: str
    """The code path, call or document that needs it."""
    grants_roles: frozenset[str] = frozenset()
    """For a change of the project's IAM policy: the roles whose grants it changes (an IAM Condition on
    `iam.googleapis.com/modifiedGrantsByRole` may limit them)."""
    resource: str | None = None
    """The resource name IAM Conditions see where the scope alone does not say it (an object of the data)."""
    list_prefix: str | None = None
    """For storage.objects.list: the prefix listed (the `storage.googleapis.com/objectListPrefix` attribute)."""


def scopes(cfg: StackConfig) -> dict[tuple[str, str], Scope]:
    """(kind of resource, its name) -> Scope, through the naming functions `infra.foundation` itself uses."""
    found = {
        ("bucket", bucket_name(cfg)): Scope.BUCKET,
        ("bucket", staging_bucket_name(cfg)): Scope.BUILD_STAGING,
        ("secret", hf_secret_id(cfg)): Scope.HF_SECRET,
        ("secret", api_key_secret_id(cfg)): Scope.API_KEY_SECRET,
        ("repository", repository_id(cfg)): Scope.REGISTRY,
        ("project", cfg.project): Scope.PROJECT,
    }
    if cfg.reservation_project and cfg.reservation_project != cfg.project:
        found[("project", cfg.reservation_project)] = Scope.RESERVATION_PROJECT
    found.update({("bucket", bucket): Scope.DATA for bucket, _ in data_read_scopes(cfg)})
    if cfg.billing_account:
        found[("billing-account", cfg.billing_account)] = Scope.BILLING_ACCOUNT
    found.update({("account", account_email(cfg, identity)): scope for identity, scope in ACCOUNT_SCOPES.items()})
    return found


def _short_name(kind: str, name: str) -> str:
    """The name `scopes` keys on, from the forms inputs carry (resource paths, image references)."""
    if kind == "account":
        return name.rsplit("/serviceAccounts/", 1)[-1]
    if kind == "secret":
        return name.rsplit("/secrets/", 1)[-1]
    if kind == "billing-account":
        return name.removeprefix("billingAccounts/")
    if kind == "project":  # the Cloud Quotas data source's parent: projects/PROJECT
        return name.removeprefix("projects/")
    if kind == "repository" and "/" in name:  # REGION-docker.pkg.dev/PROJECT/REPOSITORY/IMAGE:TAG
        return name.split("/")[2]
    return name


def scope_of(cfg: StackConfig, kind: str, name: str, where: str) -> Scope:
    """The Scope of a named resource; fails, naming `where`, for a resource the program should not touch."""
    short = _short_name(kind, name)
    if kind == "account" and "@" not in short:  # an account id
        short = f"{short}@{cfg.project}.iam.gserviceaccount.com"
    key = (kind, short)
    found = scopes(cfg)
    if key not in found:
        raise ValueError(f"{where}: {kind} {name!r} is none of the resources infra/offline/api_permissions.py knows")
    return found[key]


def _at(inputs: dict[str, Any], path: str) -> Any:
    value: Any = inputs
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value[0] if isinstance(value, list) and value else value


@dataclass(frozen=True)
class Calls:
    """What one resource type's provider calls. Permissions are needed on the resource itself (`target`: its
    kind and the input that names it), except `create_on_project`, which IAM checks on the parent project
    before the resource has a name."""

    target: tuple[str, str]
    source: str
    create: tuple[str, ...] = ()
    create_on_project: tuple[str, ...] = ()
    read: tuple[str, ...] = ()
    update: tuple[str, ...] = ()
    delete: tuple[str, ...] = ()
    acts_as: tuple[str, ...] = ()
    """Inputs naming a service account the resource runs as: creating or updating it needs actAs on that account."""
    updatable: tuple[str, ...] | None = None
    """The only inputs an update sends (None: any); update calls are needed only if one is set and not ignored."""
    no_delete_when: tuple[str, Any] | None = None
    """(input, value) with which the provider's Delete calls nothing."""
    force_delete: tuple[str, ...] = ()
    """Extra calls of a Delete when the input `forceDestroy` is true (emptying a bucket)."""
    grants_role: str | None = None
    """The input naming the role a project IAM member grants (its `Need.grants_roles`)."""


_TF = "terraform-provider-google google/services"
_IAM_MEMBER = (
    "the IAM member resources read-modify-write the resource's policy (terraform-provider-google tpgiamresource)"
)

RESOURCES: dict[str, Calls] = {
    "gcp:projects/service:Service": Calls(
        ("project", "project"),
        f"{_TF}/resourcemanager/resource_google_project_service.go: Create lists enabled services and returns when "
        "the API is on (the setup enables them all); Read gets the project, then lists services",
        create=("serviceusage.services.list",),
        read=("resourcemanager.projects.get", "serviceusage.services.list"),
        delete=("serviceusage.services.disable",),
        no_delete_when=("disableOnDestroy", False),
    ),
    "gcp:serviceaccount/account:Account": Calls(
        ("account", "accountId"),
        f"{_TF}/resourcemanager/resource_google_service_account.go: Create is called even with "
        "create_ignore_already_exists (its 409 is then ignored) and the account is read back",
        create_on_project=("iam.serviceAccounts.create",),
        create=("iam.serviceAccounts.get",),
        read=("iam.serviceAccounts.get",),
        update=("iam.serviceAccounts.update",),
        updatable=("displayName", "description", "disabled"),
        delete=("iam.serviceAccounts.delete",),
        no_delete_when=("deletionPolicy", "ABANDON"),
    ),
    "gcp:serviceaccount/iAMMember:IAMMember": Calls(
        ("account", "serviceAccountId"),
        _IAM_MEMBER,
        create=("iam.serviceAccounts.getIamPolicy", "iam.serviceAccounts.setIamPolicy"),
        read=("iam.serviceAccounts.getIamPolicy",),
        delete=("iam.serviceAccounts.getIamPolicy", "iam.serviceAccounts.setIamPolicy"),
    ),
    "gcp:projects/iAMMember:IAMMember": Calls(
        ("project", "project"),
        _IAM_MEMBER,
        create=("resourcemanager.projects.getIamPolicy", "resourcemanager.projects.setIamPolicy"),
        read=("resourcemanager.projects.getIamPolicy",),
        delete=("resourcemanager.projects.getIamPolicy", "resourcemanager.projects.setIamPolicy"),
        grants_role="role",
    ),
    "gcp:storage/bucket:Bucket": Calls(
        ("bucket", "name"),
        f"{_TF}/storage/resource_storage_bucket.go (insert, get, patch, delete; force_destroy empties it first)",
        create_on_project=("storage.buckets.create",),
        create=("storage.buckets.get",),
        read=("storage.buckets.get",),
        update=("storage.buckets.update",),
        delete=("storage.buckets.delete",),
        force_delete=("storage.objects.list", "storage.objects.delete"),
    ),
    "gcp:storage/bucketObject:BucketObject": Calls(
        ("bucket", "bucket"),
        f"{_TF}/storage/resource_storage_bucket_object.go (objects.insert, objects.get, objects.delete; new content "
        "replaces the object): the run's price file (infra/cost.py declare_price_file)",
        create=("storage.objects.create", "storage.objects.get"),
        read=("storage.objects.get",),
        update=("storage.objects.create", "storage.objects.delete"),
        delete=("storage.objects.delete",),
    ),
    "gcp:storage/bucketIAMMember:BucketIAMMember": Calls(
        ("bucket", "bucket"),
        _IAM_MEMBER,
        create=("storage.buckets.getIamPolicy", "storage.buckets.setIamPolicy"),
        read=("storage.buckets.getIamPolicy",),
        delete=("storage.buckets.getIamPolicy", "storage.buckets.setIamPolicy"),
    ),
    "gcp:secretmanager/secret:Secret": Calls(
        ("secret", "secretId"),
        f"{_TF}/secretmanager/resource_secret_manager_secret.go",
        create_on_project=("secretmanager.secrets.create",),
        create=("secretmanager.secrets.get",),
        read=("secretmanager.secrets.get",),
        update=("secretmanager.secrets.update",),
        delete=("secretmanager.secrets.delete",),
    ),
    "gcp:secretmanager/secretVersion:SecretVersion": Calls(
        ("secret", "secret"),
        f"{_TF}/secretmanager/resource_secret_manager_secret_version.go: Read accesses the payload to diff it",
        create=("secretmanager.versions.add", "secretmanager.versions.get", "secretmanager.versions.access"),
        read=("secretmanager.versions.get", "secretmanager.versions.access"),
        delete=("secretmanager.versions.destroy",),
    ),
    "gcp:secretmanager/secretIamMember:SecretIamMember": Calls(
        ("secret", "secretId"),
        _IAM_MEMBER,
        create=("secretmanager.secrets.getIamPolicy", "secretmanager.secrets.setIamPolicy"),
        read=("secretmanager.secrets.getIamPolicy",),
        delete=("secretmanager.secrets.getIamPolicy", "secretmanager.secrets.setIamPolicy"),
    ),
    "gcp:artifactregistry/repository:Repository": Calls(
        ("repository", "repositoryId"),
        f"{_TF}/artifactregistry/resource_artifact_registry_repository.go",
        create_on_project=("artifactregistry.repositories.create",),
        create=("artifactregistry.repositories.get",),
        read=("artifactregistry.repositories.get",),
        update=("artifactregistry.repositories.update",),
        delete=("artifactregistry.repositories.delete",),
    ),
    "gcp:artifactregistry/repositoryIamMember:RepositoryIamMember": Calls(
        ("repository", "repository"),
        _IAM_MEMBER,
        create=("artifactregistry.repositories.getIamPolicy", "artifactregistry.repositories.setIamPolicy"),
        read=("artifactregistry.repositories.getIamPolicy",),
        delete=("artifactregistry.repositories.getIamPolicy", "artifactregistry.repositories.setIamPolicy"),
    ),
    "docker-build:index:Image": Calls(
        ("repository", "tags"),
        "pulumi-docker-build pushes the image built on the runner (build_on_preview=False: nothing in a preview) "
        "and reads its manifest back; Artifact Registry docs, 'Access control with IAM' (push needs upload, "
        "the layer checks download)",
        create=("artifactregistry.repositories.uploadArtifacts", "artifactregistry.repositories.downloadArtifacts"),
        read=("artifactregistry.repositories.downloadArtifacts",),
        update=("artifactregistry.repositories.uploadArtifacts", "artifactregistry.repositories.downloadArtifacts"),
    ),
    "gcp:cloudrunv2/job:Job": Calls(
        ("project", "project"),
        f"{_TF}/cloudrunv2/resource_cloud_run_v2_job.go (long-running operations); Cloud Run docs: deploying "
        "with a service account needs actAs on it",
        create=("run.jobs.create", "run.jobs.get", "run.operations.get"),
        read=("run.jobs.get",),
        update=("run.jobs.update", "run.operations.get"),
        delete=("run.jobs.delete", "run.operations.get"),
        acts_as=("template.template.serviceAccount",),
    ),
    "gcp:cloudrunv2/service:Service": Calls(
        ("project", "project"),
        f"{_TF}/cloudrunv2/resource_cloud_run_v2_service.go; Cloud Run docs: deploying with a service account "
        "needs actAs on it",
        create=("run.services.create", "run.services.get", "run.operations.get"),
        read=("run.services.get",),
        update=("run.services.update", "run.operations.get"),
        delete=("run.services.delete", "run.operations.get"),
        acts_as=("template.serviceAccount",),
    ),
    "gcp:cloudrunv2/serviceIamMember:ServiceIamMember": Calls(
        ("project", "project"),
        _IAM_MEMBER,
        create=("run.services.getIamPolicy", "run.services.setIamPolicy"),
        read=("run.services.getIamPolicy",),
        delete=("run.services.getIamPolicy", "run.services.setIamPolicy"),
    ),
    "gcp:compute/network:Network": Calls(
        ("project", "project"),
        f"{_TF}/compute/resource_compute_network.go (networks.insert, get, patch of routingMode, delete; global "
        "operations are polled); Compute Engine IAM reference: compute.networks.create/get/update/delete",
        create_on_project=("compute.networks.create",),
        create=("compute.networks.get", "compute.globalOperations.get"),
        read=("compute.networks.get",),
        update=("compute.networks.update", "compute.globalOperations.get"),
        delete=("compute.networks.delete", "compute.globalOperations.get"),
    ),
    "gcp:compute/subnetwork:Subnetwork": Calls(
        ("project", "project"),
        f"{_TF}/compute/resource_compute_subnetwork.go (subnetworks.insert, get, patch of the secondary ranges, "
        "setPrivateIpGoogleAccess, delete; region operations are polled); a subnet is inserted into its network, "
        "which needs compute.networks.updatePolicy on it (Compute Engine IAM reference, subnetworks.insert)",
        create_on_project=("compute.subnetworks.create", "compute.networks.updatePolicy"),
        create=("compute.subnetworks.get", "compute.regionOperations.get"),
        read=("compute.subnetworks.get",),
        update=(
            "compute.subnetworks.update",
            "compute.subnetworks.setPrivateIpGoogleAccess",
            "compute.regionOperations.get",
        ),
        delete=("compute.subnetworks.delete", "compute.regionOperations.get"),
    ),
    "gcp:container/cluster:Cluster": Calls(
        ("project", "project"),
        "GKE docs, reference/api-permissions: clusters.create needs container.clusters.create and "
        "iam.serviceAccounts.actAs on the node service account; operations are polled. In the stack's own subnet "
        "the caller also uses the network and subnet (compute.networks.use, compute.subnetworks.use: UNCONFIRMED for "
        "a subnet of the cluster's own project; the Shared VPC guide asks them of the service project's GKE agent)",
        create=(
            "container.clusters.create",
            "container.clusters.get",
            "container.operations.get",
            "compute.networks.use",
            "compute.subnetworks.use",
        ),
        read=("container.clusters.get",),
        update=("container.clusters.update", "container.operations.get"),
        delete=("container.clusters.delete", "container.operations.get"),
        acts_as=("clusterAutoscaling.autoProvisioningDefaults.serviceAccount",),
    ),
    "gcp:billing/budget:Budget": Calls(
        ("billing-account", "billingAccount"),
        f"{_TF}/billing/resource_billing_budget.go; Cloud Billing Budget API reference, "
        "billingAccounts.budgets.create/get/patch/delete: billing.budgets.create/get/update/delete on the parent "
        "billing account (cloud.google.com/billing/docs/reference/budget/rest/v1/billingAccounts.budgets)",
        create=("billing.budgets.create", "billing.budgets.get"),
        read=("billing.budgets.get",),
        update=("billing.budgets.update",),
        delete=("billing.budgets.delete",),
    ),
    "gcp:monitoring/notificationChannel:NotificationChannel": Calls(
        ("project", "project"),
        f"{_TF}/monitoring/resource_monitoring_notification_channel.go; Cloud Monitoring API, "
        "projects.notificationChannels: monitoring.notificationChannels.create/get/update/delete",
        create=("monitoring.notificationChannels.create", "monitoring.notificationChannels.get"),
        read=("monitoring.notificationChannels.get",),
        update=("monitoring.notificationChannels.update",),
        delete=("monitoring.notificationChannels.delete",),
    ),
    "gcp:logging/metric:Metric": Calls(
        ("project", "project"),
        f"{_TF}/logging/resource_logging_metric.go (POST, GET, PUT, DELETE projects/PROJECT/metrics; create and update "
        "read it back); Cloud Logging IAM: logging.logMetrics.create/get/update/delete (infra/monitoring.py)",
        create=("logging.logMetrics.create", "logging.logMetrics.get"),
        read=("logging.logMetrics.get",),
        update=("logging.logMetrics.update", "logging.logMetrics.get"),
        delete=("logging.logMetrics.delete",),
    ),
    "gcp:monitoring/dashboard:Dashboard": Calls(
        ("project", "project"),
        f"{_TF}/monitoring/resource_monitoring_dashboard.go (POST, GET, PATCH, DELETE projects/PROJECT/dashboards; "
        "create reads it back); Cloud Monitoring IAM: monitoring.dashboards.create/get/update/delete",
        create=("monitoring.dashboards.create", "monitoring.dashboards.get"),
        read=("monitoring.dashboards.get",),
        update=("monitoring.dashboards.update",),
        delete=("monitoring.dashboards.delete",),
    ),
    "gcp:monitoring/alertPolicy:AlertPolicy": Calls(
        ("project", "project"),
        f"{_TF}/monitoring/resource_monitoring_alert_policy.go (POST, GET, PATCH, DELETE projects/PROJECT/alertPolicies; "
        "create and update read it back); Cloud Monitoring IAM: monitoring.alertPolicies.create/get/update/delete",
        create=("monitoring.alertPolicies.create", "monitoring.alertPolicies.get"),
        read=("monitoring.alertPolicies.get",),
        update=("monitoring.alertPolicies.update", "monitoring.alertPolicies.get"),
        delete=("monitoring.alertPolicies.delete",),
    ),
}

# Kubernetes kinds the program declares -> the GKE IAM resource name; custom resources are thirdPartyObjects.
KUBERNETES: dict[str, str] = {
    "kubernetes:core/v1:Namespace": "namespaces",
    "kubernetes:core/v1:ServiceAccount": "serviceAccounts",
    "kubernetes:core/v1:Secret": "secrets",
    "kubernetes:core/v1:Service": "services",
    "kubernetes:batch/v1:Job": "jobs",
    "kubernetes:networking.k8s.io/v1:NetworkPolicy": "networkPolicies",
    "kubernetes:ray.io/v1:RayJob": "thirdPartyObjects",
    "kubernetes:ray.io/v1:RayCluster": "thirdPartyObjects",
}
_K8S_SOURCE = (
    "GKE docs, reference/api-permissions (Kubernetes verbs as container.<resource>.<verb>, custom resources as "
    "thirdPartyObjects); pulumi-kubernetes applies server-side (a PATCH, authorised as update, and as create for "
    "a new object) and reads the object back while it awaits it"
)
_K8S_PREVIEW = ("create", "update", "get")
_K8S_APPLY = ("create", "update", "get", "delete")
# The provider itself: every call reaches the cluster's API server with a gke-gcloud-auth-plugin token.
_K8S_PROVIDER = "pulumi:providers:kubernetes"
_CLUSTER_ACCESS = (
    "container.clusters.get",
    "reach the cluster's API server as an IAM principal (GKE docs, 'Create IAM allow policies': the minimum "
    "to use kubectl on a cluster is container.clusters.get, roles/container.clusterViewer; UNCONFIRMED for a "
    "kubeconfig that `get-credentials` did not write)",
)


@dataclass(frozen=True)
class Invoke:
    permissions: tuple[str, ...]
    target: tuple[str, str]
    """(kind, argument naming the resource); an absent argument means the stack's project."""
    source: str


INVOKES: dict[str, Invoke] = {
    "gcp:storage/getBuckets:getBuckets": Invoke(
        ("storage.buckets.list",),
        ("project", "project"),
        "the kept-bucket check (infra/foundation.py kept_bucket); Cloud Storage buckets.list is authorised on the "
        "project, so no condition on bucket names can narrow it",
    ),
    "gcp:storage/getBucketObjects:getBucketObjects": Invoke(
        ("storage.objects.list",),
        ("bucket", "bucket"),
        "the served-run choice lists the recipe's completion markers, then the chosen run's folder, before the vLLM "
        "service is planned (infra/cloud_run.py served_run); the provider's data source calls Cloud Storage "
        "objects.list (terraform-provider-google google/services/storage/data_source_storage_bucket_objects.go; "
        "registry docs, data-sources/storage_bucket_objects: 'See the API: objects/list')",
    ),
    "gcp:storage/getBucketObjectContent:getBucketObjectContent": Invoke(
        ("storage.objects.get",),
        ("bucket", "bucket"),
        "the chosen run's completion marker is read before the vLLM service is planned (infra/cloud_run.py served_run)",
    ),
    "gcp:compute/getZones:getZones": Invoke(
        ("compute.zones.list",), ("project", "project"), "the reservation preflight lists the region's zones"
    ),
    "gcp:compute/getReservation:getReservation": Invoke(
        ("compute.reservations.get",),
        ("project", "project"),
        "the reservation preflight reads the reservation in each zone (infra/preflight.py)",
    ),
    "gcp:cloudquota/getSQuotaInfo:getSQuotaInfo": Invoke(
        ("cloudquotas.quotas.get",),
        ("project", "parent"),
        "the GPU quota preflight reads one QuotaInfo per quota the run draws on (infra/preflight.py check_gpu_quota); "
        "the data source calls quotaInfos.get, which 'requires the following IAM permission on the name resource: "
        "cloudquotas.quotas.get' (cloud.google.com/docs/quotas/reference/rest/v1/"
        "projects.locations.services.quotaInfos/get)",
    ),
}


@dataclass(frozen=True)
class CommandCall:
    permission: str
    target: tuple[str, str]
    """(kind, environment variable of the command naming the resource); kind `project` with no variable: the stack's."""
    why: str


@dataclass(frozen=True)
class Command:
    name: str
    calls: tuple[CommandCall, ...]


_GCLOUD_BUILD = "gcloud builds submit (googlecloudsdk command_lib/builds/submit_util.py SetSource and Build)"
COMMANDS: dict[str, Command] = {
    EXECUTE_SCRIPT: Command(
        "gcloud run jobs execute (infra/cloud_run.py: one execution per run id)",
        (
            CommandCall(
                "run.jobs.run",
                ("project", ""),
                "Cloud Run jobs.run (roles/run.jobsExecutor holds it); --async returns once the execution exists",
            ),
        ),
    ),
    CLOUD_BUILD_SCRIPT: Command(
        "gcloud builds submit / describe (infra/images.py, imageBuild: cloud-build)",
        (
            CommandCall(
                "storage.buckets.create",
                ("project", ""),
                f"{_GCLOUD_BUILD}: CreateBucketIfNotExists inserts the staging bucket first and accepts the 409",
            ),
            CommandCall("storage.buckets.get", ("bucket", "STAGING_BUCKET"), f"{_GCLOUD_BUILD}: after the 409"),
            CommandCall(
                "storage.objects.create", ("bucket", "STAGING_BUCKET"), f"{_GCLOUD_BUILD}: uploads the context"
            ),
            CommandCall("cloudbuild.builds.create", ("project", ""), f"{_GCLOUD_BUILD}: projects.locations.builds"),
            CommandCall(
                "cloudbuild.builds.get", ("project", ""), "gcloud follows the build, then `builds describe` reads it"
            ),
            CommandCall(
                "iam.serviceAccounts.actAs",
                ("account", "BUILD_SERVICE_ACCOUNT"),
                "--service-account: Cloud Build docs, 'Configure user-specified service accounts'",
            ),
        ),
    ),
    IAM_WAIT_SCRIPT: Command("sleep until fresh IAM grants have propagated (infra/foundation.py)", ()),
    DESCRIPTOR_WAIT_SCRIPT: Command(
        "poll Cloud Monitoring for the alerted log-based metrics (infra/monitoring.py)",
        (
            CommandCall(
                "monitoring.metricDescriptors.list",
                ("project", "PROJECT"),
                "GET projects/PROJECT/metricDescriptors?filter=metric.type = ... (Monitoring API "
                "projects.metricDescriptors.list) until each alerted metric's type is listed",
            ),
        ),
    ),
    FENCE_SCRIPT: Command(
        "kubectl apply of the preview fence (infra/admission.py)",
        (
            CommandCall(*_CLUSTER_ACCESS[:1], ("project", ""), _CLUSTER_ACCESS[1]),
            *(
                CommandCall(
                    f"container.clusterRoles.{verb}",
                    ("project", ""),
                    f"kubectl apply --server-side of ClusterRole gft-admission-fence-writer ({why})",
                )
                for verb, why in [
                    ("get", "apply reads the live object"),
                    ("create", "the first apply"),
                    ("update", "a server-side apply is a PATCH"),
                    (
                        "escalate",
                        "its rules are on admission policies, which no IAM permission grants (RBAC escalation check)",
                    ),
                ]
            ),
            *(
                CommandCall(
                    f"container.clusterRoleBindings.{verb}",
                    ("project", ""),
                    f"kubectl apply --server-side of the ClusterRoleBinding to whoever runs the step ({verb})",
                )
                for verb in ("get", "create", "update")
            ),
            CommandCall(
                "container.clusterRoles.bind",
                ("project", ""),
                "bind gft-admission-fence-writer without holding its rules (RBAC bind check); the policy and its "
                "binding are then applied under that RBAC grant",
            ),
        ),
    ),
    WAIT_SCRIPT: Command(
        "kubectl get / wait crd (infra/crd_wait.py)",
        (
            CommandCall(*_CLUSTER_ACCESS[:1], ("project", ""), _CLUSTER_ACCESS[1]),
            CommandCall("container.customResourceDefinitions.get", ("project", ""), "kubectl get crd NAME"),
            CommandCall(
                "container.customResourceDefinitions.list",
                ("project", ""),
                "kubectl wait --for=condition=Established watches the CRD (a list-watch)",
            ),
        ),
    ),
}


def _kubernetes(r: Recorded, verbs: tuple[str, ...]) -> list[Need]:
    if r.type not in KUBERNETES:
        raise ValueError(f"{r.urn}: Kubernetes kind {r.type} is unknown to infra/offline/api_permissions.py KUBERNETES")
    plural = KUBERNETES[r.type]
    return [
        Need(f"container.{plural}.{verb}", Scope.PROJECT, f"{verb} {r.name} ({r.type}): {_K8S_SOURCE}")
        for verb in verbs
    ]


def _invokes(run: StackRun, cfg: StackConfig) -> list[Need]:
    needs: list[Need] = []
    for token, args in run.invokes:
        if token not in INVOKES:
            raise ValueError(f"provider function {token} is unknown to infra/offline/api_permissions.py INVOKES")
        invoke = INVOKES[token]
        kind, argument = invoke.target
        scope = scope_of(cfg, kind, str(args.get(argument) or cfg.project), token)
        needs += [Need(p, scope, f"{token}: {invoke.source}") for p in invoke.permissions]
    return needs


def _k8s_objects(run: StackRun) -> list[Recorded]:
    return [r for r in run.resources if r.custom and r.type.startswith("kubernetes:")]


def preview_needs(run: StackRun) -> list[Need]:
    """What `pulumi preview` of this plan calls: every invoke, the read of every resource it imports, and the dry run
    of every Kubernetes object."""
    assert run.cfg is not None
    needs = _invokes(run, run.cfg)
    for r in run.resources:
        if r.custom and r.import_id:
            if r.type not in RESOURCES:
                raise ValueError(
                    f"{r.urn}: resource type {r.type} is unknown to infra/offline/api_permissions.py RESOURCES"
                )
            calls = RESOURCES[r.type]
            kind, key = calls.target
            scope = scope_of(run.cfg, kind, str(_at(r.plain_inputs(), key)), r.urn)
            why = f"import {r.import_id} ({r.type}): a preview reads it too (ImportStep); {calls.source}"
            needs += [Need(p, scope, why) for p in calls.read]
    objects = _k8s_objects(run)
    if objects:
        needs.append(Need(_CLUSTER_ACCESS[0], Scope.PROJECT, f"{_K8S_PROVIDER}: {_CLUSTER_ACCESS[1]}"))
    for r in objects:
        needs += _kubernetes(r, _K8S_PREVIEW)
    return _unique(needs)


def deploy_needs(run: StackRun) -> list[Need]:
    """What a preview, `pulumi up`, `pulumi refresh` and `pulumi destroy` of this plan call."""
    assert run.cfg is not None
    cfg = run.cfg
    needs = preview_needs(run)
    for r in run.resources:
        if not r.custom or r.type == _K8S_PROVIDER:
            continue
        if r.type.startswith("kubernetes:"):
            needs += _kubernetes(r, _K8S_APPLY)
        elif r.type == "command:local:Command":
            needs += _command(r, cfg)
        elif r.type in RESOURCES:
            needs += _resource(r, RESOURCES[r.type], cfg)
        else:
            raise ValueError(
                f"{r.urn}: resource type {r.type} is unknown to infra/offline/api_permissions.py RESOURCES"
            )
    return _unique(needs)


def _resource(r: Recorded, calls: Calls, cfg: StackConfig) -> list[Need]:
    inputs = r.plain_inputs()
    kind, key = calls.target
    name = _at(inputs, key)
    here = scope_of(cfg, kind, str(cfg.project if name is None and kind == "project" else name), r.urn)
    what = f"{r.name} ({r.type}): {calls.source}"
    roles = frozenset({inputs[calls.grants_role]}) if calls.grants_role else frozenset()
    needs: list[Need] = []

    def add(permissions: Iterable[str], scope: Scope, op: str) -> None:
        # Only a policy write modifies grants; a read sees `modifiedGrantsByRole` empty.
        needs.extend(
            Need(p, scope, f"{op} {what}", roles if p.endswith(".setIamPolicy") else frozenset()) for p in permissions
        )

    add(calls.read, here, "read")
    if not r.import_id:  # an import reads the existing resource instead of creating it
        add(calls.create_on_project, Scope.PROJECT, "create")
        add(calls.create, here, "create")
    ignored = set(r.ignore_changes)
    if calls.updatable is None or any(f in inputs and f not in ignored for f in calls.updatable):
        add(calls.update, here, "update")
    if not r.retain_on_delete:
        skip = calls.no_delete_when is not None and inputs.get(calls.no_delete_when[0]) == calls.no_delete_when[1]
        if not skip:
            add(calls.delete, here, "delete")
            if inputs.get("forceDestroy"):
                add(calls.force_delete, here, "delete (forceDestroy)")
    for path in calls.acts_as:
        account = _at(inputs, path)
        if account:
            scope = scope_of(cfg, "account", str(account), r.urn)
            needs.append(Need("iam.serviceAccounts.actAs", scope, f"create/update {what} (runs as {account})"))
    return needs


def _command(r: Recorded, cfg: StackConfig) -> list[Need]:
    inputs = r.plain_inputs()
    script = inputs.get("create")
    if script not in COMMANDS:
        raise ValueError(
            f"{r.urn}: its command is none of infra/offline/api_permissions.py COMMANDS: say what it calls there"
        )
    command = COMMANDS[script]
    environment = inputs.get("environment") or {}
    needs = []
    for call in command.calls:
        kind, variable = call.target
        name = str(environment[variable]) if variable else cfg.project
        scope = scope_of(cfg, kind, name, r.urn)
        needs.append(Need(call.permission, scope, f"{r.name}, {command.name}: {call.why}"))
    return needs


def _unique(needs: Iterable[Need]) -> list[Need]:
    """The first need of each (permission, scope, roles): one reason is enough to report."""
    seen: dict[tuple[str, Scope, frozenset[str]], Need] = {}
    for need in needs:
        seen.setdefault((need.permission, need.scope, need.grants_roles), need)
    return list(seen.values())
