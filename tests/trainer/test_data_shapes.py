"""The shapes of data people bring from axolotl and trl (docs/own-data.md): chat rows whose fields and roles have
other names (ShareGPT), several sources in one run (a mixture), a held-out file of their choosing, and empty or
tiny inputs. Every test writes its own rows; training runs use the tiny Gemma 3 (tests/tiny_models.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from trainer.data import (
    DataError,
    check,
    check_first_rows,
    held_out_identity,
    prepare_datasets,
    read_rows,
    spec_for_file,
)
from trainer.recipe import (
    REPO_ROOT,
    DataSpec,
    RecipeError,
    SourceSpec,
    load_recipe,
    mixture_counts,
    recipe_sha256,
    step_plan,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

TEMPLATE = "trainer/recipes/templates/my-data-local.yaml"
SHAREGPT_KEYS = {"field_messages": "conversations", "message_property_mappings": {"role": "from", "content": "value"}}
CATEGORIES = ("billing", "technical", "account", "shipping")


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _ticket(i: int) -> tuple[str, str]:
    return f"Ticket {i}: my order number {i} has a problem", CATEGORIES[i % 4]


def sharegpt_rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    """ShareGPT rows as exported by the tools that write it: `conversations` of {from: system|human|gpt, value}."""
    rows = []
    for i in range(start, start + n):
        ticket, category = _ticket(i)
        turns = [("system", "Triage the ticket."), ("human", ticket), ("gpt", category)]
        rows.append({"id": f"t{i}", "conversations": [{"from": who, "value": text} for who, text in turns]})
    return rows


def messages_rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [
        {"messages": [{"role": "user", "content": _ticket(i)[0]}, {"role": "assistant", "content": _ticket(i)[1]}]}
        for i in range(start, start + n)
    ]


def prompt_completion_rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"prompt": _ticket(i)[0], "completion": _ticket(i)[1]} for i in range(start, start + n)]


def _number(prompt: str) -> int:
    """The ticket number in a prompt: `Ticket 103: ...` -> 103."""
    return int(prompt.removeprefix("Triage: ").split()[1].rstrip(":"))


def _source_of(prompt: str) -> int:
    """Which of the test's sources wrote a prompt: their ticket numbers start at 0, 100 and 200."""
    return _number(prompt) // 100


def _recipe_file(tmp_path: Path, data: str) -> Path:
    """The local template with its data section replaced by `data` (YAML lines under `data:`)."""
    head, rest = (REPO_ROOT / TEMPLATE).read_text().split("\ndata:\n", 1)
    path = tmp_path / "mine.yaml"
    path.write_text(f"{head}\ndata:\n{data}{rest[rest.index(chr(10) + 'training:' + chr(10)) :]}")
    return path


BATCH_2 = ["training.per_device_train_batch_size=2"]


# --------------------------------------------------------------------------------------
# 1. Chat rows whose fields and roles have other names


def test_sharegpt_rows_become_trl_conversations(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "sharegpt.jsonl", sharegpt_rows(6))
    split = prepare_datasets(DataSpec(format="messages", path=str(path), eval_rows=2, **SHAREGPT_KEYS))
    assert len(split.train) == 4 and split.eval is not None and len(split.eval) == 2
    for row in [*split.train, *split.eval]:
        roles = [turn["role"] for turn in row["messages"]]
        assert roles == ["system", "user", "assistant"] and row["messages"][2]["content"] in CATEGORIES


def test_the_role_names_are_the_recipes_to_map(tmp_path: Path) -> None:
    """`data.roles` as axolotl spells it ({target: [names in the rows]}); a role already named as the model knows it
    stays itself, and a name nobody mapped is an error naming the row's own key."""
    rows = [
        {"chat": [{"speaker": "customer", "text": t}, {"speaker": "agent", "text": c}]}
        for t, c in map(_ticket, range(3))
    ]
    path = _jsonl(tmp_path / "chat.jsonl", rows)
    keys = {
        "field_messages": "chat",
        "message_property_mappings": {"role": "speaker", "content": "text"},
        "roles": {"user": ["customer"], "assistant": ["agent"]},
    }
    split = prepare_datasets(DataSpec(path=str(path), **keys))  # the chat keys imply format: messages
    assert [t["role"] for t in split.train[0]["messages"]] == ["user", "assistant"]

    _jsonl(path, [*rows, {"chat": [{"speaker": "customer", "text": "hi"}, {"speaker": "bot", "text": "hello"}]}])
    with pytest.raises(DataError) as info:
        prepare_datasets(DataSpec(path=str(path), **keys))
    assert (
        "chat.jsonl row 4 (line 4), field chat[1].speaker: unknown role 'bot' (use one of ['system', 'user', "
        in str(info.value)
    )
    assert "customer, agent; another name: map it in data.roles" in str(info.value)
    assert "[data.format=messages]" in str(info.value)


