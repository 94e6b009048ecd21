"""One name for the completion marker: the trainer writes it, the serving entrypoint and local server wait for it.

If the two drift, every served model looks incomplete (or, worse, an incomplete one looks done).
"""

from __future__ import annotations

import pytest

from serving.vllm_args import COMPLETION_MARKER


def test_trainer_and_serving_agree() -> None:
    export = pytest.importorskip("trainer.export", reason="trainer/export.py is not in this checkout yet")
    assert export.COMPLETION_MARKER == COMPLETION_MARKER
