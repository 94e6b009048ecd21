"""Ray Train entry point: the same recipe, trained by N Ray workers (the RayJob's entrypoint).

    python -m trainer.ray_entry --recipe product-descriptions-gemma3-4b --num-workers 16 --use-gpu \\
        --accelerator-type B200 --storage-path gs://BUCKET/ray
    # everything can also come from the environment (a RayJob's container env):
    TRAINER_RECIPE=product-descriptions-gemma3-4b RAY_NUM_WORKERS=16 RAY_USE_GPU=1 \\
        RAY_STORAGE_PATH=gs://BUCKET/ray python -m trainer.ray_entry

Decisions:
- A thin adapter. `TorchTrainer(train_loop_per_worker, ScalingConfig(num_workers, use_gpu,
  accelerator_type), RunConfig(storage_path, name, FailureConfig))`; each worker builds the
  Hugging Face trainer from the core's functions (trainer.modeling, trainer.data, trainer.train),
  wraps it with `ray.train.huggingface.transformers.prepare_trainer` and reports every saved
  checkpoint to Ray with `RayTrainReportCallback`.
- Ray Train V2 (`RAY_TRAIN_V2_ENABLED=1`) is switched on here unless the environment says
  otherwise: it is the default in the Ray we test with (2.60) and opt-in in the image's Ray
  (2.48.0, `RAY_VERSION`), so both run the same code path.
- The run name defaults to the recipe name, not a timestamp: a retried RayJob (KubeRay
  starts a new cluster) finds the same run under storage_path, and a retried worker group
  resumes from `ray.train.get_checkpoint()`, copied to local disk first.
- Vision recipes (`model.text_only: false`) get trainer/collators.py's VisionSFTCollator:
  labels mask pad and image tokens by the processor's own ids, and the prompt when
  `training.assistant_only_loss` is on. Text recipes use trainer.train.build_trainer as is.
- Rank 0 writes the final adapter (+ processor) to `output.dir/adapter` and run_summary.json,
  and mirrors them when output.dir is a URL.

`RAY_VERSION` is the Ray in the trainer image (trainer/requirements-gpu.txt); the RayJob's
`rayVersion` must equal it. This module imports nothing heavy at import time, so infra code
can read that constant without torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.recipe import Recipe, RecipeError, load_recipe

if TYPE_CHECKING:
    from transformers import TrainerCallback
    from trl import SFTTrainer

    from trainer.checkpoints import OutputLocation

RAY_VERSION = "2.48.0"
V2_ENV = "RAY_TRAIN_V2_ENABLED"
RAY_CHECKPOINT_SUBDIR = "checkpoint"  # RayTrainReportCallback.CHECKPOINT_NAME
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RayRunSpec:
    """Everything the driver needs; `worker_config()` is what each worker receives (plain, picklable)."""

    recipe: str
    overrides: tuple[str, ...] = ()
    num_workers: int = 1
    use_gpu: bool = False
    accelerator_type: str | None = None
    cpus_per_worker: float | None = None
    storage_path: str | None = None
    name: str | None = None
    max_failures: int = 2
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def worker_config(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "overrides": list(self.overrides)}


def _env_bool(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> RayRunSpec:
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog="python -m trainer.ray_entry", description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default=env.get("TRAINER_RECIPE"), help="recipe name or path ($TRAINER_RECIPE)")
    parser.add_argument("--num-workers", type=int, default=int(env.get("RAY_NUM_WORKERS", "1")))
    parser.add_argument("--use-gpu", action="store_true", default=_env_bool(env.get("RAY_USE_GPU")))
    parser.add_argument("--accelerator-type", default=env.get("RAY_ACCELERATOR_TYPE") or None, help="e.g. B200")
    parser.add_argument("--cpus-per-worker", type=float, default=None, help="CPUs Ray reserves per worker")
    parser.add_argument("--storage-path", default=env.get("RAY_STORAGE_PATH") or None, help="gs://bucket/ray")
    parser.add_argument("--name", default=env.get("RAY_RUN_NAME") or None, help="run name (default: recipe name)")
    parser.add_argument("--max-failures", type=int, default=int(env.get("RAY_MAX_FAILURES", "2")))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    if not args.recipe:
        parser.error("--recipe (or $TRAINER_RECIPE) is required")
    if args.num_workers < 1:
        parser.error(f"--num-workers={args.num_workers} must be at least 1")
    env_overrides = [item for item in env.get("TRAINER_OVERRIDES", "").split(";") if item.strip()]
    return RayRunSpec(
        recipe=args.recipe,
        overrides=(*env_overrides, *args.overrides),
        num_workers=args.num_workers,
        use_gpu=args.use_gpu,
        accelerator_type=args.accelerator_type,
        cpus_per_worker=args.cpus_per_worker,
        storage_path=args.storage_path,
        name=args.name,
        max_failures=args.max_failures,
    )


# --------------------------------------------------------------------------------------
# Per worker


def build_vision_trainer(
    recipe: Recipe, location: OutputLocation, callbacks: Sequence[TrainerCallback] = ()
) -> tuple[SFTTrainer, Any]:
    """SFTTrainer for image+text recipes with our collator; the core's pieces otherwise."""
    from trl import SFTTrainer

    from trainer.checkpoints import mirror_callback
    from trainer.collators import VisionSFTCollator
    from trainer.data import prepare_datasets
    from trainer.modeling import load_model_and_tokenizer, lora_config
    from trainer.train import LossMode, sft_config

    model, processor = load_model_and_tokenizer(recipe)
    split = prepare_datasets(recipe.data, getattr(processor, "tokenizer", processor), recipe.training.max_length)
    args = sft_config(recipe, location, has_eval=split.eval is not None, loss=LossMode.FULL)
    # The collator builds input_ids, pixel_values and labels from the raw conversations.
    args.remove_unused_columns = False
    existing = args.dataset_kwargs if isinstance(args.dataset_kwargs, dict) else {}
    args.dataset_kwargs = {**existing, "skip_prepare_dataset": True}
    collator = VisionSFTCollator(processor, mask_prompt=recipe.training.assistant_only_loss)
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=split.train,
        eval_dataset=split.eval,
        processing_class=processor,
        data_collator=collator,
        peft_config=lora_config(recipe.lora, model),
        callbacks=[mirror_callback(location), *callbacks],
    )
    return trainer, processor


