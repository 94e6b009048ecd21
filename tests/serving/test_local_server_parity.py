"""serving/local_server.py answers like vLLM where a client notices: an in-process server on 127.0.0.1.

The server is the real handler and engine (a tiny Gemma 3), started in this process so each test takes
well under a second; every request has a timeout, so a server that holds a request fails the test
instead of hanging it.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from serving.local_server import _Engine, _make_handler, open_server
from tests.serving.tiny_model import build_tiny_gemma

USER = [{"role": "user", "content": "Translate to emoji: I ate a banana"}]


class Server:
    def __init__(self, url: str, engine: _Engine) -> None:
        self.url = url
        self.engine = engine

    def post(self, path: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = build_tiny_gemma(tmp_path_factory.mktemp("parity") / "merged")
    engine = _Engine(model, "gemma")
    engine.load()
    httpd = open_server("127.0.0.1", 0, _make_handler(engine))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield Server(f"http://127.0.0.1:{httpd.server_address[1]}", engine)
    finally:
        httpd.shutdown()
        httpd.server_close()


def _text(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


class TestSamplingDefaults:
    def test_a_request_without_temperature_is_greedy(self, server: Server) -> None:
        body = {"model": "gemma", "messages": USER, "max_tokens": 8}
        answers = {_text(server.post("/v1/chat/completions", body)[1]) for _ in range(3)}
        greedy = _text(server.post("/v1/chat/completions", {**body, "temperature": 0})[1])
        assert answers == {greedy}

    def test_the_models_own_sampling_settings_never_apply(self, server: Server) -> None:
        """vLLM serves with `--generation-config vllm`: a request with temperature 1 and no top_k samples from
        every token (top_k 0), even though the export's generation_config.json keeps the base's top_k. Here the
        model's top_k is 1, which would make every sampled answer the greedy one."""
        config = server.engine.model.generation_config
        saved = (config.do_sample, config.top_k)
        config.do_sample, config.top_k = True, 1
        try:
            body = {"model": "gemma", "prompt": "Translate", "max_tokens": 8}
            greedy = _text(server.post("/v1/completions", {**body, "temperature": 0})[1])
            sampled = {_text(server.post("/v1/completions", {**body, "temperature": 1.0})[1]) for _ in range(4)}
        finally:
            config.do_sample, config.top_k = saved
        assert sampled != {greedy}
