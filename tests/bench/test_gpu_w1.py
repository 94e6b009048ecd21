"""bench/gpu_w1.py's W1 measurements compare like with like.

The profiled update is not timed: torch.profiler adds a few µs of host work to every operation, which slows a
host-bound eager step and hardly a compiled one, so a mean over it would understate the eager MFU and flatter
compiling. Here a stand-in profiler makes each forward of its update 2 s slower.

The DDP runs compute as the unwrapped one does. With one process accelerate wraps nothing, so the check builds
the DDP wrapper itself and the Trainer's loop keeps it, preparing only the optimizer (transformers 5.23 trainer.py
`_inner_training_loop`: `use_accelerator_prepare = model is self.model`). accelerate's `prepare_model` is also where
the run's mixed precision comes from (its autocast around the model's forward, accelerate 1.15 accelerator.py), so
a bare `DDP(model)` trained W1's bf16 stack without autocast: peft then runs LoRA in fp32 with casts around it, and
the wrapper's overhead ratio measured that. Here on a CPU with bf16 autocast asked for (`use_cpu`, `bf16`), the
first decoder layer reports the autocast state it runs under, unwrapped and in DDP (gloo, one rank).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch

from bench import gpu_w1
from trainer import regional_compile

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture
def loopback_rendezvous(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_ddp_runs_train_under_the_runs_autocast_like_the_unwrapped_run(
    tmp_path: Path, loopback_rendezvous: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_w1, "DRY_RUN_STEPS", (3, 1))  # bf16 on a CPU is slow: one micro-step per update
    bf16_on_cpu = ("training.compile=none", "training.extra.use_cpu=true", "training.extra.bf16=true")
    seen: dict[str, set[bool]] = {}
    for name, wrap in (("no wrapper", None), ("ddp", gpu_w1.ddp_wrap(False, False, "gloo"))):
        model = gpu_w1.stack_model(6, dry_run=True)
        states = seen.setdefault(name, set())
        layer = regional_compile.decoder_layers(model)[0]
        layer.register_forward_pre_hook(lambda *_, states=states: states.add(torch.is_autocast_enabled("cpu")))
        run = gpu_w1.train_stack(model, tmp_path, name.replace(" ", "-"), bf16_on_cpu, wrap=wrap, dry_run=True)
        assert run["tokens_per_micro_step"] > 0
        assert (run["ddp"] is None) is (wrap is None), run["ddp"]
    assert seen == {"no wrapper": {True}, "ddp": {True}}, seen


def test_the_profiled_update_is_not_timed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profiling: list[bool] = []

    class SlowProfiler:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def __enter__(self) -> SlowProfiler:
            profiling.append(True)
            return self

        def __exit__(self, *exc: object) -> None:
            profiling.clear()

        def events(self) -> list[object]:
            return []

    monkeypatch.setattr(torch.profiler, "profile", SlowProfiler)
    model = gpu_w1.stack_model(6, dry_run=True)
    layer = regional_compile.decoder_layers(model)[0]
    layer.register_forward_pre_hook(lambda *_: time.sleep(2.0) if profiling else None)
    run = gpu_w1.train_stack(model, tmp_path, "timed", ("training.compile=none",), dry_run=True)
    assert run["profiled_update_s"] >= 4.0, run  # its two micro-steps, 2 s each
    assert run["seconds_per_micro_step"] < 1.5, run
