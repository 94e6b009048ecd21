"""`trainer.train.save_adapter` writes the adapter the trainer trained, with or without FSDP."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from tests import tiny_models as tiny
from trainer.train import save_adapter


def _peft_model() -> torch.nn.Module:
    model = tiny.tiny_gemma3(tiny.tiny_tokenizer(), seed=3)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # make B non-zero so "the adapter was saved" is not "zeros were saved"
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.uniform_(-0.1, 0.1)
    return peft_model


def _fsdp_trainer(model: torch.nn.Module, process_zero: bool) -> SimpleNamespace:
    return SimpleNamespace(
        is_fsdp_enabled=True,
        model=model,
        processing_class=tiny.tiny_tokenizer(),
        is_world_process_zero=lambda: process_zero,
    )


def test_fsdp_trainer_saves_every_adapter_tensor_in_full(tmp_path: Path) -> None:
    model = _peft_model()
    save_adapter(_fsdp_trainer(model, process_zero=True), tmp_path / "fsdp")  # type: ignore[arg-type]
    model.save_pretrained(tmp_path / "reference")
    saved = load_file(tmp_path / "fsdp" / "adapter_model.safetensors")
    reference = load_file(tmp_path / "reference" / "adapter_model.safetensors")
    assert saved.keys() == reference.keys() and len(saved) > 0
    for key, tensor in reference.items():
        assert torch.equal(saved[key], tensor), key
    # the tokenizer goes with the adapter (Trainer.save_model does it on the unsharded path)
    assert (tmp_path / "fsdp" / "tokenizer.json").is_file() and (tmp_path / "fsdp" / "tokenizer_config.json").is_file()


def test_only_the_main_process_writes_the_fsdp_adapters_tokenizer(tmp_path: Path) -> None:
    save_adapter(_fsdp_trainer(_peft_model(), process_zero=False), tmp_path / "fsdp")  # type: ignore[arg-type]
    assert not (tmp_path / "fsdp" / "tokenizer.json").exists()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_trained_adapter_lands_on_disk_as_trained(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """A real (unsharded) SFTTrainer after two steps: the saved adapter is the trained one, tensor by tensor."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from trainer.checkpoints import OutputLocation
    from trainer.recipe import load_recipe
    from trainer.train import build_trainer

    recipe = load_recipe(
        "emoji-local",
        [
            f"model.name_or_path={tiny_gemma3_dir}",
            f"output.dir={tmp_path / 'run'}",
            "training.max_steps=2",
            "training.learning_rate=0.01",
            "training.report_to=[]",
            "data.max_rows=24",
            "data.eval_rows=0",
        ],
    )
    trainer, _ = build_trainer(recipe, OutputLocation.from_dir(recipe.output.dir))
    trainer.train()
    trained = {k: v.detach().clone() for k, v in get_peft_model_state_dict(trainer.model).items()}
    assert trained and any("lora_B" in k and v.abs().sum() > 0 for k, v in trained.items()), "nothing trained"

    save_adapter(trainer, tmp_path / "adapter")

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved.keys() == trained.keys()
    for key, tensor in trained.items():
        assert torch.equal(saved[key], tensor), key
    # and it is a usable adapter: base + saved adapter computes what the trained model computes
    ids = torch.arange(3, 30).unsqueeze(0)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir), tmp_path / "adapter")
    with torch.no_grad():
        expected = trainer.model.eval()(input_ids=ids).logits
        torch.testing.assert_close(reloaded.eval()(input_ids=ids).logits, expected)
