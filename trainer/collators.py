"""Batches for vision SFT (Gemma 3 image + text → text): chat template, images, labels.

    from trainer.collators import VisionSFTCollator
    collator = VisionSFTCollator(processor, max_length=1024)
    batch = collator([{"messages": [...], "images": [PIL.Image]}, ...])   # input_ids, pixel_values, labels, …

Decisions (docs/trainer.md#vision-batches):
- The processor does the work: the chat template renders, one `processor(text, images)` call per batch expands
  images into soft tokens and pixel_values; no special tokens added (the text starts with `<bos>`).
- Labels mask padding and every image token, by ids read from the processor, never typed in; the prompt is
  masked too (`mask_prompt=True`) when the rendered prompt is a prefix of the full text, else the row keeps it
  and a warning says so.
- No truncation: `max_length` counts the image's soft tokens, `fits(example)` lets the trainer drop longer rows,
  and a longer batch raises.
It opens image paths only as PIL strings and does not support pan-and-scan crops.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
_IMAGE_ID_ATTRIBUTES = ("image_token_id", "boi_token_id", "eoi_token_id")
_IMAGE_TOKEN_ATTRIBUTES = ("image_token", "boi_token", "eoi_token")


def image_token_ids(processor: Any) -> set[int]:
    """Every id that stands for image content in this processor's vocabulary (soft, begin, end tokens)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    unk = getattr(tokenizer, "unk_token_id", None)
    ids: set[int] = set()
    for owner in (processor, tokenizer):
        for attr in _IMAGE_ID_ATTRIBUTES:
            value = getattr(owner, attr, None)
            if isinstance(value, int):
                ids.add(value)
        for attr in _IMAGE_TOKEN_ATTRIBUTES:
            token = getattr(owner, attr, None)
            if isinstance(token, str) and token:
                token_id = tokenizer.convert_tokens_to_ids(token)
                if isinstance(token_id, int):
                    ids.add(token_id)
    extra = getattr(processor, "image_token_ids", None)
    if isinstance(extra, Iterable):
        ids.update(int(i) for i in extra)
    ids.discard(unk)  # a token the vocabulary does not have maps to unk: never mask real unknown text by it
    if not ids:
        raise ValueError(f"{type(processor).__name__} exposes no image token ids (image_token_id, boi_token, …)")
    return ids


def masked_token_ids(processor: Any) -> set[int]:
    """Ids that never carry loss: the image tokens plus the pad token."""
    tokenizer = getattr(processor, "tokenizer", processor)
    ids = image_token_ids(processor)
    if tokenizer.pad_token_id is not None:
        ids.add(int(tokenizer.pad_token_id))
    return ids


def _as_rgb(image: Any) -> Any:
    from PIL import Image

    if isinstance(image, str):
        image = Image.open(image)
    return image.convert("RGB") if getattr(image, "mode", "RGB") != "RGB" else image


def _prompt_messages(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("each conversation must end with the assistant's answer")
    return list(messages[:-1])


class VisionSFTCollator:
    """Callable collator for trl/transformers Trainers (set `remove_unused_columns=False`)."""

    def __init__(self, processor: Any, max_length: int | None = None, mask_prompt: bool = True) -> None:
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.max_length = max_length
        self.mask_prompt = mask_prompt
        self.masked_ids = sorted(masked_token_ids(processor))

    def _render(self, conversations: Sequence[Sequence[Mapping[str, Any]]], prompt: bool) -> list[str]:
        return [
            self.processor.apply_chat_template(list(c), tokenize=False, add_generation_prompt=prompt)
            for c in conversations
        ]

    def _encode(self, conversations: Sequence[Sequence[Mapping[str, Any]]], images: list[list[Any]], prompt: bool):
        return self._process(self._render(conversations, prompt), images)

    def _process(self, texts: list[str], images: list[list[Any]]) -> Any:
        has_images = any(images)
        return self.processor(
            text=texts,
            images=images if has_images else None,
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )

    def sequence_length(self, example: Mapping[str, Any]) -> int:
        """Tokens of this row alone as the model sees it: chat template, then each image expanded by the processor."""
        images = [[_as_rgb(image) for image in example.get("images") or []]]
        return int(self._encode([example["messages"]], images, prompt=False)["input_ids"].shape[1])

    def fits(self, example: Mapping[str, Any]) -> bool:
        """True when the row's processed sequence is within `max_length` (always, without a limit)."""
        return self.max_length is None or self.sequence_length(example) <= self.max_length

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        import torch

        conversations = [example["messages"] for example in examples]
        images = [[_as_rgb(image) for image in example.get("images") or []] for example in examples]
        texts = self._render(conversations, prompt=False)
        batch = self._process(texts, images)  # the batch's one processor call (images included)
        input_ids = batch["input_ids"]
        if self.max_length is not None and input_ids.shape[1] > self.max_length:
            raise ValueError(
                f"a batch is {input_ids.shape[1]} tokens long (image soft tokens included), over "
                f"max_length={self.max_length}: drop longer rows first (VisionSFTCollator.fits)"
            )
        labels = input_ids.clone()
        labels[torch.isin(input_ids, torch.tensor(self.masked_ids))] = IGNORE_INDEX
        if "attention_mask" in batch:
            labels[batch["attention_mask"] == 0] = IGNORE_INDEX
        if self.mask_prompt:
            self._mask_prompts(labels, batch, conversations, texts)
        batch["labels"] = labels
        return dict(batch)

    def _mask_prompts(self, labels: torch.Tensor, batch: Any, conversations: Sequence[Any], texts: list[str]):
        """Mask each row's prompt: the real tokens before its answer, the answer counted by the tokenizer alone.

        The prompt (rendered with the generation prompt) must be a prefix of the full text; the answer that
        follows has no image, so the tokenizer gives its tokens without a second processor (and image) pass,
        and they must be the last real tokens of the row."""
        prompts = self._render([_prompt_messages(c) for c in conversations], prompt=True)
        for row in range(labels.shape[0]):
            full = _real_tokens(batch, row)
            answer = texts[row][len(prompts[row]) :] if texts[row].startswith(prompts[row]) else None
            answer_ids = self.tokenizer(answer, add_special_tokens=False)["input_ids"] if answer else []
            if not answer_ids or len(answer_ids) >= len(full) or full[-len(answer_ids) :] != answer_ids:
                log.warning("row %d: the prompt is not a prefix of the conversation; its prompt stays in the loss", row)
                continue
            start = _first_real_position(batch, row)
            labels[row, start : start + len(full) - len(answer_ids)] = IGNORE_INDEX


def _real_tokens(batch: Any, row: int) -> list[int]:
    ids = batch["input_ids"][row]
    if "attention_mask" in batch:
        ids = ids[batch["attention_mask"][row].bool()]
    return ids.tolist()


def _first_real_position(batch: Any, row: int) -> int:
    """0 with right padding; the number of pads with left padding."""
    if "attention_mask" not in batch:
        return 0
    return int(batch["attention_mask"][row].int().argmax())
