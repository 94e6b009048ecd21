"""demo/local_server.py answers like vLLM where a client notices: an in-process server on 127.0.0.1.

The server is the real handler and engine (a tiny Gemma 3), started in this process so each test takes
well under a second; every request has a timeout, so a server that holds a request fails the test
instead of hanging it.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from demo import local_server
from demo.local_server import _Engine, _make_handler, open_server
from tests.tiny_models import build_tiny_gemma

USER = [{"role": "user", "content": "Translate to emoji: I ate a banana"}]
CONTEXT = 1024  # the tiny model's max_position_embeddings: vLLM's max_model_len for it


class Server:
    def __init__(self, url: str, engine: _Engine) -> None:
        self.url = url
        self.engine = engine

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def stream(self, path: str, body: dict[str, Any], timeout: float = 60) -> list[dict[str, Any]]:
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

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
    model = build_tiny_gemma(tmp_path_factory.mktemp("parity") / "merged", max_position_embeddings=CONTEXT)
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


@contextmanager
def scripted(engine: _Engine, text: str, delay_s: float = 0.0) -> Iterator[None]:
    """Make the model say `text` (one token per character with the tiny tokenizer, which decodes them joined by
    spaces), then end of sequence: every forward pass puts all its weight on the next token of the script, after
    `delay_s` (a slow model)."""
    ids = [engine.tokenizer.convert_tokens_to_ids(c) for c in text] + [engine.tokenizer.eos_token_id]
    original = engine.model.forward
    calls = 0

    def forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        out = original(*args, **kwargs)
        out.logits[:, -1, :] = -1e4
        out.logits[:, -1, ids[min(calls, len(ids) - 1)]] = 1e4
        calls += 1
        time.sleep(delay_s)
        return out

    engine.model.forward = forward
    try:
        yield
    finally:
        del engine.model.forward


def _streamed_text(chunks: list[dict[str, Any]]) -> str:
    out = ""
    for chunk in chunks:
        for choice in chunk["choices"]:
            out += choice.get("delta", {}).get("content") or choice.get("text") or ""
    return out


def _raw(server: Server, data: bytes, timeout: float = 10) -> bytes:
    """Send `data` on a fresh connection and read what comes back until the server closes it (or `timeout`)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(data)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
        return got


class TestSamplingItCannotApply:
    """vLLM applies these (SamplingParams, v0.28.0); the local server does not, so it must say so, not answer as if
    they were applied. Their neutral values (what the openai client sends when asked for them) pass."""

    @pytest.mark.parametrize(
        ("param", "value", "neutral"),
        [
            ("frequency_penalty", 0.5, 0.0),
            ("presence_penalty", -1.0, 0.0),
            ("repetition_penalty", 1.3, 1.0),
            ("min_p", 0.1, 0.0),
            ("logit_bias", {"42": 5}, {}),
        ],
    )
    def test_refused_unless_neutral(self, server: Server, param: str, value: Any, neutral: Any) -> None:
        body = {"model": "gemma", "prompt": "x", "max_tokens": 1}
        status, answer = server.post("/v1/completions", {**body, param: value})
        assert status == 400, answer
        assert (answer["error"]["param"], answer["error"]["type"]) == (param, "BadRequestError")
        assert "not supported by the local server" in answer["error"]["message"]
        status, answer = server.post("/v1/completions", {**body, param: neutral})
        assert status == 200, answer


class TestStopAndSeed:
    def test_stop_strings_end_the_answer_before_them(self, server: Server) -> None:
        """The script decodes as "a b S T O P c d": the answer ends before the stop string, which is not in it."""
        body = {"model": "gemma", "messages": USER, "max_tokens": 20, "stop": ["O P", "zz"]}
        with scripted(server.engine, "abSTOPcd"):
            status, answer = server.post("/v1/chat/completions", body)
        assert status == 200, answer
        choice = answer["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"], choice["stop_reason"]) == (
            "a b S T ",
            "stop",
            "O P",
        )
        with scripted(server.engine, "abSTOPcd"):
            chunks = server.stream("/v1/chat/completions", body)
        assert _streamed_text(chunks) == "a b S T "
        assert (chunks[-1]["choices"][0]["finish_reason"], chunks[-1]["choices"][0]["stop_reason"]) == ("stop", "O P")

    def test_the_same_seed_samples_the_same_answer(self, server: Server) -> None:
        body = {"model": "gemma", "prompt": "Translate", "max_tokens": 12, "temperature": 1.0}
        first = _text(server.post("/v1/completions", {**body, "seed": 7})[1])
        again = _text(server.post("/v1/completions", {**body, "seed": 7})[1])
        others = {_text(server.post("/v1/completions", {**body, "seed": s})[1]) for s in (8, 9, 10)}
        assert first == again
        assert others != {first}


class TestLengthRules:
    def test_max_tokens_zero_is_refused_as_vllm_does(self, server: Server) -> None:
        status, answer = server.post("/v1/completions", {"model": "gemma", "prompt": "x", "max_tokens": 0})
        assert status == 400
        assert answer == {
            "error": {
                "message": "max_tokens must be at least 1, got 0.",
                "type": "BadRequestError",
                "param": "max_tokens",
                "code": 400,
            }
        }

    def test_more_than_512_tokens_are_allowed_up_to_the_context(self, server: Server) -> None:
        with scripted(server.engine, "ok"):
            status, answer = server.post("/v1/completions", {"model": "gemma", "prompt": "x", "max_tokens": 600})
        assert status == 200, answer
        assert _text(answer).replace(" ", "") == "ok"
        status, answer = server.post("/v1/completions", {"model": "gemma", "prompt": "x", "max_tokens": CONTEXT + 1})
        assert status == 400
        assert answer["error"]["message"].startswith(f"max_tokens={CONTEXT + 1} cannot be greater than max_model_len")

    def test_a_prompt_longer_than_the_context_is_refused_at_once(self, server: Server) -> None:
        started = time.monotonic()
        body = {"model": "gemma", "prompt": "a" * (CONTEXT - 5), "max_tokens": 10}
        status, answer = server.post("/v1/completions", body, timeout=20)
        assert time.monotonic() - started < 10
        assert status == 400, answer
        error = answer["error"]
        assert (error["type"], error["param"], error["code"]) == ("BadRequestError", "input_tokens", 400)
        assert error["message"].startswith(f"This model's maximum context length is {CONTEXT} tokens. However, you")


