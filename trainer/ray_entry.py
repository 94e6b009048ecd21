"""Ray Train entry point: the same recipe, trained by N Ray workers (the RayJob's entrypoint).

    python -m trainer.ray_entry --recipe product-descriptions-gemma3-4b --num-workers 16 --use-gpu \\
        --accelerator-type B200 --storage-path gs://BUCKET/ray
    # or from a RayJob's env: TRAINER_RECIPE, RAY_NUM_WORKERS, RAY_USE_GPU, RAY_STORAGE_PATH; later flags win

A thin adapter: `TorchTrainer` around the core's Hugging Face trainer (`prepare_trainer`), Ray Train V2 on;
`--num-workers` must be the recipe's `distributed.world_size` (else exit 2); GPU-less workers train with
`use_cpu`; vision recipes get trainer/collators.py, over-long rows dropped, DDP's unused-parameter search off
(docs/distributed.md#ray-train-workers). Checkpoints reach Ray after a barrier, each file once and complete,
under the recipe's run name so a retry resumes (docs/distributed.md#ray-checkpoints-reported-once-complete); preemption is a
preStop notice read at each step end (docs/distributed.md#ray-workers-save-on-a-prestop-hook). Rank 0 writes the adapter, the merged export
(`Recipe.writes_merged`) and run_summary.json before their markers (`publish_run`), then `_RUN_COMPLETE.json`: with
it there, `main` starts no worker again. `RAY_VERSION` is the image's Ray; nothing heavy is imported at import time.
It does not decide the cluster's shape (infra/ray_job.py does) and does not use Ray Data.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.preemption import NOTICE_FILE
from trainer.recipe import Recipe, RecipeError, load_recipe, world_size_problem

if TYPE_CHECKING:
    from transformers import TrainerCallback
    from trl import SFTTrainer

    from trainer.checkpoints import OutputLocation

RAY_VERSION = "2.48.0"
V2_ENV = "RAY_TRAIN_V2_ENABLED"
RAY_CHECKPOINT_SUBDIR = "checkpoint"  # the HF checkpoint's folder inside a Ray checkpoint
# transformers' Trainer._save_rng_state: rng_state_<process_index>.pth with several processes
_RANK_RNG_FILE = re.compile(r"^rng_state_(\d+)\.pth$")
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
    # where each worker looks for its pod's preStop notice (trainer/preemption.py)
    preemption_notice: str = NOTICE_FILE

    def worker_config(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "overrides": list(self.overrides), "preemption_notice": self.preemption_notice}


def _env_bool(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> RayRunSpec:
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog="python -m trainer.ray_entry", description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default=env.get("TRAINER_RECIPE"), help="recipe name or path ($TRAINER_RECIPE)")
    parser.add_argument("--num-workers", type=int, default=int(env.get("RAY_NUM_WORKERS", "1")))
    parser.add_argument(
        "--use-gpu",
        action=argparse.BooleanOptionalAction,
        default=_env_bool(env.get("RAY_USE_GPU")),
        help="one GPU per worker ($RAY_USE_GPU); --no-use-gpu trains on CPUs",
    )
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


def rank_checkpoint_files(checkpoint: Path, rank: int) -> list[Path]:
    """The files of a local HF checkpoint that `rank` hands to Ray: rank 0 all but other ranks' RNG states.

    Every other rank hands over only its own `rng_state_<rank>.pth` (on a node without rank 0 it is
    the only copy). Together the ranks report each file exactly once.
    """
    if not checkpoint.is_dir():
        return []
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
    if rank == 0:
        return [p for p in files if (m := _RANK_RNG_FILE.match(p.name)) is None or int(m.group(1)) == 0]
    return [p for p in files if p.name == f"rng_state_{rank}.pth"]


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def ray_report_callback() -> TrainerCallback:
    """A TrainerCallback that reports each saved checkpoint to Ray once every rank has finished writing it."""
    from transformers import TrainerCallback

    class ReportCheckpointToRay(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            import ray.train

            # transformers fires on_save right after each rank's own writes; rank 0 writes most of the
            # checkpoint (and marks/mirrors it in the callbacks before this one), so wait for it.
            _barrier()
            rank = ray.train.get_context().get_world_rank()
            source = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            metrics: dict[str, Any] = {}
            for entry in state.log_history:
                metrics.update(entry)
            with tempfile.TemporaryDirectory(prefix=f"ray-report{rank}-") as tmp:
                target = Path(tmp) / RAY_CHECKPOINT_SUBDIR
                files = rank_checkpoint_files(source, rank)
                for path in files:
                    destination = target / path.relative_to(source)
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, destination)
                checkpoint = ray.train.Checkpoint.from_directory(tmp) if files else None
                # Collective in Ray Train V2: every rank calls it, with or without files.
                ray.train.report(metrics, checkpoint=checkpoint)
            return control

    return ReportCheckpointToRay()


def _without_overlong_rows(dataset: Any, collator: Any, max_length: int, split: str) -> Any:
    """Drop the rows whose processed sequence (text + image soft tokens) is longer than max_length."""
    if dataset is None:
        return None
    kept = dataset.filter(collator.fits, desc=f"max_length with image tokens ({split})")
    dropped = len(dataset) - len(kept)
    if dropped:
        log.warning(
            "%s: skipped %d of %d rows longer than training.max_length=%d once each image becomes its soft tokens",
            split,
            dropped,
            len(dataset),
            max_length,
        )
    return kept


def build_vision_trainer(
    recipe: Recipe, location: OutputLocation, callbacks: Sequence[TrainerCallback] = ()
) -> tuple[SFTTrainer, Any]:
    """SFTTrainer for image+text recipes with our collator; the core's pieces otherwise."""
    from trainer.checkpoints import mirror_callback
    from trainer.collators import VisionSFTCollator
    from trainer.data import prepare_datasets
    from trainer.lm_head import new_sft_trainer
    from trainer.metrics_log import metrics_log_callback
    from trainer.modeling import load_model_and_tokenizer, lora_config
    from trainer.train import LossMode, sft_config

    model, processor = load_model_and_tokenizer(recipe, location)
    max_length = recipe.training.max_length
    # The data loader's length check counts text tokens only; the collator counts the images too.
    split = prepare_datasets(recipe.data, getattr(processor, "tokenizer", processor), max_length)
    collator = VisionSFTCollator(processor, max_length=max_length, mask_prompt=recipe.training.assistant_only_loss)
    train_set, eval_set = split.train, split.eval
    if max_length is not None:
        train_set = _without_overlong_rows(train_set, collator, max_length, "train")
        eval_set = _without_overlong_rows(eval_set, collator, max_length, "eval")
        if len(train_set) == 0:
            raise RecipeError(
                f"training.max_length={max_length}: every training row is longer once its images are "
                "counted (each image adds the processor's soft tokens): raise training.max_length"
            )
    args = sft_config(recipe, location, has_eval=eval_set is not None, loss=LossMode.FULL)
    # The collator builds input_ids, pixel_values and labels from the raw conversations.
    args.remove_unused_columns = False
    existing = args.dataset_kwargs if isinstance(args.dataset_kwargs, dict) else {}
    args.dataset_kwargs = {**existing, "skip_prepare_dataset": True}
    if "ddp_find_unused_parameters" not in recipe.training.extra:
        # Every row has an image; a vision-tower adapter skips the unused pooling head: no trainable parameter is unused.
        args.ddp_find_unused_parameters = False
    trainer = new_sft_trainer(
        model=model,
        args=args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        processing_class=processor,
        data_collator=collator,
        peft_config=lora_config(recipe.lora, model),
        callbacks=[mirror_callback(location), metrics_log_callback(recipe), *callbacks],
    )
    return trainer, processor


