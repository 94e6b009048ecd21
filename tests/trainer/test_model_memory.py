"""Any Gemma size: the memory model's table of shapes, QLoRA's bytes and the shapes read from a config.json.

The table's numbers are checked against what transformers builds from them (on the meta device: no weights, no
download), QLoRA's bytes against bitsandbytes quantizing a real tensor on the CPU, and the cache lookup against
huggingface_hub's own. The stack's verdict on them is tests/infra/test_model_fit.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from trainer import memory_plan
from trainer.recipe import REPO_ROOT, memory_verdict, parse_recipe

SIZES = ["google/gemma-3-270m", "google/gemma-3-1b-it", "google/gemma-3-4b-it", "google/gemma-3-12b-it",
         "google/gemma-3-27b-it"]  # fmt: skip
DEV_TEMPLATE = "trainer/recipes/templates/my-data-dev.yaml"


def _built(shape: memory_plan.ModelShape):  # type: ignore[no-untyped-def]
    """The transformers model of the shape's checkpoint class, on the meta device."""
    import torch
    from transformers import Gemma3Config, Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration

    text = {
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "vocab_size": shape.vocab, "sliding_window": shape.sliding_window, "layer_types": list(shape.layer_types),
        "tie_word_embeddings": shape.tied_embeddings,
    }  # fmt: skip
    with torch.device("meta"):
        if shape.vision is None:
            return Gemma3ForCausalLM(Gemma3TextConfig(**text))
        v = shape.vision
        vision = {"hidden_size": v.hidden, "intermediate_size": v.intermediate, "num_hidden_layers": v.layers,
                  "patch_size": v.patch_size, "image_size": v.image_size, "num_attention_heads": 16,
                  "vision_use_head": False}  # fmt: skip
        return Gemma3ForConditionalGeneration(
            Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=v.tokens_per_image)
        )


@pytest.mark.parametrize("model_id", SIZES)
def test_each_gemma3_shape_counts_what_transformers_builds(model_id: str) -> None:
    """Parameters, the weights QLoRA quantizes and the LoRA parameters, against transformers 5.23's Gemma 3 classes."""
    import torch
    from transformers.quantizers.base import get_keys_to_not_convert

    shape = memory_plan.MODEL_SHAPES[model_id]
    assert shape.source.startswith(f"https://huggingface.co/{model_id}/blob/main/config.json")
    model = _built(shape)
    counted = sum(p.numel() for p in model.parameters())
    assert abs(counted - shape.total_params) / counted < 1e-3, (counted, shape.total_params)  # norms left out
    vision = sum(p.numel() for name, p in model.named_parameters() if "vision_tower" in name or "multi_modal" in name)
    assert vision == shape.vision_params  # exact: SigLIP and the projector are counted whole
    # QLoRA: transformers' bitsandbytes quantizer converts every nn.Linear but these (the head, tied weights)
    kept = set(get_keys_to_not_convert(model))
    quantized = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name not in kept and name.rsplit(".", 1)[-1] not in kept
    )
    linear = sum(shape.layer_params) + (shape.vision.linear_params if shape.vision else 0)
    assert quantized == linear
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapted = sum(
        8 * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets and "vision" not in name
    )
    assert shape.lora_params(8, targets) == adapted


def test_the_published_sizes_are_the_model_cards() -> None:
    """The table reproduces the sizes Google publishes (270M, 1B, 4B, 12B, 27B; Gemma 4 31B: 30.7B)."""
    billions = {m: round(memory_plan.MODEL_SHAPES[m].total_params / 1e9, 2) for m in SIZES}
    assert billions == {SIZES[0]: 0.27, SIZES[1]: 1.0, SIZES[2]: 4.3, SIZES[3]: 12.19, SIZES[4]: 27.43}
    pt, it = memory_plan.MODEL_SHAPES["google/gemma-3-27b-pt"], memory_plan.MODEL_SHAPES["google/gemma-3-27b-it"]
    assert replace(pt, source="") == replace(it, source="") and pt.source != it.source
    assert memory_plan.MODEL_SHAPES["local:gemma3-270m"].total_params == memory_plan.MODEL_SHAPES[SIZES[0]].total_params


