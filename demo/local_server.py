"""The local OpenAI-compatible server of `make demo` and the tests: `transformers serve`, behind a thin layer.

    python -m demo.local_server outputs/emoji-local/merged --port 8000     # foreground
    python -m serving.client --url http://127.0.0.1:8000 "Translate to emoji: I love pizza"

    from demo.local_server import LocalServer
    with LocalServer("outputs/emoji-local/merged") as server:   # a free port, stopped on exit
        chat(server.url, [{"role": "user", "content": "Translate to emoji: I love pizza"}])

Decision (docs/development.md#the-local-server): the server is the one transformers ships (transformers 5.23
`transformers serve`: chat with streaming, completions, models, health; image parts for vision models), built from
its own parts (`ModelManager`, the handlers, `build_server`) with the model preloaded. `VllmFace`, an ASGI layer in
front of it, keeps only the differences a client of the Cloud Run service would notice, each named in
`DIFFERENCES`. Around it: loopback only, complete exports only (serving/completion.py), 503 until the model is
loaded (a cold instance), and `LocalServer`, which runs it as a child and always stops its process group.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from serving.completion import COMPLETION_MARKER, IncompleteModelError, verify
from serving.vllm_args import DEFAULT_SERVED_MODEL_NAME, SERVED_MAX_MODEL_LEN, served_sampling_defaults

log = logging.getLogger("demo.local_server")

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})
EXIT_PORT_BUSY = 98
EXIT_PORT_DENIED = 13
EXIT_MODEL_NOT_READY = 3


class LocalServerError(RuntimeError):
    """The local server could not be started or stopped; the message says why and what to do."""


class PortBusyError(LocalServerError):
    """The requested port is taken."""


class PortDeniedError(LocalServerError):
    """The requested port needs privileges this user does not have."""


class ModelNotReadyError(LocalServerError):
    """The model folder is missing or has no completion marker."""


# --------------------------------------------------------------------------- checks shared by both sides


def check_loopback(host: str) -> None:
    if host not in LOOPBACK_HOSTS:
        raise LocalServerError(
            f"host {host!r}: the local server binds only to 127.0.0.1 (or ::1); it is not for exposure"
        )


def port_busy_message(host: str, port: int) -> str:
    return (
        f"port {port} on {host} is in use (another server, or an earlier demo still running?): "
        f"find it with `ss -ltnp 'sport = :{port}'` and stop it, or choose another port (--port N, or 0 for a free one)"
    )


def port_denied_message(host: str, port: int) -> str:
    return (
        f"port {port} on {host} needs privileges this user does not have (ports below "
        f"{_unprivileged_port_start()} are reserved): choose --port 8000, or --port 0 for a free one"
    )


def _unprivileged_port_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text())
    except (OSError, ValueError):
        return 1024


def _bind_error(exc: OSError, host: str, port: int) -> LocalServerError | None:
    """EADDRINUSE: someone listens there; EACCES: a privileged port. Anything else is not ours to explain."""
    if exc.errno == errno.EADDRINUSE:
        return PortBusyError(port_busy_message(host, port))
    if exc.errno == errno.EACCES:
        return PortDeniedError(port_denied_message(host, port))
    return None


def check_port_free(host: str, port: int) -> None:
    """Raise `PortBusyError` when something listens on (host, port), `PortDeniedError` when it is privileged."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # as the server does: a port in TIME_WAIT from a stopped server is free, a listener is not
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            error = _bind_error(exc, host, port)
            if error is not None:
                raise error from None
            raise


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now (another process could still take it before we bind)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_model_dir(model_dir: Path, require_marker: bool = True) -> None:
    """The same rule as serving/entrypoint.sh (serving/completion.py): serve only a complete, readable export."""
    if not model_dir.is_dir():
        raise ModelNotReadyError(
            f"model at {model_dir} does not exist: train and export it first (make demo does both)"
        )
    if require_marker:
        try:
            verify(model_dir)
        except IncompleteModelError as exc:
            raise ModelNotReadyError(f"{exc}; rerun the export (or `make demo`) instead of serving it") from None
    elif not (model_dir / "config.json").is_file():
        raise ModelNotReadyError(f"model at {model_dir} has no config.json: point at the merged model folder")


