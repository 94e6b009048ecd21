"""`python -m trainer.ray_entry`: its arguments, the vision trainer it builds, and an interrupted Ray run.

Why it matters: the RayJob runs this on 16 GPUs and a preempted worker must not cost the run.
Here the W2 recipe's real path (QLoRA 4-bit through bitsandbytes on the CPU, our vision collator,
gradient checkpointing, DDP over gloo) runs on a tiny random Gemma 3 vision model with 2 Ray
Train workers on the tests' shared KubeRay-like cluster (tests/trainer/ray_cluster.py, the image's
Ray). The run is interrupted after a checkpoint while rank 0 is a slow writer, and Ray's restart
must resume it: the step continues, the restored adapter equals the one saved, and every file
Ray holds was handed over once, complete.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tests.trainer.ray_worker_probes import (
    ATTEMPT_FILE,
    BEGIN_WEIGHTS,
    REPORT_FILE,
    SAVED_WEIGHTS,
    InterruptedRun,
    sha256,
)
from trainer.checkpoints import RUN_MARKER
from trainer.ray_entry import parse_args, rank_checkpoint_files
from trainer.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
RECIPE = "product-descriptions-gemma3-4b"


class TestArguments:
    def test_cli(self):
        spec = parse_args(
            ["--recipe", RECIPE, "--num-workers", "16", "--use-gpu", "--accelerator-type", "B200",
             "--storage-path", "gs://b/ray", "--set", "training.max_steps=3"],
            env={},
        )  # fmt: skip
        assert (spec.num_workers, spec.use_gpu, spec.accelerator_type) == (16, True, "B200")
        assert spec.storage_path == "gs://b/ray" and spec.overrides == ("training.max_steps=3",)
        assert spec.worker_config() == {
            "recipe": RECIPE,
            "overrides": ["training.max_steps=3"],
            "preemption_notice": "/tmp/gemma-finetune-preemption",
        }

    def test_environment_for_a_rayjob(self):
        env = {
            "TRAINER_RECIPE": RECIPE,
            "RAY_NUM_WORKERS": "16",
            "RAY_USE_GPU": "true",
            "RAY_ACCELERATOR_TYPE": "B200",
            "RAY_STORAGE_PATH": "gs://bucket/ray",
            "TRAINER_OVERRIDES": "output.dir=gs://bucket/runs/vision;training.save_steps=10",
        }
        spec = parse_args([], env=env)
        assert spec.recipe == RECIPE and spec.num_workers == 16 and spec.use_gpu
        assert spec.overrides == ("output.dir=gs://bucket/runs/vision", "training.save_steps=10")
        assert spec.name is None  # the driver uses the recipe name: a retried RayJob finds the same run

    def test_later_flags_win(self):
        """A planned entrypoint can be re-aimed by appending flags (what the runtime tests do)."""
        planned = ["--recipe", RECIPE, "--num-workers", "16", "--use-gpu", "--storage-path", "gs://b/ray"]
        spec = parse_args([*planned, "--num-workers", "2", "--no-use-gpu", "--storage-path", "/tmp/r"], env={})
        assert (spec.num_workers, spec.use_gpu, spec.storage_path) == (2, False, "/tmp/r")
        assert parse_args(["--recipe", RECIPE, "--no-use-gpu"], env={"RAY_USE_GPU": "1"}).use_gpu is False


class TestFilesEachRankReports:
    """After the barrier each file of a checkpoint is handed to Ray by exactly one rank."""

    @pytest.fixture
    def checkpoint(self, tmp_path: Path) -> Path:
        folder = tmp_path / "checkpoint-4"
        for name in ("adapter_model.safetensors", "optimizer.pt", "trainer_state.json", "scheduler.pt"):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(name)
        for rank in range(4):
            (folder / f"rng_state_{rank}.pth").write_text(str(rank))
        return folder

    def test_partition(self, checkpoint: Path):
        reported = [p.name for rank in range(4) for p in rank_checkpoint_files(checkpoint, rank)]
        assert sorted(reported) == sorted(p.name for p in checkpoint.iterdir()), "every file, once"
        assert [p.name for p in rank_checkpoint_files(checkpoint, 2)] == ["rng_state_2.pth"]
        assert "rng_state_0.pth" in {p.name for p in rank_checkpoint_files(checkpoint, 0)}

    def test_a_node_without_rank_0_has_only_rng_states(self, tmp_path: Path):
        folder = tmp_path / "checkpoint-4"
        folder.mkdir()
        (folder / "rng_state_9.pth").write_text("9")
        assert [p.name for p in rank_checkpoint_files(folder, 9)] == ["rng_state_9.pth"]
        assert rank_checkpoint_files(tmp_path / "missing", 0) == []

    def test_single_process_rng_state(self, tmp_path: Path):
        folder = tmp_path / "checkpoint-1"
        folder.mkdir()
        (folder / "rng_state.pth").write_text("x")
        assert [p.name for p in rank_checkpoint_files(folder, 0)] == ["rng_state.pth"]


def _recipe(model_dir: Path, out: Path, *extra: str):
    from tests.trainer.ray_cluster import tiny_recipe_overrides
    from trainer.recipe import load_recipe

    return load_recipe(RECIPE, [*tiny_recipe_overrides(model_dir), f"output.dir={out}", *extra])


class TestVisionTrainer:
    """The trainer each Ray worker builds: max_length counts image soft tokens; DDP's unused-parameter search is off."""

    def test_batches_are_collated_in_loader_processes_and_no_full_module_trains(
        self, tiny_gemma3_vision_dir: Path, tmp_path: Path
    ):
        """Why: W2's collator ran the processor in the training process; the recipe's loader workers take it."""
        from trainer.checkpoints import OutputLocation
        from trainer.ray_entry import build_vision_trainer
        from trainer.recipe import load_recipe

        w2 = load_recipe(RECIPE)
        assert w2.training.extra["dataloader_num_workers"] >= 2 and w2.training.extra["dataloader_persistent_workers"]
        assert w2.lora.modules_to_save == []  # only adapters: a LoRA adapter vLLM can load (docs/performance.md)
        recipe = _recipe(tiny_gemma3_vision_dir, tmp_path / "out", "quantization=null")
        trainer, _ = build_vision_trainer(recipe, OutputLocation.from_dir(recipe.output.dir))
        loader = trainer.get_train_dataloader()
        assert loader.num_workers == recipe.training.extra["dataloader_num_workers"] == 1
        batch = next(iter(loader))
        assert {"input_ids", "pixel_values", "labels"} <= set(batch)

    @pytest.mark.slow
    def test_max_length_counts_image_tokens(self, tiny_gemma3_vision_dir: Path, tmp_path: Path):
        from trainer.checkpoints import OutputLocation
        from trainer.collators import VisionSFTCollator
        from trainer.data import conversation_length, prepare_datasets
        from trainer.modeling import load_tokenizer
        from trainer.ray_entry import build_vision_trainer

        probe = _recipe(tiny_gemma3_vision_dir, tmp_path / "probe", "quantization=null")
        processor = load_tokenizer(probe.model)
        rows = list(prepare_datasets(probe.data).train)
        text = [conversation_length(processor.tokenizer, row["messages"]) for row in rows]
        full = [VisionSFTCollator(processor).sequence_length(row) for row in rows]
        assert all(f >= t + processor.image_seq_length for t, f in zip(text, full, strict=True)), (text, full)
        # a limit every row meets on its text alone, but the longest rows exceed with their image
        limit = max(full) - 1
        assert max(text) <= limit

        recipe = _recipe(tiny_gemma3_vision_dir, tmp_path / "out", "quantization=null", f"training.max_length={limit}")
        trainer, _ = build_vision_trainer(recipe, OutputLocation.from_dir(recipe.output.dir))

        assert len(trainer.train_dataset) == sum(f <= limit for f in full) < len(rows)
        assert trainer.data_collator.max_length == limit
        batch = trainer.data_collator(list(trainer.train_dataset))
        assert batch["input_ids"].shape[1] <= limit
        assert trainer.args.ddp_find_unused_parameters is False


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_interrupted_run_resumes_from_the_checkpoint_every_rank_finished(ray_cluster, ray_plan, tmp_path, monkeypatch):
    """2 workers, QLoRA; interrupted after checkpoint-2 (rank 0 writing slowly), Ray restarts the group."""
    import ray
    import torch
    from safetensors.torch import load_file

    from trainer.ray_entry import run

    monkeypatch.setenv("RAY_TRAIN_V2_ENABLED", "1")
    # Ray Train's controller polls the workers every 2 s (ray/train/v2/_internal/constants.py); each attempt's
    # end is seen sooner at 0.5 s, the driver passes it on (get_env_vars_to_propagate)
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    record, out, storage = tmp_path / "record", tmp_path / "out", tmp_path / "ray"
    record.mkdir()
    planned = shlex.split(ray_plan.entrypoint)[3:]
    spec = parse_args(
        [*planned, "--num-workers", "2", "--no-use-gpu", "--storage-path", str(storage), "--max-failures", "1",
         "--set", "distributed.world_size=2", "--set", "training.max_steps=4", "--set", f"output.dir=file://{out}"],
        env={},
    )  # fmt: skip
    ray.init(address=ray_cluster.address)
    try:
        result = run(spec, loop=InterruptedRun(str(record), interrupt_after_step=2, slow_write_s=5.0))
    finally:
        ray.shutdown()

    assert result.error is None, result.error
    first = json.loads((record / ATTEMPT_FILE.format(attempt=1, rank=0)).read_text())
    assert first == {"start_step": 0, "steps": [1, 2]}, "the first attempt stops after checkpoint-2"
    for rank in (0, 1):
        second = json.loads((record / ATTEMPT_FILE.format(attempt=2, rank=rank)).read_text())
        assert second == {"start_step": 2, "steps": [3, 4]}, f"rank {rank} must continue at step 3: {second}"

    # What Ray restored from: the step-2 checkpoint in storage, made of exactly what the ranks handed over.
    run_dir = storage / spec.name
    by_step = {
        json.loads((c / "checkpoint" / "trainer_state.json").read_text())["global_step"]: c / "checkpoint"
        for c in run_dir.glob("checkpoint_*")
        if (c / "checkpoint" / "trainer_state.json").exists()
    }
    assert set(by_step) == {2, 4}, sorted(p.name for p in run_dir.iterdir())
    stored = {p.relative_to(by_step[2]).as_posix(): sha256(p) for p in by_step[2].rglob("*") if p.is_file()}
    reported = [
        json.loads((record / REPORT_FILE.format(attempt=1, rank=r, step=2)).read_text())["files"] for r in (0, 1)
    ]
    for rank, files in enumerate(reported):
        for name, digest in files.items():
            assert stored[name.removeprefix("checkpoint/")] == digest, f"rank {rank} handed over {name} half-written"
    handed = [name for files in reported for name in files]
    assert sorted(handed) == sorted(f"checkpoint/{n}" for n in stored), "each stored file handed over by one rank"
    assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt", "adapter_model.safetensors"} <= set(stored)

    saved = load_file(by_step[2] / "adapter_model.safetensors")
    # adapters only: W2 trains no full copy of the head (lora.modules_to_save, docs/performance.md)
    assert any("lora_B" in k for k in saved) and not any("modules_to_save" in k or "lm_head" in k for k in saved)
    # W2 adapts the vision tower too, as its seed's all-linear did (lora.vision_tower)
    assert any("vision_tower" in k for k in saved) == load_recipe(RECIPE, list(spec.overrides)).lora.vision_tower
    for rank in (0, 1):
        in_memory = load_file(record / SAVED_WEIGHTS.format(rank=rank, step=2))
        restored = load_file(record / BEGIN_WEIGHTS.format(attempt=2, rank=rank))
        assert set(restored) == set(saved) == set(in_memory)
        for key, tensor in saved.items():
            assert torch.equal(restored[key], tensor), f"rank {rank}: {key} is not the saved adapter"
            assert torch.equal(in_memory[key].to(tensor.dtype), tensor), f"rank {rank}: {key} differs from training"

    # One upload per checkpoint: Ray's report (above: each file handed over once); the trainer's mirror
    # callback uploads none of them to output.dir, only the final adapter and the merged export serving loads
    # (the W2 recipe says merge: false, but vLLM refuses its adapter's modules_to_save, so the run merges:
    # Recipe.writes_merged) go there, after the summary.
    uploads = [json.loads(line) for f in sorted(record.glob("uploads-*.jsonl")) for line in f.read_text().splitlines()]
    assert [u["url"] for u in uploads] == [f"file://{out}/adapter", f"file://{out}/merged"], uploads
    assert not (out / "checkpoints").exists()
    # One download per node on resume: the second attempt's ranks on one Ray node share one copy.
    nodes = {(record / f"node-attempt-2-rank-{r}.txt").read_text() for r in (0, 1)}
    downloads = [
        json.loads(line)
        for f in sorted(record.glob("downloads-attempt-2-*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    assert len(downloads) == len(nodes), (downloads, nodes)
    assert not list(record.glob("downloads-attempt-1-*.jsonl")), "nothing to resume from in the first attempt"

    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 4 and summary["resumed_from_step"] == 2 and summary["ray_workers"] == 2
    assert summary["loaded_in_4bit"] is True and summary["ddp_find_unused_parameters"] is False
    assert summary["epoch"] == 4 * 2 / 8, "DDP shards the 8 rows over 2 workers: 4 steps are one epoch"
    # the run's marker, uploaded last: only the attempt that finished wrote it
    marker = json.loads((out / RUN_MARKER).read_text())
    assert marker["summary"] == summary and marker["adapter_dir"] == f"file://{out}/adapter", marker


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_preempted_worker_pod_saves_the_step_it_had_and_the_restart_resumes_there(
    ray_cluster, ray_plan, tmp_path, monkeypatch
):
    """The pod's real preStop command (as infra/ray_job.py renders it) runs mid-run, as Kubernetes runs it
    before SIGTERM; it must return once the step's checkpoint is with Ray, and Ray's restart resume there.

    Not the signal itself: SIGTERM to the worker node's `ray start --block` stops every Ray process of the
    node within ~1 s and would take the Ray tests' shared cluster down (docs/distributed.md#ray-workers-save-on-a-prestop-hook).
    """
    import dataclasses
    import subprocess
    import threading
    import time

    import ray

    from tests.trainer.ray_worker_probes import PREEMPT_STEPS_FILE, SlowStepsRun
    from trainer.preemption import prestop_command
    from trainer.ray_entry import run

    monkeypatch.setenv("RAY_TRAIN_V2_ENABLED", "1")
    # Ray Train's controller polls the workers every 2 s (ray/train/v2/_internal/constants.py); each attempt's
    # end is seen sooner at 0.5 s, the driver passes it on (get_env_vars_to_propagate)
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    record, out, storage = tmp_path / "record", tmp_path / "out", tmp_path / "ray"
    record.mkdir()
    notice = tmp_path / "pod-tmp" / "preemption"
    notice.parent.mkdir()
    # the claim needs hook_at + 2 < max_steps (the hook may land up to 2 steps late) and steps after the resume
    max_steps, hook_at = 6, 2
    planned = shlex.split(ray_plan.entrypoint)[3:]
    spec = parse_args(
        [*planned, "--num-workers", "2", "--no-use-gpu", "--storage-path", str(storage), "--max-failures", "1",
         "--set", "distributed.world_size=2", "--set", f"training.max_steps={max_steps}",
         "--set", "training.save_steps=1000", "--set", "quantization=null", "--set", f"output.dir=file://{out}",
         # 2 rows held out of 10 (8 train, as in the other runs): the run scores itself on images after training
         # (bf16 LoRA here: bitsandbytes' CPU 4-bit inference kernel needs wider layers than the tiny model's)
         "--set", "data.max_rows=10", "--set", "data.eval_rows=2", "--set", "evaluation.generate_rows=2",
         "--set", "evaluation.max_new_tokens=3", "--set", "evaluation.batch_size=1"],
        env={},
    )  # fmt: skip
    spec = dataclasses.replace(spec, preemption_notice=str(notice))

    def steps(rank: int) -> list[int]:
        path = record / PREEMPT_STEPS_FILE.format(attempt=1, rank=rank)
        try:  # a worker rewrites the file at each step: a read can see it half written
            return json.loads(path.read_text())["steps"]
        except (FileNotFoundError, json.JSONDecodeError):
            return []

    hook: dict[str, object] = {}

    def kubelet() -> None:  # what the kubelet does on a pod deletion: the preStop hook first
        deadline = time.monotonic() + 900
        while min(len(steps(0)), len(steps(1))) < hook_at and time.monotonic() < deadline:
            time.sleep(0.05)
        hook["at"] = min(max(steps(0)), max(steps(1)))
        started = time.monotonic()
        hook["rc"] = subprocess.run(prestop_command(str(notice), wait_s=120), timeout=180).returncode
        hook["seconds"] = time.monotonic() - started

    watcher = threading.Thread(target=kubelet, daemon=True)
    watcher.start()
    ray.init(address=ray_cluster.address)
    try:
        result = run(spec, loop=SlowStepsRun(str(record), step_delay_s=1.0))
    finally:
        ray.shutdown()
    watcher.join(timeout=200)

    assert result.error is None, result.error
    assert hook.get("rc") == 0, f"the preStop hook was not released by a saved checkpoint: {hook}"
    assert not notice.exists() and not Path(f"{notice}.saved").exists()
    run_dir = storage / spec.name
    saved = sorted(
        json.loads(state.read_text())["global_step"]
        for state in run_dir.glob("checkpoint_*/checkpoint/trainer_state.json")
    )
    # save_steps beyond the run: only the preemption saved, and transformers' save at the last step
    assert len(saved) == 2 and saved[1] == max_steps, saved
    step = saved[0]
    assert hook["at"] <= step <= hook["at"] + 2 < max_steps, (hook, step)
    assert max(steps(0)) == max(steps(1)) == step, "the first attempt stops at the saved step"
    for rank in (0, 1):
        second = json.loads((record / PREEMPT_STEPS_FILE.format(attempt=2, rank=rank)).read_text())
        assert second["start_step"] == step and second["steps"] == list(range(step + 1, max_steps + 1)), second
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["resumed_from_step"] == step and summary["steps"] == max_steps, summary
    # the run scored itself, base and tuned, on its 2 held-out products (each worker answers one)
    evaluation = summary["eval"]
    assert evaluation["generated_rows"] == 2 and summary["eval_loss"] == evaluation["after"]["loss"] > 0
    assert evaluation["before"]["loss"] > 0 and len(evaluation["examples"]) == 2, evaluation
