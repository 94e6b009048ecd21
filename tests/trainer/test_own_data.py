"""Fine-tuning on your own data (docs/own-data.md): the standard formats, data behind any fsspec URL, a recipe file
outside trainer/recipes/, and bad rows stopped before the model loads with the file, row and field named.

Training runs use the tiny Gemma 3 (tests/tiny_models.py): 2 steps each, no merge.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from trainer.data import (
    CHECK_ROWS,
    DataError,
    check,
    expand_url,
    prepare_datasets,
    read_rows,
)
from trainer.recipe import (
    REPO_ROOT,
    DataFormat,
    DataSource,
    DataSpec,
    Recipe,
    RecipeError,
    Task,
    list_recipes,
    load_recipe,
    step_plan,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

TEMPLATE = "trainer/recipes/templates/my-data-local.yaml"
OWN = REPO_ROOT / "trainer/samples/own"
SYSTEM = "You triage support tickets."


def own_recipe(model_dir: Path, output: Path, *overrides: str) -> Recipe:
    """The local template on the tiny model: 2 steps of 4 rows, no merge, no TensorBoard."""
    return load_recipe(
        TEMPLATE,
        [
            f"model.name_or_path={model_dir}",
            f"output.dir={output}",
            "training.max_steps=2",
            "training.save_steps=2",
            "training.logging_steps=1",
            "training.per_device_train_batch_size=4",
            "training.learning_rate=0.01",
            "output.merge=false",
            *overrides,
        ],
    )


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _turns(*pairs: tuple[str, Any]) -> list[dict[str, Any]]:
    return [{"role": role, "content": content} for role, content in pairs]


def _good(i: int) -> dict[str, Any]:
    return {"messages": _turns(("user", f"Ticket {i}: my parcel is late"), ("assistant", "shipping"))}


class FakeGCS(MemoryFileSystem):
    """fsspec's in-memory filesystem registered as `gs`, with gcsfs's paths (`bucket/object`, no root marker):
    what gcsfs is to fsspec, without a network."""

    protocol = ("gs",)
    root_marker = ""
    store: dict[str, Any] = {}  # noqa: RUF012  (fsspec's own class-level store, one per subclass)
    pseudo_dirs = [""]  # noqa: RUF012

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return path.removeprefix("gs://").rstrip("/")


@pytest.fixture
def fake_gcs(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeGCS]]:
    """`gs://` resolved by fsspec's protocol registry to FakeGCS (gcsfs registers itself the same way)."""
    registry = sys.modules["fsspec.registry"]._registry
    monkeypatch.setitem(registry, "gs", FakeGCS)
    FakeGCS.store.clear()
    FakeGCS.clear_instance_cache()
    yield FakeGCS
    FakeGCS.store.clear()
    FakeGCS.clear_instance_cache()


def _put(url: str, text: str | bytes) -> None:
    with fsspec.open(url, "wb") as handle:
        handle.write(text.encode() if isinstance(text, str) else text)


# --------------------------------------------------------------------------------------
# The recipe's data section


