"""Task formatters: one dataset row in, one chat conversation out.

Each formatter is a pure function `row -> {"messages": [...]}` (plus `"images"` for the
vision task) in the conversational format trl's `SFTTrainer` understands, so the same
recipe trains on any chat template. The prompts are the three source workflows' own, word for word
(tests/trainer/test_formatting.py holds the seeds' text).

Decisions:
- A row with a missing or empty field raises `FormattingError` naming the field; the data
  loader (trainer/data.py) counts, skips and reports such rows instead of crashing.
- Every message of the vision task uses a list of content parts (text or image), so all rows
  share one Arrow schema; the image itself travels in `images`, in the order of the image
  parts, which is what trl's vision collator expects.
- No tokenisation here: length limits need a tokenizer and are checked by the data loader.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from trainer.recipe import Task

Row = Mapping[str, Any]
Conversation = dict[str, Any]

EMOJI_PROMPT = "Translate to emoji: {text}"
TEXT_TO_SQL_SYSTEM = (
    "You are a text to SQL query translator. Users will ask you questions in English and you will generate "
    "a SQL query based on the provided SCHEMA."
)
# The seed's user prompt, instruction sentence included (the model is trained and evaluated on it).
TEXT_TO_SQL_PROMPT = (
    "Given the <USER_QUERY> and the <SCHEMA>, generate the corresponding SQL command to retrieve the desired data, "
    "considering the query's syntax, semantics, and schema constraints.\n\n"
    "<SCHEMA>\n{sql_context}\n</SCHEMA>\n\n<USER_QUERY>\n{sql_prompt}\n</USER_QUERY>\n"
)
PRODUCT_SYSTEM = "You are an expert product description writer for Amazon."
# The seed's prompt, with its newlines inside the tags.
PRODUCT_PROMPT = (
    "Create a Short Product description based on the provided <PRODUCT> and <CATEGORY> and image.\n"
    "Only return description. The description should be SEO optimized and for a better mobile search experience.\n\n"
    "<PRODUCT>\n{product}\n</PRODUCT>\n\n<CATEGORY>\n{category}\n</CATEGORY>\n"
)


class FormattingError(ValueError):
    """A row that cannot become a training example; `reason` is the short label used in skip summaries."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class MissingFieldError(FormattingError):
    def __init__(self, field: str, row: Row) -> None:
        super().__init__(f"missing field {field!r}", f"row has {sorted(row)}")
        self.field = field


class EmptyFieldError(FormattingError):
    def __init__(self, field: str) -> None:
        super().__init__(f"empty field {field!r}")
        self.field = field


def require_text(row: Row, field: str) -> str:
    """The stripped text of `row[field]`; raises when the field is missing, null or blank."""
    if field not in row or row[field] is None:
        raise MissingFieldError(field, row)
    value = row[field]
    if not isinstance(value, str):
        value = str(value)
    value = value.strip()
    if not value:
        raise EmptyFieldError(field)
    return value


def format_emoji(row: Row) -> Conversation:
    """Text2Emoji (`text`, `emoji`): the user asks for a translation, the assistant answers in emoji only."""
    text, emoji = require_text(row, "text"), require_text(row, "emoji")
    return {
        "messages": [
            {"role": "user", "content": EMOJI_PROMPT.format(text=text)},
            {"role": "assistant", "content": emoji},
        ]
    }


def format_text_to_sql(row: Row) -> Conversation:
    """Gretel text-to-SQL (`sql_prompt`, `sql_context`, `sql`): schema and question in, one SQL query out."""
    prompt = TEXT_TO_SQL_PROMPT.format(
        sql_context=require_text(row, "sql_context"), sql_prompt=require_text(row, "sql_prompt")
    )
    return {
        "messages": [
            {"role": "system", "content": TEXT_TO_SQL_SYSTEM},
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": require_text(row, "sql")},
        ]
    }


def format_product_description(row: Row) -> Conversation:
    """Amazon product descriptions (`Product Name`, `Category`, `image`, `description`): image + text in, prose out."""
    if row.get("image") is None:
        raise MissingFieldError("image", row)
    prompt = PRODUCT_PROMPT.format(product=require_text(row, "Product Name"), category=require_text(row, "Category"))
    return {
        "messages": [
            {"role": "system", "content": [_text_part(PRODUCT_SYSTEM)]},
            {"role": "user", "content": [_text_part(prompt), {"type": "image"}]},
            {"role": "assistant", "content": [_text_part(require_text(row, "description"))]},
        ],
        "images": [row["image"]],
    }


def _text_part(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


FORMATTERS: dict[Task, Callable[[Row], Conversation]] = {
    Task.EMOJI: format_emoji,
    Task.TEXT_TO_SQL: format_text_to_sql,
    Task.PRODUCT_DESCRIPTION: format_product_description,
}


def formatter_for(task: Task | str) -> Callable[[Row], Conversation]:
    return FORMATTERS[Task(task)]


def prompt_messages(conversation: Conversation) -> list[dict[str, Any]]:
    """The conversation without its final assistant turn: what the model sees at generation time."""
    messages = conversation["messages"]
    if not messages or messages[-1]["role"] != "assistant":
        raise FormattingError("no assistant turn", "the conversation must end with the assistant's answer")
    return messages[:-1]


def reference_text(conversation: Conversation) -> str:
    """The text of the final assistant turn (the reference answer)."""
    content = conversation["messages"][-1]["content"]
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content if part.get("type") == "text")
