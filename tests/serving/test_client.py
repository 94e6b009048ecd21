"""serving/client.py against a scripted server on 127.0.0.1: retries, error messages, tokens.

The real-server path (the local server on a tiny Gemma) is in test_local_server.py.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from serving import client
from serving.client import (
    AuthError,
    ClientError,
    Credentials,
    NotFoundError,
    RequestTimeoutError,
    RetryPolicy,
    UnavailableError,
    base_url,
    chat,
    chat_completion,
    cold_start_deadline_s,
    cold_start_policy,
    list_models,
    resolve_credentials,
    resolve_token,
)
from serving.startup import STARTUP_WINDOW
from tests.serving.fake_server import Reply, completion, fake_server

FAST = RetryPolicy(attempts=4, initial_delay_s=0.01, max_delay_s=0.05, deadline_s=10)
SECRET = "ya29.not-a-real-token-but-secret"
USER = [{"role": "user", "content": "Translate to emoji: I ate a banana"}]


@pytest.fixture(autouse=True)
def _no_ambient_allowlist(monkeypatch: pytest.MonkeyPatch) -> None:
    """The token allowlist comes from the environment: each test starts without one."""
    monkeypatch.delenv(client.URL_ENV, raising=False)
    monkeypatch.delenv(client.TRUSTED_URLS_ENV, raising=False)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TestHappyPath:
    def test_chat_returns_the_content_and_sends_an_openai_request(self) -> None:
        with fake_server(Reply(body=completion("🍌🤔😋🥣"))) as srv:
            assert chat(srv.url, USER, model="gemma", max_tokens=12, temperature=0.2, retry=FAST) == "🍌🤔😋🥣"
        (req,) = srv.chat_requests
        assert req.method == "POST"
        assert req.headers["Content-Type"] == "application/json"
        assert req.body == {"model": "gemma", "messages": USER, "max_tokens": 12, "temperature": 0.2}

    def test_model_defaults_to_the_first_served(self) -> None:
        with fake_server() as srv:
            chat(srv.url, USER, retry=FAST)
        assert [r.path for r in srv.requests] == ["/v1/models", "/v1/chat/completions"]
        assert srv.chat_requests[0].body["model"] == "gemma"

    def test_list_models(self) -> None:
        with fake_server() as srv:
            assert list_models(srv.url + "/v1/", retry=FAST) == ["gemma"]

    def test_unexpected_shape(self) -> None:
        with fake_server(Reply(body={"choices": []})) as srv, pytest.raises(ClientError, match="unexpected shape"):
            chat_completion(srv.url, USER, model="gemma", retry=FAST)


class TestRetries:
    def test_503_then_200(self) -> None:
        """A cold Cloud Run instance answers 503 until vLLM is up."""
        script = [Reply(503, {"error": {"message": "loading"}}), Reply(503), Reply(body=completion("🥣"))]
        with fake_server(*script) as srv:
            assert chat(srv.url, USER, model="gemma", retry=FAST) == "🥣"
        assert len(srv.chat_requests) == 3

    def test_429_until_the_budget_runs_out(self) -> None:
        with (
            fake_server(Reply(429, {"error": {"message": "no instance available"}})) as srv,
            pytest.raises(UnavailableError, match=r"after 4 tries .*HTTP 429: no instance available"),
        ):
            chat(srv.url, USER, model="gemma", retry=FAST)
        assert len(srv.chat_requests) == FAST.attempts

    def test_connection_refused_is_retried_then_explained(self) -> None:
        url = f"http://127.0.0.1:{_closed_port()}"
        with pytest.raises(UnavailableError, match=r"not available after 4 tries.*connection failed"):
            chat(url, USER, model="gemma", retry=FAST)

    def test_backoff_is_bounded(self) -> None:
        policy = RetryPolicy(initial_delay_s=1, max_delay_s=20)
        assert [policy.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 20, 20]
        assert policy.delay(1, retry_after="5") == 5
        assert policy.delay(1, retry_after="600") == 20

    def test_deadline_stops_retries(self) -> None:
        policy = RetryPolicy(attempts=100, initial_delay_s=0.2, max_delay_s=0.2, deadline_s=0.5)
        with fake_server(Reply(503)) as srv, pytest.raises(UnavailableError):
            chat(srv.url, USER, model="gemma", retry=policy)
        assert len(srv.chat_requests) <= 4


class TestErrors:
    def test_401_without_token_says_no_token_was_sent(self) -> None:
        with (
            fake_server(Reply(401, {"error": "unauthorized"})) as srv,
            pytest.raises(AuthError, match=r"HTTP 401 .*no identity token was sent: tokens are never sent to local"),
        ):
            chat(srv.url, USER, model="gemma", retry=FAST)
        assert len(srv.chat_requests) == 1, "auth errors are not retried"

    def test_403_with_a_token_names_the_role(self) -> None:
        with fake_server(Reply(403)) as srv, pytest.raises(AuthError, match=r"roles/run\.invoker") as info:
            chat(srv.url, USER, model="gemma", retry=FAST, creds=Credentials(SECRET, "--token"))
        assert "servingInvokers" in str(info.value) and SECRET not in str(info.value)

    def test_timeout_reaches_the_model_lookup(self) -> None:
        """--timeout applies to GET /v1/models too (it used a fixed 30 s, and the error then said "raise --timeout")."""
        with (
            fake_server(models_delay_s=1.5) as srv,
            pytest.raises(RequestTimeoutError, match=r"v1/models did not answer within 0\.5 s"),
        ):
            chat(srv.url, USER, timeout_s=0.5, retry=FAST)
        assert srv.chat_requests == []

    def test_404_shows_the_server_message(self) -> None:
        body = {"error": {"message": "The model `gemma-x` does not exist.", "code": 404}}
        with (
            fake_server(Reply(404, body)) as srv,
            pytest.raises(NotFoundError, match=r"--list-models.*The model `gemma-x` does not exist"),
        ):
            chat(srv.url, USER, model="gemma-x", retry=FAST)

    def test_timeout(self) -> None:
        with (
            fake_server(Reply(body=completion("late"), delay_s=1.5)) as srv,
            pytest.raises(RequestTimeoutError, match=r"did not answer within 0\.3 s"),
        ):
            chat(srv.url, USER, model="gemma", timeout_s=0.3, retry=FAST)

    def test_redirects_are_not_followed(self) -> None:
        """urllib would resend the Authorization header to wherever a redirect points."""
        with (
            fake_server(Reply(302, headers={"Location": "http://127.0.0.1:9/steal"})) as srv,
            pytest.raises(ClientError, match="redirects are not followed"),
        ):
            chat(srv.url, USER, model="gemma", retry=FAST)
        assert len(srv.requests) == 1

    def test_500(self) -> None:
        with (
            fake_server(Reply(500, {"error": {"message": "boom"}})) as srv,
            pytest.raises(ClientError, match=r"HTTP 500.*boom"),
        ):
            chat(srv.url, USER, model="gemma", retry=FAST)

    @pytest.mark.parametrize("url", ["ftp://x", "not a url", "run.app"])
    def test_bad_url(self, url: str) -> None:
        with pytest.raises(ClientError, match="is not an http"):
            base_url(url)


class TestTokens:
    def test_no_token_to_localhost_even_when_given(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(client.TOKEN_ENV, SECRET)
        with fake_server() as srv:
            chat(srv.url, USER, token=SECRET, retry=FAST)
            list_models(srv.url.replace("127.0.0.1", "localhost"), token=SECRET, retry=FAST)
        assert srv.requests and all("Authorization" not in r.headers for r in srv.requests)

    def test_bearer_header_format(self) -> None:
        """What a Cloud Run request carries (sent here to the local fake directly, bypassing resolve_token)."""
        with fake_server() as srv:
            client._request_json("GET", f"{srv.url}/v1/models", token=SECRET, retry=FAST)
        assert srv.requests[0].headers["Authorization"] == f"Bearer {SECRET}"

    def test_resolution_order(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        run = "https://serve-gemma-emoji-abc-uc.a.run.app"
        gcloud = tmp_path / "gcloud"
        gcloud.write_text("#!/bin/sh\necho from-gcloud\n")
        gcloud.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.delenv(client.TOKEN_ENV, raising=False)
        monkeypatch.setenv(client.URL_ENV, run)
        assert resolve_token(run) == "from-gcloud"
        monkeypatch.setenv(client.TOKEN_ENV, "from-env")
        assert resolve_token(run) == "from-env"
        assert resolve_token(run, "explicit") == "explicit"
        assert resolve_token("http://example.com", "explicit") is None, "never over plain http"
        assert resolve_token("http://127.0.0.1:8000", "explicit") is None
        assert resolve_token("https://localhost:8443", "explicit") is None
        monkeypatch.delenv(client.TOKEN_ENV)
        assert resolve_token("https://example.com") is None, "gcloud only for Cloud Run URLs"

    def test_no_gcloud(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(client.TOKEN_ENV, raising=False)
        monkeypatch.setattr(client.shutil, "which", lambda _: None)
        monkeypatch.setenv(client.URL_ENV, "https://x-uc.a.run.app")
        assert resolve_token("https://x-uc.a.run.app") is None

    def test_cli_never_prints_the_token(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(client, "DEFAULT_RETRY", FAST)
        with fake_server(Reply(401, {"error": {"message": "bad token"}})) as srv:
            code = client.main(["--url", srv.url, "--token", SECRET, "--no-retry", "hello"])
        out = capsys.readouterr()
        assert code == 1
        assert "HTTP 401" in out.err
        assert SECRET not in out.out + out.err


class TestCli:
    def test_prints_the_answer(self, capsys: pytest.CaptureFixture[str]) -> None:
        with fake_server(Reply(body=completion("🍌🥣"))) as srv:
            code = client.main(
                ["--url", srv.url, "--max-tokens", "8", "--system", "emoji only", "Translate to emoji: soup"]
            )
        assert code == 0
        assert capsys.readouterr().out.strip() == "🍌🥣"
        assert srv.chat_requests[0].body["messages"][0] == {"role": "system", "content": "emoji only"}
        assert srv.chat_requests[0].body["max_tokens"] == 8

    def test_list_models(self, capsys: pytest.CaptureFixture[str]) -> None:
        with fake_server() as srv:
            assert client.main(["--url", srv.url, "--list-models"]) == 0
        assert capsys.readouterr().out.strip() == "gemma"

    def test_url_from_env(self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
        with fake_server(Reply(body=completion("ok"))) as srv:
            monkeypatch.setenv(client.URL_ENV, srv.url)
            assert client.main(["hi"]) == 0

    def test_needs_url_and_prompt(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(client.URL_ENV, raising=False)
        with pytest.raises(SystemExit):
            client.main(["hi"])
        with pytest.raises(SystemExit):
            client.main(["--url", "http://127.0.0.1:1"])


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
        ("https://serve-abc.a.run.app/v1/", "https://serve-abc.a.run.app"),
    ],
)
def test_base_url(given: str, expected: str) -> None:
    assert base_url(given) == expected


RUN_URL = "https://gft-dev-vllm-abc123-uc.a.run.app"


def _trust_the_stack_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """What docs/serving.md's `export GEMMA_FT_URL="$(pulumi stack output servingUrl)"` does."""
    monkeypatch.setenv(client.URL_ENV, RUN_URL)


