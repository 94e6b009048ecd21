"""demo/local_server.py on a tiny Gemma 3: transformers serve behind its thin layer on 127.0.0.1, queried by
serving/client.py.

Every test checks that nothing is left running: the process group is gone and the port is free (the tests that
only ask a server share one, checked when their class ends).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from demo.local_server import (
    EXIT_PORT_BUSY,
    LocalServer,
    LocalServerError,
    ModelNotReadyError,
    PortBusyError,
    Refusal,
    Served,
    bind,
    check_port_free,
    free_port,
    rewrite_request,
)
from serving.client import ClientError, NotFoundError, chat, chat_completion, list_models
from serving.vllm_args import COMPLETION_MARKER
from tests.serving.privileges import in_child_as_nobody
from tests.tiny_models import build_tiny_gemma
from trainer.export import write_completion_marker

REPO = Path(__file__).resolve().parents[2]
USER = [{"role": "user", "content": "Translate to emoji: I ate a banana"}]


def _alive(pid: int) -> bool:
    """True while the process runs; a zombie (exited, not yet reaped) counts as stopped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the state follows the command name, which is in parentheses and may hold spaces
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _port_free(port: int) -> bool:
    try:
        check_port_free("127.0.0.1", port)
    except PortBusyError:
        return False
    return True


def _wait_stopped(pid: int, port: int, timeout_s: float = 30) -> bool:
    """Poll until the process no longer runs AND its port is free, with a deadline.

    A process whose main thread has exited shows as a zombie while the kernel still tears
    down its other threads, and the listening socket closes only when the last one is gone.
    On a busy machine that takes a while, so a single check right after the zombie appears
    is a race; the port is what a user would trip over, so it is what we wait for.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid) and _port_free(port):
            return True
        time.sleep(0.1)
    return False


def _assert_stopped(pid: int, port: int) -> None:
    assert _wait_stopped(pid, port), f"server pid {pid} still running or port {port} still taken"


class TestServesTheModel:
    @pytest.fixture(scope="class")
    def server(self, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
        """ONE server (default name, a picked port) for the tests that only ask it; checked stopped at the end."""
        with LocalServer(tiny_model_dir, log_path=tmp_path_factory.mktemp("server") / "server.log") as server:
            pid, port = server.pid, server.port
            yield server
        assert pid is not None
        _assert_stopped(pid, port)

    def test_models_chat_and_shape(self, server: LocalServer) -> None:
        assert server.url.startswith("http://127.0.0.1:")
        assert list_models(server.url) == ["gemma"]
        body = chat_completion(server.url, USER, max_tokens=6)
        answer = chat(server.url, USER, max_tokens=6)
        assert body["object"] == "chat.completion" and body["model"] == "gemma"
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in {"stop", "length"}
        assert body["usage"]["completion_tokens"] <= 6
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
        assert answer == choice["message"]["content"], "greedy decoding is repeatable"
        assert server.log_path is not None and "POST /v1/chat/completions" in Path(server.log_path).read_text()

    def test_unknown_model_and_bad_request(self, server: LocalServer) -> None:
        with pytest.raises(NotFoundError, match="The model `other` does not exist"):
            chat(server.url, USER, model="other")
        with pytest.raises(
            ClientError, match=r"HTTP 400.*'max_tokens' or 'max_completion_tokens' is too large: 100000"
        ):
            chat(server.url, USER, max_tokens=100_000)
        # the server survives bad requests
        assert list_models(server.url) == ["gemma"]

    def test_given_port_and_name(self, tiny_model_dir: Path) -> None:
        port = free_port()
        with LocalServer(tiny_model_dir, port=port, served_model_name="gemma-emoji") as server:
            assert server.url == f"http://127.0.0.1:{port}"
            assert list_models(server.url) == ["gemma-emoji"]


class TestRefusals:
    def test_busy_port(self, tiny_model_dir: Path) -> None:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = holder.getsockname()[1]
            server = LocalServer(tiny_model_dir, port=port)
            with pytest.raises(PortBusyError, match=f"port {port} on 127.0.0.1 is in use.*--port N"):
                server.start()
            assert server.pid is None, "nothing was started"

    def test_busy_port_seen_by_the_server_itself(self, tiny_model_dir: Path) -> None:
        """The race the keeper cannot see: the port is taken between its check and the child's bind."""
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = holder.getsockname()[1]
            done = subprocess.run(
                [sys.executable, "-m", "demo.local_server", str(tiny_model_dir), "--port", str(port)],
                capture_output=True, text=True, cwd=REPO, timeout=60, check=False,
            )  # fmt: skip
        assert done.returncode == EXIT_PORT_BUSY
        assert "is in use" in done.stderr

    def test_model_without_marker(self, tmp_path: Path) -> None:
        model = build_tiny_gemma(tmp_path / "merged", marker=False)
        with pytest.raises(ModelNotReadyError, match=f"not complete \\(no {COMPLETION_MARKER}\\)"):
            LocalServer(model).start()

    def test_missing_folder(self, tmp_path: Path) -> None:
        with pytest.raises(ModelNotReadyError, match="does not exist"):
            LocalServer(tmp_path / "nothing").start()

    @pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "::"])
    def test_loopback_only(self, tiny_model_dir: Path, host: str) -> None:
        with pytest.raises(LocalServerError, match=r"binds only to 127\.0\.0\.1"):
            LocalServer(tiny_model_dir, host=host).start()

    def test_load_failure_is_reported_with_the_log(self, tmp_path: Path) -> None:
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "config.json").write_text("{not json")
        write_completion_marker(broken, base_model="broken", adapter=None)  # complete, but not loadable
        with pytest.raises(LocalServerError, match="exited with code 1 before it was ready"):
            LocalServer(broken, startup_timeout_s=60).start()