# --------------------------------------------------------------------------- the layer: what a client would notice

# Where `transformers serve` (5.23) answers otherwise than the Cloud Run service's vLLM (v0.28.0, run as
# serving/vllm_args.py renders it), and what `VllmFace` does about each. Everything else is transformers' own.
DIFFERENCES = {
    "models": "GET /v1/models lists the Hugging Face cache (ModelManager.get_gen_models); vLLM lists its served name",
    "model name": "requests must name the preloaded folder and answers carry `path@main`; vLLM takes and answers "
    "its --served-model-name, and any other name is a 404 `The model `x` does not exist.`",
    "sampling": "a request without temperature samples with the model's generation_config; the service is greedy "
    "(--generation-config vllm, --override-generation-config temperature 0: serving.vllm_args.served_sampling_defaults)",
    "lengths": "max_tokens defaults to at least 1024 whatever the context; vLLM's default is the rest of the context "
    "(16 for completions) and it refuses a prompt plus max_tokens over --max-model-len with a 400",
    "errors": 'errors are FastAPI\'s {"detail": ...} (422 for a bad body); vLLM\'s are {"error": {message, type, '
    "param, code}} (400 for a bad body)",
    "stream end": "the last chunk carries the finish reason and the usage, with no `data: [DONE]`; vLLM sends usage "
    "only when stream_options.include_usage asks, in a chunk of its own with no choices, then `data: [DONE]`",
    "loading": "the port opens only once the model is loaded; a cold Cloud Run instance answers 503 meanwhile",
}
# What stays different (not bridged): sampling with temperature > 0 keeps the model's generation_config top_k (vLLM
# runs top_k 0: its chat API has no top_k to send); one request at a time on the CPU, no `n`, no logprobs.
REMAINING = "top_k of the model's generation_config when sampling; no batching, `n` or logprobs"
ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# vLLM's default max_tokens for /v1/completions (CompletionRequest.max_tokens, v0.28.0)
COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_BODY_BYTES = 32 * 1024 * 1024  # base64 images included

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


class Refusal(ValueError):
    """A request the service would refuse: status, message and the parameter at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's ErrorResponse (vllm/entrypoints/serve/exception_handling/error_response.py, v0.28.0)."""
    status = 400 if status == 422 else status
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "BadRequestError"), "param": param,
                      "code": status}}  # fmt: skip


@dataclass
class Served:
    """What the layer knows of the served model once it is loaded."""

    name: str
    path: str
    max_model_len: int | None
    processor: Any = None
    context: int | None = None
    load_error: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    def prompt_tokens(self, path: str, body: dict[str, Any]) -> int:
        """The prompt's length in tokens, as the handler will tokenize it (the chat template for chat)."""
        if path == COMPLETIONS:
            prompt = body.get("prompt", "")
            tokenizer = getattr(self.processor, "tokenizer", self.processor)
            return len(tokenizer(prompt if isinstance(prompt, str) else "".join(map(str, prompt)))["input_ids"])
        messages = [
            {"role": m.get("role"), "content": m.get("content") if isinstance(m.get("content"), str) else [
                {"type": "image", "url": (p.get("image_url") or {}).get("url")} if p.get("type") == "image_url"
                else {"type": "text", "text": p.get("text", "")} for p in m.get("content") or []]}
            for m in body.get("messages") or []
        ]  # fmt: skip
        ids = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return len(ids["input_ids"][0] if hasattr(ids["input_ids"][0], "__len__") else ids["input_ids"])


