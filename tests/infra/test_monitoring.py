"""Watching a run from the console (infra/monitoring.py): for every stack, a dashboard linked from the outputs, log-based
metrics over the trainer's lines, stall and overrun alerts that only a live run can raise, and no new identity that
writes logs or metrics.

The alerts are replayed (infra/offline/log_metrics.py) on runs the trainer's own line builder writes with a fake
clock (trainer/metrics_log.py `MetricLines`): the lines go through the platform's JSON parse and the declared
metrics' filters and extractors, and the declared conditions are evaluated period by period over what they record.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from infra import monitoring
from infra.config import ConfigError
from infra.gke import cluster_name
from infra.monitoring import DESCRIPTOR_WAIT_SCRIPT
from infra.offline.api_permissions import deploy_needs, preview_needs
from infra.offline.engine import StackRun, run_stack, stack_names
from infra.offline.log_metrics import (
    Point,
    UnsupportedQuery,
    dashboard_as_read,
    dashboard_changed,
    incidents,
    matches,
    record,
    replay_threshold,
    series_of,
    structured_entry,
    trainer_resource,
    unit_problem,
)
from infra.offline.permissions import ci_identities, permissions_of, planned_grants
from tests.infra.conftest import ALERT_EMAILS, BUDGET, Variant
from tests.infra.test_ordering import ancestors, dependency_graph
from trainer.metrics_log import MetricLines

DASHBOARD = "gcp:monitoring/dashboard:Dashboard"
POLICY = "gcp:monitoring/alertPolicy:AlertPolicy"
METRIC = "gcp:logging/metric:Metric"
CHANNEL = "gcp:monitoring/notificationChannel:NotificationChannel"
SERVICE = "gcp:projects/service:Service"
CLUSTER = "gcp:container/cluster:Cluster"
COMMAND = "command:local:Command"
WRITES = {"logging.logEntries.create", "monitoring.timeSeries.create"}


@pytest.fixture(scope="module")
def stacks() -> dict[str, StackRun]:
    return {stack: run_stack(stack) for stack in stack_names()}


def _metric_types(filter_: str) -> list[str]:
    return re.findall(r'metric\.type="([^"]+)"', filter_)


def _datasets(run: StackRun) -> list[tuple[str, dict[str, Any]]]:
    document = json.loads(run.one(DASHBOARD).plain_inputs()["dashboardJson"])
    return [
        (tile["widget"]["title"], dataset)
        for tile in document["mosaicLayout"]["tiles"]
        for dataset in tile["widget"]["xyChart"]["dataSets"]
    ]


class TestDashboard:
    def test_each_stack_links_its_dashboard_from_the_outputs(self, stacks: dict[str, StackRun]) -> None:
        for stack, run in stacks.items():
            dashboard = run.one(DASHBOARD)
            url = str(run.outputs["runDashboard"])
            assert url.startswith("https://console.cloud.google.com/monitoring/dashboards/builder/"), url
            assert run.cfg is not None
            assert url.endswith(f"/{dashboard.name}-id?project={run.cfg.project}"), (stack, url)  # the mock's ID

    def test_the_charts_a_run_is_watched_by(self, stacks: dict[str, StackRun]) -> None:
        for stack, run in stacks.items():
            titles = " | ".join(title for title, _ in _datasets(run)).lower()
            for chart in ("training loss", "tokens per second", "step", "epoch", "held-out loss", "gpu utilisation",
                          "gpu memory", "cost", "since the last step", "in this attempt"):  # fmt: skip
                assert chart in titles, (stack, chart, titles)

    def test_every_chart_reads_a_metric_the_stack_declares_or_the_platform_writes(
        self, stacks: dict[str, StackRun]
    ) -> None:
        for stack, run in stacks.items():
            assert run.cfg is not None
            declared = {monitoring.METRIC_PREFIX + m.plain_inputs()["name"] for m in run.of_type(METRIC)}
            gpu = 0
            for title, dataset in _datasets(run):
                filter_ = dataset["timeSeriesQuery"]["timeSeriesFilter"]["filter"]
                (metric_type,) = _metric_types(filter_)
                if metric_type.startswith(monitoring.METRIC_PREFIX):
                    assert metric_type in declared, (stack, title, metric_type)
                    assert f'resource.type="{trainer_resource(run.cfg)["type"]}"' in filter_, (stack, title)
                    continue
                gpu += 1
                if stack == "dev":
                    assert metric_type.startswith("run.googleapis.com/container/gpu/"), (stack, title)
                    assert 'resource.label.job_name="gft-dev-train"' in filter_
                else:
                    assert metric_type.startswith("prometheus.googleapis.com/DCGM_FI_DEV_"), (stack, title)
                    assert f'resource.label.cluster="{cluster_name(run.cfg)}"' in filter_
            assert gpu == 2, stack

    def test_a_later_up_leaves_the_dashboard_alone(self, stacks: dict[str, StackRun]) -> None:
        """The API leaves out a field at its default value (a tile at xPos 0 has none): a document that writes such a
        field reads back different, and every `pulumi up` would update the dashboard."""
        for stack, run in stacks.items():
            configured = json.loads(run.one(DASHBOARD).plain_inputs()["dashboardJson"])
            assert not dashboard_changed(dashboard_as_read(configured), configured), stack

    def test_the_check_sees_a_field_the_api_leaves_out(self, stacks: dict[str, StackRun]) -> None:
        configured = json.loads(stacks["dev"].one(DASHBOARD).plain_inputs()["dashboardJson"])
        configured["mosaicLayout"]["tiles"][0]["xPos"] = 0
        assert dashboard_changed(dashboard_as_read(configured), configured)
        read = dashboard_as_read(configured)
        read["mosaicLayout"]["tiles"][0]["widget"]["xyChart"]["dataSets"][0]["targetAxis"] = "Y1"  # added by the API
        del configured["mosaicLayout"]["tiles"][0]["xPos"]
        assert not dashboard_changed(read, configured)

    def test_gke_clusters_export_managed_dcgm_metrics(self, stacks: dict[str, StackRun]) -> None:
        """The DCGM charts read what GKE's managed DCGM package writes through Managed Service for Prometheus."""
        for stack, run in stacks.items():
            for cluster in run.of_type(CLUSTER):
                config = cluster.plain_inputs()["monitoringConfig"]
                assert {"SYSTEM_COMPONENTS", "DCGM"} <= set(config["enableComponents"]), stack
                assert config["managedPrometheus"]["enabled"] is True, stack

    def test_the_clusters_other_metric_packages_stay_on(self, stacks: dict[str, StackRun]) -> None:
        """The list replaces the cluster's whole set of packages: it keeps those GKE turns on for a new cluster (kube
        state, cAdvisor, Kubelet), each once and each a value the provider accepts (terraform-provider-google
        resource_container_cluster.go, enable_components)."""
        accepted = {"SYSTEM_COMPONENTS", "APISERVER", "SCHEDULER", "CONTROLLER_MANAGER", "STORAGE", "HPA", "POD",
                    "DAEMONSET", "DEPLOYMENT", "STATEFULSET", "KUBELET", "CADVISOR", "DCGM", "JOBSET"}  # fmt: skip
        gke_defaults = {"SYSTEM_COMPONENTS", "STORAGE", "HPA", "POD", "DAEMONSET", "DEPLOYMENT", "STATEFULSET",
                        "CADVISOR", "KUBELET"}  # fmt: skip
        clusters = [c for run in stacks.values() for c in run.of_type(CLUSTER)]
        assert clusters
        for cluster in clusters:
            components = cluster.plain_inputs()["monitoringConfig"]["enableComponents"]
            assert len(components) == len(set(components)) and set(components) <= accepted, components
            assert gke_defaults <= set(components), gke_defaults - set(components)

    def test_everything_waits_for_the_api_it_calls_and_alerts_for_their_metrics(
        self, stacks: dict[str, StackRun]
    ) -> None:
        for stack, run in stacks.items():
            graph = dependency_graph(run)
            apis = {s.plain_inputs()["service"]: s.urn for s in run.of_type(SERVICE)}
            for metric in run.of_type(METRIC):
                assert apis["logging.googleapis.com"] in ancestors(graph, metric.urn), (stack, metric.urn)
            for resource in [*run.of_type(DASHBOARD), *run.of_type(POLICY), *run.of_type(CHANNEL)]:
                assert apis["monitoring.googleapis.com"] in ancestors(graph, resource.urn), (stack, resource.urn)
            types = {monitoring.METRIC_PREFIX + m.plain_inputs()["name"]: m.urn for m in run.of_type(METRIC)}
            for policy in run.of_type(POLICY):
                for condition in policy.plain_inputs()["conditions"]:
                    for metric_type in _metric_types(condition["conditionThreshold"]["filter"]):
                        assert types[metric_type] in ancestors(graph, policy.urn), (stack, policy.urn, metric_type)

    def test_each_alert_waits_until_cloud_monitoring_knows_its_metric(self, stacks: dict[str, StackRun]) -> None:
        """A policy on a log-based metric Cloud Monitoring does not know yet is refused with a 404 (up to 10 minutes
        after the metric's creation): each policy comes after a wait step that polls for its metric's type, which
        itself comes after that metric."""
        for stack, run in stacks.items():
            graph = dependency_graph(run)
            metrics = {monitoring.METRIC_PREFIX + m.plain_inputs()["name"]: m.urn for m in run.of_type(METRIC)}
            waits = {w.urn: w for w in run.of_type(COMMAND) if w.plain_inputs()["create"] == DESCRIPTOR_WAIT_SCRIPT}
            assert waits, stack
            for policy in run.of_type(POLICY):
                (condition,) = policy.plain_inputs()["conditions"]
                (metric_type,) = _metric_types(condition["conditionThreshold"]["filter"])
                polled = [
                    urn
                    for urn in ancestors(graph, policy.urn)
                    if urn in waits and metric_type in waits[urn].plain_inputs()["environment"]["METRIC_TYPES"].split()
                ]
                assert polled, (stack, policy.name, metric_type)
                assert all(metrics[metric_type] in ancestors(graph, urn) for urn in polled), (stack, policy.name)


