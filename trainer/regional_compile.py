"""`training.compile: regional`: each decoder layer of the language model compiled in place for training.

Decision: eager PyTorch launches every element-wise operation of a layer (norms, rotary, LoRA's dropout, casts
and scaling, residuals) as a kernel of its own, about 380 per layer and micro-step with LoRA on the 7
projections (bench/step_ops.py); compiled, a layer's element-wise work fuses into a few kernels around the
matrix multiplications. The layers are compiled in place (`nn.Module.compile`, as accelerate's
`compile_regions_fsdp2` and PyTorch's regional compilation recipe do): the module tree, the state_dict keys and
the hooks DDP adds later are kept, and every layer of a kind shares one graph. `dynamic=True`, since a
packed row's length changes every micro-step (no static graph first). After training the layers run eagerly
again (`decompile_decoder_layers`, a callback): generation's KV cache would recompile them per layer. Vision and
audio towers stay eager; under FSDP2 nothing is compiled (its hooks inside a compiled layer: unconfirmed).
Numbers: bench/RESULTS.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.modeling import NON_LANGUAGE_MODULES

if TYPE_CHECKING:
    import torch

BACKEND = "inductor"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The language model's decoder layers: every repeated block (accelerate's `is_repeated_blocks`) outside the
    vision and audio towers."""
    from accelerate.utils.other import is_repeated_blocks

    return [
        layer
        for name, module in model.named_modules()
        if is_repeated_blocks(module) and not any(part in name for part in NON_LANGUAGE_MODULES)
        for layer in module
    ]


def compile_decoder_layers(model: torch.nn.Module, backend: str | None = None) -> int:
    """Compile each decoder layer in place; the number compiled. A layer Dynamo cannot compile runs eagerly with a
    warning (`suppress_errors`) instead of stopping a paid run at its first step."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend or BACKEND, dynamic=True)
    return len(layers)


def decompile_decoder_layers(model: torch.nn.Module) -> int:
    """Run the layers eagerly again (`nn.Module.compile` keeps the compiled call in `_compiled_call_impl`)."""
    layers = [layer for layer in decoder_layers(model) if getattr(layer, "_compiled_call_impl", None) is not None]
    for layer in layers:
        layer._compiled_call_impl = None
    return len(layers)


def eager_after_training() -> Any:
    """A TrainerCallback that decompiles the layers when training ends (evaluation and export then run eagerly)."""
    from transformers import TrainerCallback

    class EagerAfterTraining(TrainerCallback):  # type: ignore[misc]
        def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            if model is not None:
                decompile_decoder_layers(model)

    return EagerAfterTraining()
