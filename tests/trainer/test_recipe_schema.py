"""Every recipe YAML loads and validates; bad recipes fail with a message that names the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.recipe import RecipeError, Task, list_recipes, load_recipe

EXPECTED = {"emoji-gemma3-1b", "emoji-local", "product-descriptions-gemma3-4b", "text-to-sql-gemma4-31b"}


def test_the_four_recipes_exist() -> None:
    assert set(list_recipes()) >= EXPECTED


@pytest.mark.parametrize("name", list_recipes())
def test_recipe_loads_and_names_itself(name: str) -> None:
    recipe = load_recipe(name)
    assert recipe.name == name
    assert recipe.data.task in set(Task)


def test_only_the_local_recipe_runs_without_a_token() -> None:
    assert load_recipe("emoji-local").hf_token_reason() is None
    reason = load_recipe("emoji-gemma3-1b").hf_token_reason()
    assert reason is not None and "google/gemma-3-1b-it" in reason


def test_override_is_typed() -> None:
    recipe = load_recipe(
        "emoji-local",
        [
            "training.max_steps=5",
            "training.packing=true",
            "training.packing_reason=short smoke run",
            "training.per_device_train_batch_size=1",
            "output.dir=/tmp/x",
        ],
    )
    assert recipe.training.max_steps == 5
    assert recipe.training.packing is True
    assert recipe.output.dir == "/tmp/x"


def test_hub_dataset_declares_its_rows(tmp_path: Path) -> None:
    """Optimizer steps are computed from the data; a Hub split cannot be counted offline."""
    hub = BASE.replace("source: local, path: trainer/samples/emoji.jsonl", "source: hub, path: org/set")
    with pytest.raises(RecipeError, match=r"data\.rows is required for the Hub dataset 'org/set'"):
        load_recipe(_write(tmp_path, hub))
    assert load_recipe(_write(tmp_path, hub.replace("path: org/set", "path: org/set, rows: 900"))).data.rows == 900


def test_vision_tower_lora_needs_a_vision_model(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"lora\.vision_tower is true but model\.text_only is true"):
        load_recipe(_write(tmp_path, BASE + "lora: {vision_tower: true}\n"))


class TestSeedFidelity:
    """Where a recipe departs from its seed it says why; where it says nothing, it is the seed."""

    def test_w3_quantisation_and_weight_decay_are_the_seeds(self, tmp_path: Path) -> None:
        from trainer.checkpoints import OutputLocation
        from trainer.modeling import quantization_config
        from trainer.train import LossMode, sft_config

        recipe = load_recipe("emoji-gemma3-1b", [f"output.dir={tmp_path}"])
        bnb = quantization_config(recipe.quantization)
        assert bnb is not None and bnb.bnb_4bit_quant_type == "nf4"
        assert bnb.bnb_4bit_use_double_quant is False  # seed: bnb_4bit_use_double_quant=False
        args = sft_config(recipe, OutputLocation.from_dir(str(tmp_path)), has_eval=False, loss=LossMode.ASSISTANT)
        assert args.weight_decay == 0.001  # seed: weight_decay=0.001
        assert (args.lr_scheduler_type, args.learning_rate, args.max_grad_norm) == ("cosine", 2e-4, 0.3)
        assert recipe.lora.r == 8 and recipe.lora.alpha == 16 and recipe.lora.dropout == 0.1
        assert recipe.lora.target_modules == ["q_proj", "v_proj"]

    def test_w2_lora_covers_the_vision_tower_as_the_seeds_all_linear(self) -> None:
        recipe = load_recipe("product-descriptions-gemma3-4b")
        assert recipe.lora.target_modules == "all-linear" and recipe.lora.vision_tower
        assert recipe.lora.modules_to_save == []  # vLLM loads no adapter with saved modules (docs/performance.md)


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return str(path)


BASE = """
name: bad
model: {name_or_path: local:gemma3-270m}
data: {task: emoji, source: local, path: trainer/samples/emoji.jsonl}
output: {dir: out}
"""


def test_unknown_key_is_named(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(_write(tmp_path, BASE + "training: {learning_rat: 0.1}\n"))
    assert "training.learning_rat" in str(info.value)
    assert "unknown key" in str(info.value)


def test_bad_value_is_named(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(_write(tmp_path, BASE + "lora: {r: 0}\n"))
    assert "lora.r" in str(info.value)


def test_bad_enum_value_is_named(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"data\.task"):
        load_recipe(_write(tmp_path, BASE.replace("task: emoji", "task: poetry")))


def test_bad_override_key_is_named() -> None:
    with pytest.raises(RecipeError, match=r"training\.max_stepz"):
        load_recipe("emoji-local", ["training.max_stepz=5"])


def test_bad_override_value_is_named() -> None:
    with pytest.raises(RecipeError, match=r"training\.max_steps"):
        load_recipe("emoji-local", ["training.max_steps=many"])


def test_malformed_override_is_rejected() -> None:
    with pytest.raises(RecipeError, match=r"section\.key=value"):
        load_recipe("emoji-local", ["training.max_steps"])


def test_unknown_recipe_lists_the_known_ones() -> None:
    with pytest.raises(RecipeError, match="emoji-local"):
        load_recipe("no-such-recipe")
