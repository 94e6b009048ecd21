"""Watching a run from the console: log-based metrics from the trainer's lines, a dashboard, and two alerts.

    pulumi stack output dashboard          # the Cloud Monitoring dashboard of this stack's runs
    pulumi config set --path 'alertEmails[0]' oncall@example.com   # where the alerts go (else budgetEmails)

Decisions (each chart and alert, sources, what is unconfirmed: docs/operations.md, "Watching a run")
- One DELTA DISTRIBUTION log-based metric per field of the trainer's lines (trainer/metrics_log.py), labelled by
  run, computed by Cloud Logging from lines the platform collects anyway: no workload writes a metric.
- GPU charts read the platform's metrics: GKE's managed DCGM package (infra/gke.py), Cloud Run's GPU metrics.
- Alerts are thresholds on the heartbeat, not metric absence (which cannot tell a stalled run from a finished
  one): a run that stops writing is missing data, counted as not met, so only a live run alerts.
- Alerts go to `alertEmails` (one email channel each), else to the budget's channels, else the console only.
- The policies wait until Cloud Monitoring knows their new metrics (a step polls for them with `gcloud` and `curl`):
  the API refuses a policy on a metric it does not know yet.
Not here: the lines themselves (trainer/metrics_log.py); the budget (infra/budget.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_command as command
import pulumi_gcp as gcp

from infra.budget import email_channels
from infra.cloud_run import job_name
from infra.config import StackConfig, Workload
from infra.gke import cluster_name
from trainer import metrics_log as lines

METRIC_PREFIX = "logging.googleapis.com/user/"
# One histogram for every metric (percentiles only; charts and alerts use the exact mean): 0.001 to ~2.8e11.
BUCKETS = gcp.logging.MetricBucketOptionsArgs(
    exponential_buckets=gcp.logging.MetricBucketOptionsExponentialBucketsArgs(
        num_finite_buckets=48, growth_factor=2.0, scale=0.001
    )
)
ALIGNMENT = "60s"  # one heartbeat a minute (trainer/metrics_log.py HEARTBEAT_S)
# An alert looks back two heartbeats: lines come a little over a minute apart (the thread waits HEARTBEAT_S after
# each), and a look-back of one would now and then hold none, close the open incident and open it again.
ALERT_ALIGNMENT = f"{2 * int(lines.HEARTBEAT_S)}s"
AUTO_CLOSE = "1800s"  # the shortest auto-close the API takes; missing data closes an incident sooner
# Managed DCGM metrics as Managed Service for Prometheus writes them (GKE docs, "Collect and view DCGM metrics")
DCGM_GPU_UTIL = "prometheus.googleapis.com/DCGM_FI_DEV_GPU_UTIL/gauge"
DCGM_FB_USED = "prometheus.googleapis.com/DCGM_FI_DEV_FB_USED/gauge"
# Cloud Run's container GPU metrics (Cloud Run docs, "Monitoring": GPU utilization and GPU memory utilization for
# services and jobs); the metric type names are UNCONFIRMED in Google's metric list (docs/operations.md)
RUN_GPU_UTIL = "run.googleapis.com/container/gpu/utilizations"
RUN_GPU_MEMORY = "run.googleapis.com/container/gpu/memory_utilizations"
# Cloud Monitoring knows a new log-based metric's type only a while after Cloud Logging created it, and until then
# refuses an alert policy that names it: "Error 404: Cannot find metric(s) that match type = ... If a metric was
# created recently, it could take up to 10 minutes to become available" (hashicorp/terraform-provider-google#11102,
# open; depends_on does not help). So the policies wait on a step that polls for the metric types they read.
DESCRIPTOR_WAIT_S = 15 * 60
DESCRIPTOR_POLL_S = 10
DESCRIPTOR_WAIT_SCRIPT = """set -euo pipefail
for tool in gcloud curl; do
  command -v "$tool" >/dev/null || { echo "$tool is needed to wait for the metrics $METRIC_TYPES" >&2; exit 1; }