def test_the_chat_keys_are_checked_when_the_recipe_loads() -> None:
    with pytest.raises(ValueError, match=r"data\.roles names \['bot'\]: the keys are the roles the model knows"):
        DataSpec(path="x.jsonl", roles={"bot": ["gpt"]})
    with pytest.raises(ValueError, match=r"data\.roles: 'gpt' is named for both user and assistant"):
        DataSpec(path="x.jsonl", roles={"user": ["gpt"], "assistant": ["gpt"]})
    with pytest.raises(
        ValueError, match=r"data\.message_property_mappings=\{'speaker': 'from'\}: map \['role', 'content'\]"
    ):
        DataSpec(path="x.jsonl", message_property_mappings={"speaker": "from"})
    with pytest.raises(ValueError, match=r"data\.field_messages maps chat rows but data\.format=prompt-completion"):
        DataSpec(format="prompt-completion", path="x.jsonl", field_messages="conversations")


def test_a_sharegpt_row_read_as_trl_messages_says_how_to_map_it(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "sharegpt.jsonl", sharegpt_rows(3))
    with pytest.raises(DataError) as info:
        prepare_datasets(DataSpec(format="messages", path=str(path)))
    text = str(info.value)
    assert text.startswith(
        f"{path} row 1 (line 1), field messages: missing field 'messages' (row has ['conversations', 'id']: ShareGPT rows"
    )
    assert "data.field_messages: conversations and data.message_property_mappings: {role: from, content: value}" in text


def test_the_data_check_and_the_demo_detect_sharegpt_by_its_fields(tmp_path: Path) -> None:
    from demo.pipeline import _parse_args, _recipe_and_data, build_recipe

    path = _jsonl(tmp_path / "sharegpt.jsonl", sharegpt_rows(24))
    out = check(str(path))
    assert out.splitlines()[0] == (
        f"ok: 24 rows in {path} (data.format=messages, turns in conversations as {{role: from, content: value}}); "
        "the first 24 checked"
    )
    assert (
        "in a recipe: data: {format: messages, field_messages: conversations, message_property_mappings: {role: from, content: value}}"
        in out
    )
    assert spec_for_file(str(path), None).chat.messages == "conversations"

    opts = _parse_args(["--data", str(path)])
    _, overrides = _recipe_and_data(opts)
    assert overrides[1:] == [
        "data.format=messages",
        "data.field_messages=conversations",
        'data.message_property_mappings={"role": "from", "content": "value"}',
    ]
    data = build_recipe(opts).data
    assert data.path == str(path) and data.chat.role == "from" and data.chat.content == "value"


# --------------------------------------------------------------------------------------
# 2. Several sources in one run


