"""A training run's identity is known before anything is built, and the same from any checkout.

pulumi-docker-build diffs the build context's location as given (an absolute path from another checkout
means a rebuild, a new digest) and the context's files with their permission bits (another umask means a
rebuild too), and the Job / RayJob name and the Cloud Run run id name a training run:
if they followed the digest, `pulumi up` from CI or a colleague's laptop would replace a running A4 Job,
and a preview (which builds no image, so knows no digest) would see no workload at all. Run identities
derive from the images' content hash instead, and the image reference stays a leaf of the workload.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from infra.offline.engine import REPO_ROOT, StackRun, is_unknown, run_stack
from infra.policy.policies import walk

# What a checkout holds besides the commit: everything .gitignore leaves out.
NOT_IN_A_COMMIT = shutil.ignore_patterns(
    ".git",
    ".venv",
    "venv",
    "build",
    "outputs",
    ".cache",
    "__pycache__",
    "*.pyc",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    "*.egg-info",
    ".whl",
    ".gl",
)
# A laptop's leftovers inside the build contexts: none of them is part of an image's content.
LEFTOVERS = (
    "trainer/__pycache__/recipe.cpython-311.pyc",
    "trainer/outputs/demo/summary.json",
    "trainer/runs/local/checkpoint-1/state.json",
    "trainer/gemma_finetune.egg-info/PKG-INFO",
    "trainer/.cache/huggingface/token-free-cache",
    "serving/__pycache__/client.cpython-311.pyc",
)
PLAN_SCRIPT = """
import json, sys
from infra.offline.engine import run_stack
from infra.offline.plan import resources_json
result = {}
for key, (stack, overrides, trained, preview) in json.loads(sys.argv[1]).items():
    run = run_stack(stack, overrides=overrides, assume_trained=trained, preview=preview)
    resources = [{**r, "dependsOn": sorted(r["dependsOn"])} for r in resources_json(run)]
    # Registration order follows the event loop; what is declared is what counts.
    result[key] = {"resources": sorted(resources, key=lambda r: (r["type"], r["name"])), "outputs": run.outputs}
print(json.dumps(result, default=str, sort_keys=True))
"""
PLANS: dict[str, tuple[str, dict[str, Any], bool, bool]] = {
    "dev-cloud-build": ("dev", {"imageBuild": "cloud-build"}, False, False),
    "dev-serving": ("dev", {"servingEnabled": True, "imageBuild": "docker"}, True, False),
    "a4-gemma4": ("a4-gemma4", {}, False, False),
    "ray-gemma3-vision": ("ray-gemma3-vision", {}, False, False),
    "ray-preview": ("ray-gemma3-vision", {}, False, True),
}
RUN_NAMES = {"dev": "runId", "a4-gemma4": "jobName", "ray-gemma3-vision": "rayJobName"}
WORKLOADS = {"gcp:cloudrunv2/job:Job", "kubernetes:batch/v1:Job", "kubernetes:ray.io/v1:RayJob"}
# Unknown in a first preview besides the image, each computed by the cloud for a resource the same update creates.
COMPUTED_ELSEWHERE = {
    "template.template.serviceAccount": "the trainer service account's email",
    "template.template.containers[0].envs[0].valueSource.secretKeyRef.version": "the HF token's secret version",
}


def provider_context_hash(folder: Path) -> str:
    """What pulumi-docker-build compares to decide a rebuild (provider/internal/context.go `hashBuildContext`):
    every regular file's bytes, its path relative to the context and its mode string (`-rw-r--r--`). Every
    file of the folder counts here, .dockerignore or not: a file the build context holds but no commit
    does is a difference between checkouts too."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()):
        digest.update(path.read_bytes())
        digest.update(path.relative_to(folder).as_posix().encode())
        digest.update(stat.filemode(path.stat().st_mode).encode())
    return digest.hexdigest()


