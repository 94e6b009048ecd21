"""The tests' one builder of tiny random Gemma models: a few hundred thousand parameters, no Hub.

- `tiny_tokenizer`: a byte-level BPE trained on the emoji sample plus a little SQL, with Gemma's special
  tokens and trl's Gemma 3 chat template, so conversations render as they do for the real models;
- `tiny_gemma3` / `tiny_gemma4` / `save_tiny_model`: the trainer's text models (Gemma 4 with its vision
  tower), as a model or as a folder a recipe names in `model.name_or_path`;
- `tiny_vision_processor` / `tiny_vision_model`: Gemma 3 with a 1-layer SigLIP (W2, the Ray stack);
- `build_tiny_gemma`: the serving tests' folder: a character-level tokenizer (one token per character,
  so a prompt's length in tokens is its length in characters) and the trainer's completion marker;
- `gemma3_text_config` / `gemma3_vision_config` / `gemma4_config`: the configs all of these are built
  from, for tests that need a config or a model without a tokenizer.

    .venv/bin/python -c "from tests.tiny_models import save_tiny_model; print(save_tiny_model('/tmp/tiny'))"
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

from trainer.model_files import set_stop_tokens, trl_chat_template
from trainer.recipe import REPO_ROOT

Family = Literal["gemma3", "gemma4"]
DATA = REPO_ROOT / "trainer" / "samples"
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]  # ids 0..5
IMAGE_SPECIALS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
IMAGE_SEQ_LENGTH = 4  # soft tokens per image: a perfect square, (image_size / patch_size)^2 pooled to 2x2
IMAGE_SIZE = 32
_SQL_SNIPPETS = [
    "SELECT COUNT(*) FROM orders WHERE YEAR(placed_on) = 2024;",
    "CREATE TABLE orders (id INT, placed_on DATE, total DECIMAL);",
    "You are a text to SQL query translator. <SCHEMA> </SCHEMA> <USER_QUERY> </USER_QUERY>",
]
_SERVING_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


# --- configs -------------------------------------------------------------------------------------------


def gemma3_text_config(vocab: int, **overrides: Any) -> PretrainedConfig:
    """A 2-layer Gemma 3 text config (one sliding, one full attention layer); pad 0, eos 1, bos 2."""
    from transformers import Gemma3TextConfig

    dims: dict[str, Any] = {
        "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "query_pre_attn_scalar": 16,
        "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 512, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
    }  # fmt: skip
    return Gemma3TextConfig(**{**dims, **overrides})


def gemma3_vision_config(
    vocab: int, image_token_index: int, boi_token_index: int, eoi_token_index: int, **text: Any
) -> PretrainedConfig:
    """Gemma 3 with a 1-layer SigLIP on 32x32 images (4 soft tokens per image); `text` overrides the text config."""
    from transformers import Gemma3Config

    text_config = gemma3_text_config(vocab, **{"sliding_window": 64, "max_position_embeddings": 1024, **text})
    return Gemma3Config(
        text_config=text_config.to_dict(),
        vision_config={
            "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "image_size": IMAGE_SIZE, "patch_size": 8,
        },
        mm_tokens_per_image=IMAGE_SEQ_LENGTH,
        image_token_index=image_token_index,
        boi_token_index=boi_token_index,
        eoi_token_index=eoi_token_index,
        pad_token_id=text_config.pad_token_id,
        bos_token_id=text_config.bos_token_id,
        eos_token_id=text_config.eos_token_id,
    )  # fmt: skip


def gemma4_config(vocab: int, image_token_id: int | None = None, **text: Any) -> PretrainedConfig:
    """A 2-layer Gemma 4 with small per-layer embeddings (Gemma 4's PLE) and a 1-layer vision tower.

    No audio tower: the trainer never adapts either tower. `text` overrides text dimensions (a larger
    model for memory measurements, `vocab_size` too) and the token ids (pad 0, eos 1, bos 2 unless given).
    """
    from transformers import Gemma4Config

    ids = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    text_config = {
        "vocab_size": vocab, "vocab_size_per_layer_input": vocab, "hidden_size": 32,
        "hidden_size_per_layer_input": 8, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "global_head_dim": 16,
        "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 512, **ids, **text,
    }  # fmt: skip
    vision_config = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "position_embedding_size": 64,
    }  # fmt: skip
    image = {} if image_token_id is None else dict.fromkeys(
        ("image_token_id", "boi_token_id", "eoi_token_id", "video_token_id"), image_token_id
    )  # fmt: skip
    ids = {key: text_config[key] for key in ids}
    return Gemma4Config(text_config=text_config, vision_config=vision_config, audio_config=None, **image, **ids)


def _token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    return {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }


# --- the trainer's text models -------------------------------------------------------------------------


def _corpus() -> list[str]:
    rows = [json.loads(line) for line in (DATA / "emoji.jsonl").read_text(encoding="utf-8").splitlines()]
    return ["Translate to emoji: " + r["text"] for r in rows] + [r["emoji"] for r in rows] + _SQL_SNIPPETS * 20


def _bpe(corpus: list[str], vocab_size: int, specials: list[str], **special_tokens: Any) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
        **special_tokens,
    )  # fmt: skip


def tiny_tokenizer(vocab_size: int = 600) -> PreTrainedTokenizerFast:
    """A byte-level BPE with Gemma's special tokens and chat template (ids: pad 0, eos 1, bos 2)."""
    extra = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>"]
    tokenizer = _bpe(_corpus(), vocab_size, [*GEMMA_SPECIALS, "<start_of_image>"], additional_special_tokens=extra)
    tokenizer.chat_template = trl_chat_template("gemma3")
    return tokenizer


def tiny_gemma3(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> PreTrainedModel:
    """A 2-layer Gemma 3 text model (one sliding, one full attention layer)."""
    import torch
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(gemma3_text_config(len(tokenizer), **_token_ids(tokenizer)))
    set_stop_tokens(model, tokenizer)
    return model


def tiny_gemma4(tokenizer: PreTrainedTokenizerFast, seed: int = 0, **text: int) -> PreTrainedModel:
    """A Gemma4ForConditionalGeneration, the class the W1 recipe loads.

    `google/gemma-4-31B-it` is a `gemma4` (multimodal) checkpoint, and transformers maps `gemma4` to
    Gemma4ForConditionalGeneration in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES (transformers 5.23
    models/auto/modeling_auto.py), so the recipe's AutoModelForCausalLM gets that class, vision tower
    included (Gemma4ForCausalLM is `gemma4_text` only).
    """
    import torch
    from transformers import Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    image_token = tokenizer.convert_tokens_to_ids("<start_of_image>")
    model = Gemma4ForConditionalGeneration(gemma4_config(len(tokenizer), image_token, **_token_ids(tokenizer), **text))
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


# --- Gemma 3 vision (W2, the Ray stack) ----------------------------------------------------------------


def product_rows() -> list[dict]:
    return [json.loads(line) for line in (DATA / "products.jsonl").read_text().splitlines()]


def tiny_vision_processor(image_tokens_first: bool = False) -> Any:
    """A Gemma3Processor around a small BPE tokenizer with Gemma's special and image tokens."""
    from transformers import Gemma3Processor
    from transformers.models.gemma3 import Gemma3ImageProcessorPil

    specials = IMAGE_SPECIALS + GEMMA_SPECIALS if image_tokens_first else GEMMA_SPECIALS + IMAGE_SPECIALS
    corpus = [r["description"] + " " + r["Product Name"] + " " + r["Category"] for r in product_rows()]
    corpus += ["You are an expert product description writer. Create a Short Product description <PRODUCT>"]
    image_tokens = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = _bpe(corpus * 2, 500, specials, extra_special_tokens=image_tokens)
    return Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tokenizer,
        chat_template=trl_chat_template("gemma3"),
        image_seq_length=IMAGE_SEQ_LENGTH,
    )


def tiny_vision_model(processor: Any, seed: int = 0) -> PreTrainedModel:
    """A random Gemma3ForConditionalGeneration: 2 text layers, a 1-layer SigLIP on 32x32 images."""
    import torch
    from transformers import Gemma3ForConditionalGeneration

    tok = processor.tokenizer
    torch.manual_seed(seed)
    config = gemma3_vision_config(len(tok), tok.image_token_id, tok.boi_token_id, tok.eoi_token_id, **_token_ids(tok))
    return Gemma3ForConditionalGeneration(config)


def save_tiny_vision_model(directory: str | Path) -> Path:
    processor = tiny_vision_processor()
    tiny_vision_model(processor).save_pretrained(directory)
    processor.save_pretrained(directory)
    return Path(directory)


# --- the serving tests' model folder -------------------------------------------------------------------


def build_tiny_gemma(path: Path, marker: bool = True, max_position_embeddings: int = 256) -> Path:
    """A tiny Gemma 3 text model folder with a character-level tokenizer and a Gemma-style chat template;
    with `marker`, the trainer's own completion marker and inventory (files made readable)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma3ForCausalLM

    words = [*GEMMA_SPECIALS, "\n", *(chr(c) for c in range(32, 127)), "🍌", "🥣", "😋", "🤔"]
    vocab = {w: i for i, w in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = _SERVING_CHAT_TEMPLATE
    config = gemma3_text_config(len(words), sliding_window=64, max_position_embeddings=max_position_embeddings)
    model = Gemma3ForCausalLM(config)
    model.generation_config.eos_token_id = [1, vocab["<end_of_turn>"]]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if marker:
        from trainer.export import write_completion_marker

        write_completion_marker(path, base_model="tiny-gemma", adapter=None, dtype="float32")
    return path
