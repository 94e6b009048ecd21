"""Strict schema checks for the Kubernetes objects the GKE stacks declare.

Built-in kinds are validated with `kubernetes_validate` (the Kubernetes 1.33 OpenAPI schemas,
strict: unknown fields fail). KubeRay's CRDs are on no registry, so `infra/offline/schemas/kuberay.schema.json`
describes the RayJob / RayCluster fields we use and `$ref`s the PodTemplateSpec bundled in
kubernetes_validate; every pod template is also validated strictly as a Pod.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import referencing
from referencing.jsonschema import DRAFT202012

from infra.offline.engine import REPO_ROOT, Recorded

KUBERNETES_VERSION = "1.33"
KUBERAY_SCHEMA = REPO_ROOT / "infra" / "offline" / "schemas" / "kuberay.schema.json"


def _integral(value: Any) -> Any:
    """Pulumi's wire format turns integers into floats; give them back as ints."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


def manifest(resource: Recorded) -> dict[str, Any]:
    """The object a `kubernetes:*` resource applies, secrets unwrapped (for validation only, never written)."""
    _, group_version, kind = resource.type.split(":")
    body = _integral(resource.plain_inputs())
    obj = {"apiVersion": body.pop("apiVersion", group_version.removeprefix("core/")), "kind": body.pop("kind", kind)}
    obj.update(body)
    return obj


def k8s_resources(resources: list[Recorded]) -> list[Recorded]:
    return [r for r in resources if r.type.startswith("kubernetes:") and not r.type.startswith("pulumi:providers:")]


def validate_builtin(obj: dict[str, Any]) -> None:
    """Raise if a built-in kind does not match the Kubernetes schema (strict)."""
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def validate_pod_template(template: dict[str, Any], name: str = "pod") -> None:
    """A PodTemplateSpec, validated strictly as the Pod it becomes."""
    metadata = {"name": name, **template.get("metadata", {})}
    validate_builtin({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]})


def _schema_dir() -> Path:
    package = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    return package / f"v{KUBERNETES_VERSION}.0-local-strict"


@cache
def kuberay_validator(kind: str) -> jsonschema.protocols.Validator:
    """A validator for `RayJob` or `RayCluster` whose PodTemplateSpec refs resolve to kubernetes_validate's
    bundled (strict) definitions, registered under their own `$id`."""
    definitions = json.loads((_schema_dir() / "_definitions.json").read_text())
    schema = json.loads(KUBERAY_SCHEMA.read_text())
    registry: referencing.Registry = referencing.Registry().with_resources(
        [
            (definitions["$id"], DRAFT202012.create_resource(definitions)),
            (schema["$id"], DRAFT202012.create_resource(schema)),
        ]
    )
    root = {"$schema": schema["$schema"], "$ref": f"{schema['$id']}#/$defs/{kind}"}
    return jsonschema.Draft202012Validator(root, registry=registry)


def validate_kuberay(obj: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError if a RayJob / RayCluster uses a field or type KubeRay does not accept."""
    kuberay_validator(obj["kind"]).validate(obj)


def pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every pod template inside a RayJob / RayCluster, with where it sits."""
    spec = obj["spec"]
    cluster = spec.get("rayClusterSpec", spec) if obj["kind"] == "RayJob" else spec
    found: list[tuple[str, dict[str, Any]]] = []
    if "headGroupSpec" in cluster:
        found.append(("head", cluster["headGroupSpec"]["template"]))
    for group in cluster.get("workerGroupSpecs", []):
        found.append((group["groupName"], group["template"]))
    if "submitterPodTemplate" in spec:
        found.append(("submitter", spec["submitterPodTemplate"]))
    return found


def validate_object(obj: dict[str, Any]) -> None:
    """Any object the stacks declare: built-in kinds strictly, KubeRay kinds by our schema + strict pods."""
    if obj["apiVersion"].startswith("ray.io/"):
        validate_kuberay(obj)
        for where, template in pod_templates(obj):
            validate_pod_template(template, name=f"{obj['metadata']['name']}-{where}")
    else:
        validate_builtin(obj)
