"""Training throughput: a shipped recipe against its seed, same model, same data, same optimizer steps.

    .venv/bin/python bench/train_throughput.py --device cpu                      # text-to-SQL recipe, real 270M
    .venv/bin/python bench/train_throughput.py --device cpu --recipe emoji-gemma3-1b
    .venv/bin/python bench/train_throughput.py --device cpu --model tiny --steps 3   # seconds, used by the test
    .venv/bin/python bench/train_throughput.py --device cuda --model gemma3-1b   # H200: 1B shape, bf16, MFU
    .venv/bin/python bench/train_throughput.py --device cuda --model gemma3-4b --peak-tflops 989

OURS is the recipe file (`--recipe`), built by the trainer's own constructor; SEED is the workload's seed
(`SEED_SIDES`, docs/seeds.md) through trl's plain `SFTTrainer`. Only the model, sizes, data and learning
rate are swapped for the benchmark. Both train in one process, in two threads that pass a baton after
every optimizer step, so load on a shared machine hits both alike: the result is a ratio. Both see every
row once in the same steps; loss parity is judged on a held-out set. Method: bench/README.md.
Not measured here: multi-GPU (FSDP) scaling, QLoRA, Hub data loading, the recipe's own batch geometry
and learning-rate schedule.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `trainer` importable
    sys.path.insert(0, str(REPO_ROOT))

from trainer.recipe import Recipe, Task, load_recipe  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedModel, TrainerCallback
    from trl import SFTTrainer

log = logging.getLogger("bench")

DEFAULT_OUT = "build/bench/train_throughput.json"
DEFAULT_RECIPE = "text-to-sql-gemma4-31b"
SAMPLES = {Task.TEXT_TO_SQL: "trainer/samples/text_to_sql.jsonl", Task.EMOJI: "trainer/samples/emoji.jsonl"}
SEED = 42
H200_BF16_DENSE_TFLOPS = 989.0
MIN_PARITY_ROWS = 20  # held-out rows below which the held-out loss is too noisy to decide parity

# Gemma 3 text shapes from the published google/gemma-3-1b-pt and google/gemma-3-4b-it (text_config) configs.
# Random weights: throughput does not depend on their values. Vocabulary is the Gemma 3 tokenizer's 262,144
# (the 4B checkpoint pads its embedding to 262,208 for image tokens; irrelevant to text throughput).
GPU_SHAPES: dict[str, dict[str, Any]] = {
    "gemma3-1b": {
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "sliding_window": 512,
    },
    "gemma3-4b": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 1024,
    },
}


@dataclass(frozen=True)
class RunConfig:
    """One side of the comparison, in recipe terms (so the winning settings map straight onto a recipe)."""

    name: str
    attn_implementation: str
    micro_batch: int
    grad_accum: int
    packing: bool
    gradient_checkpointing: bool
    optim: str
    lora: dict[str, Any]
    liger: bool = False
    padding_free: bool = False
    pack_length: int | None = None  # packed row length; None = no packing
    labels_only_head: bool = False  # built by trainer.lm_head.new_sft_trainer (ours) or plain SFTTrainer (seed)

    def recipe_training(self, max_length: int, learning_rate: float) -> dict[str, Any]:
        extra: dict[str, Any] = {"save_strategy": "no", "dataloader_num_workers": 0}
        if self.packing:
            extra["packing_strategy"] = "bfd"
        if self.liger:
            extra["use_liger_kernel"] = True  # layer kernels only: trl already fuses the LM head + loss
        return {
            "num_train_epochs": 1,
            "per_device_train_batch_size": self.micro_batch,
            "gradient_accumulation_steps": self.grad_accum,
            "learning_rate": learning_rate,
            "lr_scheduler_type": "constant",
            "optim": self.optim,
            "max_length": self.pack_length if self.packing and self.pack_length else max_length,
            "packing": self.packing,
            "padding_free": self.packing or self.padding_free,
            "gradient_checkpointing": self.gradient_checkpointing,
            "logging_steps": 1,
            "save_steps": 10**9,
            "save_total_limit": None,
            "seed": SEED,
            "report_to": [],
            "extra": extra,
        }


@dataclass
class StepRecord:
    seconds: float
    real_tokens: int


@dataclass
class RunStats:
    """What one configuration did in the interleaved run."""

    steps: list[StepRecord] = field(default_factory=list)
    real_tokens_collated: int = 0
    slots_collated: int = 0
    peak_memory_gib: float | None = None


# --------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class SeedSide:
    """A workload's seed training settings (its source tutorial, docs/seeds.md), as far as they run here."""

    workload: str
    micro_batch: int
    gradient_checkpointing: bool
    optim: str
    lora: dict[str, Any]
    attn_implementation: str = "sdpa"


