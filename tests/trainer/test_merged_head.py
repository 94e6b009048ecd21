"""A merged export whose head was trained apart from its embeddings says so where vLLM reads it.

The seed's vision recipe kept whole copies of lm_head and embed_tokens (`modules_to_save`; one override brings it
back, docs/performance.md), so such a run's merged export (what the ray-gemma3-vision stack serves) has two tensors. vLLM v0.28.0 builds the Gemma 3 language model
from the checkpoint's text_config (gemma3_mm.py `init_vllm_registered_model(hf_config=config.text_config)`) and,
when that config says `tie_word_embeddings`, ties the head to embed_tokens and skips every saved `lm_head.` weight
(Gemma3ForCausalLM.__init__ and load_weights, vllm/model_executor/models/gemma3.py). The test reads the export as
vLLM does (transformers' AutoConfig, then the text config) and as transformers does (the reloaded model).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def vllm_ties_head(model_dir: Path) -> bool:
    """Whether vLLM would use embed_tokens as the head (and ignore lm_head.weight) for this Gemma 3 export."""
    from transformers import AutoConfig

    return bool(AutoConfig.from_pretrained(model_dir).get_text_config().tie_word_embeddings)


def merged_vision_export(tmp_path: Path, train_head: bool) -> tuple[Path, torch.Tensor | None]:
    """The vision recipe's adapter on a tiny Gemma 3 vision model, its head copy changed when `train_head`, merged
    by the trainer's own merge_and_export; returns the export and the trained head."""
    from peft import get_peft_model
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from tests.tiny_models import save_tiny_vision_model
    from trainer.export import merge_and_export
    from trainer.modeling import lora_config
    from trainer.recipe import load_recipe

    base = save_tiny_vision_model(tmp_path / "base")
    recipe = load_recipe("product-descriptions-gemma3-4b")
    saved = ["lm_head", "embed_tokens"] if train_head else []  # the seed's modules_to_save, or none
    spec = recipe.lora.model_copy(update={"modules_to_save": saved})
    model = get_peft_model(AutoModelForImageTextToText.from_pretrained(base), lora_config(spec))
    trained = None
    for name, param in model.named_parameters():
        if train_head and "lm_head.modules_to_save" in name:
            with torch.no_grad():
                param.add_(0.5)  # what training does to the head's own copy
            trained = param.detach().clone()
    model.save_pretrained(tmp_path / "adapter")
    processor = AutoProcessor.from_pretrained(base)
    out = merge_and_export(str(base), tmp_path / "adapter", tmp_path / "merged", dtype="float32", tokenizer=processor)
    return out, trained


def test_a_trained_head_is_untied_in_the_config_vllm_reads(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    out, trained = merged_vision_export(tmp_path, train_head=True)
    assert trained is not None
    assert not vllm_ties_head(out), "vLLM would tie the head to embed_tokens and drop the trained lm_head"
    reloaded = AutoModelForImageTextToText.from_pretrained(out)
    assert torch.equal(reloaded.get_output_embeddings().weight, trained)
    assert not torch.equal(reloaded.get_output_embeddings().weight, reloaded.get_input_embeddings().weight)


def test_a_head_still_shared_stays_tied(tmp_path: Path) -> None:
    out, _ = merged_vision_export(tmp_path, train_head=False)
    assert vllm_ties_head(out)