class TestBodies:
    def test_a_content_length_that_is_not_a_number_is_answered_400(self, server: Server) -> None:
        got = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: lots\r\n\r\n{}")
        assert got.startswith(b"HTTP/1.1 400"), got[:200]
        assert b'"BadRequestError"' in got

    def test_an_enormous_content_length_is_answered_413_without_reading(self, server: Server) -> None:
        got = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n{}")
        assert got.startswith(b"HTTP/1.1 413"), got[:200]

    def test_a_body_that_never_arrives_does_not_hold_a_thread(
        self, server: Server, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(local_server, "BODY_READ_TIMEOUT_S", 0.5, raising=False)
        started = time.monotonic()
        got = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{}")
        assert got.startswith(b"HTTP/1.1 408"), got[:200]
        assert time.monotonic() - started < 5


class TestStreams:
    def test_an_abandoned_stream_stops_generating_and_frees_the_model(self, server: Server) -> None:
        body = {"model": "gemma", "prompt": "x", "max_tokens": 400, "stream": True}
        data = json.dumps(body).encode()
        request = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        with scripted(server.engine, "a" * 390, delay_s=0.02):  # about 8 s if it ran to the end
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                sock.sendall(request)
                got = b""
                while b"data: " not in got:
                    got += sock.recv(4096)
            started = time.monotonic()  # the client has gone; the next request must not wait for the rest
            status, answer = server.post("/v1/completions", {"model": "gemma", "prompt": "y", "max_tokens": 2}, 10)
            waited = time.monotonic() - started
        assert status == 200, answer
        assert waited < 3, f"the next request waited {waited:.1f} s behind the abandoned stream"

    def test_an_abandoned_request_stops_generating_and_frees_the_model(self, server: Server) -> None:
        """vLLM cancels a request whose client went away, streamed or not (`with_cancellation` on the chat and
        completion routes, vllm/entrypoints/openai/*/api_router.py, v0.28.0): an openai client that timed out and
        retries must not wait behind the answer nobody reads."""
        data = json.dumps({"model": "gemma", "prompt": "x", "max_tokens": 400}).encode()
        request = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        with scripted(server.engine, "a" * 390, delay_s=0.02):  # about 8 s if it ran to the end
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                sock.sendall(request)
                time.sleep(0.5)  # generating now
            started = time.monotonic()  # the client has gone; the next request must not wait for the rest
            status, answer = server.post("/v1/completions", {"model": "gemma", "prompt": "y", "max_tokens": 2}, 10)
            waited = time.monotonic() - started
        assert status == 200, answer
        assert waited < 3, f"the next request waited {waited:.1f} s behind the abandoned request"

    def test_streamed_and_whole_answers_are_the_same_text_untrimmed(self, server: Server) -> None:
        """vLLM returns the decoded text as it is; the local server trimmed the whole answer and not the stream."""
        for kind, path, body in (
            ("chat", "/v1/chat/completions", {"model": "gemma", "messages": USER, "max_tokens": 10}),
            ("completion", "/v1/completions", {"model": "gemma", "prompt": "x", "max_tokens": 10}),
        ):
            with scripted(server.engine, "\nab\n"):
                whole = _text(server.post(path, body)[1])
            with scripted(server.engine, "\nab\n"):
                streamed = _streamed_text(server.stream(path, body))
            assert whole == streamed, kind
            assert whole.startswith("\n") and whole.endswith("\n"), repr(whole)


class TestErrorShape:
    def test_an_unknown_model_is_vllms_not_found_error(self, server: Server) -> None:
        status, answer = server.post("/v1/chat/completions", {"model": "other", "messages": USER})
        assert status == 404
        assert answer == {
            "error": {
                "message": "The model `other` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        }

    def test_the_openai_client_reads_the_errors_as_it_reads_vllms(self, server: Server) -> None:
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="gemma", prompt="x", max_tokens=0)
        assert info.value.body == {
            "message": "max_tokens must be at least 1, got 0.",
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="other", messages=USER)


def test_the_context_is_the_services_unless_the_model_has_less(tmp_path: Path, server: Server) -> None:
    """The Cloud Run service runs vLLM with `--max-model-len` servingMaxModelLen (4096 by default), not the
    model's 32768 positions: a 5,000-token prompt gets vLLM's 400 there, so it must get it here too."""
    from infra.config import StackConfig

    service_default = StackConfig.model_fields["serving_max_model_len"].default
    model = build_tiny_gemma(tmp_path / "long", marker=False, max_position_embeddings=2 * service_default)
    engine = _Engine(model, "gemma")
    engine.load()
    assert engine.max_model_len == service_default
    with pytest.raises(local_server._BadRequest, match=f"maximum context length is {service_default} tokens"):
        engine.prepare(local_server.parse_completion_request({"prompt": "a" * (service_default + 5)}, "gemma"))
    # a model with a shorter context keeps its own (vLLM refuses a --max-model-len above the model's)
    assert server.engine.max_model_len == CONTEXT < service_default
