"""The vLLM service's startup window: the one place that says how long an instance may take to start.

    from serving.startup import STARTUP_WINDOW, EXPECTED_START
    STARTUP_WINDOW.initial_delay_s    # 30: Cloud Run sends the first startup probe 30 s after start
    STARTUP_WINDOW.total_s            # 270: what the Cloud Run startup probe allows (30 + 24 x 10)
    STARTUP_WINDOW.max_marker_wait_s  # 150: the longest marker wait the window allows (vLLM keeps 120 s)
    expected_start_s()                # (32, 110): the fastest and slowest start expected, from EXPECTED_START
    cold_start(62, Loader.STREAMER, large=True).from_request_s()   # a served model's cold start, from the request

The decision: cut the start (`COLD_START_VLLM`: eager mode, whole-file weight reads), then fit the probe to it:
an initial delay no longer than the fastest expected start, a window about 2.5 times the slowest, within the
Cloud Run limits in `PROBE_LIMITS`. The entrypoint's marker wait is subtracted from vLLM's budget here and
nowhere else; the client waits this window plus one `--timeout`. Every served model gets its own estimate from the
request and window (`cold_start`, `window_for`). Sources and what is unconfirmed (all estimated, nothing measured):
docs/cloud-run.md#a-short-start-and-a-probe-fitted-to-it, docs/serving.md. Standard library only (the client imports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
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


# --------------------------------------------------------------------------- a served model's cold start, from the request


class Loader(StrEnum):
    """How vLLM reads the weights: over the Cloud Storage volume (gcsfuse, one stream per file, whole files with
    `--safetensors-load-strategy eager`) or straight from gs:// with the Run:ai streamer (`--load-format
    runai_streamer`, files read in parallel chunks)."""

    MOUNT = "mount"
    STREAMER = "streamer"


# MB/s each loader reads a checkpoint at (fastest, slowest). Mount: the range EXPECTED_START assumes; Google's
# GPU best practices say the FUSE volume "does not parallelize the download" (cloud.google.com/run/docs/configuring/
# services/gpu-best-practices). Streamer: parallel range reads (RUNAI_STREAMER_CONCURRENCY), without Direct VPC
# egress. Both UNCONFIRMED on Cloud Run: estimates, not measurements.
LOADER_MB_S: dict[Loader, tuple[int, int]] = {Loader.MOUNT: (250, 80), Loader.STREAMER: (1500, 400)}
# Before the container starts, so before the probe's clock: Cloud Run states instances with GPUs start in about 5 s
# (cloud.google.com/run/docs/configuring/services/gpu: "plus the time to load the container and the model"); the
# serving image is the ~10 GB vLLM image, streamed by Cloud Run (size and speed UNCONFIRMED).
INSTANCE_S = (5, 30)
IMAGE_PULL_S = (15, 90)


@dataclass(frozen=True)
class ColdStart:
    """The steps between a request to a service with no instance and the first answer, each (step, fastest s,
    slowest s); the first `before_container` of them happen before the container starts."""

    parts: tuple[tuple[str, int, int], ...]
    before_container: int = 2

    def from_request_s(self) -> tuple[int, int]:
        return sum(low for _, low, _ in self.parts), sum(high for _, _, high in self.parts)

    def in_container_s(self) -> tuple[int, int]:
        inside = self.parts[self.before_container :]
        return sum(low for _, low, _ in inside), sum(high for _, _, high in inside)

    def lines(self) -> list[str]:
        return [f"{step}: {low}-{high} s" for step, low, high in self.parts]


def cold_start(weights_gb: float, loader: Loader, large: bool = False) -> ColdStart:
    """The cold start of a model with `weights_gb` of weights read by `loader`. `large`: a model whose engine start
    takes longer (a 31B: its profiling pass, and Triton compiling the attention kernels Gemma 4 runs on, with no
    cache on a fresh instance)."""
    fast_mb_s, slow_mb_s = LOADER_MB_S[loader]
    how = "over the Cloud Storage volume" if loader is Loader.MOUNT else "from gs:// with the Run:ai streamer"
    weights = (
        f"weights: {weights_gb:.1f} GB read {how} ({slow_mb_s}-{fast_mb_s} MB/s), copied to the GPU",
        math.floor(weights_gb * 1000 / fast_mb_s),
        math.ceil(weights_gb * 1000 / slow_mb_s),
    )
    engine = (15, 90) if large else (2, 20)
    return ColdStart(
        (
            ("instance and GPU attached", *INSTANCE_S),
            ("serving image pulled (streamed)", *IMAGE_PULL_S),
            ("entrypoint: completion check, API key guard import", 1, 5),
            ("imports: torch, vLLM, transformers in the API server and the engine core, CUDA init", 20, 50),
            weights,
            ("engine start: KV-cache profiling pass (eager), kernels compiled, API server up", *engine),
            ("the next startup probe (every 10 s) answered", 0, 10),
        )
    )


def window_for(cold: ColdStart) -> StartupWindow:
    """The startup probe for `cold`: the window is 1.5 x its slowest start in the container (rounded up to 10 s),
    reached with the longest span Cloud Run allows (24 x 10 s) after an initial delay of the rest, never shorter than
    `STARTUP_WINDOW`'s 30 s nor longer than Cloud Run's 240 s. A window that still falls short of the slowest start
    is reported by `covers`."""
    _, slowest = cold.in_container_s()
    needed = math.ceil(1.5 * slowest / 10) * 10
    span = STARTUP_WINDOW.period_s * STARTUP_WINDOW.failure_threshold
    initial = min(MAX_INITIAL_DELAY_S, max(FIRST_PROBE_WITHIN_S, needed - span))
    return StartupWindow(initial_delay_s=initial)


def covers(window: StartupWindow, cold: ColdStart) -> bool:
    """Whether the window outlasts the slowest start in the container."""
    return window.total_s >= cold.in_container_s()[1]


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
