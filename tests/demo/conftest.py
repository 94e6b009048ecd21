"""Fixtures for the demo tests: a tiny merged Gemma folder the local server loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import build_tiny_gemma


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gemma(tmp_path_factory.mktemp("tiny-gemma") / "merged")
