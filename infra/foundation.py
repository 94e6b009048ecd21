"""The base every workload stands on: APIs, identities and their grants, the HF token, the bucket, the registry.

Decisions
- Only the APIs the chosen workload needs are enabled; none is disabled on destroy. The few the program
  reads before it can enable anything are enabled once by hand (`BOOTSTRAP_APIS`).
- One service account per identity (trainer, vLLM server, GKE nodes, Cloud Build builder), each bound to
  the one resource it uses; no basic role. `infra/offline/permissions.py` says what each needs.
- The accounts are adopted when they exist and kept by `pulumi destroy` (which deletes their grants);
  `grants_to(identity)` lists every grant to one identity and waits `IAM_PROPAGATION_S` after them.
  Why: docs/identities.md#one-account-per-identity-kept-by-destroy.
- The bucket outlives `pulumi destroy` (`bucketForceDestroy` removes it), soft delete is off unless
  `bucketSoftDeleteDays` says, and an existing bucket is adopted, its labels included:
  docs/operations.md#the-bucket-outlives-destroy.
- The HF token (Cloud Run only) and `servingApiKey` go to Secret Manager, each with its reader's grant.
  Kubernetes identities and Workload Identity belong to the GKE components.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import pulumi
import pulumi_command as command
import pulumi_gcp as gcp

from infra.config import ImageBuild, StackConfig, Workload

_COMMON_APIS = (
    "cloudresourcemanager.googleapis.com",
    "iam.googleapis.com",
    "storage.googleapis.com",
    "artifactregistry.googleapis.com",
)
# GKE pods act as the trainer's account through Workload Identity: the GKE metadata server trades the pod's
# Kubernetes token for the account's access token through the IAM Service Account Credentials API, which a
# fresh project does not have on. Without it every Google call of the pods fails with "Unable to generate
# access token; IAM returned 403 Forbidden: IAM Service Account Credentials API has not been used in project
# … or it is disabled" (the metadata server's answer, quoted in google/kctf#194).
_GKE_APIS = (
    "container.googleapis.com",
    "compute.googleapis.com",
    "logging.googleapis.com",
    "iamcredentials.googleapis.com",
)
_WORKLOAD_APIS = {
    Workload.GKE_JOB: _GKE_APIS,
    Workload.GKE_RAY: _GKE_APIS,
    Workload.CLOUD_RUN: ("run.googleapis.com", "compute.googleapis.com", "logging.googleapis.com"),
}
# What must be enabled before the first `pulumi up` can read anything (README, "The cloud path"): the preflight
# reads GPU quotas through the Cloud Quotas API before any resource (so before any `projects.Service`) exists,
# and the Cloud Quotas API lists a service's quotas only once that service is enabled in the project: the
# services whose GPU quotas it reads (Cloud Run for `dev`, Compute Engine for the GKE stacks) come first too.
BOOTSTRAP_APIS = (
    "cloudresourcemanager.googleapis.com",
    "serviceusage.googleapis.com",
    "storage.googleapis.com",
    "cloudquotas.googleapis.com",
    "run.googleapis.com",
    "compute.googleapis.com",
)


class Identity(StrEnum):
    """The Google service accounts a stack creates; the value ends the account id `gft-<stack>-<value>`."""

    TRAINER = "train"
    SERVING = "serve"
    NODES = "node"
    BUILD = "build"


def identities(cfg: StackConfig) -> list[Identity]:
    """The identities this stack creates."""
    found = [Identity.TRAINER]
    if cfg.serving_enabled:
        found.append(Identity.SERVING)
    if cfg.workload in (Workload.GKE_JOB, Workload.GKE_RAY):
        found.append(Identity.NODES)
    if cfg.image_build is ImageBuild.CLOUD_BUILD:
        found.append(Identity.BUILD)
    return found


def account_id(cfg: StackConfig, identity: Identity) -> str:
    """At most 30 characters: stack names are at most 20."""
    return f"gft-{cfg.stack}-{identity}"


ACCOUNT_DESCRIPTIONS = {
    Identity.TRAINER: "training workload",
    Identity.SERVING: "vLLM serving",
    Identity.NODES: "GKE Autopilot nodes",
    Identity.BUILD: "Cloud Build image builds",
}


def account_display_name(cfg: StackConfig, identity: Identity) -> str:
    """The display name the program (or the CI setup, which creates the same accounts first) gives an account."""
    return f"gemma-finetune {cfg.stack}: {ACCOUNT_DESCRIPTIONS[identity]}"


def account_email(cfg: StackConfig, identity: Identity) -> str:
    return f"{account_id(cfg, identity)}@{cfg.project}.iam.gserviceaccount.com"


def bucket_name(cfg: StackConfig) -> str:
    return f"{cfg.project}-gft-{cfg.stack}"


def staging_bucket_name(cfg: StackConfig) -> str:
    """Where `gcloud builds submit` uploads the build context (imageBuild: cloud-build)."""
    return f"{cfg.project}-gft-{cfg.stack}-build"


def hf_secret_id(cfg: StackConfig) -> str:
    return f"gft-{cfg.stack}-hf-token"


def api_key_secret_id(cfg: StackConfig) -> str:
    return f"gft-{cfg.stack}-vllm-api-key"


def repository_id(cfg: StackConfig) -> str:
    return f"gemma-finetune-{cfg.stack}"


def reads_hf_secret(cfg: StackConfig) -> bool:
    """Only the Cloud Run Job reads the token from Secret Manager (`infra.cloud_run` secretKeyRef)."""
    return cfg.hf_token_set and cfg.workload is Workload.CLOUD_RUN


def reads_api_key_secret(cfg: StackConfig) -> bool:
    """The vLLM Service reads `servingApiKey` from Secret Manager (`infra.serving` VLLM_API_KEY secretKeyRef)."""
    return cfg.serving_enabled and cfg.serving_api_key_set


def required_apis(cfg: StackConfig) -> list[str]:
    """The APIs this stack uses, and no others."""
    apis = list(_COMMON_APIS) + list(_WORKLOAD_APIS[cfg.workload])
    if cfg.serving_enabled:  # every stack serves on Cloud Run (infra/serving.py)
        apis.append("run.googleapis.com")
    if reads_hf_secret(cfg) or reads_api_key_secret(cfg):
        apis.append("secretmanager.googleapis.com")
    if cfg.image_build is ImageBuild.CLOUD_BUILD:
        apis.append("cloudbuild.googleapis.com")
    apis.append("monitoring.googleapis.com")  # infra.monitoring's dashboard and alerts; every email channel
    if cfg.budget_usd is not None:  # infra.budget: the budget
        apis.append("billingbudgets.googleapis.com")
    return sorted(set(apis))


def kept_bucket(cfg: StackConfig) -> str | None:
    """The stack's bucket name when it already exists in the project (kept by an earlier destroy, or
    in this stack's state), else None. Lists buckets by name prefix (`storage.buckets.list`), which
    answers "absent" without an error, unlike a read of the bucket itself."""
    name = bucket_name(cfg)
    found = gcp.storage.get_buckets(project=cfg.project, prefix=name)
    return name if any(b.name == name for b in found.buckets or []) else None


# Written last by a finished run at the top of its folder; must equal trainer.checkpoints.RUN_MARKER
# (tests/infra/test_finished_runs.py). infra/ cannot import trainer.checkpoints: the program's venv has no fsspec.
RUN_MARKER = "_RUN_COMPLETE.json"


# The output a workload sets only for a finished run; the program declares nothing more into that run's folder.
FINISHED_OUTPUT = "trainingState"


def finished_run(cfg: StackConfig, bucket_kept: bool, folder: str) -> str | None:
    """`gs://BUCKET/FOLDER/_RUN_COMPLETE.json` when the run in `folder` (relative to the bucket) has finished,
    else None. A fresh bucket holds no run, so it is listed only when it existed before this `up` (kept by a
    destroy, or in the stack): `objects.list` by the marker's name answers "absent" without an error."""
    if not bucket_kept:
        return None
    marker = f"{folder}/{RUN_MARKER}"
    found = gcp.storage.get_bucket_objects(bucket=bucket_name(cfg), prefix=marker)
    return f"gs://{bucket_name(cfg)}/{marker}" if any(o.name == marker for o in found.bucket_objects or []) else None