class TestLineMetrics:
    def test_each_is_a_delta_distribution_labelled_by_run(self, stacks: dict[str, StackRun]) -> None:
        """LogMetric reference: a distribution is DELTA + DISTRIBUTION with a value extractor and bucket options, and
        every label of the descriptor has an extractor (the kind and type cannot change once created)."""
        for run in stacks.values():
            assert len(run.of_type(METRIC)) == len(monitoring.LINE_METRICS)
            for metric in run.of_type(METRIC):
                inputs = metric.plain_inputs()
                descriptor = inputs["metricDescriptor"]
                assert (descriptor["metricKind"], descriptor["valueType"]) == ("DELTA", "DISTRIBUTION"), metric.urn
                assert inputs["valueExtractor"].startswith("EXTRACT(jsonPayload.") and inputs["bucketOptions"]
                assert {label["key"] for label in descriptor["labels"]} == set(inputs["labelExtractors"]) == {"run"}

    def test_each_unit_is_one_the_api_takes(self, stacks: dict[str, StackRun]) -> None:
        """MetricDescriptor.unit is a subset of UCUM (google/api/metric.proto): `USD` is none of its units."""
        for stack, run in stacks.items():
            for metric in run.of_type(METRIC):
                unit = metric.plain_inputs()["metricDescriptor"]["unit"]
                assert unit_problem(unit) is None, (stack, metric.name, unit_problem(unit))
        assert unit_problem("USD") and unit_problem("{USD}") is None  # the check can fail

    def test_a_stack_counts_its_own_trainer_only(self, stacks: dict[str, StackRun]) -> None:
        """The same line from another stack's trainer (another cluster, namespace or job) records nothing here."""
        written: list[str] = []
        lines = MetricLines("gs://b/runs/r-1", started_at=0.0, clock=lambda: 10.0, write=written.append)
        lines.train({"loss": 1.0, "num_input_tokens_seen": 10}, 1, 0.1)
        for stack, run in stacks.items():
            for other, other_run in stacks.items():
                assert other_run.cfg is not None
                entry = (0.0, structured_entry(written[0], trainer_resource(other_run.cfg)))
                loss = next(m for m in run.of_type(METRIC) if m.plain_inputs()["name"].endswith("/loss"))
                assert bool(record(loss.plain_inputs(), [entry])) == (stack == other), (stack, other)

    def test_a_text_line_is_no_metric(self, stacks: dict[str, StackRun]) -> None:
        run = stacks["dev"]
        assert run.cfg is not None
        entry = structured_entry("step 3 loss 1.0", trainer_resource(run.cfg))
        assert "textPayload" in entry
        assert not any(record(m.plain_inputs(), [(0.0, entry)]) for m in run.of_type(METRIC))


