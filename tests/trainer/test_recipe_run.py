"""The run a recipe describes: optimizer steps computed from the data, checked before any GPU is rented.

Why it matters: W3 once packed ~19 emoji conversations into each 512-token row and trained 27
updates instead of the seed's 500, with `save_steps: 100` beyond the end of the run: it never
checkpointed. W1 flattened 2 packed rows into one 2,048-token row and asked for a warmup from a
schedule that has none. None of that fails loudly at run time; these tests make it fail at load.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from trainer.recipe import (
    TOKEN_LENGTHS_FILE,
    Recipe,
    RecipeError,
    list_recipes,
    load_recipe,
    pack_best_fit_decreasing,
    sample_token_lengths,
    step_plan,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


class TestSeedOptimisation:
    """Each cloud recipe keeps its seed's optimisation unless the recipe says why not."""

    def test_w3_trains_the_seeds_500_updates_of_2_examples(self) -> None:
        plan = step_plan(load_recipe("emoji-gemma3-1b"))
        # seed: 1,000 rows, batch 1 x accumulation 2, 1 epoch
        assert plan.train_rows == 1000
        assert plan.conversations_per_update == 2
        assert plan.updates_per_epoch == plan.total_updates == 500
        assert load_recipe("emoji-gemma3-1b").training.save_steps <= plan.total_updates

    # the seed's geometry: 1 conversation per micro-batch x 2 accumulation, padded batches
    W3_SEED_GEOMETRY = (
        "training.per_device_train_batch_size=1",
        "training.gradient_accumulation_steps=2",
        "training.padding_free=false",
    )

    def test_w3_is_one_padding_free_micro_batch_of_2_with_the_seeds_optimisation(self, tmp_path: Path) -> None:
        """Why: W3 is launch-bound; 2 x 1 padding-free halves the micro-steps, and may change nothing else:
        the same updates, examples per update and learning-rate schedule as the seed's 1 x 2."""
        import torch
        from transformers import get_scheduler

        from trainer.checkpoints import OutputLocation
        from trainer.train import LossMode, sft_config

        ours = load_recipe("emoji-gemma3-1b", [f"output.dir={tmp_path}"])
        seed = load_recipe("emoji-gemma3-1b", [f"output.dir={tmp_path}", *self.W3_SEED_GEOMETRY])
        t = ours.training
        assert (t.per_device_train_batch_size, t.gradient_accumulation_steps, t.padding_free) == (2, 1, True)
        assert not t.packing  # padding-free alone: one micro-batch = the update's 2 conversations in one row
        plans = {name: step_plan(r) for name, r in (("ours", ours), ("seed", seed))}
        assert plans["ours"].total_updates == plans["seed"].total_updates == 500
        assert plans["ours"].conversations_per_update == plans["seed"].conversations_per_update == 2

        def schedule(recipe: Recipe) -> list[float]:
            total = step_plan(recipe).total_updates
            args = sft_config(recipe, OutputLocation.from_dir(str(tmp_path)), has_eval=False, loss=LossMode.ASSISTANT)
            optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=recipe.training.learning_rate)
            scheduler = get_scheduler(
                args.lr_scheduler_type,
                optimizer,
                num_warmup_steps=args.get_warmup_steps(total),
                num_training_steps=total,
            )
            rates = []
            for _ in range(total):
                rates.append(scheduler.get_last_lr()[0])
                optimizer.step()
                scheduler.step()
            return rates

        assert schedule(ours) == schedule(seed)

    def test_w3_padding_free_2x1_updates_hold_the_seeds_example_pairs(
        self, tiny_gemma3_dir: Path, tmp_path: Path
    ) -> None:
        """The real trainers' data loaders (W3's training geometry on a tiny model and the emoji sample): every
        update of 2 x 1 padding-free holds exactly the 2 conversations of the seed's 1 x 2 update, in one launch."""
        from trainer.checkpoints import OutputLocation
        from trainer.train import build_trainer

        w3 = load_recipe("emoji-gemma3-1b").training
        geometry = [
            f"training.per_device_train_batch_size={w3.per_device_train_batch_size}",
            f"training.gradient_accumulation_steps={w3.gradient_accumulation_steps}",
            f"training.padding_free={str(w3.padding_free).lower()}",
        ]

        def updates(name: str, overrides: list[str] | tuple[str, ...]) -> tuple[list[list[tuple[int, ...]]], int]:
            recipe = load_recipe(
                "emoji-local",
                [
                    f"model.name_or_path={tiny_gemma3_dir}",
                    f"output.dir={tmp_path / name}",
                    "training.max_steps=-1",
                    "training.num_train_epochs=1",
                    "training.save_steps=1",
                    "training.report_to=[]",
                    "data.max_rows=24",
                    "data.eval_rows=0",
                    "output.merge=false",
                    *overrides,
                ],
            )
            trainer, _ = build_trainer(recipe, OutputLocation.from_dir(str(tmp_path / name)))
            accumulation = recipe.training.gradient_accumulation_steps
            *_, max_steps = trainer.set_initial_training_values(trainer.args, trainer.get_train_dataloader())
            grouped: list[list[tuple[int, ...]]] = []
            for i, batch in enumerate(trainer.get_train_dataloader()):
                if i % accumulation == 0:
                    grouped.append([])
                ids = batch["input_ids"]
                if "position_ids" in batch and recipe.training.padding_free:  # one row, positions restart per example
                    starts = [j for j, pos in enumerate(batch["position_ids"][0].tolist()) if pos == 0]
                    row = ids[0].tolist()
                    grouped[-1] += [tuple(row[a:b]) for a, b in zip(starts, [*starts[1:], len(row)], strict=True)]
                else:
                    mask = batch["attention_mask"]
                    grouped[-1] += [tuple(r[m.bool()].tolist()) for r, m in zip(ids, mask, strict=True)]
            return grouped, max_steps

        ours, ours_steps = updates("ours", geometry)
        seed, seed_steps = updates("seed", self.W3_SEED_GEOMETRY)
        assert ours_steps == seed_steps == 12
        assert [len(u) for u in ours] == [2] * 12
        assert [sorted(u) for u in ours] == [sorted(u) for u in seed]

    def test_w2_trains_64_examples_per_update_for_3_epochs(self) -> None:
        recipe = load_recipe("product-descriptions-gemma3-4b")
        plan = step_plan(recipe)
        # seed: 16 workers x batch 1 x accumulation 4; ~1.3k rows -> ~20 updates per epoch, 60 in the log
        assert plan.conversations_per_update == 64
        assert 19 <= plan.updates_per_epoch <= 22 and plan.total_updates == 3 * plan.updates_per_epoch

    def test_w1_micro_batch_is_one_packed_row_with_the_same_tokens_per_update(self) -> None:
        recipe = load_recipe("text-to-sql-gemma4-31b")
        t, plan = recipe.training, step_plan(recipe)
        assert t.packing and t.per_device_train_batch_size == 1
        # before: 2 packed rows x 8 accumulation x 8 GPUs = 128 rows of up to 1,024 tokens per update
        assert plan.sequences_per_update == 2 * 8 * 8
        assert plan.sequences_per_update * t.max_length == 131_072  # token slots per update, unchanged
        assert not t.gradient_checkpointing  # the per-GPU estimate in the recipe fits in 180 GB

    def test_packing_that_cuts_the_updates_needs_a_reason(self) -> None:
        with pytest.raises(RecipeError) as info:
            load_recipe("emoji-gemma3-1b", ["training.packing=true", *self.W3_SEED_GEOMETRY])
        message = str(info.value)
        assert "500 updates per epoch into 27" in message and "training.packing_reason" in message
        assert "training.save_steps=100 exceeds the run's 27 optimizer steps" in message
        # a written reason (and a checkpoint interval inside the shorter run) is accepted
        load_recipe(
            "emoji-gemma3-1b",
            [
                "training.packing=true",
                "training.packing_reason=measured",
                "training.save_steps=20",
                *self.W3_SEED_GEOMETRY,
            ],
        )

    def test_packed_micro_batch_of_several_rows_is_rejected_under_sdpa(self) -> None:
        with pytest.raises(RecipeError, match=r"per_device_train_batch_size=2 with packing flattens 2 packed rows"):
            load_recipe("text-to-sql-gemma4-31b", ["training.per_device_train_batch_size=2"])
        load_recipe(
            "text-to-sql-gemma4-31b",
            [
                "training.per_device_train_batch_size=2",
                "model.attn_implementation=flash_attention_2",
                "model.name_or_path=google/gemma-3-27b-it",  # Gemma 4 cannot use flash-attn 2 (next test)
            ],
        )

    def test_flash_attention_2_is_rejected_for_gemma_4(self) -> None:
        """Why: Gemma 4's 512-wide global heads exceed flash-attn 2's 256; the run would fail after the download."""
        with pytest.raises(RecipeError, match=r"flash_attention_2 with google/gemma-4-31B-it.*head_dim 512"):
            load_recipe("text-to-sql-gemma4-31b", ["model.attn_implementation=flash_attention_2"])
        load_recipe("text-to-sql-gemma4-31b", ["model.attn_implementation=eager"])


