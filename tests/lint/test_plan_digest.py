"""`.ci/plan_digest.py`: the digest that ties deploy.yml's apply job to the preview its reviewers read.

The events are written in the engine event log's format and read back with the Automation API's own parser
(pulumi.automation.events.EngineEvent.from_json, the reader of the same `--event-log` file), so the fields the
digest uses are the ones Pulumi writes.
"""

from __future__ import annotations

import json
from typing import Any

from pulumi.automation.events import EngineEvent, OpType

from tests.lint.conftest import ci_module

plan_digest = ci_module("plan_digest")

BUCKET = "urn:pulumi:dev::gemma-finetune::gcp:storage/bucket:Bucket::gft-dev-bucket"
JOB = "urn:pulumi:dev::gemma-finetune::gcp:cloudrunv2/job:Job::train"


def step(op: str, urn: str, diffs: list[str] | None = None, detailed: dict[str, str] | None = None) -> dict[str, Any]:
    metadata = {
        "op": op,
        "urn": urn,
        "type": urn.split("::")[2],
        "provider": "",
        "diffs": diffs or [],
        "detailedDiff": {key: {"diffKind": kind, "inputDiff": True} for key, kind in (detailed or {}).items()},
    }
    return {"sequence": 1, "timestamp": 1700000000, "resourcePreEvent": {"metadata": metadata}}


def log(*events: dict[str, Any]) -> str:
    lines = [{"sequence": 0, "timestamp": 1, "preludeEvent": {"config": {}}}, *events]
    for line in lines:  # each is an event the Automation API reads
        EngineEvent.from_json(line)
    return "".join(json.dumps(line) + "\n" for line in lines)


def test_the_fields_are_the_ones_pulumi_writes() -> None:
    event = EngineEvent.from_json(step("update", JOB, ["template"], {"template.containers": "update"}))
    assert event.resource_pre_event is not None
    metadata = event.resource_pre_event.metadata
    assert metadata.op is OpType.UPDATE and metadata.urn == JOB and metadata.diffs == ["template"]
    assert plan_digest.steps(log(step("update", JOB, ["template"], {"template.containers": "update"}))) == [
        ("update", JOB, "gcp:cloudrunv2/job:Job", ("template", "template.containers:update"))
    ]


def test_the_same_plan_has_the_same_digest_whatever_the_order_and_times() -> None:
    first = log(step("create", BUCKET), step("update", JOB, ["template"]), step("same", JOB.replace("train", "x")))
    again = [step("update", JOB, ["template"]), step("create", BUCKET)]
    again[0]["sequence"], again[0]["timestamp"] = 9, 1800000000
    assert plan_digest.digest(first) == plan_digest.digest(log(*again))


def test_any_change_to_the_plan_changes_the_digest() -> None:
    reviewed = log(step("create", BUCKET), step("update", JOB, ["template"]))
    variants = [
        log(step("create", BUCKET), step("update", JOB, ["template"]), step("delete", JOB.replace("train", "old"))),
        log(step("create", BUCKET), step("replace", JOB, ["template"])),
        log(step("create", BUCKET), step("update", JOB, ["template", "labels"])),
        log(step("create", BUCKET), step("update", JOB, ["template"], {"template": "delete"})),
        log(step("create", BUCKET)),
    ]
    digests = {plan_digest.digest(text) for text in variants}
    assert plan_digest.digest(reviewed) not in digests and len(digests) == len(variants)


def test_a_plan_of_no_changes_is_not_a_plan_of_one(tmp_path: Any, capsys: Any) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(log(step("same", BUCKET)))
    assert plan_digest.main([str(path)]) == 0
    nothing = capsys.readouterr().out.strip()
    path.write_text(log(step("create", BUCKET)))
    plan_digest.main(["--list", str(path)])
    assert capsys.readouterr().out.strip() == f"create {BUCKET}"
    assert nothing == plan_digest.digest(log()) != plan_digest.digest(log(step("create", BUCKET)))
