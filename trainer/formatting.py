"""Task formatters: one dataset row in, one chat conversation out.

Each formatter is a pure function `row -> {"messages": [...]}` (plus `"images"` for the vision task) in trl's
conversational format, so the same recipe trains on any chat template. The prompts are the three source
workflows' own, word for word (tests/trainer/test_formatting.py holds the seeds' text).

Decisions:
- A missing or empty field raises `FormattingError` naming it (`.field`, e.g. `messages[2].role`); the data
  loader counts, skips and reports such rows (file, row, field) instead of crashing. No tokenisation here.
- Turns keep string content without images and become content parts (text, image) when the task or dataset
  has images, so all rows share one Arrow schema; images travel in `images`, in the parts' order (trl's way).
- The standard formats (messages, prompt-completion, columns) become the same conversation, so the loss is
  masked the one way (trainer/train.py `choose_loss_mode`): a prompt-completion row has exactly one assistant
  turn, its completion (trl's prompt-completion format never trains the prompt); plain strings become one user
  and one assistant turn, so the model is trained on the chat template it is served with (vLLM applies it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from trainer.recipe import CHAT_ROLES, ChatFields, ColumnsSpec, DataFormat, RowsSpec, Task

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
    """A row that cannot become a training example; `reason` is the short label used in skip summaries.

    `field` names the part of the row it is about (`messages[1].content`), `detail` says more."""

    def __init__(self, reason: str, detail: str = "", field: str | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail, self.field = reason, detail, field


class MissingFieldError(FormattingError):
    def __init__(self, field: str, row: Row) -> None:
        super().__init__(f"missing field {field!r}", f"row has {sorted(row)}", field)


class EmptyFieldError(FormattingError):
    def __init__(self, field: str) -> None:
        super().__init__(f"empty field {field!r}", field=field)


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


def row_formatter(spec: RowsSpec, has_images: bool = False) -> Callable[[Row], Conversation]:
    """The formatter of `data.format`; `has_images`: the dataset has an `images` column (content becomes parts)."""
    if spec.task is not None:
        return FORMATTERS[spec.task]
    if spec.format is DataFormat.MESSAGES:
        chat = spec.chat
        return lambda row: format_messages(row, has_images, chat)
    if spec.format is DataFormat.PROMPT_COMPLETION:
        return lambda row: format_prompt_completion(row, has_images)
    assert spec.columns is not None  # DataSpec requires it for format: columns
    columns = spec.columns
    return lambda row: format_columns(row, columns)


# --------------------------------------------------------------------------------------
# The standard formats: trl's conversational and prompt-completion rows, and a column mapping

ROLES = CHAT_ROLES
TRL_CHAT = ChatFields()
SHAREGPT = {"field_messages": "conversations", "message_property_mappings": {"role": "from", "content": "value"}}


def format_messages(row: Row, has_images: bool = False, chat: ChatFields = TRL_CHAT) -> Conversation:
    """trl's conversational row: `messages` (a list of {role, content}), optional `images` (one per image part).

    `chat`: the row's own names (`data.field_messages`, `data.message_property_mappings`, `data.roles`), e.g.
    ShareGPT's `conversations` of {from: human|gpt|system, value}; the turns come out in trl's names."""
    if row.get(chat.messages) is None:
        if chat_fields_of(row) == SHAREGPT and chat.messages != SHAREGPT["field_messages"]:
            raise FormattingError(
                f"missing field {chat.messages!r}",
                f"row has {sorted(row)}: ShareGPT rows (conversations of {{from, value}}); read them with "
                "data.field_messages: conversations and data.message_property_mappings: {role: from, content: value}",
                chat.messages,
            )
        raise MissingFieldError(chat.messages, row)
    turns = _turns(row[chat.messages], chat.messages, chat)
    _require_answer(turns, chat.messages)
    return _conversation(turns, row, has_images)


def chat_fields_of(row: Row) -> dict[str, Any] | None:
    """The chat keys a row's fields say (`data.field_messages`, `data.message_property_mappings`): {} for trl's
    `messages` of {role, content}, ShareGPT's for `conversations` of {from, value}; None when it is neither."""
    for field in ("messages", "conversations"):
        turns = row.get(field)
        if not isinstance(turns, list | tuple) or not turns or not isinstance(turns[0], Mapping):
            continue
        keys = set(turns[0])
        mapped = {} if field == "messages" else {"field_messages": field}
        if {"role", "content"} <= keys:
            return mapped
        if {"from", "value"} <= keys:
            return {**mapped, "message_property_mappings": {"role": "from", "content": "value"}}
    return None


