"""What each identity needs — the workloads at run time and the CI identities that run Pulumi — and the proof that
its grants cover exactly that, from public role data.

    .venv/bin/python -m pytest tests/infra/test_permissions.py   # the proof, every stack and variant
    .venv/bin/python -m infra.offline.permissions                         # every need, as Markdown (plans every stack)
    .venv/bin/python -m infra.offline.permissions --vendor ROLES.json     # refresh iam_roles.json from public role data

For every stack and variant, the program runs under mocks and each identity must have nothing `missing`
(every need granted where it applies, conditions included) and nothing `unneeded` (every role serves a need).
Decisions (why and sources: docs/identities.md#every-grant-proven-from-role-data)
- Grants: the IAM resources the program plans, and the one-time CI setup (infra/bootstrap/ci-identities.yaml).
- Needs: rows for the workloads (`RUNTIMES`); derived for the CI identities from what the program declares
  (`infra.offline.api_permissions`), so a new kind of call fails the proof.
- Roles from data (`iam_roles.json`), never from their names; scopes and conditions on symbolic names.
Not here: grants to people, Google-managed service agents, the CI federation bindings.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from infra.config import Capacity, ImageBuild, StackConfig, Workload
from infra.data_access import data_read_scopes, list_prefix, object_resource
from infra.foundation import Identity, account_email, reads_api_key_secret, reads_hf_secret, repository_id
from infra.gke_workload import TRAINER_KSA, workload_identity_member
from infra.offline.api_permissions import ACCOUNT_SCOPES, Need, Scope, deploy_needs, preview_needs, scope_of, scopes
from infra.offline.engine import MOCK_PROJECT_NUMBER, StackRun

ROLES_FILE = Path(__file__).with_name("iam_roles.json")
CI_IDENTITIES_FILE = Path(__file__).parents[1] / "bootstrap" / "ci-identities.yaml"
# The setup's defaults (infra/bootstrap/ci-setup.sh STATE_BUCKET, KMS_*): where the bucket backend keeps state.
STATE_BUCKET_SUFFIX = "-pulumi-state"
# Each stack's own key (ci-identities.yaml `state-key`, infra/bootstrap/ci-setup.sh stack_key)
STATE_KEY_PATH = "locations/global/keyRings/gft-pulumi/cryptoKeys/gft-{stack}"
# Where the bucket backend keeps stack locks (pulumi pkg/backend/diy: .pulumi/locks/…)
STATE_LOCKS_PREFIX = "/objects/.pulumi/locks/"


@dataclass(frozen=True)
class Runtime:
    name: str
    member: Callable[[StackConfig], str]
    applies: Callable[[StackConfig], bool]
    needs: tuple[Need, ...] = ()
    derived: Callable[[StackRun], list[Need]] | None = None
    """Needs that follow from what the program declares (`infra.offline.api_permissions`)."""
    configured: Callable[[StackConfig], list[Need]] | None = None
    """Needs that follow from the stack's configuration (the recipe's data: `_data_reads`)."""


@dataclass(frozen=True)
class Grant:
    member: str
    role: str
    scope: Scope
    origin: str
    """Where the grant comes from (a planned resource's URN, a line of ci-identities.yaml)."""
    condition: str | None = None
    """The IAM Condition of a project-level grant, if any."""


def _account(identity: Identity) -> Callable[[StackConfig], str]:
    return lambda cfg: f"serviceAccount:{account_email(cfg, identity)}"


def _is(*workloads: Workload) -> Callable[[StackConfig], bool]:
    return lambda cfg: cfg.workload in workloads


_GKE = (Workload.GKE_JOB, Workload.GKE_RAY)
_GCSFS = "trainer/checkpoints.py and trainer/train.py through fsspec/gcsfs (Workload Identity credentials)"
_FUSE = "the Cloud Storage volume at /mnt/bucket (gcsfuse; infra/cloud_run.py CloudRunTraining)"
_OVERWRITE = "overwriting an object needs storage.objects.delete too (Cloud Storage IAM permissions reference)"
_NODE_ROLE_DOC = (
    "GKE docs, 'Use least privilege IAM service accounts': nodes need roles/container.defaultNodeServiceAccount"
)


def _object_read_write(how: str) -> tuple[Need, ...]:
    return (
        Need("storage.objects.list", Scope.BUCKET, f"find the latest checkpoint, prune old ones: {how}"),
        Need("storage.objects.get", Scope.BUCKET, f"resume from a checkpoint: {how}"),
        Need("storage.objects.create", Scope.BUCKET, f"write checkpoints, the adapter/model, the marker: {how}"),
        Need("storage.objects.delete", Scope.BUCKET, f"replace the marker, prune checkpoints: {how}; {_OVERWRITE}"),
    )


# ------------------------------------------------------------------------------------------ CI identities
CI_PREVIEW = "gft-ci-preview"
CI_PREVIEW_GKE = "gft-ci-preview-gke"
CI_DEPLOY = "gft-ci-deploy"
CI_DEPLOY_PREVIEW = "gft-ci-deploy-preview"
_DIY = "the bucket backend (pulumi pkg/backend/diy)"
_STATE_READ = (
    Need("storage.objects.get", Scope.STATE_BUCKET, f"read the stack's checkpoint: {_DIY}"),
    Need("storage.objects.list", Scope.STATE_BUCKET, f"find the stack and its checkpoint: {_DIY}"),
    Need(
        "cloudkms.cryptoKeyVersions.useToDecrypt",
        Scope.STATE_KEY,
        "decrypt the stack's data key (gcpkms:// secrets provider, pulumi pkg/secrets/cloud/manager.go); the data "
        "key then encrypts and decrypts locally, so no KMS encrypt",
    ),
)
_STATE_WRITE = (
    *_STATE_READ,
    Need("storage.objects.create", Scope.STATE_BUCKET, f"write the checkpoint, its history and the lock: {_DIY}"),
    Need("storage.objects.delete", Scope.STATE_BUCKET, f"overwrite the checkpoint, release the lock: {_DIY}"),
)


# A destroy preview locks the stack (diy Destroy locks even with --preview-only) and releases the lock after
_STATE_LOCK = (
    Need("storage.objects.create", Scope.STATE_LOCKS, f"take the stack lock for a destroy preview: {_DIY}"),
    Need("storage.objects.delete", Scope.STATE_LOCKS, f"release the stack lock after a destroy preview: {_DIY}"),
)


def ci_member(account: str) -> Callable[[StackConfig], str]:
    return lambda cfg: f"serviceAccount:{account}@{cfg.project}.iam.gserviceaccount.com"


def _data_reads(cfg: StackConfig) -> list[Need]:
    """The trainer reads the recipe's gs:// data through gcsfs: the objects under the prefix, and lists their
    folder (infra/data_access.py)."""
    how = "trainer/data.py reads data.path / data.image_dir through fsspec/gcsfs as the trainer account"
    needs = []
    for bucket, prefix in data_read_scopes(cfg):
        needs.append(Need("storage.objects.get", Scope.DATA, how, resource=object_resource(bucket, prefix)))
        needs.append(
            Need(
                "storage.objects.list",
                Scope.DATA,
                f"{how}: a glob lists the folder above its first wildcard (fsspec AbstractFileSystem.glob)",
                resource=f"projects/_/buckets/{bucket}",
                list_prefix=list_prefix(prefix),
            )
        )
    return needs


RUNTIMES: tuple[Runtime, ...] = (
    Runtime(
        "trainer on Cloud Run",
        _account(Identity.TRAINER),
        _is(Workload.CLOUD_RUN),
        _object_read_write(_FUSE),
    ),
    Runtime(
        "trainer reading the HF token (Cloud Run)",
        _account(Identity.TRAINER),
        reads_hf_secret,
        (
            Need(
                "secretmanager.versions.access",
                Scope.HF_SECRET,
                "Cloud Run resolves the Job's HF_TOKEN secretKeyRef as the Job's service account "
                "(infra/cloud_run.py; Cloud Run docs, 'Configure secrets')",
            ),
        ),
    ),
    Runtime(
        "trainer on GKE (accelerate Job)",
        _account(Identity.TRAINER),
        _is(Workload.GKE_JOB),
        _object_read_write(_GCSFS),
    ),
    Runtime(
        "trainer under Ray Train (RayJob)",
        _account(Identity.TRAINER),
        _is(Workload.GKE_RAY),
        (
            *_object_read_write(f"{_GCSFS}; Ray Train checkpoints under gs://BUCKET/ray"),
            Need(
                "storage.buckets.get",
                Scope.BUCKET,
                "Ray Train's storage_path gs://… goes through pyarrow.fs.GcsFileSystem, whose create_dir reads "
                "the bucket's metadata first (Arrow cpp/src/arrow/filesystem/gcsfs.cc, CreateDirMarkerRecursive)",
            ),
        ),
    ),
    Runtime(
        "trainer reading the recipe's data in a bucket (gs:// data.path)",
        _account(Identity.TRAINER),
        lambda cfg: bool(data_read_scopes(cfg)),
        configured=_data_reads,
    ),
    Runtime(
        "trainer's Kubernetes service account (Workload Identity)",
        lambda cfg: workload_identity_member(cfg.project, cfg.namespace, TRAINER_KSA),
        _is(*_GKE),
        (
            Need(
                "iam.serviceAccounts.getAccessToken",
                Scope.TRAINER_ACCOUNT,
                "pods of KSA `trainer` act as the trainer account (GKE docs, 'Authenticate to Google Cloud "
                "APIs from GKE workloads': roles/iam.workloadIdentityUser on the Google service account)",
            ),
        ),
    ),
    Runtime(
        "vLLM server (Cloud Run Service)",
        _account(Identity.SERVING),
        lambda cfg: cfg.serving_enabled,
        (
            Need(
                "storage.objects.list",
                Scope.BUCKET,
                "vLLM lists runs/<run>/merged or /adapter on the read-only volume, and the Run:ai streamer lists the "
                "staged base's safetensors under gs://BUCKET/runs/<run>/_base (vllm/transformers_utils/runai_utils.py)",
            ),
            Need(
                "storage.objects.get",
                Scope.BUCKET,
                "vLLM loads the merged model or the adapters from /mnt/models and streams a staged base from gs:// "
                "(infra/serving.py VllmService; serving/entrypoint.sh checks the completion markers)",
            ),
        ),
    ),
    Runtime(
        "vLLM server reading its API key (servingApiKey)",
        _account(Identity.SERVING),
        reads_api_key_secret,
        (
            Need(
                "secretmanager.versions.access",
                Scope.API_KEY_SECRET,
                "Cloud Run resolves the Service's VLLM_API_KEY secretKeyRef as the Service's account "
                "(infra/serving.py VllmService; Cloud Run docs, 'Configure secrets')",
            ),
        ),
    ),
    Runtime(
        "GKE Autopilot nodes",
        _account(Identity.NODES),
        _is(*_GKE),
        (
            Need(
                "logging.logEntries.create",
                Scope.PROJECT,
                f"node and container logs, the trainer's metric lines among them (trainer/metrics_log.py); {_NODE_ROLE_DOC}",
            ),
            Need(
                "monitoring.timeSeries.create",
                Scope.PROJECT,
                f"node and system metrics, and the managed DCGM package's GPU metrics (infra/gke.py "
                "MONITORING_COMPONENTS), which Managed Service for Prometheus' managed collection writes as the node "
                f"account (GKE docs, 'Collect and view DCGM metrics'); {_NODE_ROLE_DOC}",
            ),
            Need("monitoring.metricDescriptors.create", Scope.PROJECT, f"system metric types; {_NODE_ROLE_DOC}"),
            Need(
                "artifactregistry.repositories.downloadArtifacts",
                Scope.REGISTRY,
                "the kubelet pulls the trainer image by digest as the node account (infra/gke_job.py, "
                "infra/ray_job.py; Artifact Registry docs, 'Configure access for GKE')",
            ),
        ),
    ),
    Runtime(
        "Cloud Build builder (imageBuild: cloud-build)",
        _account(Identity.BUILD),
        lambda cfg: cfg.image_build is ImageBuild.CLOUD_BUILD,
        (
            Need(
                "storage.objects.get",
                Scope.BUILD_STAGING,
                "Cloud Build fetches the context archive that `gcloud builds submit --gcs-source-staging-dir` "
                "uploaded (infra/images.py)",
            ),
            Need(
                "artifactregistry.repositories.uploadArtifacts",
                Scope.REGISTRY,
                "cloudbuild.yaml `images:` pushes REGISTRY/<image>:<content hash>",
            ),
            Need(
                "artifactregistry.repositories.downloadArtifacts",
                Scope.REGISTRY,
                "the push asks which layers the repository already has (Docker registry API)",
            ),
            Need(
                "logging.logEntries.create",
                Scope.PROJECT,
                "build logs go to Cloud Logging only (infra/cloudbuild.yaml): a user-specified build account "
                "must write them (Cloud Build docs, 'Configure user-specified service accounts')",
            ),
        ),
    ),
    Runtime(
        f"{CI_PREVIEW}: PR previews of Cloud Run stacks (preview.yml)",
        ci_member(CI_PREVIEW),
        _is(Workload.CLOUD_RUN),
        _STATE_READ,
        preview_needs,
    ),
    Runtime(
        f"{CI_PREVIEW_GKE}: reviewed PR previews of GKE stacks (preview.yml)",
        ci_member(CI_PREVIEW_GKE),
        _is(*_GKE),
        _STATE_READ,
        preview_needs,
    ),
    Runtime(
        f"{CI_DEPLOY_PREVIEW}: deploy.yml's preview of up or destroy (read-only but for the lock)",
        ci_member(CI_DEPLOY_PREVIEW),
        lambda cfg: True,
        (*_STATE_READ, *_STATE_LOCK),
        preview_needs,
    ),
    Runtime(
        f"{CI_DEPLOY}: deploy.yml's approved up and destroy (each previews again first)",
        ci_member(CI_DEPLOY),
        lambda cfg: True,
        _STATE_WRITE,
        deploy_needs,
    ),
)

# ------------------------------------------------------------------------------------------ planned grants
# Planned IAM resources: the kind of target and the input that names it.
_TARGETS: dict[str, tuple[str, str]] = {
    "gcp:storage/bucketIAMMember:BucketIAMMember": ("bucket", "bucket"),
    "gcp:secretmanager/secretIamMember:SecretIamMember": ("secret", "secretId"),
    "gcp:artifactregistry/repositoryIamMember:RepositoryIamMember": ("repository", "repository"),
    "gcp:projects/iAMMember:IAMMember": ("project", "project"),
    "gcp:serviceaccount/iAMMember:IAMMember": ("account", "serviceAccountId"),
}
# Grants to people the stack owner names, not to an identity the stack creates.
GRANTS_TO_PEOPLE = frozenset({"gcp:cloudrunv2/serviceIamMember:ServiceIamMember"})


def planned_grants(run: StackRun, cfg: StackConfig) -> list[Grant]:
    """Every IAM grant the program planned, as (member, role, scope). Fails on an IAM resource type or a
    target this proof does not know, so a new kind of grant cannot slip past it."""
    grants: list[Grant] = []
    for r in run.resources:
        if not r.custom or ("iam" not in r.type.lower()) or r.type in GRANTS_TO_PEOPLE:
            continue
        if r.type not in _TARGETS:
            raise ValueError(f"{r.urn}: IAM resource type {r.type} is unknown to infra/offline/permissions.py")
        kind, key = _TARGETS[r.type]
        inputs = r.plain_inputs()
        scope = scope_of(cfg, kind, str(inputs[key]), r.urn)
        condition = (inputs.get("condition") or {}).get("expression")
        grants.append(
            Grant(member=inputs["member"], role=inputs["role"], scope=scope, origin=r.urn, condition=condition)
        )
    return grants


# ------------------------------------------------------------------------------------------ CI grants
@cache
def ci_identities() -> dict[str, Any]:
    """infra/bootstrap/ci-identities.yaml, parsed."""
    data: dict[str, Any] = yaml.safe_load(CI_IDENTITIES_FILE.read_text())
    return data


def stack_features(cfg: StackConfig) -> frozenset[str]:
    """What the setup reads from a stack file besides its workload (.ci/stacks.py FEATURES): the grants it makes
    for `uses:` entries of ci-identities.yaml."""
    found = set()
    if cfg.capacity is Capacity.RESERVATION:
        found.add("reservation")
    else:  # on GKE the preflight reads this capacity's GPU quota (Cloud Run stacks read theirs whatever capacity says)
        found.add("gpu-quota")
    if cfg.image_build is ImageBuild.CLOUD_BUILD:
        found.add("cloud-build")
    if cfg.billing_account:
        found.add("budget")
    if cfg.alert_emails:
        found.add("alert-emails")
    return frozenset(found)


def ci_grant_applies(identity: str, entry: dict[str, Any], workload: str, features: Iterable[str]) -> bool:
    """Whether the setup makes this grant of ci-identities.yaml for a stack with this workload and these features."""
    spec = ci_identities()["identities"][identity]
    if workload not in spec.get("workloads", [workload]) or workload not in entry.get("workloads", [workload]):
        return False
    return set(entry.get("uses", [])) <= set(features)


def substitute(text: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        text = text.replace("${" + name + "}", value)
    return " ".join(text.split())


_CI_SCOPES = {
    "project": Scope.PROJECT,
    "state-bucket": Scope.STATE_BUCKET,
    "state-key": Scope.STATE_KEY,
    "billing-account": Scope.BILLING_ACCOUNT,
}


def ci_grants(cfg: StackConfig) -> list[Grant]:
    """The grants ci-setup.sh makes to the CI identities for a repository holding only this stack: one per binding
    (two entries that apply to one stack and grant the same role on the same scope are the same binding)."""
    values = {"PROJECT_ID": cfg.project, "PROJECT_NUMBER": MOCK_PROJECT_NUMBER, "STACK": cfg.stack}
    features = stack_features(cfg)
    grants: list[Grant] = []
    for identity, spec in ci_identities()["identities"].items():
        for entry in spec["grants"]:
            if not ci_grant_applies(identity, entry, str(cfg.workload), features):
                continue
            kind = entry["scope"]
            scope = ACCOUNT_SCOPES[Identity(entry["account"])] if kind == "workload-account" else _CI_SCOPES[kind]
            condition = substitute(entry["condition"], values) if entry.get("condition") else None
            member, role = ci_member(identity)(cfg), substitute(entry["role"], values)
            if any((g.member, g.role, g.scope, g.condition) == (member, role, scope, condition) for g in grants):
                continue  # the binding another entry made
            where = f" if {condition}" if condition else ""
            grants.append(
                Grant(
                    member=member,
                    role=role,
                    scope=scope,
                    origin=f"ci-identities.yaml {identity}: {entry['role']} on {kind}{where}",
                    condition=condition,
                )
            )
    return grants


# ------------------------------------------------------------------------------------------ role data
@cache
def role_permissions() -> dict[str, frozenset[str]]:
    """Predefined roles (iam_roles.json) and the setup's custom roles (`gftCi…`, by their short id)."""
    data = json.loads(ROLES_FILE.read_text())
    roles = {role: frozenset(entry["permissions"]) for role, entry in data["roles"].items()}
    for name, spec in ci_identities()["custom_roles"].items():
        roles[name] = frozenset(spec["permissions"])
    return roles


_CUSTOM_ROLE = re.compile(r"projects/[^/]+/roles/(\w+)")


def permissions_of(role: str, origin: str) -> frozenset[str]:
    roles = role_permissions()
    custom = _CUSTOM_ROLE.fullmatch(role)
    key = custom.group(1) if custom else role
    if key not in roles:
        raise KeyError(f"{origin}: role {role} is not in {ROLES_FILE.name} nor a custom role; vendor it (--vendor)")
    return roles[key]


# ------------------------------------------------------------------------------------------ conditions
def resource_name(scope: Scope, cfg: StackConfig) -> str:
    """The name IAM Conditions see for a resource of this scope (`resource.name`)."""
    buckets = {sc: name for (kind, name), sc in scopes(cfg).items() if kind == "bucket"}
    secrets = {sc: name for (kind, name), sc in scopes(cfg).items() if kind == "secret"}
    accounts = {sc: email for (kind, email), sc in scopes(cfg).items() if kind == "account"}
    names = {
        Scope.PROJECT: f"projects/{cfg.project}",
        Scope.RESERVATION_PROJECT: f"projects/{cfg.reservation_project}",
        Scope.STATE_BUCKET: f"projects/_/buckets/{cfg.project}{STATE_BUCKET_SUFFIX}",
        Scope.STATE_KEY: f"projects/{cfg.project}/{STATE_KEY_PATH.format(stack=cfg.stack)}",
        Scope.STATE_LOCKS: f"projects/_/buckets/{cfg.project}{STATE_BUCKET_SUFFIX}{STATE_LOCKS_PREFIX}{cfg.stack}",
        Scope.REGISTRY: f"projects/{cfg.project}/locations/{cfg.region}/repositories/{repository_id(cfg)}",
        **{sc: f"projects/_/buckets/{name}" for sc, name in buckets.items()},
        **{sc: f"projects/{MOCK_PROJECT_NUMBER}/secrets/{name}" for sc, name in secrets.items()},
        **{sc: f"projects/{cfg.project}/serviceAccounts/{email}" for sc, email in accounts.items()},
    }
    if cfg.billing_account:
        names[Scope.BILLING_ACCOUNT] = f"billingAccounts/{cfg.billing_account}"
    return names[scope]


_STARTS_WITH = re.compile(r"resource\.name\.startsWith\('([^']*)'\)")
_LIST_PREFIX = re.compile(
    r"api\.getAttribute\('storage\.googleapis\.com/objectListPrefix', ''\)\.startsWith\('([^']*)'\)"
)
_EQUALS = re.compile(r"resource\.name == '([^']*)'")
_GRANTS_BY_ROLE = re.compile(
    r"api\.getAttribute\('iam\.googleapis\.com/modifiedGrantsByRole', \[\]\)\.hasOnly\(\[([^\]]*)\]\)"
)


def condition_holds(condition: str | None, need: Need, cfg: StackConfig) -> bool:
    """Whether a grant with this IAM Condition applies to the call behind `need`. Two forms only (anything else is
    an error, so a new form cannot pass unexamined):
    - `resource.name.startsWith('…') || resource.name == '…' || …` on the resource's name (IAM Conditions,
      resource attributes);
    - `api.getAttribute('iam.googleapis.com/modifiedGrantsByRole', []).hasOnly([…])`: a policy change may
      modify grants of the listed roles only; a call that changes no grant (a read) gets the default `[]`
      (IAM docs, 'Set limits on granting roles')."""
    if condition is None:
        return True
    text = " ".join(condition.split())
    limited = _GRANTS_BY_ROLE.fullmatch(text)
    if limited:
        return need.grants_roles <= set(re.findall(r"'([^']+)'", limited.group(1)))
    parts = [clause.strip() for clause in text.split("||")]
    names = [_STARTS_WITH.fullmatch(part) or _EQUALS.fullmatch(part) for part in parts]
    listed = [_LIST_PREFIX.fullmatch(part) for part in parts]
    if all(n or p for n, p in zip(names, listed, strict=True)):
        # a list call's listed prefix (absent on any other call: the attribute's default '' applies)
        prefix = need.list_prefix if need.list_prefix is not None else ""
        name = need.resource or resource_name(need.scope, cfg)
        return any(
            name.startswith(n.group(1)) if n.re is _STARTS_WITH else name == n.group(1) for n in names if n
        ) or any(prefix.startswith(p.group(1)) for p in listed if p)
    raise ValueError(
        f"IAM Condition {condition!r} is in no form infra/offline/permissions.py condition_holds evaluates"
    )


_OUTSIDE_THE_PROJECT = (Scope.RESERVATION_PROJECT, Scope.BILLING_ACCOUNT)


def _reaches(grant: Grant, need: Need) -> bool:
    """IAM inheritance: a project grant reaches every resource of the project (not another project's, nor a billing
    account, which sits beside projects in the resource hierarchy)."""
    return (
        grant.scope == need.scope
        or (grant.scope is Scope.PROJECT and need.scope not in _OUTSIDE_THE_PROJECT)
        or (grant.scope is Scope.STATE_BUCKET and need.scope is Scope.STATE_LOCKS)  # objects inherit the bucket's
    )


def covers(grant: Grant, need: Need, cfg: StackConfig) -> bool:
    return (
        _reaches(grant, need)
        and need.permission in permissions_of(grant.role, grant.origin)
        and condition_holds(grant.condition, need, cfg)
    )


# ------------------------------------------------------------------------------------------ the proof
def needs_of(run: StackRun) -> dict[str, list[tuple[Runtime, Need]]]:
    """member -> every (runtime, need) that applies to this stack and variant."""
    cfg = run.cfg
    assert cfg is not None, "a run that validated its configuration"
    found: dict[str, list[tuple[Runtime, Need]]] = {}
    for runtime in RUNTIMES:
        if runtime.applies(cfg):
            needs = [
                *runtime.needs,
                *(runtime.derived(run) if runtime.derived else []),
                *(runtime.configured(cfg) if runtime.configured else []),
            ]
            found.setdefault(runtime.member(cfg), []).extend((runtime, need) for need in needs)
    return found


def missing(run: StackRun, grants: Iterable[Grant]) -> list[str]:
    """Every permission an identity of this stack needs and its grants do not give."""
    assert run.cfg is not None
    cfg = run.cfg
    grants = list(grants)
    problems: list[str] = []
    for member, member_needs in needs_of(run).items():
        mine = [g for g in grants if g.member == member]
        for runtime, need in member_needs:
            if not any(covers(g, need, cfg) for g in mine):
                problems.append(
                    f"{runtime.name} ({member}) lacks {need.permission} on {need.scope}, needed by: {need.why}"
                )
    return problems


def unneeded(runs: Sequence[StackRun], grants: Iterable[Grant]) -> list[str]:
    """Every grant no identity needs in any of these runs (variants a grant is made for alike): to an unknown
    identity; of a role that gives its identity no permission it needs where the grant applies (an
    unconditioned project grant must serve a need on the project itself); or one whose every needed permission
    another grant of the same identity gives too (roles often carry e.g. resourcemanager.projects.get: a role
    granted for that alone is redundant)."""
    assert runs and all(run.cfg is not None for run in runs)
    grants = list(grants)
    needs: dict[str, list[tuple[Need, StackConfig]]] = {}
    for run in runs:
        for member, member_needs in needs_of(run).items():
            needs.setdefault(member, []).extend((need, run.cfg) for _, need in member_needs)  # type: ignore[misc]
    problems: list[str] = []
    for g in grants:
        if g.member not in needs:
            problems.append(f"{g.origin}: {g.role} goes to {g.member}, an identity no runtime of this stack uses")
            continue
        permissions_of(g.role, g.origin)  # an unknown role is an error, not "unneeded"
        broad = g.scope is Scope.PROJECT and g.condition is None
        served = [
            (need, cfg)
            for need, cfg in needs[g.member]
            if covers(g, need, cfg) and (not broad or need.scope is Scope.PROJECT)
        ]
        if not served:
            problems.append(f"{g.origin}: {g.role} on {g.scope} gives {g.member} nothing it needs there")
            continue
        others = [h for h in grants if h.member == g.member and h is not g]
        if all(any(covers(h, need, cfg) for h in others) for need, cfg in served):
            given = sorted({need.permission for need, _ in served})
            problems.append(f"{g.origin}: {g.role} on {g.scope} gives {g.member} only what other grants give: {given}")
    return problems


# Who holds one of these in a GKE stack's cluster can start a pod, or mint a token, as any Kubernetes service account
# there: the trainer's, bound to the trainer's Google account by Workload Identity.
POD_OR_TOKEN = ("container.pods.create", "container.pods.exec", "container.serviceAccounts.createToken")


def fenced_usernames(run: StackRun) -> frozenset[str]:
    """The Kubernetes usernames the program's preview fence keeps to dry runs (infra/admission.py), read from the step
    it declares; empty when it declares none."""
    from infra.admission import FENCE_SCRIPT

    names: set[str] = set()
    for r in run.resources:
        inputs = r.plain_inputs() if r.type == "command:local:Command" else {}
        if inputs.get("create") == FENCE_SCRIPT:
            names.update(str((inputs.get("environment") or {}).get("PREVIEW_USERNAMES", "")).split())
    return frozenset(names)


def borrowed(run: StackRun) -> list[str]:
    """The borrow proof: every CI identity that can start a pod or mint a token in the stack's cluster (and so act as
    the trainer) holds every permission the trainer holds, where it applies, unless the preview fence keeps it to
    dry runs. One line per permission it would borrow."""
    cfg = run.cfg
    assert cfg is not None
    if cfg.workload not in (Workload.GKE_JOB, Workload.GKE_RAY):
        return []
    trainer = f"serviceAccount:{account_email(cfg, Identity.TRAINER)}"
    lent = [g for g in planned_grants(run, cfg) if g.member == trainer]
    fenced = fenced_usernames(run)
    by_member: dict[str, list[Grant]] = {}
    for grant in ci_grants(cfg):
        by_member.setdefault(grant.member, []).append(grant)
    problems = []
    for member, grants in sorted(by_member.items()):
        held = set().union(*(permissions_of(g.role, g.origin) for g in grants))
        if not held & set(POD_OR_TOKEN) or member.removeprefix("serviceAccount:") in fenced:
            continue
        for grant in lent:
            for permission in sorted(permissions_of(grant.role, grant.origin)):
                need = Need(permission, grant.scope, f"the trainer's {grant.role}")
                if not any(covers(g, need, cfg) for g in grants):
                    problems.append(
                        f"{member} can start a pod as the trainer (Workload Identity) and so borrow {permission} on "
                        f"{grant.scope} ({grant.role}), which it does not hold: fence it (infra/admission.py)"
                    )
    return problems


def markdown(runs: Sequence[StackRun] = ()) -> str:
    """The needs table: the listed rows, and for each run the needs derived from its plan."""
    lines = ["| identity | permission | on | needed by |", "|---|---|---|---|"]
    for runtime in RUNTIMES:
        for need in runtime.needs:
            lines.append(f"| {runtime.name} | `{need.permission}` | {need.scope} | {need.why} |")
    for run in runs:
        assert run.cfg is not None
        for runtime in RUNTIMES:
            if (runtime.derived or runtime.configured) and runtime.applies(run.cfg):
                derived = runtime.derived(run) if runtime.derived else []
                for need in [*derived, *(runtime.configured(run.cfg) if runtime.configured else [])]:
                    lines.append(f"| {runtime.name} [{run.stack}] | `{need.permission}` | {need.scope} | {need.why} |")
    return "\n".join(lines)


def granted_roles() -> set[str]:
    """Every predefined role ci-identities.yaml names (the program's are in iam_roles.json already)."""
    return {
        entry["role"]
        for spec in ci_identities()["identities"].values()
        for entry in spec["grants"]
        if entry["role"].startswith("roles/")
    }


def vendor(source: Path, roles: Iterable[str]) -> dict[str, Any]:
    """The subset of a public role-data file (`{"source": …, "roles": {role: {permissions, …}}}`) for `roles`."""
    data = json.loads(source.read_text())
    return {
        "source": data["source"] + "; subset: the roles infra/ and infra/bootstrap/ci-identities.yaml grant or compare",
        "roles": {role: data["roles"][role] for role in sorted(set(roles))},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vendor", type=Path, help="public role data (gcp-iam roles.json) to copy the subset from")
    parser.add_argument("--role", action="append", default=[], help="also vendor this role (repeatable)")
    parser.add_argument("--stack", action="append", default=[], help="derive the CI needs of this stack (default: all)")
    args = parser.parse_args(argv)
    if args.vendor:
        predefined = {role for role in json.loads(ROLES_FILE.read_text())["roles"]}
        subset = vendor(args.vendor, [*predefined, *granted_roles(), *args.role])
        ROLES_FILE.write_text(json.dumps(subset, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(subset['roles'])} roles to {ROLES_FILE}")
        return
    from infra.offline.engine import run_stack, stack_names

    print(markdown([run_stack(stack) for stack in args.stack or stack_names()]))


if __name__ == "__main__":
    main()
