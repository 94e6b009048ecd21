#!/usr/bin/env python3
"""Every stack file (`Pulumi.<stack>.yaml`) and the platform it deploys to, for CI and the one-time setup.

    python3 .ci/stacks.py                      # {"all": [...], "cloud-run": [...], "gke": [...]}
    python3 .ci/stacks.py --lines              # "<stack> <workload> <features>" per line (infra/bootstrap/ci-setup.sh)
    python3 .ci/stacks.py --workload dev       # cloud-run
    python3 .ci/stacks.py --components ray-gemma3-vision   # gke-gcloud-auth-plugin,kubectl (deploy.yml)
    python3 .ci/stacks.py --outputs >> "$GITHUB_OUTPUT"   # cloud-run=[...] and gke=[...] for job matrices

Decisions (why: docs/ci.md#the-stack-list-from-the-stack-files)
- Standard library only: it runs on a bare runner and wherever the one-time setup runs.
- Workload and features (`reservation`, `gpu-quota`, `budget`, `cloud-build`, `alert-emails`) are read from the stack
  file's lines; tests check them against a real YAML parse and the validated configuration.
- GKE workloads are grouped (their previews need the cluster and a reviewed environment);
  `--components` names the gcloud components a deploy needs. Bad stack names or workloads are errors.
Not here: validating the rest of the stack configuration (infra/config.py does that at preview).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {"gke-job": "gke", "gke-ray": "gke", "cloud-run": "cloud-run"}
STACK_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_DEFAULT_LINE = re.compile(r"^\s*default:\s*['\"]?([A-Za-z0-9-]+)['\"]?\s*(?:#.*)?$")
COMPONENTS = {
    "cloud-run": [],
    "gke-job": ["gke-gcloud-auth-plugin", "kubectl"],
    "gke-ray": ["gke-gcloud-auth-plugin", "kubectl"],
}
# Stack setting -> {value: the feature it means}.
FEATURES = {
    "capacity": {"reservation": "reservation", **dict.fromkeys(("on-demand", "spot", "flex-start"), "gpu-quota")},
    "imageBuild": {"cloud-build": "cloud-build"},
}
# Stack setting -> the feature it means whatever its value (set in the stack file, or defaulted in Pulumi.yaml).
FEATURES_WHEN_SET = {"billingAccount": "budget"}
# List setting -> the feature it means when the stack file gives it at least one item.
FEATURES_WHEN_LISTED = {"alertEmails": "alert-emails"}


class StackError(ValueError):
    """A stack file CI cannot use, with the file and the fix in the message."""


def _setting_line(key: str) -> re.Pattern[str]:
    return re.compile(rf"^\s*gemma-finetune:{key}:\s*['\"]?([A-Za-z0-9-]+)['\"]?\s*(?:#.*)?$")


def _project_default(root: Path, key: str = "workload") -> str | None:
    """`config.<key>.default` of Pulumi.yaml, if one is declared (read line by line, no YAML library)."""
    project = root / "Pulumi.yaml"
    if not project.exists():
        return None
    in_key = False
    for line in project.read_text().splitlines():
        if re.match(rf"^  {key}:\s*$", line):
            in_key = True
            continue
        if in_key:
            if re.match(r"^  \S", line) or not line.strip():
                return None
            match = _DEFAULT_LINE.match(line)
            if match:
                return match.group(1)
    return None


def setting_of(stack_file: Path, key: str, root: Path = REPO_ROOT) -> str | None:
    """The `gemma-finetune:<key>` of one stack file, or the project default (None when neither sets it)."""
    pattern = _setting_line(key)
    for line in stack_file.read_text().splitlines():
        match = pattern.match(line)
        if match:
            return match.group(1)
    return _project_default(root, key)


def lists_items(stack_file: Path, key: str) -> bool:
    """Whether the stack file gives the list `gemma-finetune:<key>` an item (`[a, …]`, or `- a` lines below it)."""
    lines = stack_file.read_text().splitlines()
    for index, line in enumerate(lines):
        match = re.match(rf"^(\s*)gemma-finetune:{key}:\s*(.*?)\s*(?:#.*)?$", line)
        if not match:
            continue
        if match.group(2):
            return bool(re.match(r"^\[\s*[^\]\s]", match.group(2)))
        following = next((ln for ln in lines[index + 1 :] if ln.strip() and not ln.strip().startswith("#")), "")
        return following.strip().startswith("- ") and len(following) - len(following.lstrip()) >= len(match.group(1))
    return False


def features_of(stack_file: Path, root: Path = REPO_ROOT) -> list[str]:
    """The features (FEATURES) the stack file uses, sorted."""
    found = {FEATURES[key].get(setting_of(stack_file, key, root) or "") for key in FEATURES}
    found |= {feature for key, feature in FEATURES_WHEN_SET.items() if setting_of(stack_file, key, root)}
    found |= {feature for key, feature in FEATURES_WHEN_LISTED.items() if lists_items(stack_file, key)}
    return sorted(feature for feature in found if feature)


def workload_of(stack_file: Path, root: Path = REPO_ROOT) -> str:
    """The `gemma-finetune:workload` of one stack file (or the project default)."""
    workload = setting_of(stack_file, "workload", root)
    if workload is None:
        raise StackError(
            f"{stack_file.name} sets no gemma-finetune:workload and Pulumi.yaml has no default: "
            f"add `gemma-finetune:workload: cloud-run` (or {', '.join(sorted(WORKLOADS))})"
        )
    return workload


def stacks(root: Path = REPO_ROOT) -> dict[str, str]:
    """Stack name -> workload, for every Pulumi.<stack>.yaml in `root`, sorted by name."""
    found: dict[str, str] = {}
    for path in sorted(root.glob("Pulumi.*.yaml")):
        name = path.name[len("Pulumi.") : -len(".yaml")]
        if not STACK_NAME.match(name):
            raise StackError(f"{path.name}: stack names are letters, digits, '_', '.' and '-' only; rename the file")
        workload = workload_of(path, root)
        if workload not in WORKLOADS:
            raise StackError(
                f"{path.name}: gemma-finetune:workload={workload!r} is not one of {', '.join(sorted(WORKLOADS))}"
            )
        found[name] = workload
    return found


def stack_features(root: Path = REPO_ROOT) -> dict[str, list[str]]:
    """Stack name -> its features, for every Pulumi.<stack>.yaml in `root`, sorted by name."""
    return {name: features_of(root / f"Pulumi.{name}.yaml", root) for name in stacks(root)}


def grouped(found: dict[str, str]) -> dict[str, list[str]]:
    """{"all": every stack, "cloud-run": ..., "gke": ...}; each list sorted."""
    groups: dict[str, list[str]] = {"all": sorted(found), "cloud-run": [], "gke": []}
    for name, workload in sorted(found.items()):
        groups[WORKLOADS[workload]].append(name)
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root (default: this checkout)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--lines", action="store_true", help="print '<stack> <workload>' per line")
    mode.add_argument("--workload", metavar="STACK", help="print the workload of one stack")
    mode.add_argument("--components", metavar="STACK", help="print the gcloud components its `pulumi up` runs")
    mode.add_argument("--outputs", action="store_true", help="print cloud-run=[...] and gke=[...] (GITHUB_OUTPUT)")
    args = parser.parse_args(argv)
    try:
        found = stacks(args.root)
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    one = args.workload or args.components
    if one is not None:
        if one not in found:
            print(f"error: no stack file Pulumi.{one}.yaml; stacks: {', '.join(found)}", file=sys.stderr)
            return 2
        print(found[one] if args.workload else ",".join(COMPONENTS[found[one]]))
    elif args.outputs:
        groups = grouped(found)
        print(f"cloud-run={json.dumps(groups['cloud-run'])}")
        print(f"gke={json.dumps(groups['gke'])}")
    elif args.lines:
        features = stack_features(args.root)
        for name, workload in found.items():
            print(f"{name} {workload} {','.join(features[name]) or '-'}")
    else:
        print(json.dumps(grouped(found)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
