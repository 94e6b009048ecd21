"""The real Gemma 3 270M, built from the PyPI package (no Hub): a short LoRA run on the emoji sample."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import transformers

from trainer import local_model
from trainer.evaluate import evaluate
from trainer.export import is_complete
from trainer.local_model import BUILD_MARKER, ensure_local_model
from trainer.recipe import load_recipe
from trainer.train import main

pytestmark = [
    pytest.mark.slow,
    pytest.mark.gemma3_270m,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]


def test_local_model_is_built_once_with_chat_template_and_stop_token(monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = ensure_local_model()
    assert (model_dir / BUILD_MARKER).is_file() and (model_dir / "model.safetensors").is_file()

    def build_again(*args: object, **kwargs: object) -> None:
        raise AssertionError("the second call must reuse the cached folder, not build it again")

    monkeypatch.setattr(local_model, "_build_into", build_again)
    assert ensure_local_model() == model_dir
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert 106 in generation["eos_token_id"]  # <end_of_turn>
    assert "<start_of_turn>" in (model_dir / "chat_template.jinja").read_text()
    # the cache is shared with other users and mounted into the serving image (uid 2000);
    # safetensors saves 0600, so the build makes every file readable
    assert all(p.stat().st_mode & 0o444 == 0o444 for p in model_dir.iterdir() if p.is_file())


def test_a_cache_built_with_private_weights_is_made_readable(tmp_path: Path) -> None:
    """Caches built before exports were made readable still hold 0600 weights; the next call fixes them."""
    target = tmp_path / "gemma3-270m"
    target.mkdir()
    (target / BUILD_MARKER).write_text("{}")
    weights = target / "model.safetensors"
    weights.write_bytes(b"w")
    weights.chmod(0o600)
    assert ensure_local_model(tmp_path) == target
    assert weights.stat().st_mode & 0o777 == 0o644


def test_short_lora_run_on_gemma3_270m(tmp_path: Path) -> None:
    ensure_local_model()  # the entry points build it; the trainer only finds it (trainer/model_files.py)
    recipe = load_recipe(
        "emoji-local",
        [
            f"output.dir={tmp_path / 'run'}",
            "training.max_steps=2",
            "training.per_device_train_batch_size=1",
            "training.save_steps=2",
            "training.logging_steps=1",
            "training.report_to=[]",
            "data.max_rows=16",
            "data.eval_rows=1",
            "output.merge=true",
        ],
    )
    result = main(recipe)
    summary = result.summary
    print(f"270M: {summary['train_runtime_s'] / summary['steps']:.2f} s/step, {summary['tokens_per_second']} tok/s")
    assert summary["steps"] == 2 and summary["model"] == "local:gemma3-270m"
    assert math.isfinite(summary["final_train_loss"]) and math.isfinite(summary["eval_loss"])
    assert result.merged_dir is not None and is_complete(result.merged_dir)

    # demo/pipeline.py scores the export with the run's tokenizer still in memory: what the folder's own copy gives
    assert result.processing_class is not None

    def load_again(*args: object, **kwargs: object) -> None:
        raise AssertionError("the tokenizer in memory must be used, not loaded again")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.AutoTokenizer, "from_pretrained", load_again)
        in_memory = evaluate(
            result.merged_dir, recipe, 1, tmp_path / "a.json", processing_class=result.processing_class
        )
    from_files = evaluate(result.merged_dir, recipe, 1, tmp_path / "b.json")
    assert in_memory["samples"] == 1
    for key in ("predictions", "held_out_loss", "emoji_f1"):
        assert in_memory[key] == from_files[key], key