class TestDataSection:
    @pytest.mark.parametrize("name", list_recipes())
    def test_the_shipped_recipes_say_task_and_get_the_same_format(self, name: str) -> None:
        data = load_recipe(name).data
        assert data.task is not None and data.format.value == data.task.value

    def test_format_names_a_tutorial_task_too(self) -> None:
        spec = DataSpec(format="emoji", path="trainer/samples/emoji.jsonl")
        assert spec.task is Task.EMOJI and spec.source is DataSource.LOCAL

    def test_task_naming_a_standard_format_reads_as_format(self) -> None:
        spec = DataSpec(task="messages", path="x.jsonl")
        assert spec.format is DataFormat.MESSAGES and spec.task is None

    def test_format_and_task_may_not_disagree(self) -> None:
        with pytest.raises(ValueError, match=r"data\.format='messages' and data\.task='emoji' disagree"):
            DataSpec(format="messages", task="emoji", path="x.jsonl")

    def test_a_format_is_required(self) -> None:
        with pytest.raises(ValueError, match=r"data\.format is missing: one of \['messages', 'prompt-completion'"):
            DataSpec(path="x.jsonl")

    @pytest.mark.parametrize(
        ("path", "source"),
        [
            ("gs://bucket/tickets/*.jsonl", DataSource.URL),
            ("memory://own/rows.parquet", DataSource.URL),
            ("trainer/samples/own/tickets.csv", DataSource.LOCAL),
            ("/data/rows.jsonl", DataSource.LOCAL),
            ("my-org/tickets", DataSource.HUB),
        ],
    )
    def test_the_source_is_read_from_the_path(self, path: str, source: DataSource) -> None:
        extra = {"rows": 10, "revision": "0123abc"} if source is DataSource.HUB else {}
        assert DataSpec(format="messages", path=path, **extra).source is source

    def test_a_url_with_a_source_that_is_not_url_is_refused(self) -> None:
        with pytest.raises(ValueError, match=r"a URL \(scheme://\) is source url"):
            DataSpec(format="messages", source="local", path="gs://b/rows.jsonl")

    def test_a_url_names_its_files_by_suffix(self) -> None:
        with pytest.raises(ValueError, match=r"a URL must name \.jsonl, \.json, \.parquet, \.csv files"):
            DataSpec(format="messages", path="gs://b/rows/")

    def test_a_hub_dataset_in_a_standard_format_pins_its_revision(self) -> None:
        with pytest.raises(ValueError, match=r"data\.revision is required for the Hub dataset 'org/set'"):
            DataSpec(format="messages", path="org/set", rows=10)
        assert DataSpec(format="messages", path="org/set", rows=10, revision="1f2e3d").revision == "1f2e3d"

    def test_columns_needs_its_mapping_and_named_fields(self) -> None:
        with pytest.raises(ValueError, match=r"data\.format=columns needs data\.columns"):
            DataSpec(format="columns", path="t.csv")
        with pytest.raises(ValueError, match=r"has a positional field \{\}: name a column"):
            DataSpec(format="columns", path="t.csv", columns={"prompt": "Ticket: {}", "answer": "category"})
        spec = DataSpec(format="columns", path="t.csv", columns={"prompt": "{product}: {ticket}", "answer": "category"})
        assert spec.columns is not None and spec.columns.needed == ["product", "ticket", "category"]

    def test_what_a_read_grant_and_an_image_need(self) -> None:
        """For the infra side: the bucket and prefix a gs:// recipe reads, and the repository files a local one needs."""
        url = DataSpec(format="messages", path="gs://team-data/tickets/2026-*.jsonl", rows=64)
        assert url.gcs_read_scopes == [("team-data", "tickets/2026-")]
        assert url.data_urls == ["gs://team-data/tickets/2026-*.jsonl"] and url.repository_files() == []
        vision = DataSpec(format="messages", path="gs://a/rows.jsonl", image_dir="gs://b/photos", rows=64)
        assert vision.gcs_read_scopes == [("a", "rows.jsonl"), ("b", "photos/")]
        assert DataSpec(format="messages", path="memory://x/rows.jsonl").gcs_read_scopes == []
        local = load_recipe(TEMPLATE).data
        assert local.gcs_read_scopes == [] and local.data_urls == []
        assert local.repository_files() == [OWN / "tickets-messages.jsonl"]

    def test_steps_are_computed_from_a_local_file_in_a_standard_format(self) -> None:
        plan = step_plan(load_recipe(TEMPLATE, ["training.max_steps=-1", "training.save_steps=7"]))
        # 64 rows - 8 held out = 56, batch 8: 7 updates in the epoch (every row counted as fitting: no sample table)
        assert (plan.train_rows, plan.total_updates) == (56, 7)

    def test_steps_of_a_url_are_counted_through_fsspec_or_declared(self) -> None:
        _put("memory://own-steps/a.jsonl", "".join(json.dumps(_good(i)) + "\n" for i in range(40)))
        counted = load_recipe(
            TEMPLATE, ["data.path=memory://own-steps/*.jsonl", "training.max_steps=-1", "training.save_steps=4"]
        )
        assert step_plan(counted).train_rows == 32 and step_plan(counted).total_updates == 4
        declared = load_recipe(TEMPLATE, ["data.path=gs://nowhere/x/*.jsonl", "data.rows=808", "training.max_steps=-1"])
        assert step_plan(declared).train_rows == 800  # not read: gcsfs is not even needed to plan it

    def test_a_url_that_cannot_be_read_to_count_says_declare_rows(self) -> None:
        with pytest.raises(RecipeError, match=r"names no file"):
            load_recipe(TEMPLATE, ["data.path=memory://own-steps-missing/*.jsonl"])


