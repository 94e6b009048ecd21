"""Model, tokenizer and LoRA loading for a recipe.

    .venv/bin/python -c "from trainer.modeling import *; from trainer.recipe import load_recipe;         r = load_recipe('emoji-local'); m, t = load_model_and_tokenizer(r); print(lora_config(r.lora))"

Decisions:
- dtype `auto` means bf16 where the GPU supports it, else fp16 on a GPU, else fp32 on the CPU.
- QLoRA is bitsandbytes 4-bit (nf4/fp4, optional double quantisation) with the recipe's compute and storage
  dtypes; adapters train in float32 (trainer/lm_head.py). Without FSDP2 weights load onto the GPU (`direct_device`).
- LoRA never targets a vision or audio tower nor the projector (`exclude_modules`, a regex over module
  names, so even `all-linear` stays in the language model); `lora.vision_tower: true` (W2) also adapts the
  vision tower and projector, audio towers stay excluded.
- A tokenizer without a chat template gets trl's ORIGINAL `<name>.jinja` (trl swaps in `<name>_training.jinja`
  for assistant-only loss itself), so the template saved with the model is the one used for inference.
- Under FSDP2's RAM-efficient loading, ranks other than local rank 0 read no weight at all
  (docs/distributed.md#only-rank-0-reads-the-base-weights). Ray/FSDP wrappers and batches are built elsewhere.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from trainer.base_weights import hub_name, is_hub_id
from trainer.model_files import resolve_model_path, trl_chat_template
from trainer.recipe import LoraSpec, ModelSpec, QuantizationSpec, Recipe, RecipeError

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin

    from trainer.checkpoints import OutputLocation

log = logging.getLogger(__name__)

# Module-name fragments of the parts of multimodal Gemma checkpoints that are not the language model.
NON_LANGUAGE_MODULES = ("vision_tower", "audio_tower", "multi_modal_projector", "embed_vision", "embed_audio")
NON_LANGUAGE_MODULES_REGEX = r".*(" + "|".join(NON_LANGUAGE_MODULES) + r").*"
# With `lora.vision_tower`, the audio towers stay excluded and so does SigLIP's attention-pooling head
# (`vision_tower.head`, present when a config keeps `vision_use_head`): Gemma 3 feeds the projector the
# encoder's last hidden state, never the pooled output, so adapters there would get no gradient, and DDP
# without `find_unused_parameters` (trainer/ray_entry.py) stops on parameters without one.
VISION_LORA_EXCLUDED_REGEX = r".*(audio_tower|embed_audio|vision_tower\.head\.|vision_model\.head\.).*"


def resolve_dtype(name: str) -> torch.dtype:
    """`auto` -> bf16 on GPUs that support it, fp16 on older GPUs, fp32 on the CPU; else the named dtype."""
    import torch

    if name != "auto":
        return getattr(torch, name)
    if torch.cuda.is_available():
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def quantization_config(spec: QuantizationSpec | None) -> BitsAndBytesConfig | None:
    """The bitsandbytes 4-bit config for QLoRA, or None for plain LoRA."""
    if spec is None or not spec.load_in_4bit:
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=spec.quant_type,
        bnb_4bit_use_double_quant=spec.double_quant,
        bnb_4bit_compute_dtype=resolve_dtype(spec.compute_dtype),
        bnb_4bit_quant_storage=resolve_dtype(spec.storage_dtype or spec.compute_dtype),
    )


def load_tokenizer(spec: ModelSpec, model_path: str | None = None) -> PreTrainedTokenizerBase | ProcessorMixin:
    """The tokenizer (text tasks) or processor (vision tasks), with a chat template guaranteed."""
    from transformers import AutoProcessor, AutoTokenizer

    path = model_path or resolve_model_path(spec.name_or_path)
    loader = AutoTokenizer if spec.text_only else AutoProcessor
    processing_class = loader.from_pretrained(path, revision=spec.revision)
    ensure_chat_template(processing_class, spec.chat_template)
    return processing_class


def ensure_chat_template(processing_class: Any, template_name: str | None) -> None:
    """Give a tokenizer/processor without a chat template trl's `<template_name>.jinja`."""
    if getattr(processing_class, "chat_template", None):
        return
    if template_name is None:
        raise RecipeError(
            "the tokenizer has no chat template and model.chat_template is null: "
            "set model.chat_template to a trl template name such as gemma3"
        )
    processing_class.chat_template = trl_chat_template(template_name)
    tokenizer = getattr(processing_class, "tokenizer", None)
    if tokenizer is not None and not tokenizer.chat_template:
        tokenizer.chat_template = processing_class.chat_template


def loads_weights_on_this_rank(quantized: bool) -> bool:
    """False on the ranks whose weights FSDP2's RAM-efficient loading broadcasts from rank 0 (see the module docstring).

    The decision is transformers' own (`is_fsdp_enabled()` and not `is_local_dist_rank_0()`), so it
    is only False once torch.distributed is initialised: build the SFTConfig first.
    """
    if quantized or os.environ.get("ACCELERATE_USE_CPU", "false").lower() in {"1", "true", "yes"}:
        return True
    from transformers.distributed.utils import is_local_dist_rank_0
    from transformers.integrations import is_fsdp_enabled

    return not is_fsdp_enabled() or is_local_dist_rank_0()


