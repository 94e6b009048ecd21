"""The guard rails every stack is checked against, as plain functions over (resource_type, props).

Each check takes a Pulumi resource type token (`gcp:storage/bucket:Bucket`) and the resource's
inputs as the engine sends them to a policy pack (camelCase keys, secrets already unwrapped) and
returns the violations it found as sentences; an empty list means the resource passes. `__main__.py`
wraps each one in a `ResourceValidationPolicy` (`resource_policies()`); the tests call the
functions directly over every resource of every stack run under mocks, and through the wrappers.

Decisions
- Checks look at structure, not at module names, where that is safer: every `containers` /
  `initContainers` list anywhere in a resource is a set of containers whose images must be pinned
  (Cloud Run job and service templates, Kubernetes pod templates, RayJob/RayCluster head, worker
  and submitter templates alike); every `env` / `envs` list is checked for literal tokens.
- Values the engine does not know yet during `pulumi preview` (a digest of an image built in the
  same update, an email of a service account created with it) are skipped: they are checked again
  at `pulumi up`, when the engine knows them. Known values are always judged.
- A Cloud Run service may be public only by `invokerIamDisabled: true` AND the label
  `public: "true"` on the service, which the program sets exactly when the stack says
  `servingPublic: true`: the label makes the choice visible (`gcloud run services list
  --filter=labels.public=true`) and turns an accidental flag into a violation. An `allUsers` /
  `allAuthenticatedUsers` IAM member is never allowed, on any resource.
- "GPU workload" means a Cloud Run job, Kubernetes Job or RayJob that asks for a GPU
  (`nvidia.com/gpu` in a resource list, a GKE accelerator nodeSelector, a Cloud Run accelerator).
  Each must carry an explicit deadline (Cloud Run's implicit 10 minute default is not a decision),
  and a RayJob that creates its own cluster must also delete it when the job ends.
- A standing RayCluster (`rayCluster: standing`) is an explicit choice for interactive use and has
  no deadline field; it is checked for pinned images only.
- A workload whose whole spec is unknown in a preview hides it from every rule above, so the
  `workload-known-at-preview` rule reports it, as an advisory (the rules run again at `pulumi up`).
  The program keeps it from happening: workload names derive from the images' content hash, and
  only the image digest is left unknown, as a leaf.

Not here: cost limits, regions, quotas (the stack configuration validates those), Kubernetes RBAC.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

# Kept in step with infra/catalog.py (BASIC_ROLES, PUBLIC_MEMBERS); the pack runs without the program's
# package on its path, so it carries its own copy and tests/policy checks that the two agree.
BASIC_ROLES = frozenset({"roles/owner", "roles/editor", "roles/viewer"})
PUBLIC_MEMBERS = frozenset({"allUsers", "allAuthenticatedUsers"})
REQUIRED_LABELS = ("app", "stack", "workload")
PUBLIC_LABEL = "public"
PUBLIC_LABEL_VALUE = "true"

BUCKET = "gcp:storage/bucket:Bucket"
CLOUD_RUN_JOB = "gcp:cloudrunv2/job:Job"
CLOUD_RUN_SERVICE = "gcp:cloudrunv2/service:Service"
K8S_JOB = "kubernetes:batch/v1:Job"
RAY_JOB = "kubernetes:ray.io/v1:RayJob"
RAY_CLUSTER = "kubernetes:ray.io/v1:RayCluster"
# Where each workload keeps what the rules read; an unknown value at any of these hides the workload.
WORKLOAD_FIELDS: dict[str, tuple[tuple[str, ...], ...]] = {
    CLOUD_RUN_JOB: (("template",), ("template", "template")),
    K8S_JOB: (("metadata",), ("spec",), ("spec", "template")),
    RAY_JOB: (("metadata",), ("spec",), ("spec", "rayClusterSpec")),
    RAY_CLUSTER: (("metadata",), ("spec",)),
}
# GCP resources that carry labels here, and the input that holds them.
LABELLED: dict[str, str] = {
    BUCKET: "labels",
    "gcp:artifactregistry/repository:Repository": "labels",
    "gcp:secretmanager/secret:Secret": "labels",
    CLOUD_RUN_JOB: "labels",
    CLOUD_RUN_SERVICE: "labels",
    "gcp:container/cluster:Cluster": "resourceLabels",
}

GPU_RESOURCE = "nvidia.com/gpu"
GKE_ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"
DIGEST_RE = re.compile(r"@sha256:[0-9a-f]{64}$")
CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")
ENV_LISTS = ("env", "envs")

# Sentinels the engine puts in place of values it does not know during preview (pulumi_policy.proxy).
UNKNOWN_VALUES = frozenset(
    {
        "1c4a061d-8072-4f0a-a4cb-0ff528b18fe7",  # boolean
        "3eeb2bf0-c639-47a8-9e75-3b44932eb421",  # number
        "04da6b54-80e4-46f7-96ec-b56ff0331ba9",  # string
        "6a19a0b0-7e62-4c92-b797-7f8e31da9cc2",  # array
        "030794c1-ac77-496b-92df-f27374a8bd58",  # asset
        "e48ece36-62e2-4504-bad9-02848725956a",  # archive
        "dd056dcd-154b-4c76-9bd3-c8f88648b5ff",  # object
    }
)

Check = Callable[[str, Mapping[str, Any]], list[str]]


# --- helpers -----------------------------------------------------------------------------


def is_unknown(value: Any) -> bool:
    """True for a value the engine cannot know during preview."""
    return isinstance(value, str) and value in UNKNOWN_VALUES


def to_plain(value: Any) -> Any:
    """Plain dicts and lists from the engine's proxies, without tripping on unknown values.

    The engine wraps props in proxies that raise on reading an unknown value; the checks want to
    see the sentinel and decide themselves (skip it), so the proxies' targets are read directly.
    """
    if isinstance(value, Mapping):
        target = _proxy_target(value)
        return {key: to_plain(item) for key, item in target.items()}
    if isinstance(value, list | tuple) or type(value).__name__ == "_ListProxy":
        target = _proxy_target(value)
        return [to_plain(item) for item in target]
    return value


def _proxy_target(value: Any) -> Any:
    if type(value).__name__ in ("_DictProxy", "_ListProxy"):
        return value["__target"]
    return value


def walk(value: Any, path: str = "") -> Iterator[tuple[str, str, Any]]:
    """Every (path, key, value) in a nested structure of dicts and lists, depth first."""
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            yield here, str(key), item
            yield from walk(item, here)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from walk(item, f"{path}[{index}]")


def iam_members(props: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(role, member) pairs of an IAM member / binding / policy resource; unknown members are left out."""
    pairs: list[tuple[str, str]] = []
    role = props.get("role")
    role_text = role if isinstance(role, str) and not is_unknown(role) else ""
    member = props.get("member")
    if isinstance(member, str) and not is_unknown(member):
        pairs.append((role_text, member))
    members = props.get("members")
    if isinstance(members, list):
        pairs.extend((role_text, m) for m in members if isinstance(m, str) and not is_unknown(m))
    if role_text and not pairs:
        pairs.append((role_text, ""))
    policy_data = props.get("policyData")
    if isinstance(policy_data, str) and not is_unknown(policy_data):
        try:
            policy = json.loads(policy_data)
        except json.JSONDecodeError:
            policy = {}
        for binding in policy.get("bindings", []) if isinstance(policy, dict) else []:
            binding_role = str(binding.get("role", ""))
            for binding_member in binding.get("members", []) or [""]:
                pairs.append((binding_role, str(binding_member)))
    return pairs