# IAM grants reach every Google service only after a while: "typically 2 minutes", "7 minutes or longer" for
# some (https://cloud.google.com/iam/docs/access-change-propagation). A consumer of a fresh grant that is a
# provider resource (a Cloud Run Job that reads a secret, a GKE Job whose pods write the bucket) cannot retry,
# so it waits on this step, which runs again whenever a grant is added, removed or moved: its triggers are the
# grants' IDs (resource/role/member[/condition]), which a move changes and a URN does not.
IAM_PROPAGATION_S = 120
IAM_WAIT_SCRIPT = 'sleep "$IAM_PROPAGATION_S"  # infra/foundation.py iam_propagation_wait'


def iam_propagation_wait(
    name: str, grants: list[pulumi.CustomResource], parent: pulumi.Resource | None = None
) -> command.local.Command:
    """A step that returns `IAM_PROPAGATION_S` after `grants` exist; depend on it to use them."""
    return command.local.Command(
        f"{name}-iam-propagation",
        create=IAM_WAIT_SCRIPT,
        interpreter=["/bin/bash", "-c"],
        environment={"IAM_PROPAGATION_S": str(IAM_PROPAGATION_S)},
        triggers=[g.id for g in grants],
        opts=pulumi.ResourceOptions(parent=parent, depends_on=grants),
    )


