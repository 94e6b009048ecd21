"""The workflows pass actionlint, keep their contract, and actionlint catches a broken workflow."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from infra.offline import REPO_ROOT, stack_names
from tests.lint.conftest import run_tool, tool

WORKFLOWS = REPO_ROOT / ".github" / "workflows"
# An exact release (vX.Y.Z) or a full commit SHA: never a branch, never a bare major tag.
PINNED = re.compile(r"^[\w.-]+/[\w./-]+@(v\d+\.\d+\.\d+|[0-9a-f]{40})$")


def load(name: str) -> dict[str, Any]:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as a boolean
    return data


def steps(workflow: dict[str, Any]) -> list[dict[str, Any]]:
    return [step for job in workflow["jobs"].values() for step in job.get("steps", [])]


def action(workflow: dict[str, Any], prefix: str) -> dict[str, Any]:
    found = [step for step in steps(workflow) if str(step.get("uses", "")).startswith(prefix)]
    assert len(found) == 1, f"expected one {prefix} step, found {len(found)}"
    return found[0]


class TestActionlint:
    def test_the_repository_workflows_pass(self) -> None:
        result = run_tool(tool("actionlint"), "-no-color", "-pyflakes=")
        assert result.returncode == 0, result.stdout + result.stderr

    def test_an_unknown_key_and_a_bad_expression_fail(self, tmp_path: Path) -> None:
        workflows = tmp_path / ".github" / "workflows"
        workflows.mkdir(parents=True)
        broken = workflows / "broken.yml"
        broken.write_text(
            "name: broken\n"
            "on: pull_request\n"
            "jobs:\n"
            "  preview:\n"
            "    runs-on: ubuntu-24.04\n"
            "    timeout-minute: 10\n"
            "    steps:\n"
            "      - run: echo ${{ github.event.pull_request.number\n"
        )
        result = run_tool(tool("actionlint"), "-no-color", "-pyflakes=", "-shellcheck=", str(broken), cwd=tmp_path)
        assert result.returncode == 1, result.stdout + result.stderr
        assert 'unexpected key "timeout-minute" for "job" section' in result.stdout, result.stdout
        assert "unexpected EOF while lexing expression" in result.stdout, result.stdout

    def test_an_undefined_matrix_property_fails(self, tmp_path: Path) -> None:
        broken = tmp_path / "matrix.yml"
        broken.write_text(
            "name: matrix\n"
            "on: pull_request\n"
            "jobs:\n"
            "  preview:\n"
            "    runs-on: ubuntu-24.04\n"
            "    strategy:\n"
            "      matrix:\n"
            "        stack: [dev]\n"
            "    steps:\n"
            "      - run: echo ${{ matrix.stak }}\n"
        )
        result = run_tool(tool("actionlint"), "-no-color", "-pyflakes=", "-shellcheck=", str(broken), cwd=tmp_path)
        assert result.returncode == 1, result.stdout + result.stderr
        assert 'property "stak" is not defined' in result.stdout, result.stdout


class TestWorkflowContract:
    """What the team relies on the workflows to do, checked without GitHub."""

    def test_every_action_is_pinned_to_an_exact_release(self) -> None:
        for path in sorted(WORKFLOWS.glob("*.yml")):
            workflow = load(path.name)
            for step in steps(workflow):
                if "uses" in step:
                    assert PINNED.match(step["uses"]), f"{path.name}: {step['uses']} is not pinned to vX.Y.Z or a SHA"

    def test_preview_runs_every_stack_with_the_policy_pack(self) -> None:
        preview = load("preview.yml")
        assert set(preview["on"]) == {"pull_request"}
        job = preview["jobs"]["preview"]
        assert job["permissions"] == {"contents": "read", "id-token": "write", "pull-requests": "write"}
        assert preview["permissions"] == {"contents": "read"}
        assert preview["concurrency"]["cancel-in-progress"] is True
        assert "pull_request.number" in preview["concurrency"]["group"]
        assert "Pulumi.*.yaml" in str(preview["jobs"]["stacks"]), "the matrix must come from the stack files"
        pulumi = action(preview, "pulumi/actions@")["with"]
        assert pulumi["command"] == "preview"
        assert pulumi["comment-on-pr"] is True and pulumi["diff"] is True
        assert pulumi["policyPacks"] == "infra/policy"
        assert (REPO_ROOT / pulumi["policyPacks"] / "PulumiPolicy.yaml").exists()

    def test_previews_and_deploys_authenticate_by_workload_identity(self) -> None:
        for name, account in (
            ("preview.yml", "GCP_PREVIEW_SERVICE_ACCOUNT"),
            ("deploy.yml", "GCP_DEPLOY_SERVICE_ACCOUNT"),
        ):
            workflow = load(name)
            auth = action(workflow, "google-github-actions/auth@")["with"]
            assert auth == {
                "workload_identity_provider": "${{ vars.GCP_WORKLOAD_IDENTITY_PROVIDER }}",
                "service_account": f"${{{{ vars.{account} }}}}",
            }, f"{name}: {auth}"
            assert "credentials_json" not in str(workflow), f"{name}: no JSON keys"
            order = [str(step.get("uses", "")) for step in steps(workflow)]
            checkout = next(i for i, u in enumerate(order) if u.startswith("actions/checkout@"))
            assert checkout < next(i for i, u in enumerate(order) if u.startswith("google-github-actions/auth@"))

    def test_deploy_is_manual_reviewed_and_offers_every_stack(self) -> None:
        deploy = load("deploy.yml")
        inputs = deploy["on"]["workflow_dispatch"]["inputs"]
        assert set(deploy["on"]) == {"workflow_dispatch"}
        assert inputs["stack"]["options"] == stack_names(), "add the new stack file's name to deploy.yml's options"
        assert inputs["action"]["options"] == ["up", "destroy"]
        job = deploy["jobs"]["deploy"]
        assert job["environment"] == "deploy"
        assert job["if"] == "github.ref == 'refs/heads/main'"
        pulumi = action(deploy, "pulumi/actions@")["with"]
        assert pulumi["command"] == "${{ inputs.action }}" and pulumi["policyPacks"] == "infra/policy"

    def test_test_workflow_runs_make_test_on_prs_and_main(self) -> None:
        test = load("test.yml")
        assert set(test["on"]) == {"pull_request", "push"}
        assert test["on"]["push"]["branches"] == ["main"]
        assert test["permissions"] == {"contents": "read"}
        assert any(step.get("run") == "bash .ci/run" for step in steps(test))
        assert "make test" in (REPO_ROOT / ".ci" / "run").read_text()