def test_the_mix_takes_what_trls_fractions_take(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The counts `mixture_counts` plans with are the rows trl's own mixture loader keeps (trl 1.16
    scripts/utils.py `get_dataset`, run here on the same files), with `max_rows` capping a source first."""
    import datasets
    from trl.scripts.utils import DatasetConfig, DatasetMixtureConfig, get_dataset

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    sizes, fractions = (30, 50, 8), (2.0, 1.0, 1.0)
    files = [_jsonl(tmp_path / f"s{i}.jsonl", messages_rows(n, 100 * i)) for i, n in enumerate(sizes)]
    mixed = get_dataset(
        DatasetMixtureConfig(
            datasets=[
                DatasetConfig(path="json", data_files=str(f), fraction=w) for f, w in zip(files, fractions, strict=True)
            ]
        )
    )["train"]
    trl_counts = [sum(_source_of(row["messages"][0]["content"]) == i for row in mixed) for i in range(3)]
    sources = [SourceSpec(path=str(f), format="messages", fraction=w) for f, w in zip(files, fractions, strict=True)]
    assert mixture_counts(list(sizes), sources) == trl_counts == [16, 8, 8]
    capped = [SourceSpec(path=str(f), format="messages", max_rows=m) for f, m in zip(files, (10, None, 3), strict=True)]
    assert mixture_counts(list(sizes), capped) == [10, 50, 3]


def _mixture_data(tmp_path: Path, eval_line: str = "  eval_rows: 4\n") -> str:
    _jsonl(tmp_path / "sharegpt.jsonl", sharegpt_rows(20))
    _jsonl(tmp_path / "pc.jsonl", prompt_completion_rows(20, 100))
    (tmp_path / "flat.csv").write_text(
        "ticket,category\n" + "".join(f"{t.replace(',', '')},{c}\n" for t, c in map(_ticket, range(200, 220)))
    )
    return (
        "  sources:\n"
        f"    - {{path: {tmp_path}/sharegpt.jsonl, field_messages: conversations, "
        "message_property_mappings: {role: from, content: value}, fraction: 2}\n"
        f"    - {{path: {tmp_path}/pc.jsonl, format: prompt-completion, fraction: 1}}\n"
        f"    - {{path: {tmp_path}/flat.csv, format: columns, columns: {{prompt: 'Triage: {{ticket}}', answer: category}}, "
        "max_rows: 5, fraction: 1}\n" + eval_line
    )


def test_a_mixture_of_three_formats_is_one_dataset_and_the_check_reports_each_source(
    tiny_gemma3_dir: Path, tmp_path: Path
) -> None:
    recipe_file = _recipe_file(tmp_path, _mixture_data(tmp_path))
    recipe = load_recipe(str(recipe_file), BATCH_2)
    assert step_plan(recipe).data_rows == 20  # shares 2:1:1 of what the capped csv (5) allows: 10 + 5 + 5
    split = prepare_datasets(recipe.data)
    assert len(split.train) == 16 and split.eval is not None and len(split.eval) == 4
    prompts = [row["messages"][-2]["content"] for row in [*split.train, *split.eval]]
    by_source = [sum(_source_of(p.removeprefix("Triage: ")) == i for p in prompts) for i in range(3)]
    assert by_source == [10, 5, 5] and sum(p.startswith("Triage: ") for p in prompts) == 5  # the csv's template
    assert {_number(p) for p in prompts if _source_of(p.removeprefix("Triage: ")) == 2} == set(range(200, 205))
    assert all(row["messages"][-1]["role"] == "assistant" for row in split.train)
    assert split.report.summary() == "skipped 0 of 20 rows"  # each row counted once, when its source is formatted

    # measured with the tiny Gemma's tokenizer: the 270M's takes seconds to load, and only where it was built
    out = check(str(recipe_file), [*BATCH_2, f"model.name_or_path={tiny_gemma3_dir}"])
    lines = out.splitlines()
    assert lines[0] == "ok: a mixture of 3 sources, 20 rows"
    assert lines[1].startswith(
        f"  data.sources[0]: 20 rows in {tmp_path}/sharegpt.jsonl (format=messages, turns in conversations as {{role: from, content: value}}), takes 10 (50% of the mix) by fraction 2;"
    )
    assert lines[2].startswith(
        f"  data.sources[1]: 20 rows in {tmp_path}/pc.jsonl (format=prompt-completion), takes 5 (25% of the mix)"
    )
    assert lines[3].startswith(
        f"  data.sources[2]: 20 rows in {tmp_path}/flat.csv (format=columns), takes 5 (25% of the mix) by max_rows 5 and fraction 1;"
    )
    assert "  held out: data.eval_rows=4 rows of a seeded shuffle" in out and "16 training rows" in out
    for i in range(3):
        assert f"  data.sources[{i}]: all 20 rows checked fit training.max_length=256" in out, out


def test_a_text_source_and_an_image_source_mix_into_one_schema(tmp_path: Path) -> None:
    from PIL import Image

    Image.new("RGB", (4, 4), "red").save(tmp_path / "red.png")
    turns = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
    ]
    _jsonl(tmp_path / "photos.jsonl", [{"messages": turns, "images": ["red.png"]}] * 4)
    _jsonl(tmp_path / "text.jsonl", prompt_completion_rows(4))
    sources = [
        {"path": f"{tmp_path}/text.jsonl", "format": "prompt-completion"},
        {"path": f"{tmp_path}/photos.jsonl", "format": "messages"},
    ]
    split = prepare_datasets(DataSpec(sources=sources, image_dir=str(tmp_path), eval_rows=2))
    rows = [*split.train, *(split.eval or [])]
    assert sorted(len(row["images"]) for row in rows) == [0] * 4 + [1] * 4
    assert {row["images"][0].size for row in rows if row["images"]} == {(4, 4)}  # opened, as the collator takes them
    assert all(isinstance(row["messages"][0]["content"], list) for row in rows)  # parts everywhere: one schema


def test_a_bad_row_of_a_source_names_the_source(tmp_path: Path) -> None:
    data = _mixture_data(tmp_path)
    rows = prompt_completion_rows(20, 100)
    rows[3] = {"prompt": "Ticket: late", "completion": [{"role": "assistant", "content": "shipping"}]}
    _jsonl(tmp_path / "pc.jsonl", rows)
    recipe = load_recipe(str(_recipe_file(tmp_path, data)), BATCH_2)
    with pytest.raises(
        DataError,
        match=r"pc\.jsonl row 4 \(line 4\), field prompt: prompt and completion differ in kind .*\[data\.sources\[1\]\.format=prompt-completion\]",
    ):
        prepare_datasets(recipe.data)


def test_a_mixture_is_checked_when_the_recipe_loads() -> None:
    one = {"path": "a.jsonl", "format": "messages"}
    with pytest.raises(
        ValueError, match=r"data\.path and data\.sources: a mixture names its files .* in data\.sources"
    ):
        DataSpec(path="b.jsonl", sources=[one])
    with pytest.raises(ValueError, match=r"fraction is set for some sources but not all \(trl's rule"):
        DataSpec(sources=[{**one, "fraction": 1}, one])
    with pytest.raises(
        ValueError, match=r"data\.sources\.0\b|format=emoji: a mixture's sources take the standard formats"
    ):
        DataSpec(sources=[{"path": "e.jsonl", "format": "emoji"}])
    with pytest.raises(ValueError, match=r"data\.columns with data\.sources: in a mixture each source has its own"):
        DataSpec(format="columns", columns={"prompt": "{q}", "answer": "a"}, sources=[one])
    with pytest.raises(ValueError, match=r"rows is required for the Hub dataset 'org/set'"):
        DataSpec(sources=[{"path": "org/set", "format": "messages", "revision": "abc"}])


def test_every_source_and_the_eval_path_count_in_the_read_grant_the_image_and_the_run_id(tmp_path: Path) -> None:
    """What the stacks read from a recipe: the URLs to grant, the repository files to carry, the sources without a
    declared row count; and the run id's recipe hash changes with a source or the held-out file."""
    data = DataSpec(
        sources=[
            {"path": "gs://team/a/*.jsonl", "format": "messages", "rows": 10},
            {"path": "gs://team/b/part-*.parquet", "format": "prompt-completion"},
            {
                "path": "trainer/samples/own/tickets.csv",
                "format": "columns",
                "columns": {"prompt": "{ticket}", "answer": "category"},
            },
        ],
        eval_path="gs://team/held-out/eval.jsonl",
    )
    assert data.data_urls == ["gs://team/a/*.jsonl", "gs://team/b/part-*.parquet", "gs://team/held-out/eval.jsonl"]
    assert data.gcs_read_scopes == [("team", "a/"), ("team", "b/part-"), ("team", "held-out/eval.jsonl")]
    assert data.undeclared_urls == [("data.sources[1].rows", "gs://team/b/part-*.parquet")]
    assert data.repository_files() == [REPO_ROOT / "trainer/samples/own/tickets.csv"]
    local_eval = DataSpec(
        path="trainer/samples/own/tickets-messages.jsonl",
        format="messages",
        eval_path="trainer/samples/own/tickets.csv",
    )
    assert local_eval.repository_files() == [
        REPO_ROOT / "trainer/samples/own/tickets-messages.jsonl",
        REPO_ROOT / "trainer/samples/own/tickets.csv",
    ]

    first = _recipe_file(tmp_path, _mixture_data(tmp_path)).read_text()
    hashes = set()
    for i, text in enumerate(
        [
            first,
            first.replace("fraction: 2", "fraction: 3"),
            first.replace("  eval_rows: 4\n", f"  eval_path: {tmp_path}/e.jsonl\n"),
        ]
    ):
        path = tmp_path / f"r{i}.yaml"
        path.write_text(text)
        hashes.add(recipe_sha256(str(path)))
    assert len(hashes) == 3