@pytest.mark.parametrize("double_quant", [False, True])
def test_qlora_bytes_per_weight_are_what_bitsandbytes_stores(double_quant: bool) -> None:
    """bitsandbytes 0.50 quantizes a real bf16 tensor on the CPU: packed weights, absmax (and its own absmax)."""
    import bitsandbytes.functional as bnb
    import torch

    weights = torch.randn(256, 64 * 64, dtype=torch.bfloat16)
    packed, state = bnb.quantize_4bit(
        weights, blocksize=64, compress_statistics=double_quant, quant_type="nf4", quant_storage=torch.bfloat16
    )
    stored = packed.numel() * packed.element_size() + state.absmax.numel() * state.absmax.element_size()
    if double_quant:
        stored += state.state2.absmax.numel() * state.state2.absmax.element_size()
    assert stored / weights.numel() == memory_plan.Quantization(double_quant).bytes_per_weight


def test_qlora_keeps_the_embedding_in_bf16() -> None:
    shape = memory_plan.MODEL_SHAPES["google/gemma-3-27b-it"]
    q = memory_plan.Quantization(double_quant=True)
    linear = sum(shape.layer_params) + shape.vision.linear_params  # type: ignore[union-attr]
    assert shape.weight_bytes(q) == pytest.approx(linear * q.bytes_per_weight + (shape.total_params - linear) * 2)
    assert shape.weight_bytes(q) < shape.weight_bytes() / 3  # 55 GB of bf16 -> ~17 GB


def _gemma3_text_config(**text: int) -> dict:
    return {"model_type": "gemma3_text", "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 12,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 192, "vocab_size": 32000,
            "tie_word_embeddings": True, **text}  # fmt: skip


def test_an_unknown_local_folder_is_read_from_its_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_gemma3_text_config()))
    shape, source = memory_plan.find_shape(str(tmp_path), REPO_ROOT)
    assert shape is not None and source == str(tmp_path / "config.json")
    assert (shape.hidden, shape.layers, shape.kv_heads, shape.head_dim, shape.vocab) == (1536, 12, 2, 192, 32000)
    recipe = parse_recipe(DEV_TEMPLATE, [f"model.name_or_path={tmp_path}"])
    verdict = memory_verdict(recipe, "l4", 1)
    assert verdict.fits and verdict.shape == shape and verdict.source == str(tmp_path / "config.json")
    assert f"{tmp_path} (" in verdict.line() and "strategy none" in verdict.line()


def test_a_vision_config_counts_its_siglip_tower(tmp_path: Path) -> None:
    config = {"model_type": "gemma3", "mm_tokens_per_image": 256, "text_config": _gemma3_text_config(),
              "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                                "num_hidden_layers": 27, "patch_size": 14, "image_size": 896}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = memory_plan.model_shape(str(tmp_path), REPO_ROOT)
    assert shape is not None and shape.vision == memory_plan.MODEL_SHAPES["google/gemma-3-4b-it"].vision


def test_an_architecture_the_formulas_cannot_count_is_refused(tmp_path: Path) -> None:
    """Gemma 4's E-models carry per-layer input embeddings; a mixture of experts has experts: neither is counted."""
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": _gemma3_text_config(hidden_size_per_layer_input=256)})
    )
    shape, why = memory_plan.find_shape(str(tmp_path), REPO_ROOT)
    assert shape is None and "hidden_size_per_layer_input=256" in why and "cannot be counted" in why


