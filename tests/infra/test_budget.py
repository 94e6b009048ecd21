"""The budget guard: a monthly budget on the stack's labelled spend in its project, alerting at 50/90/100 %."""

from __future__ import annotations

import re
from typing import Any

import pytest

from infra.config import ConfigError
from infra.offline.engine import MOCK_PROJECT_NUMBER, REPO_ROOT, StackRun, run_stack
from tests.infra.conftest import PREBUILT
from tests.infra.test_ordering import ancestors, dependency_graph
from tests.test_docs import slug

BUDGET = "gcp:billing/budget:Budget"
CHANNEL = "gcp:monitoring/notificationChannel:NotificationChannel"
ACCOUNT = "012345-6789AB-CDEF01"


def depends_on(stack_run: StackRun, later: Any, first: Any) -> bool:
    """`later` is created after `first`, directly or transitively, on the graph the engine orders by."""
    return first.urn in ancestors(dependency_graph(stack_run), later.urn)


ON = {**PREBUILT, "billingAccount": ACCOUNT, "budgetUsd": 500, "budgetEmails": ["alice@example.com", "ops@example.com"]}


@pytest.fixture(scope="module")
def guarded() -> StackRun:
    return run_stack("a4-gemma4", overrides=ON)


class TestBudget:
    def test_no_budget_unless_asked(self) -> None:
        stack_run = run_stack("dev", overrides=PREBUILT)
        assert not stack_run.of_type(BUDGET) and not stack_run.of_type(CHANNEL)
        assert "budget" not in stack_run.outputs

    def test_scoped_to_the_project_and_the_stack_label(self, guarded: StackRun) -> None:
        budget = guarded.one(BUDGET).plain_inputs()
        assert budget["billingAccount"] == ACCOUNT
        assert budget["budgetFilter"]["projects"] == [f"projects/{MOCK_PROJECT_NUMBER}"]
        assert budget["budgetFilter"]["labels"] == {"stack": "a4-gemma4"}
        assert budget["budgetFilter"]["calendarPeriod"] == "MONTH"
        assert budget["amount"]["specifiedAmount"] == {"currencyCode": "USD", "units": "500"}

    def test_every_labelled_resource_carries_the_label_the_budget_counts(self, guarded: StackRun) -> None:
        """The budget counts only spend labelled stack=<stack>: the billed resources must carry it."""
        for typ, field in (
            ("gcp:container/cluster:Cluster", "resourceLabels"),
            ("gcp:storage/bucket:Bucket", "labels"),
        ):
            for resource in guarded.of_type(typ):
                assert resource.plain_inputs()[field]["stack"] == "a4-gemma4", resource.urn

    def test_alerts_at_50_90_100_percent_to_each_address(self, guarded: StackRun) -> None:
        budget = guarded.one(BUDGET)
        inputs = budget.plain_inputs()
        assert [r["thresholdPercent"] for r in inputs["thresholdRules"]] == [0.5, 0.9, 1.0]
        channels = guarded.of_type(CHANNEL)
        emails = sorted(c.plain_inputs()["labels"]["email_address"] for c in channels)
        assert emails == ["alice@example.com", "ops@example.com"]
        assert all(c.plain_inputs()["type"] == "email" for c in channels)
        assert sorted(inputs["allUpdatesRule"]["monitoringNotificationChannels"]) == sorted(
            f"{c.name}-id" for c in channels
        )
        assert inputs["allUpdatesRule"]["disableDefaultIamRecipients"] is False

    def test_the_budget_waits_for_its_api_and_channels(self, guarded: StackRun) -> None:
        budget = guarded.one(BUDGET)
        apis = {r.plain_inputs()["service"]: r for r in guarded.of_type("gcp:projects/service:Service")}
        assert {"billingbudgets.googleapis.com", "monitoring.googleapis.com"} <= set(apis)
        assert depends_on(guarded, budget, apis["billingbudgets.googleapis.com"])
        for channel in guarded.of_type(CHANNEL):
            assert depends_on(guarded, budget, channel) and depends_on(
                guarded, channel, apis["monitoring.googleapis.com"]
            )

    def test_the_output_says_what_is_watched(self, guarded: StackRun) -> None:
        assert "500 USD a month for resources labelled stack=a4-gemma4" in str(guarded.outputs["budget"])
        assert "the billing account's admins and 2 address(es) in budgetEmails" in str(guarded.outputs["budget"])

    def test_no_address_in_an_output_or_a_display_name(self, guarded: StackRun) -> None:
        """The addresses live in the channels' required `email_address` label only, nowhere a log shows them."""
        shown = [str(value) for value in guarded.outputs.values()]
        for resource in guarded.resources:
            inputs = resource.plain_inputs()
            shown += [str(inputs.get("displayName", "")), str(inputs.get("description", ""))]
            shown += [str(v) for k, v in (inputs.get("labels") or {}).items() if k != "email_address"]
            shown += [str(v) for v in (inputs.get("userLabels") or {}).values()]
        for address in ON["budgetEmails"]:
            assert not [text for text in shown if address in text], address


