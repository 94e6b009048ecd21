"""What each identity the stacks create needs at run time, and the role data that proves its grants cover it.

    .venv/bin/python -m pytest tests/infra/test_permissions.py   # the proof, every stack and variant
    .venv/bin/python -m infra.permissions                         # this table as Markdown
    .venv/bin/python -m infra.permissions --vendor ROLES.json     # refresh iam_roles.json from public role data

The proof runs the program under mocks, collects the IAM grants it plans (`planned_grants`), expands
every granted role into its permissions (`iam_roles.json`, a vendored subset of public role data with
its source line) and checks, for each identity:
- every permission `RUNTIMES` lists is granted on the resource it is needed on, or on the project;
- every granted role gives that identity at least one permission `RUNTIMES` lists on that resource.

Decisions
- A runtime is one identity in one role (the trainer on Cloud Run, under accelerate on GKE, under
  Ray; vLLM; the GKE nodes; the Cloud Build builder; the trainer's Kubernetes service account), with
  the stacks it exists in (`applies`) and its needs. Each need names the code path or document that
  makes the call. Scopes are symbolic (`Scope`) and resolve to resource names through the naming
  functions `infra.foundation` itself uses.
- Roles come from data, never from their names: `iam_roles.json` is copied from public role data
  (iann0036/iam-dataset, see its `source`); `--vendor` refreshes it from a newer copy.
- More identities, e.g. the CI service accounts `gft-ci-preview` and `gft-ci-deploy`: add a `Runtime`
  per identity (its member and needs, each with the command that needs it) and feed the grants that
  are made outside the program (the CI setup script's) to `missing` / `unneeded` as extra `Grant`s
  next to `planned_grants(...)`; a `Scope` for each new kind of target (e.g. the state bucket).

Not here: grants to people (`servingInvokers` get roles/run.invoker on the service: the stack owner
chooses them), Google-managed service agents (Cloud Run's pulls images of the same project), and what
the identity running `pulumi up` needs (the CI identities above, once their rows exist).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Any

from infra.config import ImageBuild, StackConfig, Workload
from infra.foundation import (
    Identity,
    account_email,
    bucket_name,
    hf_secret_id,
    reads_hf_secret,
    repository_id,
    staging_bucket_name,
)
from infra.gke_workload import TRAINER_KSA, workload_identity_member
from infra.offline import StackRun

ROLES_FILE = Path(__file__).with_name("iam_roles.json")


class Scope(StrEnum):
    """Where a permission is needed (or a role granted)."""

    PROJECT = "the project"
    BUCKET = "the stack's bucket"
    BUILD_STAGING = "the build staging bucket"
    HF_SECRET = "the HF token secret"
    REGISTRY = "the image repository"
    TRAINER_ACCOUNT = "the trainer's service account"


@dataclass(frozen=True)
class Need:
    permission: str
    scope: Scope
    why: str
    """The code path or document that makes the call."""


@dataclass(frozen=True)
class Runtime:
    name: str
    member: Callable[[StackConfig], str]
    applies: Callable[[StackConfig], bool]
    needs: tuple[Need, ...]


@dataclass(frozen=True)
class Grant:
    member: str
    role: str
    scope: Scope
    origin: str
    """Where the grant comes from (a planned resource's URN, a setup script line)."""


def _account(identity: Identity) -> Callable[[StackConfig], str]:
    return lambda cfg: f"serviceAccount:{account_email(cfg, identity)}"


def _is(*workloads: Workload) -> Callable[[StackConfig], bool]:
    return lambda cfg: cfg.workload in workloads


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
                "the bucket's metadata first (Arrow cpp/src/arrow/filesystem/gcsfs.cc; CLOUD-FACTS §11)",
            ),
        ),
    ),
    Runtime(
        "trainer's Kubernetes service account (Workload Identity)",
        lambda cfg: workload_identity_member(cfg.project, cfg.namespace, TRAINER_KSA),
        _is(Workload.GKE_JOB, Workload.GKE_RAY),
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
            Need("storage.objects.list", Scope.BUCKET, "vLLM lists runs/<run>/merged on the read-only volume"),
            Need(
                "storage.objects.get",
                Scope.BUCKET,
                "vLLM loads the merged model from /mnt/models (infra/cloud_run.py VllmService; "
                "serving/entrypoint.sh checks the completion marker)",
            ),
        ),
    ),
    Runtime(
        "GKE Autopilot nodes",
        _account(Identity.NODES),
        _is(Workload.GKE_JOB, Workload.GKE_RAY),
        (
            Need("logging.logEntries.create", Scope.PROJECT, f"node and container logs; {_NODE_ROLE_DOC}"),
            Need("monitoring.timeSeries.create", Scope.PROJECT, f"node and system metrics; {_NODE_ROLE_DOC}"),
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
)

# Planned IAM resources: the input that names the target and the kind of target it is.
_TARGETS: dict[str, tuple[str, str]] = {
    "gcp:storage/bucketIAMMember:BucketIAMMember": ("bucket", "bucket"),
    "gcp:secretmanager/secretIamMember:SecretIamMember": ("secret", "secretId"),
    "gcp:artifactregistry/repositoryIamMember:RepositoryIamMember": ("repository", "repository"),
    "gcp:projects/iAMMember:IAMMember": ("project", "project"),
    "gcp:serviceaccount/iAMMember:IAMMember": ("serviceAccount", "serviceAccountId"),
}
# Grants to people the stack owner names, not to an identity the stack creates.
GRANTS_TO_PEOPLE = frozenset({"gcp:cloudrunv2/serviceIamMember:ServiceIamMember"})


def _scopes(cfg: StackConfig) -> dict[tuple[str, str], Scope]:
    trainer = account_email(cfg, Identity.TRAINER)
    return {
        ("bucket", bucket_name(cfg)): Scope.BUCKET,
        ("bucket", staging_bucket_name(cfg)): Scope.BUILD_STAGING,
        ("secret", hf_secret_id(cfg)): Scope.HF_SECRET,
        ("repository", repository_id(cfg)): Scope.REGISTRY,
        ("project", cfg.project): Scope.PROJECT,
        ("serviceAccount", f"projects/{cfg.project}/serviceAccounts/{trainer}"): Scope.TRAINER_ACCOUNT,
    }


def planned_grants(run: StackRun, cfg: StackConfig) -> list[Grant]:
    """Every IAM grant the program planned, as (member, role, scope). Fails on an IAM resource type or a
    target this proof does not know, so a new kind of grant cannot slip past it."""
    scopes = _scopes(cfg)
    grants: list[Grant] = []
    for r in run.resources:
        if not r.custom or ("iam" not in r.type.lower()) or r.type in GRANTS_TO_PEOPLE:
            continue
        if r.type not in _TARGETS:
            raise ValueError(f"{r.urn}: IAM resource type {r.type} is unknown to infra/permissions.py")
        kind, key = _TARGETS[r.type]
        inputs = r.plain_inputs()
        target = (kind, str(inputs[key]))
        if target not in scopes:
            raise ValueError(f"{r.urn}: grants on {kind} {target[1]!r}, which is none of {sorted(scopes.values())}")
        grants.append(Grant(member=inputs["member"], role=inputs["role"], scope=scopes[target], origin=r.urn))
    return grants


@cache
def role_permissions() -> dict[str, frozenset[str]]:
    data = json.loads(ROLES_FILE.read_text())
    return {role: frozenset(entry["permissions"]) for role, entry in data["roles"].items()}


def needs_of(cfg: StackConfig) -> dict[str, list[tuple[Runtime, Need]]]:
    """member -> every (runtime, need) that applies to this stack."""
    found: dict[str, list[tuple[Runtime, Need]]] = {}
    for runtime in RUNTIMES:
        if runtime.applies(cfg):
            found.setdefault(runtime.member(cfg), []).extend((runtime, need) for need in runtime.needs)
    return found


def effective(grants: Iterable[Grant], member: str, scope: Scope) -> set[str]:
    """What `member` may do on `scope`: its roles there plus its project-level roles (IAM inheritance)."""
    roles = role_permissions()
    perms: set[str] = set()
    for g in grants:
        if g.member == member and g.scope in (scope, Scope.PROJECT):
            if g.role not in roles:
                raise KeyError(f"{g.origin}: role {g.role} is not in {ROLES_FILE.name}; vendor it (--vendor)")
            perms |= roles[g.role]
    return perms


def missing(cfg: StackConfig, grants: list[Grant]) -> list[str]:
    """Every permission a runtime of this stack needs and its identity's grants do not give."""
    problems: list[str] = []
    for member, member_needs in needs_of(cfg).items():
        for runtime, need in member_needs:
            if need.permission not in effective(grants, member, need.scope):
                problems.append(
                    f"{runtime.name} ({member}) lacks {need.permission} on {need.scope}, needed by: {need.why}"
                )
    return problems


def unneeded(cfg: StackConfig, grants: list[Grant]) -> list[str]:
    """Every grant no runtime of this stack needs: to an unknown identity, or of a role that gives its
    identity no permission the table lists on that resource."""
    problems: list[str] = []
    needs = needs_of(cfg)
    roles = role_permissions()
    for g in grants:
        if g.member not in needs:
            problems.append(f"{g.origin}: {g.role} goes to {g.member}, an identity no runtime of this stack uses")
        elif g.role not in roles:
            problems.append(f"{g.origin}: role {g.role} is not in {ROLES_FILE.name}; vendor it (--vendor)")
        elif not {n.permission for _, n in needs[g.member] if n.scope == g.scope} & roles[g.role]:
            problems.append(f"{g.origin}: {g.role} on {g.scope} gives {g.member} nothing it needs there")
    return problems


def markdown() -> str:
    lines = ["| identity | permission | on | needed by |", "|---|---|---|---|"]
    for runtime in RUNTIMES:
        for need in runtime.needs:
            lines.append(f"| {runtime.name} | `{need.permission}` | {need.scope} | {need.why} |")
    return "\n".join(lines)


def vendor(source: Path, roles: Iterable[str]) -> dict[str, Any]:
    """The subset of a public role-data file (`{"source": …, "roles": {role: {permissions, …}}}`) for `roles`."""
    data = json.loads(source.read_text())
    return {
        "source": data["source"] + "; subset: the roles infra/ grants or compares",
        "roles": {role: data["roles"][role] for role in sorted(set(roles))},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vendor", type=Path, help="public role data (gcp-iam roles.json) to copy the subset from")
    parser.add_argument("--role", action="append", default=[], help="also vendor this role (repeatable)")
    args = parser.parse_args(argv)
    if args.vendor:
        subset = vendor(args.vendor, [*role_permissions(), *args.role])
        ROLES_FILE.write_text(json.dumps(subset, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(subset['roles'])} roles to {ROLES_FILE}")
        return
    print(markdown())


if __name__ == "__main__":
    main()
