"""Model loading decisions: dtype choice, QLoRA config, LoRA never inside a vision tower, chat template fallback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.modeling import (
    NON_LANGUAGE_MODULES,
    ensure_chat_template,
    lora_config,
    quantization_config,
    resolve_dtype,
)
from trainer.recipe import LoraSpec, QuantizationSpec, RecipeError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_auto_dtype_is_fp32_on_cpu_and_named_dtypes_pass_through() -> None:
    expected = torch.float32
    if torch.cuda.is_available():
        expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert resolve_dtype("auto") == expected
    assert resolve_dtype("bfloat16") == torch.bfloat16


def test_qlora_config_follows_the_recipe() -> None:
    config = quantization_config(
        QuantizationSpec(double_quant=True, compute_dtype="bfloat16", storage_dtype="bfloat16")
    )
    assert config is not None and config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_use_double_quant and config.bnb_4bit_compute_dtype == torch.bfloat16
    assert config.bnb_4bit_quant_storage == torch.bfloat16
    assert quantization_config(None) is None


def _tiny_gemma3_vision(vocab_size: int) -> torch.nn.Module:
    from transformers import Gemma3ForConditionalGeneration

    from tests.tiny_models import gemma3_vision_config

    return Gemma3ForConditionalGeneration(
        gemma3_vision_config(vocab_size, vocab_size - 1, vocab_size - 2, vocab_size - 3)
    )


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2", "out_proj"]])
def test_lora_never_targets_the_vision_tower(targets: list[str] | str) -> None:
    from peft import get_peft_model

    model = _tiny_gemma3_vision(vocab_size=300)
    peft_model = get_peft_model(model, lora_config(LoraSpec(target_modules=targets), model))
    adapted = [name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")]
    assert adapted, "nothing was adapted"
    assert all("language_model" in name for name in adapted), adapted
    assert not any(part in name for name in adapted for part in NON_LANGUAGE_MODULES)


def test_w2_lora_adapts_the_vision_tower_and_the_language_model() -> None:
    """The seed's `all-linear` on Gemma3ForConditionalGeneration covers SigLIP's linear layers too."""
    from peft import get_peft_model

    from trainer.recipe import load_recipe

    model = _tiny_gemma3_vision(vocab_size=300)
    spec = load_recipe("product-descriptions-gemma3-4b").lora
    peft_model = get_peft_model(model, lora_config(spec, model))
    adapted = [name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")]
    vision = [name for name in adapted if "vision_tower" in name]
    assert vision and any("language_model" in name for name in adapted), adapted
    assert any(name.endswith(("fc1", "fc2")) for name in vision) and any(name.endswith("q_proj") for name in vision)
    assert not any(name.endswith("lm_head") for name in adapted)  # the head is tied to the frozen embedding


def test_text_only_model_gets_no_exclusion(tiny_gemma3_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir)
    assert lora_config(LoraSpec(), model).exclude_modules is None
    assert lora_config(LoraSpec()).exclude_modules is not None  # without a model, stay safe


def test_missing_chat_template_comes_from_trl(tiny_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tiny_tokenizer = type(tiny_tokenizer).from_pretrained
    from tests.tiny_models import tiny_tokenizer as make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.chat_template = None
    ensure_chat_template(tokenizer, "gemma3")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<bos><start_of_turn>user\nhi<end_of_turn>\n"
    tokenizer.chat_template = None
    with pytest.raises(RecipeError, match=r"model\.chat_template"):
        ensure_chat_template(tokenizer, None)


def test_w1_recipe_loads_the_gemma4_class_of_the_real_checkpoint(tiny_gemma4_dir: Path) -> None:
    """`gemma4` checkpoints (google/gemma-4-31B-it) load as Gemma4ForConditionalGeneration through
    AutoModelForCausalLM (transformers models/auto/modeling_auto.py MODEL_FOR_CAUSAL_LM_MAPPING_NAMES);
    the tests' tiny Gemma 4 is that class, and the recipe's LoRA stays out of its vision tower."""
    from peft import get_peft_model
    from transformers import AutoConfig

    from trainer.modeling import load_model
    from trainer.recipe import load_recipe

    recipe = load_recipe("text-to-sql-gemma4-31b", [f"model.name_or_path={tiny_gemma4_dir}", "model.dtype=float32"])
    assert AutoConfig.from_pretrained(tiny_gemma4_dir).model_type == "gemma4"
    model = load_model(recipe.model)
    assert type(model).__name__ == "Gemma4ForConditionalGeneration"
    assert any("vision_tower" in name for name, _ in model.named_modules())
    peft_model = get_peft_model(model, lora_config(recipe.lora, model))
    adapted = [name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")]
    assert adapted and all("language_model" in name for name in adapted), adapted


def test_weights_go_straight_to_the_ranks_gpu_unless_fsdp_or_4bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why: read into host memory first, every DDP rank copied W1's 62 GB to its GPU a second time in prepare()."""
    import torch

    from trainer.modeling import direct_device

    assert direct_device(quantized=False) is None  # this CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # accelerate's set_device for local rank 3
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert direct_device(quantized=False) == "cuda:3"
    assert direct_device(quantized=True) is None
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # accelerate launch's FSDP config
    assert direct_device(quantized=False) is None
