"""FSDP2 for the trainer: which block to shard, the accelerate config, and a shard-safe adapter save.

Decisions:
- The block FSDP wraps is looked up, not typed in: `decoder_layer_class` builds the model's text stack on
  the meta device and returns its class from `_no_split_modules` (docs/distributed.md#fsdp2s-configuration).
- `render_accelerate_config` writes accelerate 1.15's own keys: FSDP2, transformer-based wrap, reshard after
  forward, FULL_STATE_DICT, RAM-efficient loading, no offload; LoRA gradients reduce in fp32
  (`reduce_gradients_in_fp32`), compute stays bf16 (same record).
- `save_adapter_fsdp_safe` gathers every adapter tensor before rank 0 writes it, and a checkpoint under FSDP
  holds the adapter, not the gathered model (`checkpoints_without_the_base`,
  docs/distributed.md#fsdp-checkpoints-hold-the-adapter-only).
- `fsdp2_loads_persistent_buffers` broadcasts persistent buffers (Gemma 4's `layer_scalar`) apart from
  accelerate's RAM-efficient loading, which fails on them (docs/distributed.md#only-rank-0-reads-the-base-weights).
It launches nothing (trainer/launch.py does) and shards nothing itself (accelerate does, from the config).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

# Last resort only (see the module docstring): model types whose text block we know, for a
# transformers too old to build the config.
_FALLBACK_LAYER_CLASSES = {
    "gemma4": "Gemma4TextDecoderLayer",
    "gemma4_text": "Gemma4TextDecoderLayer",
    "gemma3": "Gemma3DecoderLayer",
    "gemma3_text": "Gemma3DecoderLayer",
    "gemma2": "Gemma2DecoderLayer",
    "gemma": "GemmaDecoderLayer",
}

# Wrapper prefixes that FSDP1 / activation checkpointing / torch.compile put into parameter names.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


class FsdpConfigError(ValueError):
    """The model or the launch settings cannot produce a valid FSDP config."""


def _as_config(model_type_or_config: str | PretrainedConfig | Mapping[str, Any]) -> PretrainedConfig:
    from transformers import AutoConfig

    if isinstance(model_type_or_config, str):
        return AutoConfig.for_model(model_type_or_config)
    if isinstance(model_type_or_config, Mapping):
        data = dict(model_type_or_config)
        model_type = data.pop("model_type", None)
        if not model_type:
            raise FsdpConfigError("the model config has no model_type")
        return AutoConfig.for_model(model_type, **data)
    return model_type_or_config


def _text_model_class(text_config: PretrainedConfig) -> Any:
    """The causal-LM class transformers maps the text config's model_type to."""
    from transformers.models.auto import modeling_auto

    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING, modeling_auto.MODEL_MAPPING):
        model_class = mapping.get(type(text_config), None)
        if model_class is not None:
            return model_class
    raise FsdpConfigError(f"transformers has no causal-LM class for model_type {text_config.model_type!r}")


def decoder_layer_class(model_type_or_config: str | PretrainedConfig | Mapping[str, Any]) -> str:
    """The class name of the text transformer block to wrap with FSDP, e.g. `Gemma4TextDecoderLayer`.

    Accepts a model_type (`"gemma4"`), a config object or a config dict. The text config's
    causal-LM class is built on the meta device; its `_no_split_modules` that actually occur in
    it are the candidates, and the one repeated most (the layer stack) wins.
    """
    try:
        config = _as_config(model_type_or_config)
    except (KeyError, ValueError) as exc:
        model_type = model_type_or_config if isinstance(model_type_or_config, str) else None
        if model_type in _FALLBACK_LAYER_CLASSES:
            log.warning("transformers does not know %r (%s); using the fallback table", model_type, exc)
            return _FALLBACK_LAYER_CLASSES[model_type]
        raise FsdpConfigError(f"cannot read a model config for {model_type_or_config!r}: {exc}") from exc

    import torch

    text_config = config.get_text_config(decoder=True)
    model_class = _text_model_class(text_config)
    no_split = list(getattr(model_class, "_no_split_modules", None) or [])
    with torch.device("meta"):
        model = model_class._from_config(text_config)
    counts: dict[str, int] = {}
    for module in model.modules():
        name = type(module).__name__
        if not no_split or name in no_split:
            counts[name] = counts.get(name, 0) + 1
    if not no_split:
        # No declaration: the block is the module class repeated once per hidden layer.
        n_layers = getattr(text_config, "num_hidden_layers", None)
        counts = {k: v for k, v in counts.items() if v == n_layers and "Layer" in k}
    if not counts:
        raise FsdpConfigError(
            f"{model_class.__name__} declares no transformer block in its text stack "
            f"(_no_split_modules={no_split}); set the class explicitly"
        )
    return max(counts, key=lambda k: counts[k])


