"""The vision collator: exactly the pad and image tokens (and, by default, the prompt) carry no loss.

Why it matters: a label on an image soft token asks the model to predict image placeholders,
and a magic id like 262144 silently stops matching when the vocabulary changes. Here the ids
come from a tiny Gemma 3 processor built on this machine (no Hub), including one whose image
tokens sit at other ids, and the masks are checked position by position.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import (
    IMAGE_SEQ_LENGTH,
    IMAGE_SIZE,
    IMAGE_SPECIALS,
    product_rows,
    tiny_vision_model,
    tiny_vision_processor,
)
from trainer.collators import IGNORE_INDEX, VisionSFTCollator, image_token_ids, masked_token_ids
from trainer.formatting import format_product_description

DATA = Path(__file__).resolve().parents[2] / "trainer" / "samples"


def examples(n: int = 3) -> list[dict]:
    from PIL import Image

    out = []
    for row in product_rows()[:n]:
        conversation = format_product_description(row)
        conversation["images"] = [Image.open(DATA / image) for image in conversation["images"]]
        out.append(conversation)
    return out


@pytest.fixture(scope="module")
def processor():
    return tiny_vision_processor()


@pytest.fixture(scope="module")
def batch_and_ids(processor):
    collator = VisionSFTCollator(processor, mask_prompt=False)
    return collator(examples(3)), processor.tokenizer


class TestTokenIds:
    def test_ids_come_from_the_processor(self, processor):
        tok = processor.tokenizer
        assert image_token_ids(processor) == {tok.image_token_id, tok.boi_token_id, tok.eoi_token_id}
        assert masked_token_ids(processor) == {tok.image_token_id, tok.boi_token_id, tok.eoi_token_id, tok.pad_token_id}
        assert tok.convert_ids_to_tokens(sorted(image_token_ids(processor))) == sorted(
            IMAGE_SPECIALS, key=tok.convert_tokens_to_ids
        )

    def test_other_vocabulary_other_ids(self):
        moved = tiny_vision_processor(image_tokens_first=True)
        tok = moved.tokenizer
        assert image_token_ids(moved) == {0, 1, 2} == {tok.boi_token_id, tok.eoi_token_id, tok.image_token_id}
        assert tok.pad_token_id not in image_token_ids(moved)


class TestLabelsWithoutPromptMasking:
    def test_masked_exactly_where_pad_or_image_tokens_are(self, batch_and_ids):
        batch, tok = batch_and_ids
        ids, labels = batch["input_ids"], batch["labels"]
        special = {tok.pad_token_id, tok.image_token_id, tok.boi_token_id, tok.eoi_token_id}
        expected_masked = sum(int(i) in special for i in ids.flatten())
        assert int((labels == IGNORE_INDEX).sum()) == expected_masked
        for row in range(ids.shape[0]):
            for pos in range(ids.shape[1]):
                token = int(ids[row, pos])
                if token in special or batch["attention_mask"][row, pos] == 0:
                    assert labels[row, pos] == IGNORE_INDEX, (row, pos, token)
                else:
                    assert labels[row, pos] == token, (row, pos, token)

    def test_image_token_counts(self, batch_and_ids):
        batch, tok = batch_and_ids
        ids = batch["input_ids"]
        for row in range(ids.shape[0]):
            assert int((ids[row] == tok.image_token_id).sum()) == IMAGE_SEQ_LENGTH
            assert int((ids[row] == tok.boi_token_id).sum()) == 1 and int((ids[row] == tok.eoi_token_id).sum()) == 1
        assert batch["pixel_values"].shape == (3, 3, IMAGE_SIZE, IMAGE_SIZE)

    def test_padding_is_masked_and_rows_differ_in_length(self, batch_and_ids):
        batch, tok = batch_and_ids
        pads = batch["attention_mask"] == 0
        assert int(pads.sum()) > 0, "the sample rows should need padding"
        assert bool((batch["labels"][pads] == IGNORE_INDEX).all())
        assert bool((batch["input_ids"][pads] == tok.pad_token_id).all())

    def test_single_bos(self, batch_and_ids):
        batch, tok = batch_and_ids
        for row in range(batch["input_ids"].shape[0]):
            assert int((batch["input_ids"][row] == tok.bos_token_id).sum()) == 1


class TestAssistantOnlyLoss:
    @pytest.mark.parametrize("padding_side", ["right", "left"])
    def test_only_the_answer_carries_loss(self, processor, padding_side):
        processor.tokenizer.padding_side = padding_side
        try:
            rows = examples(3)
            batch = VisionSFTCollator(processor)(rows)
        finally:
            processor.tokenizer.padding_side = "right"
        tok = processor.tokenizer
        for row, example in enumerate(rows):
            kept = batch["labels"][row][batch["labels"][row] != IGNORE_INDEX].tolist()
            answer = example["messages"][-1]["content"][0]["text"]
            assert tok.decode(kept) == answer + "<end_of_turn>\n"

    @pytest.mark.parametrize("padding_side", ["right", "left"])
    def test_one_processor_call_per_batch_masks_what_the_prompt_pass_masked(self, processor, padding_side):
        """Why: W2's collator ran the processor (and its image processor) twice per batch in the training
        process; the prompt's length now comes from the answer's tokens, with the same mask as the former
        second pass (the prompt processed with its images)."""
        import torch

        calls = []

        class Counting:
            def __init__(self, inner):
                self.inner = inner

            def __call__(self, *args, **kwargs):
                calls.append(kwargs.get("images") is not None)
                return self.inner(*args, **kwargs)

            def __getattr__(self, name):
                return getattr(self.inner, name)

        processor.tokenizer.padding_side = padding_side
        try:
            rows = examples(3)
            collator = VisionSFTCollator(Counting(processor))
            batch = collator(rows)
            assert calls == [True], f"processor calls per batch: {calls}"
            # the former second pass, as reference: the prompts processed with their images
            images = [[image for image in row.get("images") or []] for row in rows]
            prompts = collator._encode([row["messages"][:-1] for row in rows], images, prompt=True)
        finally:
            processor.tokenizer.padding_side = "right"
        for row in range(len(rows)):
            real = batch["attention_mask"][row].bool()
            masked = (batch["labels"][row][real] == IGNORE_INDEX).tolist()
            prompt_length = int(prompts["attention_mask"][row].sum())
            assert masked[:prompt_length] == [True] * prompt_length
            assert not any(masked[prompt_length:]), "an answer token lost its label"
        assert torch.equal(
            batch["labels"] != IGNORE_INDEX, (batch["labels"] != IGNORE_INDEX) & batch["attention_mask"].bool()
        )

    def test_forward_pass_gives_a_finite_loss(self, processor):
        import torch

        model = tiny_vision_model(processor)
        batch = VisionSFTCollator(processor)(examples(2))
        loss = model(**batch).loss
        assert torch.isfinite(loss) and loss.item() > 0

    def test_every_w2_adapter_gets_a_gradient(self, processor):
        """DDP runs W2 without `find_unused_parameters`: every trainable parameter must get a gradient.

        The tiny SigLIP keeps its attention-pooling head (`vision_use_head`), which Gemma 3 never uses."""
        from peft import get_peft_model

        from trainer.modeling import lora_config
        from trainer.recipe import load_recipe

        model = tiny_vision_model(processor)
        assert any(".vision_tower.head." in name for name, _ in model.named_parameters())
        peft_model = get_peft_model(model, lora_config(load_recipe("product-descriptions-gemma3-4b").lora, model))
        peft_model(**VisionSFTCollator(processor)(examples(2))).loss.backward()
        trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
        assert any("vision_tower" in n for n in trainable)
        assert [n for n, p in trainable.items() if p.grad is None] == []

    def test_conversation_without_answer_is_rejected(self, processor):
        broken = examples(1)
        broken[0]["messages"] = broken[0]["messages"][:-1]
        with pytest.raises(ValueError, match="assistant"):
            VisionSFTCollator(processor)(broken)

    def test_overlong_batch_raises(self, processor):
        with pytest.raises(ValueError, match="max_length"):
            VisionSFTCollator(processor, max_length=16)(examples(1))


class TestProductSample:
    def test_rows_and_images(self):
        from PIL import Image

        rows = product_rows()
        assert 24 <= len(rows) <= 60
        total = 0
        for row in rows:
            assert {"Product Name", "Category", "description", "image"} <= set(row)
            path = DATA / row["image"]
            assert path.parent == DATA / "products" and path.suffix == ".png"
            with Image.open(path) as image:
                assert image.size == (64, 64)
            total += path.stat().st_size
        assert total < 300_000
        assert len({r["Product Name"] for r in rows}) == len(rows)

    def test_every_row_formats(self):
        for row in product_rows():
            conversation = format_product_description(row)
            assert conversation["images"] == [row["image"]]
