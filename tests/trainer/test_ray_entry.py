"""`python -m trainer.ray_entry`: the vision recipe under Ray Train, on 2 CPU workers.

Why it matters: the RayJob runs this on 16 GPUs; here the same code path (TorchTrainer,
prepare_trainer, RayTrainReportCallback, our vision collator, resume from Ray's checkpoint)
runs on a tiny random Gemma 3 vision model built on this machine, with the bundled product
sample, so a broken API or collator fails here and not after the cluster is up.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.trainer.test_collator import tiny_vision_model, tiny_vision_processor
from trainer.ray_entry import RAY_VERSION, parse_args
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
        assert spec.worker_config() == {"recipe": RECIPE, "overrides": ["training.max_steps=3"]}

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

    def test_ray_version_matches_the_image(self):
        pin = re.search(r"^ray\[train\]==(\S+)", (REPO / "trainer/requirements-gpu.txt").read_text(), re.M)
        assert pin and pin.group(1) == RAY_VERSION


@pytest.fixture
def local_ray(monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_V2_ENABLED", "1")
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": str(REPO),
                "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1",
            }
        },
    )
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_cpu_workers_train_tiny_gemma3_vision_and_report_a_checkpoint(local_ray, tmp_path):
    from safetensors.torch import load_file

    from trainer.ray_entry import RayRunSpec, run

    model_dir = tmp_path / "tiny-gemma3-vision"
    processor = tiny_vision_processor()
    tiny_vision_model(processor).save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    out = tmp_path / "out"
    overrides = (
        f"model.name_or_path={model_dir}",
        "model.dtype=float32",
        "quantization=null",
        "data.source=local",
        "data.path=trainer/data/products.jsonl",
        "data.image_dir=trainer/data",
        "data.max_rows=8",
        "data.eval_rows=0",
        "training.max_steps=2",
        "training.save_steps=1",
        "training.logging_steps=1",
        "training.per_device_train_batch_size=1",
        "training.gradient_accumulation_steps=1",
        "training.gradient_checkpointing=false",
        "training.optim=adamw_torch",
        "training.max_length=512",
        "training.report_to=[]",
        f"output.dir={out}",
    )
    spec = RayRunSpec(
        recipe=RECIPE,
        overrides=overrides,
        num_workers=2,
        cpus_per_worker=1,
        storage_path=str(tmp_path / "ray"),
        name="tiny-vision",
        max_failures=0,
    )
    result = run(spec)

    assert result.error is None, result.error
    assert result.checkpoint is not None, "no checkpoint was reported to Ray"
    ray_checkpoint = Path(result.checkpoint.path) / "checkpoint"
    assert (ray_checkpoint / "adapter_model.safetensors").exists(), sorted(p.name for p in ray_checkpoint.iterdir())
    assert str(tmp_path / "ray" / "tiny-vision") in result.checkpoint.path
    assert "loss" in result.metrics and result.metrics.get("step", result.metrics.get("epoch")) is not None

    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    lora_b = [t for k, t in adapter.items() if "lora_B" in k]
    assert lora_b and any(float(t.abs().sum()) > 0 for t in lora_b), "LoRA B is still zero: nothing trained"
    # W2 adapts the vision tower too, as its seed's all-linear did (lora.vision_tower)
    assert any("vision_tower" in k for k in adapter) == load_recipe(RECIPE, list(overrides)).lora.vision_tower
    assert (out / "adapter" / "processor_config.json").exists() or (out / "adapter" / "tokenizer_config.json").exists()
    summary = (out / "run_summary.json").read_text()
    assert '"ray_workers": 2' in summary and '"steps": 2' in summary
    assert os.environ.get("RAY_TRAIN_V2_ENABLED") == "1"