# --------------------------------------------------------------------------------------
# Data from anywhere: one fsspec path for files and URLs


class TestFsspecPath:
    def test_a_memory_url_glob_reads_every_file_in_order(self) -> None:
        _put("memory://own-glob/part-2.jsonl", json.dumps(_good(2)) + "\n")
        _put("memory://own-glob/part-1.jsonl", json.dumps(_good(0)) + "\n\n" + json.dumps(_good(1)) + "\n")
        loaded = read_rows(DataSpec(format="messages", path="memory://own-glob/part-*.jsonl"))
        rows, origin = loaded.dataset(), loaded.origin
        assert [r["messages"][0]["content"] for r in rows] == [f"Ticket {i}: my parcel is late" for i in range(3)]
        assert origin.where(1) == "memory:///own-glob/part-1.jsonl row 2 (line 3)"
        assert origin.where(2) == "memory:///own-glob/part-2.jsonl row 1 (line 1)"

    def test_a_file_url_takes_the_same_path(self, tmp_path: Path) -> None:
        _write_jsonl(tmp_path / "a.jsonl", [_good(0), _good(1)])
        loaded = read_rows(DataSpec(format="messages", path=f"file://{tmp_path}/*.jsonl"))
        rows, origin = loaded.dataset(), loaded.origin
        assert len(rows) == 2 and origin.where(0) == f"file://{tmp_path}/a.jsonl row 1 (line 1)"

    def test_a_gs_url_goes_through_fsspecs_protocol_registry(self, fake_gcs: type[FakeGCS]) -> None:
        """No special case for gs://: fsspec picks the filesystem by protocol, as it picks gcsfs on the cluster."""
        _put("gs://team-data/tickets/a.jsonl", json.dumps(_good(0)) + "\n")
        fs, paths = expand_url("gs://team-data/tickets/*.jsonl")
        assert isinstance(fs, FakeGCS) and paths == ["team-data/tickets/a.jsonl"]
        loaded = read_rows(DataSpec(format="messages", path="gs://team-data/tickets/*.jsonl"))
        rows, origin = loaded.dataset(), loaded.origin
        assert len(rows) == 1 and origin.where(0) == "gs://team-data/tickets/a.jsonl row 1 (line 1)"

    def test_a_url_that_names_no_file(self) -> None:
        with pytest.raises(DataError, match=r"data\.path='memory://own-none/\*\.jsonl' names no file"):
            read_rows(DataSpec(format="messages", path="memory://own-none/*.jsonl"))


# --------------------------------------------------------------------------------------
# Each format trains 2 steps, the loss on the answer only


