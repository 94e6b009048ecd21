"""The budget guard: a monthly Cloud Billing budget on this stack's spend, alerting at 50, 90 and 100 %.

    pulumi config set billingAccount 012345-6789AB-CDEF01
    pulumi config set budgetUsd 500
    pulumi config set --path 'budgetEmails[0]' alice@example.com
    pulumi up

Decisions
- Declared only when the stack sets `billingAccount` and `budgetUsd` (config validation requires both).
- The filter names the project by number (`projects/<number>`, pulumi-gcp 10.2 BudgetBudgetFilter
  `projects`), taken from the stack bucket's `project_number` output (Cloud Storage buckets carry
  `projectNumber`; pulumi-gcp 10.2 storage.Bucket `project_number`), not from a `getProject` invoke: a
  preview then reads nothing more, so PR previews need no `resourcemanager.projects.get`.
- Scope: the stack's project (`projects/<number>`) AND the label `stack=<stack>`, which every labelled
  resource of the stack carries (`StackConfig.resource_labels`): other stacks in the same project do not
  count. The Budget API takes one label with one value (pulumi-gcp 10.2 BudgetBudgetFilter `labels`: "A
  single label and value pair"); spend on resources without labels is not counted.
- Alerts at 50, 90 and 100 % of current spend (`thresholdRules`) go to the billing account's admins and
  users (the API's default recipients, kept) and to one Cloud Monitoring email channel per `budgetEmails`
  address (at most 5 channels per budget; `allUpdatesRule.monitoringNotificationChannels`).
- An address appears only where the API needs it: the channel's `email_address` label (each channel type
  requires its own labels, listed by projects.notificationChannelDescriptors.list: pulumi-gcp
  NotificationChannel docs). Display names number the channels ("the display name and description focus
  on the purpose/semantics of the channel rather than its destination", gcloud monitoring channels create
  reference) and the stack's `budget` output counts the recipients, so the addresses stay out of outputs,
  logs and PR preview comments (the stack configuration and the channel's label still hold them).
- A budget alerts; it does not stop spending. The hard limits are the workload deadlines and
  `maxRunCostUsd` (`infra.cost`, `infra.preflight`).

Not here: credentials. Creating the budget needs `billing.budgets.create` on the billing account
(roles/billing.costsManager, or roles/billing.admin); the channels need
`monitoring.notificationChannels.create` on the project (roles/monitoring.notificationChannelEditor).
`infra/offline/api_permissions.py` RESOURCES holds every call with its source; the CI deploy identity gets both roles
from the one-time setup (infra/bootstrap/ci-identities.yaml, `uses: [budget]`). With
user credentials (ADC) the Budget API also needs `gcp:billingProject` and `gcp:userProjectOverride: true`
(pulumi-gcp Budget docs), and `serviceusage.services.use` on that project.
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


class BudgetGuard(pulumi.ComponentResource):
    """A `gcp.billing.Budget` on the stack's spend and its email notification channels."""

    budget: gcp.billing.Budget
    channels: list[gcp.monitoring.NotificationChannel]

    def __init__(self, name: str, args: BudgetGuardArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gemma-finetune:gcp:BudgetGuard", name, None, opts)
        cfg = args.cfg
        assert cfg.billing_account and cfg.budget_usd, "config validation requires both"
        after = pulumi.ResourceOptions(parent=self, depends_on=args.after)
        self.channels = [
            gcp.monitoring.NotificationChannel(
                f"{name}-email-{index}",
                project=cfg.project,
                display_name=f"gemma-finetune {cfg.stack} budget alert {index + 1}",
                type="email",
                labels={"email_address": email},
                user_labels=cfg.resource_labels,
                opts=after,
            )
            for index, email in enumerate(cfg.budget_emails)
        ]
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