# --------------------------------------------------------------------------------------------------- alerts
def simulate(
    run: StackRun,
    until: float,
    step_every: float = 10.0,
    stall_at: float | None = None,
    end_at: float | None = None,
    beat_every: int = 60,
) -> list[tuple[float, dict[str, Any]]]:
    """A run as the trainer writes it: a step every `step_every` s until `stall_at` (then none), a heartbeat every
    `beat_every` s until `end_at` (training ended, or the process is gone: no line after it)."""
    assert run.cfg is not None
    now = [0.0]
    written: list[tuple[float, str]] = []
    lines = MetricLines(
        "gs://b/runs/emoji-r-1", started_at=0.0, clock=lambda: now[0], write=lambda line: written.append((now[0], line))
    )
    step = 0
    for second in range(int(until) + 1):
        now[0] = float(second)
        if end_at is not None and second >= end_at:
            break
        if (stall_at is None or second < stall_at) and second % int(step_every) == 0 and second:
            step += 1
            lines.stepped(step)
            lines.train({"loss": 1.0, "num_input_tokens_seen": 100 * step}, step, step / 1000)
        if second % beat_every == 0:
            lines.heartbeat()
    resource = trainer_resource(run.cfg)
    return [(at, structured_entry(line, resource)) for at, line in written]