def rewrite_request(served: Served, path: str, body: Any) -> dict[str, Any]:
    """The request as transformers serve needs it, or a `Refusal` as vLLM would answer (names, sampling, lengths)."""
    if not isinstance(body, dict):
        raise Refusal(400, "the request body must be a JSON object")
    name = body.get("model", served.name)
    if name != served.name:
        raise Refusal(404, f"The model `{name}` does not exist.", "model")
    body = {**body, "model": served.path}
    defaults = served_sampling_defaults()  # the service's: greedy unless asked (DIFFERENCES["sampling"])
    for name in ("temperature", "top_p"):
        if body.get(name) is None:
            body[name] = defaults[name]
    max_tokens = body.pop("max_completion_tokens", None)
    max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise Refusal(400, f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    if served.context is not None:
        prompt = served.prompt_tokens(path, body)
        room = served.context - prompt
        if room < 1 or (max_tokens is not None and max_tokens > room):
            asked = max_tokens if max_tokens is not None else 0
            raise Refusal(
                400,
                f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's maximum context length "
                f"is {served.context} tokens and your request has {prompt} input tokens ({asked} > {served.context} "
                f"- {prompt}).",
                "max_tokens",
            )
        if max_tokens is None:
            max_tokens = min(room, COMPLETION_DEFAULT_MAX_TOKENS) if path == COMPLETIONS else room
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def rewrite_event(served: Served, data: str, include_usage: bool) -> list[str]:
    """One `data:` payload of a stream as vLLM sends it: the served name; usage in a chunk of its own, if asked."""
    try:
        chunk = json.loads(data)
    except ValueError:
        return [data]
    if not isinstance(chunk, dict):
        return [data]
    if "error" in chunk:
        message = chunk["error"] if isinstance(chunk["error"], str) else json.dumps(chunk["error"])
        return [json.dumps(error_body(500, message))]
    chunk["model"] = served.name
    usage = chunk.pop("usage", None)
    events = [json.dumps(chunk)]
    if usage is not None and include_usage:
        events.append(json.dumps({**chunk, "choices": [], "usage": usage}))
    return events


class VllmFace:
    """ASGI middleware in front of transformers serve's app: `DIFFERENCES`, answered as the service answers."""

    def __init__(self, app: Any, served: Served) -> None:
        self.app, self.served = app, served

    async def _json(self, send: Send, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        served = self.served
        if served.load_error or not served.ready.is_set():  # a failed load never answers 200, not even /health
            status = 500 if served.load_error else 503
            message = served.load_error or "the model is loading"
            return await self._json(send, status, error_body(status, message))
        if path == "/v1/models" and method == "GET":
            card = {"id": served.name, "object": "model", "created": 0, "owned_by": "gemma-finetune",
                    "root": served.path, "max_model_len": served.context}  # fmt: skip
            return await self._json(send, 200, {"object": "list", "data": [card]})
        if method != "POST" or path not in (CHAT, COMPLETIONS):
            return await self.app(scope, receive, self._errors_as_vllm(send))
        raw = await _read_body(receive)
        try:
            if raw is None:
                raise Refusal(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
            body = rewrite_request(served, path, json.loads(raw or b"null"))
        except ValueError as exc:
            status, param = (exc.status, exc.param) if isinstance(exc, Refusal) else (400, None)
            return await self._json(send, status, error_body(status, str(exc), param))
        options = body.get("stream_options") or {}
        include_usage = bool(body.get("stream") and isinstance(options, dict) and options.get("include_usage"))
        replay = json.dumps(body).encode()
        sent = False

        async def replayed() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": replay, "more_body": False}
            return await receive()  # a disconnect, which stops the generation

        await self.app(scope, replayed, self._answers_as_vllm(send, include_usage))

    def _errors_as_vllm(self, send: Send) -> Send:
        return self._answers_as_vllm(send, include_usage=False)

    def _answers_as_vllm(self, send: Send, include_usage: bool) -> Send:
        """Rewrite the response on its way out: JSON bodies whole, streams event by event."""
        state: dict[str, Any] = {"start": None, "stream": False, "buffer": b"", "pending": ""}

        async def rewriting(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                state["stream"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                state["start"] = message
                if state["stream"]:
                    await send(message)
                return
            if message["type"] != "http.response.body":
                return await send(message)
            more = message.get("more_body", False)
            if state["stream"]:
                text = state["pending"] + message.get("body", b"").decode()
                *events, state["pending"] = text.split("\n\n")
                out = []
                for event in events:
                    data = event.removeprefix("data: ").strip()
                    out += [f"data: {e}\n\n" for e in rewrite_event(self.served, data, include_usage)] if data else []
                if not more:
                    out.append("data: [DONE]\n\n")
                return await send({"type": "http.response.body", "body": "".join(out).encode(), "more_body": more})
            state["buffer"] += message.get("body", b"")
            if more:
                return
            start = state["start"]
            status = start["status"]
            body = _json_answer(self.served, status, state["buffer"])
            headers = [(k, v) for k, v in start.get("headers") or [] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "status": 400 if status == 422 else status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        return rewriting


def _json_answer(served: Served, status: int, raw: bytes) -> bytes:
    try:
        payload = json.loads(raw or b"null")
    except ValueError:
        return raw
    if status >= 400:
        detail = payload.get("detail", payload.get("error")) if isinstance(payload, dict) else payload
        return json.dumps(error_body(status, detail if isinstance(detail, str) else json.dumps(detail))).encode()
    if isinstance(payload, dict) and "model" in payload:
        payload["model"] = served.name
    return json.dumps(payload).encode()


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when it is larger than MAX_BODY_BYTES."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


# --------------------------------------------------------------------------- the server (child process)


def transformers_serve_app(served: Served) -> Any:
    """transformers serve's app, built as `transformers serve` builds it (transformers/cli/serve.py `Serve`), with no
    model yet: `load` preloads the folder as its forced model while the layer answers 503."""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.systemone import SystemOneHandler
    from transformers.cli.serving.transcription import TranscriptionHandler
    from transformers.cli.serving.utils import GenerationState

    manager = ModelManager(device="cpu", dtype="float32")
    state = GenerationState(continuous_batching=False, compile=False, cb_config=None)
    app = build_server(
        manager,
        ChatCompletionHandler(model_manager=manager, generation_state=state),
        completion_handler=CompletionHandler(model_manager=manager, generation_state=state),
        response_handler=ResponseHandler(model_manager=manager, generation_state=state),
        transcription_handler=TranscriptionHandler(manager, state),
        systemone_handler=SystemOneHandler(model_manager=manager, generation_state=state),
        generation_state=state,
    )

    def load() -> None:
        try:
            manager.force_model, manager.model_timeout = served.path, -1  # what Serve(force_model=...) sets
            model, served.processor = manager.load_model_and_processor(manager.process_model_name(served.path))
            limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
            served.context = (
                min(x for x in (served.max_model_len, limit) if x) if (served.max_model_len or limit) else None
            )
            served.ready.set()
        except Exception as exc:  # reported on every request and by the keeper, which reads the log
            served.load_error = f"the model failed to load: {type(exc).__name__}: {exc}"
            log.exception("model load failed")
            served.ready.set()

    return VllmFace(app, served), load


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a busy port fails in milliseconds."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        error = _bind_error(exc, host, port)
        if error is not None:
            raise error from None
        raise
    sock.listen(128)
    return sock


def serve(
    model_dir: Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME,
    require_marker: bool = True,
    parent_pid: int | None = None,
    max_model_len: int | None = SERVED_MAX_MODEL_LEN,
) -> int:
    """Run the server in the foreground until SIGTERM/SIGINT; returns the process exit code."""
    import uvicorn

    check_loopback(host)
    try:
        check_model_dir(model_dir, require_marker)
    except ModelNotReadyError as exc:
        log.error("%s", exc)
        return EXIT_MODEL_NOT_READY
    try:
        sock = bind(host, port)
    except PortBusyError as exc:
        log.error("%s", exc)
        return EXIT_PORT_BUSY
    except PortDeniedError as exc:
        log.error("%s", exc)
        return EXIT_PORT_DENIED
    if parent_pid is not None:
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    served = Served(served_model_name, str(model_dir), max_model_len)
    app, load = transformers_serve_app(served)
    # the access log ("POST /v1/chat/completions ... 200") goes to the server's log, as vLLM's does
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", lifespan="off"))

    def load_or_stop() -> None:
        load()
        if served.load_error:
            server.should_exit = True  # a model that cannot load is an exit, as for vLLM; the keeper shows the log

    threading.Thread(target=load_or_stop, name="load", daemon=True).start()
    log.info("listening on http://%s:%d (model %s as %r)", host, sock.getsockname()[1], model_dir, served_model_name)
    asyncio.run(server.serve(sockets=[sock]))  # uvicorn stops on SIGTERM/SIGINT
    return 1 if served.load_error else 0


def _exit_when_orphaned(parent_pid: int) -> None:
    """The keeper died without stopping us (SIGKILL, crash): exit rather than hold the port and memory."""
    while True:
        if os.getppid() != parent_pid:
            log.warning("parent %d is gone; stopping", parent_pid)
            os._exit(0)
        time.sleep(1.0)


# --------------------------------------------------------------------------- the keeper (parent process)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class LocalServer:
    """Start the server as a child process, wait until it answers, and always stop it.

    Use it as a context manager; `start()`/`stop()` exist for callers that manage lifetimes
    themselves. `port=0` (the default) picks a free port.
    """

    model_dir: Path | str
    port: int = 0
    host: str = "127.0.0.1"
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME
    log_path: Path | str | None = None
    startup_timeout_s: float = 300.0
    require_marker: bool = True
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self, wait: bool = True) -> LocalServer:
        """Start the child; with `wait`, return once it answers (stopping it if it never does).

        `wait=False` returns as soon as the child runs, so the caller can work while the model loads;
        it then calls `wait_ready()` before its first request, and `stop()` in every case.
        """
        check_loopback(self.host)
        self.model_dir = Path(self.model_dir).resolve()
        check_model_dir(self.model_dir, self.require_marker)
        if self.port == 0:
            self.port = free_port(self.host)
        else:
            check_port_free(self.host, self.port)
        self.log_path = Path(self.log_path or Path(tempfile.gettempdir()) / f"gemma-local-server-{self.port}.log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "demo.local_server", str(self.model_dir),
            "--host", self.host, "--port", str(self.port), "--served-model-name", self.served_model_name,
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        if not self.require_marker:
            command.append("--no-require-marker")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")])
        )
        with open(self.log_path, "ab") as log_file:
            # own session = own process group, so stop() reaches anything the server spawns
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        log.info("local server pid %d starting on %s (log %s)", self._process.pid, self.url, self.log_path)
        if not wait:
            return self
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        """Poll `/health` until 200, the process exits, or the deadline passes."""
        assert self._process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while True:
            code = self._process.poll()
            if code is not None:
                if code == EXIT_PORT_BUSY:
                    raise PortBusyError(port_busy_message(self.host, self.port))
                if code == EXIT_PORT_DENIED:
                    raise PortDeniedError(port_denied_message(self.host, self.port))
                raise LocalServerError(
                    f"the local server exited with code {code} before it was ready; log {self.log_path}:\n{_tail(Path(str(self.log_path)))}"
                )
            try:
                with opener.open(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise LocalServerError(
                    f"the local server was not ready within {self.startup_timeout_s:g} s; log {self.log_path}:\n{_tail(Path(str(self.log_path)))}"
                )
            time.sleep(0.25)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left; safe to call twice."""
        process, self._process = self._process, None
        if process is None:
            return
        # SIGKILL cannot be ignored, but on a busy machine the kernel may need a while to finish the exit
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        _reap_group(process.pid)
        log.info("local server pid %d stopped", process.pid)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _reap_group(pgid: int) -> None:
    """Kill any straggler left in the group (e.g. a grandchild that ignored SIGTERM)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m demo.local_server", description=__doc__.splitlines()[0])
    p.add_argument("model_dir", type=Path, help="merged model folder (with the trainer's completion marker)")
    p.add_argument("--host", default="127.0.0.1", help="loopback only: 127.0.0.1 or ::1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=DEFAULT_SERVED_MODEL_NAME)
    p.add_argument("--no-require-marker", action="store_true", help=f"serve a folder without {COMPLETION_MARKER}")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=SERVED_MAX_MODEL_LEN,
        help=f"context length, as the service's --max-model-len (servingMaxModelLen, default {SERVED_MAX_MODEL_LEN}); "
        "0: the model's own",
    )
    p.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return serve(
            args.model_dir.resolve(),
            args.host,
            args.port,
            args.served_model_name,
            not args.no_require_marker,
            args.parent_pid,
            args.max_model_len or None,
        )
    except LocalServerError as exc:
        log.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
