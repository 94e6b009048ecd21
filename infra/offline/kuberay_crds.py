"""What the API server makes of the RayJob and RayCluster the program applies: KubeRay's CRD pruning and defaults.

    .venv/bin/python -m infra.offline.kuberay_crds --kuberay-git ~/src/kuberay/.git   # rewrite kuberay_crds.json

The GKE Ray operator add-on installs KubeRay's CRDs at the version its GKE minor ships (GKE docs, "Enable the Ray
operator on GKE": 1.31-1.32 KubeRay 1.2, 1.33 1.3, 1.34 1.4, 1.35 1.5). The API server drops every field a CRD's
structural schema does not know and fills the `default:` of every absent field of an object that is present
(Kubernetes docs, "Extend the Kubernetes API with CustomResourceDefinitions": field pruning, defaulting), and
pulumi-kubernetes diffs the live object pruned to the program's inputs (pulumi/pulumi-kubernetes
provider/pkg/provider/provider.go `pruneLiveState`, util.go `pruneMap` / `pruneSlice`). A field the server dropped
or rewrote would be a change on every `up`, under `replace_on_changes` a restart of the run.
kuberay_crds.json keeps, per add-on version, each CRD's `spec` schema trimmed to the fields the program renders
(and the defaults beside them), read from ray-project/kuberay ray-operator/config/crd/bases at each tag. Regenerate
it with the command above when the manifests gain a field.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

DATA_FILE = Path(__file__).with_name("kuberay_crds.json")
# The newest patch of each KubeRay minor the add-on runs on the GKE minors the A4 stacks can use (B200 needs GKE
# 1.32.2-gke.1422000 or later, GKE docs "About GPUs in Autopilot").
ADDON_KUBERAY = {"1.32": "v1.2.2", "1.33": "v1.3.2", "1.34": "v1.4.2", "1.35": "v1.5.2"}
CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
CRD_DIR = "ray-operator/config/crd/bases"
_KEPT = ("type", "default", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string")


def trim(schema: dict[str, Any], samples: list[Any]) -> dict[str, Any]:
    """`schema` reduced to the fields the samples hold, plus the defaulted fields of each object they hold."""
    out = {k: schema[k] for k in _KEPT if k in schema}
    objects = [s for s in samples if isinstance(s, dict)]
    if objects:
        props = schema.get("properties") or {}
        present = {k for o in objects for k in o}
        kept: dict[str, Any] = {}
        for key, sub in props.items():
            if key in present:
                kept[key] = trim(sub, [o[key] for o in objects if key in o])
            elif "default" in sub:
                kept[key] = {k: sub[k] for k in ("type", "default") if k in sub}
        if "properties" in schema:
            out["properties"] = kept
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            out["additionalProperties"] = trim(extra, [v for o in objects for k, v in o.items() if k not in props])
        elif extra is not None:
            out["additionalProperties"] = extra
    lists = [s for s in samples if isinstance(s, list)]
    if lists and isinstance(schema.get("items"), dict):
        out["items"] = trim(schema["items"], [v for items in lists for v in items])
    return out


def served(schema: dict[str, Any], value: Any) -> Any:
    """`value` as the API server stores it under a structural `schema`: unknown fields pruned, defaults filled."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields") is True
        out: dict[str, Any] = {}
        for key, item in value.items():
            if key in props:
                out[key] = served(props[key], item)
            elif isinstance(extra, dict):
                out[key] = served(extra, item)
            elif extra is True or keep_unknown:
                out[key] = item
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = served(sub, copy.deepcopy(sub["default"]))
        return out
    if isinstance(value, list):
        items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        return [served(items or {}, v) for v in value]
    return value


def prune_to_inputs(live: Any, inputs: Any) -> Any:
    """pulumi-kubernetes `pruneMap` / `pruneSlice`: the live value reduced to the keys and positions of the inputs."""
    if isinstance(live, dict) and isinstance(inputs, dict):
        return {k: prune_to_inputs(v, inputs[k]) for k, v in live.items() if k in inputs}
    if isinstance(live, list) and isinstance(inputs, list):
        if not live or not inputs:
            return []
        if type(live[0]) is not type(inputs[0]):
            return copy.deepcopy(live)
        return [prune_to_inputs(v, t) for v, t in zip(live, inputs, strict=False)]
    return live


def differences(manifest: dict[str, Any], version: str, data: dict[str, Any] | None = None) -> list[str]:
    """The paths of `manifest.spec` that the API server of add-on KubeRay `version` would store otherwise, as
    pulumi-kubernetes would see them on the next `up` (dropped, rewritten, or of another type)."""
    from infra.offline.impact import diff_paths

    schemas = (data or load())["versions"][version]
    spec = manifest["spec"]
    live = served(schemas[manifest["kind"]], spec)
    return [f"spec.{p}" if p else "spec" for p in diff_paths(spec, prune_to_inputs(live, spec))]


def load() -> dict[str, Any]:
    return json.loads(DATA_FILE.read_text())


def _crd_spec_schema(git_dir: Path, tag: str, file: str) -> dict[str, Any]:
    text = subprocess.run(
        ["git", f"--git-dir={git_dir}", "show", f"{tag}:{CRD_DIR}/{file}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    crd = yaml.safe_load(text)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def ray_manifests() -> list[dict[str, Any]]:
    """Every RayJob and RayCluster the Ray stack renders, over the variants users pick."""
    from infra.offline.engine import run_stack
    from infra.offline.plan import k8s_manifest

    variants: tuple[dict[str, Any], ...] = (
        {},
        {"rayCluster": "standing", "trainingRetries": 0},
        {"nodes": 1, "recipeOverrides": ["distributed.world_size=8"]},
    )
    found: list[dict[str, Any]] = []
    for overrides in variants:
        run = run_stack("ray-gemma3-vision", overrides=overrides)
        found += [m for m in (k8s_manifest(r) for r in run.resources) if m and m["apiVersion"] == "ray.io/v1"]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kuberay-git", type=Path, required=True, help="a clone of ray-project/kuberay (its .git)")
    args = parser.parse_args(argv)
    manifests = ray_manifests()
    versions: dict[str, Any] = {}
    for tag in sorted(set(ADDON_KUBERAY.values())):
        versions[tag] = {
            kind: trim(
                _crd_spec_schema(args.kuberay_git, tag, file), [m["spec"] for m in manifests if m["kind"] == kind]
            )
            for kind, file in CRD_FILES.items()
        }
    data = {
        "source": {"repo": "ray-project/kuberay", "path": f"{CRD_DIR}/{{{','.join(CRD_FILES.values())}}}"},
        "addon": ADDON_KUBERAY,
        "versions": versions,
    }
    DATA_FILE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {DATA_FILE} ({', '.join(versions)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