def policy(run: StackRun, kind: str) -> dict[str, Any]:
    return next(p for p in run.of_type(POLICY) if p.name.endswith(f"-alert-{kind}")).plain_inputs()


def replay(
    run: StackRun, kind: str, entries: list[tuple[float, dict[str, Any]]], until: float, change: Callable | None = None
) -> list[tuple[float, float | None]]:
    """Incidents the declared `kind` policy opens over this run: its condition's series, recorded by the declared
    metric it names, replayed period by period."""
    condition = policy(run, kind)["conditions"][0]
    if change is not None:
        condition = change(condition)
    filter_ = condition["conditionThreshold"]["filter"]
    resource_type = entries[0][1]["resource"]["type"]
    chosen = [
        m.plain_inputs() for m in run.of_type(METRIC) if matches(filter_, series_of(m.plain_inputs(), resource_type))
    ]
    assert len(chosen) == 1, (kind, filter_)
    points: list[Point] = record(chosen[0], entries)
    return incidents(replay_threshold(condition, points, until))


class TestStallAlert:
    def test_a_stalled_run_alerts_once_the_stall_minutes_have_passed(self, stacks: dict[str, StackRun]) -> None:
        for stack, run in stacks.items():
            assert run.cfg is not None
            stall = run.cfg.alert_stall_minutes * 60
            found = replay(run, "stall", simulate(run, until=3600, stall_at=600), until=3600)
            assert len(found) == 1 and found[0][1] is None, (stack, found)
            last_step = 590
            assert last_step + stall < found[0][0] <= last_step + stall + 2 * 60, (stack, found)

    def test_a_late_heartbeat_does_not_close_and_reopen_the_incident(self, stacks: dict[str, StackRun]) -> None:
        """The heartbeat thread waits 60 s after each line, so lines come a little over a minute apart, and a log
        entry's time is the agent's: the look-back window must hold a line even when one is late (here each by 1 s),
        or the open incident closes for missing data and opens again, one more email each time."""
        for stack, run in stacks.items():
            assert run.cfg is not None
            overrun_until = monitoring.run_minutes(run.cfg) * 60 + 3600
            for kind, entries in (
                ("stall", simulate(run, until=7200, stall_at=600, beat_every=61)),
                ("overrun", simulate(run, until=overrun_until, beat_every=61)),
            ):
                until = entries[-1][0]
                found = replay(run, kind, entries, until=until)
                assert len(found) == 1 and found[0][1] is None, (stack, kind, found)

    def test_a_run_that_steps_raises_nothing(self, stacks: dict[str, StackRun]) -> None:
        for stack, run in stacks.items():
            assert replay(run, "stall", simulate(run, until=3000, step_every=30), until=3000) == [], stack

    def test_a_finished_run_raises_nothing(self, stacks: dict[str, StackRun]) -> None:
        """Training ended at 20 min: the heartbeat stopped with it, so its series has no data from then on."""
        for stack, run in stacks.items():
            entries = simulate(run, until=7200, end_at=1200)
            assert replay(run, "stall", entries, until=7200) == [], stack
            assert replay(run, "overrun", entries, until=7200) == [], stack

    def test_a_stalled_run_deleted_closes_its_incident(self, stacks: dict[str, StackRun]) -> None:
        run = stacks["a4-gemma4"]
        (opened, closed), *more = replay(run, "stall", simulate(run, until=5400, stall_at=600, end_at=3000), 5400)
        assert not more and closed is not None and 3000 <= closed <= 3000 + 2 * 60, (opened, closed)

    def test_missing_data_counted_as_active_would_alert_on_a_finished_run(self, stacks: dict[str, StackRun]) -> None:
        """The check can fail: the setting that makes a finished run alert is caught by the replay."""
        run = stacks["dev"]

        def active(condition: dict[str, Any]) -> dict[str, Any]:
            threshold = {**condition["conditionThreshold"], "evaluationMissingData": "EVALUATION_MISSING_DATA_ACTIVE"}
            return {**condition, "conditionThreshold": threshold}

        assert replay(run, "stall", simulate(run, until=3600, end_at=600), 3600, change=active) != []

    def test_a_condition_outside_the_replayed_subset_is_refused(self, stacks: dict[str, StackRun]) -> None:
        condition = policy(stacks["dev"], "stall")["conditions"][0]
        absent = {"displayName": "x", "conditionAbsent": condition["conditionThreshold"]}
        with pytest.raises(UnsupportedQuery):
            replay_threshold(absent, [], 600)


