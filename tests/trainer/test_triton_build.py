"""trl's fused LM head picks its Triton kernel on a CUDA device only where Triton can build its driver stub.

Why it matters: trl 1.16 launches Triton kernels on every CUDA training step whenever the triton package is
installed (`trl/kernels/chunked_logprob.py` `_use_triton`), and Triton 3.7 compiles its driver stub at the
first launch with $CC, gcc or clang and Python.h (`triton/runtime/build.py` `_build`): without them every
recipe crashed at its first step. The image now has them (tests/trainer/test_launch_image.py); anywhere
else, trl's torch kernel is chosen instead of a crash. No GPU here: the selection runs with a `cuda`
device reported and Triton reported installed, the compiler and the header present or not.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainer import triton_build

CUDA = torch.device("cuda")


@pytest.fixture
def trl_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """trl's chunked_logprob with its own `_use_triton` and Triton reported installed, restored afterwards."""
    from trl.kernels import chunked_logprob

    # trl's own choice: a trainer built earlier in this process may have installed the guard already
    own = getattr(chunked_logprob._use_triton, "__wrapped__", chunked_logprob._use_triton)
    monkeypatch.setattr(chunked_logprob, "_use_triton", own)
    monkeypatch.setattr(chunked_logprob, "_TRITON_AVAILABLE", True)
    monkeypatch.delenv("CC", raising=False)
    triton_build.triton_builds_here.cache_clear()
    yield chunked_logprob
    triton_build.triton_builds_here.cache_clear()


def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, compiler: str | None, header: bool) -> None:
    """PATH holds only `compiler` (an executable file), and the Python include folder has Python.h or not."""
    bin_dir, include = tmp_path / "bin", tmp_path / "include"
    bin_dir.mkdir()
    include.mkdir()
    if compiler:
        tool = bin_dir / compiler
        tool.write_text("#!/bin/sh\nexit 0\n")
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    if header:
        (include / "Python.h").write_text("")
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(triton_build, "python_include_dir", lambda: include)


def test_trl_alone_picks_triton_on_cuda_even_without_a_compiler(trl_kernels, tmp_path, monkeypatch):
    """The crash this guards against: trl's own choice ignores what Triton needs to build."""
    machine(tmp_path, monkeypatch, compiler=None, header=False)
    assert trl_kernels._use_triton(CUDA) is True
    assert triton_build.missing_for_triton_build()  # and Triton could not build here


@pytest.mark.parametrize(
    ("compiler", "header", "triton"),
    [("gcc", True, True), ("clang", True, True), (None, True, False), ("gcc", False, False), (None, False, False)],
)
def test_the_kernel_selected_on_cuda_is_one_this_machine_can_run(
    trl_kernels, tmp_path, monkeypatch, compiler, header, triton
):
    machine(tmp_path, monkeypatch, compiler=compiler, header=header)
    triton_build.use_triton_only_where_it_builds()
    assert trl_kernels._use_triton(CUDA) is triton
    assert trl_kernels._use_triton(torch.device("xpu")) is triton
    assert trl_kernels._use_triton(torch.device("cpu")) is False  # trl's choice on a CPU is untouched


def test_cc_counts_as_a_compiler(trl_kernels, tmp_path, monkeypatch):
    machine(tmp_path, monkeypatch, compiler=None, header=True)
    monkeypatch.setenv("CC", os.devnull)
    triton_build.use_triton_only_where_it_builds()
    assert trl_kernels._use_triton(CUDA) is True


def test_the_image_picks_triton(trl_kernels, tmp_path, monkeypatch):
    """What the trainer image holds (test_launch_image.py checks its final stage installs it): gcc on PATH and
    Python.h in the include folder of its Python, so trl's Triton kernel, the fast one, is kept on CUDA."""
    from tests.trainer.test_launch_image import DOCKERFILE, apt_packages, final_stage

    packages = apt_packages(final_stage(DOCKERFILE.read_text()))
    compiler = next(name for name in triton_build.COMPILERS if name in packages)
    python = next(p for p in packages if p.startswith("python3.") and p.endswith("-dev"))
    machine(tmp_path, monkeypatch, compiler=compiler, header=bool(python))
    triton_build.use_triton_only_where_it_builds()
    assert trl_kernels._use_triton(CUDA) is True


def test_a_missing_compiler_warns_once(trl_kernels, tmp_path, monkeypatch, caplog):
    machine(tmp_path, monkeypatch, compiler=None, header=True)
    triton_build.use_triton_only_where_it_builds()
    with caplog.at_level("WARNING", logger="trainer.triton_build"):
        for _ in range(3):
            assert trl_kernels._use_triton(CUDA) is False
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "C compiler" in caplog.records[0].getMessage()
