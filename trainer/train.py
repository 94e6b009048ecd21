"""Supervised fine-tuning of a recipe with trl's SFTTrainer: LoRA/QLoRA, resumable, exported for serving.

    .venv/bin/python -m trainer --recipe emoji-local --set training.max_steps=5
    .venv/bin/python -c "from trainer.recipe import load_recipe; from trainer.train import main; \
        print(main(load_recipe('emoji-local', ['training.max_steps=5'])).summary)"

Decisions (docs/trainer.md#a-training-run, with the output layout under `output.dir`):
- Loss on the assistant's tokens only, with any chat template: trl's `assistant_only_loss`, else (a template trl
  cannot patch, Gemma 4's) prompt/completion pairs with `completion_only_loss`. Packing and
  `training.padding_free` batch without pad tokens.
- A run resumes from its latest complete checkpoint, and a SIGTERM raises `Preempted` after saving; a run whose
  `output.dir` holds `_RUN_COMPLETE.json` returns that summary before loading anything; a process count other
  than the recipe's stops it first.
- The SFTConfig is built before the model (FSDP2's RAM-efficient loading needs torch.distributed up); then every
  rank waits up to STARTUP_TIMEOUT for local rank 0's download (docs/distributed.md#a-startup-barrier-of-its-own).
- `training.extra` goes verbatim to SFTConfig (launching: trainer/launch.py; DDP, compiling, phases: docs/performance.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.base_weights import merge_base, stage_base_model
from trainer.checkpoints import RUN_MARKER, OutputLocation, checkpoint_step, mirror_callback, upload_dir
from trainer.cost_line import SUMMARY_COST_KEY, run_cost_line
from trainer.export import SUMMARY_FILE as SUMMARY_FILE
from trainer.preemption import Preempted, preemption_callback
from trainer.recipe import Recipe, RecipeError, world_size_problem
from trainer.run_eval import run_evaluation

if TYPE_CHECKING:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback, TrainingArguments
    from trl import SFTConfig, SFTTrainer

log = logging.getLogger(__name__)

# How long the ranks wait for local rank 0 to load the model: on a fresh node that is the first
# download of the weights from the Hub (Gemma 4 31B: ~62 GB). Every later collective keeps the
# process group's own timeout (`ddp_timeout`, 30 min), so a hung rank is still found within it.
STARTUP_TIMEOUT = timedelta(hours=2)


class LossMode(StrEnum):
    ASSISTANT = "assistant"  # trl assistant_only_loss via {% generation %} markers
    COMPLETION = "completion"  # prompt/completion pairs, trl completion_only_loss
    FULL = "full"  # every token (training.assistant_only_loss: false)


@dataclass(frozen=True)
class RunResult:
    output_dir: str
    adapter_dir: str
    merged_dir: str | None
    summary: dict[str, Any] = field(default_factory=dict)
    # the tokenizer (or processor) the run trained with and exported, for an in-process caller that scores
    # the export next (demo/pipeline.py): the files in adapter/ and merged/ are this object saved, and
    # loading Gemma's 262k-word tokenizer again costs seconds. None for a run found finished.
    processing_class: Any = field(default=None, repr=False, compare=False)


class Phases:
    """Wall seconds of each phase of a run, in the order they ran (run_summary.json `phases_s`, the cost line).

    `start` is the process's own start-up before `main` (interpreter, imports, the launcher's rendezvous),
    read from the process's creation time. Node provisioning and the image pull happen before any process:
    bench/time_to_model.py models them."""

    def __init__(self, on_start: Callable[[str], None] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.on_start = on_start
        """Told each phase's name as it begins (the start-up heartbeat, trainer/metrics_log.py)."""

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.on_start is not None:
            self.on_start(name)
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = round(self.seconds.get(name, 0.0) + seconds, 2)


def process_start_seconds() -> float:
    """Seconds from this process's creation to now (psutil, accelerate's own dependency)."""
    import psutil

    return max(0.0, time.time() - psutil.Process().create_time())


def choose_loss_mode(tokenizer: PreTrainedTokenizerBase, assistant_only: bool) -> LossMode:
    """ASSISTANT when trl can mask by generation markers for this template, else COMPLETION; FULL if asked."""
    if not assistant_only:
        return LossMode.FULL
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    template = tokenizer.chat_template
    if template and has_generation_markers(template):
        return LossMode.ASSISTANT
    try:
        get_training_chat_template(tokenizer)
    except ValueError:
        log.info("trl has no training variant of this chat template: masking the prompt with completion_only_loss")
        return LossMode.COMPLETION
    return LossMode.ASSISTANT