def is_iam_resource(resource_type: str) -> bool:
    """IAM member, binding and policy resources of any provider module (`…IAMMember`, `…IamBinding`, …)."""
    kind = resource_type.rsplit(":", 1)[-1].lower()
    return "iam" in kind and kind.endswith(("member", "binding", "policy"))


def requests_gpu(props: Mapping[str, Any]) -> bool:
    """A workload that asks for a GPU: `nvidia.com/gpu` in resources, a GKE or Cloud Run accelerator selector."""
    for path, key, value in walk(dict(props)):
        if key == GPU_RESOURCE and str(value) not in ("0", "0.0", ""):
            return True
        if key == GKE_ACCELERATOR_LABEL:
            return True
        if key == "accelerator" and path.endswith("nodeSelector.accelerator") and value:
            return True
    return False


def _seconds(value: Any) -> float | None:
    """A positive duration from a number or a Cloud Run duration string ("3600s"); None otherwise."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value) if value > 0 else None
    if isinstance(value, str):
        match = re.fullmatch(r"(\d+(?:\.\d+)?)s?", value.strip())
        if match and float(match.group(1)) > 0:
            return float(match.group(1))
    return None


def _dig(props: Mapping[str, Any], *keys: str) -> Any:
    value: Any = props
    for key in keys:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


# --- the checks --------------------------------------------------------------------------


def no_basic_roles(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """roles/owner, roles/editor and roles/viewer grant far more than any workload needs."""
    if not is_iam_resource(resource_type):
        return []
    found = sorted({role for role, _ in iam_members(props) if role in BASIC_ROLES})
    return [
        f"basic role {role} is granted; grant a predefined role on the one resource instead "
        "(e.g. roles/storage.objectUser on the bucket)"
        for role in found
    ]


def no_public_principals(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """No allUsers / allAuthenticatedUsers anywhere; a public Cloud Run service only by explicit choice."""
    problems: list[str] = []
    if is_iam_resource(resource_type):
        public = sorted({member for _, member in iam_members(props) if member in PUBLIC_MEMBERS})
        problems.extend(
            f"public principal {member} is granted a role; name the principals who need access "
            "(a public vLLM service is chosen with servingPublic=true, never with an IAM member)"
            for member in public
        )
    if resource_type == CLOUD_RUN_SERVICE and props.get("invokerIamDisabled") is True:
        labels = props.get("labels") or {}
        if not isinstance(labels, Mapping) or labels.get(PUBLIC_LABEL) != PUBLIC_LABEL_VALUE:
            problems.append(
                "Cloud Run service has invokerIamDisabled=true (anyone on the internet may call it) without the "
                f'label {PUBLIC_LABEL}="{PUBLIC_LABEL_VALUE}" that marks a public endpoint as an explicit choice; '
                "set servingPublic=true in the stack (the program labels the service), or keep it private"
            )
    return problems


def bucket_is_private(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """Buckets use uniform bucket-level access and enforce public access prevention."""
    if resource_type != BUCKET:
        return []
    problems: list[str] = []
    uniform = props.get("uniformBucketLevelAccess")
    if uniform is not True and not is_unknown(uniform):
        problems.append(
            f"bucket has uniformBucketLevelAccess={uniform!r}: set uniform_bucket_level_access=True "
            "(no per-object ACLs)"
        )
    prevention = props.get("publicAccessPrevention")
    if prevention != "enforced" and not is_unknown(prevention):
        problems.append(f'bucket has publicAccessPrevention={prevention!r}: set public_access_prevention="enforced"')
    return problems


def gpu_workloads_have_deadlines(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A GPU job that hangs must not bill GPUs for ever: every GPU workload has an explicit deadline."""
    if resource_type not in (CLOUD_RUN_JOB, K8S_JOB, RAY_JOB) or not requests_gpu(props):
        return []
    if resource_type == CLOUD_RUN_JOB:
        timeout = _dig(props, "template", "template", "timeout")
        if is_unknown(timeout) or _seconds(timeout):
            return []
        return [
            f"Cloud Run GPU job has template.template.timeout={timeout!r}: set an explicit task timeout "
            '(e.g. "3600s", from trainingTimeoutMinutes)'
        ]
    deadline = _dig(props, "spec", "activeDeadlineSeconds")
    problems: list[str] = []
    if not is_unknown(deadline) and not _seconds(deadline):
        kind = "Kubernetes Job" if resource_type == K8S_JOB else "RayJob"
        problems.append(
            f"{kind} asking for GPUs has spec.activeDeadlineSeconds={deadline!r}: set a deadline "
            "(from trainingTimeoutMinutes) so a hung run stops billing GPUs"
        )
    if resource_type == RAY_JOB and "rayClusterSpec" in (props.get("spec") or {}):
        shutdown = _dig(props, "spec", "shutdownAfterJobFinishes")
        if shutdown is not True and not is_unknown(shutdown):
            problems.append(
                "RayJob creates its own GPU cluster but spec.shutdownAfterJobFinishes is not true: the cluster "
                "would keep its GPUs after the job ends"
            )
    return problems


