"""`make plan STACK=<name>`: what `pulumi up` would create, offline, without a cloud account.

    python -m infra.offline.plan --stack dev
    python -m infra.offline.plan --stack dev --set servingEnabled=true --assume-trained
    python -m infra.offline.plan --stack a4-gemma4 --out build/plan
    python -m infra.offline.plan --stack a4-gemma4 --set maxRunCostUsd=500     # fails when a run can cost more

Runs the program under mocks (infra/offline/engine.py) with the real stack file, prints a preview-like
table (type, name, parent, key inputs), and writes `build/plan/<stack>/resources.json` (secrets as
"[secret]") and every Kubernetes object the stack would apply as YAML under `build/plan/<stack>/manifests/`.
The table ends with a run's cost ceiling and serving's hourly cost (infra/pricing.py), the memory model's
verdict on the recipe over the stack's GPUs, and any warning the program logged.
Computed values are the mocks' stand-ins (digests, emails, endpoints); the shape of every request is real.
It does not contact Google Cloud and needs no Pulumi CLI (more: infra/offline/README.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pulumi
import yaml

from infra import cost
from infra.config import StackConfig, stack_memory_verdict, validate
from infra.offline.engine import (
    PROJECT,
    REPO_ROOT,
    Recorded,
    StackRun,
    project_defaults,
    redact_secrets,
    run_stack,
    stack_file_config,
    stack_names,
)
from trainer.cost_line import cost_line, describe

# Inputs worth a glance in the table, per resource type (the JSON has everything).
_KEY_INPUTS = ("accountId", "name", "role", "member", "service", "location", "repositoryId", "secretId", "metadata")


def _whole_numbers(value: Any) -> Any:
    """The engine carries every number as a double; show 600, not 600.0 (Kubernetes int fields reject floats)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _whole_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_numbers(v) for v in value]
    return value


def k8s_manifest(resource: Recorded) -> dict[str, Any] | None:
    """The Kubernetes object a `kubernetes:*` resource applies, secrets redacted; None for other resources."""
    if not resource.type.startswith("kubernetes:") or resource.type.startswith("kubernetes:yaml"):
        return None
    _, group_version, kind = resource.type.split(":")
    api_version = group_version.removeprefix("core/")
    body = _whole_numbers(redact_secrets(resource.inputs))
    manifest = {"apiVersion": body.pop("apiVersion", api_version), "kind": body.pop("kind", kind)}
    manifest.update(body)
    return manifest


def _parent_name(resource: Recorded) -> str:
    return resource.parent.rsplit("::", 1)[-1] if resource.parent else ""


def _summary(resource: Recorded) -> str:
    inputs = redact_secrets(resource.inputs)
    parts = []
    for key in _KEY_INPUTS:
        value = inputs.get(key)
        if isinstance(value, dict) and key == "metadata":
            value = value.get("name")
        if value not in (None, "", {}, []):
            parts.append(f"{key}={value}")
    return ", ".join(parts)[:110]


def resources_json(run: StackRun) -> list[dict[str, Any]]:
    return [
        {
            "type": r.type,
            "name": r.name,
            "parent": _parent_name(r),
            "inputs": _whole_numbers(redact_secrets(r.inputs)),
            "dependsOn": [d.rsplit("::", 1)[-1] for d in r.dependencies],
            "retainOnDelete": r.retain_on_delete,
        }
        for r in run.resources
    ]


def write_plan(run: StackRun, out_root: Path) -> Path:
    out = out_root / run.stack
    if out.exists():
        shutil.rmtree(out)
    manifests_dir = out / "manifests"
    manifests_dir.mkdir(parents=True)
    (out / "resources.json").write_text(json.dumps(resources_json(run), indent=2, default=str) + "\n")
    outputs = {k: ("[secret]" if k in run.secret_outputs else v) for k, v in run.outputs.items()}
    (out / "outputs.json").write_text(json.dumps(outputs, indent=2, default=str) + "\n")
    count = 0
    for resource in run.resources:
        manifest = k8s_manifest(resource)
        if manifest is None:
            continue
        count += 1
        name = manifest.get("metadata", {}).get("name", resource.name)
        path = manifests_dir / f"{count:02d}-{manifest['kind'].lower()}-{name}.yaml"
        path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    return out