# --------------------------------------------------------------------------------------
# 3. A held-out set of the user's choosing


def test_the_held_out_rows_are_the_eval_files_in_its_order(tmp_path: Path) -> None:
    train = _jsonl(tmp_path / "train.jsonl", messages_rows(12))
    held = _jsonl(tmp_path / "eval.jsonl", sharegpt_rows(3, 500))
    spec = DataSpec(path=str(train), format="messages", eval_path=str(held))
    # eval_path's rows are read with the data level's format keys: ShareGPT here needs them, plain messages fails
    with pytest.raises(DataError, match=r"eval\.jsonl row 1 \(line 1\), field messages: missing field 'messages'"):
        prepare_datasets(spec)
    _jsonl(held, messages_rows(3, 500))
    split = prepare_datasets(spec)
    assert len(split.train) == 12 and split.eval is not None
    assert [row["messages"][0]["content"] for row in split.eval] == [_ticket(i)[0] for i in (500, 501, 502)]
    with pytest.raises(
        ValueError, match=r"data\.eval_rows=2 and data\.eval_path='e\.jsonl': the held-out rows are eval_path's"
    ):
        DataSpec(path="t.jsonl", format="messages", eval_rows=2, eval_path="e.jsonl")


def test_the_demo_scores_and_asks_the_eval_files_rows(tmp_path: Path) -> None:
    from demo.pipeline import _parse_args, build_recipe, seed_messages

    train = _jsonl(tmp_path / "train.jsonl", messages_rows(16))
    held = _jsonl(tmp_path / "eval.jsonl", messages_rows(2, 800))
    recipe_file = _recipe_file(tmp_path, f"  format: messages\n  path: {train}\n  eval_path: {held}\n")
    recipe = build_recipe(_parse_args(["--recipe", str(recipe_file), "--output-dir", str(tmp_path / "demo")]))
    assert seed_messages(recipe) == [{"role": "user", "content": _ticket(800)[0]}]


