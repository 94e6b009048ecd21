"""Re-running a failed training by hand (`gcloud run jobs execute`) leaves the `dev` stack working.

No cloud here: the test plays the program's real plans (from the real program under mocks) against a small
model of the services involved, each rule a documented or reported behaviour:
- Cloud Run v2: a Job's `startExecutionToken` starts an execution `<job>-<token>` when the Job is created or
  updated; one whose name exists fails "Resource '<job>-<token>' already exists"
  (hashicorp/terraform-provider-google#24451).
- The API returns the token only while the Job's current generation was started by it; an execution started
  otherwise (gcloud, the console, a scheduler) drops it, so a refresh stores null and the next plan sets it
  again; the provider sends the configured token on every create and update ("They are still sent on create
  and update"), so an update after such an execution re-sends a used token (GoogleCloudPlatform/magic-modules#19060).
- pulumi-command `local.Command`: `create` runs on create, and again on any input change without an `update`
  command; `triggers` replace it; refresh changes nothing (pulumi-command `Command.create`/`update` docs).
- The engine: `pulumi up` touches a resource only when its inputs differ from its state; `pulumi refresh`
  stores what the provider reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from infra.offline.engine import StackRun, run_stack
from tests.infra.conftest import PREBUILT

JOB = "gcp:cloudrunv2/job:Job"
COMMAND = "command:local:Command"
TOKEN = "startExecutionToken"


class ModeledApiError(Exception):
    """What the Cloud Run API answers to a request the model rejects."""


@dataclass
class ModeledCloud:
    """The Cloud Run Jobs of one project and the stack's state, as the rules in the module docstring have them."""

    executions: list[str] = field(default_factory=list)
    state: dict[str, dict[str, Any]] = field(default_factory=dict)
    tokens: dict[str, str | None] = field(default_factory=dict)
    """Per Job: the token the API still reports (None once an execution started another way)."""

    def up(self, plan: StackRun) -> None:
        for resource in plan.resources:  # registration order: a resource comes after what it depends on
            if resource.type not in (JOB, COMMAND):
                continue
            inputs = resource.plain_inputs()
            if self.state.get(resource.urn) == inputs:
                continue
            if resource.type == JOB:
                self._create_or_update_job(inputs)
            elif "gcloud run jobs execute" in inputs["create"]:
                self._execute(inputs["environment"]["JOB"], "pulumi")
            self.state[resource.urn] = inputs

    def _create_or_update_job(self, inputs: dict[str, Any]) -> None:
        job, token = inputs["name"], inputs.get(TOKEN)
        if token:
            name = f"{job}-{token}"
            if name in self.executions:
                raise ModeledApiError(f"Resource '{name}' already exists")
            self.executions.append(name)
        self.tokens[job] = token

    def _execute(self, job: str, by: str) -> None:
        self.executions.append(f"{job}-{by}-{len(self.executions)}")
        self.tokens[job] = None

    def execute_by_hand(self, job: str) -> None:
        """`gcloud run jobs execute JOB`."""
        self._execute(job, "by-hand")

    def refresh(self) -> None:
        for inputs in self.state.values():
            if "name" in inputs and self.tokens.get(inputs["name"]) is None:
                inputs.pop(TOKEN, None)


def plan(**overrides: Any) -> StackRun:
    return run_stack("dev", overrides={**PREBUILT, **overrides})


@pytest.fixture
def trained() -> tuple[ModeledCloud, StackRun]:
    """A first `pulumi up`: the Job exists and one execution started."""
    cloud, first = ModeledCloud(), plan()
    cloud.up(first)
    assert len(cloud.executions) == 1, cloud.executions
    return cloud, first


class TestByHandRerun:
    def test_refresh_and_up_after_a_by_hand_run(self, trained: tuple[ModeledCloud, StackRun]) -> None:
        cloud, first = trained
        cloud.execute_by_hand(first.outputs["trainingJob"])
        cloud.refresh()
        cloud.up(plan())  # must not fail: nothing changed, so nothing starts
        assert len(cloud.executions) == 2, cloud.executions

    def test_changing_a_setting_after_a_by_hand_run(self, trained: tuple[ModeledCloud, StackRun]) -> None:
        cloud, first = trained
        cloud.execute_by_hand(first.outputs["trainingJob"])
        changed = plan(trainingRetries=3)  # updates the Job, not the run
        assert changed.outputs["runId"] == first.outputs["runId"]
        cloud.up(changed)
        assert len(cloud.executions) == 2, "a setting of the Job is not a new training run"

    def test_a_new_run_after_a_by_hand_run_starts_once(self, trained: tuple[ModeledCloud, StackRun]) -> None:
        cloud, first = trained
        cloud.execute_by_hand(first.outputs["trainingJob"])
        cloud.refresh()
        cloud.up(plan(recipeOverrides=["training.max_steps=5"]))
        assert len(cloud.executions) == 3, cloud.executions

    def test_the_by_hand_command_is_what_the_stack_tells(self, trained: tuple[ModeledCloud, StackRun]) -> None:
        _, first = trained
        assert first.outputs["rerunTraining"] == (
            f"gcloud run jobs execute {first.outputs['trainingJob']} --region us-central1 --project my-gcp-project"
        )


class TestTheModel:
    """The model reproduces the reported failure when a Job carries a start token; otherwise it proves nothing."""

    def test_a_token_on_the_job_fails_after_a_by_hand_run(self) -> None:
        first = plan()
        job = first.one(JOB)
        with_token = {**job.plain_inputs(), TOKEN: first.outputs["runId"]}
        cloud = ModeledCloud()
        cloud._create_or_update_job(with_token)
        cloud.state[job.urn] = dict(with_token)
        cloud.execute_by_hand(with_token["name"])
        cloud.refresh()
        assert TOKEN not in cloud.state[job.urn], "the refresh reads null, as magic-modules#19060 reports"
        with pytest.raises(ModeledApiError, match="already exists"):
            cloud._create_or_update_job(with_token)  # the next `up` re-sends the same token