def to_prompt_completion(dataset: Dataset) -> Dataset:
    """{"messages": [..., assistant]} -> {"prompt": [...], "completion": [assistant]} (other columns kept)."""
    return dataset.map(
        lambda messages: {"prompt": messages[:-1], "completion": messages[-1:]},
        input_columns=["messages"],
        remove_columns=["messages"],
    )


def sft_config(recipe: Recipe, location: OutputLocation, has_eval: bool, loss: LossMode) -> SFTConfig:
    """The SFTConfig for a recipe: its training section, our output layout, then `training.extra` on top."""
    import torch
    from trl import SFTConfig

    from trainer.modeling import resolve_dtype

    t = recipe.training
    compute_dtype = resolve_dtype(recipe.quantization.compute_dtype if recipe.quantization else recipe.model.dtype)
    on_gpu = torch.cuda.is_available()
    kwargs: dict[str, Any] = {
        "output_dir": str(location.checkpoints_dir),
        "num_train_epochs": t.num_train_epochs,
        "max_steps": t.max_steps,
        "per_device_train_batch_size": t.per_device_train_batch_size,
        "per_device_eval_batch_size": t.per_device_eval_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "learning_rate": t.learning_rate,
        "lr_scheduler_type": t.lr_scheduler_type,
        # transformers 5 takes the warmup ratio as a float in [0, 1) in warmup_steps (warmup_ratio is gone)
        "warmup_steps": float(t.warmup_ratio),
        "weight_decay": t.weight_decay,
        "optim": t.optim,
        "max_grad_norm": t.max_grad_norm,
        # trl refuses padding_free without packing while max_length is set, since it would not truncate
        # (trl sft_trainer.py); the rows are bounded already: trainer/data.py drops longer conversations
        "max_length": None if t.padding_free and not t.packing else t.max_length,
        "packing": t.packing,
        "padding_free": t.padding_free,
        "assistant_only_loss": loss is LossMode.ASSISTANT,
        "completion_only_loss": loss is LossMode.COMPLETION,
        "gradient_checkpointing": t.gradient_checkpointing,
        "gradient_checkpointing_kwargs": {"use_reentrant": False} if t.gradient_checkpointing else None,
        "logging_steps": t.logging_steps,
        "save_strategy": "steps",
        "save_steps": t.save_steps,
        "save_total_limit": t.save_total_limit,
        "eval_strategy": "steps" if has_eval and t.eval_steps else "no",
        "eval_steps": t.eval_steps,
        "seed": t.seed,
        "data_seed": t.seed,
        "report_to": list(t.report_to) or "none",
        "bf16": on_gpu and compute_dtype == torch.bfloat16,
        "fp16": on_gpu and compute_dtype == torch.float16,
        "include_num_input_tokens_seen": "non_padding",  # read once per update (trainer/step_syncs.py)
        # no read of the loss per micro-step: a NaN loss is logged as NaN instead of being averaged away
        "logging_nan_inf_filter": False,
        # DDP over LoRA: every adapter gets a gradient in every micro-step and no buffer changes in training, so
        # DDP neither walks the graph for unused parameters nor broadcasts buffers before each forward
        # (transformers sets find_unused_parameters=True for any model that is not a PreTrainedModel, a PeftModel)
        "ddp_find_unused_parameters": False,
        "ddp_broadcast_buffers": False,
        "dataset_num_proc": None,
        "disable_tqdm": True,
    }
    kwargs.update(t.extra)
    return SFTConfig(**kwargs)


@contextlib.contextmanager
def _tensorboard_dir(path: Path) -> Iterator[None]:
    """transformers' TensorBoard callback reads its folder from the environment when the trainer is built."""
    previous = os.environ.get("TENSORBOARD_LOGGING_DIR")
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(path)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TENSORBOARD_LOGGING_DIR", None)
        else:
            os.environ["TENSORBOARD_LOGGING_DIR"] = previous


@dataclass(frozen=True)
class TrainingInputs:
    """Everything SFTTrainer is built from."""

    args: SFTConfig
    model: PreTrainedModel
    tokenizer: Any
    train_set: Dataset
    eval_set: Dataset | None
    peft_config: LoraConfig