def render_accelerate_config(
    model_config: str | PretrainedConfig | Mapping[str, Any],
    num_processes: int,
    num_machines: int = 1,
    machine_rank: int = 0,
    main_process_ip: str | None = None,
    main_process_port: int = 29500,
    mixed_precision: str = "bf16",
    *,
    strategy: str = "fsdp",
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    layer_class: str | None = None,
    use_cpu: bool = False,
) -> dict[str, Any]:
    """An accelerate `config_file` as a dict (dump it as YAML).

    `num_processes` is the TOTAL over all machines, as accelerate expects. `strategy="none"`
    renders plain data parallelism (MULTI_GPU), used for QLoRA recipes that FSDP cannot shard and for
    `distributed.strategy: ddp`. `reshard_after_forward=False` keeps each FSDP2 layer gathered from its
    forward to its backward (one all-gather per micro-step instead of two; trainer/memory_plan.py).
    `use_cpu=True` runs the processes on CPUs over gloo: accelerate then trains them as DDP
    (MULTI_CPU), also for an FSDP config, since accelerate shards with FSDP only on accelerators
    (accelerate 1.15 state.py `AcceleratorState.__init__`).
    """
    if num_processes < 1 or num_machines < 1:
        raise FsdpConfigError(f"num_processes={num_processes} and num_machines={num_machines} must be >= 1")
    if num_processes % num_machines:
        raise FsdpConfigError(f"num_processes={num_processes} is not a multiple of num_machines={num_machines}")
    if not 0 <= machine_rank < num_machines:
        raise FsdpConfigError(f"machine_rank={machine_rank} is outside 0..{num_machines - 1}")
    if num_machines > 1 and not main_process_ip:
        raise FsdpConfigError("a multi-node launch needs main_process_ip (the address of node 0)")
    if mixed_precision not in {"no", "fp16", "bf16", "fp8"}:
        raise FsdpConfigError(f"mixed_precision={mixed_precision!r}: use no, fp16, bf16 or fp8")
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "FSDP" if strategy == "fsdp" else ("MULTI_GPU" if num_processes > 1 else "NO"),
        "downcast_bf16": False,
        "enable_cpu_affinity": False,
        "machine_rank": machine_rank,
        "main_training_function": "main",
        "mixed_precision": mixed_precision,
        "num_machines": num_machines,
        "num_processes": num_processes,
        # static rendezvous: accelerate passes main_process_ip:port to torchrun as rdzv_endpoint.
        # (`same_network` is left out: accelerate 1.15 ignores it when it comes from a config file.)
        "rdzv_backend": "static",
        "use_cpu": use_cpu,
        "main_process_port": main_process_port,
    }
    if main_process_ip:
        config["main_process_ip"] = main_process_ip
    if strategy == "fsdp":
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": layer_class or decoder_layer_class(model_config),
            "fsdp_reshard_after_forward": reshard_after_forward,
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_offload_params": cpu_offload,
            "fsdp_activation_checkpointing": activation_checkpointing,
        }
    elif strategy != "none":
        raise FsdpConfigError(f"strategy={strategy!r}: use fsdp or none")
    return config


def reduce_gradients_in_fp32(fsdp_plugin: Any) -> None:
    """Make an FSDP2 plugin's policy accumulate and reduce gradients in fp32; compute dtypes unchanged.

    Call it before accelerate prepares the model (`fully_shard` reads the policy then). FSDP1 plugins
    and None (no FSDP) are left alone.
    """
    if fsdp_plugin is None or getattr(fsdp_plugin, "fsdp_version", 1) != 2:
        return
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    current = fsdp_plugin.mixed_precision_policy or MixedPrecisionPolicy()
    fsdp_plugin.mixed_precision_policy = MixedPrecisionPolicy(
        param_dtype=current.param_dtype,
        reduce_dtype=torch.float32,
        output_dtype=current.output_dtype,
        cast_forward_inputs=current.cast_forward_inputs,
    )