@dataclass
class FoundationArgs:
    cfg: StackConfig
    """The validated stack configuration."""
    hf_token: pulumi.Output[str] | None
    """The Hugging Face token as a secret Output, or None when the recipe needs none."""
    serving_api_key: pulumi.Output[str] | None = None
    """`servingApiKey` as a secret Output, or None when the stack sets none."""


class Foundation(pulumi.ComponentResource):
    """APIs, service accounts and their grants, the HF token and API key secrets, the bucket and the image registry."""

    apis: list[gcp.projects.Service]
    accounts: dict[Identity, gcp.serviceaccount.Account]
    trainer_account: gcp.serviceaccount.Account
    serving_account: gcp.serviceaccount.Account | None
    node_account: gcp.serviceaccount.Account | None
    build_account: gcp.serviceaccount.Account | None
    bucket: gcp.storage.Bucket
    bucket_kept: bool
    """The bucket existed before this `up` (kept by a destroy, or in the stack): it may hold finished runs."""
    bucket_name: pulumi.Output[str]
    bucket_uri: pulumi.Output[str]
    build_staging_bucket: gcp.storage.Bucket | None
    hf_secret: gcp.secretmanager.Secret | None
    hf_secret_version: gcp.secretmanager.SecretVersion | None
    api_key_secret: gcp.secretmanager.Secret | None
    api_key_secret_version: gcp.secretmanager.SecretVersion | None
    registry: gcp.artifactregistry.Repository
    registry_url: pulumi.Output[str]

    def __init__(self, name: str, args: FoundationArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gemma-finetune:gcp:Foundation", name, None, opts)
        cfg = args.cfg
        self._cfg = cfg
        self._name = name
        self._grants: dict[Identity, list[pulumi.CustomResource]] = {identity: [] for identity in Identity}
        self._waits: dict[Identity, command.local.Command] = {}
        self._name = name
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

        # Adopted when the CI setup created them first; kept by `destroy`
        # (docs/identities.md#one-account-per-identity-kept-by-destroy).
        adopt_accounts = pulumi.ResourceOptions(parent=self, depends_on=self.apis, ignore_changes=["display_name"])
        self.accounts = {
            identity: gcp.serviceaccount.Account(
                f"{name}-{identity.name.lower()}-sa",
                project=cfg.project,
                account_id=account_id(cfg, identity),
                display_name=account_display_name(cfg, identity),
                create_ignore_already_exists=True,
                deletion_policy="ABANDON",
                opts=adopt_accounts,
            )
            for identity in identities(cfg)
        }
        self.trainer_account = self.accounts[Identity.TRAINER]
        self.serving_account = self.accounts.get(Identity.SERVING)
        self.node_account = self.accounts.get(Identity.NODES)
        self.build_account = self.accounts.get(Identity.BUILD)

        adopt = kept_bucket(cfg)
        self.bucket_kept = adopt is not None
        self.bucket = gcp.storage.Bucket(
            f"{name}-bucket",
            project=cfg.project,
            name=bucket_name(cfg),
            location=cfg.region,
            uniform_bucket_level_access=True,
            public_access_prevention="enforced",
            force_destroy=cfg.bucket_force_destroy,
            soft_delete_policy=gcp.storage.BucketSoftDeletePolicyArgs(
                retention_duration_seconds=cfg.bucket_soft_delete_days * 86400
            ),
            labels=cfg.resource_labels,
            opts=pulumi.ResourceOptions(
                parent=self,
                depends_on=self.apis,
                retain_on_delete=not cfg.bucket_force_destroy,
                # The bucket's ID is its name (terraform-provider-google google_storage_bucket). While the bucket is in
                # the state with that ID the option does nothing (pulumi/pulumi step_generator.go imports only when
                # there is no old state or its ID differs), so `labels` and every other setting update as for any
                # resource; after a destroy the import reads the bucket and the same `up` updates it to the program's
                # inputs (docs/operations.md#the-bucket-outlives-destroy).
                import_=adopt,
            ),
        )
        self.bucket_name = self.bucket.name
        self.bucket_uri = self.bucket.name.apply(lambda n: f"gs://{n}")
        self._grant_on_bucket(Identity.TRAINER, "trainer", "roles/storage.objectUser")
        if cfg.workload is Workload.GKE_RAY:
            # Ray Train's gs:// storage goes through pyarrow's GCS filesystem, which reads the bucket's
            # metadata (storage.buckets.get) before it creates a directory; objectUser lacks it.
            # bucketViewer (buckets.get, buckets.list) is the smallest role with it: on a bucket,
            # buckets.list grants nothing; legacyBucketReader would add object listing twice over.
            self._grant_on_bucket(Identity.TRAINER, "trainer-meta", "roles/storage.bucketViewer")
        if Identity.SERVING in self.accounts:
            self._grant_on_bucket(Identity.SERVING, "serving", "roles/storage.objectViewer")
        self._grant_data_read()

        self.hf_secret, self.hf_secret_version = None, None
        if args.hf_token is not None and reads_hf_secret(cfg):
            self.hf_secret, self.hf_secret_version = self._secret(
                "hf-token", hf_secret_id(cfg), args.hf_token, Identity.TRAINER
            )
        self.api_key_secret, self.api_key_secret_version = None, None
        if args.serving_api_key is not None and reads_api_key_secret(cfg):
            self.api_key_secret, self.api_key_secret_version = self._secret(
                "vllm-api-key", api_key_secret_id(cfg), args.serving_api_key, Identity.SERVING
            )

        self.registry = gcp.artifactregistry.Repository(
            f"{name}-registry",
            project=cfg.project,
            location=cfg.region,
            repository_id=repository_id(cfg),
            format="DOCKER",
            description=f"gemma-finetune {cfg.stack}: trainer and serving images",
            labels=cfg.resource_labels,
            opts=after_apis,
        )
        self.registry_url = self.registry.repository_id.apply(
            lambda repo: f"{cfg.region}-docker.pkg.dev/{cfg.project}/{repo}"
        )
        if Identity.NODES in self.accounts:
            # Nodes pull the trainer image and export logs and metrics as their service account.
            self._grant_on_registry(Identity.NODES, "nodes", "roles/artifactregistry.reader")
            self._grant_on_project(Identity.NODES, "nodes", "roles/container.defaultNodeServiceAccount")

        self.build_staging_bucket = None
        if Identity.BUILD in self.accounts:
            self._build_grants(name, cfg, child)

        self.register_outputs(
            {
                "bucket_name": self.bucket_name,
                "bucket_uri": self.bucket_uri,
                "registry_url": self.registry_url,
                "trainer_account_email": self.trainer_account.email,
            }
        )

    def grants_to(self, identity: Identity) -> list[pulumi.Resource]:
        """Every IAM grant this foundation makes to `identity` and the step that waits until they have propagated
        (`iam_propagation_wait`, one per identity); empty when the stack has no such identity."""
        grants = self._grants[identity]
        if not grants:
            return []
        if identity not in self._waits:
            self._waits[identity] = iam_propagation_wait(f"{self._name}-{identity.value}", list(grants), parent=self)
        return [*grants, self._waits[identity]]

    def _member(self, identity: Identity) -> pulumi.Output[str]:
        return self.accounts[identity].email.apply(lambda e: f"serviceAccount:{e}")

    def _secret(
        self, suffix: str, secret_id: str, value: pulumi.Output[str], reader: Identity
    ) -> tuple[gcp.secretmanager.Secret, gcp.secretmanager.SecretVersion]:
        """A Secret Manager secret holding `value` (kept a secret Output), its version, and `reader`'s accessor
        grant, registered in `grants_to(reader)`."""
        secret = gcp.secretmanager.Secret(
            f"{self._name}-{suffix}",
            project=self._cfg.project,
            secret_id=secret_id,
            replication=gcp.secretmanager.SecretReplicationArgs(auto=gcp.secretmanager.SecretReplicationAutoArgs()),
            labels=self._cfg.resource_labels,
            opts=pulumi.ResourceOptions(parent=self, depends_on=self.apis),
        )
        version = gcp.secretmanager.SecretVersion(
            f"{self._name}-{suffix}-v",
            secret=secret.id,
            secret_data=pulumi.Output.secret(value),  # type: ignore[arg-type]
            opts=pulumi.ResourceOptions(parent=self),
        )
        self._grants[reader].append(
            gcp.secretmanager.SecretIamMember(
                f"{self._name}-{suffix}-{reader.name.lower()}",
                project=self._cfg.project,
                secret_id=secret.secret_id,
                role="roles/secretmanager.secretAccessor",
                member=self._member(reader),
                opts=pulumi.ResourceOptions(parent=self),
            )
        )
        return secret, version

    def _grant_on_bucket(
        self, identity: Identity, suffix: str, role: str, bucket: gcp.storage.Bucket | None = None
    ) -> None:
        target = bucket or self.bucket
        self._grants[identity].append(
            gcp.storage.BucketIAMMember(
                f"{self._name}-{'bucket' if bucket is None else 'build-staging'}-{suffix}",
                bucket=target.name,
                role=role,
                member=self._member(identity),
                opts=pulumi.ResourceOptions(parent=self),
            )
        )

    def _grant_data_read(self) -> None:
        """The trainer reads the recipe's gs:// data: objectViewer on that bucket, limited to its prefix
        (infra/data_access.py)."""
        from infra.data_access import CONDITION_TITLE, READ_ROLE, data_read_grants, read_condition

        for index, (bucket, prefixes) in enumerate(data_read_grants(self._cfg)):
            condition = read_condition(bucket, prefixes)
            self._grants[Identity.TRAINER].append(
                gcp.storage.BucketIAMMember(
                    f"{self._name}-data-read-{index}",
                    bucket=bucket,
                    role=READ_ROLE,
                    member=self._member(Identity.TRAINER),
                    condition=gcp.storage.BucketIAMMemberConditionArgs(
                        title=CONDITION_TITLE,
                        description="read " + ", ".join(f"gs://{bucket}/{prefix}*" for prefix in prefixes),
                        expression=condition,
                    )
                    if condition
                    else None,
                    opts=pulumi.ResourceOptions(parent=self),
                )
            )

    def _grant_on_registry(self, identity: Identity, suffix: str, role: str) -> None:
        self._grants[identity].append(
            gcp.artifactregistry.RepositoryIamMember(
                f"{self._name}-registry-{suffix}",
                project=self._cfg.project,
                location=self._cfg.region,
                repository=self.registry.repository_id,
                role=role,
                member=self._member(identity),
                opts=pulumi.ResourceOptions(parent=self),
            )
        )

    def _grant_on_project(self, identity: Identity, suffix: str, role: str) -> None:
        """Only for roles whose permissions exist at project level alone (logs, metrics)."""
        self._grants[identity].append(
            gcp.projects.IAMMember(
                f"{self._name}-project-{suffix}",
                project=self._cfg.project,
                role=role,
                member=self._member(identity),
                opts=pulumi.ResourceOptions(parent=self),
            )
        )

    def _build_grants(self, name: str, cfg: StackConfig, child: pulumi.ResourceOptions) -> None:
        """imageBuild: cloud-build runs each build as the builder account (`gcloud builds submit
        --service-account`). Cloud Build then requires the logs to go to Cloud Logging (our
        cloudbuild.yaml: CLOUD_LOGGING_ONLY) or a user bucket, and the account to write them
        (cloud.google.com/build/docs/securing-builds/configure-user-specified-service-accounts);
        it pushes to this repository and fetches the source archive that gcloud uploads to
        the staging bucket (`--gcs-source-staging-dir`)."""
        self.build_staging_bucket = gcp.storage.Bucket(
            f"{name}-build-staging",
            project=cfg.project,
            name=staging_bucket_name(cfg),
            location=cfg.region,
            uniform_bucket_level_access=True,
            public_access_prevention="enforced",
            # Only build contexts live here: nothing to keep, and they age out (no soft delete either).
            force_destroy=True,
            soft_delete_policy=gcp.storage.BucketSoftDeletePolicyArgs(retention_duration_seconds=0),
            lifecycle_rules=[
                gcp.storage.BucketLifecycleRuleArgs(
                    action=gcp.storage.BucketLifecycleRuleActionArgs(type="Delete"),
                    condition=gcp.storage.BucketLifecycleRuleConditionArgs(age=7),
                )
            ],
            labels=cfg.resource_labels,
            opts=pulumi.ResourceOptions(parent=self, depends_on=self.apis),
        )
        self._grant_on_bucket(Identity.BUILD, "builder", "roles/storage.objectViewer", self.build_staging_bucket)
        self._grant_on_registry(Identity.BUILD, "builder", "roles/artifactregistry.writer")
        self._grant_on_project(Identity.BUILD, "builder", "roles/logging.logWriter")