def training_inputs(recipe: Recipe, location: OutputLocation, phases: Phases | None = None) -> TrainingInputs:
    """Tokenizer, data and SFTConfig, THEN the model.

    TrainingArguments.__post_init__ reads `self.device`, which creates accelerate's PartialState
    and with it the torch.distributed process group (transformers 5.23 training_args.py
    `_setup_devices`). transformers reads `is_fsdp_enabled()` while loading weights, and it is
    False until that group exists, so the config must come first.
    """
    from trainer.data import prepare_datasets
    from trainer.fsdp import fsdp2_loads_persistent_buffers
    from trainer.model_files import resolve_model_path
    from trainer.modeling import load_model, load_tokenizer, lora_config

    phase = phases or Phases()
    fsdp2_loads_persistent_buffers()  # else accelerate's FSDP2 prepare fails on Gemma 4 (trainer/fsdp.py)
    # staged once per run in the bucket (trainer/base_weights.py); per-node file lock, before the process group
    with phase("stage_weights"):
        model_path = stage_base_model(resolve_model_path(recipe.model.name_or_path), recipe.model.revision, location)
    with phase("prepare_data"):
        tokenizer: Any = load_tokenizer(recipe.model, model_path)
        text_tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        split = prepare_datasets(recipe.data, text_tokenizer, recipe.training.max_length)
        loss = choose_loss_mode(text_tokenizer, recipe.training.assistant_only_loss)
        train_set, eval_set = split.train, split.eval
        if loss is LossMode.COMPLETION:
            train_set = to_prompt_completion(train_set)
            eval_set = to_prompt_completion(eval_set) if eval_set is not None else None
        args = sft_config(recipe, location, has_eval=eval_set is not None, loss=loss)
        startup = startup_group()  # every rank, right after the process group came up in sft_config
    with phase("load_model"):
        model = load_model(recipe.model, recipe.quantization, model_path)
    with phase("wait_for_ranks"):
        _startup_barrier(startup)  # the ranks that load no weights wait here for local rank 0's download
    return TrainingInputs(args, model, tokenizer, train_set, eval_set, lora_config(recipe.lora, model))


def startup_group() -> Any:
    """A gloo group over every rank whose barrier waits up to STARTUP_TIMEOUT; None without several ranks.

    Created by every rank at the same point (right after the default process group exists), used once
    the models are loaded. gloo runs on the CPU, next to an NCCL default group, with its own timeout
    (torch.distributed `new_group(backend=..., timeout=...)`).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.new_group(backend="gloo", timeout=STARTUP_TIMEOUT)


def _startup_barrier(group: Any) -> None:
    if group is not None:
        import torch.distributed as dist

        log.info("waiting for every rank to hold its model (up to %s)", STARTUP_TIMEOUT)
        dist.barrier(group=group)


def build_trainer(
    recipe: Recipe,
    location: OutputLocation,
    callbacks: Sequence[TrainerCallback] = (),
    phases: Phases | None = None,
) -> tuple[SFTTrainer, Any]:
    """Load model, tokenizer and data for a recipe and wire them into an SFTTrainer (not yet trained)."""
    from trainer.lm_head import new_sft_trainer
    from trainer.metrics_log import metrics_log_callback
    from trainer.recipe import CompileMode

    phase = phases or Phases()
    inputs = training_inputs(recipe, location, phase)
    with phase("build_trainer"), _tensorboard_dir(location.local / "logs"):
        trainer = new_sft_trainer(
            model=inputs.model,
            args=inputs.args,
            train_dataset=inputs.train_set,
            eval_dataset=inputs.eval_set,
            processing_class=inputs.tokenizer,
            peft_config=inputs.peft_config,
            callbacks=[mirror_callback(location), metrics_log_callback(recipe), *callbacks],
        )
        trainer.add_callback(ddp_check(trainer))
        mode = compile_mode(recipe, trainer)
        if mode is CompileMode.REGIONAL and getattr(trainer, "is_fsdp_enabled", False):
            log.warning("training.compile=regional is not applied under FSDP2: its layers run eagerly")
        elif mode is CompileMode.REGIONAL:
            from trainer.regional_compile import compile_decoder_layers, eager_after_training

            log.info("compiled %d decoder layers in place", compile_decoder_layers(trainer.model))
            trainer.add_callback(eager_after_training())
    return trainer, inputs.tokenizer


def compile_mode(recipe: Recipe, trainer: Any) -> Any:
    """`training.compile` with `auto` decided: regional for a bf16 model on CUDA without FSDP2, else none."""
    import torch

    from trainer.recipe import CompileMode

    mode = recipe.training.compile
    if mode is not CompileMode.AUTO:
        return mode
    quantized = recipe.quantization is not None and recipe.quantization.load_in_4bit
    eager = quantized or getattr(trainer, "is_fsdp_enabled", False) or not torch.cuda.is_available()
    return CompileMode.NONE if eager else CompileMode.REGIONAL


def ddp_settings(model_wrapped: Any) -> dict[str, bool] | None:
    """The DDP wrapper's own settings (run_summary.json `ddp`), None when the run is not wrapped in DDP."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model_wrapped, DistributedDataParallel):
        return None
    return {
        "find_unused_parameters": bool(model_wrapped.find_unused_parameters),
        "broadcast_buffers": bool(model_wrapped.broadcast_buffers),
    }