class TestCheckpointsInsideTheRun:
    @pytest.mark.parametrize("key", ["save_steps", "eval_steps"])
    def test_interval_beyond_the_run_is_rejected(self, key: str) -> None:
        with pytest.raises(RecipeError, match=rf"training\.{key}=501 exceeds the run's 500 optimizer steps"):
            load_recipe("emoji-gemma3-1b", [f"training.{key}=501"])

    def test_epochs_scale_the_run(self) -> None:
        load_recipe("emoji-gemma3-1b", ["training.num_train_epochs=2", "training.save_steps=1000"])

    def test_a_run_bounded_by_max_steps_is_a_chosen_length(self) -> None:
        """`--set training.max_steps=5` is a smoke run (trainer/README.md), not the run the data describes."""
        recipe = load_recipe("emoji-local", ["training.max_steps=5"])
        assert step_plan(recipe).total_updates == 5 and not step_plan(recipe).from_data

    def test_every_recipe_checkpoints_inside_its_run(self) -> None:
        for name in list_recipes():
            recipe = load_recipe(name)
            assert recipe.training.save_steps <= step_plan(recipe).total_updates, name


class TestWarmup:
    def test_constant_schedule_with_warmup_is_rejected(self) -> None:
        with pytest.raises(RecipeError, match=r"lr_scheduler_type=constant ignores training\.warmup_ratio=0\.03"):
            load_recipe("text-to-sql-gemma4-31b", ["training.lr_scheduler_type=constant"])

    @pytest.mark.parametrize("name", list_recipes())
    def test_the_trainers_schedule_warms_up_when_the_recipe_asks(self, name: str, tmp_path: Path) -> None:
        """Built the way transformers' Trainer builds it: SFTConfig -> get_warmup_steps -> get_scheduler."""
        import torch
        from transformers import get_scheduler

        from trainer.checkpoints import OutputLocation
        from trainer.train import LossMode, sft_config

        recipe = load_recipe(name, [f"output.dir={tmp_path}"])
        total = step_plan(recipe).total_updates
        args = sft_config(recipe, OutputLocation.from_dir(str(tmp_path)), has_eval=False, loss=LossMode.ASSISTANT)
        warmup = args.get_warmup_steps(total)
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=recipe.training.learning_rate)
        scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total)
        rates = []
        for _ in range(total):
            rates.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        peak = recipe.training.learning_rate
        if recipe.training.warmup_ratio > 0:
            assert warmup == math.ceil(total * recipe.training.warmup_ratio) >= 1
            assert rates[0] < peak, f"{name}: no warmup, the first update already runs at {rates[0]}"
            assert rates[warmup] == pytest.approx(peak)
        else:
            assert rates[0] == pytest.approx(peak)


