"""Multi-GPU / multi-node launcher: render the accelerate config for a recipe, then exec `accelerate launch`.

    python -m trainer.launch --recipe text-to-sql-gemma4-31b --nproc-per-node 8
    python -m trainer.launch --recipe text-to-sql-gemma4-31b --nproc-per-node 8 \
        --nnodes 2 --main-process-ip finetune-0.finetune   # node rank from $JOB_COMPLETION_INDEX
    python -m trainer.launch --recipe text-to-sql-gemma4-31b --nproc-per-node 8 --dry-run
    python -m trainer.launch --recipe emoji-local --nproc-per-node 4 --cpu \
        --set distributed.world_size=4      # CPUs only, over gloo; the recipe sized for 4 ranks

Decisions (docs/distributed.md#one-launcher-per-node): the recipe's strategy (`auto` resolved by the memory model)
renders DDP or FSDP2 (trainer/fsdp.py); one process per node writes the config and `os.execve`s into
`accelerate launch`, so SIGTERM reaches the ranks; the processes must total `distributed.world_size` (else
exit 2); `--cpu` also exports `ACCELERATE_USE_CPU`; torchrun waits `WORKER_SHUTDOWN_S` for a preemption
checkpoint; a finished run launches nothing (exit 0). Everything heavy happens in the launched trainer.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from trainer.recipe import (
    REPO_ROOT,
    Recipe,
    RecipeError,
    load_recipe,
    parse_recipe,
    resolve_strategy,
    world_size_problem,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

NODE_RANK_ENV = "JOB_COMPLETION_INDEX"
MASTER_ADDR_ENV = "MASTER_ADDR"
MASTER_PORT_ENV = "MASTER_PORT"
DEFAULT_PORT = 29500
# torchrun kills its workers this long after passing them a SIGTERM (torch/distributed/launcher/api.py reads
# the variable; 30 s by default): long enough that the pod's terminationGracePeriodSeconds is the bound on
# the checkpoint a SIGTERM saves (trainer/preemption.py)
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
WORKER_SHUTDOWN_S = 3600
_MIXED_PRECISION = {"auto": "bf16", "bfloat16": "bf16", "float16": "fp16", "float32": "no"}


@dataclass(frozen=True)
class LaunchPlan:
    """What this node will run: the accelerate config, where it is written, and the command."""

    config: dict[str, Any]
    config_path: Path
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment

    def render(self) -> str:
        env = "".join(f"{key}={value} " for key, value in sorted(self.env.items()))
        return (
            f"# accelerate config: {self.config_path}\n"
            + yaml.safe_dump(self.config, sort_keys=True)
            + f"# command\n{env}{shlex.join(self.command)}\n"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.launch", description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", required=True, help="recipe name (trainer/recipes/) or path to a .yaml file")
    procs = parser.add_mutually_exclusive_group(required=True)
    procs.add_argument("--nproc-per-node", type=int, help="processes (GPUs) on each node")
    procs.add_argument("--num-processes", type=int, help="processes over ALL nodes (accelerate's num_processes)")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--node-rank", type=int, default=None, help=f"this node's rank (default ${NODE_RANK_ENV} or 0)")
    parser.add_argument("--main-process-ip", default=None, help=f"address of node 0 (default ${MASTER_ADDR_ENV})")
    parser.add_argument("--main-process-port", type=int, default=None, help=f"rendezvous port (default {DEFAULT_PORT})")
    parser.add_argument("--mixed-precision", choices=["no", "fp16", "bf16", "fp8"], default=None)
    parser.add_argument("--cpu", action="store_true", help="run the processes on CPUs (gloo), e.g. tests and laptops")
    parser.add_argument("--config-out", type=Path, default=None, help="where to write the accelerate config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--dry-run", action="store_true", help="print the config and the command; launch nothing")
    return parser.parse_args(argv)


def resolve_node_rank(cli_value: int | None, env: Mapping[str, str]) -> int:
    if cli_value is not None:
        return cli_value
    raw = env.get(NODE_RANK_ENV, "").strip()
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError:
        raise RecipeError(f"${NODE_RANK_ENV}={raw!r} is not an integer node rank") from None


def total_processes(nproc_per_node: int | None, num_processes: int | None, nnodes: int) -> int:
    if nnodes < 1:
        raise RecipeError(f"--nnodes={nnodes} must be at least 1")
    if nproc_per_node is not None:
        if nproc_per_node < 1:
            raise RecipeError(f"--nproc-per-node={nproc_per_node} must be at least 1")
        return nproc_per_node * nnodes
    assert num_processes is not None
    if num_processes < nnodes or num_processes % nnodes:
        raise RecipeError(f"--num-processes={num_processes} must be a positive multiple of --nnodes={nnodes}")
    return num_processes


def model_reference(recipe: Recipe) -> str:
    """Where AutoConfig reads the model config: the local package model, a repo folder, or the Hub id."""
    ref = recipe.model.name_or_path
    if recipe.model.is_local_package:
        from trainer.local_model import resolve_model_path

        return resolve_model_path(ref)
    if not Path(ref).is_absolute() and (REPO_ROOT / ref).exists():
        return str(REPO_ROOT / ref)
    return ref


def load_model_config(recipe: Recipe) -> PretrainedConfig:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_reference(recipe), revision=recipe.model.revision)


def accelerate_command(config_path: Path, recipe_arg: str, overrides: Sequence[str]) -> list[str]:
    """`accelerate launch --config_file … -m trainer --recipe … --set …`.

    The `accelerate` console script of this interpreter's environment is preferred (a venv's
    bin/ need not be on PATH), then the one on PATH, then `python -m accelerate.commands.launch`.
    """
    beside = Path(sys.executable).parent / "accelerate"
    launcher = str(beside) if beside.exists() else shutil.which("accelerate")
    head = [launcher, "launch"] if launcher else [sys.executable, "-m", "accelerate.commands.launch"]
    tail = ["-m", "trainer", "--recipe", recipe_arg]
    for item in overrides:
        tail += ["--set", item]
    return [*head, "--config_file", str(config_path), *tail]


def plan(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> LaunchPlan:
    """Everything up to (not including) the launch; writes the config file."""
    from trainer.fsdp import render_accelerate_config

    env = os.environ if env is None else env
    recipe = load_recipe(args.recipe, args.overrides)
    chosen = resolve_strategy(recipe)  # `auto`: the memory model's pick (trainer/memory_plan.py)
    strategy = "fsdp" if chosen.name == "fsdp" else "none"  # ddp and none: accelerate's MULTI_GPU
    num_processes = total_processes(args.nproc_per_node, args.num_processes, args.nnodes)
    given = (
        f"--nproc-per-node {args.nproc_per_node} x --nnodes {args.nnodes}"
        if args.nproc_per_node is not None
        else f"--num-processes {args.num_processes}"
    )
    problem = world_size_problem(recipe, num_processes, f"this launch ({given})")
    if problem:
        raise RecipeError(problem)
    model_config: PretrainedConfig | dict[str, Any] = load_model_config(recipe) if strategy == "fsdp" else {}
    port = args.main_process_port or int(env.get(MASTER_PORT_ENV) or DEFAULT_PORT)
    config = render_accelerate_config(
        model_config,
        num_processes=num_processes,
        num_machines=args.nnodes,
        machine_rank=resolve_node_rank(args.node_rank, env),
        main_process_ip=args.main_process_ip or env.get(MASTER_ADDR_ENV) or None,
        main_process_port=port,
        mixed_precision=args.mixed_precision or _MIXED_PRECISION[recipe.model.dtype],
        strategy=strategy,
        activation_checkpointing=recipe.distributed.fsdp_activation_checkpointing,
        cpu_offload=recipe.distributed.fsdp_cpu_offload,
        reshard_after_forward=chosen.reshard_after_forward,
        use_cpu=args.cpu,
    )
    config_path = args.config_out or Path(tempfile.mkdtemp(prefix="accelerate-")) / "accelerate_config.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(config, sort_keys=True))
    extra = {"ACCELERATE_USE_CPU": "true"} if args.cpu else {}
    if SHUTDOWN_TIMEOUT_ENV not in env:
        extra[SHUTDOWN_TIMEOUT_ENV] = str(WORKER_SHUTDOWN_S)
    env = extra
    return LaunchPlan(config, config_path, accelerate_command(config_path, args.recipe, args.overrides), env)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from trainer.checkpoints import RUN_MARKER, OutputLocation
    from trainer.fsdp import FsdpConfigError

    try:
        output_dir = parse_recipe(args.recipe, args.overrides).output.dir  # the run checks come in plan()
        if OutputLocation.from_dir(output_dir).finished_run() is not None:
            print(
                f"{output_dir} already holds a finished run ({RUN_MARKER}): nothing to launch; "
                "set output.dir to a new folder to train again",
                flush=True,
            )
            return 0
        launch = plan(args)
    except (RecipeError, FsdpConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(launch.render(), flush=True)
    if args.dry_run:
        return 0
    os.execve(launch.command[0], launch.command, {**os.environ, **launch.env})
    return 0  # pragma: no cover - execve does not return


if __name__ == "__main__":
    raise SystemExit(main())
