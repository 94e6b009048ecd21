"""The Workload Identity Federation gates, evaluated as Google evaluates them: each provider's attribute condition
(infra/bootstrap/ci-identities.yaml, which ci-setup.sh installs) run as CEL (cel-python) over the claims of a
GitHub Actions OIDC token.

A pool admits a token when its condition evaluates to true ("The expression must output a boolean representing
whether to allow the federation": WorkloadIdentityPoolProvider.attributeCondition, IAM API reference); false and
an evaluation error (a claim the token does not carry, such as `environment` for a job without one) both refuse.

The claims are those GitHub puts in every job's token (docs.github.com, "OpenID Connect reference": `ref`,
`repository`, `repository_id`, `repository_owner_id`, `event_name`, `workflow_ref`, `job_workflow_ref`, and
`environment` only for a job that names one). Each job of this repository's workflows that requests a token
must be admitted by the pool its auth step names, with the claims its own trigger and environment give it; and
the tokens an attacker can obtain (a fork, a re-registered name, another branch, another workflow, another event)
must be admitted by no pool that grants more than a PR preview's reads.
"""

from __future__ import annotations

import re
from typing import Any

import celpy
import pytest
import yaml

from infra.offline.engine import REPO_ROOT
from tests.lint.test_ci_setup import IDENTITIES, VALUES, substitute

WORKFLOWS = REPO_ROOT / ".github" / "workflows"
REPO = VALUES["GITHUB_REPO"]
OWNER = REPO.split("/")[0]
PR_REF = "refs/pull/42/merge"
MAIN = "refs/heads/main"
POOLS = {spec["federation"]["pool"]: account for account, spec in IDENTITIES["identities"].items()}


def token(
    event: str,
    ref: str,
    workflow: str,
    environment: str | None = None,
    repository: str = REPO,
    repository_id: str = VALUES["GITHUB_REPO_ID"],
    owner_id: str = VALUES["GITHUB_OWNER_ID"],
    job_workflow: str | None = None,
) -> dict[str, Any]:
    """The claims of a GitHub Actions OIDC token for one job (the `sub` format GitHub uses by default)."""
    workflow_ref = f"{repository}/.github/workflows/{workflow}@{ref}"
    claims: dict[str, Any] = {
        "sub": f"repo:{repository}:" + (f"environment:{environment}" if environment else f"ref:{ref}"),
        "aud": f"https://github.com/{repository.split('/')[0]}",
        "iss": "https://token.actions.githubusercontent.com",
        "ref": ref,
        "ref_type": "branch",
        "repository": repository,
        "repository_id": repository_id,
        "repository_owner": repository.split("/")[0],
        "repository_owner_id": owner_id,
        "repository_visibility": "private",
        "event_name": event,
        "workflow_ref": workflow_ref,
        "job_workflow_ref": job_workflow or workflow_ref,
        "actor": "mallory",
        "actor_id": "999",
        "runner_environment": "github-hosted",
    }
    if environment:
        claims["environment"] = environment
    return claims


def admitted(pool: str, claims: dict[str, Any]) -> bool:
    """Whether the pool's provider accepts a token with these claims (only a `true` result admits)."""
    [spec] = [s for s in IDENTITIES["identities"].values() if s["federation"]["pool"] == pool]
    env = celpy.Environment()
    program = env.program(env.compile(substitute(spec["federation"]["condition"])))
    try:
        result = program.evaluate({"assertion": celpy.json_to_cel(claims)})
    except celpy.CELEvalError:
        return False
    return isinstance(result, celpy.celtypes.BoolType) and bool(result)


def admitting(claims: dict[str, Any]) -> set[str]:
    return {pool for pool in POOLS if admitted(pool, claims)}


def _load(path: str) -> dict[str, Any]:
    data = yaml.safe_load((WORKFLOWS / path).read_text())
    data["on"] = data.pop(True, data.get("on"))
    return data


def _environments(job: dict[str, Any]) -> list[str | None]:
    """The environments a job can run in: a literal, or each quoted name in an expression choosing one (deploy.yml:
    `inputs.action == 'destroy' && 'destroy' || 'deploy'`)."""
    environment = job.get("environment")
    if environment is None:
        return [None]
    if isinstance(environment, dict):
        environment = environment["name"]
    if "${{" in environment:
        return sorted(set(re.findall(r"'([A-Za-z0-9_-]+)'", environment)))
    return [environment]


def token_jobs() -> list[tuple[str, str, str | None, str, dict[str, Any]]]:
    """(workflow, job, environment, pool, claims) for every job that requests an OIDC token, on each trigger."""
    found = []
    for path in sorted(p.name for p in WORKFLOWS.glob("*.yml")):
        workflow = _load(path)
        for name, job in workflow["jobs"].items():
            if job.get("permissions", workflow.get("permissions", {})).get("id-token") != "write":
                continue
            [auth] = [s for s in job["steps"] if str(s.get("uses", "")).startswith("google-github-actions/auth@")]
            pool = re.search(r"workloadIdentityPools/([a-z-]+)/", auth["with"]["workload_identity_provider"])
            assert pool, auth
            for event in workflow["on"]:
                ref = PR_REF if event == "pull_request" else MAIN
                for environment in _environments(job):
                    found.append((path, name, environment, pool.group(1), token(event, ref, path, environment)))
    return found


JOBS = token_jobs()


