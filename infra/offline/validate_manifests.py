"""`python -m infra.offline.validate_manifests`: plan every stack offline, then validate every manifest strictly.

    .venv/bin/python -m infra.offline.validate_manifests                  # make plan for every stack, then validate
    .venv/bin/python -m infra.offline.validate_manifests --no-plan        # validate what build/plan already holds
    .venv/bin/python -m infra.offline.validate_manifests --files x.yaml   # validate these files only

`make lint` runs the first form. Built-in kinds are checked against kubernetes-validate's strict schemas
for `KUBERNETES_VERSION`; KubeRay kinds against infra/offline/schemas/kuberay.schema.json, KubeRay's own
admission rules (`kuberay_rule_errors`) and each pod template as a Pod; a kind with no schema is
reported as skipped. Every error is listed with its path; a value redacted to "[secret]" is reported,
not failed; integral floats are warnings. Why: docs/program.md#offline-every-manifest-validated-strictly.
Not here: server-side admission (Autopilot's own rules), policy checks (infra/policy does those).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import referencing
import yaml
from referencing.jsonschema import DRAFT202012

KUBERNETES_VERSION = "1.33"
REPO_ROOT = Path(__file__).resolve().parents[2]
PLAN_ROOT = REPO_ROOT / "build" / "plan"
KUBERAY_SCHEMA = REPO_ROOT / "infra" / "offline" / "schemas" / "kuberay.schema.json"
SECRET_MARK = "[secret]"


@dataclass
class Outcome:
    """What validating one YAML document found."""

    where: str
    status: str  # "valid" | "invalid" | "skipped"
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _schema_dir() -> Path:
    package = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    return package / f"v{KUBERNETES_VERSION}.0-local-strict"


def _definitions() -> dict[str, Any]:
    return json.loads((_schema_dir() / "_definitions.json").read_text())


def builtin_schema_file(api_version: str, kind: str) -> Path:
    """kubernetes-validate's file name for a kind: `batch/v1 Job` -> job-batch-v1.json, `v1 Pod` -> pod-v1.json."""
    group, _, version = api_version.rpartition("/")
    group = group.split(".", 1)[0]
    suffix = f"{group}-{version}" if group else version
    return _schema_dir() / f"{kind.lower()}-{suffix}.json"


@cache
def builtin_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator | None:
    """A strict validator for a built-in kind, or None when kubernetes-validate has no schema for it."""
    path = builtin_schema_file(api_version, kind)
    if not path.exists():
        return None
    schema = json.loads(path.read_text())
    registry: referencing.Registry = referencing.Registry()
    registry = DRAFT202012.create_resource(schema) @ registry
    registry = DRAFT202012.create_resource(_definitions()) @ registry
    return jsonschema.Draft202012Validator(schema, registry=registry)


@cache
def kuberay_validator(kind: str) -> jsonschema.protocols.Validator | None:
    """A validator for RayJob / RayCluster from the GKE stack's schema, or None when there is none for `kind`."""
    if not KUBERAY_SCHEMA.exists():
        return None
    schema = json.loads(KUBERAY_SCHEMA.read_text())
    if kind not in schema.get("$defs", {}):
        return None
    definitions = _definitions()
    registry: referencing.Registry = referencing.Registry().with_resources(
        [
            (definitions["$id"], DRAFT202012.create_resource(definitions)),
            (schema["$id"], DRAFT202012.create_resource(schema)),
        ]
    )
    root = {"$schema": schema["$schema"], "$ref": f"{schema['$id']}#/$defs/{kind}"}
    return jsonschema.Draft202012Validator(root, registry=registry)


def _path(error: jsonschema.ValidationError) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path) or "."


