"""The API key on every vLLM route but the health check: an ASGI middleware that vLLM loads with `--middleware`.

    vllm serve /mnt/models/merged --middleware serving.api_key_guard.ApiKeyGuard   # VLLM_API_KEY in the env

Decision: deny by default. vLLM's own check asks for the key only on `/v1`, `/v2`, `/inference` and `/cohere`
paths; `/invocations` (the same chat and completion requests), `/tokenize`, `/metrics` and more answer without it.
So when `VLLM_API_KEY` is set, every HTTP and WebSocket request but `OPEN_PATHS` (`/health`, Cloud Run's keyless
startup probe) needs `Authorization: Bearer <key>`: a new vLLM route is closed until it is listed there.
- Constant-time comparison over SHA-256 digests; the key is read once, never logged, echoed or kept in plain form.
- Refused: HTTP 401 with vLLM's own body plus `WWW-Authenticate: Bearer`; a WebSocket closed before it is accepted.
- Without `VLLM_API_KEY` (or with it empty) every request passes unchanged; vLLM's check still runs inside this one.
vLLM adds the class with `app.add_middleware()`, outermost of its middlewares; serving/vllm_args.py renders the flag
when the service has a key. Standard library and Starlette only. Sources: docs/cloud-run.md#the-api-key-guard.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocketClose

API_KEY_ENV = "VLLM_API_KEY"
# Paths answered without a key: Cloud Run's startup probe (infra/cloud_run.py, serving/vllm_args.py VLLM_HEALTH_PATH).
OPEN_PATHS = frozenset({"/health"})
# vLLM's body for a refused request (AuthenticationMiddleware in vllm/entrypoints/serve/utils/server_utils.py).
UNAUTHORIZED_BODY = {"error": "Unauthorized"}
# RFC 6455 7.4.1: 1008 = policy violation. The ASGI WebSocket spec (asgi.readthedocs.io, specs/www.html,
# "Close - send event"): a close sent before the socket is accepted makes the server answer HTTP 403.
WS_POLICY_VIOLATION = 1008


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def _bearer_token(scope: Scope) -> bytes | None:
    """The token of the first `Authorization: Bearer …` header, as sent (raw bytes), or None."""
    for name, value in scope.get("headers") or ():
        if name.lower() == b"authorization":
            scheme, _, token = bytes(value).partition(b" ")
            return token if scheme.lower() == b"bearer" else None
    return None


class ApiKeyGuard:
    """ASGI middleware: with `VLLM_API_KEY` set, every request but `OPEN_PATHS` needs `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        key = os.environ.get(API_KEY_ENV, "")
        self._key_digest = _digest(key.encode("utf-8")) if key else None

    @property
    def enabled(self) -> bool:
        """Whether a key was set when the app was built (without one every request passes)."""
        return self._key_digest is not None

    def _authorized(self, scope: Scope) -> bool:
        token = _bearer_token(scope)
        if token is None or self._key_digest is None:
            return False
        return hmac.compare_digest(_digest(token), self._key_digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._key_digest is None or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)  # no key, or lifespan events
            return
        # The route path, as vLLM's own check and Starlette's router see it (root_path stripped).
        path = str(scope.get("path", "")).removeprefix(str(scope.get("root_path", "")))
        if path in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await WebSocketClose(code=WS_POLICY_VIOLATION)(scope, receive, send)
            return
        response = JSONResponse(UNAUTHORIZED_BODY, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
