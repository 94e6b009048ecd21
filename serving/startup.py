"""The vLLM service's startup window: the one place that says how long an instance may take to start.

    from serving.startup import STARTUP_WINDOW, EXPECTED_START
    STARTUP_WINDOW.initial_delay_s    # 30: Cloud Run sends the first startup probe 30 s after start
    STARTUP_WINDOW.total_s            # 270: what the Cloud Run startup probe allows (30 + 24 x 10)
    STARTUP_WINDOW.vllm_budget_s      # 270: minus the entrypoint's marker wait (0 on Cloud Run)
    STARTUP_WINDOW.max_marker_wait_s  # 150: the longest marker wait the window allows (vLLM keeps 120 s)
    expected_start_s()                # (32, 110): the fastest and slowest start expected, from EXPECTED_START

The decision: cut the start (`COLD_START_VLLM`: eager mode, whole-file weight reads), then fit the probe to it:
an initial delay no longer than the fastest expected start, a window about 2.5 times the slowest, within the
Cloud Run limits in `PROBE_LIMITS`. The entrypoint's marker wait is subtracted from vLLM's budget here and
nowhere else; the client waits this window plus one `--timeout` for a scaled-to-zero service. The sources, and
what is unconfirmed (`EXPECTED_START` is estimated, not measured): docs/decisions/cloud-run-startup-window.md.
Standard library only (the client imports it). It does not measure anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

API_PROBE_SOURCE = (
    "Cloud Run API v2 GoogleCloudRunV2Probe (https://googleapis.deno.dev/v1/run:v2.ts, GoogleCloudRunV2Probe); "
    "pulumi-gcp cloudrunv2 ServiceTemplateContainerStartupProbe; the services page's default TCP startup probe "
    "uses timeoutSeconds 240 (https://cloud.google.com/run/docs/configuring/healthchecks)"
)
SPAN_SOURCE = (
    "https://cloud.google.com/run/docs/configuring/workerpools/healthchecks (failureThreshold x periodSeconds "
    "at most 240 s); jobs: https://docs.cloud.google.com/run/docs/configuring/jobs/healthchecks (600 s, 1800 s GPU)"
)
# The Cloud Run startup probe's limits: field -> (smallest, largest, where it is stated).
PROBE_LIMITS: dict[str, tuple[int, int, str]] = {
    "initialDelaySeconds": (0, 240, API_PROBE_SOURCE),
    "periodSeconds": (1, 240, API_PROBE_SOURCE),
    "timeoutSeconds": (1, 240, API_PROBE_SOURCE),
    "failureThresholdTimesPeriodSeconds": (1, 240, SPAN_SOURCE),
}
MAX_INITIAL_DELAY_S = PROBE_LIMITS["initialDelaySeconds"][1]
MAX_PERIOD_S = PROBE_LIMITS["periodSeconds"][1]
MAX_PROBE_SPAN_S = PROBE_LIMITS["failureThresholdTimesPeriodSeconds"][1]
# vLLM flags for a short cold start (serving.vllm_args.VllmServerConfig fields; the Cloud Run service sets them).
COLD_START_VLLM: dict[str, Any] = {"enforce_eager": True, "safetensors_load_strategy": "eager"}

# What a cold instance does between container start and its first successful probe, with COLD_START_VLLM, for
# Gemma 3 1B in bf16 (about 2 GB) on a Cloud Run L4: (step, fastest s, slowest s). Estimates, not measurements.
EXPECTED_START: tuple[tuple[str, int, int], ...] = (
    ("container start", 1, 5),
    ("entrypoint: completion check, API key guard import (python3)", 1, 5),
    ("API server process: import torch, vLLM, transformers", 10, 25),
    ("engine core process: the same imports again, CUDA init", 10, 25),
    ("weights: ~2 GB read whole over the Cloud Storage mount (80-250 MB/s), copied to the GPU", 8, 30),
    ("KV-cache memory profiling: one dummy forward pass, eager", 2, 10),
    ("torch.compile and CUDA-graph capture: skipped (--enforce-eager)", 0, 0),
    ("API server up; the next probe (every 10 s) answered", 0, 10),
)
# Without COLD_START_VLLM the review of vLLM v0.28.0 estimated 150-330 s: torch.compile with no cache and 51 graph
# sizes captured, weights read lazily page by page over the mount.


def expected_start_s() -> tuple[int, int]:
    """The fastest and slowest start EXPECTED_START adds up to."""
    return sum(low for _, low, _ in EXPECTED_START), sum(high for _, _, high in EXPECTED_START)


# Cloud Run sends the first probe this long after the container starts: no longer than the fastest expected start.
FIRST_PROBE_WITHIN_S = 30
# vLLM needs at least this long after any marker wait (imports alone take tens of seconds).
MIN_VLLM_BUDGET_S = 120


class StartupWindowError(ValueError):
    """A window Cloud Run would reject, or one that leaves vLLM too little time."""


@dataclass(frozen=True)
class StartupWindow:
    """A startup probe (`initial_delay_s`, then up to `failure_threshold` failures `period_s` apart) and the marker wait inside it."""

    initial_delay_s: int = FIRST_PROBE_WITHIN_S
    period_s: int = 10
    failure_threshold: int = 24
    timeout_s: int = 5
    marker_wait_s: int = 0

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.initial_delay_s <= MAX_INITIAL_DELAY_S:
            problems.append(f"initial_delay_s={self.initial_delay_s}: Cloud Run allows 0..{MAX_INITIAL_DELAY_S}")
        if not 1 <= self.period_s <= MAX_PERIOD_S:
            problems.append(f"period_s={self.period_s}: Cloud Run allows 1..{MAX_PERIOD_S}")
        if not 1 <= self.timeout_s <= min(self.period_s, PROBE_LIMITS["timeoutSeconds"][1]):
            problems.append(f"timeout_s={self.timeout_s}: must be 1..period_s ({self.period_s})")
        if self.failure_threshold < 1 or self.failure_threshold * self.period_s > MAX_PROBE_SPAN_S:
            problems.append(
                f"failure_threshold x period_s = {self.failure_threshold} x {self.period_s}: must be at most "
                f"{MAX_PROBE_SPAN_S} s"
            )
        if self.marker_wait_s < 0 or self.vllm_budget_s < MIN_VLLM_BUDGET_S:
            problems.append(
                f"marker_wait_s={self.marker_wait_s} leaves vLLM {self.vllm_budget_s} s of the {self.total_s} s window; "
                f"it needs at least {MIN_VLLM_BUDGET_S} s"
            )
        if problems:
            raise StartupWindowError("startup window: " + "; ".join(problems))

    @property
    def total_s(self) -> int:
        """How long Cloud Run waits for the first successful probe before it gives up on the instance."""
        return self.initial_delay_s + self.failure_threshold * self.period_s

    @property
    def max_marker_wait_s(self) -> int:
        """The longest marker wait this window allows: what is left after vLLM's minimum."""
        return self.total_s - MIN_VLLM_BUDGET_S

    @property
    def vllm_budget_s(self) -> int:
        """What is left for vLLM after the entrypoint's marker wait."""
        return self.total_s - self.marker_wait_s