def _assert_trained(summary: dict[str, Any], output: Path) -> None:
    assert summary["steps"] == 2 and math.isfinite(summary["final_train_loss"]), summary
    assert summary["eval_loss"] is not None and math.isfinite(summary["eval_loss"])
    assert (output / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_a_messages_jsonl_in_a_bucket_trains_two_steps(
    tiny_gemma3_dir: Path, tmp_path: Path, fake_gcs: type[FakeGCS]
) -> None:
    from trainer.train import main

    _put("gs://team-data/tickets/all.jsonl", (OWN / "tickets-messages.jsonl").read_text())
    recipe = own_recipe(tiny_gemma3_dir, tmp_path / "run", "data.path=gs://team-data/tickets/*.jsonl")
    _assert_trained(main(recipe).summary, tmp_path / "run")


@pytest.mark.slow
def test_a_prompt_completion_parquet_trains_two_steps(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainer.train import main

    rows = [json.loads(line) for line in (OWN / "tickets-messages.jsonl").read_text().splitlines()]
    table = pa.Table.from_pylist([{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in rows])
    pq.write_table(table, tmp_path / "tickets.parquet")
    recipe = own_recipe(
        tiny_gemma3_dir, tmp_path / "run", "data.format=prompt-completion", f"data.path={tmp_path}/tickets.parquet"
    )
    _assert_trained(main(recipe).summary, tmp_path / "run")


@pytest.mark.slow
def test_a_mapped_csv_trains_two_steps(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    from trainer.train import main

    recipe = own_recipe(
        tiny_gemma3_dir,
        tmp_path / "run",
        "data.format=columns",
        "data.path=trainer/samples/own/tickets.csv",
        'data.columns={system: "Answer with one word.", prompt: "Product: {product}\\nTicket: {ticket}", '
        "answer: category}",
    )
    _assert_trained(main(recipe).summary, tmp_path / "run")


def _trained_text(tiny_gemma3_dir: Path, tmp_path: Path, *overrides: str) -> tuple[str, str]:
    """(text under the loss, whole text) of the first training row, as trl tokenised and masked it."""
    from trainer.checkpoints import OutputLocation
    from trainer.train import build_trainer

    recipe = own_recipe(tiny_gemma3_dir, tmp_path / "run", "data.eval_rows=0", *overrides)
    trainer, tokenizer = build_trainer(recipe, OutputLocation.from_dir(str(tmp_path / "run")))
    row = trainer.train_dataset[0]
    labels = row["labels"]
    return tokenizer.decode([t for t in labels if t != -100]), tokenizer.decode(row["input_ids"])


@pytest.mark.parametrize(
    ("rows", "overrides"),
    [
        pytest.param(
            [
                {
                    "messages": _turns(
                        ("system", SYSTEM),
                        ("user", "Ticket: charged twice"),
                        ("assistant", "billing"),
                        ("user", "Ticket: parcel late"),
                        ("assistant", "shipping"),
                    )
                }
            ]
            * 8,
            ["data.format=messages"],
            id="messages-multi-turn",
        ),
        pytest.param(
            [
                {
                    "prompt": _turns(("system", SYSTEM), ("user", "Ticket: parcel late")),
                    "completion": _turns(("assistant", "shipping")),
                }
            ]
            * 8,
            ["data.format=prompt-completion"],
            id="prompt-completion",
        ),
        pytest.param(
            [{"prompt": f"{SYSTEM} Ticket: parcel late", "completion": "shipping"}] * 8,
            ["data.format=prompt-completion"],
            id="prompt-completion-plain",
        ),
        pytest.param(
            [
                {
                    "conversations": [
                        {"from": "system", "value": SYSTEM},
                        {"from": "human", "value": "Ticket: parcel late"},
                        {"from": "gpt", "value": "shipping"},
                    ]
                }
            ]
            * 8,
            [
                "data.format=messages",
                "data.field_messages=conversations",
                "data.message_property_mappings={role: from, content: value}",
            ],
            id="sharegpt",
        ),
        pytest.param(
            [{"ticket": "parcel late", "category": "shipping"}] * 8,
            [
                "data.format=columns",
                f"data.columns={{system: {SYSTEM}, prompt: 'Ticket: {{ticket}}', answer: category}}",
            ],
            id="columns",
        ),
    ],
)
def test_the_loss_is_on_the_answers_only(
    rows: list[dict[str, Any]], overrides: list[str], tiny_gemma3_dir: Path, tmp_path: Path
) -> None:
    path = _write_jsonl(tmp_path / "rows.jsonl", rows)
    trained, whole = _trained_text(tiny_gemma3_dir, tmp_path, f"data.path={path}", *overrides)
    assert "Ticket" in whole and "triage" in whole, whole  # the prompt is in the row ...
    assert "Ticket" not in trained and "triage" not in trained, trained  # ... and not under the loss
    assert "shipping" in trained
    if "billing" in whole:  # multi-turn messages: every assistant turn is trained
        assert "billing" in trained


# --------------------------------------------------------------------------------------
# Bad data: the first rows are checked before the model loads; the message names file, row and field


_BAD = [
    ("unknown-role", {"messages": _turns(("user", "hi"), ("bot", "hello"))}, "messages", r"field messages\[1\]\.role: unknown role 'bot' \(use one of \['system', 'user', 'assistant'\] or human, gpt, model; another name: map it in data\.roles\)"),
    ("empty-turn", {"messages": _turns(("user", "hi"), ("assistant", "  "))}, "messages", r"field messages\[1\]\.content: empty turn"),
    ("no-answer", {"messages": _turns(("user", "hi"))}, "messages", r"field messages: last turn is not the assistant's"),
    ("no-messages", {"conversation": []}, "messages", r"field messages: missing field 'messages' \(row has \['conversation'\]\)"),
    ("system-late", {"messages": _turns(("user", "hi"), ("system", "be nice"), ("assistant", "ok"))}, "messages", r"field messages\[1\]\.role: system turn not first"),
    ("image-count", {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}, {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]}], "images": []}, "messages", r"field images: image count differs from image parts \(1 \{type: image\} parts, 0 images\)"),
    ("prompt-has-answer", {"prompt": _turns(("user", "hi"), ("assistant", "hello"), ("user", "and?")), "completion": _turns(("assistant", "bye"))}, "prompt-completion", r"field prompt\[1\]\.role: assistant turn in prompt"),
    ("completion-not-assistant", {"prompt": _turns(("user", "hi")), "completion": _turns(("user", "bye"))}, "prompt-completion", r"field completion: completion is not one assistant turn \(got roles \['user'\]\)"),
    ("kinds-differ", {"prompt": "hi", "completion": _turns(("assistant", "bye"))}, "prompt-completion", r"field prompt: prompt and completion differ in kind"),
    ("empty-completion", {"prompt": "hi", "completion": ""}, "prompt-completion", r"field completion: empty field 'completion'"),
    ("missing-column", {"ticket": "parcel late"}, "columns", r"field category: missing field 'category'"),
    ("empty-column", {"ticket": " ", "category": "shipping"}, "columns", r"field ticket: empty field 'ticket'"),
]  # fmt: skip


def _spec(path: Path, data_format: str, **extra: Any) -> DataSpec:
    columns = {"prompt": "Ticket: {ticket}", "answer": "category"} if data_format == "columns" else None
    return DataSpec(format=data_format, path=str(path), columns=columns, **extra)


def _good_row(data_format: str) -> dict[str, Any]:
    if data_format == "columns":
        return {"ticket": "parcel late", "category": "shipping"}
    if data_format == "prompt-completion":
        return {"prompt": "Ticket: parcel late", "completion": "shipping"}
    return _good(0)


@pytest.mark.parametrize(("bad", "data_format", "message"), [case[1:] for case in _BAD], ids=[c[0] for c in _BAD])
def test_a_bad_row_is_named_with_its_file_row_and_field(
    bad: dict[str, Any], data_format: str, message: str, tmp_path: Path
) -> None:
    good = _good_row(data_format)
    path = _write_jsonl(tmp_path / "rows.jsonl", [good, good, bad, good])
    with pytest.raises(DataError) as info:
        prepare_datasets(_spec(path, data_format))
    text = str(info.value)
    assert re.search(re.escape(f"{path} row 3 (line 3), ") + message, text), text
    assert f"[data.format={data_format}]" in text and "docs/own-data.md" in text


def test_an_image_that_does_not_open_is_named(tmp_path: Path) -> None:
    from PIL import Image

    Image.new("RGB", (4, 4), "red").save(tmp_path / "ok.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        ]
    }
    path = _write_jsonl(
        tmp_path / "rows.jsonl",
        [{**row, "images": ["ok.png"]}, {**row, "images": ["broken.png"]}, {**row, "images": ["ok.png"]}],
    )
    with pytest.raises(
        DataError, match=r"rows\.jsonl row 2 \(line 2\), field images\[0\]: image does not open \('broken\.png'"
    ):
        prepare_datasets(_spec(path, "messages", image_dir=str(tmp_path)))
    path = _write_jsonl(tmp_path / "rows.jsonl", [{**row, "images": ["ok.png"]}] * 3)
    split = prepare_datasets(_spec(path, "messages", image_dir=str(tmp_path)))
    assert split.train[0]["images"][0].size == (4, 4)  # opened, RGB: what the vision collator takes


def test_a_line_that_is_not_json_is_named(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(_good(0)) + "\n{'role': 'user'}\n")
    with pytest.raises(DataError, match=r"rows\.jsonl line 2: not valid JSON \(Expecting property name"):
        prepare_datasets(_spec(path, "messages"))


def test_rows_without_one_schema_are_refused_with_the_fix(tmp_path: Path) -> None:
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "ok"},
        ]
    }
    path = _write_jsonl(tmp_path / "rows.jsonl", [_good(0), parts])
    with pytest.raises(DataError, match=r"do not share one schema .*always a string or always a list of parts"):
        prepare_datasets(_spec(path, "messages"))


