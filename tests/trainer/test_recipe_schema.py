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
    recipe = load_recipe("emoji-local", ["training.max_steps=5", "training.packing=true", "output.dir=/tmp/x"])
    assert recipe.training.max_steps == 5
    assert recipe.training.packing is True
    assert recipe.output.dir == "/tmp/x"


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return str(path)


BASE = """
name: bad
model: {name_or_path: local:gemma3-270m}
data: {task: emoji, source: local, path: trainer/data/emoji.jsonl}
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
