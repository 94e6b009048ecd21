"""What each stack's docs name as its data-parallel strategy is what the stack prints ("memory per GPU").

The strategy is the memory model's pick for the stack's recipe (trainer/memory_plan.py, `infra.config
.stack_memory_verdict`): DDP over LoRA for a4-gemma4 today, where the seed ran FSDP2. Every place that
describes a stack's strategy is listed here with the recipe it describes; the first strategy it names must
be the one the model picks for that recipe on that stack.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from infra.catalog import TRAINING_GPU
from infra.config import StackConfig, stack_memory_verdict
from infra.offline.engine import REPO_ROOT, run_stack
from trainer.recipe import memory_verdict, parse_recipe

NAMES = {"ddp": "DDP", "fsdp": "FSDP", "fsdp-gathered": "FSDP", "none": "replica"}
STRATEGY = re.compile(r"\b(DDP|FSDP2?|replica)\b")
TEMPLATE = "trainer/recipes/templates/my-data-a4-gemma4.yaml"
# (file, a text that starts the passage, stack, recipe it describes: None for the stack's own)
MENTIONS = (
    ("Pulumi.a4-gemma4.yaml", "# Stack `a4-gemma4`", "a4-gemma4", None),
    ("Pulumi.yaml", "description: Fine-tune", "a4-gemma4", None),
    ("Pulumi.yaml", "gke-job (GKE Autopilot Job", "a4-gemma4", None),
    ("infra/gke_job.py", '"""The a4-gemma4 workload', "a4-gemma4", None),
    ("docs/seeds.md", "| `a4-gemma4` |", "a4-gemma4", None),
    ("README.md", "| `a4-gemma4` |", "a4-gemma4", None),
    ("demo/pipeline.py", "make plan STACK=a4-gemma4", "a4-gemma4", None),
    ("docs/own-data.md", "| `a4-gemma4` (GKE A4", "a4-gemma4", TEMPLATE),
)


def printed_strategy(stack: str, recipe: str | None) -> str:
    """The strategy the stack prints for its recipe, or for `recipe` (a template) on the stack's GPUs."""
    run = run_stack(stack)
    cfg: StackConfig | None = run.cfg
    assert cfg is not None
    if recipe is None:
        verdict = stack_memory_verdict(cfg)
    else:
        gpu = TRAINING_GPU[cfg.gpu_type or ""]
        verdict = memory_verdict(parse_recipe(str(REPO_ROOT / recipe)), gpu, cfg.total_gpus, replicated=False)
    assert verdict is not None
    return verdict.strategy


def named_strategy(file: str, start: str) -> str:
    text = Path(REPO_ROOT / file).read_text()
    assert start in text, f"{file} no longer has {start!r}: update MENTIONS"
    passage = text[text.index(start) :][:400]
    found = STRATEGY.search(passage)
    assert found, f"{file}: {start!r} names no strategy"
    return found.group(1)


@pytest.mark.parametrize(("file", "start", "stack", "recipe"), MENTIONS)
def test_the_docs_name_the_strategy_the_stack_prints(file: str, start: str, stack: str, recipe: str | None) -> None:
    strategy = printed_strategy(stack, recipe)
    assert named_strategy(file, start).rstrip("2") == NAMES[strategy], f"{file}: the stack prints {strategy}"


def test_the_check_can_fail() -> None:
    assert named_strategy("docs/seeds.md", "the seed ran") == "FSDP2", "a passage about the seed names FSDP2"
    assert NAMES[printed_strategy("a4-gemma4", None)] != "FSDP"


def test_the_demo_creates_the_stack_it_selects() -> None:
    text = (REPO_ROOT / "demo" / "pipeline.py").read_text()
    assert "pulumi stack select --create dev" in text and "pulumi stack select dev " not in text
