"""Activation memory of one Gemma decoder layer under LoRA: the bytes autograd keeps for the backward pass.

    .venv/bin/python bench/activation_memory.py --tokens 64

The W1 recipe's memory estimate decides whether gradient checkpointing is needed; its largest term, the
activations, is measured here: one full-width bf16 decoder layer with the recipe's LoRA, one forward under
`torch.autograd.graph.saved_tensors_hooks`, the distinct saved storages summed (weights excluded). Run at
two lengths: bytes per token per layer. Widths default to Gemma 3 27B's (Gemma 4 31B's: UNCONFIRMED).
Method and what it leaves out: bench/README.md, "The estimates".
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
