"""What Cloud Logging and Cloud Monitoring do with the trainer's lines, replayed offline for the subset we declare.

- `structured_entry`: an agent's parse of one stdout line (single-line JSON → `jsonPayload`, else `textPayload`).
- `matches` / `extract`: a log filter's `=`, `:*` and `AND`; a log-based metric's `EXTRACT(field)`.
- `replay_threshold`: a metric-threshold condition on one series, evaluated as the alignment window slides;
  missing data is "not met" (EVALUATION_MISSING_DATA_INACTIVE).
- `dashboard_as_read` / `dashboard_changed`: the API's read-back of a dashboard (fields at their default left out)
  and whether the provider then plans a change.
- `unit_problem`: a metric descriptor's `unit` against the grammar the API documents.
Anything outside this subset raises `UnsupportedQuery` instead of guessing. The rules and where each was read:
docs/operations.md, "How the tests replay Logging and Monitoring". Not here: the metrics and policies
(infra/monitoring.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from infra.cloud_run import job_name
from infra.config import StackConfig, Workload
from infra.gke import cluster_name
from infra.monitoring import METRIC_PREFIX

_LABELS_FIELD = "logging.googleapis.com/labels"
EVALUATION_STEP_S = 10.0  # how often the replay evaluates a condition (the window, not this step, decides)
_SPECIAL_PREFIX = "logging.googleapis.com/"
_TERM = re.compile(r'^\s*([A-Za-z_][\w.]*)\s*(?:(=)\s*"((?:[^"\\]|\\.)*)"|(:)\*)\s*$')
_EXTRACT = re.compile(r"^EXTRACT\(([A-Za-z_][\w.]*)\)$")


class UnsupportedQuery(ValueError):
    """A filter, extractor or condition outside the subset this replay implements."""


def trainer_resource(cfg: StackConfig, pod: str = "trainer-0") -> dict[str, Any]:
    """The monitored resource the platform writes the trainer's stdout under (Cloud Logging docs, monitored resource
    types: `k8s_container` for a GKE container, `cloud_run_job` for a Cloud Run job's task)."""
    if cfg.workload is Workload.CLOUD_RUN:
        return {
            "type": "cloud_run_job",
            "labels": {"project_id": cfg.project, "location": cfg.region, "job_name": job_name(cfg)},
        }
    container = "trainer" if cfg.workload is Workload.GKE_JOB else "ray-worker"
    return {
        "type": "k8s_container",
        "labels": {
            "project_id": cfg.project,
            "location": cfg.region,
            "cluster_name": cluster_name(cfg),
            "namespace_name": cfg.namespace,
            "pod_name": pod,
            "container_name": container,
        },
    }


def structured_entry(line: str, resource: Mapping[str, Any]) -> dict[str, Any]:
    """The log entry the platform's agent writes for one stdout line of a container on `resource`."""
    entry: dict[str, Any] = {"resource": dict(resource), "severity": "DEFAULT"}
    try:
        payload = json.loads(line)
    except json.JSONDecodeError:
        payload = None
    if not isinstance(payload, dict) or "\n" in line.strip():
        entry["textPayload"] = line
        return entry
    payload = dict(payload)
    if "severity" in payload:
        entry["severity"] = str(payload.pop("severity")).upper()
    if isinstance(payload.get(_LABELS_FIELD), dict):
        entry["labels"] = payload.pop(_LABELS_FIELD)
    entry["jsonPayload"] = {key: value for key, value in payload.items() if not key.startswith(_SPECIAL_PREFIX)}
    return entry


def _field(entry: Mapping[str, Any], path: str) -> Any:
    value: Any = entry
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def matches(query: str, entry: Mapping[str, Any]) -> bool:
    """Whether the entry matches a filter of `field = "value"` / `field:*` terms joined by AND."""
    for term in re.split(r"\s+AND\s+", query.strip()):
        found = _TERM.match(term)
        if not found:
            raise UnsupportedQuery(f"term {term!r} of {query!r} is outside the replayed subset")
        path, equals, expected, exists = found.groups()
        value = _field(entry, path)
        if exists and value is None:
            return False
        if equals and (value is None or str(value) != expected.replace('\\"', '"')):
            return False
    return True


