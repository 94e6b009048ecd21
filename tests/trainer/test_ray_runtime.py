"""The Ray runtime the RayJob gets: the image's exact Ray, a head KubeRay can probe, the planned entrypoint.

Why it matters: every mock and schema check passes while a head without the dashboard's packages never
becomes ready (`ray[train]` alone lacks the `default` extra; docs/distributed.md#ray-tests-on-a-real-cluster).

- One Ray version: the image's and the dev venv's pins, installed Ray, `trainer.ray_entry.RAY_VERSION`, the
  stack's default and stack-file `rayVersion`, the rendered RayJob's; the `default` extra in both files.
- The shared cluster (tests/trainer/conftest.py `ray_cluster`) is started from the plan's rayStartParams
  as KubeRay starts it; KubeRay's own probe commands must pass on the head.
- The RayJob's `spec.entrypoint`, from the offline plan, is submitted as KubeRay's K8sJobMode submitter does,
  with flags a user could append (2 CPU workers, local storage) and the stack's recipeOverrides making the
  recipe tiny (QLoRA, the vision collator and gradient checkpointing stay on). The job must SUCCEED.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.trainer.ray_cluster import GCS_HEALTH_PATH, RAY, RAYLET_HEALTH_PATH, REPO, node_environment
from trainer.ray_entry import RAY_VERSION

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def ray_pin(path: Path) -> tuple[set[str], str]:
    match = re.search(r"^ray\[([^\]]*)\]==(\S+)", path.read_text(), re.M)
    assert match, f"{path.name} has no pinned ray[...] requirement"
    return {extra.strip() for extra in match.group(1).split(",")}, match.group(2)


class TestOneRayVersion:
    def test_image_and_dev_venv_pin_the_same_ray_with_the_dashboard(self):
        for path in (REPO / "trainer/requirements-gpu.txt", REPO / "requirements-dev.txt"):
            extras, version = ray_pin(path)
            assert {"default", "train"} <= extras, f"{path.name}: ray[{','.join(sorted(extras))}] has no dashboard"
            assert version == RAY_VERSION, (
                f"{path.name} pins ray {version}, trainer.ray_entry.RAY_VERSION={RAY_VERSION}"
            )

    def test_installed_ray_is_the_pinned_one(self):
        import ray
        import ray.dashboard.optional_deps  # what Ray imports to decide the dashboard starts

        assert ray.__version__ == RAY_VERSION

    def test_stack_files_and_default_config(self):
        from infra.config import StackConfig

        schema = yaml.safe_load((REPO / "Pulumi.yaml").read_text())["config"]["rayVersion"]
        assert str(schema["default"]) == RAY_VERSION
        assert StackConfig.model_fields["ray_version"].default == RAY_VERSION
        stack = yaml.safe_load((REPO / "Pulumi.ray-gemma3-vision.yaml").read_text())["config"]
        assert str(stack.get("gemma-finetune:rayVersion", RAY_VERSION)) == RAY_VERSION

    @pytest.mark.slow  # the session plan is shared with the cluster; tests/infra/test_ray_job.py checks it fast
    def test_rendered_rayjob(self, ray_plan):
        assert ray_plan.ray_version == RAY_VERSION


@pytest.mark.slow
def test_head_answers_kuberays_probes(ray_cluster):
    """The exec probes KubeRay injects into the head (raylet via the dashboard agent, GCS via the dashboard)."""
    for port, path in (
        (ray_cluster.head_agent_port, RAYLET_HEALTH_PATH),
        (ray_cluster.dashboard_port, GCS_HEALTH_PATH),
    ):
        done = ray_cluster.probe_as_kubelet(port, path)
        assert done.returncode == 0 and "success" in done.stdout, (path, done.stdout, done.stderr)
    done = ray_cluster.probe_as_kubelet(ray_cluster.worker_agent_port, RAYLET_HEALTH_PATH)
    assert done.returncode == 0, ("the worker's raylet probe", done.stdout, done.stderr, ray_cluster.logs())


def _submit_and_wait(dashboard_url: str, submission_id: str, entrypoint: str) -> str:
    """`ray job submit` as the RayJob's submitter does; the job's logs once it SUCCEEDED."""
    from ray.job_submission import JobSubmissionClient

    submit = f"{RAY} job submit --address {dashboard_url} --no-wait --submission-id {submission_id} -- {entrypoint}"
    done = subprocess.run(["bash", "-c", submit], env=node_environment(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr

    client = JobSubmissionClient(dashboard_url)
    deadline = time.monotonic() + 1000
    while (status := str(client.get_job_status(submission_id).value)) not in TERMINAL:
        assert time.monotonic() < deadline, f"job still {status}\n{client.get_job_logs(submission_id)[-4000:]}"
        time.sleep(0.5)  # one HTTP status call: the job's end is seen within 0.5 s instead of 2
    logs = client.get_job_logs(submission_id)
    assert status == "SUCCEEDED", logs[-6000:]
    return logs


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_planned_entrypoint_succeeds_through_job_submission(ray_cluster, ray_plan, tmp_path):
    """The planned entrypoint trains through a real submission; submitted again (an `up` after `destroy`
    recreates the RayJob with the same run), it finds the run's marker and starts no worker."""
    from trainer.checkpoints import RUN_MARKER

    out, storage = tmp_path / "out", tmp_path / "ray"
    entrypoint = (
        f"{ray_plan.entrypoint} --num-workers 2 --no-use-gpu --storage-path {storage} "
        f"--set distributed.world_size=2 --set output.dir={out}"
    )
    _submit_and_wait(ray_cluster.dashboard_url, f"{ray_plan.run_name}-test", entrypoint)

    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["ray_workers"] == 2 and summary["steps"] == 2
    assert summary["loaded_in_4bit"] is True, "the W2 recipe is QLoRA"
    assert summary["ddp_find_unused_parameters"] is False, "DDP wraps the model, without the unused-parameter search"
    assert summary["epoch"] == 2 * 2 / 8, "2 workers share the 8 rows (DDP), 1 row each per step"
    assert summary["final_train_loss"] is not None

    from safetensors.torch import load_file

    from trainer.recipe import load_recipe

    words = shlex.split(ray_plan.entrypoint)
    planned_recipe = words[words.index("--recipe") + 1]

    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    lora_b = [t for k, t in adapter.items() if "lora_B" in k]
    assert lora_b and any(float(t.abs().sum()) > 0 for t in lora_b), "LoRA B is still zero: nothing trained"
    # W2 adapts the vision tower too, as its seed's all-linear did (lora.vision_tower)
    assert any("vision_tower" in k for k in adapter) == load_recipe(planned_recipe).lora.vision_tower
    assert (out / "adapter" / "processor_config.json").exists()
    checkpoints = list((storage / ray_plan.run_name).glob("checkpoint_*/checkpoint/adapter_model.safetensors"))
    assert checkpoints, "no checkpoint reached Ray's storage"

    marker = json.loads((out / RUN_MARKER).read_text())  # written last, by rank 0
    assert marker["summary"] == summary and marker["adapter_dir"] == str(out / "adapter"), marker
    written = {p: p.stat().st_mtime_ns for p in [*out.rglob("*"), *storage.rglob("*")]}
    again = _submit_and_wait(ray_cluster.dashboard_url, f"{ray_plan.run_name}-again", entrypoint)
    assert "already holds a finished run" in again, again[-4000:]
    after = {p: p.stat().st_mtime_ns for p in [*out.rglob("*"), *storage.rglob("*")]}
    assert after == written, "the second submission trained or wrote again"
