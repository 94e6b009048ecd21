"""`python -m infra.validate_manifests`: plan every stack offline, then validate every manifest strictly.

    .venv/bin/python -m infra.validate_manifests                  # make plan for every stack, then validate
    .venv/bin/python -m infra.validate_manifests --no-plan        # validate what build/plan already holds
    .venv/bin/python -m infra.validate_manifests --files x.yaml   # validate these files only

`make lint` runs the first form. Each stack is planned under mocks exactly as `make plan` does
(infra/plan.py), into `build/plan/<stack>/manifests/`, and every YAML document there is checked:

- built-in kinds against the Kubernetes OpenAPI schemas bundled with kubernetes-validate, strict
  (an unknown or misspelt field fails), for `KUBERNETES_VERSION` (the GKE REGULAR channel's minor);
- KubeRay kinds (`ray.io/*`) against `infra/schemas/kuberay.schema.json` when that file exists,
  and each of their pod templates strictly as the Pod it becomes;
- any kind with no schema is reported as skipped, by name, never passed silently.

Decisions
- Every error of a document is listed (not only the first), with its path in the object.
- `make plan` redacts secret values to "[secret]", which can replace a whole field (a Secret's
  `stringData`). An error whose value is exactly that mark is reported as "redacted, not
  validated" instead of failing: the file deliberately hides the field's shape.
- Integral floats (`activeDeadlineSeconds: 28800.0`, from Pulumi's wire format) pass the JSON
  schema but are listed as a warning: `kubectl apply -f` of such a file may be refused by a typed
  decoder, so infra/plan.py should write them as integers.

Not here: server-side admission (Autopilot's own rules), policy checks (infra/policy does those).
"""

from __future__ import annotations

import argparse
import json
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
REPO_ROOT = Path(__file__).resolve().parents[1]
PLAN_ROOT = REPO_ROOT / "build" / "plan"
KUBERAY_SCHEMA = REPO_ROOT / "infra" / "schemas" / "kuberay.schema.json"
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
        outcome.notes.append(f"{KUBERAY_SCHEMA.relative_to(REPO_ROOT)} + strict pod templates")
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


def plan_all(out_root: Path) -> list[str]:
    """`make plan` for every stack file, into out_root/<stack>/ (the same runner, the same files)."""
    from infra.offline import run_stack, stack_names
    from infra.plan import write_plan

    stacks = stack_names()
    for stack in stacks:
        write_plan(run_stack(stack), out_root)
    return stacks


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
            print(f"planned {len(stacks)} stacks under mocks into {args.out}: {', '.join(stacks)}")
        files = manifest_files(args.out, stacks)
    outcomes = [outcome for path in files for outcome in validate_file(path, args.out)]
    if not outcomes:
        print("no manifests found (no stack declares Kubernetes objects)")
    return report(outcomes)


if __name__ == "__main__":
    sys.exit(main())
