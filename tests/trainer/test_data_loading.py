"""Data loading: a reproducible split, and bad rows counted, skipped and reported instead of crashing."""

from __future__ import annotations

import importlib.util
import json
import logging
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import pytest
from datasets import Dataset
from transformers import PreTrainedTokenizerFast

from trainer.data import SkipReport, format_rows, load_rows, prepare_datasets, split_rows
from trainer.recipe import REPO_ROOT, DataSpec, RecipeError, Task, load_recipe


def _load_generator() -> ModuleType:
    """trainer/samples/ is a data folder, not a package (trainer.data is the loader module)."""
    path = REPO_ROOT / "trainer/samples/make_emoji_sample.py"
    spec = importlib.util.spec_from_file_location("make_emoji_sample", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _spec(path: Path | str, **kwargs: object) -> DataSpec:
    return DataSpec(task=Task.EMOJI, source="local", path=str(path), **kwargs)


def _write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")
    return path


class TestBundledSample:
    def test_has_300_distinct_text2emoji_rows(self) -> None:
        lines = (REPO_ROOT / "trainer/samples/emoji.jsonl").read_text(encoding="utf-8").splitlines()
        rows = [json.loads(line) for line in lines]
        assert len(rows) >= 300
        assert all(set(row) == {"text", "emoji"} and row["text"] and row["emoji"] for row in rows)
        assert len({row["text"] for row in rows}) == len(rows)

    def test_generator_reproduces_the_committed_file(self) -> None:
        committed = (REPO_ROOT / "trainer/samples/emoji.jsonl").read_text(encoding="utf-8")
        regenerated = "\n".join(json.dumps(r, ensure_ascii=False) for r in _load_generator().make_rows()) + "\n"
        assert committed == regenerated


class TestSplit:
    def test_seeded_shuffle_then_max_rows_then_eval_first(self) -> None:
        rows = Dataset.from_list([{"text": str(i), "emoji": "🙂"} for i in range(50)])
        spec = _spec("x.jsonl", max_rows=20, eval_rows=5, seed=3)
        train, evaluation = split_rows(rows, spec)
        shuffled = [r["text"] for r in rows.shuffle(seed=3)][:20]
        assert evaluation is not None
        assert evaluation["text"] == shuffled[:5]
        assert train["text"] == shuffled[5:]

    def test_same_seed_same_split_other_seed_other_split(self) -> None:
        rows = Dataset.from_list([{"text": str(i), "emoji": "🙂"} for i in range(50)])
        first = split_rows(rows, _spec("x.jsonl", eval_rows=5, seed=1))[1]
        again = split_rows(rows, _spec("x.jsonl", eval_rows=5, seed=1))[1]
        other = split_rows(rows, _spec("x.jsonl", eval_rows=5, seed=2))[1]
        assert first is not None and again is not None and other is not None
        assert first["text"] == again["text"] != other["text"]

    def test_no_eval_rows_means_no_eval_set(self) -> None:
        rows = Dataset.from_list([{"text": "a", "emoji": "🅰️"}] * 3)
        assert split_rows(rows, _spec("x.jsonl"))[1] is None

    def test_eval_rows_larger_than_the_data_is_a_clear_error(self) -> None:
        rows = Dataset.from_list([{"text": "a", "emoji": "🅰️"}] * 3)
        with pytest.raises(RecipeError, match="eval_rows=5"):
            split_rows(rows, _spec("x.jsonl", eval_rows=5))


class TestBadRows:
    ROWS: ClassVar[list[dict[str, str]]] = [
        {"text": "I ate pizza", "emoji": "🍕"},
        {"text": "no emoji here"},
        {"text": "also none"},
        {"text": "", "emoji": "🌧️"},
        {"text": "It is sunny", "emoji": "☀️"},
    ]

    def test_bad_rows_are_counted_and_skipped(self) -> None:
        kept, report = format_rows(Dataset.from_list(self.ROWS), Task.EMOJI)
        assert len(kept) == 2
        assert report.total == 5
        assert report.reasons == {"missing field 'emoji'": 2, "empty field 'text'": 1}
        assert report.summary() == "skipped 3 of 5 rows: 2 missing field 'emoji', 1 empty field 'text'"

    def test_rows_longer_than_max_length_are_skipped(self, tiny_tokenizer: PreTrainedTokenizerFast) -> None:
        rows = [{"text": "short", "emoji": "🙂"}, {"text": "long " * 200, "emoji": "📜"}]
        kept, report = format_rows(Dataset.from_list(rows), Task.EMOJI, tiny_tokenizer, max_length=64)
        assert [m[0]["content"] for m in kept["messages"]] == ["Translate to emoji: short"]
        assert report.reasons == {"longer than max_length=64": 1}

    def test_loader_logs_one_summary_line(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        path = _write_jsonl(tmp_path / "rows.jsonl", self.ROWS)
        with caplog.at_level(logging.INFO, logger="trainer.data"):
            split = prepare_datasets(_spec(path, eval_rows=1))
        assert split.report.skipped == 3
        assert "skipped 3 of 5 rows" in caplog.text

    def test_nothing_left_to_train_on_is_an_error(self, tmp_path: Path) -> None:
        path = _write_jsonl(tmp_path / "rows.jsonl", [{"text": "x"}, {"text": "y"}])
        with pytest.raises(RecipeError, match="no training rows"):
            prepare_datasets(_spec(path))


def test_report_merge_adds_up() -> None:
    merged = SkipReport(3, Counter({"a": 1})).merge(SkipReport(2, Counter({"a": 1, "b": 1})))
    assert (merged.total, merged.skipped) == (5, 3)


def test_local_path_is_resolved_against_the_repo_root() -> None:
    assert len(load_rows(load_recipe("emoji-local").data)) >= 300


def test_missing_local_file_is_a_recipe_error() -> None:
    with pytest.raises(RecipeError, match="no such file"):
        load_rows(_spec("trainer/samples/missing.jsonl"))


def test_parquet_is_read_too(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    Dataset.from_list([{"text": "I ate pizza", "emoji": "🍕"}]).to_parquet(str(path))
    assert load_rows(_spec(path))[0] == {"text": "I ate pizza", "emoji": "🍕"}


class TestTokenizerFingerprint:
    @pytest.mark.slow
    @pytest.mark.gemma3_270m
    def test_map_fingerprint_digests_the_tokenizer_instead_of_pickling_it(self, tmp_path: Path) -> None:
        """Why: datasets pickled Gemma's whole tokenizer (~28 MB) to name each map's cache, 12-15 s a map on a busy
        machine; the digest must stay as discriminating (same files: same cache; changed tokenizer: new cache)."""
        from datasets.fingerprint import Hasher
        from datasets.utils._dill import dumps
        from transformers import AutoTokenizer

        from trainer.local_model import ensure_local_model

        model_dir = ensure_local_model()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        rows = Dataset.from_list([{"text": "I ate a banana", "emoji": "🍌"}, {"text": "rain", "emoji": "🌧"}])
        formatted, _ = format_rows(rows, Task.EMOJI, tokenizer, 128)
        assert len(formatted) == 2
        assert len(dumps(tokenizer)) < 100_000, "the fingerprint pickles the vocabulary"

        reference = Hasher.hash(tokenizer)
        again = AutoTokenizer.from_pretrained(model_dir)
        assert Hasher.hash(again) == reference, "the same tokenizer files: the cache is reused"
        again.backend_tokenizer.enable_truncation(16)  # runtime settings do not count, as in datasets
        assert Hasher.hash(again) == reference
        again.chat_template = "{{ messages[0]['content'] }}"
        assert Hasher.hash(again) != reference, "another chat template, another cache"
        again.chat_template = tokenizer.chat_template
        again.add_tokens(["<not-in-gemma>"])
        assert Hasher.hash(again) != reference, "an added token must give another cache"
