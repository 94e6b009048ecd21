"""The base every workload stands on: APIs, identities, the HF token, the bucket, the registry.

Decisions
- Only the APIs the chosen workload needs are enabled, and none is disabled on destroy
  (other things in the project may use them).
- One Google service account per role (trainer; serving when it is on), each bound to
  the one resource it needs: object access on this bucket, accessor on this secret,
  reader on this repository. Nothing is granted at project level and no basic role is
  ever used (see `infra.catalog.BASIC_ROLES`).
- The bucket outlives `pulumi destroy` by default (`retain_on_delete`): trained models
  are never deleted silently. `bucketForceDestroy: true` removes it with its contents.
- The HF token is written to Secret Manager only when the stack sets one; it stays a
  secret Output everywhere.

Not here: Kubernetes identities and Workload Identity bindings (the GKE components own
them, because they know the namespace and the Kubernetes service account).
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

from infra.config import ImageBuild, StackConfig, Workload

_COMMON_APIS = ("iam.googleapis.com", "storage.googleapis.com", "artifactregistry.googleapis.com")
_WORKLOAD_APIS = {
    Workload.GKE_JOB: ("container.googleapis.com", "compute.googleapis.com", "logging.googleapis.com"),
    Workload.GKE_RAY: ("container.googleapis.com", "compute.googleapis.com", "logging.googleapis.com"),
    Workload.CLOUD_RUN: ("run.googleapis.com", "compute.googleapis.com", "logging.googleapis.com"),
}


def required_apis(cfg: StackConfig) -> list[str]:
    """The APIs this stack uses, and no others."""
    apis = list(_COMMON_APIS) + list(_WORKLOAD_APIS[cfg.workload])
    if cfg.hf_token_set or (cfg.serving_enabled and cfg.serving_api_key_set):
        apis.append("secretmanager.googleapis.com")
    if cfg.image_build is ImageBuild.CLOUD_BUILD:
        apis.append("cloudbuild.googleapis.com")
    return sorted(set(apis))


@dataclass
class FoundationArgs:
    cfg: StackConfig
    """The validated stack configuration."""
    hf_token: pulumi.Output[str] | None
    """The Hugging Face token as a secret Output, or None when the recipe needs none."""


class Foundation(pulumi.ComponentResource):
    """APIs, service accounts, the HF token secret, the bucket and the image registry."""

    apis: list[gcp.projects.Service]
    trainer_account: gcp.serviceaccount.Account
    serving_account: gcp.serviceaccount.Account | None
    bucket: gcp.storage.Bucket
    bucket_name: pulumi.Output[str]
    bucket_uri: pulumi.Output[str]
    hf_secret: gcp.secretmanager.Secret | None
    hf_secret_version: gcp.secretmanager.SecretVersion | None
    registry: gcp.artifactregistry.Repository
    registry_url: pulumi.Output[str]

    def __init__(self, name: str, args: FoundationArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gemma-finetune:gcp:Foundation", name, None, opts)
        cfg = args.cfg
        child = pulumi.ResourceOptions(parent=self)

        self.apis = [
            gcp.projects.Service(
                f"{name}-api-{api.split('.')[0]}",
                project=cfg.project,
                service=api,
                disable_on_destroy=False,
                opts=child,
            )
            for api in required_apis(cfg)
        ]
        after_apis = pulumi.ResourceOptions(parent=self, depends_on=self.apis)

        self.trainer_account = gcp.serviceaccount.Account(
            f"{name}-trainer-sa",
            project=cfg.project,
            account_id=f"gft-{cfg.stack}-train",
            display_name=f"gemma-finetune {cfg.stack}: training workload",
            opts=after_apis,
        )
        self.serving_account = None
        if cfg.serving_enabled:
            self.serving_account = gcp.serviceaccount.Account(
                f"{name}-serving-sa",
                project=cfg.project,
                account_id=f"gft-{cfg.stack}-serve",
                display_name=f"gemma-finetune {cfg.stack}: vLLM serving",
                opts=after_apis,
            )

        self.bucket = gcp.storage.Bucket(
            f"{name}-bucket",
            project=cfg.project,
            name=f"{cfg.project}-gft-{cfg.stack}",
            location=cfg.region,
            uniform_bucket_level_access=True,
            public_access_prevention="enforced",
            force_destroy=cfg.bucket_force_destroy,
            labels=cfg.resource_labels,
            opts=pulumi.ResourceOptions(
                parent=self, depends_on=self.apis, retain_on_delete=not cfg.bucket_force_destroy
            ),
        )
        self.bucket_name = self.bucket.name
        self.bucket_uri = self.bucket.name.apply(lambda n: f"gs://{n}")
        gcp.storage.BucketIAMMember(
            f"{name}-bucket-trainer",
            bucket=self.bucket.name,
            role="roles/storage.objectUser",
            member=self.trainer_account.email.apply(lambda e: f"serviceAccount:{e}"),
            opts=child,
        )
        if self.serving_account is not None:
            gcp.storage.BucketIAMMember(
                f"{name}-bucket-serving",
                bucket=self.bucket.name,
                role="roles/storage.objectViewer",
                member=self.serving_account.email.apply(lambda e: f"serviceAccount:{e}"),
                opts=child,
            )

        self.hf_secret = None
        self.hf_secret_version = None
        if args.hf_token is not None:
            self.hf_secret = gcp.secretmanager.Secret(
                f"{name}-hf-token",
                project=cfg.project,
                secret_id=f"gft-{cfg.stack}-hf-token",
                replication=gcp.secretmanager.SecretReplicationArgs(auto=gcp.secretmanager.SecretReplicationAutoArgs()),
                labels=cfg.resource_labels,
                opts=after_apis,
            )
            self.hf_secret_version = gcp.secretmanager.SecretVersion(
                f"{name}-hf-token-v",
                secret=self.hf_secret.id,
                secret_data=pulumi.Output.secret(args.hf_token),  # type: ignore[arg-type]
                opts=child,
            )
            if cfg.workload is Workload.CLOUD_RUN:
                # GKE workloads read the token from a Kubernetes Secret instead; no accessor needed there.
                gcp.secretmanager.SecretIamMember(
                    f"{name}-hf-token-trainer",
                    project=cfg.project,
                    secret_id=self.hf_secret.secret_id,
                    role="roles/secretmanager.secretAccessor",
                    member=self.trainer_account.email.apply(lambda e: f"serviceAccount:{e}"),
                    opts=child,
                )

        self.registry = gcp.artifactregistry.Repository(
            f"{name}-registry",
            project=cfg.project,
            location=cfg.region,
            repository_id=f"gemma-finetune-{cfg.stack}",
            format="DOCKER",
            description=f"gemma-finetune {cfg.stack}: trainer and serving images",
            labels=cfg.resource_labels,
            opts=after_apis,
        )
        self.registry_url = self.registry.repository_id.apply(
            lambda repo: f"{cfg.region}-docker.pkg.dev/{cfg.project}/{repo}"
        )
        if cfg.workload in (Workload.GKE_JOB, Workload.GKE_RAY):
            # Autopilot nodes pull images as the project's default compute service account; grant it
            # read on this repository only (orgs that disable automatic grants give it nothing).
            number = gcp.organizations.get_project_output(project_id=cfg.project).number
            gcp.artifactregistry.RepositoryIamMember(
                f"{name}-registry-nodes",
                project=cfg.project,
                location=cfg.region,
                repository=self.registry.repository_id,
                role="roles/artifactregistry.reader",
                member=number.apply(lambda n: f"serviceAccount:{n}-compute@developer.gserviceaccount.com"),
                opts=child,
            )

        self.register_outputs(
            {
                "bucket_name": self.bucket_name,
                "bucket_uri": self.bucket_uri,
                "registry_url": self.registry_url,
                "trainer_account_email": self.trainer_account.email,
            }
        )