def checkpoints_without_the_base(trainer: Any) -> None:
    """Under FSDP, a checkpoint gathers and writes the adapter's parameters only (module docstring).

    The trainer's `save_model` writes nothing for a checkpoint, and its `_save_optimizer_and_scheduler`
    writes the adapter as transformers' FSDP model file (what `load_fsdp_model` resumes from, strict=False),
    then accelerate's FSDP optimizer file and the scheduler, as transformers does.
    """
    if not getattr(trainer, "is_fsdp_enabled", False):
        return
    save_model = trainer.save_model

    def save_model_unless_checkpoint(output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not _internal_call:  # a checkpoint (or Trainer.push_to_hub, unused): the adapter is saved below
            save_model(output_dir, _internal_call=_internal_call)

    def save_adapter_optimizer_and_scheduler(output_dir: str) -> None:
        import torch
        from accelerate.utils import save_fsdp_optimizer
        from transformers.trainer import FSDP_MODEL_NAME, SCHEDULER_NAME

        adapter = gather_adapter_state_dict(trainer.model)  # a collective: every rank, adapter shards only
        plugin = trainer.accelerator.state.fsdp_plugin
        Path(output_dir).mkdir(parents=True, exist_ok=True)  # save_model made it; accelerate's writers expect it
        if trainer.args.should_save:
            torch.save(adapter, Path(output_dir) / f"{FSDP_MODEL_NAME}.bin")
        save_fsdp_optimizer(plugin, trainer.accelerator, trainer.optimizer, trainer.model, output_dir)
        if trainer.args.should_save:
            torch.save(trainer.lr_scheduler.state_dict(), Path(output_dir) / SCHEDULER_NAME)

    trainer.save_model = save_model_unless_checkpoint
    trainer._save_optimizer_and_scheduler = save_adapter_optimizer_and_scheduler


# --------------------------------------------------------------------------------------
# Saving a LoRA adapter from a sharded model


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _unwrap(model: Any) -> Any:
    """The PeftModel inside DDP/accelerate wrappers (FSDP2 does not wrap: it swaps parameters)."""
    while hasattr(model, "module") and not hasattr(model, "peft_config"):
        model = model.module
    return model


def _is_adapter_parameter(name: str, param: torch.nn.Parameter) -> bool:
    return param.requires_grad or "lora_" in name or "modules_to_save" in name


def gather_adapter_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU copies of every trainable/adapter parameter, keyed by its plain name.

    Every rank must call this: gathering a DTensor is a collective. Parameters are visited in
    `named_parameters()` order, which is the same on every rank.
    """
    from torch.distributed.tensor import DTensor

    gathered: dict[str, torch.Tensor] = {}
    for name, param in _unwrap(model).named_parameters():
        if not _is_adapter_parameter(name, param):
            continue
        tensor = param.full_tensor() if isinstance(param, DTensor) else param
        gathered[_clean_name(name)] = tensor.detach().to("cpu", copy=True)
    return gathered


def save_adapter_fsdp_safe(
    model: Any,
    out_dir: str | os.PathLike[str],
    *,
    rank: int | None = None,
    safe_serialization: bool = True,
    barrier: bool = True,
) -> Path | None:
    """Write the PEFT adapter of a (possibly FSDP2-sharded) PeftModel to `out_dir`, on rank 0 only.

    All ranks call it; each contributes its shards; rank 0 returns the folder, the others None.
    Works unchanged without torch.distributed (one process).
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    if rank is None:
        rank = dist.get_rank() if distributed else 0
    state_dict = gather_adapter_state_dict(model)
    out = Path(out_dir)
    if rank == 0:
        peft_model = _unwrap(model)
        out.mkdir(parents=True, exist_ok=True)
        # PEFT filters the adapter keys out of the state dict we pass and renames them.
        peft_model.save_pretrained(
            str(out), state_dict=state_dict, safe_serialization=safe_serialization, is_main_process=True
        )
    if distributed and barrier:
        dist.barrier()
    return out if rank == 0 else None


# --------------------------------------------------------------------------------------
# FSDP2 RAM-efficient loading of persistent buffers


def _persistent_buffers(model: Any) -> list[tuple[Any, str, str]]:
    """(module, local name, fully qualified name) of every persistent buffer, each module once."""
    found = []
    for module_name, module in model.named_modules(remove_duplicate=True):
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                found.append((module, name, f"{module_name}.{name}" if module_name else name))
    return found


def fsdp2_loads_persistent_buffers() -> None:
    """Wrap accelerate's `fsdp2_load_full_state_dict` so persistent buffers are broadcast too (idempotent).

    accelerate's `fsdp2_prepare_model` looks the function up in its module at call time, so
    replacing the module attribute is enough. Inside the wrapper the persistent buffers are marked
    non-persistent while accelerate broadcasts the parameters (its `model.state_dict()` then holds
    only sharded parameters), then each buffer is broadcast from rank 0 and registered again as a
    persistent buffer on the accelerator's device.
    """
    from accelerate.utils import fsdp_utils

    if getattr(fsdp_utils.fsdp2_load_full_state_dict, "loads_persistent_buffers", False):
        return
    load_parameters = fsdp_utils.fsdp2_load_full_state_dict

    def load_full_state_dict(accelerator: Any, model: Any, full_sd: dict[str, Any], cpu_offload: bool = False) -> Any:
        import torch
        import torch.distributed as dist

        buffers = _persistent_buffers(model)
        names = {fqn for _, _, fqn in buffers}
        for module, name, _ in buffers:
            module._non_persistent_buffers_set.add(name)
        try:
            parameters = (
                {k: v for k, v in full_sd.items() if k not in names} if accelerator.is_main_process else full_sd
            )
            model = load_parameters(accelerator, model, parameters, cpu_offload=cpu_offload)
        finally:
            for module, name, _ in buffers:
                module._non_persistent_buffers_set.discard(name)
        for module, name, fqn in buffers:
            empty = getattr(module, name)
            if accelerator.is_main_process:
                value = full_sd[fqn].detach().to(accelerator.device, dtype=empty.dtype).contiguous()
            else:
                value = torch.empty(empty.shape, dtype=empty.dtype, device=accelerator.device)
            dist.broadcast(value, src=0)
            module.register_buffer(name, value, persistent=True)
        return model

    load_full_state_dict.loads_persistent_buffers = True  # type: ignore[attr-defined]
    fsdp_utils.fsdp2_load_full_state_dict = load_full_state_dict
