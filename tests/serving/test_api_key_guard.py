"""serving/api_key_guard.py: with VLLM_API_KEY set, no route but /health answers without the key.

vLLM's own check covers only /v1, /v2, /inference and /cohere; /invocations (the SageMaker route) served
full completions without a key (vllm-project/vllm#58144). The app here has vLLM's routes of each kind and is
wrapped the way vLLM's `build_app` wraps it: CORS first, then the `--middleware` value the service renders,
imported by its dotted path and added with `app.add_middleware(cls)`. It runs under uvicorn on 127.0.0.1 and
is called over real HTTP. The last test rebuilds the image's file layout from serving/Dockerfile and starts
the real entrypoint, whose `vllm` imports the middleware the way vLLM does, with only the image's PYTHONPATH.
"""

from __future__ import annotations

import http.client
import importlib
import inspect
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

from serving.api_key_guard import OPEN_PATHS, UNAUTHORIZED_BODY, WS_POLICY_VIOLATION
from serving.vllm_args import VLLM_HEALTH_PATH, VllmServerConfig, render_args

KEY = "sk-test-9f1c2e"  # a test value, not a credential
SERVING = Path(__file__).resolve().parents[2] / "serving"
# Routes vLLM serves outside its own GUARDED_PREFIX: inference (/invocations, /tokenize) and information.
INFERENCE = [("POST", "/v1/chat/completions"), ("POST", "/invocations"), ("POST", "/tokenize")]
OTHER_OPEN_IN_VLLM = [("GET", "/metrics"), ("GET", "/ping")]


def _middleware_arg() -> str:
    """The `--middleware` value the service renders when it has a key."""
    args = render_args(VllmServerConfig(api_key_guard=True))
    return args[args.index("--middleware") + 1]


def _vllm_like_app(calls: list[str]) -> FastAPI:
    """vLLM's route kinds, each recording that it ran, wrapped as vLLM's build_app wraps its app."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat() -> dict[str, Any]:
        calls.append("/v1/chat/completions")
        return {"choices": [{"message": {"role": "assistant", "content": "🍌"}}]}

    @app.post("/invocations")
    async def invocations() -> dict[str, Any]:
        calls.append("/invocations")
        return {"choices": [{"message": {"role": "assistant", "content": "🍌"}}]}

    @app.post("/tokenize")
    async def tokenize() -> dict[str, Any]:
        calls.append("/tokenize")
        return {"tokens": [1, 2, 3]}

    @app.get("/metrics")
    async def metrics() -> Response:
        calls.append("/metrics")
        return Response("vllm:num_requests_running 0\n", media_type="text/plain")

    @app.get("/ping")
    async def ping() -> Response:
        calls.append("/ping")
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> Response:
        calls.append("/health")
        return Response(status_code=200)

    # vllm/entrypoints/openai/api_server.py build_app: CORS, ..., then each --middleware by import path.
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    module_path, object_name = _middleware_arg().rsplit(".", 1)
    imported = getattr(importlib.import_module(module_path), object_name)
    assert inspect.isclass(imported), "vLLM adds a class with app.add_middleware(); a function would be @app.middleware"
    app.add_middleware(imported)  # type: ignore[arg-type]  # as vLLM writes it: the class is known at run time
    return app


@contextmanager
def _serve(app: FastAPI) -> Iterator[int]:
    """The app under uvicorn on 127.0.0.1 (a free port), stopped on exit; yields the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


