"""A paid run starts only when the user asked for it (DESIGN.md), and the preview says in one line whether one does.

A run is named by its recipe file, the repository data it reads, its overrides and `runGeneration`
(infra/run_identity.py), never by the trainer image: a `git pull` that changes trainer/ must not start the W1
run again (about $1,200 at the plan's ceiling), perhaps in an `up` made only to turn serving on. And the first
`up` after this change of the formula must not either: the stack's run folders were named by the older one.
The bucket is the mock cloud's (infra/offline/engine.py), holding what the trainer and the program wrote.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from infra.foundation import FINISHED_OUTPUT, RUN_MARKER
from infra.offline import impact
from infra.offline.engine import Recorded, StackRun, run_stack
from infra.run_identity import RUN_KEY_FILE
from trainer.cost_line import PRICE_FILE
from trainer.recipe import recipe_sha256

STACKS = ("dev", "a4-gemma4", "ray-gemma3-vision")
WORKLOADS = ("kubernetes:batch/v1:Job", "kubernetes:ray.io/v1:RayJob")
RUN_NAME = {"dev": "runUri", "a4-gemma4": "runDir", "ray-gemma3-vision": "runDir"}
# The GKE name prefixes and lengths the older formula used (infra/gke_job.py, infra/ray_job.py at the parent commit).
LEGACY_NAMES = {"a4-gemma4": ("train", 56), "ray-gemma3-vision": ("ft", 40)}


def bucket(stack: str) -> str:
    return f"my-gcp-project-gft-{stack}"


def up(stack: str, objects: dict[str, str] | None = None, what_if: str | None = None, **overrides: Any) -> StackRun:
    with impact.repository_changed(what_if):
        return run_stack(stack, overrides=overrides, existing_buckets=(bucket(stack),), bucket_objects=objects)


def folder(run: StackRun) -> str:
    """The run's folder under the bucket, from the outputs."""
    return str(run.outputs[RUN_NAME[run.stack]]).removeprefix(f"gs://{bucket(run.stack)}/")


def starts_training(run: StackRun) -> bool:
    """A Job, a RayJob or the Cloud Run execution step is declared."""
    declared = [r for r in run.resources if r.type in WORKLOADS or r.name.endswith("-execution")]
    return bool(declared)


def records(run: StackRun) -> list[Recorded]:
    """The run records (`runs/<run>/_RUN_KEY.json`) the program declares."""
    return [
        r
        for r in run.resources
        if r.type == "gcp:storage/bucketObject:BucketObject"
        and str(r.plain_inputs().get("name", "")).endswith(f"/{RUN_KEY_FILE}")
    ]


def written(run: StackRun, before: StackRun | None = None) -> dict[str, str]:
    """The records `run`'s `up` writes into the bucket, with the content the engine sends after an `up` of `before`:
    an `ignore_changes` input keeps the old state's value even in a replacement (`impact.sent_inputs`)."""
    olds = {r.urn: r for r in before.resources} if before is not None else {}
    sent = [impact.sent_inputs(r, olds.get(r.urn)) for r in records(run)]
    return {f"{bucket(run.stack)}/{inputs['name']}": inputs["content"] for inputs in sent}


def finished(run: StackRun, before: StackRun | None = None) -> dict[str, str]:
    """The bucket after `run` (an `up` made after `before`) finished: its record (as the engine wrote it), price file
    and completion marker."""
    where = folder(run)
    return {
        f"{bucket(run.stack)}/{where}/{PRICE_FILE}": "{}",
        f"{bucket(run.stack)}/{where}/{RUN_MARKER}": '{"completed_at": 1}',
        **written(run, before),
    }