STARTUP_WINDOW = StartupWindow()


# --------------------------------------------------------------------------- the official openai client on a cold service

# While no instance is ready, Cloud Run holds a request for up to 60 s, then answers 429 ("Incoming requests queue
# for up to 60 seconds ... the request fails with a 429 error code": cloud.google.com/run/docs/configuring/max-instances).
CLOUD_RUN_QUEUE_S = 60
# openai-python's retry backoff (openai/_constants.py and `_calculate_retry_timeout` in openai/_base_client.py,
# openai 3.57.0): 0.5 s doubling up to 8 s, minus up to 25 % jitter; 429 is retried; DEFAULT_MAX_RETRIES is 2.
OPENAI_INITIAL_RETRY_DELAY_S = 0.5
OPENAI_MAX_RETRY_DELAY_S = 8.0
OPENAI_DEFAULT_MAX_RETRIES = 2
# Per try: longer than Cloud Run's hold, plus an answer of a few dozen tokens.
OPENAI_TIMEOUT_S = 120.0


def openai_covers_s(max_retries: int, queue_s: float = CLOUD_RUN_QUEUE_S, scale: float = 1.0) -> float:
    """The shortest time the openai client keeps trying with `max_retries` while every try is held `queue_s`, then
    429: one hold per try plus the smallest backoffs (the most jitter)."""
    backoff = sum(
        0.75 * min(OPENAI_INITIAL_RETRY_DELAY_S * 2.0**i, OPENAI_MAX_RETRY_DELAY_S) for i in range(max_retries)
    )
    return (max_retries + 1) * queue_s * scale + backoff * scale


def openai_cold_start_settings(window: StartupWindow = STARTUP_WINDOW) -> dict[str, float | int]:
    """`max_retries` and `timeout` for `openai.OpenAI(...)` that outlast a cold start: tries for the whole startup
    window plus one more hold (the instance is scheduled and its image pulled before the window's clock starts)."""
    needed = window.total_s + CLOUD_RUN_QUEUE_S
    retries = next(n for n in range(100) if openai_covers_s(n) >= needed)
    return {"max_retries": retries, "timeout": OPENAI_TIMEOUT_S}


OPENAI_COLD_START = openai_cold_start_settings()
