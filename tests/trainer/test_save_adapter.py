"""`trainer.train.save_adapter` takes the shard-gathering path whenever the trainer runs FSDP."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from tests.trainer import tiny
from trainer.train import save_adapter


def _peft_model() -> torch.nn.Module:
    model = tiny.tiny_gemma3(tiny.tiny_tokenizer(), seed=3)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # make B non-zero so "the adapter was saved" is not "zeros were saved"
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.uniform_(-0.1, 0.1)
    return peft_model


def test_fsdp_trainer_saves_every_adapter_tensor_in_full(tmp_path: Path) -> None:
    model = _peft_model()
    fsdp_trainer = SimpleNamespace(is_fsdp_enabled=True, model=model)
    save_adapter(fsdp_trainer, tmp_path / "fsdp")  # type: ignore[arg-type]
    model.save_pretrained(tmp_path / "reference")
    saved = load_file(tmp_path / "fsdp" / "adapter_model.safetensors")
    reference = load_file(tmp_path / "reference" / "adapter_model.safetensors")
    assert saved.keys() == reference.keys() and len(saved) > 0
    for key, tensor in reference.items():
        assert torch.equal(saved[key], tensor), key


def test_plain_trainer_uses_save_model(tmp_path: Path) -> None:
    calls: list[str] = []
    plain = SimpleNamespace(is_fsdp_enabled=False, save_model=calls.append)
    save_adapter(plain, tmp_path / "plain")  # type: ignore[arg-type]
    assert calls == [str(tmp_path / "plain")]