done
api="${MONITORING_API:-https://monitoring.googleapis.com}/v3/projects/$PROJECT/metricDescriptors"
body=$(mktemp)
trap 'rm -f "$body"' EXIT
deadline=$(( $(date +%s) + WAIT_SECONDS ))
for type in $METRIC_TYPES; do
  while :; do
    token=$(gcloud auth print-access-token)
    status=$(printf 'Authorization: Bearer %s\\n' "$token" | curl -sS -G -H @- -o "$body" -w '%{http_code}' \\
      --data-urlencode "filter=metric.type = \\"$type\\"" "$api") || status=000
    case "$status" in
      200) if grep -qF "\\"$type\\"" "$body"; then break; fi ;;
      000|429|5??) ;;
      *) echo "metricDescriptors.list of $type answered $status: $(cat "$body")" >&2; exit 1 ;;
    esac
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "Cloud Monitoring does not know $type after ${WAIT_SECONDS}s (last answer: $status)." >&2
      echo "Check the metric: gcloud logging metrics list --project $PROJECT; then run pulumi up again." >&2
      exit 1
    fi
    sleep "$POLL_SECONDS"
  done
done
printf 'known to Cloud Monitoring: %s' "$METRIC_TYPES"
"""


@dataclass(frozen=True)
class LineMetric:
    """A log-based metric over one field of one kind of trainer line."""

    key: str
    event: str
    field: str
    unit: str
    description: str


LINE_METRICS = (
    LineMetric("loss", lines.TRAIN_EVENT, lines.LOSS, "1", "training loss at each logging step"),
    LineMetric("tokens_per_second", lines.TRAIN_EVENT, lines.TOKENS_PER_SECOND, "1/s", "input tokens per second"),
    LineMetric("step", lines.TRAIN_EVENT, lines.STEP, "1", "optimizer step"),
    LineMetric("epoch", lines.TRAIN_EVENT, lines.EPOCH, "1", "epoch (fractional)"),
    LineMetric("eval_loss", lines.EVAL_EVENT, lines.EVAL_LOSS, "1", "held-out loss of the tuned model"),
    LineMetric("base_eval_loss", lines.EVAL_EVENT, lines.BASE_EVAL_LOSS, "1", "held-out loss of the base model"),
    LineMetric("cost_usd", lines.HEARTBEAT_EVENT, lines.COST_USD, "{USD}", "cost of this attempt so far"),
    LineMetric("since_step_s", lines.HEARTBEAT_EVENT, lines.SINCE_STEP_S, "s", "seconds since the last step"),
    LineMetric("elapsed_s", lines.HEARTBEAT_EVENT, lines.ELAPSED_S, "s", "seconds since this attempt started"),
)


# The metrics the alert policies read: the stall alert's and the overrun alert's.
ALERT_METRICS = ("since_step_s", "elapsed_s")


def _line_metric(key: str) -> LineMetric:
    return next(m for m in LINE_METRICS if m.key == key)


def metric_name(cfg: StackConfig, metric: LineMetric) -> str:
    return f"gft/{cfg.stack}/{metric.key}"


def metric_type(cfg: StackConfig, metric: LineMetric) -> str:
    return METRIC_PREFIX + metric_name(cfg, metric)


def log_source(cfg: StackConfig) -> str:
    """The trainer's log entries of this stack: its GKE cluster and namespace, or its Cloud Run job."""
    if cfg.workload is Workload.CLOUD_RUN:
        return f'resource.type="cloud_run_job" AND resource.labels.job_name="{job_name(cfg)}"'
    return (
        f'resource.type="k8s_container" AND resource.labels.cluster_name="{cluster_name(cfg)}" '
        f'AND resource.labels.namespace_name="{cfg.namespace}"'
    )


def line_filter(cfg: StackConfig, metric: LineMetric) -> str:
    return f'{log_source(cfg)} AND jsonPayload.{lines.EVENT}="{metric.event}" AND jsonPayload.{metric.field}:*'


def monitored_resource(cfg: StackConfig) -> str:
    return "cloud_run_job" if cfg.workload is Workload.CLOUD_RUN else "k8s_container"