class TestEveryJobGetsItsIdentity:
    def test_every_token_job_is_listed(self) -> None:
        assert {(w, j) for w, j, *_ in JOBS} == {
            ("deploy.yml", "preview"),
            ("deploy.yml", "apply"),
            ("deploy.yml", "unlock"),
            ("preview.yml", "preview"),
            ("preview.yml", "preview-gke"),
        }
        assert {e for w, j, e, *_ in JOBS if j == "apply"} == {"deploy", "destroy"}

    @pytest.mark.parametrize(("workflow", "job", "environment", "pool", "claims"), JOBS, ids=lambda v: str(v)[:24])
    def test_the_pool_the_job_names_admits_its_token(
        self, workflow: str, job: str, environment: str | None, pool: str, claims: dict[str, Any]
    ) -> None:
        assert admitted(pool, claims), f"{workflow}/{job} ({environment}): pool {pool} refuses its own token"


# Tokens that someone without a reviewed change on main can obtain, and the pools that may admit them. Only
# gft-preview (reads: state, stack buckets) admits any same-repository PR; only gft-deploy-preview (reads) a
# dispatch of main's deploy.yml that no reviewer approved; nothing else admits any of them.
ATTACKS: dict[str, tuple[dict[str, Any], set[str]]] = {
    "deploy.yml dispatched on main, a job without an environment (no reviewer approved it)": (
        token("workflow_dispatch", MAIN, "deploy.yml"),
        {"gft-deploy-preview"},
    ),
    "deploy.yml dispatched on main, a job in the preview-gke environment": (
        token("workflow_dispatch", MAIN, "deploy.yml", "preview-gke"),
        {"gft-deploy-preview"},
    ),
    "a fork's own workflow": (
        token("workflow_dispatch", MAIN, "deploy.yml", "deploy", "mallory/gemma-finetune", "7001", "7002"),
        set(),
    ),
    "the name re-registered by someone else": (
        token("workflow_dispatch", MAIN, "deploy.yml", "deploy", REPO, "7003", "7004"),
        set(),
    ),
    "the same repository id under another owner id": (
        token("workflow_dispatch", MAIN, "deploy.yml", "deploy", owner_id="7005"),
        set(),
    ),
    "deploy.yml dispatched on a branch": (
        token("workflow_dispatch", "refs/heads/feature", "deploy.yml", "deploy"),
        set(),
    ),
    "another workflow dispatched on main": (
        token("workflow_dispatch", MAIN, "ops.yml", "deploy"),
        set(),
    ),
    "deploy.yml called as a reusable workflow from another one on main": (
        token(
            "workflow_dispatch", MAIN, "ops.yml", "deploy", job_workflow=f"{REPO}/.github/workflows/deploy.yml@{MAIN}"
        ),
        set(),
    ),
    "a push to main (a trigger added to deploy.yml)": (
        token("push", MAIN, "deploy.yml", "deploy"),
        set(),
    ),
    "a push to main without an environment": (
        token("push", MAIN, "deploy.yml"),
        set(),
    ),
    "a PR job that names the deploy environment": (
        token("pull_request", PR_REF, "deploy.yml", "deploy"),
        {"gft-preview"},
    ),
    "a PR job without the preview-gke environment": (
        token("pull_request", PR_REF, "preview.yml"),
        {"gft-preview"},
    ),
    "pull_request_target (runs with the base repository's identity on a fork's PR)": (
        token("pull_request_target", MAIN, "preview.yml", "preview-gke"),
        set(),
    ),
    "workflow_run after a fork's PR": (
        token("workflow_run", MAIN, "preview.yml", "preview-gke"),
        set(),
    ),
    "the preview-gke environment outside a pull request": (
        token("workflow_dispatch", MAIN, "preview.yml", "preview-gke"),
        set(),
    ),
}


class TestNoOtherTokenGetsIn:
    @pytest.mark.parametrize("case", sorted(ATTACKS))
    def test_refused(self, case: str) -> None:
        claims, allowed = ATTACKS[case]
        assert admitting(claims) <= allowed, f"{case}: admitted by {admitting(claims) - allowed}"

    def test_the_conditions_can_refuse(self) -> None:
        """Each pool refuses a token that differs from one it admits in one claim only (the check can fail)."""
        for pool, claims in {(p, str(c)): (p, c) for _, _, _, p, c in JOBS}.values():
            assert admitted(pool, claims)
            for claim, value in (("repository_id", "1"), ("repository_owner_id", "1"), ("event_name", "schedule")):
                assert not admitted(pool, {**claims, claim: value}), (pool, claim)


def test_the_deploy_pools_follow_githubs_spelling_of_the_repository() -> None:
    """Issue 23 item 10: workflow_ref carries the repository as GitHub spells it (`Acme/Gemma-Finetune`), which need
    not be how the person running the setup typed GITHUB_REPO; the gate compares the token with itself."""
    spelled = "Acme/Gemma-Finetune"
    assert spelled.lower() == REPO and spelled != REPO
    approved = token("workflow_dispatch", MAIN, "deploy.yml", "deploy", repository=spelled)
    assert admitting(approved) == {"gft-deploy", "gft-deploy-preview"}
    assert admitting(token("workflow_dispatch", MAIN, "deploy.yml", repository=spelled)) == {"gft-deploy-preview"}
    other = token("workflow_dispatch", MAIN, "deploy.yml", "deploy", repository=spelled)
    other["workflow_ref"] = f"{spelled}/.github/workflows/ops.yml@{MAIN}"
    assert admitting(other) == set()