def _stub_gcloud(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Path:
    """A `gcloud` on PATH running `body`; it appends its arguments to calls.txt."""
    calls = tmp_path / "calls.txt"
    gcloud = tmp_path / "gcloud"
    gcloud.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n{body}\n')
    gcloud.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(client.TOKEN_ENV, raising=False)
    return calls


class TestAutomaticTokensStayOnCloudRun:
    """A token the client finds by itself goes only to *.run.app; an explicit --token goes where it is sent."""

    @pytest.mark.parametrize("host", ["https://api.example.com", "https://evil.run.app.example.com", "https://run.app"])
    def test_env_token_is_not_sent_elsewhere(self, monkeypatch: pytest.MonkeyPatch, host: str) -> None:
        monkeypatch.setenv(client.TOKEN_ENV, SECRET)
        monkeypatch.setenv(client.TRUSTED_URLS_ENV, host)
        _trust_the_stack_url(monkeypatch)
        assert resolve_token(host) is None
        assert resolve_token(RUN_URL) == SECRET

    def test_gcloud_token_is_not_minted_for_other_hosts(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        calls = _stub_gcloud(tmp_path, monkeypatch, "echo from-gcloud")
        _trust_the_stack_url(monkeypatch)
        creds = resolve_credentials("https://api.example.com")
        assert creds.token is None and not calls.exists(), "gcloud must not even be asked"
        assert "not a Cloud Run URL" in creds.missing_because and "--token" in creds.missing_because
        assert resolve_token(RUN_URL) == "from-gcloud"

    def test_explicit_token_goes_to_any_https_host(self) -> None:
        assert resolve_token("https://api.example.com", SECRET) == SECRET
        assert resolve_token("http://api.example.com", SECRET) is None, "never over plain http"


class TestTokensOnlyToTheStacksService:
    """Anyone can deploy a *.run.app service, and a gcloud user token works on every service its account may
    invoke: an automatic token goes only to the stack's servingUrl ($GEMMA_FT_URL) or an explicit allowlist."""

    OTHER = "https://someone-elses-service-xyz-uc.a.run.app"

    def test_another_run_app_host_gets_no_token(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        calls = _stub_gcloud(tmp_path, monkeypatch, "echo from-gcloud")
        _trust_the_stack_url(monkeypatch)
        monkeypatch.setenv(client.TOKEN_ENV, SECRET)
        creds = resolve_credentials(self.OTHER)
        assert creds.token is None and not calls.exists(), "neither the env token nor gcloud for another service"
        assert "GEMMA_FT_URL" in creds.missing_because and "pulumi stack output servingUrl" in creds.missing_because
        assert resolve_token(RUN_URL) == SECRET, "the stack's own service still gets it"

    def test_nothing_trusted_means_no_automatic_token(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(client.TOKEN_ENV, SECRET)
        assert resolve_token(RUN_URL) is None

    def test_the_other_host_receives_no_token_on_the_wire(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Through the whole request path: the server behind a run.app name that is not the stack's sees no token."""
        monkeypatch.setenv(client.TOKEN_ENV, SECRET)
        _trust_the_stack_url(monkeypatch)
        creds = resolve_credentials(self.OTHER)
        with fake_server() as srv:
            chat(srv.url, USER, model="gemma", retry=FAST, creds=creds)
        sent = srv.chat_requests[0].headers
        assert "Authorization" not in sent and "X-Serverless-Authorization" not in sent

    @pytest.mark.parametrize("listed", [f"{RUN_URL}/", f"https://other.example.com, {RUN_URL.upper()}"])
    def test_explicit_allowlist(self, monkeypatch: pytest.MonkeyPatch, listed: str) -> None:
        monkeypatch.setenv(client.TOKEN_ENV, SECRET)
        monkeypatch.setenv(client.TRUSTED_URLS_ENV, listed)
        assert resolve_token(f"{RUN_URL}/v1") == SECRET
        assert resolve_token(self.OTHER) is None
        assert resolve_credentials(self.OTHER, trusted_urls=frozenset({self.OTHER})).token == SECRET

    def test_the_cli_trusts_its_default_url(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`export GEMMA_FT_URL=...` then no --url: the stack's URL is both the target and the allowlist."""
        monkeypatch.setenv(client.TOKEN_ENV, SECRET)
        _trust_the_stack_url(monkeypatch)
        args = client._parse_args(["hi"])
        assert args.url == RUN_URL
        assert resolve_token(base_url(args.url)) == SECRET


class TestGcloud:
    def test_stdin_is_closed_and_flags_pass_through(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        """gcloud must never wait on a prompt: its stdin is /dev/null, not ours."""
        calls = _stub_gcloud(tmp_path, monkeypatch, "readlink /proc/$$/fd/0")
        _trust_the_stack_url(monkeypatch)
        sa = "ci@p.iam.gserviceaccount.com"
        assert resolve_token(RUN_URL, audience=RUN_URL, impersonate=sa) == "/dev/null"
        args = calls.read_text().split()
        assert args[:3] == ["auth", "print-identity-token", "--quiet"]
        assert f"--impersonate-service-account={sa}" in args and f"--audiences={RUN_URL}" in args

    def test_not_logged_in_is_explained_with_the_fix(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        said = "ERROR: (gcloud.auth.print-identity-token) You do not currently have an active account selected."
        _stub_gcloud(tmp_path, monkeypatch, f'echo "{said}" >&2; exit 1')
        _trust_the_stack_url(monkeypatch)
        creds = resolve_credentials(RUN_URL)
        assert creds.token is None
        assert said in creds.missing_because
        assert "gcloud auth login" in creds.missing_because and "--impersonate-service-account" in creds.missing_because

    def test_403_without_a_token_says_why_not_which_role(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        """Cloud Run answers 403 to a request without a token: granting run.invoker would not help."""
        _stub_gcloud(tmp_path, monkeypatch, 'echo "no active account" >&2; exit 1')
        _trust_the_stack_url(monkeypatch)
        creds = resolve_credentials(RUN_URL)
        with fake_server(Reply(403)) as srv, pytest.raises(AuthError) as info:
            chat(srv.url, USER, model="gemma", retry=FAST, creds=creds)
        message = str(info.value)
        assert "no identity token was sent" in message and "no active account" in message
        assert "gcloud auth login" in message and "roles/run.invoker" not in message

    def test_no_gcloud(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(client.TOKEN_ENV, raising=False)
        monkeypatch.setattr(client.shutil, "which", lambda _: None)
        _trust_the_stack_url(monkeypatch)
        creds = resolve_credentials(RUN_URL)
        assert creds.token is None and "gcloud is not installed" in creds.missing_because


class TestStartupWindowDocs:
    def test_docs_state_the_window_and_the_client_default_timeout(self) -> None:
        """docs/serving.md's "Startup window" gives the probe's numbers and the client's cold-start deadline.

        It said 480 s after the window changed; the client's deadline is the window plus one default --timeout.
        """
        serving = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text(encoding="utf-8")
        text = " ".join(serving.split("\n## Startup window\n\n", 1)[1].split("\n\n", 1)[0].split())
        default_timeout = client._parse_args(["--url", "http://127.0.0.1:8000", "hi"]).timeout
        assert default_timeout == client.DEFAULT_TIMEOUT_S
        assert f"first startup probe {STARTUP_WINDOW.initial_delay_s} s after the container starts" in text
        assert f"every {STARTUP_WINDOW.period_s} s, up to {STARTUP_WINDOW.failure_threshold} failures" in text
        assert f"the window is {STARTUP_WINDOW.total_s} s" in text
        assert f"`--timeout` (default {default_timeout:g} s): {cold_start_deadline_s(default_timeout):g} s" in text


class TestColdStart:
    def test_cloud_run_urls_retry_timeouts_across_the_startup_window(self) -> None:
        policy = cold_start_policy(RUN_URL, client.DEFAULT_RETRY, 120)
        assert policy.retry_timeouts and policy.deadline_s >= STARTUP_WINDOW.total_s + 120
        assert not cold_start_policy("http://127.0.0.1:8000", client.DEFAULT_RETRY, 120).retry_timeouts
        assert not cold_start_policy(RUN_URL, client.NO_RETRY, 120).retry_timeouts, "--no-retry means no retry"

    def test_429_for_longer_than_eight_tries_then_the_instance_answers(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A cold start answers 429 for as long as the image pull and model load take: a try count must not end it.

        The default policy's 8 tries (about 70 s of backoff) gave up long before a 480 s startup window; here
        the delays are shortened so 12 refusals take a moment, but the policy is the one the client uses.
        """
        monkeypatch.setattr(client, "is_cloud_run", lambda url: True)
        quick = RetryPolicy(initial_delay_s=0.01, max_delay_s=0.02)
        assert quick.attempts == client.DEFAULT_RETRY.attempts == 8
        busy = Reply(429, {"error": {"message": "no available instance"}})
        with fake_server(*[busy] * 12, Reply(body=completion("🥣"))) as srv:
            assert chat(srv.url, USER, model="gemma", timeout_s=5, retry=quick) == "🥣"
        assert len(srv.chat_requests) == 13

    def test_cold_start_retries_end_at_the_startup_window(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A service that never comes up is given up on once the startup window and one timeout have passed."""
        monkeypatch.setattr(client, "is_cloud_run", lambda url: True)
        clock = [0.0]

        class FakeTime:
            @staticmethod
            def monotonic() -> float:
                return clock[0]

            @staticmethod
            def sleep(seconds: float) -> None:
                clock[0] += seconds

        monkeypatch.setattr(client, "time", FakeTime)
        with fake_server(Reply(503)) as srv, pytest.raises(UnavailableError) as info:
            chat(srv.url, USER, model="gemma", timeout_s=30)
        waited = clock[0]
        assert STARTUP_WINDOW.total_s - client.DEFAULT_RETRY.max_delay_s <= waited <= STARTUP_WINDOW.total_s + 30
        assert len(srv.chat_requests) > client.DEFAULT_RETRY.attempts, "bounded by time, not by 8 tries"
        assert f"startup window is {STARTUP_WINDOW.total_s} s" in str(info.value)

    def test_first_request_times_out_then_the_instance_answers(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The whole path, with this fake standing in for a Cloud Run URL whose first request waits on a cold start."""
        monkeypatch.setattr(client, "is_cloud_run", lambda url: True)
        script = [Reply(body=completion("late"), delay_s=3.0), Reply(body=completion("🥣"))]
        with fake_server(*script) as srv:
            assert chat(srv.url, USER, model="gemma", timeout_s=1.0, retry=FAST) == "🥣"
        assert len(srv.chat_requests) >= 2, "the timed-out first request was retried"


class TestApiKey:
    def test_key_in_authorization_and_token_in_the_serverless_header(self) -> None:
        with fake_server() as srv:
            chat(srv.url, USER, model="gemma", retry=FAST, creds=Credentials("id-token", "--token", api_key=SECRET))
        headers = srv.chat_requests[0].headers
        assert headers["Authorization"] == f"Bearer {SECRET}"
        assert headers["X-Serverless-Authorization"] == "Bearer id-token"

    def test_key_from_env_to_a_local_server(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(client.API_KEY_ENV, SECRET)
        with fake_server() as srv:
            list_models(srv.url, retry=FAST)
        assert srv.requests[0].headers["Authorization"] == f"Bearer {SECRET}"

    @pytest.mark.parametrize(
        "url", ["https://api.example.com/v1", "https://someone-elses-service-xyz-uc.a.run.app", "https://evil.example"]
    )
    def test_key_from_env_goes_to_no_host_off_the_allowlist(self, monkeypatch: pytest.MonkeyPatch, url: str) -> None:
        """A key left in the shell is worth as much as the service: like an ambient token, it goes only where the
        user said ($GEMMA_FT_URL, $GEMMA_FT_TRUSTED_URLS) or to this machine."""
        monkeypatch.setenv(client.API_KEY_ENV, SECRET)
        _trust_the_stack_url(monkeypatch)
        creds = resolve_credentials(url, token="id-token")
        assert creds.api_key is None
        assert SECRET not in json.dumps(creds.headers())
        assert client.URL_ENV in creds.key_withheld_because and SECRET not in creds.key_withheld_because

    def test_key_from_env_goes_to_the_allow_listed_service(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(client.API_KEY_ENV, SECRET)
        monkeypatch.setenv(client.TOKEN_ENV, "id-token")
        _trust_the_stack_url(monkeypatch)
        assert resolve_credentials(RUN_URL + "/v1").headers()["Authorization"] == f"Bearer {SECRET}"
        monkeypatch.delenv(client.URL_ENV)
        monkeypatch.setenv(client.TRUSTED_URLS_ENV, "https://other.example.com")
        assert resolve_credentials("https://other.example.com/v1", token="t").api_key == SECRET

    def test_an_explicit_key_goes_to_the_https_host_given(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(client.API_KEY_ENV, "from-env")
        assert resolve_credentials("https://api.example.com", api_key=SECRET).api_key == SECRET

    def test_a_withheld_key_is_named_when_the_server_asks_for_one(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(client.API_KEY_ENV, SECRET)
        creds = resolve_credentials("https://api.example.com", token="id-token")
        with fake_server(Reply(401, {"error": "Unauthorized"})) as srv, pytest.raises(AuthError) as info:
            chat(srv.url, USER, model="gemma", retry=FAST, creds=creds)
        assert "GEMMA_FT_API_KEY is set but was not sent" in str(info.value)
        assert SECRET not in str(info.value)
        assert (
            "Authorization" not in srv.requests[-1].headers or SECRET not in srv.requests[-1].headers["Authorization"]
        )

    def test_never_over_plain_http_to_another_host(self) -> None:
        with pytest.raises(ClientError, match="over plain http"):
            resolve_credentials("http://api.example.com", api_key=SECRET)

    def test_401_with_a_key_but_no_token_from_cloud_run_explains_the_token_first(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        """Without an identity token Cloud Run reads the API key in Authorization as one and answers 401: the
        missing token (and how to get one) is the news, not the key."""
        _stub_gcloud(tmp_path, monkeypatch, 'echo "You do not currently have an active account selected." >&2; exit 1')
        _trust_the_stack_url(monkeypatch)
        creds = resolve_credentials(RUN_URL, api_key=SECRET)
        assert creds.token is None and creds.api_key == SECRET
        monkeypatch.setattr(client, "is_cloud_run", lambda url: True)  # this fake answers as the Cloud Run URL
        with fake_server(Reply(401, {"error": "Unauthorized"})) as srv, pytest.raises(AuthError) as info:
            chat(srv.url, USER, model="gemma", retry=FAST, creds=creds)
        message = str(info.value)
        assert message.index("no identity token was sent") < message.find("API key"), message
        assert "have an active account" in message and "gcloud auth login" in message, "what happened, how to fix"
        assert "--impersonate-service-account" in message
        assert SECRET not in message

    def test_rejected_key_is_named(self) -> None:
        with (
            fake_server(Reply(401, {"error": "Unauthorized"})) as srv,
            pytest.raises(AuthError, match="API key was rejected"),
        ):
            chat(srv.url, USER, model="gemma", retry=FAST, creds=Credentials(api_key="wrong"))

    @pytest.mark.parametrize("api_key", [None, "wrong"])
    def test_api_key_refusal_behind_a_valid_identity_token_names_the_key(self, api_key: str | None) -> None:
        """vLLM's and the guard's 401 `{"error": "Unauthorized"}` is about the API key: Cloud Run let the token in.

        It was reported as a rejected identity token, with an --audience hint naming the request URL.
        """
        creds = Credentials(token=SECRET, source="gcloud", api_key=api_key)
        with fake_server(Reply(401, {"error": "Unauthorized"})) as srv, pytest.raises(AuthError) as info:
            chat(srv.url, USER, model="gemma", retry=FAST, creds=creds)
        message = str(info.value)
        assert "identity token (from gcloud) was accepted" in message, message
        assert ("API key was rejected" if api_key else "no API key was sent") in message, message
        assert "--api-key" in message and "audience" not in message and "rejected: it expires" not in message
        assert SECRET not in message and (api_key is None or api_key not in message)
        sent = srv.requests[0].headers
        assert sent.get("X-Serverless-Authorization" if api_key else "Authorization") == f"Bearer {SECRET}"

    def test_rejected_identity_token_suggests_the_service_origin_as_audience(self) -> None:
        """A 401 that is not the API-key body is about the token; the audience is scheme + host, not the request URL."""
        with fake_server(Reply(401, "<html>401 Unauthorized</html>")) as srv, pytest.raises(AuthError) as info:
            chat(srv.url, USER, model="gemma", retry=FAST, creds=Credentials(token=SECRET, source="gcloud"))
        message = str(info.value)
        assert "identity token (from gcloud) was rejected" in message, message
        audience = message.split("--audience ", 1)[1].split(")", 1)[0]
        assert audience == srv.url and "/v1" not in audience, message

    def test_cli_never_prints_the_key(self, capsys: pytest.CaptureFixture[str]) -> None:
        with fake_server(Reply(401, {"error": "Unauthorized"})) as srv:
            assert client.main(["--url", srv.url, "--api-key", SECRET, "--no-retry", "--model", "gemma", "hi"]) == 1
        out = capsys.readouterr()
        assert "API key was rejected" in out.err and SECRET not in out.out + out.err