class TestOverrunAlert:
    def test_a_run_past_its_expected_duration_alerts(self, stacks: dict[str, StackRun]) -> None:
        for stack, run in stacks.items():
            assert run.cfg is not None
            expected = monitoring.run_minutes(run.cfg) * 60
            until = expected + 600
            found = replay(run, "overrun", simulate(run, until=until, step_every=20), until=until)
            assert len(found) == 1 and expected < found[0][0] <= expected + 2 * 60, (stack, found)

    def test_by_default_three_quarters_of_the_deadline_or_what_the_stack_says(self) -> None:
        run = run_stack("a4-gemma4")
        assert run.cfg is not None and monitoring.run_minutes(run.cfg) == run.cfg.timeout_minutes * 3 // 4
        run = run_stack("a4-gemma4", overrides={"alertRunMinutes": 200, "alertStallMinutes": 30})
        assert policy(run, "overrun")["conditions"][0]["conditionThreshold"]["thresholdValue"] == 200 * 60
        assert policy(run, "stall")["conditions"][0]["conditionThreshold"]["thresholdValue"] == 30 * 60


class TestWhereAlertsGo:
    def test_to_alert_emails(self) -> None:
        run = run_stack("ray-gemma3-vision", overrides={**ALERT_EMAILS, **BUDGET})
        channels = [c for c in run.of_type(CHANNEL) if "-alert-email-" in c.name]
        assert [c.plain_inputs()["labels"]["email_address"] for c in channels] == ALERT_EMAILS["alertEmails"]
        for kind in ("stall", "overrun"):
            assert policy(run, kind)["notificationChannels"] == [f"{c.name}-id" for c in channels]
        assert "1 address(es) in alertEmails" in str(run.outputs["alerts"])
        shown = " ".join(str(v) for v in run.outputs.values())
        assert "oncall@example.com" not in shown and "alice@example.com" not in shown

    def test_else_to_the_budgets_channels(self) -> None:
        run = run_stack("dev", overrides=BUDGET)
        budget_channels = sorted(f"{c.name}-id" for c in run.of_type(CHANNEL))
        assert budget_channels and sorted(policy(run, "stall")["notificationChannels"]) == budget_channels
        assert "the budget's 1 address(es)" in str(run.outputs["alerts"])

    def test_else_to_the_console_only(self, stacks: dict[str, StackRun]) -> None:
        run = stacks["dev"]
        assert not run.of_type(CHANNEL) and not policy(run, "stall").get("notificationChannels")
        assert "console only (set alertEmails" in str(run.outputs["alerts"])


