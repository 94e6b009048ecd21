"""tests/infra/conftest.py reuses an identical offline run only where the test cannot have changed it.

Why it matters: a reused run that a test had changed (a patched function, a file in a temporary folder) would
hand that test another run's result, and a stability test comparing two identical runs would compare one
run with its copy: the first runs the program anew, the second gets a new run for each repeat.
"""

from __future__ import annotations

from typing import Any

import pytest

from infra.offline.engine import StackRun, run_stack
from tests.infra import conftest as infra_conftest


def run(ceiling: int) -> StackRun:
    """A dev run no other test makes (its own cost ceiling): whether it is kept is seen in the cache's size."""
    return run_stack("dev", overrides={"recipe": "emoji-local", "maxRunCostUsd": ceiling}, hf_token=None)


def test_an_identical_run_is_made_once_and_handed_out_as_copies() -> None:
    before = len(infra_conftest._runs)
    first = run(11)
    assert len(infra_conftest._runs) == before + 1, "the run was not kept for the next identical one"
    second = run(11)
    assert len(infra_conftest._runs) == before + 1, "the identical run was made again"
    assert second is not first and second.outputs == first.outputs
    second.outputs.clear()
    assert run(11).outputs == first.outputs, "a change to a copy reached the kept run"


def _kept() -> dict[str, Any]:
    return dict(infra_conftest._runs)


def test_an_identical_run_repeated_within_one_test_is_made_anew() -> None:
    """Two identical runs compared in one test (a stability check, a fixture and its test) must be two runs."""
    made: list[str] = []
    program_run = infra_conftest._program_run

    def counting(stack: str, *args: Any, **kwargs: Any) -> StackRun:
        made.append(stack)
        return program_run(stack, *args, **kwargs)

    infra_conftest._program_run = counting  # not monkeypatch: that fixture turns the reuse off
    try:
        run(12)
        run(12)
        run(12)
    finally:
        infra_conftest._program_run = program_run
    assert made == ["dev", "dev", "dev"], f"{len(made)} of 3 identical runs in one test were made"


def test_a_test_that_can_patch_makes_every_run(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _kept()
    run(13)
    assert _kept() == before, "the run of a test with monkeypatch was kept for reuse"