def extract(extractor: str, entry: Mapping[str, Any]) -> Any:
    """`EXTRACT(field)`: the field's value, or None when the entry has none."""
    found = _EXTRACT.match(extractor.strip())
    if not found:
        raise UnsupportedQuery(f"extractor {extractor!r} is outside the replayed subset")
    value = _field(entry, found.group(1))
    return None if isinstance(value, (dict, list)) else value


@dataclass(frozen=True)
class Point:
    """One value a log-based metric recorded: when (seconds), its labels, the value."""

    at: float
    labels: dict[str, str]
    value: float


def series_of(metric: Mapping[str, Any], resource_type: str) -> dict[str, Any]:
    """What a Monitoring filter sees of a log-based metric's series (`metric.type`, `resource.type`)."""
    return {"metric": {"type": METRIC_PREFIX + str(metric["name"])}, "resource": {"type": resource_type}}


def record(metric: Mapping[str, Any], timed_entries: Iterable[tuple[float, Mapping[str, Any]]]) -> list[Point]:
    """What a DELTA DISTRIBUTION log-based metric (its plain inputs) records from (time, entry) pairs."""
    descriptor = metric.get("metricDescriptor") or {}
    if (descriptor.get("metricKind"), descriptor.get("valueType")) != ("DELTA", "DISTRIBUTION"):
        raise UnsupportedQuery(f"{metric.get('name')}: only DELTA DISTRIBUTION metrics are replayed")
    extractors = metric.get("labelExtractors") or {}
    points = []
    for at, entry in timed_entries:
        if not matches(metric["filter"], entry):
            continue
        raw = extract(metric["valueExtractor"], entry)
        try:
            value = float(raw)
        except (TypeError, ValueError):
            continue
        labels = {key: str(extract(expr, entry) or "") for key, expr in extractors.items()}
        points.append(Point(at, labels, value))
    return points


@dataclass(frozen=True)
class Verdict:
    """A condition's state at the end of one alignment period."""

    at: float
    value: float | None
    met: bool