def images_pinned_by_digest(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """Every container image is `…@sha256:<64 hex>`: a tag can move under a running stack."""
    problems: list[str] = []
    for path, key, value in walk(dict(props)):
        if key not in CONTAINER_LISTS or not isinstance(value, list):
            continue
        for index, container in enumerate(value):
            if not isinstance(container, dict):
                continue
            image = container.get("image")
            if is_unknown(image):
                continue
            if not isinstance(image, str) or not DIGEST_RE.search(image):
                problems.append(
                    f"{path}[{index}].image={image!r} is not pinned by digest: use REGISTRY/NAME@sha256:<digest> "
                    "(the images component hands out digests)"
                )
    return problems


def _token_name(name: Any) -> bool:
    """HF_TOKEN, HUGGING_FACE_HUB_TOKEN, GITHUB_TOKEN…: a `TOKEN` word, not TOKENIZERS_PARALLELISM."""
    return isinstance(name, str) and "TOKEN" in name.upper().replace("-", "_").split("_")


def tokens_only_from_secrets(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A token reaches a container only through a secret reference, never as a literal env value."""
    problems: list[str] = []
    for path, key, value in walk(dict(props)):
        if key in ENV_LISTS and isinstance(value, list):
            for index, entry in enumerate(value):
                if isinstance(entry, dict) and _token_name(entry.get("name")) and entry.get("value") not in (None, ""):
                    problems.append(
                        f"{path}[{index}] sets {entry['name']} to a literal value: read it from a secret "
                        "(Kubernetes valueFrom.secretKeyRef, Cloud Run valueSource.secretKeyRef)"
                    )
        elif key == "runtimeEnvYAML" and isinstance(value, str) and not is_unknown(value):
            problems.extend(_runtime_env_tokens(path, value))
    return problems


def _runtime_env_tokens(path: str, text: str) -> list[str]:
    """A RayJob's runtime env (YAML in a string) must not carry a token in env_vars."""
    try:
        runtime_env = yaml.safe_load(text)
    except yaml.YAMLError:
        return [f"{path} is not valid YAML"]
    env_vars = runtime_env.get("env_vars") if isinstance(runtime_env, dict) else None
    if not isinstance(env_vars, dict):
        return []
    return [
        f"{path} env_vars sets {name} to a literal value: pods read it from the Kubernetes Secret instead"
        for name, value in env_vars.items()
        if _token_name(name) and value not in (None, "")
    ]


def workload_known_at_preview(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A workload whose spec the engine cannot know yet escapes the deadline, digest and token rules."""
    unknown = [
        ".".join(path)
        for path in WORKLOAD_FIELDS.get(resource_type, ())
        if path[0] in props and is_unknown(_dig(props, *path))
    ]
    if not unknown:
        return []
    return [
        f"{', '.join(unknown)} unknown in this preview, so the deadline, image-digest and token rules could not "
        "check this workload (they run again at `pulumi up`); derive workload names and specs from values "
        "known at preview (the images' content hash), and leave only the image digest unknown"
    ]


def required_labels(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """Labelled GCP resources carry app, stack and workload, so cost and ownership are attributable."""
    field_name = LABELLED.get(resource_type)
    if field_name is None:
        return []
    labels = props.get(field_name)
    if is_unknown(labels):
        return []
    present = labels if isinstance(labels, Mapping) else {}
    missing = [key for key in REQUIRED_LABELS if not present.get(key)]
    if not missing:
        return []
    return [
        f"{field_name} lack {', '.join(missing)} (required: {', '.join(REQUIRED_LABELS)}); "
        "the program sets them from StackConfig.resource_labels"
    ]


# --- the pack's policies -----------------------------------------------------------------


MANDATORY = "mandatory"
ADVISORY = "advisory"


@dataclass(frozen=True)
class GuardRail:
    """One policy: its name in the pack, what it protects, the check, and whether it blocks (mandatory)."""

    name: str
    description: str
    check: Check
    enforcement: str = MANDATORY


GUARD_RAILS: tuple[GuardRail, ...] = (
    GuardRail("no-basic-roles", "No roles/owner, roles/editor or roles/viewer in any IAM resource.", no_basic_roles),
    GuardRail(
        "no-public-principals",
        "No allUsers/allAuthenticatedUsers; a public Cloud Run service only with the public=true label.",
        no_public_principals,
    ),
    GuardRail("private-buckets", "Buckets use uniform access and enforce public access prevention.", bucket_is_private),
    GuardRail(
        "gpu-workload-deadlines",
        "Every GPU job (Cloud Run Job, Kubernetes Job, RayJob) has an explicit deadline.",
        gpu_workloads_have_deadlines,
    ),
    GuardRail("images-pinned-by-digest", "Every container image is pinned by sha256 digest.", images_pinned_by_digest),
    GuardRail(
        "tokens-from-secrets",
        "Tokens (HF_TOKEN, …) reach containers only through secret references.",
        tokens_only_from_secrets,
    ),
    GuardRail(
        "required-labels",
        "Buckets, registries, secrets, clusters and Cloud Run jobs/services carry app/stack/workload labels.",
        required_labels,
    ),
    GuardRail(
        "workload-known-at-preview",
        "A training workload's spec is known in a preview, so the other rules can check it.",
        workload_known_at_preview,
        enforcement=ADVISORY,
    ),
)


def violations(resource_type: str, props: Mapping[str, Any]) -> dict[str, list[str]]:
    """Every guard rail's violations for one resource, by policy name (only the failing ones)."""
    plain = to_plain(props)
    found = {rail.name: rail.check(resource_type, plain) for rail in GUARD_RAILS}
    return {name: problems for name, problems in found.items() if problems}


def resource_policies() -> list[Any]:
    """The guard rails as `ResourceValidationPolicy` objects (imported here so the checks need no engine)."""
    from pulumi_policy import EnforcementLevel, ReportViolation, ResourceValidationArgs, ResourceValidationPolicy

    def wrap(rail: GuardRail) -> ResourceValidationPolicy:
        def validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
            for problem in rail.check(args.resource_type, to_plain(args.props)):
                report_violation(problem, None)  # the engine names the resource

        return ResourceValidationPolicy(
            name=rail.name,
            description=rail.description,
            validate=validate,
            enforcement_level=EnforcementLevel(rail.enforcement),
        )

    return [wrap(rail) for rail in GUARD_RAILS]