SEED_SIDES = {
    # W1: "sdpa attention. LoRA r16, alpha 32, dropout 0.05, targets q/k/v/o/gate/up/down ... SFT: max_length
    # 1024, no packing, gradient checkpointing (non-reentrant), adamw_torch"; per-device batch 2
    Task.TEXT_TO_SQL: SeedSide(
        "W1",
        micro_batch=2,
        gradient_checkpointing=True,
        optim="adamw_torch",
        lora={
            "r": 16,
            "alpha": 32,
            "dropout": 0.05,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        },
    ),
    # W3: "LoRA r8 alpha16 dropout 0.1 on q_proj/v_proj; 1 epoch, batch 1, grad accum 2, paged_adamw_32bit";
    # no attention named (transformers' default for Gemma 3 is sdpa); QLoRA and the paged optimizer need CUDA
    Task.EMOJI: SeedSide(
        "W3",
        micro_batch=1,
        gradient_checkpointing=False,
        optim="adamw_torch",
        lora={"r": 8, "alpha": 16, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]},
    ),
}


def shipped_recipe(args: argparse.Namespace) -> Recipe:
    """The recipe file the benchmark measures; only tasks with a bundled text sample and a seed side qualify."""
    recipe = load_recipe(args.recipe)
    if recipe.data.task not in SEED_SIDES:
        raise SystemExit(
            f"--recipe {args.recipe}: task {recipe.data.task.value} has no seed side here; "
            f"benchmark one of the tasks {sorted(t.value for t in SEED_SIDES)}"
        )
    return recipe


def seed_config(recipe: Recipe, steps_sequences: int) -> RunConfig:
    """The seed of the recipe's workload: padded batches, its optimizer, its adapter, plain SFTTrainer."""
    seed = SEED_SIDES[recipe.data.task]
    if steps_sequences % seed.micro_batch:
        raise ValueError(
            f"--seqs-per-step={steps_sequences} must be a multiple of {seed.micro_batch} "
            f"(the {seed.workload} seed's per-device batch)"
        )
    return RunConfig(
        name="seed",
        attn_implementation=seed.attn_implementation,
        micro_batch=seed.micro_batch,
        grad_accum=steps_sequences // seed.micro_batch,
        packing=False,
        gradient_checkpointing=seed.gradient_checkpointing,
        optim=seed.optim,
        lora=seed.lora,
    )


def ours_config(recipe: Recipe, device: str, steps_sequences: int, grad_accum: int | None) -> RunConfig:
    """The recipe's own settings; only the number of micro-batches per step is the benchmark's.

    A packing recipe packs the step's sequences into `micro_batch x grad_accum` rows (`grad_accum` from
    `--ours-grad-accum`); one that does not pack takes the seed's sequences per step in micro-batches of
    its own size. Liger's layer kernels are used where the recipe asks for them and they are installed.
    """
    t = recipe.training
    liger = bool(t.extra.get("use_liger_kernel", False)) and device == "cuda" and _importable("liger_kernel")
    if t.packing:
        accum = grad_accum or (2 if device == "cpu" else 1)
    else:
        if steps_sequences % t.per_device_train_batch_size:
            raise ValueError(
                f"--seqs-per-step={steps_sequences} must be a multiple of the recipe's "
                f"per_device_train_batch_size {t.per_device_train_batch_size}"
            )
        accum = steps_sequences // t.per_device_train_batch_size
    return RunConfig(
        name="ours",
        attn_implementation=recipe.model.attn_implementation,
        micro_batch=t.per_device_train_batch_size,
        grad_accum=accum,
        packing=t.packing,
        padding_free=t.padding_free,
        gradient_checkpointing=t.gradient_checkpointing,
        optim=t.optim,
        lora=recipe.lora.model_dump(),
        liger=liger,
        labels_only_head=True,
    )


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def bench_recipe(cfg: RunConfig, model_path: str, args: argparse.Namespace, out_dir: Path) -> Recipe:
    """A complete recipe for one side, validated by the trainer's own schema."""
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    task = args.shipped.data.task
    return Recipe.model_validate(
        {
            "name": f"bench-{cfg.name}",
            "model": {"name_or_path": model_path, "dtype": dtype, "attn_implementation": cfg.attn_implementation},
            "lora": cfg.lora,
            "data": {
                "task": task.value,
                "source": "local",
                "path": SAMPLES[task],
                "max_rows": args.train_rows + args.eval_rows,
                "eval_rows": args.eval_rows,
                "seed": SEED,
            },
            "training": cfg.recipe_training(args.max_length, args.learning_rate),
            "output": {"dir": str(out_dir / cfg.name), "merge": False},
            "evaluation": {"enabled": False},
        }
    )


