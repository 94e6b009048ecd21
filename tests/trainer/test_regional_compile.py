"""`training.compile: regional` (trainer/regional_compile.py): W1's decoder layers compiled in place, no graph break.

Why: compiled, a layer's ~385 eager kernels per micro-step fuse into a few dozen (bench/step_ops.py, RESULTS.md);
that only holds if Dynamo captures each whole layer (a graph break splits it and runs the rest eagerly) and
compiles one graph per kind of layer (a recompilation per layer would hit Dynamo's limit of 8 and fall back to
eager). The backend here is `aot_eager` (Dynamo's capture and AOTAutograd's joint graph, without inductor's code
generation, which takes minutes on a CPU): the capture, the graph count and the numbers are what it proves;
bench/step_ops.py --compile measures inductor's kernels.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bench import step_ops
from trainer import regional_compile

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def w1_stack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return step_ops.save_w1_block_model(tmp_path_factory.mktemp("w1-stack"), layers=6)


def _run(model_dir: Path, out: Path, compile_layers: bool) -> tuple[Any, list[float]]:
    from transformers import set_seed

    from trainer.checkpoints import OutputLocation
    from trainer.recipe import load_recipe
    from trainer.train import build_trainer

    overrides = step_ops.w1_overrides(model_dir, out, 2, ("training.logging_steps=1", "lora.dropout=0"))
    overrides.append(f"training.compile={'regional' if compile_layers else 'none'}")
    recipe = load_recipe(step_ops.W1, overrides)
    set_seed(0)
    trainer, _ = build_trainer(recipe, OutputLocation.from_dir(recipe.output.dir))
    layers = regional_compile.decoder_layers(trainer.model)
    assert len(layers) == 6 and {type(layer).__name__ for layer in layers} == {"Gemma4TextDecoderLayer"}
    assert all((layer._compiled_call_impl is not None) is compile_layers for layer in layers)
    towers = [m for name, m in trainer.model.named_modules() if "vision_tower" in name]
    assert towers and all(getattr(m, "_compiled_call_impl", None) is None for m in towers)
    set_seed(0)
    trainer.train()
    assert all(layer._compiled_call_impl is None for layer in layers), "layers must run eagerly after training"
    return trainer, [e["loss"] for e in trainer.state.log_history if "loss" in e]


def test_w1_layers_compile_whole_once_per_kind_and_train_the_same(
    w1_stack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._dynamo.utils import counters

    monkeypatch.setattr(regional_compile, "BACKEND", "eager")
    torch._dynamo.reset()
    counters.clear()
    compiled, compiled_losses = _run(w1_stack, tmp_path / "compiled", compile_layers=True)
    breaks, graphs = dict(counters["graph_break"]), counters["stats"]["unique_graphs"]
    _, eager_losses = _run(w1_stack, tmp_path / "eager", compile_layers=False)

    assert not breaks, breaks
    # sliding and global layers, the first layer's input without a gradient: 3 graphs for 6 layers, 4 micro-steps
    # of 4 row lengths (dynamic shapes, no static graph first)
    assert 2 <= graphs <= 3, graphs
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-4)
    keys = compiled.model.state_dict().keys()
    assert not any("_orig_mod" in key for key in keys)  # checkpoints and adapters keep their names


class TestAutoCompile:
    """`training.compile: auto` (the default): compiled where the host limits a step, eager elsewhere; so no shipped
    recipe names it, and changing the choice in a release trains no finished run again (infra/run_identity.py)."""

    @staticmethod
    def _mode(overrides: list[str], cuda: bool, fsdp: bool, monkeypatch: pytest.MonkeyPatch) -> str:
        import torch

        from trainer.recipe import load_recipe
        from trainer.train import compile_mode

        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        recipe = load_recipe("text-to-sql-gemma4-31b", overrides)
        return str(compile_mode(recipe, SimpleNamespace(is_fsdp_enabled=fsdp)))

    def test_w1_on_cuda_compiles_and_its_recipe_does_not_say_so(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from trainer.recipe import load_recipe, recipe_path

        assert load_recipe("text-to-sql-gemma4-31b").training.compile == "auto"
        assert "compile:" not in recipe_path("text-to-sql-gemma4-31b").read_text()
        assert self._mode([], cuda=True, fsdp=False, monkeypatch=monkeypatch) == "regional"

    @pytest.mark.parametrize(
        ("overrides", "cuda", "fsdp"),
        [([], False, False), ([], True, True), (["quantization.load_in_4bit=true"], True, False)],
        ids=["cpu", "fsdp2", "4-bit"],
    )
    def test_elsewhere_it_runs_eagerly(
        self, overrides: list[str], cuda: bool, fsdp: bool, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        assert self._mode(overrides, cuda, fsdp, monkeypatch) == "none"

    def test_a_recipe_that_says_so_gets_what_it_says(self, monkeypatch: pytest.MonkeyPatch) -> None:
        assert self._mode(["training.compile=none"], cuda=True, fsdp=False, monkeypatch=monkeypatch) == "none"
        assert self._mode(["training.compile=regional"], cuda=False, fsdp=False, monkeypatch=monkeypatch) == "regional"
