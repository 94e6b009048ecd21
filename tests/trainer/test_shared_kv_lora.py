"""vLLM serves a Gemma 4 adapter with the values the run trained on its shared-kv layers.

Gemma 4 31B's full-attention layers have no v_proj (`attention_k_eq_v`): in transformers their values are the
k_proj output, LoRA included (Gemma4TextAttention.forward, transformers 5.23). vLLM v0.28.0 packs q/k/v into one
qkv_proj for every layer, loads the base's k_proj into both the key and the value slot (gemma4.py
`_weight_iterator`), and applies the adapter per slot, the value slot's from the adapter's `v_proj` tensors; a
missing one is none (lora/model_manager.py `_create_merged_loras_inplace`). `vllm_value_weight` replays that rule on
the published adapter; the run's own values are transformers' effective k_proj (base + LoRA delta).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from trainer.export import COMPLETION_MARKER, SHARED_KV_VALUE_LORA

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

ADAPTER = "adapter_model.safetensors"
LAYER = re.compile(r"\.layers\.(\d+)\.self_attn\.([kv])_proj\.lora_([AB])\.weight$")


def lora_deltas(adapter_dir: Path, scale: float) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, "k" | "v") -> the weight delta `scale * B @ A` the adapter's tensors give that projection."""
    from safetensors.torch import load_file

    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(adapter_dir / ADAPTER).items():
        match = LAYER.search(name)
        if match:
            parts.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor.float()
    return {key: scale * ab["B"] @ ab["A"] for key, ab in parts.items()}


def vllm_value_weight(base_k: torch.Tensor, deltas: dict[tuple[int, str], torch.Tensor], layer: int) -> torch.Tensor:
    """The value slot vLLM serves on a shared-kv layer: the base's k_proj, plus the adapter's v_proj LoRA if any."""
    delta = deltas.get((layer, "v"))
    return base_k if delta is None else base_k + delta


@pytest.fixture
def trained_adapter(tmp_path: Path) -> tuple[Path, object, Path]:
    """The a4 recipe's LoRA on a tiny Gemma 4 whose full-attention layer shares keys and values, its B matrices
    moved off zero as training moves them, saved as the trainer saves it."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import save_tiny_model
    from trainer.modeling import lora_config
    from trainer.recipe import load_recipe

    base = save_tiny_model(tmp_path / "base", family="gemma4", attention_k_eq_v=True, num_global_key_value_heads=1)
    recipe = load_recipe("text-to-sql-gemma4-31b")
    model = AutoModelForCausalLM.from_pretrained(base)
    peft_model = get_peft_model(model, lora_config(recipe.lora, model))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    peft_model.save_pretrained(tmp_path / "adapter")
    return base, peft_model, tmp_path / "adapter"


@pytest.mark.slow
def test_a_run_publishes_the_value_lora_vllm_would_otherwise_drop(tmp_path: Path) -> None:
    """The real trainer (`python -m trainer`'s main) on a tiny Gemma 4 with shared keys and values, the a4 recipe's
    LoRA targets; its published adapter, read as vLLM reads it, gives the values transformers trained with."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import save_tiny_model
    from tests.trainer.test_training import tiny_recipe
    from trainer.recipe import load_recipe
    from trainer.train import main

    base = save_tiny_model(tmp_path / "base", family="gemma4", attention_k_eq_v=True, num_global_key_value_heads=1)
    lora = load_recipe("text-to-sql-gemma4-31b").lora
    targets = ",".join(lora.target_modules)
    main(tiny_recipe(base, str(tmp_path / "run"), "training.max_steps=2", f"lora.target_modules=[{targets}]",
                     f"lora.r={lora.r}", f"lora.alpha={lora.alpha}", "output.merge=false"))  # fmt: skip
    adapter = tmp_path / "run" / "adapter"
    attention = AutoModelForCausalLM.from_pretrained(base).model.language_model.layers[1].self_attn
    assert attention.v_proj is None, "transformers has no v_proj there: the values are the k_proj output"
    base_k = attention.k_proj.weight.detach().float()
    deltas = lora_deltas(adapter, lora.alpha / lora.r)
    trained_values = base_k + deltas[(1, "k")]  # transformers: value_states = k_proj(x), LoRA included
    assert not torch.allclose(trained_values, base_k), "training moved the k_proj LoRA off zero"
    torch.testing.assert_close(vllm_value_weight(base_k, deltas, 1), trained_values)
    marker = json.loads((adapter / COMPLETION_MARKER).read_text())
    assert marker[SHARED_KV_VALUE_LORA] == [1], "the marker says so: the Pulumi program refuses an adapter without it"


def test_only_shared_kv_layers_get_a_copy_and_only_once(trained_adapter) -> None:
    from safetensors.torch import load_file

    from trainer.export import add_shared_kv_value_lora, shared_kv_layers

    _, peft_model, adapter = trained_adapter
    assert shared_kv_layers(peft_model.config) == {1}, "the tiny model's one full-attention layer shares them"
    own = {n: t.clone() for n, t in load_file(adapter / ADAPTER).items()}
    assert add_shared_kv_value_lora(adapter, peft_model.config) == [1]
    assert add_shared_kv_value_lora(adapter, peft_model.config) == [], "a second call adds nothing"
    after = load_file(adapter / ADAPTER)
    assert {n for n in after if n not in own} == {
        n.replace("k_proj", "v_proj") for n in own if ".layers.1.self_attn.k_proj" in n
    }
    assert all(torch.equal(after[n], t) for n, t in own.items()), "the trained tensors are untouched"


def test_peft_loads_the_published_adapter_unchanged(trained_adapter) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.export import add_shared_kv_value_lora

    base, peft_model, adapter = trained_adapter
    ids = torch.tensor([[2, 5, 9, 14, 7, 3]])
    before = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()(ids).logits
    add_shared_kv_value_lora(adapter, peft_model.config)
    after = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()(ids).logits
    torch.testing.assert_close(after, before)


def test_a_model_without_shared_kv_is_left_alone(tmp_path: Path) -> None:
    from transformers import AutoConfig

    from tests.tiny_models import save_tiny_model
    from trainer.export import add_shared_kv_value_lora, shared_kv_layers

    base = save_tiny_model(tmp_path / "base", family="gemma4")
    assert shared_kv_layers(AutoConfig.from_pretrained(base)) == set()
    assert add_shared_kv_value_lora(tmp_path, AutoConfig.from_pretrained(base)) == []