def ddp_check(trainer: SFTTrainer) -> TrainerCallback:
    """A callback that, once accelerate has wrapped the model (`on_train_begin`), stops a run whose DDP wrapper
    does not hold the settings sft_config asked for."""
    from transformers import TrainerCallback

    class DdpCheck(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            found = ddp_settings(trainer.model_wrapped)
            wanted = {
                "find_unused_parameters": args.ddp_find_unused_parameters,
                "broadcast_buffers": args.ddp_broadcast_buffers,
            }
            if found is not None and any(v is not None and found[k] != v for k, v in wanted.items()):
                raise RuntimeError(f"the DDP wrapper holds {found}, not the {wanted} sft_config set")

    return DdpCheck()


def find_resume_checkpoint(location: OutputLocation, args: TrainingArguments) -> Path | None:
    """The newest complete checkpoint, downloaded once per machine.

    Local rank 0 looks (and downloads) first while the machine's other ranks wait at
    TrainingArguments.main_process_first's barrier; they then find it complete in the shared
    staging folder. Every rank downloading into that one folder raced (rmtree + os.replace).
    """
    with args.main_process_first(local=True, desc="finding the checkpoint to resume from"):
        return location.latest_checkpoint(download=args.local_process_index == 0)


def finished_result(recipe: Recipe) -> RunResult | None:
    """The result of the run `output.dir` already holds (its `_RUN_COMPLETE.json`), else None. Reads the marker
    only: needs nothing of the model or the data."""
    finished = OutputLocation.from_dir(recipe.output.dir).finished_run()
    if finished is None:
        return None
    log.info(
        "%s already holds a finished run (%s): nothing to train; choose a new output.dir to train again",
        recipe.output.dir,
        RUN_MARKER,
    )
    return RunResult(
        output_dir=recipe.output.dir,
        adapter_dir=finished["adapter_dir"],
        merged_dir=finished.get("merged_dir"),
        summary=finished["summary"],
    )


def main(recipe: Recipe, callbacks: Sequence[TrainerCallback] = ()) -> RunResult:
    """Train, save the adapter, optionally merge, write run_summary.json, mirror everything to output.dir."""
    from trainer.export import clear_completion_marker, merge_and_export, publish_run, push_to_hub
    from trainer.metrics_log import StartupHeartbeat

    started = time.perf_counter()
    phase = Phases()
    phase.add("start", process_start_seconds())
    finished = finished_result(recipe)
    if finished is not None:
        return finished
    # torchrun (accelerate launch) sets WORLD_SIZE; a plain `python -m trainer` is one process.
    problem = world_size_problem(recipe, int(os.environ.get("WORLD_SIZE") or 1), "this run")
    if problem:
        raise RecipeError(problem)
    location = OutputLocation.from_dir(recipe.output.dir)
    location.local.mkdir(parents=True, exist_ok=True)
    preemption = preemption_callback()
    startup = StartupHeartbeat(recipe)  # world rank 0: the alerts see a stuck start-up too
    phase.on_start = startup.progress
    try:
        trainer, tokenizer = build_trainer(recipe, location, [*callbacks, preemption], phase)
        with phase("find_checkpoint"):
            resume_from = find_resume_checkpoint(location, trainer.args)
    finally:
        startup.stop()  # the training loop's own heartbeat starts at on_train_begin
        phase.on_start = None
    if resume_from is not None:
        log.info("resuming from %s", resume_from)
    preemption.install()
    try:
        with phase("train"):
            train_output = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    finally:
        preemption.uninstall()
    if preemption.stopped_at is not None:
        raise Preempted(preemption.stopped_at)
    with phase("evaluate"):
        evaluation = run_evaluation(trainer, recipe, tokenizer)  # None without held-out rows
    eval_loss = evaluation["after"]["loss"] if evaluation else None

    adapter_dir = location.local / "adapter"
    if trainer.is_world_process_zero():
        clear_completion_marker(adapter_dir)  # a retried run rewrites it: marked again only after its summary
    with phase("save_adapter"):
        save_adapter(trainer, adapter_dir)
    merged_dir = None
    if recipe.writes_merged and trainer.is_world_process_zero():
        with phase("merge"):
            base = merge_base(recipe.model.name_or_path, recipe.model.revision, location)
            merged_dir = merge_and_export(base, adapter_dir, location.local / "merged", tokenizer=tokenizer, mark=False)

    summary = run_summary(
        recipe, trainer, train_output, eval_loss, resume_from, time.perf_counter() - started, phase.seconds
    )
    summary["eval"] = evaluation
    result = RunResult(
        output_dir=recipe.output.dir,
        adapter_dir=location.remote_path("adapter") or str(adapter_dir),
        merged_dir=(location.remote_path("merged") or str(merged_dir)) if merged_dir else None,
        summary=summary,
        processing_class=tokenizer,
    )
    if trainer.is_world_process_zero():
        # the summary, then the exports' markers (trainer/export.py publish_run), then the logs
        with phase("publish"):
            publish_run(location, summary, adapter_dir, merged_dir, recipe.model.name_or_path, trainer.model.config)
            _publish_logs(location)
        if recipe.output.push_to_hub and recipe.output.hub_model_id:
            with phase("push_to_hub"):
                summary["hub_url"] = push_to_hub(
                    merged_dir or adapter_dir, recipe.output.hub_model_id, recipe.output.hub_private
                )
        location.mark_run_complete(
            {
                "recipe": recipe.name,
                "adapter_dir": result.adapter_dir,
                "merged_dir": result.merged_dir,
                "summary": summary,
                # the uploads ran after run_summary.json was written
                "upload_phases_s": {k: v for k, v in phase.seconds.items() if k not in summary["phases_s"]},
            }
        )
    return result


def save_adapter(trainer: SFTTrainer, adapter_dir: Path) -> None:
    """Save the LoRA adapter and the tokenizer; under FSDP every shard is gathered first (all ranks call this).

    FSDP2 with adapter-only saving has been seen to write only rank 0's shard of each
    matrix; `save_adapter_fsdp_safe` gathers full tensors on every rank and writes on rank 0
    (tests/trainer/test_fsdp_save.py proves it equals an unsharded run). `Trainer.save_model`
    writes the tokenizer (its `processing_class`) itself; the FSDP path writes it here, once.
    """
    if getattr(trainer, "is_fsdp_enabled", False):
        from trainer.fsdp import save_adapter_fsdp_safe

        save_adapter_fsdp_safe(trainer.model, adapter_dir)
        if trainer.is_world_process_zero() and trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(adapter_dir)
    else:
        trainer.save_model(str(adapter_dir))


def run_summary(
    recipe: Recipe,
    trainer: SFTTrainer,
    train_output: Any,
    eval_loss: float | None,
    resumed_from: Path | None,
    wall_time_s: float,
    phases_s: dict[str, float] | None = None,
) -> dict[str, Any]:
    """What a person checks after a run: how far it got, how fast, how well, where the time went, what it cost."""
    state = trainer.state
    train_losses = [entry["loss"] for entry in state.log_history if "loss" in entry]
    runtime = float(train_output.metrics.get("train_runtime", wall_time_s))
    tokens = int(state.num_input_tokens_seen)
    return {
        "recipe": recipe.name,
        "model": recipe.model.name_or_path,
        "steps": state.global_step,
        "resumed_from_step": checkpoint_step(resumed_from) if resumed_from else None,
        "tokens_seen": tokens,
        "tokens_per_second": round(tokens / runtime, 2) if runtime > 0 else None,
        "final_train_loss": train_losses[-1] if train_losses else None,
        "mean_train_loss": train_output.training_loss,
        "eval_loss": eval_loss,
        "train_runtime_s": round(runtime, 2),
        "wall_time_s": round(wall_time_s, 2),
        "phases_s": dict(phases_s or {}),
        # the DDP wrapper's own settings, None when the run was not wrapped in DDP
        "ddp": ddp_settings(trainer.model_wrapped),
        SUMMARY_COST_KEY: run_cost_line(recipe.output.dir, wall_time_s, phases_s),
    }


def _publish_logs(location: OutputLocation) -> None:
    """Mirror the training logs (TensorBoard) to a remote output.dir; the exports are `publish_run`'s."""
    if location.remote and (location.local / "logs").is_dir():
        upload_dir(location.local / "logs", f"{location.remote}/logs")