def node_resume_checkpoint(checkpoint: Any, args: Any) -> Path | None:
    """Ray's checkpoint copied to this node's disk ONCE; the HF checkpoint folder inside it, or None.

    Local rank 0 downloads it while the node's other ranks wait at TrainingArguments.main_process_first
    (local=True)'s barrier; they then read the same folder (16 workers on 2 nodes: 2 downloads, not 16).
    The folder is per Ray node and per checkpoint, so two Ray nodes on one machine never share one.
    """
    if checkpoint is None:
        return None
    import ray

    key = hashlib.sha256(f"{ray.get_runtime_context().get_node_id()}:{checkpoint.path}".encode()).hexdigest()[:16]
    target = Path(tempfile.gettempdir()) / "gemma-finetune-ray-resume" / key
    complete = target / ".complete"
    with args.main_process_first(local=True, desc="copying the Ray checkpoint to this node"):
        if args.local_process_index == 0 and not complete.is_file():
            shutil.rmtree(target, ignore_errors=True)
            checkpoint.to_directory(str(target))
            complete.touch()
    inner = target / RAY_CHECKPOINT_SUBDIR
    return inner if inner.is_dir() else None


def _checkpoint_global_step(checkpoint: Path) -> int | None:
    state = checkpoint / "trainer_state.json"
    return int(json.loads(state.read_text())["global_step"]) if state.is_file() else None


