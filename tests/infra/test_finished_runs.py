"""`pulumi up` → the run completes → `pulumi destroy` → `pulumi up` starts no workload for the finished run.

The run's folder in the kept bucket holds `_RUN_COMPLETE.json` (the trainer writes it last,
trainer/checkpoints.py); the second `up` lists it (foundation.finished_run) and declares no Cloud Run
execution, no Job, no RayJob, while every output still points at the run's folder and model. The Ray
entry point, started by hand on a finished run, exits before Ray starts a worker.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from infra import foundation
from infra.offline.engine import StackRun, run_stack, stack_names
from tests.infra.conftest import PREBUILT
from tests.infra.test_lifecycle import accounts_kept_after_destroy, kept_after_destroy

JOB = "kubernetes:batch/v1:Job"
RAYJOB = "kubernetes:ray.io/v1:RayJob"
RAYCLUSTER = "kubernetes:ray.io/v1:RayCluster"
# outputs that say where the run and its model are
WHERE = ("runId", "runUri", "modelUri", "runDir", "adapter", "jobName", "rayJobName", "checkpoints", "bucket")


def workloads(run: StackRun) -> list[str]:
    """What starts GPUs: the Cloud Run execution step, a Job, a RayJob."""
    found = [r.urn for r in run.resources if r.type in (JOB, RAYJOB)]
    return found + [r.urn for r in run.of_type("command:local:Command") if r.name.endswith("-execution")]


def run_folder(run: StackRun) -> str:
    """The run's folder relative to the bucket, from the stack outputs."""
    uri = str(run.outputs.get("runUri") or run.outputs["runDir"])
    return uri.removeprefix(str(run.outputs["bucket"]) + "/")


def up(stack: str, objects: dict[str, str] | None = None, after: StackRun | None = None, **extra: Any) -> StackRun:
    kept = (kept_after_destroy(after), accounts_kept_after_destroy(after)) if after else ((), ())
    return run_stack(
        stack,
        overrides={**PREBUILT, **extra},
        existing_buckets=kept[0],
        existing_accounts=kept[1],
        bucket_objects=objects,
    )


def completed(run: StackRun) -> dict[str, str]:
    """The bucket after the run finished: its marker at the top of its folder."""
    bucket = str(run.outputs["bucket"]).removeprefix("gs://")
    return {f"{bucket}/{run_folder(run)}/{foundation.RUN_MARKER}": '{"completed_at": 1}'}


def test_infra_and_trainer_agree_on_the_marker() -> None:
    from trainer.checkpoints import RUN_MARKER

    assert foundation.RUN_MARKER == RUN_MARKER


@pytest.mark.parametrize(
    "stack,extra",
    [(s, {}) for s in stack_names()] + [("ray-gemma3-vision", {"rayCluster": "standing"})],
    ids=[*stack_names(), "ray-standing"],
)
def test_up_after_destroy_starts_nothing_for_a_finished_run(stack: str, extra: dict[str, Any]) -> None:
    first = up(stack, **extra)
    assert workloads(first), "the first up starts the run"
    second = up(stack, completed(first), after=first, **extra)
    assert workloads(second) == [], "a finished run must not be started again"
    assert str(second.outputs["trainingState"]).startswith(f"finished ({first.outputs['bucket']}/{run_folder(first)}/")
    for key in WHERE:
        assert second.outputs.get(key) == first.outputs.get(key), key
    if extra.get("rayCluster") == "standing":
        assert second.of_type(RAYCLUSTER), "the standing cluster is the user's: it stays"
    # the price the run ran with stays: its marker's cost line came from it (an insert would overwrite it)
    price = "gcp:storage/bucketObject:BucketObject"
    assert any(o.plain_inputs()["name"].endswith("/_PRICE.json") for o in first.of_type(price)), first.of_type(price)
    assert not [o for o in second.of_type(price) if o.plain_inputs()["name"].endswith("/_PRICE.json")]


