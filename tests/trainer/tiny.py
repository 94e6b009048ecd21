"""Tiny randomly initialised Gemma 3 (text) and Gemma 4 (text + vision) models for fast, offline trainer tests.

The tokenizer is a small byte-level BPE trained on the bundled emoji sample plus a little SQL,
with Gemma's special tokens (`<pad>`, `<eos>`, `<bos>`, `<start_of_turn>`, `<end_of_turn>`) and
trl's Gemma 3 chat template, so conversations render exactly as they do for the real models.
Models are a few hundred thousand parameters: a training step takes milliseconds on a CPU.

    .venv/bin/python -c "from tests.trainer.tiny import save_tiny_model; print(save_tiny_model('/tmp/tiny', 'gemma3'))"
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from transformers import PreTrainedModel, PreTrainedTokenizerFast

from trainer.local_model import set_stop_tokens, trl_chat_template
from trainer.recipe import REPO_ROOT

Family = Literal["gemma3", "gemma4"]
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"]
_SQL_SNIPPETS = [
    "SELECT COUNT(*) FROM orders WHERE YEAR(placed_on) = 2024;",
    "CREATE TABLE orders (id INT, placed_on DATE, total DECIMAL);",
    "You are a text to SQL query translator. <SCHEMA> </SCHEMA> <USER_QUERY> </USER_QUERY>",
]


def _corpus() -> list[str]:
    lines = (REPO_ROOT / "trainer/samples/emoji.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    return ["Translate to emoji: " + r["text"] for r in rows] + [r["emoji"] for r in rows] + _SQL_SNIPPETS * 20


def tiny_tokenizer(vocab_size: int = 600) -> PreTrainedTokenizerFast:
    """A byte-level BPE with Gemma's special tokens and chat template (ids: pad 0, eos 1, bos 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>", "<start_of_image>"],
    )
    tokenizer.chat_template = trl_chat_template("gemma3")
    return tokenizer


def tiny_gemma3(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> PreTrainedModel:
    """A 2-layer Gemma 3 text model (one sliding, one full attention layer)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=32,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=512,
        **_token_ids(tokenizer),
    )
    return _with_stop_tokens(Gemma3ForCausalLM(config), tokenizer)


def tiny_gemma4(tokenizer: PreTrainedTokenizerFast, seed: int = 0, **text: int) -> PreTrainedModel:
    """A 2-layer Gemma 4 with small per-layer embeddings (Gemma 4's PLE) and a 1-layer vision tower.

    The class is the one the W1 recipe loads: `google/gemma-4-31B-it` is a `gemma4` (multimodal)
    checkpoint, and transformers maps `gemma4` to Gemma4ForConditionalGeneration in
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES (transformers 5.23 models/auto/modeling_auto.py), so the
    recipe's AutoModelForCausalLM gets that class, vision tower included (Gemma4ForCausalLM is
    `gemma4_text` only). No audio tower: UNCONFIRMED whether the 31B checkpoint has one (the Hub is
    not reachable here); the trainer never adapts either tower. `text` overrides text dimensions
    (a larger model for memory measurements).
    """
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    image_token = tokenizer.convert_tokens_to_ids("<start_of_image>")
    text_config = {
        "vocab_size": len(tokenizer),
        "vocab_size_per_layer_input": len(tokenizer),
        "hidden_size": 32,
        "hidden_size_per_layer_input": 8,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "global_head_dim": 16,
        "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 512,
        **_token_ids(tokenizer),
        **text,
    }
    vision_config = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "patch_size": 4,
        "position_embedding_size": 64,
    }
    config = Gemma4Config(
        text_config=text_config,
        vision_config=vision_config,
        audio_config=None,
        image_token_id=image_token,
        boi_token_id=image_token,
        eoi_token_id=image_token,
        video_token_id=image_token,
        **_token_ids(tokenizer),
    )
    return _with_stop_tokens(Gemma4ForConditionalGeneration(config), tokenizer)


def _token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    return {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }


def _with_stop_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    set_stop_tokens(model, tokenizer)
    return model


def save_tiny_model(directory: str | Path, family: Family = "gemma3", seed: int = 0, **text: int) -> Path:
    """Save a tiny model + tokenizer as an ordinary model folder a recipe can name in `model.name_or_path`.

    The Gemma 4 folder carries trl's Gemma 4 chat template, for which trl 1.16 has no training variant,
    so runs on it take the prompt/completion loss path. `text` overrides Gemma 4's text dimensions.
    """
    directory = Path(directory)
    tokenizer = tiny_tokenizer()
    if family == "gemma4":
        tokenizer.chat_template = trl_chat_template("gemma4")  # as the real checkpoints ship it
        model = tiny_gemma4(tokenizer, seed=seed, **text)
    else:
        model = tiny_gemma3(tokenizer, seed=seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
