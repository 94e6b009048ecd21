"""Task formatters on in-memory rows: the exact prompts, and a named error for every bad row."""

from __future__ import annotations

import pytest

from trainer.formatting import (
    EmptyFieldError,
    FormattingError,
    MissingFieldError,
    format_emoji,
    format_product_description,
    format_text_to_sql,
    formatter_for,
    prompt_messages,
    reference_text,
)
from trainer.recipe import Task

SQL_ROW = {
    "sql_prompt": "How many orders were placed in 2024?",
    "sql_context": "CREATE TABLE orders (id INT, placed_on DATE);",
    "sql": "SELECT COUNT(*) FROM orders WHERE YEAR(placed_on) = 2024;",
    "domain": "retail",
}
PRODUCT_ROW = {
    "Product Name": "Trail Mug",
    "Category": "Kitchen",
    "image": "mug.png",
    "description": "A sturdy enamel mug for camp coffee.",
}


class TestEmoji:
    def test_user_asks_for_a_translation_and_the_assistant_answers_in_emoji(self) -> None:
        assert format_emoji({"text": "I ate a banana", "emoji": "🍌"}) == {
            "messages": [
                {"role": "user", "content": "Translate to emoji: I ate a banana"},
                {"role": "assistant", "content": "🍌"},
            ]
        }

    def test_surrounding_whitespace_is_stripped(self) -> None:
        result = format_emoji({"text": "  rain \n", "emoji": " 🌧️ "})
        assert result["messages"][0]["content"] == "Translate to emoji: rain"
        assert result["messages"][1]["content"] == "🌧️"

    @pytest.mark.parametrize("field", ["text", "emoji"])
    def test_missing_field_is_named(self, field: str) -> None:
        row = {"text": "sun", "emoji": "☀️"}
        del row[field]
        with pytest.raises(MissingFieldError) as info:
            format_emoji(row)
        assert info.value.field == field
        assert info.value.reason == f"missing field {field!r}"

    @pytest.mark.parametrize("value", ["", "   ", None])
    def test_empty_or_null_emoji_is_rejected(self, value: str | None) -> None:
        with pytest.raises(FormattingError, match="'emoji'"):
            format_emoji({"text": "sun", "emoji": value})

    def test_empty_text_raises_empty_field_error(self) -> None:
        with pytest.raises(EmptyFieldError) as info:
            format_emoji({"text": "", "emoji": "☀️"})
        assert info.value.reason == "empty field 'text'"


class TestTextToSql:
    def test_system_schema_and_question_then_sql(self) -> None:
        messages = format_text_to_sql(SQL_ROW)["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant"]
        assert messages[0]["content"].startswith("You are a text to SQL query translator.")
        assert messages[0]["content"].endswith("based on the provided SCHEMA.")
        # the seed's user prompt (W1 finetune.py `user_prompt`), instruction sentence included
        assert messages[1]["content"] == (
            "Given the <USER_QUERY> and the <SCHEMA>, generate the corresponding SQL command to retrieve the "
            "desired data, considering the query's syntax, semantics, and schema constraints.\n\n"
            "<SCHEMA>\nCREATE TABLE orders (id INT, placed_on DATE);\n</SCHEMA>\n\n"
            "<USER_QUERY>\nHow many orders were placed in 2024?\n</USER_QUERY>\n"
        )
        assert messages[2]["content"] == SQL_ROW["sql"]

    @pytest.mark.parametrize("field", ["sql_prompt", "sql_context", "sql"])
    def test_each_required_field_is_checked(self, field: str) -> None:
        row = {k: v for k, v in SQL_ROW.items() if k != field}
        with pytest.raises(MissingFieldError, match=field):
            format_text_to_sql(row)


class TestProductDescription:
    def test_text_and_image_parts_and_the_image_kept_aside(self) -> None:
        result = format_product_description(PRODUCT_ROW)
        system, user, assistant = result["messages"]
        assert system["content"] == [
            {"type": "text", "text": "You are an expert product description writer for Amazon."}
        ]
        text_part, image_part = user["content"]
        # the seed's user prompt (W2 vision_train.py `user_prompt`), newlines inside the tags included
        assert text_part["text"] == (
            "Create a Short Product description based on the provided <PRODUCT> and <CATEGORY> and image.\n"
            "Only return description. The description should be SEO optimized and for a better mobile search "
            "experience.\n\n<PRODUCT>\nTrail Mug\n</PRODUCT>\n\n<CATEGORY>\nKitchen\n</CATEGORY>\n"
        )
        assert image_part == {"type": "image"}
        assert assistant["content"] == [{"type": "text", "text": PRODUCT_ROW["description"]}]
        assert result["images"] == ["mug.png"]

    def test_missing_image_is_named(self) -> None:
        with pytest.raises(MissingFieldError) as info:
            format_product_description({**PRODUCT_ROW, "image": None})
        assert info.value.field == "image"

    def test_empty_description_is_rejected(self) -> None:
        with pytest.raises(EmptyFieldError, match="description"):
            format_product_description({**PRODUCT_ROW, "description": " "})


def test_every_task_has_a_formatter() -> None:
    assert {formatter_for(task) for task in Task} == {format_emoji, format_text_to_sql, format_product_description}


def test_prompt_and_reference_split_a_conversation() -> None:
    conversation = format_product_description(PRODUCT_ROW)
    assert [m["role"] for m in prompt_messages(conversation)] == ["system", "user"]
    assert reference_text(conversation) == PRODUCT_ROW["description"]
    assert reference_text(format_emoji({"text": "x", "emoji": "🍕"})) == "🍕"