def build_contexts(checkout: Path, planned: dict[str, Any]) -> dict[str, str]:
    """`<plan>/<resource>` -> the provider's hash of each build context the plans hand to a builder, resolved
    from `checkout` (where `plan_in` runs the program, as Pulumi runs it and its providers in one folder)."""
    found: dict[str, str] = {}
    for key, plan in planned.items():
        for r in plan["resources"]:
            inputs = r["inputs"]
            location = (inputs.get("context") or {}).get("location") or (inputs.get("environment") or {}).get("CONTEXT")
            if r["type"] in ("docker-build:index:Image", "command:local:Command") and location:
                found[f"{key}/{r['name']}"] = provider_context_hash(checkout / location)
    return found


def umask_002(checkout: Path) -> None:
    """The files of a checkout made with umask 002 (group-writable), as git writes them on such a laptop."""
    for path in checkout.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(path.stat().st_mode | stat.S_IWGRP)


def plan_in(checkout: Path) -> dict[str, Any]:
    """Every plan in PLANS, made by the program of `checkout`, run from there as `make plan` would."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", PLAN_SCRIPT, json.dumps(PLANS)],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{path}.{key}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return _first_difference(x, y, f"{path}[{index}]")
    return f"{path}: {a!r} != {b!r}"


@pytest.mark.slow
def test_two_checkouts_plan_the_same_images_and_runs(tmp_path: Path) -> None:
    first = tmp_path / "ci" / "gemma-finetune"
    second = tmp_path / "home" / "someone" / "src" / "gft-copy"
    for checkout in (first, second):
        shutil.copytree(REPO_ROOT, checkout, ignore=NOT_IN_A_COMMIT, symlinks=True)
    for leftover in LEFTOVERS:
        (second / leftover).parent.mkdir(parents=True, exist_ok=True)
        (second / leftover).write_text("local only\n")
    umask_002(second)

    plans = [plan_in(first), plan_in(second)]
    assert plans[0] == plans[1], _first_difference(plans[0], plans[1])
    contexts = [build_contexts(first, plans[0]), build_contexts(second, plans[1])]
    assert contexts[0] and contexts[0] == contexts[1], "the builder would see another context: a rebuild"
    for checkout, planned in zip((first, second), plans, strict=True):
        text = json.dumps(planned)
        assert str(checkout) not in text and str(REPO_ROOT) not in text, "a plan names its checkout's path"
        images = [r for p in planned.values() for r in p["resources"] if r["type"] == "docker-build:index:Image"]
        assert images, "the docker-build inputs were compared"
    assert plans[0]["ray-preview"]["outputs"]["rayJobName"] == plans[0]["ray-gemma3-vision"]["outputs"]["rayJobName"]


@pytest.mark.parametrize("stack", sorted(RUN_NAMES))
def test_a_preview_knows_the_run(stack: str) -> None:
    """The name / run id a preview shows is the one `pulumi up` creates, though the digest is still unknown."""
    preview, up = run_stack(stack, preview=True), run_stack(stack)
    assert is_unknown(preview.outputs["trainerImage"]), "a preview builds no image"
    name = RUN_NAMES[stack]
    assert not is_unknown(preview.outputs[name]) and preview.outputs[name] == up.outputs[name]


@pytest.mark.parametrize("stack", sorted(RUN_NAMES))
def test_only_the_image_of_a_workload_is_unknown_in_a_preview(stack: str) -> None:
    preview: StackRun = run_stack(stack, preview=True)
    workloads = [r for r in preview.resources if r.type in WORKLOADS]
    assert workloads, stack
    for resource in workloads:
        unknown = [path for path, _, value in walk(resource.plain_inputs()) if is_unknown(value)]
        images = [path for path in unknown if path.endswith(".image")]
        others = sorted(set(unknown) - set(images) - set(COMPUTED_ELSEWHERE))
        assert not others, f"{resource.urn}: unknown at preview besides the image: {others}"
        assert images, f"{resource.urn}: the digest should be unknown in a preview"
