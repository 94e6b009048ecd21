"""The workflows pass actionlint (with shellcheck), keep their contract, and actionlint catches a broken workflow.

The contract tests parse the YAML and check what GitHub cannot be asked offline: which job gets which
identity, which steps see which secret, that failures are reported, that the GKE stacks get their auth
plugin, that a deploy is previewed before the reviewed apply and applies only the reviewed plan, that every
action is pinned by a commit SHA confirmed for its release, gcloud by version, and that the jobs holding an
identity install only hashed locks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.gke import AUTH_PLUGIN
from infra.offline.engine import REPO_ROOT, run_stack, stack_names
from tests.lint.conftest import ci_module, run_tool, tool

ci_stacks = ci_module("stacks")

WORKFLOWS = REPO_ROOT / ".github" / "workflows"
# A full commit SHA: a tag (even vX.Y.Z) can be moved to other code by whoever controls the action's repository.
PINNED = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")


def load(name: str) -> dict[str, Any]:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as a boolean
    return data


def steps(workflow: dict[str, Any]) -> list[dict[str, Any]]:
    return [step for job in workflow["jobs"].values() for step in job.get("steps", [])]


def uses(job: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    return [step for step in job["steps"] if str(step.get("uses", "")).startswith(prefix)]


def runs(job: dict[str, Any], fragment: str) -> list[dict[str, Any]]:
    return [step for step in job["steps"] if fragment in str(step.get("run", ""))]


def index_of(job: dict[str, Any], step: dict[str, Any]) -> int:
    return next(i for i, s in enumerate(job["steps"]) if s is step)


def minutes(duration: str) -> int:
    """'240m' / '4h' / '45m' / '30s' as whole minutes (rounded up)."""
    value, unit = re.fullmatch(r"(\d+)([smh])", duration).groups()  # type: ignore[union-attr]
    return -(-int(value) * {"s": 1, "m": 60, "h": 3600}[unit] // 60)


def action(workflow: dict[str, Any], prefix: str) -> dict[str, Any]:
    found = [step for step in steps(workflow) if str(step.get("uses", "")).startswith(prefix)]
    assert len(found) == 1, f"expected one {prefix} step, found {len(found)}"
    return found[0]


class TestActionlint:
    def test_the_repository_workflows_pass(self) -> None:
        """With shellcheck on every `run:` script, as `make lint` runs it."""
        result = run_tool(tool("actionlint"), "-no-color", "-pyflakes=", f"-shellcheck={tool('shellcheck')}")
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


# The commit of each release tag in use, read from a mirror of the action's repository
# (`git rev-parse TAG^{commit}`, 2026-12-01): github.com/actions/checkout v5.0.0,
# github.com/actions/setup-python v6.0.0, github.com/google-github-actions/auth v3.0.0,
# github.com/google-github-actions/setup-gcloud v3.0.1, github.com/pulumi/actions v7.0.0,
# github.com/pulumi/auth-actions v2.1.0.
CONFIRMED_SHAS = {
    "pulumi/auth-actions": ("141415910c3beb54e03b48e9057c204c97b956f2", "v2.1.0"),
    "actions/checkout": ("08c6903cd8c0fde910a37f88322edcfb5dd907a8", "v5.0.0"),
    "actions/setup-python": ("e797f83bcb11b83ae66e0230d6156d7c80228e7c", "v6.0.0"),
    "google-github-actions/auth": ("7c6bc770dae815cd3e89ee6cdf493a5fab2cc093", "v3.0.0"),
    "google-github-actions/setup-gcloud": ("aa5489c8933f4cc7a4f7d45035b3b1440c9c10db", "v3.0.1"),
    "pulumi/actions": ("8e5e406f4007fca908480587cb9893c07090f58d", "v7.0.0"),
}
IDENTITIES = yaml.safe_load((REPO_ROOT / "infra" / "bootstrap" / "ci-identities.yaml").read_text())["identities"]


def auth(job: dict[str, Any]) -> dict[str, Any]:
    [step] = uses(job, "google-github-actions/auth@")
    return step


def identity_of(job: dict[str, Any]) -> tuple[str, str]:
    """(pool, service account) a job authenticates with."""
    with_ = auth(job)["with"]
    pool = re.fullmatch(
        r"projects/\$\{\{ vars.GCP_PROJECT_NUMBER \}\}/locations/global/workloadIdentityPools/([a-z-]+)/providers/github",
        with_["workload_identity_provider"],
    )
    account = re.fullmatch(
        r"([a-z-]+)@\$\{\{ vars.GCP_PROJECT_ID \}\}\.iam\.gserviceaccount\.com", with_["service_account"]
    )
    assert pool and account, with_
    return pool.group(1), account.group(1)


class TestWorkflowContract:
    """What the team relies on the workflows to do, checked without GitHub."""

    def test_every_action_is_pinned_by_a_full_commit_sha(self) -> None:
        for path in sorted(WORKFLOWS.glob("*.yml")):
            workflow = load(path.name)
            for step in steps(workflow):
                if "uses" in step:
                    assert PINNED.match(step["uses"]), f"{path.name}: {step['uses']} is not pinned by a commit SHA"

    def test_every_action_is_pinned_by_the_confirmed_sha_of_its_release(self) -> None:
        """Every step of a job with `id-token: write` can mint its tokens, and any job can be given one by a PR:
        GitHub's own actions too."""
        for path in sorted(WORKFLOWS.glob("*.yml")):
            workflow = load(path.name)
            text = path.read_text()
            for name, job in workflow["jobs"].items():
                for step in job["steps"]:
                    action, _, ref = str(step.get("uses", "")).partition("@")
                    if not action:
                        continue
                    assert action in CONFIRMED_SHAS, f"{path.name}/{name}: {action} has no confirmed SHA"
                    sha, tag = CONFIRMED_SHAS[action]
                    assert ref == sha, f"{path.name}/{name}: {action}@{ref} is not the confirmed SHA of {tag}"
                    assert f"uses: {action}@{sha} # {tag}" in text, f"{path.name}: say which release {sha} is"

    def test_previews_run_every_stack_with_the_policy_pack(self) -> None:
        preview = load("preview.yml")
        assert set(preview["on"]) == {"pull_request"}
        assert preview["permissions"] == {"contents": "read"}
        assert preview["concurrency"]["cancel-in-progress"] is True
        assert "pull_request.number" in preview["concurrency"]["group"]
        [list_step] = runs(preview["jobs"]["stacks"], ".ci/stacks.py")
        assert list_step["run"] == 'python3 .ci/stacks.py --outputs >> "$GITHUB_OUTPUT"'
        for job_name, group in (("preview", "cloud-run"), ("preview-gke", "gke")):
            job = preview["jobs"][job_name]
            assert job["strategy"]["matrix"]["stack"] == f"${{{{ fromJSON(needs.stacks.outputs.{group}) }}}}"
            assert job["if"] == f"needs.stacks.outputs.{group} != '[]'"
            assert job["permissions"] == {"contents": "read", "id-token": "write", "pull-requests": "write"}
            [pulumi] = runs(job, ".ci/pulumi-run.sh")
            assert pulumi["run"] == 'bash .ci/pulumi-run.sh preview "$STACK"'
            assert pulumi["env"]["STACK"] == "${{ matrix.stack }}"
        script = (REPO_ROOT / ".ci" / "pulumi-run.sh").read_text()
        assert "policy=(--policy-pack infra/policy)" in script
        assert (REPO_ROOT / "infra" / "policy" / "PulumiPolicy.yaml").exists()

    def test_the_stack_groups_follow_the_stack_files(self) -> None:
        """Each stack file lands in the job its workload needs (the same workload the program reads)."""
        from infra.offline.engine import project_defaults, stack_file_config

        groups = ci_stacks.grouped(ci_stacks.stacks())
        assert groups["all"] == stack_names()
        for stack in stack_names():
            workload = {**project_defaults(), **stack_file_config(stack)}["gemma-finetune:workload"]
            assert stack in groups["gke" if workload.startswith("gke") else "cloud-run"], (stack, workload)

    def test_forks_and_dependabot_get_no_preview(self) -> None:
        preview = load("preview.yml")
        condition = " ".join(preview["jobs"]["stacks"]["if"].split())
        assert "github.event.pull_request.head.repo.full_name == github.repository" in condition
        assert "github.event.pull_request.user.login != 'dependabot[bot]'" in condition
        for name in ("preview", "preview-gke"):
            assert preview["jobs"][name]["needs"] == "stacks"

    def test_gcloud_is_an_exact_version(self) -> None:
        for path in sorted(WORKFLOWS.glob("*.yml")):
            workflow = load(path.name)
            for step in steps(workflow):
                if str(step.get("uses", "")).startswith("google-github-actions/setup-gcloud@"):
                    assert step["with"]["version"] == "${{ env.GCLOUD_VERSION }}", f"{path.name}: {step}"
                    assert re.fullmatch(r"\d+\.\d+\.\d+", workflow["env"]["GCLOUD_VERSION"]), path.name

    def test_jobs_with_an_identity_install_only_hashed_locks(self) -> None:
        """Every `pip install` of a job with `id-token: write` is in hash-checking mode from a lock, wheels only."""
        seen = 0
        for path in sorted(WORKFLOWS.glob("*.yml")):
            workflow = load(path.name)
            for name, job in workflow["jobs"].items():
                if job.get("permissions", workflow.get("permissions", {})).get("id-token") != "write":
                    continue
                for step in job["steps"]:
                    for line in str(step.get("run", "")).splitlines():
                        if "pip install" not in line and "uv " not in line:
                            continue
                        seen += 1
                        assert re.search(
                            r"pip install -q --require-hashes --only-binary :all: -r \.ci/[\w-]+\.lock$", line
                        ), f"{path.name}/{name}: `{line.strip()}` installs what no review pinned"
                        lock = REPO_ROOT / line.rsplit(" ", 1)[-1]
                        assert lock.is_file(), lock
        assert seen >= 8, "the check found no install to judge"

    def test_a_failed_preview_is_reported_on_the_pr(self) -> None:
        preview = load("preview.yml")
        for name in ("preview", "preview-gke"):
            job = preview["jobs"][name]
            [pulumi] = runs(job, ".ci/pulumi-run.sh")
            [report] = [s for s in runs(job, ".ci/preview_report.py") if "--cancelled" not in s["run"]]
            assert index_of(job, report) > index_of(job, pulumi)
            assert report["if"] == "${{ !cancelled() }}", "the report must run when the preview failed"
            assert "--comment" in report["run"] and "--summary" in report["run"]
            assert '--exit-code "${EXIT_CODE:-1}"' in report["run"]
            assert report["env"]["EXIT_CODE"] == f"${{{{ steps.{pulumi['id']}.outputs.exit-code }}}}"
            assert report["env"]["PR_NUMBER"] == "${{ github.event.pull_request.number }}"
            assert report["env"]["GITHUB_TOKEN"] == "${{ github.token }}"
            assert not uses(job, "pulumi/actions@")[0].get("with", {}).get("command"), "pulumi/actions only installs"
            assert pulumi["env"]["GCP_PROJECT_ID"] == "${{ vars.GCP_PROJECT_ID }}", "names the stack's key"

    def test_a_cancelled_or_timed_out_preview_is_reported_on_the_pr(self) -> None:
        """A cancelled run skips the `!cancelled()` report, so this step says so. Whether GitHub counts a job past its
        timeout-minutes as cancelled is not documented plainly (github/docs#45403): either this step or the
        `!cancelled()` report (FAILED, exit code 1 by default) then replaces the last comment, never neither."""
        preview = load("preview.yml")
        for name in ("preview", "preview-gke"):
            job = preview["jobs"][name]
            [said] = [s for s in runs(job, ".ci/preview_report.py") if "--cancelled" in s["run"]]
            assert said["if"] == "cancelled()"
            assert "--comment" in said["run"] and said["env"]["PR_NUMBER"] == "${{ github.event.pull_request.number }}"
            assert said["env"]["PREVIEW_SHA"] == "${{ github.event.pull_request.head.sha }}"
            assert index_of(job, said) > index_of(job, runs(job, ".ci/pulumi-run.sh")[0])

    def test_the_auth_plugin_is_installed_with_setup_gcloud_for_gke_stacks_only(self) -> None:
        assert AUTH_PLUGIN == "gke-gcloud-auth-plugin", "the component installed is the command the kubeconfig runs"
        for path in sorted(WORKFLOWS.glob("*.yml")):
            assert "apt-get" not in path.read_text(), f"{path.name}: the runner image has no Google apt source"
        preview = load("preview.yml")
        assert not uses(preview["jobs"]["preview"], "google-github-actions/setup-gcloud@"), (
            "Cloud Run stacks need no plugin"
        )
        gke = preview["jobs"]["preview-gke"]
        [setup] = uses(gke, "google-github-actions/setup-gcloud@")
        assert setup["with"]["install_components"] == AUTH_PLUGIN and "if" not in setup
        assert index_of(gke, auth(gke)) < index_of(gke, setup) < index_of(gke, runs(gke, ".ci/pulumi-run.sh")[0])
        deploy = load("deploy.yml")
        preview_job = deploy["jobs"]["preview"]
        [setup] = uses(preview_job, "google-github-actions/setup-gcloud@")
        assert setup["with"]["install_components"] == AUTH_PLUGIN
        assert setup["if"] == "steps.kind.outputs.workload != 'cloud-run'"
        order = [index_of(preview_job, auth(preview_job)), index_of(preview_job, setup)]
        assert order[0] < order[1] < index_of(preview_job, runs(preview_job, ".ci/pulumi-run.sh")[0])
        [kind] = runs(preview_job, ".ci/stacks.py --workload")
        assert kind["id"] == "kind"

    @pytest.mark.slow
    def test_the_apply_job_has_every_tool_the_command_steps_of_pulumi_up_run(self) -> None:
        """`pulumi up` runs command steps on the runner (never in a preview): each finds an authenticated gcloud
        and the components it calls, for every stack and the build mode users pick."""
        deploy = load("deploy.yml")
        apply, preview_job = deploy["jobs"]["apply"], deploy["jobs"]["preview"]
        [setup] = uses(apply, "google-github-actions/setup-gcloud@")
        assert "if" not in setup, "every stack's `pulumi up` calls gcloud (the dev execution, Cloud Build)"
        assert index_of(apply, auth(apply)) < index_of(apply, setup) < index_of(apply, runs(apply, '"$ACTION"')[0]), (
            "setup-gcloud authenticates gcloud from the auth step's credentials, so it must come after it"
        )
        assert setup["with"]["install_components"] == "${{ needs.preview.outputs.components }}"
        assert preview_job["outputs"]["components"] == "${{ steps.kind.outputs.components }}"
        [kind] = runs(preview_job, ".ci/stacks.py --components")
        assert (
            kind["id"] == "kind" and 'echo "components=$(python3 .ci/stacks.py --components "$STACK")"' in kind["run"]
        )
        for stack in stack_names():
            for run in (run_stack(stack), run_stack(stack, overrides={"imageBuild": "cloud-build"})):
                needed: set[str] = set()
                if run.of_type("pulumi:providers:kubernetes"):
                    needed.add(AUTH_PLUGIN)
                for command in run.of_type("command:local:Command"):
                    script = command.plain_inputs()["create"]
                    needed |= {tool for tool in ("kubectl",) if re.search(rf"\b{tool}\b", script)}
                workload = ci_stacks.stacks()[stack]
                assert set(ci_stacks.COMPONENTS[workload]) == needed, (stack, needed)

    def test_each_job_uses_the_identity_and_gate_of_ci_identities(self) -> None:
        preview = load("preview.yml")
        deploy = load("deploy.yml")
        jobs = {
            "gft-ci-preview": [preview["jobs"]["preview"]],
            "gft-ci-preview-gke": [preview["jobs"]["preview-gke"]],
            "gft-ci-deploy-preview": [deploy["jobs"]["preview"]],
            "gft-ci-deploy": [deploy["jobs"]["apply"], deploy["jobs"]["unlock"]],
        }
        assert set(jobs) == set(IDENTITIES), "every identity is used, by the jobs ci-identities.yaml names"
        for job in jobs["gft-ci-deploy"]:
            assert job["environment"] in ("${{ inputs.action == 'destroy' && 'destroy' || 'deploy' }}", "deploy")
        for account, its_jobs in jobs.items():
            for job in its_jobs:
                assert identity_of(job) == (IDENTITIES[account]["federation"]["pool"], account)
                assert "credentials_json" not in str(job), "no JSON keys"
                order = [str(step.get("uses", "")) for step in job["steps"]]
                assert order.index(next(u for u in order if u.startswith("actions/checkout@"))) < order.index(
                    next(u for u in order if u.startswith("google-github-actions/auth@"))
                )
        assert preview["jobs"]["preview-gke"]["environment"] == "preview-gke"
        assert "assertion.environment == 'preview-gke'" in IDENTITIES["gft-ci-preview-gke"]["federation"]["condition"]
        # an environment without reviewers: it only holds this trust level's Pulumi Cloud fallback token
        assert preview["jobs"]["preview"]["environment"] == "preview"
        assert "environment" not in IDENTITIES["gft-ci-preview"]["federation"]["condition"]

    def test_deploys_preview_first_then_apply_behind_the_environment(self) -> None:
        deploy = load("deploy.yml")
        inputs = deploy["on"]["workflow_dispatch"]["inputs"]
        assert set(deploy["on"]) == {"workflow_dispatch"}
        assert inputs["stack"]["options"] == stack_names(), "add the new stack file's name to deploy.yml's options"
        assert inputs["action"]["options"] == ["up", "destroy", "unlock"]
        assert deploy["concurrency"]["cancel-in-progress"] is False
        preview, apply = deploy["jobs"]["preview"], deploy["jobs"]["apply"]
        # reviewers read the preview before they approve: its environment has none (main only, its own token)
        assert preview["environment"] == "deploy-preview"
        [pulumi] = [step for step in runs(preview, ".ci/pulumi-run.sh") if "cancel" not in step["run"]]
        assert "preview-destroy" in pulumi["run"] and " preview)" in pulumi["run"]
        [release_preview] = runs(preview, ".ci/pulumi-run.sh cancel")
        assert release_preview["if"] == "cancelled() && inputs.action == 'destroy'", "destroy --preview-only locks"
        [summary] = runs(preview, ".ci/preview_report.py")
        assert "--summary" in summary["run"] and summary["if"] == "${{ !cancelled() }}"
        assert apply["needs"] == "preview"
        assert apply["environment"] == "${{ inputs.action == 'destroy' && 'destroy' || 'deploy' }}"
        for job in (preview, apply):
            assert job["if"] == "github.ref == 'refs/heads/main' && inputs.action != 'unlock'"
        [run_apply] = runs(apply, '.ci/pulumi-run.sh "$ACTION"')
        assert run_apply["id"] == "apply"
        [release] = runs(apply, ".ci/pulumi-run.sh cancel")
        assert release["if"] == "cancelled()"

    def test_the_apply_job_runs_the_reviewed_plan_or_nothing(self) -> None:
        """The digest of the preview the reviewers read goes to the apply job, whose pulumi-run.sh previews again and
        stops on any other plan (tests/lint/test_pulumi_run.py TestTheReviewedPlanRuns)."""
        deploy = load("deploy.yml")
        preview, apply = deploy["jobs"]["preview"], deploy["jobs"]["apply"]
        [pulumi] = [step for step in runs(preview, ".ci/pulumi-run.sh") if "cancel" not in step["run"]]
        assert preview["outputs"]["plan-digest"] == f"${{{{ steps.{pulumi['id']}.outputs.plan-digest }}}}"
        [run_apply] = runs(apply, '.ci/pulumi-run.sh "$ACTION"')
        assert run_apply["env"]["PULUMI_REVIEWED_PLAN"] == "${{ needs.preview.outputs.plan-digest || 'missing' }}", (
            "fail closed: without a reviewed digest the check must still run, and fail"
        )
        assert run_apply["run"] == 'exec bash .ci/pulumi-run.sh "$ACTION" "$STACK"'
        [summary] = runs(preview, ".ci/preview_report.py")
        assert summary["env"]["PLAN_DIGEST"] == "${{ steps.preview.outputs.plan-digest }}"
        assert '--plan-digest "$PLAN_DIGEST"' in summary["run"], "the reviewers see the digest they approve"

    def test_a_lock_left_by_a_lost_runner_has_a_way_out(self) -> None:
        deploy = load("deploy.yml")
        unlock = deploy["jobs"]["unlock"]
        assert unlock["if"] == "github.ref == 'refs/heads/main' && inputs.action == 'unlock'"
        assert unlock["environment"] == "deploy", "releasing a lock is a deploy: its reviewers approve it"
        [step] = runs(unlock, ".ci/pulumi-run.sh")
        assert step["run"] == 'bash .ci/pulumi-run.sh cancel "$STACK"'
        assert "A lock left by a lost runner" in (REPO_ROOT / "docs" / "ci.md").read_text()

    def test_secrets_reach_only_the_pulumi_steps(self) -> None:
        """No workflow- or job-level secret; each secret only in the env of a step that runs Pulumi."""
        for path in sorted(WORKFLOWS.glob("*.yml")):
            workflow = load(path.name)
            assert "secrets." not in str(workflow.get("env", {})), path.name
            assert "PULUMI_CONFIG_PASSPHRASE" not in path.read_text(), "stack secrets use Cloud KMS, not a passphrase"
            for name, job in workflow["jobs"].items():
                assert "secrets." not in str(job.get("env", {})), f"{path.name}/{name}"
                for step in job.get("steps", []):
                    assert "secrets." not in str(step.get("with", {})), f"{path.name}/{name}: {step}"
                    if "secrets." in str(step.get("env", {})):
                        assert ".ci/pulumi-run.sh" in step["run"], f"{path.name}/{name}: {step.get('name')}"
        deploy = load("deploy.yml")
        oidc = "steps.pulumi-token.outputs.pulumi-access-token"
        for job in (deploy["jobs"]["apply"], deploy["jobs"]["unlock"]):
            tokens = [s["env"]["PULUMI_ACCESS_TOKEN"] for s in runs(job, ".ci/pulumi-run.sh")]
            assert tokens and set(tokens) == {f"${{{{ {oidc} || secrets.PULUMI_ACCESS_TOKEN }}}}"}
        preview = load("preview.yml")
        preview_jobs = [
            (preview["jobs"]["preview"], "PULUMI_PREVIEW_ACCESS_TOKEN"),
            (preview["jobs"]["preview-gke"], "PULUMI_PREVIEW_GKE_ACCESS_TOKEN"),
            (deploy["jobs"]["preview"], "PULUMI_DEPLOY_PREVIEW_ACCESS_TOKEN"),
        ]
        for job, secret in preview_jobs:
            for step in runs(job, ".ci/pulumi-run.sh"):
                assert step["env"]["PULUMI_ACCESS_TOKEN"] == f"${{{{ {oidc} || secrets.{secret} }}}}"

    def test_pulumi_cloud_tokens_come_from_the_oidc_exchange_per_trust_level(self) -> None:
        """With an OIDC issuer (vars.PULUMI_*_TEAM set), each job trades its own OIDC token for its trust level's team
        token: one team per level, only the approved deploy jobs for the deploy team (docs/ci.md, "Pulumi Cloud")."""
        preview, deploy = load("preview.yml"), load("deploy.yml")
        expected = [
            (preview, "preview", "PULUMI_PREVIEW_TEAM"),
            (preview, "preview-gke", "PULUMI_PREVIEW_GKE_TEAM"),
            (deploy, "preview", "PULUMI_DEPLOY_PREVIEW_TEAM"),
            (deploy, "apply", "PULUMI_DEPLOY_TEAM"),
            (deploy, "unlock", "PULUMI_DEPLOY_TEAM"),
        ]
        for workflow, name, team in expected:
            job = workflow["jobs"][name]
            [exchange] = uses(job, "pulumi/auth-actions@")
            assert exchange["id"] == "pulumi-token"
            assert exchange["if"] == f"vars.PULUMI_ORG != '' && vars.{team} != ''"
            assert exchange["with"]["requested-token-type"] == "urn:pulumi:token-type:access_token:team"
            assert exchange["with"]["scope"] == f"team:${{{{ vars.{team} }}}}"
            first_pulumi = min(index_of(job, s) for s in runs(job, ".ci/pulumi-run.sh"))
            assert index_of(job, exchange) < first_pulumi, name

    @pytest.mark.slow
    def test_timeouts_cannot_kill_pulumi_mid_operation(self) -> None:
        """The job limit is above Pulumi's budget + grace + setup (so .ci/pulumi-run.sh, not GitHub, stops it),
        and the grace outlasts the slowest single operation any stack declares (its customTimeouts)."""
        apply = load("deploy.yml")["jobs"]["apply"]
        [step] = runs(apply, '.ci/pulumi-run.sh "$ACTION"')
        budget, grace = minutes(step["env"]["PULUMI_BUDGET"]), minutes(step["env"]["PULUMI_GRACE"])
        assert budget + grace + 30 <= apply["timeout-minutes"] <= 360, (budget, grace, apply["timeout-minutes"])
        slowest = max(
            minutes(timeout)
            for stack in stack_names()
            for resource in run_stack(stack).resources
            for timeout in resource.custom_timeouts.values()
        )
        assert grace >= slowest, f"a {slowest}m operation would be killed {grace}m after SIGINT"

    def test_test_workflow_runs_make_test_on_prs_and_main(self) -> None:
        test = load("test.yml")
        assert set(test["on"]) == {"pull_request", "push"}
        assert test["on"]["push"]["branches"] == ["main"]
        assert test["permissions"] == {"contents": "read"}
        assert any(step.get("run") == "bash .ci/run" for step in steps(test))
        assert "make test" in (REPO_ROOT / ".ci" / "run").read_text()