class TestAlertConfig:
    def test_an_alert_after_the_deadline_is_refused_with_its_fix(self) -> None:
        with pytest.raises(ConfigError) as error:
            run_stack("dev", overrides={"alertStallMinutes": 60, "alertRunMinutes": 90})
        message = str(error.value)
        assert "alertStallMinutes=60 is not below the training deadline (60 min" in message
        assert "alertRunMinutes=90" in message and "Fix: pulumi config set alertRunMinutes 45" in message

    def test_a_bad_address_is_refused(self) -> None:
        with pytest.raises(ConfigError, match=r"alertEmails entries \['oncall'\] are not email addresses"):
            run_stack("dev", overrides={"alertEmails": ["oncall"]})


# --------------------------------------------------------------------------------------------------- writers
class TestNothingNewWritesLogsOrMetrics:
    """Log-based metrics are computed by Cloud Logging from lines the platform collects anyway: the identities that
    can write logs or metrics (both are authorised on the project) are the ones the platform uses (GKE's nodes, a
    Cloud Build builder), each on its own project; the trainer and vLLM accounts can write neither.
    (roles/storage.objectUser, the trainer's on its bucket, lists monitoring.timeSeries.create: on a bucket it
    reaches no project, so it writes nothing.)"""

    @pytest.mark.slow
    def test_only_platform_identities_write_and_only_on_their_project(
        self, user_variant_runs: list[tuple[Variant, StackRun]]
    ) -> None:
        writers: set[str] = set()
        for variant, run in user_variant_runs:
            assert run.cfg is not None
            for grant in planned_grants(run, run.cfg):
                if grant.scope.name != "PROJECT" or not WRITES & permissions_of(grant.role, grant.origin):
                    continue
                account = grant.member.removeprefix("serviceAccount:").split("@")[0]
                writers.add(account.removeprefix(f"gft-{run.cfg.stack}-"))
                assert account in {f"gft-{run.cfg.stack}-node", f"gft-{run.cfg.stack}-build"}, (variant.label, grant)
                assert grant.condition is None, (variant.label, grant)
                inputs = next(r for r in run.resources if r.urn == grant.origin).plain_inputs()
                assert inputs["project"] == run.cfg.project, (variant.label, grant)
        assert writers == {"node", "build"}


class TestTheDeployManagesThemWithTheirOwnCalls:
    """The permission proof derives the deploy identity's needs from what the program declares: the new resource
    types have their calls (terraform-provider-google), and the grant for log-based metrics holds exactly those."""

    CALLS = frozenset(
        f"{service}.{kind}.{verb}"
        for service, kind in (("logging", "logMetrics"), ("monitoring", "dashboards"), ("monitoring", "alertPolicies"))
        for verb in ("create", "get", "update", "delete")
    )

    def test_every_stack_deploy_needs_them_and_no_preview_does(self, stacks: dict[str, StackRun]) -> None:
        for stack, run in stacks.items():
            assert {need.permission for need in deploy_needs(run)} >= self.CALLS, stack
            assert not self.CALLS & {need.permission for need in preview_needs(run)}, stack

    def test_the_log_metric_role_holds_only_the_metric_calls_and_the_descriptor_list(
        self, stacks: dict[str, StackRun]
    ) -> None:
        role = ci_identities()["custom_roles"]["gftCiLogMetricWriter"]
        polled = "monitoring.metricDescriptors.list"  # the wait before the alert policies
        assert set(role["permissions"]) == {c for c in self.CALLS if c.startswith("logging.")} | {polled}
        for stack, run in stacks.items():
            assert polled in {need.permission for need in deploy_needs(run)}, stack