@pytest.mark.parametrize("stack", STACKS)
def test_a_trainer_pull_starts_no_finished_run_again(stack: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """(`monkeypatch`: the trainer edit is a patch, so no run of this test is reused from another.)"""
    first = up(stack)
    pulled = up(stack, finished(first), what_if="trainer")
    assert folder(pulled) == folder(first), "a trainer update names the same run"
    assert not starts_training(pulled), "the finished run would be trained again"
    assert FINISHED_OUTPUT in pulled.outputs
    line = pulled.outputs["paidRun"]
    assert line.startswith("no paid run starts: run ") and "the trainer image changed since it started" in line, line
    assert "runGeneration 1" in line, "the line says how to train again"


@pytest.mark.parametrize("stack", ("dev", "a4-gemma4"))
def test_a_trainer_pull_during_a_run_says_whether_it_restarts(stack: str) -> None:
    """On GKE the pull replaces the Job (the RayJob alike: `GKE_WORKLOAD_KIND`), its pod template holding the image:
    the line says the run restarts from its last checkpoint. A Cloud Run execution under way keeps its image."""
    first = up(stack)
    running = {**written(first), f"{bucket(stack)}/{folder(first)}/{PRICE_FILE}": "{}"}
    pulled = up(stack, running, what_if="trainer")
    line = pulled.outputs["paidRun"]
    assert folder(pulled) == folder(first) and line.startswith("no new paid run starts"), line
    workloads = [i for i in impact.classify(first, pulled).values() if i.type in WORKLOADS and i.action == "replace"]
    restarts = "the trainer image changed since it started: a " in line and "restarts the run from its last" in line
    assert restarts == bool(workloads) == (stack != "dev"), (line, workloads)


def test_a_run_generation_trains_it_again() -> None:
    first = up("a4-gemma4")
    again = up("a4-gemma4", finished(first), runGeneration=1)
    assert folder(again) != folder(first) and starts_training(again)
    line = again.outputs["paidRun"]
    assert line.startswith("a paid training run starts") and "runGeneration changed" in line, line


def test_the_next_up_finds_a_new_run_under_its_own_record() -> None:
    """The `up` that starts a new run writes that run's key into its folder, so the next `up` sees the run going on,
    then finished, and a return to the first run's inputs finds the first run (its record names them). The record is
    the same code on every stack: the most expensive one stands for them."""
    stack = "a4-gemma4"
    first = up(stack)
    bucket_then = finished(first)
    second = up(stack, bucket_then, runGeneration=1)
    assert starts_training(second) and folder(second) != folder(first)
    running = {**bucket_then, **written(second, before=first), f"{bucket(stack)}/{folder(second)}/{PRICE_FILE}": "{}"}
    third = up(stack, running, runGeneration=1)
    assert folder(third) == folder(second)
    assert third.outputs["paidRun"].startswith("no new paid run starts"), third.outputs["paidRun"]
    done = {**running, f"{bucket(stack)}/{folder(second)}/{RUN_MARKER}": '{"completed_at": 2}'}
    fourth = up(stack, done, runGeneration=1)
    assert not starts_training(fourth) and " has finished " in fourth.outputs["paidRun"], fourth.outputs["paidRun"]
    back = up(stack, done)
    assert folder(back) == folder(first) and not starts_training(back), back.outputs["paidRun"]


def test_new_overrides_are_a_new_run_and_say_so() -> None:
    first = up("dev")
    changed = up("dev", finished(first), recipeOverrides=["training.seed=7"])
    assert folder(changed) != folder(first) and starts_training(changed)
    assert "recipeOverrides changed since run" in changed.outputs["paidRun"]


def legacy_name(stack: str, run: StackRun) -> str:
    """The run's name as the program named runs before run_identity: a hash that included the trainer image's
    content (infra/gke_workload.py `run_name`, infra/cloud_run.py `run_id` at the parent commit), here for an
    image built from another trainer/ than this checkout's."""
    cfg = run.cfg
    assert cfg is not None
    identity = {"image": "trainer:" + "e" * 64, "recipe": recipe_sha256(cfg.recipe_source), "overrides": []}
    if stack == "dev":
        return f"{cfg.recipe}-{hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]}"
    identity |= {"recipe": cfg.recipe, "recipe_sha256": recipe_sha256(cfg.recipe_source)}
    identity |= {"gpu_type": cfg.gpu_type, "gpus_per_node": cfg.gpus_per_node, "nodes": cfg.nodes}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
    prefix, max_len = LEGACY_NAMES[stack]
    return f"{prefix}-{cfg.recipe[: max_len - len(prefix) - len(digest) - 2].rstrip('-')}-{digest}"


@pytest.mark.parametrize("stack", STACKS)
class TestUpgradeFromImageNamedRuns:
    """The first `up` after pulling the change that stopped naming runs by the image."""

    def test_a_finished_run_stays_finished(self, stack: str) -> None:
        name = legacy_name(stack, up(stack))
        objects = {
            f"{bucket(stack)}/runs/{name}/{PRICE_FILE}": "{}",
            f"{bucket(stack)}/runs/{name}/{RUN_MARKER}": '{"completed_at": 1}',
        }
        pulled = up(stack, objects)
        assert not starts_training(pulled), "a new paid run after an upgrade"
        assert folder(pulled) == f"runs/{name}"
        line = pulled.outputs["paidRun"]
        assert "named by an earlier version of this program) has finished" in line, line
        record = pulled.by_name(f"gft-{stack}-run-key-{name}")
        assert record.plain_inputs()["name"] == f"runs/{name}/_RUN_KEY.json", "adopted for good"
        assert record.retain_on_delete

    def test_a_running_run_keeps_its_name(self, stack: str) -> None:
        name = legacy_name(stack, up(stack))
        pulled = up(stack, {f"{bucket(stack)}/runs/{name}/{PRICE_FILE}": "{}"})
        assert folder(pulled) == f"runs/{name}" and starts_training(pulled)
        assert pulled.outputs["paidRun"].startswith("no new paid run starts"), pulled.outputs["paidRun"]

    def test_after_the_upgrade_a_new_recipe_is_a_new_run(self, stack: str) -> None:
        """Once the stack's run carries its record, the older folders are history: a change is a new run."""
        first = up(stack)
        name = legacy_name(stack, first)
        objects = {f"{bucket(stack)}/runs/{name}/{RUN_MARKER}": "{}", **finished(first)}
        changed = up(stack, objects, recipeOverrides=["training.seed=7"])
        assert folder(changed) not in (f"runs/{name}", folder(first)) and starts_training(changed)


@pytest.mark.parametrize("stack", STACKS)
def test_a_preview_prints_the_line(stack: str) -> None:
    preview = run_stack(stack, preview=True)
    line = preview.outputs["paidRun"]
    assert line.startswith("a paid training run starts") and "has no run in this stack's bucket yet" in line
