"""W1's time-to-model, phase by phase: `pulumi up` on a reserved A4 to the adapter in the bucket, from cited figures.

    .venv/bin/python bench/time_to_model.py                       # first `pulumi up` and a later run, as a table
    make time-to-model                                            # the same into bench/time_to_model.json

A model, not a measurement. Each phase has an optimistic, central and pessimistic duration and where it comes from
(a cited figure, this repository's code, or an assumption marked as one); phases Pulumi creates side by side
(the cluster and the trainer image) count once, as the longer. Training and evaluation come from
bench/mfu_estimate.py's step times (with the host's launches, bench/step_ops.json) over the tokens the recipe
trains on; compiling the layers (`training.compile: regional`) adds its compile time. A real run's trainer
phases are in its run_summary.json (`phases_s`), the numbers to set against these (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import mfu_estimate  # noqa: E402
from trainer.recipe import load_recipe, sample_token_lengths, step_plan  # noqa: E402

W1 = "text-to-sql-gemma4-31b"
CASES = mfu_estimate.CASES
WEIGHTS_GB = 62.0  # Gemma 4 31B in bf16 (trainer/memory_plan.py: 30.7B parameters x 2 bytes)


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: tuple[float, float, float]  # optimistic, central, pessimistic
    source: str
    group: str = ""  # phases of one group run side by side: the group takes its longest
    first_up_only: bool = False  # only the first `pulumi up` of a project pays it


def _gb_at(rates_gb_s: tuple[float, float, float], gb: float = WEIGHTS_GB) -> tuple[float, float, float]:
    return (gb / rates_gb_s[0], gb / rates_gb_s[1], gb / rates_gb_s[2])


def platform_phases() -> list[Phase]:
    """Before and around the trainer: Pulumi's resources, the node, the image, the weights."""
    return [
        Phase(
            "foundation (APIs, accounts, IAM, bucket, registry)",
            (120, 240, 480),
            "IAM grants take typically 2 minutes to apply, sometimes 7 or more (Cloud IAM docs, access change "
            "propagation); the workloads wait for them",
            first_up_only=True,
        ),
        Phase(
            "GKE Autopilot cluster",
            (300, 360, 900),
            "'Creating the cluster took 6 minutes' (ahmet.im/blog/gke-autopilot, 2021); pessimistic: assumption",
            group="cluster and image",
            first_up_only=True,
        ),
        Phase(
            "trainer image (Cloud Build)",
            (480, 720, 1200),
            "assumption, unconfirmed: a CUDA runtime base, torch's CUDA wheel and the trainer's pins; a later "
            "`pulumi up` with the same image content builds nothing",
            group="cluster and image",
            first_up_only=True,
        ),
        Phase(
            "A4 node from the reservation",
            (180, 420, 900),
            "assumption, unconfirmed: Autopilot creates the node when the Job's pod asks for 8 B200",
        ),
        Phase(
            "image pull",
            (30, 90, 240),
            "Autopilot streams eligible Artifact Registry images (GKE docs, Image streaming), but 'during the first "
            "pull of an eligible image you might not notice' it; ~8 GB at 100-250 MB/s: assumption",
        ),
        Phase(
            "weights from the Hub (first run)",
            (180, 300, 600),
            "the seed's 'model download ~5 min' (docs/seeds.md, W1)",
            first_up_only=True,
        ),
        Phase(
            "weights to or from the bucket",
            _gb_at((1.5, 0.8, 0.3)),
            "62 GB, 8 files at a time (trainer/checkpoints.py TRANSFER_WORKERS); per-stream GCS rates: assumption",
        ),
        Phase(
            "weights into 8 GPUs",
            (30, 60, 180),
            "safetensors from the node's disk straight to each rank's GPU (trainer/modeling.py direct_device); "
            "assumption",
        ),
    ]