def test_runs_on_the_same_eval_file_name_the_same_held_out_rows(tmp_path: Path) -> None:
    """The identity the run summary records (`eval.held_out`) and the serving gate compares: the same eval file
    gives the same sha256 whatever the training rows; a seeded slice of other data gives another."""
    held = _jsonl(tmp_path / "eval.jsonl", messages_rows(4, 900))
    a = _jsonl(tmp_path / "a.jsonl", messages_rows(12))
    b = _jsonl(tmp_path / "b.jsonl", messages_rows(20, 50))
    same = [held_out_identity(DataSpec(path=str(p), format="messages", eval_path=str(held))) for p in (a, b)]
    assert same[0] == same[1] and same[0] is not None and same[0]["rows"] == 4 and len(same[0]["sha256"]) == 64
    sliced = [held_out_identity(DataSpec(path=str(p), format="messages", eval_rows=4)) for p in (a, b)]
    assert sliced[0] is not None and sliced[1] is not None and sliced[0]["sha256"] != sliced[1]["sha256"]
    assert held_out_identity(DataSpec(path=str(a), format="messages")) is None


# --------------------------------------------------------------------------------------
# 4. Empty and tiny inputs


@pytest.mark.parametrize(
    ("name", "text"), [("rows.jsonl", "\n\n"), ("rows.json", "[]"), ("rows.csv", "ticket,category\n")]
)
def test_an_empty_file_says_no_rows(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError, match=rf"{name}: no rows \(the file is empty\)"):
        read_rows(DataSpec(path=str(path), format="messages"))
    with pytest.raises(RecipeError, match=rf"data\.path='{path}': no rows \(the file is empty\)"):
        load_recipe(str(_recipe_file(tmp_path, f"  format: messages\n  path: {path}\n")))


