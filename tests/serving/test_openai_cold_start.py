"""The official `openai` client against a Cloud Run cold start, scaled down in time (1 s here = 100 s there).

A fake Cloud Run front end on 127.0.0.1 holds each request for up to the queue time (60 s there), then answers
429, until the instance is ready after the whole startup window (270 s there); a request held when it becomes
ready is answered. The client's own backoff constants are scaled by the same factor, so every ratio is the one
the cloud has. The settings the README shows (`serving.startup.OPENAI_COLD_START`) must get an answer; the
client's defaults must not.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from serving.startup import (
    CLOUD_RUN_QUEUE_S,
    OPENAI_COLD_START,
    OPENAI_DEFAULT_MAX_RETRIES,
    OPENAI_INITIAL_RETRY_DELAY_S,
    OPENAI_MAX_RETRY_DELAY_S,
    STARTUP_WINDOW,
    openai_covers_s,
)
from tests.serving.fake_server import completion

openai = pytest.importorskip("openai", reason="the openai client is a test dependency (requirements-dev.txt)")
from openai import _base_client, _constants  # noqa: E402

SCALE = 0.01
README = Path(__file__).resolve().parents[2] / "serving" / "README.md"
PROMPT = [{"role": "user", "content": "Translate to emoji: I love pizza"}]


class ColdService:
    """Ready `ready_after_s` after the first request; until then each request is held up to `queue_s`, then 429."""

    def __init__(self, ready_after_s: float, queue_s: float) -> None:
        self.ready_after_s, self.queue_s = ready_after_s, queue_s
        self.first: float | None = None
        self.tries = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                now = time.monotonic()
                outer.first = outer.first or now
                outer.tries += 1
                ready_at = outer.first + outer.ready_after_s
                time.sleep(max(0.0, min(now + outer.queue_s, ready_at) - now))
                ok = time.monotonic() >= ready_at
                body = json.dumps(completion("🍕") if ok else {"error": "Rate exceeded."}).encode()
                self.send_response(200 if ok else 429)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"


@pytest.fixture
def cold_service(monkeypatch: pytest.MonkeyPatch) -> Iterator[ColdService]:
    # the client's backoff, scaled like the rest (the constants serving/startup.py states, read from openai 3.57.0)
    assert (_constants.INITIAL_RETRY_DELAY, _constants.MAX_RETRY_DELAY) == (
        OPENAI_INITIAL_RETRY_DELAY_S,
        OPENAI_MAX_RETRY_DELAY_S,
    )
    assert _constants.DEFAULT_MAX_RETRIES == OPENAI_DEFAULT_MAX_RETRIES
    monkeypatch.setattr(_base_client, "INITIAL_RETRY_DELAY", OPENAI_INITIAL_RETRY_DELAY_S * SCALE)
    monkeypatch.setattr(_base_client, "MAX_RETRY_DELAY", OPENAI_MAX_RETRY_DELAY_S * SCALE)
    service = ColdService(STARTUP_WINDOW.total_s * SCALE, CLOUD_RUN_QUEUE_S * SCALE)
    thread = threading.Thread(target=service.httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield service
    finally:
        service.httpd.shutdown()
        service.httpd.server_close()


def test_the_documented_settings_outlast_a_cold_start(cold_service: ColdService) -> None:
    settings = OPENAI_COLD_START
    client = openai.OpenAI(
        base_url=cold_service.url,
        api_key="id-token",
        max_retries=int(settings["max_retries"]),
        timeout=settings["timeout"] * SCALE,
    )
    started = time.monotonic()
    answer = client.chat.completions.create(model="gemma", messages=PROMPT)
    assert answer.choices[0].message.content == "🍕"
    assert time.monotonic() - started >= STARTUP_WINDOW.total_s * SCALE
    assert cold_service.tries <= int(settings["max_retries"]) + 1


def test_the_clients_defaults_give_up_within_a_cold_start(cold_service: ColdService) -> None:
    client = openai.OpenAI(base_url=cold_service.url, api_key="id-token", timeout=OPENAI_COLD_START["timeout"] * SCALE)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="gemma", messages=PROMPT)
    assert cold_service.tries == OPENAI_DEFAULT_MAX_RETRIES + 1


def test_the_readme_shows_those_settings() -> None:
    text = README.read_text()
    shown = re.findall(r"max_retries=(\d+), timeout=(\d+)", text)
    assert shown, "serving/README.md shows the openai settings for a cold service"
    for retries, timeout in shown:
        assert (int(retries), float(timeout)) == (OPENAI_COLD_START["max_retries"], OPENAI_COLD_START["timeout"])
    retries_shown = int(shown[0][0])
    assert f"at least {int(openai_covers_s(retries_shown))} s ({retries_shown + 1} holds" in text
    assert f"longer than the {STARTUP_WINDOW.total_s} s window" in text