def format_prompt_completion(row: Row, has_images: bool = False) -> Conversation:
    """trl's prompt-completion row: two strings, or two lists of turns (the completion: one assistant turn)."""
    for name in ("prompt", "completion"):
        if row.get(name) is None:
            raise MissingFieldError(name, row)
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        turns = [
            {"role": "user", "content": _content(require_text(row, "prompt"), "prompt")},
            {"role": "assistant", "content": _content(require_text(row, "completion"), "completion")},
        ]
        return _conversation(turns, row, has_images)
    if isinstance(prompt, str) or isinstance(completion, str):
        raise FormattingError(
            "prompt and completion differ in kind",
            "both are strings, or both are lists of {role, content} turns",
            "prompt" if isinstance(prompt, str) else "completion",
        )
    before, answer = _turns(prompt, "prompt"), _turns(completion, "completion")
    for i, turn in enumerate(before):
        if turn["role"] == "assistant":
            raise FormattingError(
                "assistant turn in prompt",
                "prompt-completion trains the completion only; for a multi-turn conversation whose every assistant "
                "turn is trained use data.format: messages",
                f"prompt[{i}].role",
            )
    if len(answer) != 1 or answer[0]["role"] != "assistant":
        raise FormattingError(
            "completion is not one assistant turn",
            f"got roles {[turn['role'] for turn in answer]}",
            "completion",
        )
    _require_answer([*before, *answer], "prompt")
    return _conversation([*before, *answer], row, has_images)


def format_columns(row: Row, columns: ColumnsSpec) -> Conversation:
    """A flat row through `data.columns`: [system,] user = the prompt template filled, assistant = the answer."""
    values = {name: require_text(row, name) for name in columns.needed}
    turns = [] if columns.system is None else [{"role": "system", "content": columns.system.format_map(values)}]
    turns.append({"role": "user", "content": columns.prompt.format_map(values)})
    turns.append({"role": "assistant", "content": values[columns.answer]})
    return {"messages": turns}


def _turns(value: Any, field: str, chat: ChatFields = TRL_CHAT) -> list[dict[str, Any]]:
    """Validated turns in trl's names: each a {role, content} with a known role and non-empty content (text or
    parts). `chat` says the keys the row's turns use and what their role names mean."""
    shape = f"{{{chat.role}, {chat.content}}}"
    if not isinstance(value, list | tuple) or not value:
        raise FormattingError("not a list of turns", f"a non-empty list of {shape}", field)
    turns = []
    for i, turn in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(turn, Mapping):
            raise FormattingError(f"turn is not a {shape} mapping", f"got {type(turn).__name__}", where)
        name, content = turn.get(chat.role), turn.get(chat.content)
        role = chat.role_of(name)
        if role is None:
            aliases = [n for n, _ in chat.names if n not in ROLES]
            raise FormattingError(
                f"unknown role {name!r}",
                f"use one of {list(ROLES)}{' or ' + ', '.join(aliases) if aliases else ''}; another name: map it "
                "in data.roles",
                f"{where}.{chat.role}",
            )
        if role == "system" and (i > 0 or field == "completion"):
            raise FormattingError(
                "system turn not first", "a system prompt opens the conversation", f"{where}.{chat.role}"
            )
        turns.append({"role": role, "content": _content(content, f"{where}.{chat.content}")})
    return turns


def _content(content: Any, field: str) -> list[dict[str, Any]]:
    """Content as a list of parts ({type: text, text} / {type: image}); empty text is an empty turn."""
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list | tuple):
        raise FormattingError("content is not text", "a string, or a list of {type: text|image} parts", field)
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str) and part["text"].strip():
            parts.append(_text_part(part["text"]))
        elif kind == "image":
            parts.append({"type": "image"})
        elif kind != "text":
            raise FormattingError("unknown content part", f"got {part!r}; parts are {{type: text|image}}", field)
    if not parts:
        raise FormattingError("empty turn", "the turn has no text", field)
    return parts


def _require_answer(turns: list[dict[str, Any]], field: str) -> None:
    if turns[-1]["role"] != "assistant":
        raise FormattingError("last turn is not the assistant's", "a row ends with the answer to train on", field)
    if not any(turn["role"] == "user" for turn in turns):
        raise FormattingError("no user turn", "the assistant answers a user turn", field)


def _conversation(turns: list[dict[str, Any]], row: Row, has_images: bool) -> Conversation:
    """String content for a text dataset, parts plus `images` for a dataset with an images column."""
    images = row.get("images")
    images = [] if images is None else list(images)
    placeholders = sum(part["type"] == "image" for turn in turns for part in turn["content"])
    if placeholders != len(images):
        raise FormattingError(
            "image count differs from image parts",
            f"{placeholders} {{type: image}} parts, {len(images)} images",
            "images",
        )
    if has_images:
        return {"messages": turns, "images": images}
    if placeholders:
        raise FormattingError("image part without an images column", "add the images to the row", "messages")
    as_text = [{"role": t["role"], "content": "".join(p["text"] for p in t["content"])} for t in turns]
    return {"messages": as_text}


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