def test_a_hub_id_in_the_local_cache_is_read_where_huggingface_hub_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache layout huggingface_hub writes; its own try_to_load_from_cache finds the same file."""
    from huggingface_hub import try_to_load_from_cache

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snapshot = tmp_path / "models--my-org--gemma-3-ft" / "snapshots" / ("ab" * 20)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(_gemma3_text_config()))
    (tmp_path / "models--my-org--gemma-3-ft" / "refs").mkdir()
    (tmp_path / "models--my-org--gemma-3-ft" / "refs" / "main").write_text("ab" * 20)
    found = memory_plan.cached_config("my-org/gemma-3-ft")
    assert found == snapshot / "config.json"
    assert Path(try_to_load_from_cache("my-org/gemma-3-ft", "config.json", cache_dir=tmp_path)) == found
    assert memory_plan.cached_config("my-org/gemma-3-ft", revision="ab" * 20) == found
    assert memory_plan.cached_config("my-org/gemma-3-ft", revision="v2") is None
    shape, source = memory_plan.find_shape("my-org/gemma-3-ft", REPO_ROOT)
    assert shape is not None and source == str(found)


def test_an_unknown_remote_id_has_no_shape_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    shape, why = memory_plan.find_shape("someone/gemma-3-9b-custom", REPO_ROOT)
    assert shape is None
    assert "someone/gemma-3-9b-custom is not a Gemma the memory model knows" in why and str(tmp_path) in why
    verdict = memory_verdict(parse_recipe(DEV_TEMPLATE, ["model.name_or_path=someone/gemma-3-9b-custom"]), "l4", 1)
    assert not verdict.fits and verdict.estimate is None and "not estimated" in verdict.line()


def test_qlora_and_vision_tokens_enter_the_estimate() -> None:
    """The same recipe: QLoRA shrinks the frozen weights; a vision recipe's image adds 256 positions per row."""
    base = ["model.name_or_path=google/gemma-3-12b-it", "training.per_device_train_batch_size=1"]
    lora = memory_verdict(parse_recipe(DEV_TEMPLATE, [*base, "quantization=null"]), "h100", 1).estimate
    qlora = memory_verdict(parse_recipe(DEV_TEMPLATE, base), "h100", 1).estimate
    assert lora.terms["frozen weights"] == pytest.approx(24.4, abs=0.1)  # 12.19B x 2 bytes
    assert qlora.terms["frozen weights"] < lora.terms["frozen weights"] / 2.5
    vision = memory_verdict(parse_recipe(DEV_TEMPLATE, [*base, "model.text_only=false"]), "h100", 1).estimate
    head = 1024 * 262_208 * 8 / 1e9
    assert vision.terms["LM head"] == pytest.approx(head * (1024 + 256) / 1024)


@pytest.mark.parametrize(
    ("model", "gpu", "max_length", "lora_fits", "qlora_fits"),
    [
        ("google/gemma-3-4b-it", "l4", 1024, True, True),
        ("google/gemma-3-12b-it", "l4", 1024, False, False),
        ("google/gemma-3-12b-it", "l4", 512, False, True),
        ("google/gemma-3-27b-it", "rtx-pro-6000", 1024, True, True),
        ("google/gemma-4-31b-it", "rtx-pro-6000", 1024, True, True),
        ("google/gemma-4-31b-it", "h100", 1024, False, True),
    ],
)
def test_the_table_of_docs_own_data(model: str, gpu: str, max_length: int, lora_fits: bool, qlora_fits: bool) -> None:
    """docs/own-data.md "Which Gemma fits": the dev template, 1 x max_length tokens, gradient checkpointing, one GPU."""
    sets = [
        f"model.name_or_path={model}",
        "training.per_device_train_batch_size=1",
        f"training.max_length={max_length}",
    ]
    lora = memory_verdict(parse_recipe(DEV_TEMPLATE, [*sets, "quantization=null"]), gpu, 1)
    qlora = memory_verdict(parse_recipe(DEV_TEMPLATE, sets), gpu, 1)
    assert (lora.fits, qlora.fits) == (lora_fits, qlora_fits), (lora.line(), qlora.line())
