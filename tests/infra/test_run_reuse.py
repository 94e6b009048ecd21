"""tests/infra/conftest.py reuses an identical offline run only where the test cannot have changed it.

Why it matters: a reused run that a test had changed (a patched function, a file in a temporary folder) would
hand that test another run's result, and a stability test comparing two identical runs would compare one
run with its copy; both must run the program anew.
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


@pytest.mark.fresh_runs
def test_a_test_marked_fresh_runs_makes_every_run() -> None:
    before = _kept()
    run(12)
    assert _kept() == before, "a fresh_runs test's run was kept for reuse"


def test_a_test_that_can_patch_makes_every_run(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _kept()
    run(13)
    assert _kept() == before, "the run of a test with monkeypatch was kept for reuse"
