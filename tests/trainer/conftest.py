"""Shared fixtures for trainer tests: tiny model folders are built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from tests.trainer import tiny


@pytest.fixture(scope="session")
def tiny_tokenizer_session() -> PreTrainedTokenizerFast:
    return tiny.tiny_tokenizer()


@pytest.fixture
def tiny_tokenizer(tiny_tokenizer_session: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    return tiny_tokenizer_session


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.save_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3")


@pytest.fixture(scope="session")
def tiny_gemma4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.save_tiny_model(tmp_path_factory.mktemp("tiny-gemma4"), "gemma4")
