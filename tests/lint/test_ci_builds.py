"""CI deploys build their images in Cloud Build, never on the runner.

deploy.yml's `apply` job runs `pulumi up` on `ubuntu-24.04`, which GitHub documents with 14 GB of disk
(docs.github.com, "GitHub-hosted runners": standard runners); a `docker` stack would pull the CUDA and vLLM
bases, build and push there. So every stack deploy.yml offers must build with `imageBuild: cloud-build` (or take
`prebuilt` images), as the program reads its configuration (infra/offline/plan.py `stack_config`: Pulumi.yaml defaults
plus the stack file, validated), and the program must then declare `gcloud builds submit` steps only; the job
runs them with an authenticated gcloud and nothing that sets Docker up.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from infra.config import ImageBuild, Workload
from infra.images import CLOUD_BUILD_SCRIPT
from infra.offline.engine import REPO_ROOT, run_stack, stack_names
from infra.offline.plan import stack_config

DEPLOY = REPO_ROOT / ".github" / "workflows" / "deploy.yml"
CLOUD_BUILD_CONFIG = REPO_ROOT / "infra" / "cloudbuild.yaml"
# The disk GitHub documents for its standard Linux runner, in GB.
RUNNER_DISK_GB = 14


def _workflow() -> dict[Any, Any]:
    data: dict[Any, Any] = yaml.safe_load(DEPLOY.read_text())
    return data


def deployable_stacks() -> list[str]:
    """The stacks deploy.yml's dispatch form offers (PyYAML reads the `on:` key as True)."""
    inputs = _workflow()[True]["workflow_dispatch"]["inputs"]
    return list(inputs["stack"]["options"])


def _uses(step: dict[str, Any]) -> str:
    return str(step.get("uses", "")).split("@")[0]


class TestDeploysBuildInCloudBuild:
    def test_deploy_offers_every_stack_file(self) -> None:
        assert sorted(deployable_stacks()) == sorted(stack_names())

    @pytest.mark.parametrize("stack", deployable_stacks())
    def test_every_deployable_stack_builds_off_the_runner(self, stack: str) -> None:
        mode = stack_config(stack).image_build
        assert mode in (ImageBuild.CLOUD_BUILD, ImageBuild.PREBUILT), (
            f"Pulumi.{stack}.yaml builds with imageBuild={mode}: deploy.yml would build its images on the "
            f"{RUNNER_DISK_GB} GB runner. Fix: set gemma-finetune:imageBuild: cloud-build in Pulumi.{stack}.yaml"
        )

    @pytest.mark.slow
    @pytest.mark.parametrize("stack", deployable_stacks())
    def test_the_program_declares_cloud_builds_only(self, stack: str) -> None:
        """With serving on where a stack serves (the vLLM image is the largest), as a deploy from CI builds it."""
        serving = stack_config(stack).workload is Workload.CLOUD_RUN
        overrides = {"servingEnabled": True, "servingInvokers": ["user:alice@example.com"]} if serving else {}
        run = run_stack(stack, overrides=overrides, assume_trained=serving)
        assert run.of_type("docker-build:index:Image") == [], "an image built by the runner's Docker"
        builds = [r for r in run.of_type("command:local:Command") if "gcp:Images" in r.parent]
        if stack_config(stack).image_build is ImageBuild.CLOUD_BUILD:
            assert len(builds) == (2 if serving else 1), [b.name for b in builds]
            assert all(b.plain_inputs()["create"] == CLOUD_BUILD_SCRIPT for b in builds)

    def test_the_apply_job_has_gcloud_and_no_docker(self) -> None:
        """`gcloud builds submit` runs as the deploy identity: gcloud is installed after the auth step and before
        Pulumi; no step sets Docker up (a build on the runner would need it)."""
        jobs = _workflow()["jobs"]
        steps = jobs["apply"]["steps"]
        uses = [_uses(step) for step in steps]
        auth = uses.index("google-github-actions/auth")
        gcloud = uses.index("google-github-actions/setup-gcloud")
        pulumi = next(i for i, step in enumerate(steps) if "pulumi-run.sh" in str(step.get("run", "")))
        assert auth < gcloud < pulumi
        for name, job in jobs.items():
            for step in job["steps"]:
                assert not _uses(step).startswith("docker/"), f"{name}: {step}"
                assert "docker " not in str(step.get("run", "")), f"{name}: {step}"

    def test_the_build_vm_asks_for_its_disk(self) -> None:
        options = yaml.safe_load(CLOUD_BUILD_CONFIG.read_text())["options"]
        assert int(options["diskSizeGb"]) >= 100 > RUNNER_DISK_GB