def test_rows_that_fail_after_the_checked_ones_are_counted_and_skipped(tmp_path: Path) -> None:
    rows = [_good(i) for i in range(CHECK_ROWS + 10)]
    rows[CHECK_ROWS + 3] = {"messages": _turns(("user", "hi"), ("bot", "hello"))}
    path = _write_jsonl(tmp_path / "rows.jsonl", rows)
    split = prepare_datasets(_spec(path, "messages", eval_rows=10))
    assert split.report.summary() == f"skipped 1 of {CHECK_ROWS + 10} rows: 1 unknown role 'bot'"
    assert len(split.train) + len(split.eval or []) == CHECK_ROWS + 9


def test_the_trainer_exits_2_on_bad_data_before_loading_the_model(
    tiny_gemma3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import trainer.__main__
    import trainer.modeling

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(trainer.modeling, "load_model", never)
    path = _write_jsonl(tmp_path / "rows.jsonl", [_good(0), {"messages": _turns(("user", "hi"), ("assistant", ""))}])
    argv = ["--recipe", TEMPLATE, "--set", f"model.name_or_path={tiny_gemma3_dir}", "--set", f"data.path={path}"]
    argv += ["--set", "data.eval_rows=0", "--set", f"output.dir={tmp_path / 'run'}"]
    argv += ["--set", "training.per_device_train_batch_size=1"]
    assert trainer.__main__.run(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path} row 2 (line 2), field messages[1].content: empty turn"), err


# --------------------------------------------------------------------------------------
# `python -m trainer.data check` and `python -m trainer --recipe FILE`


def _python(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_check_a_recipe_measures_its_rows_with_the_models_tokenizer(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "mine.yaml"
    recipe.write_text((REPO_ROOT / TEMPLATE).read_text().replace("local:gemma3-270m", str(tiny_gemma3_dir)))
    out = check(str(recipe))
    assert out.splitlines()[0] == (
        "ok: 64 rows in trainer/samples/own/tickets-messages.jsonl (data.format=messages); the first 64 checked"
    )
    assert (
        f"lengths measured with {tiny_gemma3_dir}'s tokenizer" in out and "56 training rows, 30 optimizer steps" in out
    )
    with pytest.raises(
        DataError,
        match=r"every one of the 64 rows checked of data is longer than training\.max_length=8 tokens \(the longest: "
        r"trainer/samples/own/tickets-messages\.jsonl row \d+ \(line \d+\), \d+ tokens once the chat template is "
        r"applied\): the trainer drops such rows, so nothing would train",
    ):
        check(str(recipe), ["training.max_length=8"])


def test_check_a_file_guesses_its_format_or_asks_for_one(tmp_path: Path) -> None:
    assert check(str(OWN / "tickets-prompt-completion.jsonl")).startswith("ok: 64 rows in ")
    assert "(data.format=prompt-completion)" in check(str(OWN / "tickets-prompt-completion.jsonl"))
    with pytest.raises(
        DataError, match=r"neither `messages` \(trl\), `conversations` of \{from, value\} \(ShareGPT\) nor "
    ):
        check(str(OWN / "tickets.csv"))


def test_python_m_trainer_data_check_on_a_bad_file(tmp_path: Path) -> None:
    """`python -m trainer.data` runs the check of the module trainer/data.py (the samples live in trainer/samples/)."""
    path = _write_jsonl(tmp_path / "rows.jsonl", [_good(0), {"messages": _turns(("user", "hi"), ("bot", "hello"))}])
    done = _python("-m", "trainer.data", "check", str(path), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {path} row 2 (line 2), field messages[1].role: unknown role 'bot'"), (
        done.stderr
    )
    assert "Traceback" not in done.stderr


def test_a_file_check_without_a_tokenizer_imports_neither_transformers_nor_torch(tmp_path: Path) -> None:
    """Without a tokenizer no length is measured, so the check of a file (the bad one above, or a good one) needs no
    model library: a fresh process, as `python -m trainer.data check FILE` starts, imports neither."""
    path = _write_jsonl(tmp_path / "rows.jsonl", [_good(0), _good(1)])
    code = (
        "import sys; from trainer.data import check; print(check(sys.argv[1]));"
        " print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    done = _python("-c", code, str(path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"ok: 2 rows in {path}") and "lengths not measured" in done.stdout, done.stdout
    assert done.stdout.splitlines()[-1] == "[]", done.stdout


@pytest.mark.slow
def test_python_m_trainer_runs_a_recipe_file_outside_trainer_recipes(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """The user's copy of the template, in their own folder, with their own CSV: through the real command line."""
    (tmp_path / "tickets.csv").write_text((OWN / "tickets.csv").read_text())
    recipe = (REPO_ROOT / TEMPLATE).read_text().replace("local:gemma3-270m", str(tiny_gemma3_dir))
    recipe = recipe.replace("format: messages", "format: columns").replace(
        "path: trainer/samples/own/tickets-messages.jsonl",
        f"path: {tmp_path / 'tickets.csv'}\n  columns: {{prompt: 'Ticket: {{ticket}}', answer: category}}",
    )
    (tmp_path / "mine.yaml").write_text(recipe)
    sets = [
        "training.max_steps=2",
        "training.save_steps=2",
        "training.per_device_train_batch_size=4",
        "training.logging_steps=1",
        "output.merge=false",
    ]
    done = _python(
        "-m", "trainer", "--recipe", "mine.yaml", *(f"--set={s}" for s in sets), f"--set=output.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert summary["recipe"] == "my-data-local" and summary["steps"] == 2 and math.isfinite(summary["final_train_loss"])
    assert f"data: 64 rows from {tmp_path / 'tickets.csv'}; the first 64 are well-formed" in done.stderr


def test_the_example_files_are_what_their_generator_writes() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_examples", OWN / "make_examples.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, render in module.FILES.items():
        assert (OWN / name).read_text(encoding="utf-8") == render(module.make_rows()), name


def test_evaluation_scores_any_format_by_text_overlap_exact_match_and_held_out_loss(
    tiny_gemma3_dir: Path, tmp_path: Path
) -> None:
    from trainer.evaluate import evaluate, rouge_l_f1

    recipe = load_recipe(TEMPLATE, [f"model.name_or_path={tiny_gemma3_dir}", "evaluation.max_new_tokens=4"])
    results = evaluate(tiny_gemma3_dir, recipe, max_samples=3, out=tmp_path / "eval.json")
    predictions = results["predictions"]
    assert results["samples"] == 3 and results["held_out_loss"] > 0
    assert {p["reference"] for p in predictions} <= {"billing", "technical", "account", "shipping"}
    assert results["rouge_l_f1"] == pytest.approx(
        sum(rouge_l_f1(p["prediction"], p["reference"]) for p in predictions) / 3
    )
    assert results["exact_match"] == sum(p["prediction"].strip() == p["reference"] for p in predictions) / 3


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "trainer/recipes/templates").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_template_loads_and_checkpoints_inside_its_run(path: Path) -> None:
    """The templates are copied and run as they are: valid, named after their file, checkpointing inside the run."""
    recipe = load_recipe(str(path))
    assert recipe.name == path.stem and recipe.data.task is None
    plan = step_plan(recipe)
    assert recipe.training.save_steps <= plan.total_updates
    assert path.stem not in list_recipes()  # templates, not stack recipes: trainer/recipes/*.yaml only


def test_check_a_recipe_refuses_images_for_a_text_model(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    from PIL import Image

    Image.new("RGB", (4, 4), "red").save(tmp_path / "ok.png")
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        ],
        "images": ["ok.png"],
    }
    path = _write_jsonl(tmp_path / "rows.jsonl", [row] * 3)
    sets = [
        f"model.name_or_path={tiny_gemma3_dir}",
        f"data.path={path}",
        f"data.image_dir={tmp_path}",
        "data.eval_rows=1",
        "training.per_device_train_batch_size=1",
    ]
    sets.append("training.max_steps=2")
    with pytest.raises(DataError, match=r"rows\.jsonl row 1 \(line 1\), field images: the rows carry images but model"):
        check(TEMPLATE, sets)
    assert check(TEMPLATE, [*sets, "model.text_only=false"]).startswith(f"ok: 3 rows in {path}")


def test_image_rows_in_a_bucket_reach_the_vision_collator_with_the_answer_alone_trained(
    fake_gcs: type[FakeGCS],
) -> None:
    """messages + images from gs:// (rows and images through fsspec) -> PIL images -> the W2 collator's batch."""
    import io

    import torch
    from PIL import Image

    from tests.tiny_models import tiny_vision_model, tiny_vision_processor
    from trainer.collators import VisionSFTCollator

    rows = []
    for i, colour in enumerate(["red", "green", "blue"]):
        png = io.BytesIO()
        Image.new("RGB", (8, 8), colour).save(png, format="PNG")
        _put(f"gs://team-data/photos/{i}.png", png.getvalue())
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": colour}]},
                ],
                "images": [f"{i}.png"],
            }
        )
    _put("gs://team-data/photos/rows.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    split = prepare_datasets(
        DataSpec(format="messages", path="gs://team-data/photos/rows.jsonl", image_dir="gs://team-data/photos")
    )
    examples = list(split.train)  # shuffled: each row's image still goes with its answer
    pixels = {"red": (255, 0, 0), "green": (0, 128, 0), "blue": (0, 0, 255)}
    answers = [e["messages"][-1]["content"][0]["text"] for e in examples]
    assert sorted(answers) == sorted(pixels)
    assert [e["images"][0].getpixel((0, 0)) for e in examples] == [pixels[a] for a in answers]
    processor = tiny_vision_processor()
    batch = VisionSFTCollator(processor)(examples)
    for row, answer in enumerate(answers):
        kept = batch["labels"][row][batch["labels"][row] != -100].tolist()
        assert processor.tokenizer.decode(kept) == answer + "<end_of_turn>\n"
    assert torch.isfinite(tiny_vision_model(processor)(**batch).loss)


def test_a_file_that_is_no_data_file_is_one_message(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(DataError, match=r"notes\.txt': local data must be a \.jsonl, \.json, \.parquet, \.csv file"):
        check(str(tmp_path / "notes.txt"), data_format="messages")


def test_the_fix_of_a_recipe_file_names_the_file() -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(TEMPLATE, ["training.max_steps=-1", "training.save_steps=50"])
    assert f"`python -m trainer --recipe {TEMPLATE} --set training.save_steps=N`" in str(info.value)