def run_minutes(cfg: StackConfig) -> int:
    """When a still-training attempt counts as overrunning: `alertRunMinutes`, else 3/4 of its deadline."""
    return cfg.alert_run_minutes or max(1, cfg.timeout_minutes * 3 // 4)


def _series(cfg: StackConfig, metric: LineMetric) -> str:
    return f'metric.type="{metric_type(cfg, metric)}" AND resource.type="{monitored_resource(cfg)}"'


def _line_chart(
    title: str, datasets: list[dict[str, Any]], unit: str, thresholds: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    chart: dict[str, Any] = {"dataSets": datasets, "yAxis": {"label": unit, "scale": "LINEAR"}}
    if thresholds:
        chart["thresholds"] = thresholds
    return {"title": title, "xyChart": chart}


def _dataset(
    filter_: str, aligner: str, group_by: list[str], legend: str, reducer: str = "REDUCE_MEAN"
) -> dict[str, Any]:
    aggregation: dict[str, Any] = {"alignmentPeriod": ALIGNMENT, "perSeriesAligner": aligner}
    if group_by:
        aggregation.update(crossSeriesReducer=reducer, groupByFields=group_by)
    return {
        "timeSeriesQuery": {"timeSeriesFilter": {"filter": filter_, "aggregation": aggregation}},
        "plotType": "LINE",
        "legendTemplate": legend,
    }


def _by_run(cfg: StackConfig, key: str, legend: str = "${metric.labels.run}") -> dict[str, Any]:
    metric = _line_metric(key)
    return _dataset(_series(cfg, metric), "ALIGN_MEAN", ["metric.label.run"], legend)


def _gpu_charts(cfg: StackConfig) -> list[dict[str, Any]]:
    """GPU utilisation and memory from the platform: Cloud Run's distributions over instances (their median), or
    the managed DCGM gauges of every GPU in the stack's cluster."""
    if cfg.workload is Workload.CLOUD_RUN:
        where = f'resource.type="cloud_run_job" AND resource.label.job_name="{job_name(cfg)}"'
        charts = (
            ("GPU utilisation (Cloud Run, median over instances)", RUN_GPU_UTIL, "ALIGN_PERCENTILE_50", "fraction"),
            ("GPU memory utilisation (Cloud Run, median)", RUN_GPU_MEMORY, "ALIGN_PERCENTILE_50", "fraction"),
        )
    else:
        where = f'resource.type="prometheus_target" AND resource.label.cluster="{cluster_name(cfg)}"'
        charts = (
            ("GPU utilisation (DCGM, each GPU of the cluster)", DCGM_GPU_UTIL, "ALIGN_MEAN", "%"),
            ("GPU memory used (DCGM, each GPU of the cluster)", DCGM_FB_USED, "ALIGN_MEAN", "MiB"),
        )
    return [
        _line_chart(title, [_dataset(f'metric.type="{metric}" AND {where}', aligner, [], title.split(" (")[0])], unit)
        for title, metric, aligner, unit in charts
    ]


def _tile(x: int, y: int, widget: dict[str, Any]) -> dict[str, Any]:
    """A 24 x 16 tile at (x, y). A 0 is left out, as the API leaves it out of what it returns: written, the read-back
    document would differ from this one and every `pulumi up` would update the dashboard."""
    position = {key: value for key, value in (("xPos", x), ("yPos", y)) if value}
    return {**position, "width": 24, "height": 16, "widget": widget}


def dashboard_document(cfg: StackConfig) -> dict[str, Any]:
    """The dashboard (Monitoring API `Dashboard`, mosaic layout of 48 columns): two charts a row."""
    stall, overrun = cfg.alert_stall_minutes * 60, run_minutes(cfg) * 60
    widgets = [
        _line_chart("Training loss", [_by_run(cfg, "loss")], "loss"),
        _line_chart("Tokens per second", [_by_run(cfg, "tokens_per_second")], "tokens/s"),
        _line_chart("Optimizer step", [_by_run(cfg, "step")], "step"),
        _line_chart("Epoch", [_by_run(cfg, "epoch")], "epoch"),
        _line_chart(
            "Held-out loss (tuned vs base model)",
            [_by_run(cfg, "eval_loss", "tuned ${metric.labels.run}"), _by_run(cfg, "base_eval_loss", "base")],
            "loss",
        ),
        _line_chart("Cost of this attempt so far", [_by_run(cfg, "cost_usd")], "USD"),
        *_gpu_charts(cfg),
        _line_chart(
            "Seconds since the last step (stall alert above the line)",
            [_by_run(cfg, "since_step_s")],
            "s",
            [{"label": "stall alert", "value": stall}],
        ),
        _line_chart(
            "Seconds in this attempt (overrun alert above the line)",
            [_by_run(cfg, "elapsed_s")],
            "s",
            [{"label": "overrun alert", "value": overrun}],
        ),
    ]
    tiles = [_tile((i % 2) * 24, (i // 2) * 16, widget) for i, widget in enumerate(widgets)]
    return {
        "displayName": f"gemma-finetune {cfg.stack}: training runs",
        "mosaicLayout": {"columns": 48, "tiles": tiles},
    }


def dashboard_url(cfg: StackConfig, dashboard_id: str) -> str:
    """The console page of a dashboard whose ID is `projects/NUMBER/dashboards/ID`."""
    return f"https://console.cloud.google.com/monitoring/dashboards/builder/{dashboard_id.rsplit('/', 1)[-1]}?project={cfg.project}"


@dataclass
class RunMonitoringArgs:
    cfg: StackConfig
    """The validated stack configuration (workload, alertEmails, alertStallMinutes, alertRunMinutes)."""
    after: list[pulumi.Resource] = field(default_factory=list)
    """The APIs the resources call (Cloud Logging, Cloud Monitoring)."""
    channels: list[gcp.monitoring.NotificationChannel] = field(default_factory=list)
    """Channels to alert when the stack sets no `alertEmails`: the budget's, if any."""


class RunMonitoring(pulumi.ComponentResource):
    """Log-based metrics over the trainer's lines, a dashboard, and the stall and overrun alert policies."""

    metrics: dict[str, gcp.logging.Metric]
    descriptors: command.local.Command
    """Returns once Cloud Monitoring knows the alerted metrics' types: the policies wait on it."""
    dashboard: gcp.monitoring.Dashboard
    channels: list[gcp.monitoring.NotificationChannel]
    alerts: dict[str, gcp.monitoring.AlertPolicy]
    dashboard_url: pulumi.Output[str]

    def __init__(self, name: str, args: RunMonitoringArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gemma-finetune:gcp:RunMonitoring", name, None, opts)
        cfg = args.cfg
        after = pulumi.ResourceOptions(parent=self, depends_on=args.after)
        self.metrics = {
            metric.key: gcp.logging.Metric(
                f"{name}-metric-{metric.key.replace('_', '-')}",
                project=cfg.project,
                name=metric_name(cfg, metric),
                description=f"gemma-finetune {cfg.stack}: {metric.description} (trainer/metrics_log.py)",
                filter=line_filter(cfg, metric),
                metric_descriptor=gcp.logging.MetricMetricDescriptorArgs(
                    metric_kind="DELTA",
                    value_type="DISTRIBUTION",
                    unit=metric.unit,
                    display_name=f"gemma-finetune {cfg.stack} {metric.key}",
                    labels=[
                        gcp.logging.MetricMetricDescriptorLabelArgs(
                            key=lines.RUN, value_type="STRING", description="the run's folder name"
                        )
                    ],
                ),
                value_extractor=f"EXTRACT(jsonPayload.{metric.field})",
                label_extractors={lines.RUN: f"EXTRACT(jsonPayload.{lines.RUN})"},
                bucket_options=BUCKETS,
                opts=after,
            )
            for metric in LINE_METRICS
        }
        after_metrics = pulumi.ResourceOptions(parent=self, depends_on=[*args.after, *self.metrics.values()])
        self.dashboard = gcp.monitoring.Dashboard(
            f"{name}-dashboard",
            project=cfg.project,
            dashboard_json=json.dumps(dashboard_document(cfg), sort_keys=True),
            opts=after_metrics,
        )
        alerted = [self.metrics[key] for key in ALERT_METRICS]
        # Runs again only when one of those metrics is new (its ID changes): a later `up` waits for nothing.
        self.descriptors = command.local.Command(
            f"{name}-metric-descriptors",
            create=DESCRIPTOR_WAIT_SCRIPT,
            interpreter=["/bin/bash", "-c"],
            environment={
                "PROJECT": cfg.project,
                "METRIC_TYPES": " ".join(metric_type(cfg, _line_metric(key)) for key in ALERT_METRICS),
                "WAIT_SECONDS": str(DESCRIPTOR_WAIT_S),
                "POLL_SECONDS": str(DESCRIPTOR_POLL_S),
            },
            triggers=[metric.id for metric in alerted],
            opts=pulumi.ResourceOptions(parent=self, depends_on=alerted),
        )
        after_descriptors = pulumi.ResourceOptions(
            parent=self, depends_on=[*args.after, *self.metrics.values(), self.descriptors]
        )
        self.dashboard_url = self.dashboard.id.apply(lambda dashboard_id: dashboard_url(cfg, dashboard_id))
        own = email_channels(f"{name}-alert-email", cfg, cfg.alert_emails, "run alert", after)
        self.channels = own or list(args.channels)
        notify = [channel.id for channel in self.channels]
        self.alerts = {
            "stall": self._threshold_policy(
                f"{name}-alert-stall",
                cfg,
                "since_step_s",
                cfg.alert_stall_minutes,
                f"no training progress for {cfg.alert_stall_minutes} min",
                "ERROR",
                notify,
                after_descriptors,
            ),
            "overrun": self._threshold_policy(
                f"{name}-alert-overrun",
                cfg,
                "elapsed_s",
                run_minutes(cfg),
                f"still training after {run_minutes(cfg)} min",
                "WARNING",
                notify,
                after_descriptors,
            ),
        }
        self.register_outputs({"dashboard_url": self.dashboard_url})

    @staticmethod
    def _threshold_policy(
        resource_name: str,
        cfg: StackConfig,
        key: str,
        minutes: int,
        what: str,
        severity: str,
        notify: list[pulumi.Output[str]],
        opts: pulumi.ResourceOptions,
    ) -> gcp.monitoring.AlertPolicy:
        metric = _line_metric(key)
        return gcp.monitoring.AlertPolicy(
            resource_name,
            project=cfg.project,
            display_name=f"gemma-finetune {cfg.stack}: {what}",
            combiner="OR",
            severity=severity,
            conditions=[
                gcp.monitoring.AlertPolicyConditionArgs(
                    display_name=f"{metric.description} > {minutes} min",
                    condition_threshold=gcp.monitoring.AlertPolicyConditionConditionThresholdArgs(
                        filter=_series(cfg, metric),
                        comparison="COMPARISON_GT",
                        threshold_value=float(minutes * 60),
                        duration="0s",
                        aggregations=[
                            gcp.monitoring.AlertPolicyConditionConditionThresholdAggregationArgs(
                                alignment_period=ALERT_ALIGNMENT, per_series_aligner="ALIGN_MEAN"
                            )
                        ],
                        evaluation_missing_data="EVALUATION_MISSING_DATA_INACTIVE",
                    ),
                )
            ],
            alert_strategy=gcp.monitoring.AlertPolicyAlertStrategyArgs(auto_close=AUTO_CLOSE),
            documentation=gcp.monitoring.AlertPolicyDocumentationArgs(
                mime_type="text/markdown", content=_runbook(cfg, what)
            ),
            notification_channels=notify,
            user_labels=cfg.resource_labels,
            opts=opts,
        )


def _runbook(cfg: StackConfig, what: str) -> str:
    heartbeats = f'{log_source(cfg)} AND jsonPayload.{lines.EVENT}="{lines.HEARTBEAT_EVENT}"'
    return (
        f"A run of stack {cfg.stack} is {what}, and its GPUs are billed meanwhile. The run's last lines:\n\n"
        f"`gcloud logging read '{heartbeats}' --project {cfg.project} --limit 5`\n\n"
        "What each alert means and what to do: docs/operations.md, 'Watching a run'."
    )


def declare(
    name: str, cfg: StackConfig, after: list[pulumi.Resource], budget_channels: list[gcp.monitoring.NotificationChannel]
) -> dict[str, Any]:
    """The stack's monitoring and its outputs: the dashboard's address and where the alerts go."""
    monitoring = RunMonitoring(name, RunMonitoringArgs(cfg=cfg, after=after, channels=budget_channels))
    if cfg.alert_emails:
        recipients = f"{len(cfg.alert_emails)} address(es) in alertEmails"
    elif budget_channels:
        recipients = f"the budget's {len(budget_channels)} address(es) in budgetEmails"
    else:
        recipients = "the console only (set alertEmails to be emailed)"
    return {
        "runDashboard": monitoring.dashboard_url,
        "alerts": (
            f"no step for {cfg.alert_stall_minutes} min, or still training after {run_minutes(cfg)} min: "
            f"to {recipients}"
        ),
    }