def direct_device(quantized: bool) -> str | None:
    """The GPU this rank trains on when its weights can go straight there (`device_map`), else None.

    Without it transformers reads the safetensors into host memory and accelerate's `prepare` copies the model to
    the GPU afterwards: a second pass over 62 GB per rank for W1. Not under FSDP2 (it shards from rank 0's host
    copy) and not for 4-bit models (bitsandbytes' quantizer already places them on the current GPU)."""
    import torch

    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in {"1", "true", "yes"}
    if quantized or fsdp or not torch.cuda.is_available():
        return None
    return f"cuda:{torch.cuda.current_device()}"  # accelerate set it to this rank's GPU when the config was built


def load_model(
    spec: ModelSpec, quantization: QuantizationSpec | None = None, model_path: str | None = None
) -> PreTrainedModel:
    """The base model in the recipe's dtype and attention implementation, 4-bit when quantization is set.

    On the ranks that FSDP2 fills from rank 0 no weight is read: every parameter is an untouched `torch.empty`
    (module docstring).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    path = model_path or resolve_model_path(spec.name_or_path)
    loader = AutoModelForCausalLM if spec.text_only else AutoModelForImageTextToText
    kwargs: dict[str, Any] = {
        "revision": spec.revision,
        "dtype": resolve_dtype(spec.dtype),
        "attn_implementation": spec.attn_implementation,
    }
    bnb = quantization_config(quantization)
    if bnb is not None:
        kwargs["quantization_config"] = bnb
        kwargs["dtype"] = bnb.bnb_4bit_compute_dtype
    if not loads_weights_on_this_rank(quantized=bnb is not None):
        model = _load_without_weights(path, spec, kwargs)
    else:
        device = direct_device(quantized=bnb is not None)
        if device is not None:
            kwargs["device_map"] = {"": device}
        model = loader.from_pretrained(path, **kwargs)
        log.info("loaded %s (%s, %s%s)", path, kwargs["dtype"], spec.attn_implementation, ", 4-bit" if bnb else "")
    if path != spec.name_or_path and is_hub_id(spec.name_or_path):
        hub_name(model, spec.name_or_path)  # staged in the bucket: the adapter still names the Hub id
    return model


def _load_without_weights(path: str, spec: ModelSpec, kwargs: dict[str, Any]) -> PreTrainedModel:
    """The model class the Auto loader would pick, no weight read (empty CPU parameters), real non-persistent buffers."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )
    from transformers.utils import logging as hf_logging

    config = AutoConfig.from_pretrained(path, revision=spec.revision)
    mapping = MODEL_FOR_CAUSAL_LM_MAPPING if spec.text_only else MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    model_class: Any = mapping[type(config)]
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report would call every weight MISSING and "newly initialized"
    try:
        model = model_class.from_pretrained(
            None, config=config, state_dict={}, dtype=kwargs["dtype"], attn_implementation=spec.attn_implementation
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    _parameters_to_empty_cpu(model)
    log.info("built %s from %s without weights: FSDP2 broadcasts them from rank 0", model_class.__name__, path)
    return model


def _parameters_to_empty_cpu(model: PreTrainedModel) -> None:
    """Give every meta parameter its own uninitialised CPU storage (`torch.empty`: no page is touched, so no RAM is
    used), keeping tied parameters tied.

    accelerate's FSDP2 prepare maps the optimizer's parameters to the sharded ones by `data_ptr()` (accelerate 1.15
    accelerator.py `_prepare_fsdp2`, utils/fsdp_utils.py `fsdp2_switch_optimizer_parameters`). A meta tensor's
    data_ptr() is 0 for all of them, so on a rank whose model stayed on the meta device every optimizer entry
    became the same (frozen) parameter and that rank's shards of the adapters never trained, silently.
    accelerate's own RAM-efficient path expects CPU tensors there ("non-main ranks only have torch.empty",
    fsdp2_prepare_model); buffers are left as transformers set them.
    """
    import torch

    replaced: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in replaced:
                empty = torch.empty_like(param, device="cpu")
                replaced[id(param)] = torch.nn.Parameter(empty, requires_grad=param.requires_grad)
            module._parameters[name] = replaced[id(param)]


def load_model_and_tokenizer(recipe: Recipe, location: OutputLocation | None = None) -> tuple[PreTrainedModel, Any]:
    """Base model + tokenizer/processor for a recipe (resolving `local:` models once; staged with `location`)."""
    path = resolve_model_path(recipe.model.name_or_path)
    if location is not None:
        from trainer.base_weights import stage_base_model

        path = stage_base_model(path, recipe.model.revision, location)
    return load_model(recipe.model, recipe.quantization, path), load_tokenizer(recipe.model, path)


def lora_config(spec: LoraSpec, model: PreTrainedModel | None = None) -> LoraConfig:
    """A causal-LM LoRA config whose targets can never fall inside a vision or audio tower.

    Given the model, the exclusion is only added when the model has such towers (peft warns otherwise).
    """
    from peft import LoraConfig

    excluded = VISION_LORA_EXCLUDED_REGEX if spec.vision_tower else NON_LANGUAGE_MODULES_REGEX
    return LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=spec.target_modules,
        exclude_modules=excluded if model is None or has_non_language_modules(model) else None,
        modules_to_save=list(spec.modules_to_save) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def has_non_language_modules(model: PreTrainedModel) -> bool:
    return any(part in name for name, _ in model.named_modules() for part in NON_LANGUAGE_MODULES)
