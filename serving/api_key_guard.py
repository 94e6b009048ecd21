"""The API key on every vLLM route but the health check: an ASGI middleware that vLLM loads with `--middleware`.

    vllm serve /mnt/models/merged --middleware serving.api_key_guard.ApiKeyGuard   # VLLM_API_KEY in the env

Decision: deny by default. vLLM's own check (`AuthenticationMiddleware`,
vllm/entrypoints/serve/utils/server_utils.py) asks for the key only on paths starting with
`GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")`; every other route answers without it,
among them `/invocations`, the SageMaker route that serves the same chat and completion requests
(vllm-project/vllm#58144 measured full completions there without a key on 0.27.1 and 0.29.0; the
`--api-key` help in vllm/entrypoints/openai/cli_args.py says so too), and `/tokenize`,
`/detokenize`, `/pooling`, `/classify`, `/score`, `/rerank`, `/metrics`. A public service with a
key would still hand out GPU inference. So when `VLLM_API_KEY` is set, this middleware asks for
`Authorization: Bearer <key>` on every HTTP and WebSocket request except `OPEN_PATHS`:

- `/health` only: Cloud Run's startup probe (infra/cloud_run.py; it sends no header) is its one
  keyless caller. The product's clients (serving/client.py) call `/v1/…` and send the key.
  Everything else, `/ping`, `/metrics`, `/version`, `/docs`, CORS preflights (`OPTIONS`)
  included, needs the key: a new vLLM route is closed until it is listed here.
- The comparison is constant-time over SHA-256 digests (`hmac.compare_digest`), so neither the
  key nor its length leaks through timing. The key is read once from the environment and never
  logged, echoed or kept in plain form.
- A refused HTTP request gets 401 with vLLM's own body, `{"error": "Unauthorized"}`, plus
  `WWW-Authenticate: Bearer` (RFC 6750); a refused WebSocket is closed before it is accepted
  (code 1008, policy violation; the server answers the handshake with 403).
- Without `VLLM_API_KEY` (or with it empty, as vLLM treats it) every request passes unchanged:
  no key, no authentication, as with vLLM alone.
- vLLM's own check still runs inside this one on its prefixes, with the same key and the same
  parsing (scheme `Bearer` in any case, the token is everything after the first space), so a
  request let through here with the key passes there too.

How vLLM loads it: `FrontendArgs.middleware` (vllm/entrypoints/openai/cli_args.py): "If a class is
provided, vLLM will add it to the server using `app.add_middleware()`"; `build_app` imports the
path with `importlib.import_module` and calls `app.add_middleware(cls)` with no arguments, after
CORS and its own authentication, so this layer is the outermost of the app's middlewares (the
SageMaker bootstrap that runs afterwards keeps the engine's middlewares in order and puts only
an optional "throttle" outside them: model_hosting_container_standards
common/fastapi/middleware/core.py `load_middlewares`). serving/vllm_args.py renders the flag
whenever the service has a key, and serving/Dockerfile puts this package on `PYTHONPATH`.

Imports: the standard library and Starlette only (the vLLM image has both; FastAPI is built on
Starlette). Not here: several keys, per-caller keys, rate limits, key rotation without a new
revision.
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