class TestPrivilegedPort:
    """EACCES (a port below ip_unprivileged_port_start) is not "in use": the message must say what it is."""

    def test_keeper_and_server_report_a_privileged_port(self) -> None:
        start = int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text())
        if start == 0:
            pytest.skip("every port is unprivileged on this machine")
        port = start - 1
        for check in (
            lambda: check_port_free("127.0.0.1", port),
            lambda: bind("127.0.0.1", port),
        ):
            result = in_child_as_nobody(check)
            assert result.startswith("PortDeniedError: "), result
            assert f"port {port} on 127.0.0.1 needs privileges" in result and "--port 8000" in result
            assert "in use" not in result


class TestAlwaysStops:
    def test_exception_inside_the_block(self, tiny_model_dir: Path) -> None:
        with pytest.raises(RuntimeError, match="injected"), LocalServer(tiny_model_dir) as server:
            pid, port = server.pid, server.port
            raise RuntimeError("injected")
        assert pid is not None
        _assert_stopped(pid, port)

    def test_keyboard_interrupt_inside_the_block_and_stop_twice(self, tiny_model_dir: Path) -> None:
        """Ctrl-C inside the block stops the server; a second stop() (a caller's own clean-up) is a no-op."""
        with pytest.raises(KeyboardInterrupt), LocalServer(tiny_model_dir) as server:
            pid, port = server.pid, server.port
            raise KeyboardInterrupt
        server.stop()
        assert pid is not None and server.pid is None
        _assert_stopped(pid, port)

    def test_startup_timeout_stops_the_child(self, tiny_model_dir: Path) -> None:
        server = LocalServer(tiny_model_dir, startup_timeout_s=0.01)
        with pytest.raises(LocalServerError, match="not ready within"):
            server.start()
        assert server.pid is None

    @pytest.mark.slow
    def test_child_exits_when_the_keeper_is_killed(self, tiny_model_dir: Path) -> None:
        """SIGKILL gives the keeper no chance to clean up; the server notices it is orphaned and exits."""
        script = (
            "import sys, time; from demo.local_server import LocalServer; "
            f"s = LocalServer({str(tiny_model_dir)!r}).start(); print(s.pid, s.port, flush=True); time.sleep(600)"
        )
        keeper = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
        try:
            assert keeper.stdout is not None
            pid, port = (int(x) for x in keeper.stdout.readline().split())
            assert _alive(pid)
            keeper.send_signal(signal.SIGKILL)
            keeper.wait(timeout=10)
            _assert_stopped(pid, port)
        finally:
            if keeper.poll() is None:
                keeper.kill()
                keeper.wait()


class TestRequestRewriting:
    """`rewrite_request`: what the layer changes in a request before transformers serve sees it."""

    SERVED = Served("gemma", "/models/merged", None)

    def test_the_served_name_becomes_the_folder_and_sampling_the_services(self) -> None:
        body = rewrite_request(self.SERVED, "/v1/chat/completions", {"model": "gemma", "messages": USER})
        assert body["model"] == "/models/merged" and body["temperature"] == 0.0 and body["top_p"] == 1.0
        assert (
            rewrite_request(self.SERVED, "/v1/chat/completions", {"messages": USER, "temperature": 0.7})["temperature"]
            == 0.7
        )

    def test_max_completion_tokens_is_max_tokens(self) -> None:
        body = rewrite_request(self.SERVED, "/v1/chat/completions", {"messages": USER, "max_completion_tokens": 5})
        assert body["max_tokens"] == 5 and "max_completion_tokens" not in body

    @pytest.mark.parametrize(
        ("body", "status", "message"),
        [
            ({"model": "other", "messages": USER}, 404, "The model `other` does not exist."),
            ({"messages": USER, "max_tokens": 0}, 400, "max_tokens must be at least 1, got 0."),
            ([1, 2], 400, "must be a JSON object"),
        ],
    )
    def test_refusals(self, body: object, status: int, message: str) -> None:
        with pytest.raises(Refusal, match=message) as info:
            rewrite_request(self.SERVED, "/v1/chat/completions", body)
        assert info.value.status == status
