"""Pulumi Cloud credentials per trust level: each CI identity's jobs trade their OIDC token for their own team's token,
and their static fallback is a secret of their own environment.

Four trust levels run Pulumi: any same-repository pull request (`preview`, Cloud Run stacks), an approved pull
request (`preview-gke`, GKE stacks), deploy.yml's preview on main (every stack, read) and the approved deploy (write).
Pulumi Cloud decrypts a stack's secrets for any token that may read the stack, so one team or one token for two of
them hands the lower level the higher one's stacks (docs/ci.md, "Pulumi Cloud"). GitHub gives an environment's
secrets only to jobs bound to it (docs.github.com, "Using environments for deployment"), and a repository secret to
every job, a pull request's included.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import yaml

from infra.offline.engine import REPO_ROOT

WORKFLOWS = REPO_ROOT / ".github" / "workflows"


def pulumi_jobs() -> list[tuple[str, str, dict[str, Any]]]:
    """(workflow, job id, job) for every job that runs .ci/pulumi-run.sh."""
    found = []
    for path in sorted(WORKFLOWS.glob("*.yml")):
        for name, job in yaml.safe_load(path.read_text())["jobs"].items():
            if any(".ci/pulumi-run.sh" in str(step.get("run", "")) for step in job.get("steps", [])):
                found.append((path.name, name, job))
    return found


def pool_of(job: dict[str, Any]) -> str:
    for step in job["steps"]:
        provider = (step.get("with") or {}).get("workload_identity_provider", "")
        if provider:
            return re.search(r"workloadIdentityPools/([^/]+)/", provider).group(1)  # type: ignore[union-attr]
    raise AssertionError("no auth step")


def teams_and_secrets(job: dict[str, Any]) -> tuple[set[str], set[str]]:
    text = yaml.safe_dump(job["steps"])
    teams = set(re.findall(r"scope: team:\$\{\{ vars\.(\w+) \}\}", text))
    secrets = set(re.findall(r"secrets\.(\w+)", text))
    return teams, secrets


def environments(job: dict[str, Any]) -> set[str]:
    value = str(job.get("environment", ""))
    return set(re.findall(r"'([\w-]+)'", value)) or ({value} if value else set())


def test_each_trust_level_has_its_own_team_and_token() -> None:
    by_pool: dict[str, tuple[set[str], set[str]]] = defaultdict(lambda: (set(), set()))
    for _, _, job in pulumi_jobs():
        teams, secrets = teams_and_secrets(job)
        by_pool[pool_of(job)][0].update(teams)
        by_pool[pool_of(job)][1].update(secrets)
    assert set(by_pool) == {"gft-preview", "gft-preview-gke", "gft-deploy-preview", "gft-deploy"}, by_pool
    for pool, (teams, secrets) in by_pool.items():
        assert len(teams) == 1 and len(secrets) == 1, (pool, teams, secrets)
    for one in by_pool:
        for other in by_pool:
            if one != other:
                assert not by_pool[one][0] & by_pool[other][0], f"{one} and {other} request the same team"
                assert not by_pool[one][1] & by_pool[other][1], f"{one} and {other} share a static token"


def test_every_static_token_is_an_environment_secret() -> None:
    """A job that names a secret is bound to an environment, so the secret lives there and only there."""
    for workflow, name, job in pulumi_jobs():
        _, secrets = teams_and_secrets(job)
        assert not secrets or environments(job), f"{workflow} {name} reads {secrets} as repository secrets"


def test_no_pull_request_job_names_a_token_of_main() -> None:
    """preview.yml runs as the pull request has it; its jobs name only the preview tokens (deploy-preview and deploy
    are environments limited to main, docs/ci.md)."""
    main_secrets = {s for wf, _, job in pulumi_jobs() if wf == "deploy.yml" for s in teams_and_secrets(job)[1]}
    for workflow, name, job in pulumi_jobs():
        if workflow == "preview.yml":
            assert not teams_and_secrets(job)[1] & main_secrets, name
            assert not environments(job) & {"deploy", "destroy", "deploy-preview"}, name


def test_the_checks_can_fail() -> None:
    shared = {"steps": [{"with": {"scope": "team:${{ vars.X }}"}}, {"env": {"T": "${{ secrets.Y }}"}}]}
    assert teams_and_secrets(shared) == ({"X"}, {"Y"}) and not environments(shared)
    assert environments({"environment": "${{ inputs.action == 'destroy' && 'destroy' || 'deploy' }}"}) == {
        "destroy",
        "deploy",
    }
