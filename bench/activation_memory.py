"""Activation memory of one Gemma decoder layer under LoRA: the bytes autograd keeps for the backward pass.

The W1 recipe (trainer/recipes/text-to-sql-gemma4-31b.yaml) decides whether gradient checkpointing
is needed from a per-GPU memory estimate; its largest term is the activations, measured here rather
than guessed. One decoder layer is built at full width in bf16 (random weights, no Hub access), the
recipe's LoRA is applied (r16, dropout 0.05, the 7 projections; peft keeps adapters in fp32), one
forward runs under `torch.autograd.graph.saved_tensors_hooks`, and the distinct storages saved for
backward (weights excluded) are summed. Run it at two lengths: the result is bytes per token per
layer, linear in tokens (the sdpa kernels keep no tokens x tokens matrix).

    .venv/bin/python bench/activation_memory.py --tokens 64     # ~2 min and ~2 GB RAM on a CPU

Widths default to Gemma 3 27B's text model (hidden 5376, MLP 21504, 32 heads x 128, 16 KV heads):
Gemma 4 31B's exact shapes were not checked (UNCONFIRMED; no Hub access here). What this does not
measure: the weights, the optimizer, the LM head, or allocator overhead (the recipe adds those).
"""

from __future__ import annotations

import argparse

import torch


def saved_bytes_per_token(
    tokens: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int
) -> float:
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer, Gemma3RotaryEmbedding

    config = Gemma3TextConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, num_hidden_layers=1, layer_types=["full_attention"], vocab_size=16,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)

    class OneLayer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = Gemma3DecoderLayer(config, 0).to(torch.bfloat16)

        def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor):  # type: ignore[no-untyped-def]
            return self.layer(x, position_embeddings=cos_sin, attention_mask=None, position_ids=positions)

    model = OneLayer().requires_grad_(False)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=targets))
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            parameter.data = parameter.data.float()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    # the hidden states need grad: under LoRA every earlier layer's adapter sits behind them
    x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(tokens)[None]
    cos_sin = Gemma3RotaryEmbedding(config)(x, positions, "full_attention")
    saved: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(x, cos_sin, positions)
    return sum(saved.values()) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=5376)
    parser.add_argument("--intermediate", type=int, default=21504)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    a = parser.parse_args()
    per_token = saved_bytes_per_token(a.tokens, a.hidden, a.intermediate, a.heads, a.kv_heads, a.head_dim)
    print(f"{a.tokens} tokens: {per_token / 1e3:.1f} KB saved for backward per token per layer")


if __name__ == "__main__":
    main()
