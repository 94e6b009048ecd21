#!/usr/bin/env python3
"""Run zizmor and checkov (offline) on what CI and the stacks ship, and fail on any finding the baseline lacks.

    .venv/bin/python .ci/scan.py                 # what `make test` runs (scanners from .venv-scanners)
    .venv/bin/python .ci/scan.py --list          # every finding, baselined or not

Scanned: zizmor (auditor persona, --offline) on .github/workflows; checkov on both Dockerfiles, the workflows and
every Kubernetes manifest the offline plan writes for every stack and variant, with each RayJob / RayCluster pod
template written out as a Pod, for checkov reads no pod template inside a custom resource. checkov runs with
--skip-download (no guidelines from the platform) and CKV_SKIP_PACKAGE_UPDATE_CHECK (no PyPI version check).
.ci/scanners-baseline.yaml lists each accepted finding (scanner, rule, target) with its reason; a finding not
there, an entry without a reason, or an entry nothing matches any more fails. Exit 0 clean, 1 findings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
SCANNERS = Path(os.environ.get("SCANNERS_VENV", REPO_ROOT / ".venv-scanners")) / "bin"
BASELINE = REPO_ROOT / ".ci" / "scanners-baseline.yaml"
DOCKERFILES = ["trainer/Dockerfile", "serving/Dockerfile"]
# Named after the run (content-derived): a finding on one is named by its stack and kind only.
RUN_KINDS = {"Job", "RayJob", "RayCluster"}
WORKFLOWS = ".github/workflows"


@dataclass(frozen=True, order=True)
class Finding:
    scanner: str
    rule: str
    target: str
    """Stable across line moves: a file, or a file and the resource / job in it."""
    title: str = ""


def zizmor(root: Path) -> list[Finding]:
    command = [str(SCANNERS / "zizmor"), "--offline", "--no-config", "--persona", "auditor", "--format", "json"]
    result = subprocess.run([*command, WORKFLOWS], cwd=root, capture_output=True, text=True, check=False)
    if result.returncode not in (0, 10, 11, 12, 13, 14):  # 1x: findings of that severity
        raise SystemExit(f"zizmor failed ({result.returncode}): {result.stderr[-2000:]}")
    found = []
    for item in json.loads(result.stdout or "[]"):
        where = item["locations"][0]["symbolic"]
        local = where["key"].get("Local") or {}
        path = local.get("verbatim_path") or local.get("given_path") or str(where["key"])
        # the job (jobs.<id>), not the line: stable when the file moves around
        keys = [str(next(iter(part.values()))) for part in (where.get("route") or {}).get("route", [])][:2]
        found.append(Finding("zizmor", item["ident"], f"{path} {'.'.join(keys)}".strip(), item.get("desc", "")))
    return found


def checkov(targets: list[str], frameworks: list[str], root: Path, label: dict[str, str]) -> list[Finding]:
    env = {**os.environ, "CKV_SKIP_PACKAGE_UPDATE_CHECK": "true", "BC_SKIP_MAPPING": "TRUE"}
    command = [str(SCANNERS / "checkov"), "--skip-download", "--quiet", "--compact", "-o", "json", "--framework"]
    command += frameworks
    for target in targets:
        command += ["-d" if (root / target).is_dir() else "-f", target]
    result = subprocess.run(command, cwd=root, capture_output=True, text=True, check=False, env=env)
    if result.returncode not in (0, 1):
        raise SystemExit(f"checkov failed ({result.returncode}): {result.stderr[-2000:]}")
    reports = json.loads(result.stdout or "[]")
    found = []
    for report in reports if isinstance(reports, list) else [reports]:
        for check in (report.get("results") or {}).get("failed_checks", []):
            path = check["file_path"].lstrip("/")
            found.append(Finding("checkov", check["check_id"], label.get(path, path), check["check_name"]))
    return found


def rendered_manifests(out: Path) -> dict[str, str]:
    """Plan every stack and variant offline; write each built-in object as is and each Ray pod template as a Pod.
    Returns file -> label (stack/kind[/template]: one object of a kind per stack, and a run's name changes with its
    content), which names a finding's target."""
    sys.path.insert(0, str(REPO_ROOT))
    from infra.offline.staging import contexts_staged_one_at_a_time
    from infra.offline.validate_manifests import manifest_files, plan_all, ray_pod_templates

    plan = out / "plan"
    with contexts_staged_one_at_a_time():  # make test runs this beside pytest's workers, which stage them too
        plan_all(plan)
    labels: dict[str, str] = {}
    for number, path in enumerate(manifest_files(plan)):
        stack = path.parent.parent.name
        for index, document in enumerate(yaml.safe_load_all(path.read_text())):
            if not document:
                continue
            kind, name = document["kind"], document["metadata"]["name"]
            pieces: list[tuple[str, dict[str, Any]]] = [(f"{stack}/{kind}/{name}", document)]
            if kind in RUN_KINDS:
                pieces = [(f"{stack}/{kind}", document)]
            if document["apiVersion"].startswith("ray.io/"):
                pieces = [
                    (
                        f"{stack}/{kind}/{where.split('.')[-2]}",
                        {
                            "apiVersion": "v1",
                            "kind": "Pod",
                            "metadata": {**template.get("metadata", {}), "name": name, "namespace": "scan"},
                            "spec": template["spec"],
                        },
                    )
                    for where, template in ray_pod_templates(document)
                ]
            for part, (label, obj) in enumerate(pieces):
                file = out / "k8s" / f"{number:03d}-{index}-{part}.yaml"
                file.parent.mkdir(parents=True, exist_ok=True)
                file.write_text(yaml.safe_dump(obj, sort_keys=False))
                labels[file.relative_to(out).as_posix()] = label
    return labels