class TestStepArithmetic:
    """The plan counts what trl and transformers will do, not an approximation of it."""

    @pytest.mark.parametrize("task", ["emoji", "text-to-sql", "product-description"])
    @pytest.mark.parametrize("capacity", [512, 1024])
    def test_packing_count_equals_trls_bfd(self, task: str, capacity: int) -> None:
        from datasets import Dataset
        from trl import pack_dataset

        lengths = [n for n in sample_token_lengths()["tasks"][task]["conversation"] if n <= capacity]
        dataset = Dataset.from_dict({"input_ids": [[1] * n for n in lengths]})
        packed = pack_dataset(dataset, capacity, strategy="bfd")
        assert len(packed) == pack_best_fit_decreasing(lengths, capacity)

    def test_plan_equals_the_trainers_count_for_a_packed_run(self, tiny_gemma3_dir: Path, tmp_path: Path) -> None:
        """A real SFTTrainer on the emoji sample: its packed rows, and the optimizer steps it will run."""
        from trainer.checkpoints import OutputLocation
        from trainer.recipe import _updates_per_epoch
        from trainer.train import build_trainer

        recipe = load_recipe(
            "emoji-local",
            [
                f"model.name_or_path={tiny_gemma3_dir}",
                f"output.dir={tmp_path / 'run'}",
                "training.max_steps=-1",
                "training.num_train_epochs=1",
                "training.packing=true",
                "training.packing_reason=test",
                "training.per_device_train_batch_size=1",
                "training.gradient_accumulation_steps=3",
                "training.max_length=128",
                "training.save_steps=1",
                "training.report_to=[]",
                "data.max_rows=120",
                "data.eval_rows=0",
                "output.merge=false",
            ],
        )
        trainer, _ = build_trainer(recipe, OutputLocation.from_dir(str(tmp_path / "run")))
        packed = trainer.train_dataset
        lengths = [n for row in packed["seq_lengths"] for n in row]
        assert len(lengths) == 120 and len(packed) == pack_best_fit_decreasing(lengths, 128)
        *_, max_steps = trainer.set_initial_training_values(trainer.args, trainer.get_train_dataloader())
        assert max_steps == _updates_per_epoch(len(packed), 1, 3, 1)


@pytest.mark.slow
@pytest.mark.gemma3_270m
def test_token_lengths_table_is_what_the_gemma_tokenizer_measures() -> None:
    """trainer/samples/token_lengths.json is regenerated from the bundled samples with the real Gemma 3 tokenizer."""
    import importlib.util

    path = TOKEN_LENGTHS_FILE.parent / "measure_token_lengths.py"
    spec = importlib.util.spec_from_file_location("measure_token_lengths", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert json.loads(module.render(module.measure())) == json.loads(TOKEN_LENGTHS_FILE.read_text())