def _local_resume_checkpoint(checkpoint: Any, scratch: Path) -> Path | None:
    """Copy a Ray checkpoint to local disk; the HF checkpoint folder inside it, or None."""
    if checkpoint is None:
        return None
    target = scratch / "ray-resume"
    shutil.rmtree(target, ignore_errors=True)
    checkpoint.to_directory(str(target))
    inner = target / RAY_CHECKPOINT_SUBDIR
    return inner if inner.is_dir() else None


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Runs on every Ray worker (torch.distributed is already set up by TorchTrainer)."""
    import ray.train
    from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer

    from trainer.checkpoints import OutputLocation, upload_dir
    from trainer.train import SUMMARY_FILE, build_trainer, run_summary

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    recipe = load_recipe(config["recipe"], config["overrides"])
    location = OutputLocation.from_dir(recipe.output.dir)
    location.local.mkdir(parents=True, exist_ok=True)
    callbacks = [RayTrainReportCallback()]
    if recipe.model.text_only:
        trainer, processor = build_trainer(recipe, location, callbacks)
    else:
        trainer, processor = build_vision_trainer(recipe, location, callbacks)
    trainer = prepare_trainer(trainer)  # type: ignore[assignment]  # same class, Ray-aware dataloaders

    rank = ray.train.get_context().get_world_rank()
    scratch = Path(tempfile.mkdtemp(prefix=f"ray-worker{rank}-"))
    resume = _local_resume_checkpoint(ray.train.get_checkpoint(), scratch)
    if resume is not None:
        log.info("resuming from the Ray checkpoint copied to %s", resume)
    train_output = trainer.train(resume_from_checkpoint=str(resume) if resume else None)

    adapter_dir = location.local / "adapter"
    trainer.save_model(str(adapter_dir))
    if trainer.is_world_process_zero():
        processor.save_pretrained(adapter_dir)
        summary = run_summary(recipe, trainer, train_output, None, None, time.perf_counter() - started)
        summary.update({"ray_workers": ray.train.get_context().get_world_size(), "resumed_from_ray": bool(resume)})
        (location.local / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        if location.remote:
            upload_dir(adapter_dir, f"{location.remote}/adapter")
            from fsspec.core import url_to_fs

            fs, root = url_to_fs(location.remote)
            fs.put_file(str(location.local / SUMMARY_FILE), f"{root}/{SUMMARY_FILE}")
    shutil.rmtree(scratch, ignore_errors=True)


# --------------------------------------------------------------------------------------
# Driver


def build_torch_trainer(spec: RayRunSpec) -> Any:
    """The TorchTrainer for a run (not started); validates the recipe first, on the driver."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    recipe = load_recipe(spec.recipe, spec.overrides)
    resources: dict[str, float] | None = None
    if spec.cpus_per_worker is not None:
        resources = {"CPU": spec.cpus_per_worker}
        if spec.use_gpu:
            resources["GPU"] = 1
    scaling = ScalingConfig(
        num_workers=spec.num_workers,
        use_gpu=spec.use_gpu,
        accelerator_type=spec.accelerator_type,
        resources_per_worker=resources,
    )
    run = RunConfig(
        name=spec.name or recipe.name,
        storage_path=spec.storage_path,
        failure_config=FailureConfig(max_failures=spec.max_failures),
    )
    return TorchTrainer(
        train_loop_per_worker, train_loop_config=spec.worker_config(), scaling_config=scaling, run_config=run
    )


def run(spec: RayRunSpec) -> Any:
    """Fit and return Ray's Result (its .checkpoint is the last reported one)."""
    os.environ.setdefault(V2_ENV, "1")
    trainer = build_torch_trainer(spec)
    return trainer.fit()


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault(V2_ENV, "1")  # before ray.train is imported anywhere
    try:
        spec = parse_args(argv)
        result = run(spec)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = {
        "checkpoint": getattr(result.checkpoint, "path", None),
        "metrics": {k: v for k, v in (result.metrics or {}).items() if isinstance(v, int | float | str)},
        "error": repr(result.error) if getattr(result, "error", None) else None,
    }
    print(json.dumps(report, indent=2, default=str))
    return 1 if report["error"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