# --------------------------------------------------------------------------- models


def model_source(args: argparse.Namespace, workdir: Path) -> str:
    """A model folder for the CPU modes: the real Gemma 3 270M, or a tiny random Gemma 3 saved on the spot."""
    if args.model == "gemma3-270m":
        from trainer.local_model import ensure_local_model

        return str(ensure_local_model())
    if args.model == "tiny":
        from tests.tiny_models import save_tiny_model

        return str(save_tiny_model(workdir / "tiny-gemma3", "gemma3"))
    # GPU shapes: weights are built in memory; the tokenizer comes from the local 270M's folder, or with
    # `--tokenizer tiny` from a tiny model's folder (a 600-entry BPE: ids fit the 262,144-row embedding;
    # conversations tokenize longer than with Gemma's tokenizer, and the FLOPs count uses the lengths seen)
    if getattr(args, "tokenizer", "gemma3-270m") == "tiny":
        from tests.tiny_models import save_tiny_model

        return str(save_tiny_model(workdir / "tiny-gemma3", "gemma3"))
    from trainer.local_model import ensure_local_model

    return str(ensure_local_model())


def load_bench_model(recipe: Recipe, model_path: str, shape: str) -> PreTrainedModel:
    """The recipe's model from disk (CPU modes), or a random Gemma 3 of a published shape in bf16 on the GPU."""
    import torch

    if shape not in GPU_SHAPES:
        from trainer.modeling import load_model

        return load_model(recipe.model, None, model_path)
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    sizes = GPU_SHAPES[shape]
    pattern = ["sliding_attention"] * 5 + ["full_attention"]
    config = Gemma3TextConfig(
        vocab_size=262144,
        query_pre_attn_scalar=256,
        max_position_embeddings=32768,
        layer_types=[pattern[i % 6] for i in range(sizes["num_hidden_layers"])],
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        **sizes,
    )
    torch.manual_seed(SEED)
    with torch.device("cuda"):
        return Gemma3ForCausalLM._from_config(
            config, dtype=torch.bfloat16, attn_implementation=recipe.model.attn_implementation
        )


# --------------------------------------------------------------------------- packing size


def token_lengths(trainer: SFTTrainer) -> list[int]:
    return [len(ids) for ids in trainer.train_dataset["input_ids"]]


def packed_rows(lengths: Sequence[int], pack_length: int) -> int:
    """How many rows trl's best-fit-decreasing packing makes of these sequences."""
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    dataset = Dataset.from_dict({"input_ids": [[1] * n for n in lengths]})
    return len(pack_dataset(dataset, pack_length, strategy="bfd"))