def _cpu_overrides() -> list[str]:
    """On a worker without a GPU, tell transformers to train on CPUs: accelerate only treats a CPU process
    as one of several (MULTI_CPU, over Ray's gloo group) when asked to (accelerate/state.py
    `PartialState._prepare_backend`); otherwise every worker trains alone on all the data, without DDP."""
    import torch

    return [] if torch.cuda.is_available() else ["training.extra.use_cpu=true"]


def train_loop_per_worker(config: dict[str, Any], extra_callbacks: Sequence[TrainerCallback] = ()) -> None:
    """Runs on every Ray worker (torch.distributed is already set up by TorchTrainer).

    `extra_callbacks` run after the checkpoint report (a caller's own observers).
    """
    import ray.train
    from ray.train.huggingface.transformers import prepare_trainer

    from trainer.base_weights import merge_base
    from trainer.checkpoints import OutputLocation
    from trainer.export import clear_completion_marker, merge_and_export, publish_run
    from trainer.metrics_log import send_to_container_stdout
    from trainer.preemption import Preempted, acknowledge, preemption_callback
    from trainer.run_eval import run_evaluation
    from trainer.train import build_trainer, run_summary

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    send_to_container_stdout()  # Ray keeps this worker's stdout in a file: the metric lines go to the pod's
    started = time.perf_counter()
    recipe = load_recipe(config["recipe"], [*config["overrides"], *_cpu_overrides()])
    location = OutputLocation.from_dir(recipe.output.dir)
    if location.finished_run() is not None:
        # the group restarted after rank 0 had marked the run complete (a worker failed at its very end): done
        log.info("%s already holds a finished run: this worker trains nothing", recipe.output.dir)
        return
    location.local.mkdir(parents=True, exist_ok=True)
    notice = config.get("preemption_notice", NOTICE_FILE)
    preemption = preemption_callback(notice)  # after the report: its save is reported before the stop
    callbacks = [ray_report_callback(), preemption, *extra_callbacks]
    # Ray's report is each checkpoint's one upload (to storage_path, where a restarted worker group resumes
    # from); the trainer's mirror callback only marks it complete here: no remote to copy it to as well.
    checkpoints_here = replace(location, remote=None, base_remote=location.base_weights_url)
    if recipe.model.text_only:
        trainer, processor = build_trainer(recipe, checkpoints_here, callbacks)
    else:
        trainer, processor = build_vision_trainer(recipe, checkpoints_here, callbacks)
    trainer = prepare_trainer(trainer)  # type: ignore[assignment]  # same class, Ray-aware dataloaders

    context = ray.train.get_context()
    resume = node_resume_checkpoint(ray.train.get_checkpoint(), trainer.args)
    try:
        resumed_step = _checkpoint_global_step(resume) if resume is not None else None
        if resume is not None:
            log.info("resuming at step %s from the Ray checkpoint copied to %s", resumed_step, resume)
        train_output = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    finally:
        if resume is not None and trainer.args.local_process_index == 0:  # the node's copy, read at the start
            shutil.rmtree(resume.parent, ignore_errors=True)
    if preemption.stopped_at is not None:
        # checkpoint-N is with Ray (reported in that step's on_save, every rank): free the pod's preStop hook, then
        # fail this attempt so that Ray's FailureConfig restarts the group from it.
        if trainer.args.local_process_index == 0:
            acknowledge(notice)
        raise Preempted(preemption.stopped_at)

    # every worker: the held-out loss and the answers are collectives over the Ray workers' process group
    evaluation = run_evaluation(trainer, recipe, processor)
    adapter_dir = location.local / "adapter"
    if trainer.is_world_process_zero():
        clear_completion_marker(adapter_dir)  # a restarted group rewrites it: marked again only after the summary
    trainer.save_model(str(adapter_dir))
    if trainer.is_world_process_zero():
        processor.save_pretrained(adapter_dir)
        merged_dir = None
        if recipe.writes_merged:  # what serving loads when vLLM cannot take the adapter (docs/serving.md)
            if not recipe.output.merge:
                log.info(
                    "output.merge is false, but vLLM cannot serve this adapter as one (lora.modules_to_save or "
                    "lora.vision_tower): the merged export is written too, the form of this run that can be served"
                )
            base = merge_base(recipe.model.name_or_path, recipe.model.revision, checkpoints_here)
            merged_dir = merge_and_export(base, adapter_dir, location.local / "merged", tokenizer=processor, mark=False)
        eval_loss = evaluation["after"]["loss"] if evaluation else None
        summary = run_summary(recipe, trainer, train_output, eval_loss, None, time.perf_counter() - started)
        summary.update(
            {
                "eval": evaluation,
                "ray_workers": context.get_world_size(),
                "epoch": trainer.state.epoch,
                "resumed_from_ray": resume is not None,
                "resumed_from_step": resumed_step,
                "loaded_in_4bit": bool(getattr(trainer.model, "is_loaded_in_4bit", False)),
                # the DDP wrapper's own setting, None when the run was not distributed
                "ddp_find_unused_parameters": getattr(trainer.model_wrapped, "find_unused_parameters", None),
            }
        )
        # the summary, then the exports' markers, on every output kind (trainer/export.py publish_run)
        publish_run(location, summary, adapter_dir, merged_dir, recipe.model.name_or_path, trainer.model.config)
        # last, as `python -m trainer` does: what `pulumi up` and `main` read to start nothing for this run again
        location.mark_run_complete(
            {
                "recipe": recipe.name,
                "adapter_dir": location.remote_path("adapter") or str(adapter_dir),
                "merged_dir": (location.remote_path("merged") or str(merged_dir)) if merged_dir else None,
                "summary": summary,
            }
        )