def replay_threshold(condition: Mapping[str, Any], points: list[Point], until: float) -> list[Verdict]:
    """Replay a conditionThreshold (plain inputs of one policy condition) over one series, period by period."""
    threshold = condition.get("conditionThreshold")
    if threshold is None:
        raise UnsupportedQuery("only conditionThreshold conditions are replayed")
    aggregations = threshold.get("aggregations") or []
    if (
        len(aggregations) != 1
        or aggregations[0].get("perSeriesAligner") != "ALIGN_MEAN"
        or aggregations[0].get("crossSeriesReducer", "REDUCE_NONE") != "REDUCE_NONE"
    ):
        raise UnsupportedQuery(
            f"aggregations {aggregations} are outside the replayed subset (one ALIGN_MEAN per series)"
        )
    if threshold.get("comparison") != "COMPARISON_GT":
        raise UnsupportedQuery(f"comparison {threshold.get('comparison')} is outside the replayed subset")
    missing_active = threshold.get("evaluationMissingData") == "EVALUATION_MISSING_DATA_ACTIVE"
    if threshold.get("evaluationMissingData") not in (
        "EVALUATION_MISSING_DATA_INACTIVE",
        "EVALUATION_MISSING_DATA_ACTIVE",
    ):
        raise UnsupportedQuery("an unset evaluationMissingData keeps the last state: not replayed")
    period = _seconds(aggregations[0]["alignmentPeriod"])
    duration = _seconds(threshold.get("duration") or "0s")
    limit = float(threshold["thresholdValue"])
    verdicts: list[Verdict] = []
    at = EVALUATION_STEP_S
    while at <= until:
        inside = [p.value for p in points if at - period < p.at <= at]
        value = sum(inside) / len(inside) if inside else None
        violated = missing_active if value is None else value > limit
        verdicts.append(Verdict(at, value, violated))
        at += EVALUATION_STEP_S
    window = int(duration // EVALUATION_STEP_S) + 1
    return [
        Verdict(v.at, v.value, i + 1 >= window and all(w.met for w in verdicts[i + 1 - window : i + 1]))
        for i, v in enumerate(verdicts)
    ]


def incidents(verdicts: list[Verdict]) -> list[tuple[float, float | None]]:
    """(opened, closed) per incident: opened when the condition becomes met, closed when it no longer is."""
    found: list[tuple[float, float | None]] = []
    opened: float | None = None
    for verdict in verdicts:
        if verdict.met and opened is None:
            opened = verdict.at
        elif not verdict.met and opened is not None:
            found.append((opened, verdict.at))
            opened = None
    if opened is not None:
        found.append((opened, None))
    return found


def _seconds(duration: str) -> float:
    if not duration.endswith("s"):
        raise UnsupportedQuery(f"duration {duration!r} is not in seconds")
    return float(duration[:-1])


def dashboard_as_read(document: Mapping[str, Any], dashboard_id: str = "projects/1/dashboards/d") -> dict[str, Any]:
    """The dashboard as projects.dashboards.get returns it: default values (0, "", false, [], {}) left out."""

    def read(value: Any) -> Any:
        if isinstance(value, Mapping):
            kept = {key: read(item) for key, item in value.items()}
            return {key: item for key, item in kept.items() if item not in (0, "", False, [], {}) or item is True}
        if isinstance(value, list):
            return [read(item) for item in value]
        return value

    return {**read(document), "name": dashboard_id, "etag": "e1"}


def dashboard_changed(read: Mapping[str, Any], configured: Mapping[str, Any]) -> bool:
    """Whether the provider plans an update of a dashboard read as `read` and configured as `configured`."""

    def without_computed(old: Any, new: Any) -> Any:  # removeComputedKeys
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            return {key: without_computed(value, new[key]) for key, value in old.items() if new.get(key) is not None}
        if isinstance(old, list) and isinstance(new, list):
            return [without_computed(o, new[i]) if i < len(new) else o for i, o in enumerate(old)]
        return old

    def numbers(value: Any) -> Any:  # JSON numbers decode to float64 on both sides
        if isinstance(value, Mapping):
            return {key: numbers(item) for key, item in value.items()}
        if isinstance(value, list):
            return [numbers(item) for item in value]
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    return numbers(without_computed(dict(read), dict(configured))) != numbers(dict(configured))


_PREFIXES = [
    "k",
    "M",
    "G",
    "T",
    "P",
    "E",
    "Z",
    "Y",
    "m",
    "u",
    "n",
    "p",
    "f",
    "a",
    "z",
    "y",
    "Ki",
    "Mi",
    "Gi",
    "Ti",
    "Pi",
]
_UNITS = ("bit", "By", "s", "min", "h", "d", "1")
_ANNOTATION = r"\{[!-z|~]+\}"  # printable ASCII without { }
_COMPONENT = re.compile(
    rf"^(?:(?:(?:{'|'.join(_PREFIXES)})?(?:{'|'.join(_UNITS)})|%)(?:{_ANNOTATION})?|{_ANNOTATION}|1)$"
)


def unit_problem(unit: str) -> str | None:
    """None when `unit` follows MetricDescriptor.unit's grammar, else what is wrong with it."""
    if not unit:
        return None
    factors, *divisors = unit.split("/")
    for component in [*factors.split("."), *divisors]:
        if not _COMPONENT.match(component):
            return f"{component!r} in {unit!r} is no UNIT, PREFIX UNIT, %, {{annotation}} or 1 of MetricDescriptor.unit"
    return None