def choose_pack_length(lengths: Sequence[int], target_rows: int) -> int:
    """The shortest packed row length (a multiple of 8, never truncating) that packs into at most `target_rows`."""
    length = max(max(lengths), -(-sum(lengths) // target_rows))
    length += -length % 8
    while packed_rows(lengths, length) > target_rows:
        length += 8
    return length


# --------------------------------------------------------------------------- interleaving


class Baton:
    """Turn-taking between training threads: the holder trains one optimizer step, then passes it on."""

    def __init__(self, names: Sequence[str]) -> None:
        self._order = list(names)
        self._turn = self._order[0]
        self._done: set[str] = set()
        self._cond = threading.Condition()

    def wait(self, name: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == name)

    def pass_on(self, name: str, finished: bool = False) -> None:
        with self._cond:
            if finished:
                self._done.add(name)
            waiting = [n for n in self._order if n not in self._done]
            if waiting:
                i = self._order.index(name)
                following = self._order[i + 1 :] + self._order[: i + 1]
                self._turn = next(n for n in following if n not in self._done)
            self._cond.notify_all()


def interleave_callback(name: str, baton: Baton, stats: RunStats, sync: Callable[[], None]) -> TrainerCallback:
    """Times each optimizer step of one trainer (data fetch included) and hands over the baton after it."""
    from transformers import TrainerCallback

    class _Interleave(TrainerCallback):
        def __init__(self) -> None:
            self.started = 0.0
            self.tokens_before = 0

        def _take(self, state: Any) -> None:
            baton.wait(name)
            self.started = time.perf_counter()
            self.tokens_before = int(state.num_input_tokens_seen)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._take(state)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            sync()
            seconds = time.perf_counter() - self.started
            stats.steps.append(StepRecord(seconds, int(state.num_input_tokens_seen) - self.tokens_before))
            log.info(
                "%s step %d: %.1f s, %d real tokens", name, state.global_step, seconds, stats.steps[-1].real_tokens
            )
            baton.pass_on(name)
            self._take(state)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            baton.pass_on(name, finished=True)

    return _Interleave()


class CountingCollator:
    """Wraps a trainer's collator to count real tokens against the slots of the batches it builds."""

    def __init__(self, inner: Callable[[list[dict[str, Any]]], dict[str, Any]], stats: RunStats) -> None:
        self.inner = inner
        self.stats = stats

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.inner(examples)
        self.stats.real_tokens_collated += sum(len(example["input_ids"]) for example in examples)
        self.stats.slots_collated += int(batch["input_ids"].numel())
        return batch


def train_interleaved(trainers: dict[str, SFTTrainer], stats: dict[str, RunStats]) -> None:
    """Run every trainer's `train()` in its own thread; the baton lets exactly one step run at a time."""
    errors: list[BaseException] = []

    def run(name: str, trainer: SFTTrainer) -> None:
        try:
            trainer.train()
        except BaseException as exc:  # surfaced below, after the other thread is released
            errors.append(exc)
            baton.pass_on(name, finished=True)

    baton = Baton(list(trainers))
    sync = _synchronizer()
    from transformers import PrinterCallback

    for name, trainer in trainers.items():
        trainer.remove_callback(PrinterCallback)  # the table at the end says it all
        trainer.add_callback(interleave_callback(name, baton, stats[name], sync))
        trainer.data_collator = CountingCollator(trainer.data_collator, stats[name])
    threads = [threading.Thread(target=run, args=item, name=f"train-{item[0]}") for item in trainers.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _synchronizer() -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


# --------------------------------------------------------------------------- building


@dataclass
class Built:
    trainer: SFTTrainer
    tokenizer: Any
    recipe: Recipe


def build(cfg: RunConfig, model_path: str, args: argparse.Namespace, workdir: Path, eval_set: bool = False) -> Built:
    """An SFTTrainer for one configuration, assembled from the trainer package's functions."""
    from transformers import set_seed
    from trl import SFTTrainer

    from trainer.checkpoints import OutputLocation
    from trainer.data import prepare_datasets
    from trainer.lm_head import new_sft_trainer
    from trainer.modeling import load_tokenizer, lora_config
    from trainer.train import LossMode, choose_loss_mode, sft_config, to_prompt_completion

    recipe = bench_recipe(cfg, model_path, args, workdir)
    tokenizer = load_tokenizer(recipe.model, model_path)
    split = prepare_datasets(recipe.data, tokenizer, args.max_length)
    loss = choose_loss_mode(tokenizer, recipe.training.assistant_only_loss)
    train_set, held_out = split.train, split.eval
    if loss is LossMode.COMPLETION:
        train_set = to_prompt_completion(train_set)
        held_out = to_prompt_completion(held_out) if held_out is not None else None
    set_seed(SEED)  # identical base weights (GPU shapes) and identical LoRA initialisation on both sides
    model = load_bench_model(recipe, model_path, args.model)
    set_seed(SEED)
    constructor = new_sft_trainer if cfg.labels_only_head else SFTTrainer
    trainer = constructor(
        model=model,
        args=sft_config(recipe, OutputLocation.from_dir(recipe.output.dir), has_eval=False, loss=loss),
        train_dataset=train_set,
        eval_dataset=held_out if eval_set else None,
        processing_class=tokenizer,
        peft_config=lora_config(recipe.lora, model),
    )
    return Built(trainer, tokenizer, recipe)


def sized_ours(seed: Built, args: argparse.Namespace) -> RunConfig:
    """Ours, with a packed row length that gives exactly the seed's number of optimizer steps."""
    rows = len(seed.trainer.train_dataset)
    steps = -(-rows // (seed.trainer.args.per_device_train_batch_size * seed.trainer.args.gradient_accumulation_steps))
    base = ours_config(args.shipped, args.device, args.seqs_per_step, args.ours_grad_accum)
    if not base.packing:
        return base
    target_rows = steps * base.micro_batch * base.grad_accum
    return replace(base, pack_length=choose_pack_length(token_lengths(seed.trainer), target_rows))


# --------------------------------------------------------------------------- checks


def packing_isolation_error(trainer: SFTTrainer, sequences: Sequence[Sequence[int]]) -> float:
    """Max |logit difference| between sequences run alone and the same sequences packed padding-free.

    Near zero means the packed row's attention does not leak across sequence boundaries with this
    attention implementation (transformers derives a block-diagonal mask from the restarting position_ids).
    """
    import torch

    model = trainer.model
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = trainer.data_collator([{"input_ids": list(ids)} for ids in sequences])
            inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in packed.items() if k != "labels"}
            logits_packed = model(**inputs).logits[0].float()
            alone = [model(input_ids=torch.tensor([list(ids)], device=device)).logits[0].float() for ids in sequences]
    finally:
        model.train(was_training)
    return float((logits_packed - torch.cat(alone)).abs().max())


def isolation_sequences(seed: Built, length: int = 96) -> list[list[int]]:
    """Two different training sequences, cut short: enough to expose a leak, cheap on a CPU."""
    ids = seed.trainer.train_dataset.select(range(2))["input_ids"]
    return [list(ids[0][:length]), list(ids[1][: length // 2])]


def held_out_loss(model: Any, batches: Sequence[dict[str, Any]]) -> float:
    """Token-weighted cross-entropy on the held-out batches (assistant tokens only)."""
    import torch

    device = next(model.parameters()).device
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                batch = {k: v.to(device) for k, v in batch.items() if torch.is_tensor(v)}
                n = int((batch["labels"][:, 1:] != -100).sum())
                loss = model(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
                ).loss
                total += float(loss) * n
                count += n
    finally:
        model.train(was_training)
    return total / max(count, 1)


def held_out_batches(seed: Built, batch_size: int = 2) -> list[dict[str, Any]]:
    """Padded batches of the held-out rows built with the seed's collator, scored the same way for both."""
    dataset = seed.trainer.eval_dataset
    if dataset is None:
        return []
    rows = [dataset[i] for i in range(len(dataset))]
    return [seed.trainer.data_collator(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]


def train_losses(trainer: SFTTrainer) -> list[float]:
    return [float(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]


# --------------------------------------------------------------------------- FLOPs


def flops_per_token(model: Any, mean_seq_len: float) -> dict[str, float]:
    """LoRA training FLOPs per real token: 4 x N_frozen + 6 x N_lora + attention.

    The frozen base runs forward (2N) and a backward for the input gradients only (2N); the adapters
    run forward and both backward passes (6N). N_frozen counts every matmul weight, the tied LM head
    included and the embedding lookup excluded. Attention (score and value products, forward 4·H·D·ctx
    per layer, backward twice that) adds 12·H·D·ctx per layer, ctx = min(mean sequence length, window).
    Recomputation by gradient checkpointing and work on padding are NOT useful FLOPs.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config()
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    matmul = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n and "embed_tokens" not in n)
    if not any(n.endswith("lm_head.weight") for n, _ in model.named_parameters()):
        matmul += config.vocab_size * config.hidden_size  # LM head tied to the embedding: counted once, as a matmul
    windows = [
        min(mean_seq_len, config.sliding_window) if kind == "sliding_attention" else mean_seq_len
        for kind in config.layer_types
    ]
    attention = 12 * config.num_attention_heads * config.head_dim * sum(windows)
    return {"n_frozen": float(matmul), "n_lora": float(lora), "per_token": 4 * matmul + 6 * lora + attention}


# --------------------------------------------------------------------------- memory


def peak_memory_gib() -> float:
    """Peak GPU memory allocated by tensors, else peak resident set size of this process."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def start_memory_probe(side: str, argv: Sequence[str], steps: int) -> subprocess.Popen[str]:
    """One configuration trained alone for a few steps in a fresh process, which prints its peak memory."""
    script = str(Path(__file__).resolve())
    command = [sys.executable, script, *argv, "--memory-probe", side, "--probe-steps", str(steps)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_memory_probe(side: str, probe: subprocess.Popen[str]) -> float | None:
    """The peak memory a probe printed, or None (logged) when it printed none."""
    stdout, stderr = probe.communicate()
    for line in reversed(stdout.splitlines()):
        if line.startswith("PEAK_MEMORY_GIB="):
            return float(line.split("=", 1)[1])
    log.warning("memory probe for %s failed (rc %s): %s", side, probe.returncode, stderr[-2000:])
    return None


def memory_probes(argv: Sequence[str], steps: int, device: str, threads: int) -> dict[str, float | None]:
    """Each side's peak memory, each side in its own fresh process. On the CPU the two run at once, on half the
    `threads` each (more would contend for the cores), when the free memory holds both with room to spare (twice
    this process's resident set, which holds both models): each reads its own process's peak resident set, which
    the other does not change, unless the machine swaps. Otherwise, and on a GPU, one at a time, each alone."""
    import psutil  # accelerate's dependency

    room = psutil.virtual_memory().available > 2 * psutil.Process().memory_info().rss
    if device == "cpu" and room:
        half = [*argv, "--threads", str(max(1, threads // 2))]
        probes = {side: start_memory_probe(side, half, steps) for side in ("seed", "ours")}
        return {side: finish_memory_probe(side, probe) for side, probe in probes.items()}
    return {side: finish_memory_probe(side, start_memory_probe(side, argv, steps)) for side in ("seed", "ours")}


def run_memory_probe(args: argparse.Namespace) -> None:
    """Child-process entry: train one side for `--probe-steps` optimizer steps, print its peak memory."""
    with tempfile.TemporaryDirectory(prefix="bench-probe-") as tmp:
        workdir = Path(tmp)
        model_path = model_source(args, workdir)
        if args.memory_probe == "seed":
            cfg = seed_config(args.shipped, args.seqs_per_step)
        else:
            base = ours_config(args.shipped, args.device, args.seqs_per_step, args.ours_grad_accum)
            cfg = replace(base, pack_length=args.pack_length if base.packing else None)
        chosen = build(cfg, model_path, args, workdir)
        chosen.trainer.args.max_steps = args.probe_steps
        chosen.trainer.train()
        print(f"PEAK_MEMORY_GIB={peak_memory_gib():.4f}")


# --------------------------------------------------------------------------- report


def side_report(
    cfg: RunConfig, stats: RunStats, trainer: SFTTrainer, warmup: int, held_out: float | None, last_k: int
) -> dict[str, Any]:
    timed = stats.steps[warmup:] or stats.steps
    seconds = sum(s.seconds for s in timed)
    tokens = sum(s.real_tokens for s in timed)
    losses = train_losses(trainer)
    tail = losses[-last_k:]
    return {
        "config": asdict(cfg),
        "optimizer_steps": len(stats.steps),
        "timed_steps": len(timed),
        "real_tokens_timed": tokens,
        "real_tokens_total": sum(s.real_tokens for s in stats.steps),
        "seconds_timed": round(seconds, 3),
        "wall_seconds_all_steps": round(sum(s.seconds for s in stats.steps), 3),
        "tokens_per_second": round(tokens / seconds, 2) if seconds > 0 else 0.0,
        "padding_fraction": round(1 - stats.real_tokens_collated / max(stats.slots_collated, 1), 4),
        "peak_memory_gib": None if stats.peak_memory_gib is None else round(stats.peak_memory_gib, 3),
        "final_train_loss": losses[-1] if losses else None,
        f"mean_train_loss_last_{last_k}": sum(tail) / len(tail) if tail else None,
        "held_out_loss": held_out,
        "train_losses": losses,
        "step_seconds": [round(s.seconds, 3) for s in stats.steps],
    }


def parity(seed: dict[str, Any], ours: dict[str, Any], tolerance: float, last_k: int, eval_rows: int) -> dict[str, Any]:
    """One-sided loss parity: ours' held-out loss may not exceed the seed's by more than `tolerance` (relative).

    Ours doing better is no failure (a two-sided check once failed ours for a 19% lower held-out loss on 2
    rows). The held-out loss decides, on at least MIN_PARITY_ROWS rows; the last-k mean training loss is
    reported beside it (packing regroups the batches, so it is context, not a verdict).
    """

    def rel(key: str) -> float | None:
        a, b = seed.get(key), ours.get(key)
        return None if a is None or b is None else (b - a) / abs(a)  # > 0: ours worse

    held = rel("held_out_loss")
    enough = held is not None and eval_rows >= MIN_PARITY_ROWS
    return {
        "tolerance_relative": tolerance,
        "one_sided": True,
        "eval_rows": eval_rows,
        "min_eval_rows": MIN_PARITY_ROWS,
        "held_out_loss_rel_diff": held,
        f"mean_train_loss_last_{last_k}_rel_diff": rel(f"mean_train_loss_last_{last_k}"),
        "ok": enough and held is not None and held <= tolerance,
        "reason": (
            f"ours' held-out loss is {held:+.2%} relative to the seed's (allowed: at most +{tolerance:.0%})"
            if enough and held is not None
            else f"needs a held-out loss on at least {MIN_PARITY_ROWS} rows (--eval-rows {eval_rows})"
        ),
    }


def table(result: dict[str, Any]) -> str:
    s, o, r = result["seed"], result["ours"], result["ratio_ours_over_seed"]
    rows = [
        ("real tokens/s", s["tokens_per_second"], o["tokens_per_second"], r["tokens_per_second"]),
        ("padding fraction", s["padding_fraction"], o["padding_fraction"], None),
        ("peak memory GiB", s["peak_memory_gib"], o["peak_memory_gib"], r["peak_memory"]),
        ("wall s (all steps)", s["wall_seconds_all_steps"], o["wall_seconds_all_steps"], r["wall_time"]),
        ("optimizer steps", s["optimizer_steps"], o["optimizer_steps"], None),
        ("real tokens", s["real_tokens_total"], o["real_tokens_total"], None),
        ("final train loss", s["final_train_loss"], o["final_train_loss"], None),
        (f"mean loss last {result['last_k']}", *[x[f"mean_train_loss_last_{result['last_k']}"] for x in (s, o)], None),
        ("held-out loss", s["held_out_loss"], o["held_out_loss"], None),
    ]
    if "mfu" in s:
        rows.append(("MFU", s["mfu"], o["mfu"], r.get("mfu")))

    def fmt(x: Any) -> str:
        if x is None:
            return "-"
        return f"{x:.4g}" if isinstance(x, float) else str(x)

    lines = [f"{'':22}{'seed':>14}{'ours':>14}{'ours/seed':>12}"]
    lines += [f"{name:22}{fmt(a):>14}{fmt(b):>14}{fmt(c):>12}" for name, a, b, c in rows]
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a in (None, 0) or b is None else round(b / a, 3)


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help="the shipped recipe measured as OURS (name or path)")
    p.add_argument("--model", choices=["gemma3-270m", "tiny", *GPU_SHAPES], default=None)
    p.add_argument(
        "--tokenizer", choices=["gemma3-270m", "tiny"], default="gemma3-270m", help="a GPU shape's tokenizer"
    )
    p.add_argument("--train-rows", type=int, default=None, help="training rows (seqs-per-step x steps by default)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps for both sides")
    p.add_argument("--seqs-per-step", type=int, default=None, help="sequences per optimizer step (seed: batch 2 x GA)")
    p.add_argument("--eval-rows", type=int, default=None, help=f"held-out rows for loss parity (>= {MIN_PARITY_ROWS})")
    p.add_argument("--max-length", type=int, default=None, help="longest conversation kept (default: the recipe's)")
    p.add_argument("--learning-rate", type=float, default=2e-4)
    p.add_argument("--ours-grad-accum", type=int, default=None, help="micro-batches per step (ours, packing recipes)")
    p.add_argument("--warmup-steps", type=int, default=1, help="first steps of each side left out of tokens/s")
    p.add_argument("--last-k", type=int, default=None, help="steps averaged for the training-loss comparison")
    p.add_argument(
        "--loss-tolerance", type=float, default=0.05, help="how much higher (relative) ours' held-out loss may be"
    )
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="GPU dense bf16 peak for MFU")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--no-memory-probe", action="store_true", help="skip the per-side peak-memory subprocesses")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--memory-probe", choices=["seed", "ours"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--probe-steps", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--pack-length", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return apply_defaults(args)


def apply_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Sizes that finish in a few minutes: on 2 CPU cores for the 270M, inside 5 minutes on one H200."""
    cpu = args.device == "cpu"
    args.shipped = shipped_recipe(args)
    args.max_length = args.max_length or args.shipped.training.max_length
    if args.model is None:
        args.model = "gemma3-270m" if cpu else "gemma3-1b"
    if cpu and args.model in GPU_SHAPES:
        raise SystemExit(f"--model {args.model} is a GPU shape: use --device cuda, or --model gemma3-270m|tiny on CPU")
    if not cpu and args.model not in GPU_SHAPES:
        raise SystemExit(f"--device cuda benchmarks the Gemma 3 shapes {sorted(GPU_SHAPES)}, not {args.model}")
    args.seqs_per_step = args.seqs_per_step or (4 if cpu else 16)
    args.steps = args.steps or (10 if cpu else 12)  # held-out loss parity is judged after >= 10 steps
    args.train_rows = args.train_rows or args.seqs_per_step * args.steps
    args.eval_rows = args.eval_rows if args.eval_rows is not None else MIN_PARITY_ROWS
    args.ours_grad_accum = args.ours_grad_accum or (2 if cpu else 1)
    args.last_k = args.last_k or max(1, args.steps // 2)
    rows = args.shipped.training.per_device_train_batch_size * args.ours_grad_accum
    if args.shipped.training.packing and rows > args.seqs_per_step:
        raise SystemExit(
            f"ours would pack fewer than one sequence into each of its {rows} rows: lower --ours-grad-accum"
        )
    return args


def probe_argv(args: argparse.Namespace) -> list[str]:
    """The command-line flags that make a child process build exactly the same two sides."""
    argv = [
        "--device", args.device, "--model", args.model, "--recipe", args.recipe,
        "--train-rows", str(args.train_rows), "--steps", str(args.steps),
        "--seqs-per-step", str(args.seqs_per_step), "--eval-rows", str(args.eval_rows),
        "--max-length", str(args.max_length), "--learning-rate", str(args.learning_rate),
        "--ours-grad-accum", str(args.ours_grad_accum), "--tokenizer", args.tokenizer,
    ]  # fmt: skip
    if args.threads:
        argv += ["--threads", str(args.threads)]
    return argv


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers
    import trl

    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["tokenizer"] = args.tokenizer
    return info


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor()
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build both sides, train them interleaved, score them, and return the result document."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        workdir = Path(tmp)
        model_path = model_source(args, workdir)
        seed_cfg = seed_config(args.shipped, args.seqs_per_step)
        seed = build(seed_cfg, model_path, args, workdir, eval_set=True)
        ours_cfg = sized_ours(seed, args)
        ours = build(ours_cfg, model_path, args, workdir)
        batches = held_out_batches(seed)
        scored_rows = len(seed.trainer.eval_dataset) if seed.trainer.eval_dataset is not None else 0
        padding_free = ours_cfg.packing or ours_cfg.padding_free
        isolation = packing_isolation_error(ours.trainer, isolation_sequences(seed)) if padding_free else None
        initial_loss = held_out_loss(seed.trainer.model, batches) if batches else None
        stats = {"seed": RunStats(), "ours": RunStats()}
        train_interleaved({"seed": seed.trainer, "ours": ours.trainer}, stats)
        reports = {}
        for name, built, cfg in (("seed", seed, seed_cfg), ("ours", ours, ours_cfg)):
            held = held_out_loss(built.trainer.model, batches) if batches else None
            reports[name] = side_report(cfg, stats[name], built.trainer, args.warmup_steps, held, args.last_k)
        lengths = token_lengths(seed.trainer)
        flops = flops_per_token(ours.trainer.model, sum(n * n for n in lengths) / sum(lengths))
    if not args.no_memory_probe:
        argv = [*probe_argv(args), "--pack-length", str(ours_cfg.pack_length or 0)]
        for name, peak in memory_probes(argv, args.probe_steps, args.device, torch.get_num_threads()).items():
            reports[name]["peak_memory_gib"] = peak
    if args.device == "cuda":
        for report in reports.values():
            report["mfu"] = round(report["tokens_per_second"] * flops["per_token"] / (args.peak_tflops * 1e12), 4)
    s, o = reports["seed"], reports["ours"]
    return {
        "benchmark": "train_throughput",
        "device": args.device,
        "model": args.model,
        "recipe": args.shipped.name,
        "seed_workload": SEED_SIDES[args.shipped.data.task].workload,
        "data": SAMPLES[args.shipped.data.task],
        "command": " ".join([Path(sys.executable).name, "bench/train_throughput.py", *sys.argv[1:]]),
        "environment": environment(args),
        "train_rows": args.train_rows,
        "eval_rows": args.eval_rows,
        "eval_rows_scored": scored_rows,
        "sequences_per_step_seed": args.seqs_per_step,
        "mean_real_tokens_per_step": {
            k: round(v["real_tokens_total"] / max(v["optimizer_steps"], 1), 1) for k, v in reports.items()
        },
        "sequence_length": {"min": min(lengths), "mean": round(sum(lengths) / len(lengths), 1), "max": max(lengths)},
        "warmup_steps_excluded": args.warmup_steps,
        "last_k": args.last_k,
        "packing_isolation_max_abs_logit_diff": isolation,
        "held_out_loss_before_training": initial_loss,
        "flops_per_token_lora": flops,
        "peak_tflops": args.peak_tflops if args.device == "cuda" else None,
        "seed": s,
        "ours": o,
        "ratio_ours_over_seed": {
            "tokens_per_second": _ratio(s["tokens_per_second"], o["tokens_per_second"]),
            "peak_memory": _ratio(s["peak_memory_gib"], o["peak_memory_gib"]),
            "wall_time": _ratio(s["wall_seconds_all_steps"], o["wall_seconds_all_steps"]),
            "mfu": _ratio(s.get("mfu"), o.get("mfu")),
        },
        "loss_parity": parity(s, o, args.loss_tolerance, args.last_k, scored_rows),
        "bench_wall_seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_probe:
        run_memory_probe(args)
        return 0
    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(table(result))
    isolation = result["packing_isolation_max_abs_logit_diff"]
    if isolation is not None:
        print(f"packing isolation (max |logit diff|, packed vs alone): {isolation:.2e}")
    print(f"loss parity: {json.dumps(result['loss_parity'])}")
    print(f"wrote {out}")
    return 0 if result["loss_parity"]["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