# --------------------------------------------------------------------------------------
# Driver


def build_torch_trainer(spec: RayRunSpec, loop: Callable[[dict[str, Any]], None] = train_loop_per_worker) -> Any:
    """The TorchTrainer for a run (not started); validates the recipe first, on the driver."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    recipe = load_recipe(spec.recipe, spec.overrides)
    problem = world_size_problem(recipe, spec.num_workers, f"--num-workers {spec.num_workers}")
    if problem:
        raise RecipeError(problem)
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
    return TorchTrainer(loop, train_loop_config=spec.worker_config(), scaling_config=scaling, run_config=run)


def run(spec: RayRunSpec, loop: Callable[[dict[str, Any]], None] = train_loop_per_worker) -> Any:
    """Fit and return Ray's Result (its .checkpoint is the last reported one)."""
    os.environ.setdefault(V2_ENV, "1")
    trainer = build_torch_trainer(spec, loop)
    return trainer.fit()


def finished_output(spec: RayRunSpec) -> str | None:
    """The recipe's `output.dir` when it holds `_RUN_COMPLETE.json` (a finished run), else None: checked
    before Ray starts any worker, from the marker alone."""
    from trainer.checkpoints import OutputLocation
    from trainer.recipe import parse_recipe

    output_dir = parse_recipe(spec.recipe, spec.overrides).output.dir
    return output_dir if OutputLocation.from_dir(output_dir).finished_run() is not None else None


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault(V2_ENV, "1")  # before ray.train is imported anywhere
    try:
        spec = parse_args(argv)
        finished = finished_output(spec)
        if finished is not None:
            print(f"{finished} already holds a finished run: nothing to train (as `python -m trainer`)", flush=True)
            return 0
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