def scan() -> list[Finding]:
    found = zizmor(REPO_ROOT)
    # one call per framework: checkov given both -f and -d scans only the folder
    found += checkov(DOCKERFILES, ["dockerfile"], REPO_ROOT, {})
    found += checkov([WORKFLOWS], ["github_actions"], REPO_ROOT, {})
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        labels = rendered_manifests(out)
        found += checkov(["k8s"], ["kubernetes"], out, labels)
    return sorted(set(found))


def load_baseline(path: Path = BASELINE) -> list[dict[str, str]]:
    return yaml.safe_load(path.read_text())["accepted"] or []


def compare(found: list[Finding], accepted: list[dict[str, str]]) -> list[str]:
    """Problems: a finding the baseline lacks, an entry without a reason, an entry nothing matches."""
    problems = []
    keys = {(f.scanner, f.rule, f.target) for f in found}
    listed = set()
    for entry in accepted:
        key = (entry.get("scanner", ""), entry.get("rule", ""), entry.get("target", ""))
        listed.add(key)
        if len(str(entry.get("reason") or "").split()) < 4:
            problems.append(f"baseline entry {key} gives no reason")
        if key not in keys:
            problems.append(f"baseline entry {key} matches no finding any more: remove it")
    for finding in found:
        if (finding.scanner, finding.rule, finding.target) not in listed:
            problems.append(f"NEW {finding.scanner} {finding.rule} {finding.target}: {finding.title}")
    return problems


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print every finding as baseline entries")
    args = parser.parse_args(argv)
    found = scan()
    if args.list:
        entries = [{"scanner": f.scanner, "rule": f.rule, "target": f.target, "reason": f.title} for f in found]
        print(yaml.safe_dump(entries, sort_keys=False, width=120))
        return 0
    problems = compare(found, load_baseline())
    counts = {name: sum(f.scanner == name for f in found) for name in ("zizmor", "checkov")}
    print(f"scanners: zizmor {counts['zizmor']} finding(s), checkov {counts['checkov']}, all in the baseline"
          if not problems else "\n".join(problems))  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