def _call(port: int, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = json.dumps({"model": "gemma", "messages": [{"role": "user", "content": "banana"}]})
        conn.request(method, path, body=body if method == "POST" else None, headers=headers or {})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            payload: Any = json.loads(raw) if raw else None
        except ValueError:
            payload = raw.decode()
        return resp.status, payload, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


@pytest.fixture(scope="module")
def _guarded_server() -> Iterator[tuple[int, list[str]]]:
    """One running app, built while VLLM_API_KEY is set (vLLM builds its app in the process that has the env)."""
    calls: list[str] = []
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_API_KEY", KEY)
        with _serve(_vllm_like_app(calls)) as port:
            yield port, calls


@pytest.fixture
def guarded(_guarded_server: tuple[int, list[str]]) -> tuple[int, list[str]]:
    """The guarded app's port and the routes that ran during this test."""
    _guarded_server[1].clear()
    return _guarded_server


class TestWithAKey:
    @pytest.mark.parametrize(("method", "path"), INFERENCE + OTHER_OPEN_IN_VLLM)
    def test_no_key_is_refused_and_nothing_runs(self, guarded: tuple[int, list[str]], method: str, path: str) -> None:
        """/invocations and /tokenize too: vLLM's own prefix check let them through (vllm-project/vllm#58144)."""
        port, calls = guarded
        status, body, headers = _call(port, method, path)
        assert (status, body) == (401, UNAUTHORIZED_BODY), (path, status, body)
        assert headers.get("www-authenticate") == "Bearer"
        assert calls == [], f"{path} ran without a key"

    @pytest.mark.parametrize(
        "authorization",
        [
            f"Bearer {KEY}x",
            f"Bearer {KEY[:-1]}",
            "Bearer ",
            f"Basic {KEY}",
            KEY,
            f"Token {KEY}",
        ],
        ids=["longer", "shorter", "empty", "basic-scheme", "no-scheme", "other-scheme"],
    )
    @pytest.mark.parametrize(("method", "path"), INFERENCE)
    def test_a_wrong_key_is_refused(
        self, guarded: tuple[int, list[str]], method: str, path: str, authorization: str
    ) -> None:
        port, calls = guarded
        status, body, _ = _call(port, method, path, {"Authorization": authorization})
        assert (status, body) == (401, UNAUTHORIZED_BODY), (path, authorization, status)
        assert calls == []

    @pytest.mark.parametrize(("method", "path"), INFERENCE + OTHER_OPEN_IN_VLLM)
    def test_the_right_key_passes(self, guarded: tuple[int, list[str]], method: str, path: str) -> None:
        port, calls = guarded
        for authorization in (f"Bearer {KEY}", f"bearer {KEY}"):  # the scheme is case-insensitive (RFC 7235)
            status, _, _ = _call(port, method, path, {"Authorization": authorization})
            assert status == 200, (path, authorization, status)
        assert calls == [path, path]

    def test_the_health_check_needs_no_key(self, guarded: tuple[int, list[str]]) -> None:
        """Cloud Run's startup probe sends no header: /health must answer 200 without one."""
        port, calls = guarded
        assert _call(port, "GET", VLLM_HEALTH_PATH)[0] == 200
        assert calls == [VLLM_HEALTH_PATH]

    @pytest.mark.parametrize("path", ["/health/", "//health", "/healthz", "/Health", "/health/../invocations"])
    def test_only_the_exact_health_path_is_open(self, guarded: tuple[int, list[str]], path: str) -> None:
        port, calls = guarded
        status, _, _ = _call(port, "GET", path)
        assert status == 401, (path, status)
        assert calls == []

    def test_a_cors_preflight_is_refused_too(self, guarded: tuple[int, list[str]]) -> None:
        """Deny by default: no browser front end is part of the product, so OPTIONS gets no exception."""
        port, calls = guarded
        headers = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
        assert _call(port, "OPTIONS", "/invocations", headers)[0] == 401
        assert calls == []

    def test_only_health_is_open(self) -> None:
        assert frozenset({VLLM_HEALTH_PATH}) == OPEN_PATHS


@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
def test_without_a_key_everything_passes(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    """No VLLM_API_KEY (or an empty one, which vLLM also ignores): the middleware changes nothing."""
    if value is None:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("VLLM_API_KEY", value)
    calls: list[str] = []
    with _serve(_vllm_like_app(calls)) as port:
        for method, path in [*INFERENCE, *OTHER_OPEN_IN_VLLM, ("GET", VLLM_HEALTH_PATH)]:
            assert _call(port, method, path)[0] == 200, path
    assert len(calls) == len(INFERENCE) + len(OTHER_OPEN_IN_VLLM) + 1


class TestWebSocket:
    """vLLM serves WebSockets too (/v1/realtime); uvicorn here has no WebSocket library, so the ASGI call is direct."""

    @staticmethod
    def _connect(app: Any, headers: list[tuple[bytes, bytes]]) -> tuple[list[dict[str, Any]], list[str]]:
        import asyncio

        sent: list[dict[str, Any]] = []
        reached: list[str] = []

        async def inner(scope: Any, receive: Any, send: Any) -> None:
            reached.append(scope["path"])
            await send({"type": "websocket.accept"})

        async def receive() -> dict[str, Any]:
            return {"type": "websocket.connect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "websocket", "path": "/v1/realtime", "root_path": "", "headers": headers}
        loop = asyncio.new_event_loop()  # not asyncio.run: it would unset the main thread's loop for later tests
        try:
            loop.run_until_complete(app(inner)(scope, receive, send))
        finally:
            loop.close()
        return sent, reached

    def test_refused_before_accept_without_the_key(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from serving.api_key_guard import ApiKeyGuard

        monkeypatch.setenv("VLLM_API_KEY", KEY)
        sent, reached = self._connect(ApiKeyGuard, [(b"authorization", b"Bearer nope")])
        assert reached == [] and sent[0]["type"] == "websocket.close" and sent[0]["code"] == WS_POLICY_VIOLATION

    def test_accepted_with_the_key(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from serving.api_key_guard import ApiKeyGuard

        monkeypatch.setenv("VLLM_API_KEY", KEY)
        sent, reached = self._connect(ApiKeyGuard, [(b"authorization", f"Bearer {KEY}".encode())])
        assert reached == ["/v1/realtime"] and sent == [{"type": "websocket.accept"}]


class TestInTheImageLayout:
    """`vllm serve --middleware serving.api_key_guard.ApiKeyGuard` must import in the image, not only in a checkout."""

    @staticmethod
    def _image_root(tmp_path: Path) -> tuple[Path, dict[str, str], Path]:
        """Files placed as serving/Dockerfile's COPY lines place them; its ENV values and WORKDIR, under tmp_path."""
        text = SERVING.joinpath("Dockerfile").read_text()
        root = tmp_path / "image"
        for sources, dest in re.findall(r"^COPY (?!--from)((?:\S+ )+)(\S+)$", text, re.MULTILINE):
            target = root / dest.lstrip("/")
            target.mkdir(parents=True, exist_ok=True)
            for source in sources.split():
                shutil.copy2(SERVING / source, target / source)
        env: dict[str, str] = {}
        for name, value in re.findall(r"^ENV (\w+)=(\S+)$", text, re.MULTILINE):
            # Docker's ${VAR:+word} is the shell's: evaluate it as the base image would (no PYTHONPATH of its own).
            done = subprocess.run(
                ["env", "-i", "bash", "-c", f'printf %s "{value}"'], capture_output=True, text=True, check=True
            )
            env[name] = done.stdout
        workdirs = re.findall(r"^WORKDIR (\S+)$", text, re.MULTILINE)
        workdir = root / workdirs[-1].lstrip("/")
        workdir.mkdir(parents=True, exist_ok=True)
        return root, env, workdir

    @staticmethod
    def _stub_vllm(bin_dir: Path) -> None:
        """A `vllm` console script that loads each --middleware as vLLM's build_app does, and reports where from."""
        bin_dir.mkdir()
        stub = bin_dir / "vllm"
        stub.write_text(
            f"#!{sys.executable}\n"
            "import importlib, inspect, json, sys\n"
            "args = sys.argv[2:]\n"
            "value = args[args.index('--middleware') + 1]\n"
            "module_path, object_name = value.rsplit('.', 1)\n"
            "imported = getattr(importlib.import_module(module_path), object_name)\n"
            "print(json.dumps({'file': inspect.getfile(imported), 'isclass': inspect.isclass(imported)}))\n"
        )
        stub.chmod(0o755)

    def _start(self, tmp_path: Path, with_image_env: bool) -> tuple[subprocess.CompletedProcess[str], Path]:
        root, image_env, workdir = self._image_root(tmp_path)
        bin_dir = tmp_path / "bin"
        self._stub_vllm(bin_dir)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", GEMMA_FT_SKIP_MODEL_CHECK="1")
        # the entrypoint's import check runs the interpreter vLLM runs on (python3 in the image; here the stub's)
        env["PYTHON"] = sys.executable
        if with_image_env:
            assert image_env.get("PYTHONPATH"), "serving/Dockerfile sets no PYTHONPATH: vLLM cannot import the guard"
            env["PYTHONPATH"] = os.pathsep.join(str(root / p.lstrip("/")) for p in image_env["PYTHONPATH"].split(":"))
        args = render_args(VllmServerConfig(model="/mnt/models/merged", api_key_guard=True))
        done = subprocess.run(
            ["bash", str(root / "opt/gemma-serving/entrypoint.sh"), *args],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return done, root

    def test_the_rendered_middleware_imports_from_the_image_layout(self, tmp_path: Path) -> None:
        done, root = self._start(tmp_path, with_image_env=True)
        assert done.returncode == 0, done.stderr
        loaded = json.loads(done.stdout.strip().splitlines()[-1])
        assert loaded["isclass"]
        assert Path(loaded["file"]) == root / "opt/gemma-serving/serving/api_key_guard.py"

    def test_without_the_images_pythonpath_it_would_not(self, tmp_path: Path) -> None:
        """The control: the ENV line, not the checkout, is what makes the import path resolve."""
        done, _ = self._start(tmp_path, with_image_env=False)
        assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, done.stderr
