"""The guard rails every stack is checked against, as plain functions over (resource_type, props).

Each check takes a Pulumi type token (`gcp:storage/bucket:Bucket`) and the resource's inputs as the
engine sends them to a policy pack (camelCase keys, secrets unwrapped) and returns its violations as
sentences (empty: the resource passes). `__main__.py` wraps each in a `ResourceValidationPolicy`
(`resource_policies()`); the tests call the functions over every resource of every stack under mocks.

Decisions (the rules table: infra/policy/README.md; why: docs/program.md#the-policy-pack-judges-structure)
- Checks look at structure, not names: any `containers` list must pin images, any `env` list must hold
  no literal credential, any resource asking for a GPU must be bounded by a deadline or a visible label.
- Nothing public but a Cloud Run service the stack made public (`invokerIamDisabled` plus `public: "true"`).
- A labelled run limit is checked from the workload's own nodes, deadline and retries.
- Rules fail closed; values unknown in a preview are judged at `pulumi up`.
Not here: regions, quotas (the stack configuration and preflight check those), Kubernetes RBAC.
"""

from __future__ import annotations

import itertools
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
K8S_POD = "kubernetes:core/v1:Pod"
K8S_CRON_JOB = "kubernetes:batch/v1:CronJob"
K8S_DEPLOYMENT = "kubernetes:apps/v1:Deployment"
K8S_STATEFUL_SET = "kubernetes:apps/v1:StatefulSet"
# JobSet (sigs.k8s.io/jobset): replicatedJobs[].template is a Job template, so each one carries its own deadline.
JOB_SET = "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet"
# Controllers whose pods run until the object is deleted: no deadline field applies, so a GPU one is an
# explicit choice, marked with this label (like `public` on a Cloud Run service).
LONG_RUNNING_LABEL = "gemma-finetune/gpu-long-running"
RAY_CLUSTER = "kubernetes:ray.io/v1:RayCluster"
# Kinds with a field that bounds how long their pods run (the rest are judged as long-running controllers).
DEADLINE_KINDS = frozenset({K8S_JOB, RAY_JOB, K8S_POD, K8S_CRON_JOB, JOB_SET})
CLOUD_RUN_V1_SERVICE = "gcp:cloudrun/service:Service"
INVOKER_IAM_DISABLED_ANNOTATION = "run.googleapis.com/invoker-iam-disabled"
K8S_SERVICE = "kubernetes:core/v1:Service"
# Kubernetes groups and users that stand for everyone (RBAC docs, "Default roles and role bindings"); on GKE every
# Google account authenticates as system:authenticated.
PUBLIC_K8S_SUBJECTS = frozenset({"system:authenticated", "system:unauthenticated", "system:anonymous"})
# Cloud Storage canned ACLs that give everyone (or every Google account) access (JSON API, predefinedAcl).
PUBLIC_PREDEFINED_ACLS = frozenset({"publicRead", "publicReadWrite", "authenticatedRead"})
# GKE's Ingress controller gives every Ingress of class `gce`, or of no class, an external Application Load Balancer;
# only `gce-internal` stays inside the VPC (GKE docs, "GKE Ingress for Application Load Balancers"). Gateway classes
# whose load balancer is external say so in their name (GKE docs, "GatewayClass capabilities": gke-l7-global-external-
# managed, gke-l7-regional-external-managed, gke-l7-gxlb).
INTERNAL_INGRESS_CLASS = "gce-internal"
INGRESS_CLASS_ANNOTATION = "kubernetes.io/ingress.class"
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
# Words that make an env var name a credential (`HF_TOKEN`, `HuggingFaceToken`, `DB_PASSWORD`), and word pairs
# (`HF_API_KEY`, `AWS_ACCESS_KEY_ID`). A lone KEY (`CACHE_KEY`) or CREDENTIALS (a file path) is not one.
SECRET_WORDS = frozenset({"TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "APIKEY"})
SECRET_WORD_PAIRS = frozenset({("API", "KEY"), ("ACCESS", "KEY"), ("PRIVATE", "KEY")})
# A value that only names another variable (`${HF_TOKEN}` for Ray's runtime env, `$(HF_TOKEN)` for Kubernetes)
# carries no secret itself.
ENV_REFERENCE = re.compile(r"^\s*(\$\{[A-Za-z_][A-Za-z0-9_]*\}|\$\([A-Za-z_][A-Za-z0-9_]*\))\s*$")

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
        pairs.extend(parse_policy_data(policy_data)[0])
    return pairs


def parse_policy_data(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """(role, member) pairs of an IAM policy document (`policyData`), and what makes it unreadable.

    The document comes from the program (`gcp.organizations.get_iam_policy`) or from a hand-written
    string, so any JSON may arrive: a list, bindings that are not objects, members that are not strings.
    Whatever can be read is returned; everything else is named, so the rules fail closed instead of
    crashing the pack or passing a policy they could not read.
    """
    try:
        policy = json.loads(text)
    except json.JSONDecodeError as exc:
        return [], [f"is not JSON ({exc.msg} at character {exc.pos})"]
    if not isinstance(policy, dict):
        return [], [f"is a JSON {type(policy).__name__}, not an IAM policy object"]
    bindings = policy.get("bindings") or []
    if not isinstance(bindings, list):
        return [], [f"has bindings of type {type(bindings).__name__}, not a list"]
    pairs: list[tuple[str, str]] = []
    problems: list[str] = []
    for index, binding in enumerate(bindings):
        if not isinstance(binding, dict):
            problems.append(f"has bindings[{index}] of type {type(binding).__name__}, not an object")
            continue
        role = binding.get("role")
        if not isinstance(role, str):
            problems.append(f"has bindings[{index}].role={role!r}, not a role name")
            role = ""
        members = binding.get("members") or []
        if not isinstance(members, list) or not all(isinstance(member, str) for member in members):
            problems.append(f"has bindings[{index}].members={members!r}, not a list of principals")
            members = [member for member in members if isinstance(member, str)] if isinstance(members, list) else []
        pairs.extend((role, member) for member in members or [""])
    return pairs, problems


def policy_data_problems(props: Mapping[str, Any]) -> list[str]:
    """Why an IAM policy resource's `policyData` cannot be read in full (empty when it can, or is unknown)."""
    policy_data = props.get("policyData")
    if policy_data is None or is_unknown(policy_data):
        return []
    if not isinstance(policy_data, str):
        return [f"policyData is a {type(policy_data).__name__}, not a JSON string"]
    return [f"policyData {problem}" for problem in parse_policy_data(policy_data)[1]]


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
    problems = [
        f"basic role {role} is granted; grant a predefined role on the one resource instead "
        "(e.g. roles/storage.objectUser on the bucket)"
        for role in found
    ]
    problems.extend(
        f"{problem}: it cannot be checked for basic roles; pass a document from gcp.organizations.get_iam_policy"
        for problem in policy_data_problems(props)
    )
    return problems


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
        problems.extend(
            f"{problem}: it cannot be checked for public principals; pass a document from "
            "gcp.organizations.get_iam_policy"
            for problem in policy_data_problems(props)
        )
    if resource_type == CLOUD_RUN_SERVICE and props.get("invokerIamDisabled") is True:
        labels = props.get("labels") or {}
        if not isinstance(labels, Mapping) or labels.get(PUBLIC_LABEL) != PUBLIC_LABEL_VALUE:
            problems.append(
                "Cloud Run service has invokerIamDisabled=true (anyone on the internet may call it) without the "
                f'label {PUBLIC_LABEL}="{PUBLIC_LABEL_VALUE}" that marks a public endpoint as an explicit choice; '
                "set servingPublic=true in the stack (the program labels the service), or keep it private"
            )
    if resource_type == CLOUD_RUN_V1_SERVICE:
        annotations = _dig(props, "metadata", "annotations")
        labels = _dig(props, "metadata", "labels")
        disabled = isinstance(annotations, Mapping) and str(annotations.get(INVOKER_IAM_DISABLED_ANNOTATION)) == "true"
        if disabled and (not isinstance(labels, Mapping) or labels.get(PUBLIC_LABEL) != PUBLIC_LABEL_VALUE):
            problems.append(
                f"Cloud Run (v1) service has the annotation {INVOKER_IAM_DISABLED_ANNOTATION}=true (anyone on the "
                f'internet may call it) without the label {PUBLIC_LABEL}="{PUBLIC_LABEL_VALUE}": the same choice '
                "as invokerIamDisabled, allowed on the same terms; keep it private"
            )
    problems.extend(_public_acls(resource_type, props))
    problems.extend(_public_kubernetes(resource_type, props))
    return problems


def _public_acls(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """Cloud Storage ACLs (bucket, object, default object) that name allUsers / allAuthenticatedUsers."""
    if not resource_type.startswith("gcp:storage/"):
        return []
    problems: list[str] = []
    entity = props.get("entity")
    if entity in PUBLIC_MEMBERS:
        problems.append(f"ACL entity {entity} makes objects public: grant named principals IAM roles instead")
    for path, _, value in walk(dict(props)):  # roleEntities: ["READER:allUsers", …]
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and ":" in item and item.rsplit(":", 1)[-1] in PUBLIC_MEMBERS:
                problems.append(f"{path} has {item!r}, access for {item.rsplit(':', 1)[-1]}: remove the ACL entry")
    predefined = props.get("predefinedAcl")
    if predefined in PUBLIC_PREDEFINED_ACLS:
        problems.append(f"predefinedAcl={predefined!r} makes the object or bucket public: leave it unset")
    return problems


def _public_kubernetes(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """RBAC bindings to everyone, and Services that open a public load balancer."""
    kind = resource_type.rsplit(":", 1)[-1]
    problems: list[str] = []
    if resource_type.startswith("kubernetes:rbac.authorization.k8s.io/") and kind.startswith(
        ("RoleBinding", "ClusterRoleBinding")
    ):
        subjects = props.get("subjects")
        for subject in subjects if isinstance(subjects, list) else []:
            if isinstance(subject, Mapping) and subject.get("name") in PUBLIC_K8S_SUBJECTS:
                problems.append(
                    f"{kind} grants its role to {subject.get('kind')} {subject['name']} (on GKE every Google account "
                    "is system:authenticated): bind the service accounts or people who need it"
                )
    if resource_type.startswith("kubernetes:core/v1:Service") and _dig(props, "spec", "type") == "LoadBalancer":
        problems.append(
            "Service of type LoadBalancer opens a public IP to the pods behind it: use ClusterIP (kubectl "
            "port-forward) or serve through Cloud Run, whose invoker IAM is the gate"
        )
    if (
        resource_type.startswith("kubernetes:networking.k8s.io/")
        and kind.startswith("Ingress")
        and kind != "IngressClass"
    ):
        annotations = _dig(props, "metadata", "annotations")
        annotated = annotations.get(INGRESS_CLASS_ANNOTATION) if isinstance(annotations, Mapping) else None
        ingress_class = _dig(props, "spec", "ingressClassName") or annotated
        if not is_unknown(ingress_class) and ingress_class != INTERNAL_INGRESS_CLASS:
            problems.append(
                f"Ingress of class {ingress_class or '(none: GKE takes gce)'} gets an external load balancer, a "
                f"public IP to the pods behind it: use class {INTERNAL_INGRESS_CLASS}, or serve through Cloud Run"
            )
    if resource_type.startswith("kubernetes:gateway.networking.k8s.io/") and kind.startswith("Gateway"):
        gateway_class = _dig(props, "spec", "gatewayClassName")
        if isinstance(gateway_class, str) and ("external" in gateway_class or gateway_class == "gke-l7-gxlb"):
            problems.append(
                f"Gateway of class {gateway_class} gets an external load balancer, a public IP to the routes behind "
                "it: use an internal class (gke-l7-rilb), or serve through Cloud Run"
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
    """A GPU job that hangs must not bill GPUs for ever: every GPU workload has an explicit deadline.

    Where a deadline field applies it must be set: Cloud Run `template.template.timeout`; Job, RayJob
    and Pod `spec.activeDeadlineSeconds`; CronJob `spec.jobTemplate.spec.activeDeadlineSeconds`; JobSet
    each GPU `replicatedJobs[].template.spec.activeDeadlineSeconds`. Every other Kubernetes kind that carries
    a pod spec (Deployment, DaemonSet, RayCluster, any CRD) has no deadline and keeps its GPUs until deleted,
    so one that asks for GPUs must say so with the label `gemma-finetune/gpu-long-running: "true"`.
    """
    if not requests_gpu(props):
        return []
    if resource_type == CLOUD_RUN_JOB:
        timeout = _dig(props, "template", "template", "timeout")
        if is_unknown(timeout) or _seconds(timeout):
            return []
        return [
            f"Cloud Run GPU job has template.template.timeout={timeout!r}: set an explicit task timeout "
            '(e.g. "3600s", from trainingTimeoutMinutes)'
        ]
    kinds = {K8S_JOB: "Kubernetes Job", RAY_JOB: "RayJob", K8S_POD: "Pod"}
    problems: list[str] = []
    if not resource_type.startswith("kubernetes:"):
        return []
    if resource_type in kinds:
        problems.extend(_missing_deadline(kinds[resource_type], props, ("spec", "activeDeadlineSeconds")))
    elif resource_type == K8S_CRON_JOB:
        cron_path = ("spec", "jobTemplate", "spec", "activeDeadlineSeconds")
        problems.extend(_missing_deadline("CronJob", props, cron_path))
    elif resource_type == JOB_SET:
        replicated = _dig(props, "spec", "replicatedJobs")
        for index, job in enumerate(replicated if isinstance(replicated, list) else []):
            if isinstance(job, Mapping) and requests_gpu(job):
                name = job.get("name", index)
                job_path = ("template", "spec", "activeDeadlineSeconds")
                problems.extend(_missing_deadline(f"JobSet replicatedJobs[{index}] ({name})", job, job_path))
    elif resource_type not in DEADLINE_KINDS and carries_pods(props):
        labels = _dig(props, "metadata", "labels")
        if not is_unknown(labels) and (not isinstance(labels, Mapping) or labels.get(LONG_RUNNING_LABEL) != "true"):
            kind = resource_type.rsplit(":", 1)[-1]
            problems.append(
                f"{kind} asking for GPUs has no deadline and holds its GPUs until it is deleted: run training as a "
                f"Job with activeDeadlineSeconds, or mark a deliberate long-running GPU service with the label "
                f'{LONG_RUNNING_LABEL}: "true"'
            )
    if resource_type == RAY_JOB and "rayClusterSpec" in (props.get("spec") or {}):
        shutdown = _dig(props, "spec", "shutdownAfterJobFinishes")
        if shutdown is not True and not is_unknown(shutdown):
            problems.append(
                "RayJob creates its own GPU cluster but spec.shutdownAfterJobFinishes is not true: the cluster "
                "would keep its GPUs after the job ends"
            )
    return problems


def carries_pods(props: Mapping[str, Any]) -> bool:
    """Whether a resource holds a pod spec anywhere (a `containers` list): a pod template of any kind, a CRD's too."""
    return any(key == "containers" and isinstance(value, list) for _, key, value in walk(dict(props)))


def _missing_deadline(kind: str, props: Mapping[str, Any], path: tuple[str, ...]) -> list[str]:
    deadline = _dig(props, *path)
    if is_unknown(deadline) or _seconds(deadline):
        return []
    return [
        f"{kind} asking for GPUs has {'.'.join(path)}={deadline!r}: set a deadline "
        "(from trainingTimeoutMinutes) so a hung run stops billing GPUs"
    ]


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


def _name_words(name: str) -> list[str]:
    """`HuggingFaceToken` -> HUGGING, FACE, TOKEN; `HF_API_KEY` -> HF, API, KEY; `HFToken` -> HF, TOKEN."""
    spaced = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", spaced)
    return [word for word in re.split(r"[^A-Za-z0-9]+", spaced.upper()) if word]


def is_secret_name(name: Any) -> bool:
    """HF_TOKEN, HuggingFaceToken, HF_API_KEY, DB_PASSWORD…: a credential's name; not TOKENIZERS_PARALLELISM."""
    if not isinstance(name, str):
        return False
    words = _name_words(name)
    return any(word in SECRET_WORDS for word in words) or any(
        pair in SECRET_WORD_PAIRS for pair in itertools.pairwise(words)
    )


def _is_literal(value: Any) -> bool:
    """A value written into the resource itself: not empty, not unknown, not a reference to another variable."""
    if value is None or value == "" or is_unknown(value):
        return False
    return not (isinstance(value, str) and ENV_REFERENCE.match(value))


def tokens_only_from_secrets(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A credential reaches a container only through a secret reference, never as a literal env value."""
    problems: list[str] = []
    for path, key, value in walk(dict(props)):
        if key in ENV_LISTS and isinstance(value, list):
            for index, entry in enumerate(value):
                if isinstance(entry, dict) and is_secret_name(entry.get("name")) and _is_literal(entry.get("value")):
                    problems.append(
                        f"{path}[{index}] sets {entry['name']} to a literal value: read it from a secret "
                        "(Kubernetes valueFrom.secretKeyRef, Cloud Run valueSource.secretKeyRef)"
                    )
        elif key == "runtimeEnvYAML" and isinstance(value, str) and not is_unknown(value):
            problems.extend(_runtime_env_tokens(path, value))
    return problems


def _runtime_env_tokens(path: str, text: str) -> list[str]:
    """A RayJob's runtime env (YAML in a string) must not carry a credential in env_vars."""
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
        if is_secret_name(name) and _is_literal(value)
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


# Kept equal to infra/cost.py NODE_RELEASE_S (GKE nodes outlive their Pods until scale-down); tests/policy checks it.
NODE_RELEASE_S = 600
# Kept equal to infra/pricing.py GKE_CLUSTER_FEE_CENTS (the GKE cluster management fee per hour); tests/policy checks it.
GKE_CLUSTER_FEE_CENTS = 10
NODE_HOUR_CENTS = "node-hour-cents"
MAX_RUN_COST = "max-run-cost-usd"
K8S_COST_PREFIX = "gemma-finetune/"
# Cloud Run's own defaults when a field is left out (Cloud Run jobs reference: 3 retries, a 10 minute task timeout).
CLOUD_RUN_DEFAULT_RETRIES = 3
CLOUD_RUN_DEFAULT_TIMEOUT_S = 600


@dataclass(frozen=True)
class CeilingParts:
    """What a workload's own fields say about its most expensive run."""

    nodes: int
    deadline_s: float
    tail_s: float
    attempts: int
    fee_cents: int = 0
    """Per hour on top of the nodes: the GKE cluster management fee (none on Cloud Run)."""

    def usd(self, cents: int) -> float:
        return round(
            (cents * self.nodes + self.fee_cents) * self.attempts * (self.deadline_s + self.tail_s) / 3600 / 100, 2
        )

    def explain(self, cents: int) -> str:
        per_hour = f"${cents / 100:,.2f}/h x {self.nodes}"
        if self.fee_cents:
            per_hour = f"({per_hour} + ${self.fee_cents / 100:,.2f}/h cluster fee)"
        return (
            f"{per_hour} x ({self.deadline_s:.0f} s deadline + {self.tail_s:.0f} s release) x {self.attempts} "
            "attempt(s)"
        )


def _cost_labels(resource_type: str, props: Mapping[str, Any]) -> Mapping[str, Any] | None:
    labels = props.get("labels") if resource_type == CLOUD_RUN_JOB else _dig(props, "metadata", "labels")
    return labels if isinstance(labels, Mapping) else None


def _label(labels: Mapping[str, Any], resource_type: str, key: str) -> Any:
    return labels.get(key if resource_type == CLOUD_RUN_JOB else K8S_COST_PREFIX + key)


def _int(value: Any, default: int) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


def ceiling_parts(resource_type: str, props: Mapping[str, Any]) -> CeilingParts | str:
    """The nodes, deadline, tail and attempts of a training workload, or why they cannot be read."""
    if resource_type == K8S_JOB:
        deadline = _seconds(_dig(props, "spec", "activeDeadlineSeconds"))
        nodes = _int(_dig(props, "spec", "parallelism"), 1)
        if not deadline:
            return "spec.activeDeadlineSeconds is not set"
        return CeilingParts(nodes, deadline, NODE_RELEASE_S, 1, GKE_CLUSTER_FEE_CENTS)
    if resource_type == RAY_JOB:
        spec = props.get("spec") or {}
        if "rayClusterSpec" not in spec:
            return "it runs on a standing RayCluster, which has no deadline"
        deadline = _seconds(spec.get("activeDeadlineSeconds"))
        if not deadline:
            return "spec.activeDeadlineSeconds is not set"
        groups = _dig(props, "spec", "rayClusterSpec", "workerGroupSpecs") or []
        nodes = sum(
            max(_int(g.get("replicas"), 0), _int(g.get("maxReplicas"), 0))
            for g in groups
            if isinstance(g, Mapping) and requests_gpu(g)
        )
        ttl = _int(spec.get("ttlSecondsAfterFinished"), 0) if spec.get("shutdownAfterJobFinishes") is True else 0
        attempts = _int(spec.get("backoffLimit"), 0) + 1
        return CeilingParts(nodes, deadline, NODE_RELEASE_S + ttl, attempts, GKE_CLUSTER_FEE_CENTS)
    if resource_type == CLOUD_RUN_JOB:
        template = props.get("template") or {}
        task = template.get("template") or {}
        deadline = _seconds(task.get("timeout")) or CLOUD_RUN_DEFAULT_TIMEOUT_S
        retries = _int(task.get("maxRetries"), CLOUD_RUN_DEFAULT_RETRIES)
        return CeilingParts(_int(template.get("taskCount"), 1), deadline, 0, retries + 1)
    return f"{resource_type} is not a training workload with a deadline"


def run_cost_within_limit(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A training workload labelled `max-run-cost-usd` cannot cost more than that in one run."""
    if resource_type not in (K8S_JOB, RAY_JOB, RAY_CLUSTER, CLOUD_RUN_JOB):
        return []
    labels = _cost_labels(resource_type, props)
    if labels is None:
        return []
    limit = _label(labels, resource_type, MAX_RUN_COST)
    if limit is None or is_unknown(limit):
        return []
    if not str(limit).isdigit():
        return [f"label {MAX_RUN_COST}={limit!r} is not whole US dollars (maxRunCostUsd)"]
    if resource_type == RAY_CLUSTER:
        return [
            f"a standing RayCluster has no deadline, so it cannot stay within {MAX_RUN_COST}={limit}: run training "
            "as an ephemeral RayJob (rayCluster: ephemeral), or remove maxRunCostUsd"
        ]
    price = _label(labels, resource_type, NODE_HOUR_CENTS)
    if price is None or is_unknown(price) or not str(price).isdigit():
        return [
            f"{MAX_RUN_COST}={limit} cannot be checked: the label {NODE_HOUR_CENTS} (the hourly price the program takes "
            f"from infra/pricing.py) is {price!r}; set trainingHourPriceUsd for hardware the table lacks"
        ]
    parts = ceiling_parts(resource_type, props)
    if isinstance(parts, str):
        return [f"{MAX_RUN_COST}={limit} cannot be checked: {parts}"]
    usd = parts.usd(int(price))
    if usd <= int(limit):
        return []
    return [
        f"one run can cost {usd:,.2f} USD ({parts.explain(int(price))}), above {MAX_RUN_COST}={limit} (maxRunCostUsd): "
        "lower trainingTimeoutMinutes, nodes or trainingRetries, choose cheaper capacity, or raise maxRunCostUsd"
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
        "No allUsers/allAuthenticatedUsers (IAM or Cloud Storage ACLs), no Kubernetes binding to system:authenticated "
        "or system:unauthenticated, no LoadBalancer Service, external Ingress or Gateway; a public Cloud Run service (v2 invokerIamDisabled, v1 "
        "invoker-iam-disabled annotation) only with the public=true label.",
        no_public_principals,
    ),
    GuardRail("private-buckets", "Buckets use uniform access and enforce public access prevention.", bucket_is_private),
    GuardRail(
        "gpu-workload-deadlines",
        "Every GPU workload (Cloud Run Job; Kubernetes Job, CronJob, JobSet, Pod, RayJob) has an explicit deadline; "
        "any other kind that runs GPU pods (Deployment, StatefulSet, DaemonSet, ReplicaSet, RayCluster, RayService, "
        "LeaderWorkerSet, …) is labelled as a deliberate long-running service.",
        gpu_workloads_have_deadlines,
    ),
    GuardRail("images-pinned-by-digest", "Every container image is pinned by sha256 digest.", images_pinned_by_digest),
    GuardRail(
        "tokens-from-secrets",
        "Credentials (HF_TOKEN, HuggingFaceToken, HF_API_KEY, …) reach containers only through secret references.",
        tokens_only_from_secrets,
    ),
    GuardRail(
        "required-labels",
        "Buckets, registries, secrets, clusters and Cloud Run jobs/services carry app/stack/workload labels.",
        required_labels,
    ),
    GuardRail(
        "run-cost-within-limit",
        "A training workload labelled max-run-cost-usd cannot cost more in one run (price label x its own nodes, "
        "deadline and retries).",
        run_cost_within_limit,
    ),
    GuardRail(
        "workload-known-at-preview",
        "A training workload's spec is known in a preview, so the other rules can check it.",
        workload_known_at_preview,
        enforcement=ADVISORY,
    ),
)


def run_check(rail: GuardRail, resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """One rail's violations; a check that raises on input nobody foresaw fails closed with a violation.

    An exception inside a policy would stop the whole pack (every preview fails with a stack trace and
    no other rule runs); a violation names the resource and the rule, and a mandatory rule still blocks.
    """
    try:
        return rail.check(resource_type, props)
    except Exception as exc:  # any crash becomes a violation on purpose
        return [f"{rail.name} could not check this {resource_type} ({type(exc).__name__}: {exc}); fix the resource"]


def violations(resource_type: str, props: Mapping[str, Any]) -> dict[str, list[str]]:
    """Every guard rail's violations for one resource, by policy name (only the failing ones)."""
    plain = to_plain(props)
    found = {rail.name: run_check(rail, resource_type, plain) for rail in GUARD_RAILS}
    return {name: problems for name, problems in found.items() if problems}


def resource_policies() -> list[Any]:
    """The guard rails as `ResourceValidationPolicy` objects (imported here so the checks need no engine)."""
    from pulumi_policy import EnforcementLevel, ReportViolation, ResourceValidationArgs, ResourceValidationPolicy

    def wrap(rail: GuardRail) -> ResourceValidationPolicy:
        def validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
            for problem in run_check(rail, args.resource_type, to_plain(args.props)):
                report_violation(problem, None)  # the engine names the resource

        return ResourceValidationPolicy(
            name=rail.name,
            description=rail.description,
            validate=validate,
            enforcement_level=EnforcementLevel(rail.enforcement),
        )

    return [wrap(rail) for rail in GUARD_RAILS]