def schema_errors(validator: jsonschema.protocols.Validator, obj: Any, prefix: str = "") -> tuple[list[str], list[str]]:
    """(errors, notes): every schema error with its path; errors on redacted values become notes."""
    errors: list[str] = []
    notes: list[str] = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        where = f"{prefix}{_path(error)}"
        if error.instance == SECRET_MARK:
            notes.append(f"{where} is redacted by make plan: not validated")
        else:
            errors.append(f"{where}: {error.message}")
    return errors, notes


def ray_pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every pod template inside a RayJob / RayCluster, with where it sits."""
    spec = obj.get("spec") or {}
    cluster = spec.get("rayClusterSpec", {}) if obj.get("kind") == "RayJob" else spec
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(cluster.get("headGroupSpec"), dict) and "template" in cluster["headGroupSpec"]:
        found.append(("spec.rayClusterSpec.headGroupSpec.template", cluster["headGroupSpec"]["template"]))
    for index, group in enumerate(cluster.get("workerGroupSpecs") or []):
        if isinstance(group, dict) and "template" in group:
            found.append((f"spec.rayClusterSpec.workerGroupSpecs[{index}].template", group["template"]))
    if isinstance(spec.get("submitterPodTemplate"), dict):
        found.append(("spec.submitterPodTemplate", spec["submitterPodTemplate"]))
    if obj.get("kind") == "RayCluster":
        found = [(where.replace("spec.rayClusterSpec.", "spec."), template) for where, template in found]
    return found


# KubeRay's own admission rules (ray-operator/controllers/ray/utils/validation.go: ValidateRayJobMetadata,
# ValidateRayJobSpec, validateDeletionConfiguration, ValidateRayClusterMetadata, ValidateRayClusterSpec), which the
# operator applies when it reconciles and the CRD schema does not express. Ported from v1.7.0; each rule names the
# first release that has it. The GKE add-on ships v1.1 to v1.5 (GKE 1.29 to 1.35, the table in
# https://cloud.google.com/kubernetes-engine/docs/add-on/ray-on-gke/how-to/enable-ray-on-gke) and moves with the
# cluster's minor version on its release channel, so a manifest must pass the newest rules too. Rules on fields
# the schema above refuses anyway (GCS fault tolerance, auth, TLS, network policy, history server) are left out.
KUBERAY_RULES_VERSION = "v1.7.0"
MAX_RAY_CLUSTER_NAME = 53  # utils/constant.go MaxRayClusterNameLength; a RayJob's is 6 shorter (its cluster's suffix)
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _dns1035_errors(kind: str, name: str, limit: int) -> list[str]:
    errors = []
    if len(name) > limit:
        errors.append(f"metadata.name: {kind} name should be no more than {limit} characters (v1.4)")
    if len(name) > 63 or not _DNS1035.match(name):
        errors.append(f"metadata.name: {kind} name should be a valid DNS1035 label (v1.4)")
    return errors


def _env_value(container: dict[str, Any], name: str) -> str | None:
    for env in container.get("env") or []:
        if isinstance(env, dict) and env.get("name") == name:
            return str(env.get("value", ""))
    return None


def kuberay_cluster_spec_errors(spec: dict[str, Any], where: str) -> list[str]:
    """validation.go ValidateRayClusterSpec, for the fields this schema allows."""
    errors: list[str] = []
    head = spec.get("headGroupSpec") or {}
    head_containers = ((head.get("template") or {}).get("spec") or {}).get("containers") or []
    if not head_containers:
        errors.append(f"{where}.headGroupSpec: headGroupSpec should have at least one container (v1.3)")
    autoscaling = bool(spec.get("enableInTreeAutoscaling"))
    groups = [("Head", head)] + [(str(g.get("groupName", "?")), g) for g in spec.get("workerGroupSpecs") or []]
    for index, (name, group) in enumerate(groups):
        at = f"{where}.headGroupSpec" if index == 0 else f"{where}.workerGroupSpecs[{index - 1}]"
        params = group.get("rayStartParams") or {}
        if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) and group.get("resources"):
            errors.append(f"{at}: resource fields should not be set in both rayStartParams and Resources (v1.5)")
        if "labels" in params:
            errors.append(f"{at}.rayStartParams.labels: not supported, use the group's labels field (v1.5)")
        if index == 0:
            continue
        containers = ((group.get("template") or {}).get("spec") or {}).get("containers") or []
        if not containers:
            errors.append(f"{at}: workerGroupSpec should have at least one container (v1.3)")
        low, high = group.get("minReplicas"), group.get("maxReplicas")
        if not autoscaling and (low is None or high is None):
            errors.append(
                f"{at}: worker group {name} must set both minReplicas and maxReplicas when autoscaling is disabled (v1.6)"
            )
        for key, value in (("minReplicas", low), ("maxReplicas", high)):
            if value is not None and value < 0:
                errors.append(f"{at}.{key}: worker group {name} has negative {key} {value} (v1.6)")
        if low is not None and high is not None and low > high:
            errors.append(f"{at}: worker group {name} has minReplicas {low} greater than maxReplicas {high} (v1.1)")
        # an operator flag: alpha and off in v1.5, beta and on from v1.6 (features.go); GKE's managed operator
        # publishes neither its version nor its flags, so it is taken as off
        if group.get("suspend"):
            errors.append(
                f"{at}.suspend: worker group {name} can be suspended only when the RayJobDeletionPolicy feature gate "
                "is enabled (v1.3)"
            )
        if autoscaling and group.get("suspend"):
            errors.append(f"{at}.suspend: worker group {name} cannot be suspended with Autoscaler enabled (v1.4)")
    if head_containers:
        ray_head = head_containers[0]
        if _env_value(ray_head, "RAY_REDIS_ADDRESS") is not None:
            errors.append(
                f"{where}: RAY_REDIS_ADDRESS on the head enables GCS fault tolerance without its options (v1.1)"
            )
        if (head.get("rayStartParams") or {}).get("redis-username") or _env_value(ray_head, "REDIS_USERNAME"):
            errors.append(f"{where}: cannot set a redis username in rayStartParams or the environment (v1.3)")
        if not autoscaling and _env_value(ray_head, "RAY_ENABLE_AUTOSCALER_V2") in {"1", "true"}:
            errors.append(
                f"{where}: RAY_ENABLE_AUTOSCALER_V2 cannot be on when enableInTreeAutoscaling is false (v1.4)"
            )
    return errors


def kuberay_rule_errors(obj: dict[str, Any]) -> list[str]:
    """KubeRay's RayJob / RayCluster admission rules (`KUBERAY_RULES_VERSION`), each error with the release
    that introduced the rule; [] for another kind."""
    kind, name = obj.get("kind"), str((obj.get("metadata") or {}).get("name", ""))
    spec = obj.get("spec") or {}
    if kind == "RayCluster":
        return _dns1035_errors("RayCluster", name, MAX_RAY_CLUSTER_NAME) + kuberay_cluster_spec_errors(spec, "spec")
    if kind != "RayJob":
        return []
    errors = _dns1035_errors("RayJob", name, MAX_RAY_CLUSTER_NAME - 6)
    shutdown, suspend = bool(spec.get("shutdownAfterJobFinishes")), bool(spec.get("suspend"))
    ttl, backoff = spec.get("ttlSecondsAfterFinished", 0), spec.get("backoffLimit")
    mode, selector = spec.get("submissionMode", "K8sJobMode"), spec.get("clusterSelector") or {}
    if suspend and not shutdown:
        errors.append("spec.suspend: a RayJob with shutdownAfterJobFinishes false cannot be suspended (v1.1)")
    if ttl < 0:
        errors.append("spec.ttlSecondsAfterFinished: must be a non-negative integer (v1.4)")
    if not shutdown and ttl > 0:
        errors.append(
            "spec.ttlSecondsAfterFinished: a RayJob with shutdownAfterJobFinishes false cannot have one (v1.4)"
        )
    if selector:
        if suspend:
            errors.append("spec.clusterSelector: the ClusterSelector mode does not support suspend (v1.1)")
        if not selector.get("ray.io/cluster"):
            errors.append("spec.clusterSelector: cluster name (ray.io/cluster) should not be empty (v1.5)")
        if mode == "SidecarMode":
            errors.append("spec.clusterSelector: not supported in SidecarMode (v1.5)")
        if backoff is not None and backoff > 0:
            errors.append(
                "spec.backoffLimit: BackoffLimit is incompatible with ClusterSelector mode (v1.6, kuberay PR #4527)"
            )
    elif spec.get("rayClusterSpec") is None:
        errors.append("spec: one of rayClusterSpec or clusterSelector must be set (v1.1)")
    if mode == "InteractiveMode" and backoff is not None and backoff > 0:
        errors.append("spec.backoffLimit: BackoffLimit is incompatible with InteractiveMode (v1.4)")
    if mode == "SidecarMode" and (spec.get("submitterPodTemplate") or spec.get("submitterConfig")):
        errors.append("spec: SidecarMode supports neither submitterPodTemplate nor submitterConfig (v1.5)")
    if isinstance(spec.get("rayClusterSpec"), dict):
        errors += kuberay_cluster_spec_errors(spec["rayClusterSpec"], "spec.rayClusterSpec")
    if spec.get("runtimeEnvYAML"):
        try:
            yaml.safe_load(spec["runtimeEnvYAML"])
        except yaml.YAMLError as exc:
            errors.append(f"spec.runtimeEnvYAML: not valid YAML: {exc} (v1.3)")
    for key, since in (("activeDeadlineSeconds", "v1.3"), ("preRunningDeadlineSeconds", "v1.6")):
        if spec.get(key) is not None and spec[key] <= 0:
            errors.append(f"spec.{key}: must be a positive integer ({since})")
    if backoff is not None and backoff < 0:
        errors.append("spec.backoffLimit: must not be negative (v1.2)")
    return errors


def integral_floats(value: Any, path: str = "") -> Iterator[str]:
    """Paths of numbers written as floats that are whole (28800.0)."""
    if isinstance(value, float) and value.is_integer():
        yield path or "."
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from integral_floats(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from integral_floats(item, f"{path}[{index}]")


def validate_document(obj: Any, where: str) -> Outcome:
    """One manifest: strict schema for its kind, pod templates of Ray kinds, or skipped when no schema exists."""
    if not isinstance(obj, dict) or not obj.get("apiVersion") or not obj.get("kind"):
        return Outcome(where, "invalid", ["not a Kubernetes object (apiVersion and kind are required)"])
    api_version, kind = str(obj["apiVersion"]), str(obj["kind"])
    name = (obj.get("metadata") or {}).get("name", "?")
    where = f"{where} {kind}/{name}"
    outcome = Outcome(where, "valid")
    floats = list(integral_floats(obj))
    if floats:
        outcome.notes.append(f"warning: {len(floats)} whole number(s) written as floats, e.g. {floats[0]}")
    if api_version.startswith("ray.io/"):
        validator = kuberay_validator(kind)
        if validator is None:
            return Outcome(
                where, "skipped", notes=[f"no schema for {api_version} {kind} ({KUBERAY_SCHEMA.name} absent)"]
            )
        errors, notes = schema_errors(validator, obj)
        errors += [f"KubeRay {KUBERAY_RULES_VERSION} rule: {e}" for e in kuberay_rule_errors(obj)]
        outcome.notes.append(
            f"{KUBERAY_SCHEMA.relative_to(REPO_ROOT)} + KubeRay {KUBERAY_RULES_VERSION} rules + strict pod templates"
        )
        pod_validator = builtin_validator("v1", "Pod")
        assert pod_validator is not None, "kubernetes-validate always has v1 Pod"
        for template_path, template in ray_pod_templates(obj):
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"{name}-pod", **(template.get("metadata") or {})},
                "spec": template.get("spec"),
            }
            pod_errors, pod_notes = schema_errors(pod_validator, pod, prefix=f"{template_path}(as Pod)")
            errors += pod_errors
            notes += pod_notes
    else:
        validator = builtin_validator(api_version, kind)
        if validator is None:
            return Outcome(
                where, "skipped", notes=[f"no schema for {api_version} {kind} in Kubernetes {KUBERNETES_VERSION}"]
            )
        errors, notes = schema_errors(validator, obj)
        outcome.notes.append(f"Kubernetes {KUBERNETES_VERSION} strict")
    outcome.errors, outcome.notes = errors, outcome.notes + notes
    outcome.status = "invalid" if errors else "valid"
    return outcome


def validate_file(path: Path, root: Path | None = None) -> list[Outcome]:
    """Every YAML document in one file."""
    shown = str(path.relative_to(root)) if root and path.is_relative_to(root) else str(path)
    try:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as exc:
        return [Outcome(shown, "invalid", [f"not valid YAML: {exc}"])]
    return [validate_document(doc, shown if len(documents) == 1 else f"{shown}#{i}") for i, doc in enumerate(documents)]


# Variants whose manifests differ in kind or shape from every stack file's: planned and validated too, each
# into out_root/<folder>/ (folder -> stack, overrides).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "ray-gemma3-vision+standing": ("ray-gemma3-vision", {"rayCluster": "standing"}),
}


def plan_all(out_root: Path) -> list[str]:
    """`make plan` for every stack file and every `VARIANTS` entry, into out_root/<stack or variant>/ (the same
    runner, the same files); returns the folders."""
    import dataclasses

    from infra.offline.engine import run_stack, stack_names
    from infra.offline.plan import write_plan

    stacks = stack_names()
    for stack in stacks:
        write_plan(run_stack(stack), out_root)
    for folder, (stack, overrides) in VARIANTS.items():
        write_plan(dataclasses.replace(run_stack(stack, overrides=overrides), stack=folder), out_root)
    return stacks + list(VARIANTS)


def manifest_files(out_root: Path, stacks: list[str] | None = None) -> list[Path]:
    """The manifests of `stacks` (all planned stacks when None; a stale folder of a removed stack is ignored)."""
    folders = [out_root / stack for stack in stacks] if stacks is not None else sorted(out_root.glob("*"))
    return sorted(path for folder in folders for path in (folder / "manifests").glob("*.y*ml"))


def report(outcomes: list[Outcome]) -> int:
    """Print one line per document (and its errors/notes); 1 when any document is invalid."""
    for outcome in outcomes:
        print(
            f"{outcome.status.upper():8} {outcome.where}" + (f"  ({'; '.join(outcome.notes)})" if outcome.notes else "")
        )
        for error in outcome.errors:
            print(f"           {error}")
    counts = {status: sum(o.status == status for o in outcomes) for status in ("valid", "invalid", "skipped")}
    print(f"manifests: {counts['valid']} valid, {counts['invalid']} invalid, {counts['skipped']} skipped (no schema)")
    return 1 if counts["invalid"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=PLAN_ROOT, help="where the plans are written (build/plan)")
    parser.add_argument("--no-plan", action="store_true", help="validate the manifests already under --out")
    parser.add_argument("--files", type=Path, nargs="+", help="validate these YAML files only (no plan)")
    args = parser.parse_args(argv)
    if args.files:
        files = list(args.files)
    else:
        stacks = None
        if not args.no_plan:
            stacks = plan_all(args.out)
            print(f"planned {len(stacks)} stacks and variants under mocks into {args.out}: {', '.join(stacks)}")
        files = manifest_files(args.out, stacks)
    outcomes = [outcome for path in files for outcome in validate_file(path, args.out)]
    if not outcomes:
        print("no manifests found (no stack declares Kubernetes objects)")
    return report(outcomes)


if __name__ == "__main__":
    sys.exit(main())
