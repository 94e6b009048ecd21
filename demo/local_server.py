"""A local OpenAI-compatible server for a merged model folder, on 127.0.0.1 (CPU), and its keeper.

    python -m demo.local_server outputs/emoji-local/merged --port 8000     # foreground
    python -m serving.client --url http://127.0.0.1:8000 "Translate to emoji: I love pizza"

    from demo.local_server import LocalServer
    with LocalServer("outputs/emoji-local/merged") as server:   # a free port, stopped on exit
        chat(server.url, [{"role": "user", "content": "Translate to emoji: I love pizza"}])

Decisions (docs/decisions/local-server.md): our own small server (`http.server` + transformers `generate`),
not `transformers serve`; it answers the part of vLLM's OpenAI API clients use, streaming included, as vLLM
v0.28.0 does (shapes, `gemma`, greedy defaults, errors, limits), so code written against it runs unchanged
against the Cloud Run service. Loopback only; complete exports only (serving/completion.py); 503 until the
model is loaded, like a cold instance; `LocalServer` always stops its process group. No batching, `n`,
logprobs, penalties or LoRA: it is not for production traffic.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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


# --------------------------------------------------------------------------- the server (child process)


@dataclass(frozen=True)
class GenerationRequest:
    """One validated request: a chat (`messages`) or a plain completion (`prompt`)."""

    kind: str  # "chat" | "completion"
    messages: list[dict[str, str]] | None
    prompt: str | None
    max_tokens: int | None  # None: the rest of the context, as vLLM
    temperature: float
    top_p: float
    top_k: int = 0  # 0: off, as in vLLM
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()
    seed: int | None = None
    max_tokens_param: str = "max_tokens"


@dataclass
class _Prepared:
    """A request with its prompt tokenised and its output budget settled (vLLM's checks, before the lock)."""

    request: GenerationRequest
    inputs: Any
    prompt_len: int
    max_tokens: int
    cancel: threading.Event = field(default_factory=threading.Event)


def _stop_criterion(job: _Prepared, tokenizer: Any) -> Any:
    """A transformers stopping criterion: end generation once `job.cancel` is set (the client went away) or the
    new text holds one of the request's stop strings (transformers' own StopStringCriteria cannot read every
    tokenizer's vocabulary, so the decoded text is what is checked)."""
    import torch
    from transformers import StoppingCriteria

    stop, start = job.request.stop, job.prompt_len

    class Until(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            done = job.cancel.is_set()
            if not done and stop:
                text = tokenizer.decode(input_ids[0, start:], skip_special_tokens=True)
                done = any(s in text for s in stop)
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    return Until()


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, str | None]:
    """`text` up to the first stop string (excluded, as vLLM's default include_stop_str_in_output=False), and it."""
    found = [(text.find(s), s) for s in stop if s in text]
    if not found:
        return text, None
    at, which = min(found)
    return text[:at], which


class _Engine:
    """The model and tokenizer, loaded once; generation is serialised (one CPU, one request at a time)."""

    def __init__(
        self, model_dir: Path, served_model_name: str, max_model_len: int | None = SERVED_MAX_MODEL_LEN
    ) -> None:
        self.model_dir = model_dir
        self.served_model_name = served_model_name
        self.context_limit = max_model_len
        self.created = int(time.time())
        self.ready = threading.Event()
        self.load_error: str | None = None
        self._lock = threading.Lock()
        self.model: Any = None
        self.tokenizer: Any = None
        self.max_model_len = 0

    def load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        started = time.monotonic()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        if not getattr(self.tokenizer, "chat_template", None):
            raise LocalServerError(f"the tokenizer in {self.model_dir} has no chat template; the export must save one")
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.eval()
        # the service's --max-model-len (servingMaxModelLen), or the model's max_position_embeddings if that is
        # less (vLLM refuses a longer --max-model-len) or no limit was given (vLLM's own default)
        positions = int(self.model.config.max_position_embeddings)
        self.max_model_len = min(positions, self.context_limit) if self.context_limit else positions
        log.info("model %s loaded in %.1f s", self.model_dir, time.monotonic() - started)
        self.ready.set()

    def prepare(self, request: GenerationRequest) -> _Prepared:
        """Tokenise and apply vLLM's length rules (vllm/renderers/params.py TokenizeParams, v0.28.0): 400 if the
        prompt plus the requested tokens exceed the context; no max_tokens means the rest of the context."""
        if request.kind == "chat":
            inputs = self.tokenizer.apply_chat_template(
                request.messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
        else:
            inputs = self.tokenizer(request.prompt, return_tensors="pt")
        prompt_len = int(inputs["input_ids"].shape[1])
        limit, asked = self.max_model_len, request.max_tokens
        if asked is not None and asked > limit:
            raise _BadRequest(
                f"{request.max_tokens_param}={asked} cannot be greater than max_model_len=max_total_tokens={limit}. "
                "Please request fewer output tokens.",
                param=request.max_tokens_param,
            )
        if prompt_len > limit - (asked or 0):
            raise _BadRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested {asked or 0} output "
                f"tokens and your prompt contains {prompt_len} input tokens, for a total of {prompt_len + (asked or 0)} "
                "tokens. Please reduce the length of the input prompt or the number of requested output tokens.",
                param="input_tokens",
            )
        max_tokens = min(asked, limit - prompt_len) if asked is not None else limit - prompt_len
        if max_tokens < 1:
            raise _BadRequest(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        return _Prepared(request, inputs, prompt_len, max_tokens)

    def _run(self, job: _Prepared, streamer: Any = None) -> list[int]:
        """Generate under the lock; returns the new token ids. Stops early when `job.cancel` is set."""
        import torch
        from transformers import StoppingCriteriaList

        request = job.request
        with self._lock, torch.inference_mode():
            if request.seed is not None:  # generation is serialised, so the global generator is this request's
                torch.manual_seed(request.seed)
            output = self.model.generate(
                **job.inputs,
                max_new_tokens=job.max_tokens,
                pad_token_id=self.tokenizer.pad_token_id,
                streamer=streamer,
                stopping_criteria=StoppingCriteriaList([_stop_criterion(job, self.tokenizer)]),
                **_sampling_kwargs(request),
            )
        return output[0, job.prompt_len :].tolist()

    def _finish_reason(self, new_tokens: list[int], max_tokens: int, stopped_by: str | None) -> str:
        if stopped_by is not None:
            return "stop"
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        return "stop" if (new_tokens and new_tokens[-1] in eos_ids) or len(new_tokens) < max_tokens else "length"

    @staticmethod
    def _usage(prompt_len: int, completion_len: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_len,
            "completion_tokens": completion_len,
            "total_tokens": prompt_len + completion_len,
        }

    def _choice(
        self,
        request: GenerationRequest,
        text: str | None,
        finish: str | None,
        delta: bool,
        stop_reason: str | None = None,
    ) -> dict[str, Any]:
        if request.kind == "completion":
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        else:
            key = "delta" if delta else "message"
            content: dict[str, Any] = {} if delta and text is None else {"content": text or ""}
            if not delta:
                content = {"role": "assistant", **content}
            choice = {"index": 0, key: content, "logprobs": None, "finish_reason": finish}
        if finish is not None or not delta:
            choice["stop_reason"] = stop_reason
        return choice

    def _envelope(self, request: GenerationRequest, rid: str, chunk: bool) -> dict[str, Any]:
        obj = "chat.completion" if request.kind == "chat" else "text_completion"
        return {
            "id": rid,
            "object": f"{obj}.chunk" if chunk and request.kind == "chat" else obj,
            "created": int(time.time()),
            "model": self.served_model_name,
        }

    def generate(self, job: _Prepared) -> dict[str, Any]:
        request = job.request
        new_tokens = self._run(job)
        # the text as decoded, untrimmed: what vLLM returns, and what the stream below sends piece by piece
        text, stopped_by = _cut_at_stop(self.tokenizer.decode(new_tokens, skip_special_tokens=True), request.stop)
        rid = f"{'chatcmpl' if request.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        finish = self._finish_reason(new_tokens, job.max_tokens, stopped_by)
        return {
            **self._envelope(request, rid, chunk=False),
            "choices": [self._choice(request, text, finish, delta=False, stop_reason=stopped_by)],
            "usage": self._usage(job.prompt_len, len(new_tokens)),
        }

    def stream(self, job: _Prepared) -> Iterator[dict[str, Any]]:
        """The response as OpenAI stream chunks, produced while the model generates.

        Each chunk is what the decoded text of all new tokens so far adds to what was sent, so the chunks add up to
        exactly the whole answer's text (an unfinished character, U+FFFD at the end, waits for its next token).
        With stop strings, the last `len(longest stop) - 1` characters are held back until they cannot begin one,
        as vLLM does (SamplingParams.output_text_buffer_length). A consumer that stops early (a closed stream)
        sets `job.cancel`: generation ends at the next token and releases the lock (`_stop_criterion`).
        """
        from transformers.generation.streamers import BaseStreamer

        request = job.request
        tokens: queue.Queue[list[int] | None] = queue.Queue()

        class Tokens(BaseStreamer):
            prompt_seen = False

            def put(self, value: Any) -> None:
                if not self.prompt_seen:  # generate() first puts the prompt
                    self.prompt_seen = True
                    return
                tokens.put(value.reshape(-1).tolist())

            def end(self) -> None:
                tokens.put(None)

        result: dict[str, Any] = {}

        def work() -> None:
            try:
                result["value"] = self._run(job, Tokens())
            except BaseException as exc:  # reported to the client after the stream ends
                result["error"] = exc
                tokens.put(None)

        worker = threading.Thread(target=work, name="generate", daemon=True)
        worker.start()
        rid = f"{'chatcmpl' if request.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        holdback = max((len(s) for s in request.stop), default=1) - 1
        ids: list[int] = []
        sent, stopped_by = "", None

        def more(text: str, final: bool) -> str:
            kept, stop = _cut_at_stop(text, request.stop)
            upto = len(kept) if stop is not None or final else max(len(sent), len(kept) - holdback)
            return kept[len(sent) : upto] if kept.startswith(sent) else ""

        try:
            if request.kind == "chat":
                first = self._choice(request, "", None, delta=True)
                first["delta"] = {"role": "assistant", "content": ""}
                yield {**self._envelope(request, rid, chunk=True), "choices": [first]}
            while (new := tokens.get()) is not None:
                ids += new
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                if stopped_by is not None or text.endswith("\ufffd"):
                    continue
                piece = more(text, final=False)
                stopped_by = _cut_at_stop(text, request.stop)[1]
                if piece:
                    sent += piece
                    yield {
                        **self._envelope(request, rid, chunk=True),
                        "choices": [self._choice(request, piece, None, True)],
                    }
            worker.join()
            if "error" in result:
                raise result["error"]
            new_tokens = result["value"]
            text = self.tokenizer.decode(new_tokens, skip_special_tokens=True)
            piece = more(text, final=True)
            if piece:  # what was held back
                sent += piece
                yield {
                    **self._envelope(request, rid, chunk=True),
                    "choices": [self._choice(request, piece, None, True)],
                }
            stopped_by = _cut_at_stop(text, request.stop)[1]
            finish = self._finish_reason(new_tokens, job.max_tokens, stopped_by)
            last = self._choice(request, None, finish, delta=True, stop_reason=stopped_by)
            if request.kind == "completion":
                last["text"] = ""
            yield {**self._envelope(request, rid, chunk=True), "choices": [last]}
            if request.include_usage:
                yield {
                    **self._envelope(request, rid, chunk=True),
                    "choices": [],
                    "usage": self._usage(job.prompt_len, len(new_tokens)),
                }
        finally:
            job.cancel.set()  # a consumer that stopped early (a closed stream) ends the generation
            worker.join(timeout=30)


@contextlib.contextmanager
def _cancel_when_client_leaves(sock: socket.socket, cancel: threading.Event) -> Iterator[None]:
    """Set `cancel` once the client closes its connection while the body of the block runs (a generation).

    vLLM cancels a request whose client went away, streamed or not (`with_cancellation` on its chat and completion
    routes, v0.28.0); without this a client that timed out and retried would wait behind the answer nobody reads.
    A non-blocking peek that reads no bytes is the client's end of the connection (data it pipelines is left unread
    for the next request)."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.1):
            try:
                if not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                    cancel.set()
                    return
            except (BlockingIOError, InterruptedError):  # nothing to read: the client is still there
                continue
            except OSError:  # reset, or closed under us
                cancel.set()
                return

    watcher = threading.Thread(target=watch, name="disconnect-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(timeout=1)


def _sampling_kwargs(request: GenerationRequest) -> dict[str, Any]:
    """`generate` settings for the request alone: every one is passed, so the model's generation_config.json
    (the base's do_sample, top_k 64, top_p 0.95) never adds its own, as vLLM's `--generation-config vllm` does not."""
    if request.temperature <= 0:  # vLLM: temperature 0 is greedy, top_k/top_p ignored (SamplingParams)
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    return {"do_sample": True, "temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k}


# vLLM's error types by status (create_error_response, vllm/entrypoints/serve/exception_handling/error_response.py)
ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class _BadRequest(ValueError):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def _text_content(content: Any) -> str:
    """OpenAI content: a string, or a list of parts of which only text parts are accepted."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise _BadRequest("message content must be a string or a list of text parts (this server is text-only)")


def _common(body: Any, served_model_name: str, default_max_tokens: int | None) -> dict[str, Any]:
    """The fields chat and completion requests share, validated the way vLLM answers them (vllm/sampling_params.py
    `_verify_args`, the request models in vllm/entrypoints/openai/*/protocol.py; v0.28.0)."""
    if not isinstance(body, dict):
        raise _BadRequest("the request body must be a JSON object")
    model = body.get("model", served_model_name)
    if model != served_model_name:
        raise _BadRequest(f"The model `{model}` does not exist.", 404, "model")
    if body.get("n", 1) not in (1, None):
        raise _BadRequest("only n=1 is supported by the local server", param="n")
    for unsupported in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "best_of"):
        if body.get(unsupported) not in (None, False, 1 if unsupported == "best_of" else None):
            raise _BadRequest(f"{unsupported} is not supported by the local server", param=unsupported)
    # vLLM applies these (SamplingParams); generate() here does not, so only their neutral values are accepted
    for name, neutral in (("frequency_penalty", 0), ("presence_penalty", 0), ("repetition_penalty", 1), ("min_p", 0)):
        if body.get(name) not in (None, neutral):
            raise _BadRequest(
                f"{name}={body[name]!r} is not supported by the local server (only {neutral})", param=name
            )
    if body.get("logit_bias"):
        raise _BadRequest("logit_bias is not supported by the local server", param="logit_bias")
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(param)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise _BadRequest(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    # what the service does for a parameter the request omits (serving/vllm_args.py decides it, once)
    defaults = served_sampling_defaults()
    temperature = defaults["temperature"] if body.get("temperature") is None else body["temperature"]
    top_p = defaults["top_p"] if body.get("top_p") is None else body["top_p"]
    top_k = defaults["top_k"] if body.get("top_k") is None else body["top_k"]
    if not isinstance(temperature, int | float) or not 0 <= temperature <= 2:
        raise _BadRequest(f"temperature must be in [0, 2], got {temperature}.", param="temperature")
    if not isinstance(top_p, int | float) or not 0 < top_p <= 1:
        raise _BadRequest(f"top_p must be in (0, 1], got {top_p}.", param="top_p")
    if not isinstance(top_k, int) or top_k < -1:
        raise _BadRequest(f"top_k must be 0 (disable), or at least 1, got {top_k!r}.", param="top_k")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _BadRequest("stop must be a string or a list of strings", param="stop")
    if any(not s for s in stop):
        raise _BadRequest("stop cannot contain an empty string.", param="stop")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**63):
        raise _BadRequest(f"seed must be a 64-bit integer, got {seed!r}", param="seed")
    stream = bool(body.get("stream"))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _BadRequest("stream_options must be an object", param="stream_options")
    return {
        "max_tokens": max_tokens,
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": max(top_k, 0),
        "stream": stream,
        "include_usage": stream and bool(options.get("include_usage")),
        "stop": tuple(dict.fromkeys(stop)),
        "seed": seed,
        "max_tokens_param": param,
    }


def parse_chat_request(body: Any, served_model_name: str) -> GenerationRequest:
    """Validate a chat request the way vLLM would answer it (no max_tokens: the rest of the context)."""
    common = _common(body, served_model_name, default_max_tokens=None)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _BadRequest("messages must be a non-empty list of {role, content}", param="messages")
    messages = []
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in {"system", "user", "assistant"}:
            raise _BadRequest("each message needs a role of system, user or assistant", param="messages")
        messages.append({"role": m["role"], "content": _text_content(m.get("content", ""))})
    return GenerationRequest("chat", messages, None, **common)


def parse_completion_request(body: Any, served_model_name: str) -> GenerationRequest:
    """Validate a `/v1/completions` request: one text prompt (vLLM's and OpenAI's default max_tokens is 16)."""
    common = _common(body, served_model_name, default_max_tokens=16)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise _BadRequest("prompt must be a non-empty string (one prompt per request)", param="prompt")
    return GenerationRequest("completion", None, prompt, **common)


_ROUTES = {"/v1/chat/completions": parse_chat_request, "/v1/completions": parse_completion_request}
# A request body larger than this is refused (413) before it is read; a body that arrives slower than
# BODY_READ_TIMEOUT_S (a Content-Length larger than what is sent) is answered 408 instead of holding a thread.
MAX_BODY_BYTES = 16 * 1024 * 1024
BODY_READ_TIMEOUT_S = 30.0


def _make_handler(engine: _Engine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "gemma-finetune-local"
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            log.info("%s %s", self.address_string(), format % args)

        def _send(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            data = json.dumps(payload, ensure_ascii=False).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, param: str | None = None) -> None:
            """vLLM's ErrorResponse: {"error": {"message", "type", "param", "code"}}."""
            extra = {"Retry-After": "1"} if status == 503 else None
            kind = ERROR_TYPES.get(status, "BadRequestError")
            self._send(status, {"error": {"message": message, "type": kind, "param": param, "code": status}}, extra)

        def _not_ready(self) -> bool:
            if engine.ready.is_set():
                return False
            self._error(503, engine.load_error or "the model is loading")
            return True

        def do_GET(self) -> None:
            if self.path == "/health":
                status = 200 if engine.ready.is_set() else 503
                self._send(status, {"status": "ok" if status == 200 else "loading", "model": engine.served_model_name})
            elif self.path == "/v1/models":
                if self._not_ready():
                    return
                card = {
                    "id": engine.served_model_name,
                    "object": "model",
                    "created": engine.created,
                    "owned_by": "gemma-finetune",
                    "root": str(engine.model_dir),
                    "max_model_len": engine.max_model_len,
                }
                self._send(200, {"object": "list", "data": [card]})
            else:
                self._error(404, f"no route {self.path}")

        def _stream(self, chunks: Iterator[dict[str, Any]]) -> None:
            """Server-sent events as vLLM sends them: `data: {json}` per chunk, then `data: [DONE]`."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")  # the body ends when the connection does
            self.end_headers()
            self.close_connection = True
            try:
                try:
                    for chunk in chunks:
                        self._event(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    raise
                except Exception as exc:  # headers are gone: report in-band, as vLLM does
                    log.exception("generation failed while streaming")
                    message = f"generation failed: {type(exc).__name__}: {exc}"
                    self._event(
                        {"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}}
                    )
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                log.info("the client closed the stream early; generation stopped")
            finally:
                close = getattr(chunks, "close", None)
                if close is not None:
                    close()  # runs the generator's finally: cancel, then wait for the worker to let go of the lock

        def _event(self, payload: dict[str, Any]) -> None:
            self.wfile.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")
            self.wfile.flush()

        def _read_body(self) -> bytes | None:
            """The body, or None after answering 400 (bad Content-Length), 413 (too large) or 408 (too slow)."""
            raw_length = self.headers.get("Content-Length")
            if raw_length is None:
                return b""
            if not raw_length.strip().isdigit():
                self.close_connection = True
                self._error(400, f"Content-Length {raw_length!r} is not a number of bytes")
                return None
            length = int(raw_length)
            if length > MAX_BODY_BYTES:
                self.close_connection = True
                self._error(413, f"request body of {length} bytes is larger than {MAX_BODY_BYTES} bytes")
                return None
            self.connection.settimeout(BODY_READ_TIMEOUT_S)
            try:
                raw = self.rfile.read(length)
            except TimeoutError:
                raw = None
            finally:
                self.connection.settimeout(None)
            if raw is None or len(raw) < length:
                self.close_connection = True
                self._error(
                    408, f"the {length} bytes of body announced did not arrive within {BODY_READ_TIMEOUT_S:g} s"
                )
                return None
            return raw

        def do_POST(self) -> None:
            raw = self._read_body()
            if raw is None:
                return
            parse = _ROUTES.get(self.path.split("?", 1)[0])
            if parse is None:
                self._error(404, f"no route {self.path}")
                return
            if self._not_ready():
                return
            try:
                request = parse(json.loads(raw or b"null"), engine.served_model_name)
                job = engine.prepare(request)
                if request.stream:
                    self._stream(engine.stream(job))
                else:
                    with _cancel_when_client_leaves(self.connection, job.cancel):
                        answer = engine.generate(job)
                    if job.cancel.is_set():  # nobody to answer
                        self.close_connection = True
                        log.info("the client closed the connection; generation stopped")
                        return
                    self._send(200, answer)
            except _BadRequest as exc:
                self._error(exc.status, str(exc), exc.param)
            except json.JSONDecodeError as exc:
                self._error(400, f"the body is not JSON: {exc}")
            except Exception as exc:  # a bug or an OOM must not kill the server mid-demo
                log.exception("generation failed")
                self._error(500, f"generation failed: {type(exc).__name__}: {exc}")

    return Handler


def _exit_when_orphaned(parent_pid: int) -> None:
    """The keeper died without stopping us (SIGKILL, crash): exit rather than hold the port and memory."""
    while True:
        if os.getppid() != parent_pid:
            log.warning("parent %d is gone; stopping", parent_pid)
            os._exit(0)
        time.sleep(1.0)


def open_server(host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    """Bind (host, port); a busy port raises `PortBusyError`, a privileged one `PortDeniedError`."""

    class _Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True

    try:
        return _Server((host, port), handler)
    except OSError as exc:
        error = _bind_error(exc, host, port)
        if error is not None:
            raise error from None
        raise


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
    check_loopback(host)
    try:
        check_model_dir(model_dir, require_marker)
    except ModelNotReadyError as exc:
        log.error("%s", exc)
        return EXIT_MODEL_NOT_READY
    engine = _Engine(model_dir, served_model_name, max_model_len)
    try:
        httpd = open_server(host, port, _make_handler(engine))
    except PortBusyError as exc:
        log.error("%s", exc)
        return EXIT_PORT_BUSY
    except PortDeniedError as exc:
        log.error("%s", exc)
        return EXIT_PORT_DENIED
    if parent_pid is not None:
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    signal.signal(signal.SIGTERM, _raise_system_exit)
    threading.Thread(target=httpd.serve_forever, name="http", daemon=True).start()
    log.info("listening on http://%s:%d (model %s as %r)", host, httpd.server_address[1], model_dir, served_model_name)
    try:
        try:
            engine.load()
        except Exception as exc:
            engine.load_error = f"the model failed to load: {type(exc).__name__}: {exc}"
            log.exception("model load failed")
            return 1
        while True:
            time.sleep(3600)  # requests are served by the http thread; SIGTERM/SIGINT end this
    except (KeyboardInterrupt, SystemExit):
        log.info("stopping")
        return 0
    finally:
        httpd.shutdown()
        httpd.server_close()


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)


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