# --------------------------------------------------------------------------------------------------- descriptor wait
class FakeMonitoring:
    """Cloud Monitoring's projects.metricDescriptors.list on 127.0.0.1: a metric type is listed only from its
    `appear_after`-th request on (as a new log-based metric reaches Monitoring a while after Logging made it);
    `status` answers every request with that HTTP status instead."""

    def __init__(self, appear_after: int, status: int = 200) -> None:
        self.requests: list[tuple[str, dict[str, list[str]], str]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                query = parse_qs(url.query)
                fake.requests.append((url.path, query, self.headers.get("Authorization", "")))
                (wanted,) = re.fullmatch(r'metric\.type = "([^"]+)"', query["filter"][0]).groups()  # type: ignore[union-attr]
                asked = sum(1 for _, q, _ in fake.requests if q["filter"] == query["filter"])
                if status != 200:
                    body: dict[str, Any] = {"error": {"code": status, "message": "Permission denied (fake)"}}
                elif asked >= appear_after:
                    body = {"metricDescriptors": [{"type": wanted, "metricKind": "DELTA"}]}
                else:
                    body = {}
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def descriptor_wait(run: StackRun) -> dict[str, Any]:
    (wait,) = [w for w in run.of_type(COMMAND) if w.plain_inputs()["create"] == DESCRIPTOR_WAIT_SCRIPT]
    return wait.plain_inputs()


def run_descriptor_wait(
    inputs: dict[str, Any], fake: FakeMonitoring, tmp_path: Path, types: list[str], wait_seconds: int = 60
) -> subprocess.CompletedProcess[str]:
    """The declared wait step's script, under bash with the real curl, `gcloud` a stand-in that prints a token."""
    assert shutil.which("curl"), "curl is needed"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    gcloud = bin_dir / "gcloud"
    gcloud.write_text('#!/bin/bash\n[ "$*" = "auth print-access-token" ] && echo fake-token-1\n')
    gcloud.chmod(0o755)
    proxies = {"HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "ALL_PROXY", "all_proxy"}
    env = {
        **{k: v for k, v in os.environ.items() if k not in proxies},
        **inputs["environment"],
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "METRIC_TYPES": " ".join(types),
        "WAIT_SECONDS": str(wait_seconds),
        "POLL_SECONDS": "0",
        "MONITORING_API": fake.url,
    }
    return subprocess.run(
        [*inputs["interpreter"], inputs["create"]], env=env, capture_output=True, text=True, timeout=60
    )


class TestDescriptorWait:
    TYPES = ("logging.googleapis.com/user/gft/dev/since_step_s", "logging.googleapis.com/user/gft/dev/elapsed_s")

    def test_returns_once_each_metric_is_listed(self, stacks: dict[str, StackRun], tmp_path: Path) -> None:
        run = stacks["dev"]
        assert run.cfg is not None
        fake = FakeMonitoring(appear_after=3)
        try:
            done = run_descriptor_wait(descriptor_wait(run), fake, tmp_path, list(self.TYPES))
        finally:
            fake.close()
        assert done.returncode == 0, done.stderr
        asked = [q["filter"][0] for _, q, _ in fake.requests]
        assert asked == [f'metric.type = "{t}"' for t in self.TYPES for _ in range(3)], asked
        assert {path for path, _, _ in fake.requests} == {f"/v3/projects/{run.cfg.project}/metricDescriptors"}
        assert {auth for _, _, auth in fake.requests} == {"Bearer fake-token-1"}

    def test_it_polls_the_types_the_policies_read(self, stacks: dict[str, StackRun]) -> None:
        for stack, run in stacks.items():
            polled = descriptor_wait(run)["environment"]["METRIC_TYPES"].split()
            read = [_metric_types(policy(run, kind)["conditions"][0]["conditionThreshold"]["filter"])[0]
                    for kind in ("stall", "overrun")]  # fmt: skip
            assert sorted(polled) == sorted(read), stack

    def test_a_refusal_fails_at_once_with_the_apis_answer(self, stacks: dict[str, StackRun], tmp_path: Path) -> None:
        fake = FakeMonitoring(appear_after=1, status=403)
        try:
            done = run_descriptor_wait(descriptor_wait(stacks["dev"]), fake, tmp_path, list(self.TYPES))
        finally:
            fake.close()
        assert done.returncode == 1 and len(fake.requests) == 1, (done.returncode, fake.requests)
        assert "answered 403" in done.stderr and "Permission denied (fake)" in done.stderr

    def test_a_metric_never_listed_fails_after_the_wait(self, stacks: dict[str, StackRun], tmp_path: Path) -> None:
        fake = FakeMonitoring(appear_after=10**9)
        try:
            done = run_descriptor_wait(descriptor_wait(stacks["dev"]), fake, tmp_path, [self.TYPES[0]], wait_seconds=1)
        finally:
            fake.close()
        assert done.returncode == 1 and len(fake.requests) >= 2, (done.returncode, len(fake.requests))
        assert f"does not know {self.TYPES[0]} after 1s" in done.stderr and "pulumi up again" in done.stderr
