"""serving/startup.py: the probe is fitted to the start it states, step by step."""

from __future__ import annotations

from serving.startup import COLD_START_VLLM, EXPECTED_START, STARTUP_WINDOW, expected_start_s
from serving.vllm_args import VllmServerConfig, render_args


def test_the_first_probe_comes_no_later_than_the_fastest_expected_start() -> None:
    """Until the initial delay ends Cloud Run sends no probe: a start faster than it would sit idle on a billed L4."""
    fastest, _ = expected_start_s()
    assert STARTUP_WINDOW.initial_delay_s <= fastest


def test_the_window_holds_the_slowest_expected_start_twice() -> None:
    _, slowest = expected_start_s()
    assert 2 * slowest <= STARTUP_WINDOW.total_s


def test_every_step_is_stated_with_its_range() -> None:
    assert len(EXPECTED_START) >= 6
    for step, low, high in EXPECTED_START:
        assert step and 0 <= low <= high, step
    assert expected_start_s() == (sum(s[1] for s in EXPECTED_START), sum(s[2] for s in EXPECTED_START))


def test_the_cold_start_settings_render_the_flags_the_estimate_assumes() -> None:
    """No torch.compile or CUDA-graph capture (vLLM: enforce_eager sets -cc.mode=none -cc.cudagraph_mode=none,
    vllm/config/vllm.py), weights read whole (vllm/config/load.py `safetensors_load_strategy`), v0.28.0."""
    args = render_args(VllmServerConfig(**COLD_START_VLLM))
    assert "--enforce-eager" in args
    assert args[args.index("--safetensors-load-strategy") + 1] == "eager"