def test_fewer_rows_than_the_held_out_ones_and_one_batch_is_a_config_error(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "rows.jsonl", messages_rows(5))
    recipe_file = _recipe_file(tmp_path, f"  format: messages\n  path: {path}\n  eval_rows: 2\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(str(recipe_file), ["training.per_device_train_batch_size=4"])
    assert (
        "data holds 5 rows, fewer than data.eval_rows=2 held out + one batch of "
        "training.per_device_train_batch_size=4 = 6. Fix: more rows" in str(info.value)
    )
    assert load_recipe(str(recipe_file), ["training.per_device_train_batch_size=3"]).data.eval_rows == 2


def test_rows_longer_than_max_length_are_counted_and_dropped(
    tiny_tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    long = {
        "messages": [
            {"role": "user", "content": "my parcel is late " * 40},
            {"role": "assistant", "content": "shipping"},
        ]
    }
    path = _jsonl(tmp_path / "rows.jsonl", [*messages_rows(3), long])
    spec = DataSpec(path=str(path), format="messages")
    checked = check_first_rows(read_rows(spec), spec, tiny_tokenizer, max_length=64)
    assert (checked.rows, checked.too_long) == (4, 1) and checked.longest is not None
    assert checked.longest[0] == f"{path} row 4 (line 4)" and checked.longest[1] > 64
    line = checked.length_line(64)
    assert line is not None and line.startswith("1 of the 4 rows checked are longer than training.max_length=64")
    assert "the trainer drops such rows (trainer/data.py format_rows), it does not truncate them" in line
    split = prepare_datasets(spec, tiny_tokenizer, max_length=64)
    assert len(split.train) == 3 and split.report.reasons == {"longer than max_length=64": 1}


@pytest.mark.slow
def test_a_mixture_with_a_held_out_file_trains_and_records_its_held_out_rows(
    tiny_gemma3_dir: Path, tmp_path: Path
) -> None:
    """Two steps on a mixture of ShareGPT, prompt-completion and CSV rows, scored on a held-out file: the run
    summary names the held-out rows as `held_out_identity` does, which the serving gate compares."""
    from trainer.train import main

    _jsonl(tmp_path / "eval.jsonl", messages_rows(3, 700))
    data = _mixture_data(tmp_path, f"  eval_path: {tmp_path}/eval.jsonl\n")
    recipe = load_recipe(
        str(_recipe_file(tmp_path, data)),
        [
            f"model.name_or_path={tiny_gemma3_dir}",
            f"output.dir={tmp_path / 'run'}",
            "training.max_steps=2",
            "training.save_steps=2",
            "training.per_device_train_batch_size=4",
            "output.merge=false",
            "evaluation.generate_rows=2",
            "evaluation.max_new_tokens=4",
        ],
    )
    summary = main(recipe).summary
    assert summary["steps"] == 2 and summary["eval_loss"] is not None
    assert summary["eval"]["held_out"] == held_out_identity(recipe.data)
    assert summary["eval"]["held_out"]["rows"] == 3 and summary["eval"]["held_out"]["from"].startswith(
        "data.eval_path="
    )


def test_when_every_row_fails_alike_the_fix_is_the_recipes_format_not_the_rows(tmp_path: Path) -> None:
    """Why: a flat CSV (or any file) read under the wrong data.format failed every row with 'missing field
    messages' and told the user to fix the row; it is the recipe that does not describe the rows."""
    path = tmp_path / "tickets.csv"
    path.write_text("ticket,category\n" + "".join(f"ticket {i},{CATEGORIES[i % 4]}\n" for i in range(5)))
    with pytest.raises(DataError) as info:
        prepare_datasets(DataSpec(format="messages", path=str(path)))
    text = str(info.value)
    assert text.startswith(f"{path} row 1, field messages: missing field 'messages' (row has ['category', 'ticket'])")
    assert "every one of the 5 rows checked fails alike: data.format=messages does not describe these rows" in text
    assert "Fix: data.format and its keys (columns: data.columns" in text and "Fix the row" not in text
    # a held-out file is read with the data level's keys, and the message names those (no data.eval_path.format)
    with pytest.raises(DataError) as info:
        prepare_datasets(
            DataSpec(format="messages", path=str(_jsonl(tmp_path / "t.jsonl", messages_rows(4))), eval_path=str(path))
        )
    assert "[data.format=messages]" in str(info.value) and "eval_path.format" not in str(info.value)
    assert "Fix: data.eval_path is read with the data level's format keys: write the held-out rows in the" in str(
        info.value
    )
    # one bad row among good ones is the row's to fix
    rows = [*messages_rows(3), {"messages": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(
        DataError, match=r"row 4 \(line 4\), field messages: last turn is not the assistant's.*Fix the row"
    ):
        prepare_datasets(DataSpec(format="messages", path=str(_jsonl(tmp_path / "rows.jsonl", rows))))


def test_every_rank_mixes_splits_and_names_the_same_rows(tmp_path: Path) -> None:
    """Each rank (an accelerate process, a Ray worker) builds the mixture, the split and the held-out identity on
    its own: another process, with another hash seed, must get the very same rows in the same order."""
    import hashlib
    import os
    import subprocess
    import sys

    recipe_file = _recipe_file(tmp_path, _mixture_data(tmp_path))
    code = (
        "import hashlib, json, sys\n"
        "from trainer.data import held_out_identity, prepare_datasets\n"
        "from trainer.recipe import load_recipe\n"
        "data = load_recipe(sys.argv[1], ['training.per_device_train_batch_size=2']).data\n"
        "split = prepare_datasets(data)\n"
        "rows = json.dumps([list(split.train['messages']), list(split.eval['messages'])])\n"
        "print(hashlib.sha256(rows.encode()).hexdigest(), held_out_identity(data)['sha256'])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONHASHSEED": "7"}
    other = subprocess.run(
        [sys.executable, "-c", code, str(recipe_file)], env=env, capture_output=True, text=True, timeout=300
    )
    assert other.returncode == 0, other.stderr[-2000:]
    data = load_recipe(str(recipe_file), BATCH_2).data
    split = prepare_datasets(data)
    assert split.eval is not None
    rows = json.dumps([list(split.train["messages"]), list(split.eval["messages"])])
    identity = held_out_identity(data)
    assert identity is not None
    assert other.stdout.split() == [hashlib.sha256(rows.encode()).hexdigest(), identity["sha256"]]


def test_a_url_source_whose_rows_differ_from_its_declared_count_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As for one URL (`data.rows`), a mixture's URL source that declares other rows than its files hold is logged:
    the step plan, and what the fractions take of each source, were computed from the declared count."""
    import logging

    url = f"file://{_jsonl(tmp_path / 'a.jsonl', messages_rows(20))}"
    local = _jsonl(tmp_path / "b.jsonl", messages_rows(20, 100))
    data = DataSpec(
        sources=[
            {"path": url, "format": "messages", "rows": 10, "fraction": 1},
            {"path": str(local), "format": "messages", "fraction": 1},
        ]
    )
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        prepare_datasets(data)
    assert f"data.sources[0].rows=10 but {url} holds 20 rows: the recipe's step plan counted 10" in caplog.text


def test_the_held_out_file_is_read_without_the_training_data(tmp_path: Path) -> None:
    """Why: after training, every rank names and answers the held-out rows (run_eval.py); with data.eval_path that
    read, and for a mixture formatted (every image opened), all the training data again to throw it away."""
    from trainer.evaluate import held_out_rows

    train = _jsonl(tmp_path / "train.jsonl", messages_rows(12))
    held = _jsonl(tmp_path / "eval.jsonl", messages_rows(3, 700))
    recipe = load_recipe(
        str(_recipe_file(tmp_path, f"  format: messages\n  path: {train}\n  eval_path: {held}\n")), BATCH_2
    )
    expected = held_out_identity(recipe.data)
    train.unlink()  # what is not read cannot be missing
    assert held_out_identity(recipe.data) == expected
    assert [c["messages"][0]["content"] for c, _ in held_out_rows(recipe, 2)] == [_ticket(i)[0] for i in (700, 701)]


def test_a_check_before_the_local_model_is_built_says_how_to_measure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why: on a fresh clone the template's `local:gemma3-270m` is not built yet (python -m trainer builds it), and
    the check's note asked for a --tokenizer the user does not have."""
    monkeypatch.setenv("GEMMA_FT_CACHE", str(tmp_path / "empty-cache"))
    out = check(TEMPLATE)
    assert (
        "lengths not measured (local:gemma3-270m is not built on this machine: `python -m trainer.local_model` "
        "builds it, or pass --tokenizer MODEL_OR_FOLDER)" in out
    ), out
