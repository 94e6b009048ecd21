"""A W1 micro-step reads the device once (trainer/step_syncs.py, trainer/lm_head.py), and its logged numbers are trl's.

Why: every host read of a device value waits for the GPU's queue to drain; transformers 5.23 and trl 1.16 made
about a dozen per micro-step for logging alone. The count is torch.profiler's on a CPU (bench/step_ops.py): the
operations that would wait for a GPU (`.item()`, `bool()`, `nonzero`, `masked_select`), each with the line that
caused it, through the trainer's own `build_trainer` on Gemma 4 31B's decoder pattern at a small width. trl's
SFTTrainer as it ships (its compact head branch as on a Triton device) is the comparison: the same counter finds
its reads, so it can fail.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import step_ops

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def w1_stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 4 31B's first 6 decoder layers (5 sliding, 1 global, keys as values) at 1/64 width."""
    return step_ops.save_w1_block_model(tmp_path_factory.mktemp("w1-stack"), layers=6)


def test_a_w1_micro_step_reads_the_device_once_where_trl_reads_it_a_dozen_times(w1_stack: Path, tmp_path: Path) -> None:
    ours = step_ops.count_micro_step(w1_stack, tmp_path, skip=1, updates=1)
    stock = step_ops.count_micro_step(w1_stack, tmp_path, stock=True, skip=1, updates=1)

    counted = {site: n for site, n in ours.sync_sites.items() if not site.startswith("(CPU only)")}
    assert ours.syncs == 1 and list(counted) == [next(s for s in counted if "trainer/lm_head.py" in s)], counted
    assert stock.syncs >= 12, stock.sync_sites
    stock_sites = " | ".join(stock.sync_sites)
    for where in (
        "transformers/trainer.py",  # the token count's .item() and the NaN filter's bool()
        "trl/trainer/sft_trainer.py",  # entropy, accuracy and token metrics
        "transformers/masking_utils.py",  # packed-sequence detection's .all()
        "trl/trainer/utils.py",  # the compact head's boolean indexing
    ):
        assert where in stock_sites, (where, stock.sync_sites)
    # the same work otherwise: the kernels of the step differ by the reads' own few operations
    assert abs(ours.kernels - stock.kernels) < 0.1 * stock.kernels, (ours.kernels, stock.kernels)


def _train(recipe_for: Any, out: Path, stock: bool) -> Any:
    from transformers import set_seed

    from trainer.checkpoints import OutputLocation
    from trainer.train import build_trainer

    recipe = recipe_for(out)
    set_seed(0)
    if stock:
        with step_ops._stock_trl():
            trainer, _ = build_trainer(recipe, OutputLocation.from_dir(recipe.output.dir))
    else:
        trainer, _ = build_trainer(recipe, OutputLocation.from_dir(recipe.output.dir))
    set_seed(0)
    trainer.train()
    return trainer


def test_the_logged_metrics_and_token_counts_are_trls(tiny_gemma4_dir: Path, tmp_path: Path) -> None:
    """Read once per update instead of per micro-step: the same entropy, token accuracy, token counts and losses, in the
    log and in the checkpoint's trainer_state.json (a resumed run starts its count from it)."""
    from trainer.recipe import load_recipe

    def recipe_for(out: Path) -> Any:
        return load_recipe(
            step_ops.W1,
            [
                f"model.name_or_path={tiny_gemma4_dir}", "model.dtype=float32", "data.source=local",
                f"data.path={step_ops.SAMPLE}", "data.max_rows=24", "data.eval_rows=0", "training.max_steps=3",
                "training.gradient_accumulation_steps=2", "training.logging_steps=1", "training.save_steps=2",
                "training.report_to=[]", "distributed.world_size=1", "distributed.strategy=none", "lora.dropout=0",
                "evaluation.enabled=false", "output.merge=false", f"output.dir={out}",
            ],
        )  # fmt: skip

    stock = _train(recipe_for, tmp_path / "stock", stock=True)
    ours = _train(recipe_for, tmp_path / "ours", stock=False)
    keys = ("loss", "entropy", "mean_token_accuracy", "num_tokens", "num_input_tokens_seen")
    got = [{k: e.get(k) for k in keys} for e in ours.state.log_history if "loss" in e]
    want = [{k: e.get(k) for k in keys} for e in stock.state.log_history if "loss" in e]
    assert len(got) == len(want) == 3 and got[0]["num_input_tokens_seen"] > 0
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-5, abs=1e-6)
    assert ours.state.num_input_tokens_seen == stock.state.num_input_tokens_seen
    saved = [
        json.loads((Path(t.args.output_dir) / "checkpoint-2" / "trainer_state.json").read_text()) for t in (ours, stock)
    ]
    assert saved[0]["num_input_tokens_seen"] == saved[1]["num_input_tokens_seen"] > 0
