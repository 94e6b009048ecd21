"""One name for the completion marker: the trainer writes it, the serving entrypoint and local server wait for it.

If the two drift, every served model looks incomplete (or, worse, an incomplete one looks done).
"""

from __future__ import annotations

from pathlib import Path

from serving.vllm_args import COMPLETION_MARKER
from trainer import export


def test_trainer_and_serving_agree() -> None:
    assert export.COMPLETION_MARKER == COMPLETION_MARKER


def test_the_entrypoint_and_the_local_server_use_it() -> None:
    serving = Path(__file__).resolve().parents[2] / "serving"
    assert f'COMPLETION_MARKER="{COMPLETION_MARKER}"' in (serving / "entrypoint.sh").read_text()
    demo = serving.parent / "demo"
    assert "from serving.completion import" in (demo / "local_server.py").read_text()
    assert "from serving.completion import" in (demo / "pipeline.py").read_text()


def test_the_image_carries_the_check() -> None:
    """The entrypoint runs serving/completion.py from the image; the build context must include it."""
    from infra.images import SERVING, context_files

    serving = Path(__file__).resolve().parents[2] / "serving"
    assert Path("completion.py") in context_files(SERVING)
    assert "!completion.py" in (serving / ".dockerignore").read_text().splitlines()
    assert "COPY entrypoint.sh completion.py /opt/gemma-serving/" in (serving / "Dockerfile").read_text()