class TestBudgetDocs:
    """`gcp:userProjectOverride` bills every call to the billing project, which needs `serviceusage.services.use`
    there (cloud.google.com/apis/docs/system-parameters): the budget setup says so, and the cloud path links it."""

    def test_the_override_comes_with_the_permission_it_needs(self) -> None:
        assert "gcp:userProjectOverride" in _budget_guard()
        assert "serviceusage.services.use" in _budget_guard()
        assert "roles/serviceusage.serviceUsageConsumer" in _budget_guard()

    def test_the_cloud_path_links_there(self) -> None:
        """The one-time enable line's explanation names the permission and links the section with the budget."""
        cloud_path = (REPO_ROOT / "docs" / "cloud-path.md").read_text()
        enable = cloud_path.split("\n## The one-time enable line\n", 1)[1].split("\n## ", 1)[0]
        assert "serviceusage.services.use" in enable
        anchors = set(re.findall(r"\]\(costs\.md#([\w-]+)\)", enable))
        assert anchors, "no link to docs/costs.md"
        for anchor in anchors:
            assert "- A budget:" in _costs_section(anchor), f"costs.md#{anchor} is not the budget guard's section"


def _costs_section(anchor: str) -> str:
    """The section of docs/costs.md whose heading GitHub gives `anchor` (tests/test_docs.py checks it exists)."""
    costs = (REPO_ROOT / "docs" / "costs.md").read_text()
    for section in costs.split("\n## ")[1:]:
        heading = section.split("\n", 1)[0]
        if slug(heading) == anchor:
            return section
    return ""


def _budget_guard() -> str:
    guards = _costs_section("guards")
    return guards[guards.index("- A budget:") :].split("\n- ", 1)[0]


class TestBudgetConfig:
    """A half-configured budget fails before anything is declared, with the key and the fix."""

    @pytest.mark.parametrize(
        ("overrides", "phrase"),
        [
            ({"billingAccount": ACCOUNT}, "billingAccount is set but budgetUsd is not"),
            ({"budgetUsd": 100}, "budgetUsd is set but billingAccount is not"),
            ({"billingAccount": "billingAccounts/0123", "budgetUsd": 1}, "is not a billing account id"),
            ({"budgetEmails": ["a@example.com"]}, "budgetEmails is set but no budget is"),
            ({**ON, "budgetEmails": ["not-an-address"]}, "are not email addresses"),
            ({**ON, "budgetEmails": [f"u{i}@example.com" for i in range(6)]}, "at most 5 channels"),
            ({**ON, "budgetUsd": 0}, "budgetUsd='0': Input should be greater than 0"),
        ],
    )
    def test_rejected(self, overrides: dict[str, Any], phrase: str) -> None:
        with pytest.raises(ConfigError) as caught:
            run_stack("dev", overrides={**PREBUILT, **overrides})
        assert phrase in str(caught.value)
        assert getattr(caught.value, "declared_resources", None) == []
