"""The budget guard: a monthly Cloud Billing budget on this stack's spend, alerting at 50, 90 and 100 %.

    pulumi config set billingAccount 012345-6789AB-CDEF01
    pulumi config set budgetUsd 500
    pulumi config set --path 'budgetEmails[0]' alice@example.com
    pulumi up

Decisions (why and sources: docs/costs.md#the-budget)
- Declared only when the stack sets `billingAccount` and `budgetUsd`.
- Scoped to the project (by number, from the bucket's output: no extra read in a preview) AND the
  label `stack=<stack>`: other stacks in the project do not count, unlabelled spend neither.
- Alerts go to the billing account's admins and one email channel per `budgetEmails` address; an
  address appears only in its channel's label, never in outputs, logs or PR comments.
- A budget alerts; it does not stop spending (the deadlines and `maxRunCostUsd` do).
Not here: credentials (`billing.budgets.create`, channel creation: infra/offline/api_permissions.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_gcp as gcp

from infra.config import StackConfig

THRESHOLDS = (0.5, 0.9, 1.0)
BUDGET_LABEL = "stack"


@dataclass
class BudgetGuardArgs:
    cfg: StackConfig
    """The validated stack configuration (billingAccount, budgetUsd, budgetEmails)."""
    project_number: pulumi.Input[int]
    """The project's number, which the budget filter takes: the stack bucket's `project_number` output."""
    after: list[pulumi.Resource] = field(default_factory=list)
    """The APIs the budget and its channels call (Billing Budgets, Monitoring)."""


def email_channels(
    prefix: str, cfg: StackConfig, emails: list[str], what: str, opts: pulumi.ResourceOptions
) -> list[gcp.monitoring.NotificationChannel]:
    """One email notification channel per address (`<prefix>-<index>`); the address only in its required label."""
    return [
        gcp.monitoring.NotificationChannel(
            f"{prefix}-{index}",
            project=cfg.project,
            display_name=f"gemma-finetune {cfg.stack} {what} {index + 1}",
            type="email",
            labels={"email_address": email},
            user_labels=cfg.resource_labels,
            opts=opts,
        )
        for index, email in enumerate(emails)
    ]


class BudgetGuard(pulumi.ComponentResource):
    """A `gcp.billing.Budget` on the stack's spend and its email notification channels."""

    budget: gcp.billing.Budget
    channels: list[gcp.monitoring.NotificationChannel]

    def __init__(self, name: str, args: BudgetGuardArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gemma-finetune:gcp:BudgetGuard", name, None, opts)
        cfg = args.cfg
        assert cfg.billing_account and cfg.budget_usd, "config validation requires both"
        after = pulumi.ResourceOptions(parent=self, depends_on=args.after)
        self.channels = email_channels(f"{name}-email", cfg, cfg.budget_emails, "budget alert", after)
        self.budget = gcp.billing.Budget(
            f"{name}-budget",
            billing_account=cfg.billing_account,
            display_name=f"gemma-finetune {cfg.stack}"[:60],
            budget_filter=gcp.billing.BudgetBudgetFilterArgs(
                projects=[pulumi.Output.concat("projects/", pulumi.Output.from_input(args.project_number).apply(str))],
                labels={BUDGET_LABEL: cfg.resource_labels[BUDGET_LABEL]},
                calendar_period="MONTH",
            ),
            amount=gcp.billing.BudgetAmountArgs(
                specified_amount=gcp.billing.BudgetAmountSpecifiedAmountArgs(
                    currency_code="USD", units=str(cfg.budget_usd)
                )
            ),
            threshold_rules=[
                gcp.billing.BudgetThresholdRuleArgs(threshold_percent=t, spend_basis="CURRENT_SPEND")
                for t in THRESHOLDS
            ],
            all_updates_rule=gcp.billing.BudgetAllUpdatesRuleArgs(
                monitoring_notification_channels=[channel.id for channel in self.channels],
                disable_default_iam_recipients=False,
            ),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[*args.after, *self.channels]),
        )
        self.register_outputs({"budget": self.budget.name})
