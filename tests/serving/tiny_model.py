"""A tiny random Gemma 3 model folder for the serving tests: seconds to build, no Hub, a Gemma-style chat template."""

from __future__ import annotations

from pathlib import Path

_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def build_tiny_gemma(path: Path, marker: bool = True, max_position_embeddings: int = 256) -> Path:
    """A 2-layer Gemma 3 text model with a character-level tokenizer and a Gemma-style chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n"]
    words += [chr(c) for c in range(32, 127)] + ["🍌", "🥣", "😋", "🤔"]
    vocab = {w: i for i, w in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = _CHAT_TEMPLATE
    config = Gemma3TextConfig(
        vocab_size=len(words),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=max_position_embeddings,
        sliding_window=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    model = Gemma3ForCausalLM(config)
    model.generation_config.eos_token_id = [1, vocab["<end_of_turn>"]]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if marker:  # the trainer's own writer: marker + inventory, files made readable
        from trainer.export import write_completion_marker

        write_completion_marker(path, base_model="tiny-gemma", adapter=None, dtype="float32")
    return path
