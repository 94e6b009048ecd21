"""The vLLM service's startup window: the one place that says how long an instance may take to start.

    from serving.startup import STARTUP_WINDOW
    STARTUP_WINDOW.total_s          # 480: what the Cloud Run startup probe allows
    STARTUP_WINDOW.vllm_budget_s    # 480: minus the entrypoint's marker wait (0 by default)

Why 480 s. A cold instance must, before its first answer: start the container (about 5 s for
Cloud Run GPU instances, plus the image pull), import vLLM and torch, read the weights lazily
over the Cloud Storage mount (about 2 GB for Gemma 3 1B in bf16), profile memory for the KV
cache, compile and capture CUDA graphs, and, if the entrypoint is told to, wait for the
trainer's completion marker. Those steps are not measured on Cloud Run L4 for this model
(UNCONFIRMED); the previous 240 s window (30 s + 21 x 10 s) left no margin for them.

The limits, from the sources:
- Cloud Run API v2 `Probe`: `initialDelaySeconds` and `periodSeconds` are each at most 240 for a
  startup probe (googleapis run/v2 `GoogleCloudRunV2Probe`; also pulumi-gcp's
  `ServiceTemplateContainerStartupProbeArgs` docs).
- Cloud Run docs: the startup probe's `failureThreshold x periodSeconds` may not exceed 240 s
  (services page, older snapshot; worker pools page); the current jobs page says 600 s, and
  1800 s for GPU (docs.cloud.google.com/run/docs/configuring/jobs/healthchecks). Whether the
  GPU allowance applies to services is UNCONFIRMED, so this window stays within 240 s for
  `failureThreshold x periodSeconds`.
- The initial delay counts separately from `failureThreshold x periodSeconds`, so the window is
  `initialDelaySeconds + failureThreshold x periodSeconds` = 240 + 24 x 10 = 480 s.

The entrypoint's wait for the marker (`GEMMA_FT_WAIT_FOR_MODEL_S`) runs inside this window, so
`marker_wait_s` is subtracted from what vLLM gets; the Pulumi program passes both numbers to the
container and the entrypoint refuses a wait that leaves vLLM nothing. The client allows a
scaled-to-zero service this long to answer its first request.

Standard library only (the client imports it). It does not measure anything.
"""

from __future__ import annotations

from dataclasses import dataclass

# Cloud Run API v2 Probe: initial_delay_seconds and period_seconds are at most 240 for startup probes.
MAX_INITIAL_DELAY_S = 240
MAX_PERIOD_S = 240
# failureThreshold x periodSeconds: 240 s in the services documentation we could confirm (see above).
MAX_PROBE_SPAN_S = 240
# vLLM needs at least this long after any marker wait (imports alone take tens of seconds).
MIN_VLLM_BUDGET_S = 120


class StartupWindowError(ValueError):
    """A window Cloud Run would reject, or one that leaves vLLM too little time."""


@dataclass(frozen=True)
class StartupWindow:
    """A startup probe (`initial_delay_s`, then up to `failure_threshold` failures `period_s` apart) and the marker wait inside it."""

    initial_delay_s: int = 240
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
        if not 1 <= self.timeout_s <= self.period_s:
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
    def vllm_budget_s(self) -> int:
        """What is left for vLLM after the entrypoint's marker wait."""
        return self.total_s - self.marker_wait_s


STARTUP_WINDOW = StartupWindow()