def print_table(run: StackRun, out: Path) -> None:
    rows = [(r.type, r.name, _parent_name(r), _summary(r)) for r in run.resources]
    widths = [max(len(row[i]) for row in [("TYPE", "NAME", "PARENT", ""), *rows]) for i in range(3)]
    print(f"Plan for stack {run.stack!r} (offline, under mocks): {len(rows)} resources to create\n")
    print(f"    {'TYPE':<{widths[0]}}  {'NAME':<{widths[1]}}  {'PARENT':<{widths[2]}}  KEY INPUTS")
    for typ, name, parent, summary in rows:
        print(f"  + {typ:<{widths[0]}}  {name:<{widths[1]}}  {parent:<{widths[2]}}  {summary}")
    print("\nOutputs:")
    for key, value in run.outputs.items():
        shown = "[secret]" if key in run.secret_outputs else value
        print(f"    {key}: {shown}")
    print("\nCost:")
    print(f"    one training run at most: {run.outputs.get('runCostCeiling')}")
    if "servingCostPerHourUsd" in run.outputs:
        hourly = run.outputs["servingCostPerHourUsd"]
        shown = f"{hourly} USD/h" if hourly is not None else "unknown (set servingHourPriceUsd)"
        print(f"    serving, every instance awake: {shown}")
    if "servingColdStart" in run.outputs:
        print(f"    serving, one cold start: {run.outputs['servingColdStart']}")
    if "servingMemory" in run.outputs:
        print("\nServing memory (one GPU, serving/memory.py):")
        print(f"    {run.outputs['servingMemory']}")
    verdict = stack_memory_verdict(run.cfg) if run.cfg is not None else None
    if verdict is not None:
        print("\nMemory (per GPU, trainer/memory_plan.py):")
        print(f"    {verdict.line()}")
    for warning in run.warnings:
        print(f"\nWarning: {warning}")
    print(f"\nWrote {out / 'resources.json'} and {out / 'manifests'}/")


def stack_config(stack: str) -> StackConfig:
    """A stack's validated configuration from Pulumi.yaml defaults and its stack file (no mocks, no cloud)."""
    values = {**project_defaults(), **stack_file_config(stack)}
    raw = {key.removeprefix(f"{PROJECT}:"): value for key, value in values.items() if not isinstance(value, dict)}
    return validate(raw, stack, hf_token_set=True)


def cost_on_each_stack(wall_seconds: float) -> list[str]:
    """What a run of `wall_seconds` would cost on each stack's training hardware (`make demo` prints it)."""
    lines = []
    for stack in stack_names():
        document = cost.price_document(stack_config(stack))
        if document is None:
            lines.append(f"{stack}: no price in infra/pricing.py for its hardware")
            continue
        line = cost_line(document, wall_seconds)
        lines.append(f"{stack}: {describe(line).removeprefix('cost: ')}")
    return lines


def _parse_sets(items: list[str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: use KEY=VALUE, e.g. --set servingEnabled=true")
        overrides[key] = yaml.safe_load(value)
    return overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stack", required=True, help=f"one of: {', '.join(stack_names())}")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument(
        "--assume-trained",
        action="store_true",
        help="plan serving as if a training run had finished (the default with --set servingEnabled=true)",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "plan")
    args = parser.parse_args(argv)
    if args.stack not in stack_names():
        print(f"unknown stack {args.stack!r}: stacks here are {', '.join(stack_names())}", file=sys.stderr)
        return 2
    overrides = _parse_sets(args.set)
    # serving needs a finished run in the bucket, which an offline plan has not: plan it as if one had finished
    assume_trained = args.assume_trained or overrides.get("servingEnabled") is True
    if assume_trained and not args.assume_trained:
        print("Serving is planned as if a training run had finished (a run the mocks put in the bucket).\n")
    try:
        run = run_stack(args.stack, overrides=overrides, assume_trained=assume_trained)
    except pulumi.RunError as exc:  # ConfigError, PreflightError included: the message is the whole story
        print(str(exc), file=sys.stderr)
        # A failed run leaves the event loop of its provider invokes behind; collect it now, while its file
        # descriptors are still open, instead of at interpreter exit (asyncio prints a spurious ValueError).
        gc.collect()
        return 2
    out = write_plan(run, args.out)
    print_table(run, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
