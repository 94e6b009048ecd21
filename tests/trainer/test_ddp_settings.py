"""DDP over LoRA neither searches for unused parameters nor broadcasts buffers (trainer/train.py `sft_config`).

Why: transformers 5.23 sets `find_unused_parameters=True` for any model that is not a `PreTrainedModel`
(`Trainer._build_accelerator_args`; a PeftModel is not one), which walks the autograd graph after every forward,
and DDP broadcasts every buffer from rank 0 before each forward by default. Every LoRA adapter gets a gradient in
every micro-step and no buffer of a Gemma changes in training, so both are pure cost. The settings reach
accelerate's DDP handler here; a real DDP wrapper is checked against them once accelerate has wrapped the model
(`ddp_check`, on_train_begin); the 3-rank run of tests/trainer/test_multirank_resume.py records them in
run_summary.json.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainer.train import ddp_check, ddp_settings

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def test_the_w1_trainer_hands_accelerate_both_settings_off(tiny_gemma4_dir: Path, tmp_path: Path) -> None:
    from trainer.checkpoints import OutputLocation
    from trainer.recipe import load_recipe
    from trainer.train import build_trainer

    def handler(*extra: str) -> dict[str, bool]:
        recipe = load_recipe(
            "text-to-sql-gemma4-31b",
            [
                f"model.name_or_path={tiny_gemma4_dir}", "data.source=local",
                "data.path=trainer/samples/text_to_sql.jsonl", "data.max_rows=12", "data.eval_rows=0", "training.max_steps=1",
                "distributed.world_size=1", "distributed.strategy=none", "training.report_to=[]",
                f"output.dir={tmp_path / str(len(extra))}", *extra,
            ],
        )  # fmt: skip
        trainer, _ = build_trainer(recipe, OutputLocation.from_dir(recipe.output.dir))
        ddp = trainer.accelerator.ddp_handler  # what accelerate passes to DistributedDataParallel in prepare()
        return {"find_unused_parameters": ddp.find_unused_parameters, "broadcast_buffers": ddp.broadcast_buffers}

    assert handler() == {"find_unused_parameters": False, "broadcast_buffers": False}
    # a recipe can still ask for the search (training.extra goes verbatim to SFTConfig)
    assert handler("training.extra.ddp_find_unused_parameters=true")["find_unused_parameters"] is True


@pytest.fixture
def one_rank_gloo(tmp_path: Path):  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_wrapper_that_searches_for_unused_parameters_stops_the_run(one_rank_gloo: None) -> None:
    """The check reads the DDP object itself, so a layer between the settings and the wrapper cannot hide a change."""
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Linear(4, 4)
    ours = DistributedDataParallel(model, find_unused_parameters=False, broadcast_buffers=False)
    stock = DistributedDataParallel(torch.nn.Linear(4, 4))  # torch's defaults: broadcast, no search
    searching = DistributedDataParallel(torch.nn.Linear(4, 4), find_unused_parameters=True, broadcast_buffers=False)
    args = SimpleNamespace(ddp_find_unused_parameters=False, ddp_broadcast_buffers=False)

    assert ddp_settings(ours) == {"find_unused_parameters": False, "broadcast_buffers": False}
    assert ddp_settings(model) is None  # not wrapped: one process
    ddp_check(SimpleNamespace(model_wrapped=ours)).on_train_begin(args, None, None)
    for wrong in (stock, searching):
        with pytest.raises(RuntimeError, match="the DDP wrapper holds"):
            ddp_check(SimpleNamespace(model_wrapped=wrong)).on_train_begin(args, None, None)
