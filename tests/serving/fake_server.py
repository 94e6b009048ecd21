"""A scripted OpenAI-compatible HTTP server on 127.0.0.1 for the client's error paths."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


def completion(content: str, model: str = "gemma") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


class FakeServer:
    """Replies from `script` in order (the last one repeats); `/v1/models` lists `gemma` after `models_delay_s`."""

    def __init__(self, script: list[Reply], models_delay_s: float = 0.0) -> None:
        self.script = list(script)
        self.requests: list[Recorded] = []
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                with fake._lock:
                    fake.requests.append(Recorded(self.command, self.path, dict(self.headers.items()), body))
                    if self.path == "/v1/models":
                        reply = Reply(
                            body={"object": "list", "data": [{"id": "gemma", "object": "model"}]},
                            delay_s=models_delay_s,
                        )
                    else:
                        reply = fake.script.pop(0) if len(fake.script) > 1 else fake.script[0]
                time.sleep(reply.delay_s)
                data = json.dumps(reply.body).encode() if reply.body is not None else b""
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up first: what the timeout tests provoke

            do_GET = _handle
            do_POST = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    @property
    def chat_requests(self) -> list[Recorded]:
        return [r for r in self.requests if r.path == "/v1/chat/completions"]


@contextmanager
def fake_server(*script: Reply, models_delay_s: float = 0.0) -> Iterator[FakeServer]:
    server = FakeServer(list(script) or [Reply(body=completion("🍌"))], models_delay_s)
    thread = threading.Thread(target=server.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
        thread.join(timeout=5)