def trainer_phases(configuration: str, mfu: dict[str, Any], recipe_name: str = W1) -> list[Phase]:
    """Compile, training, evaluation and saving for one configuration of bench/step_ops.json."""
    recipe = load_recipe(recipe_name)
    plan = step_plan(recipe)
    t, d = recipe.training, recipe.distributed
    lengths = sample_token_lengths()["tasks"][recipe.data.task.value]["conversation"]
    mean_len = statistics.fmean(n for n in lengths if n <= t.max_length)
    tokens = plan.train_rows * t.num_train_epochs * mean_len
    per_step = mfu["real_tokens_per_micro_step"]
    host = mfu["with_the_host"][configuration]
    train = tuple(tokens / (d.world_size * per_step / (host[c]["step_ms"] / 1e3)) for c in CASES)
    # evaluation during training: a forward over the held-out rows every eval_steps, about a third of a step's work
    evaluations = plan.total_updates // t.eval_steps if t.eval_steps else 0
    eval_tokens = evaluations * recipe.data.eval_rows * mean_len
    in_training_eval = tuple(eval_tokens / (d.world_size * per_step / (host[c]["step_ms"] / 3e3)) for c in CASES)
    compiled = bool(host.get("compiled")) or configuration == "compiled layers"
    phases = []
    if compiled:
        phases.append(
            Phase(
                "compiling the decoder layers",
                (60, 150, 300),
                "assumption, unconfirmed: inductor compiles 3 graphs (first layer, sliding, global), forward and "
                "backward, in each rank; the GPU check times it",
            )
        )
    phases += [
        Phase(
            "training",
            train,  # type: ignore[arg-type]
            f"{tokens / 1e6:.2f}M tokens ({plan.train_rows:,} rows x {t.num_train_epochs:g} epochs x {mean_len:.0f}) "
            f"at bench/mfu_estimate.py's step time ({configuration})",
        ),
        Phase(
            "evaluation during training",
            in_training_eval,  # type: ignore[arg-type]
            f"{evaluations} passes over {recipe.data.eval_rows:,} held-out rows (eval_steps {t.eval_steps}), a "
            "forward each: a third of a step's work per token",
        ),
        Phase(
            "final evaluation",
            (30, 60, 120),
            f"the held-out loss and {recipe.evaluation.generate_rows} answers, base and tuned, up to "
            f"{recipe.evaluation.max_new_tokens} new tokens (trainer/run_eval.py): decoding at 20-60 ms a token, "
            "assumption",
        ),
        Phase("adapter saved and uploaded", (5, 10, 30), "a ~0.5 GB adapter (LoRA r16 on 7 projections)"),
    ]
    return phases


def total(phases: list[Phase], first_up: bool) -> tuple[float, float, float]:
    sums = [0.0, 0.0, 0.0]
    groups: dict[str, list[Phase]] = {}
    for phase in phases:
        if phase.first_up_only and not first_up:
            continue
        if phase.group:
            groups.setdefault(phase.group, []).append(phase)
            continue
        sums = [s + v for s, v in zip(sums, phase.seconds, strict=True)]
    for members in groups.values():
        sums = [s + max(p.seconds[i] for p in members) for i, s in enumerate(sums)]
    return (sums[0], sums[1], sums[2])


def model(args: argparse.Namespace) -> dict[str, Any]:
    mfu = mfu_estimate.estimate(W1, argparse.Namespace(step_ops=args.step_ops))
    result: dict[str, Any] = {"recipe": W1, "stack": "a4-gemma4", "configurations": {}}
    for configuration in mfu["with_the_host"]:
        phases = [*platform_phases(), *trainer_phases(configuration, mfu)]
        result["configurations"][configuration] = {
            "phases": [asdict(p) for p in phases],
            "first_up_minutes": [round(s / 60, 1) for s in total(phases, first_up=True)],
            "later_run_minutes": [round(s / 60, 1) for s in total(phases, first_up=False)],
        }
    return result


def table(result: dict[str, Any]) -> str:
    lines = []
    for configuration, run in result["configurations"].items():
        first, later = run["first_up_minutes"], run["later_run_minutes"]
        lines.append(
            f"{configuration}: first `pulumi up` {first[1]:.0f} min ({first[0]:.0f}-{first[2]:.0f}), a later run "
            f"{later[1]:.0f} min ({later[0]:.0f}-{later[2]:.0f})"
        )
        for phase in run["phases"]:
            seconds = phase["seconds"]
            mark = " (first up)" if phase["first_up_only"] else ""
            group = f" [{phase['group']}]" if phase["group"] else ""
            lines.append(
                f"  {phase['name'] + mark + group:62}{seconds[1] / 60:6.1f} min  "
                f"({seconds[0] / 60:.1f}-{seconds[2] / 60:.1f})"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ops", type=Path, default=mfu_estimate.STEP_OPS)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = model(args)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