@pytest.mark.parametrize("stack,name_key", [("a4-gemma4", "jobName"), ("ray-gemma3-vision", "rayJobName")])
def test_a_finished_gke_run_points_its_logs_at_cloud_logging(stack: str, name_key: str, tmp_path: Path) -> None:
    """No Job of the finished run exists after destroy: `kubectl logs` would find nothing, Cloud Logging has them."""
    first = up(stack)
    second = up(stack, completed(first), after=first)
    assert first.outputs["logs"].startswith("kubectl logs -f job/"), first.outputs["logs"]
    logs = str(second.outputs["logs"])
    job = second.outputs[name_key]
    assert logs.startswith("gcloud logging read ") and f'labels."k8s-pod/job-name"="{job}"' in logs, logs
    status = second.outputs.get("status", second.outputs.get("rayJobStatus"))
    assert str(status).startswith("finished (gs://"), status
    if shutil.which("gcloud"):  # the real gcloud parses it: with no account it stops at asking for one
        env = {**os.environ, "CLOUDSDK_CONFIG": str(tmp_path), "CLOUDSDK_CORE_DISABLE_PROMPTS": "1"}
        done = subprocess.run(shlex.split(logs), env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and "active account" in done.stderr, done.stderr


@pytest.mark.parametrize("stack", stack_names())
def test_an_unfinished_run_in_the_kept_bucket_starts_again(stack: str) -> None:
    first = up(stack)
    bucket = str(first.outputs["bucket"]).removeprefix("gs://")
    # checkpoints, no marker: the run stopped (destroy while training) and must resume
    objects = {f"{bucket}/{run_folder(first)}/checkpoints/checkpoint-10/adapter_model.safetensors": "x"}
    second = up(stack, objects, after=first)
    assert len(workloads(second)) == len(workloads(first))
    assert "trainingState" not in second.outputs


def test_a_fresh_bucket_is_not_listed_for_markers() -> None:
    first = up("dev")
    listed = [args for token, args in first.invokes if token == "gcp:storage/getBucketObjects:getBucketObjects"]
    assert not any(str(a.get("prefix", "")).endswith(foundation.RUN_MARKER) for a in listed)


class TestRayEntryPoint:
    RECIPE = "product-descriptions-gemma3-4b"

    def _main(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, list[Any]]:
        from trainer import ray_entry

        started: list[Any] = []
        monkeypatch.setattr(ray_entry, "run", lambda spec, *a, **k: started.append(spec) or _Result())
        rc = ray_entry.main(["--recipe", self.RECIPE, "--set", f"output.dir={tmp_path}"])
        return rc, started

    def test_a_finished_run_exits_before_ray_starts(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        (tmp_path / foundation.RUN_MARKER).write_text('{"completed_at": 1}')
        rc, started = self._main(tmp_path, monkeypatch)
        assert rc == 0 and started == []

    def test_an_unfinished_run_trains(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        rc, started = self._main(tmp_path, monkeypatch)
        assert rc == 0 and len(started) == 1

    def test_a_worker_group_restarted_after_the_marker_trains_nothing(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Ray Train restarts every worker of a group when one fails, even after rank 0 wrote the marker."""
        from trainer import ray_entry

        def no_training(*args: Any) -> Any:
            raise AssertionError("a worker of a finished run built a trainer")

        monkeypatch.setattr(ray_entry, "build_vision_trainer", no_training)
        config = {"recipe": self.RECIPE, "overrides": [f"output.dir={tmp_path / 'out'}"]}
        (tmp_path / "out").mkdir()
        with pytest.raises(AssertionError, match="built a trainer"):
            ray_entry.train_loop_per_worker(config)  # the check can fail: unfinished, it builds one
        (tmp_path / "out" / foundation.RUN_MARKER).write_text('{"completed_at": 1}')
        assert ray_entry.train_loop_per_worker(config) is None


class _Result:
    checkpoint = None
    metrics = None
    error = None
