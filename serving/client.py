"""A small OpenAI-compatible chat client for the served model: Cloud Run (vLLM) or 127.0.0.1.

    python -m serving.client --url https://serve-gemma-emoji-abc123-uc.a.run.app \\
        "Translate to emoji: I ate a banana for breakfast, later I'm thinking of having soup!"
    python -m serving.client --url http://127.0.0.1:8000 --list-models

    from serving.client import chat
    chat("http://127.0.0.1:8000", [{"role": "user", "content": "Translate to emoji: I love pizza"}])

Decisions:
- Standard library only (urllib), so it runs from any Python 3.11 without installing anything.
- Authentication: the vLLM service requires authenticated invokers, so for a `*.run.app` URL
  the client sends a Google identity token, taken from `--token`, then `$GEMMA_FT_ID_TOKEN`,
  then `gcloud auth print-identity-token`. Tokens go only over https and never to
  localhost/127.0.0.1; they are never printed or logged, and redirects are refused so a token
  cannot follow one to another host.
- Retries: connection refused, 429 and 502/503/504 are what a Cloud Run service answers while
  an instance cold-starts (vLLM loading weights), so those are retried with a bounded
  exponential backoff; everything else fails at once with a message that says what to do.
- Proxies from the environment are ignored for local URLs (a corporate proxy cannot reach
  this machine's 127.0.0.1).

It does not stream and does not handle tools or images: it is for smoke tests and the demo.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("serving.client")

TOKEN_ENV = "GEMMA_FT_ID_TOKEN"
URL_ENV = "GEMMA_FT_URL"
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
RETRY_STATUSES = frozenset({429, 502, 503, 504})
DEFAULT_TIMEOUT_S = 120.0

Message = dict[str, str]


class ClientError(RuntimeError):
    """A request that failed, with a message that says why and what to do."""


class AuthError(ClientError):
    """401/403: no, expired or insufficient identity token."""


class NotFoundError(ClientError):
    """404: wrong URL or unknown model name."""


class RequestTimeoutError(ClientError):
    """The server did not answer within the timeout."""


class UnavailableError(ClientError):
    """The server kept refusing or answering 429/5xx until the retry budget ran out."""


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff for cold starts: at most `attempts` tries within `deadline_s`."""

    attempts: int = 8
    initial_delay_s: float = 1.0
    max_delay_s: float = 20.0
    deadline_s: float = 300.0

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        """Seconds to wait after failed try number `attempt` (1-based); honours a numeric Retry-After."""
        delay = min(self.max_delay_s, self.initial_delay_s * 2 ** (attempt - 1))
        if retry_after and retry_after.strip().isdigit():
            delay = min(self.max_delay_s, max(delay, float(retry_after)))
        return delay


DEFAULT_RETRY = RetryPolicy()
NO_RETRY = RetryPolicy(attempts=1)


def base_url(url: str) -> str:
    """Normalise `https://host/`, `http://127.0.0.1:8000/v1` ... to the server root without a slash."""
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in {"http", "https"} or not parsed.hostname:
        raise ClientError(
            f"--url {url!r} is not an http(s) URL; e.g. https://SERVICE-….run.app or http://127.0.0.1:8000"
        )
    path = parsed.path.rstrip("/")
    path = path.removesuffix("/v1")
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


def is_local(url: str) -> bool:
    return (urllib.parse.urlsplit(url).hostname or "") in LOCAL_HOSTS


def is_cloud_run(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme == "https" and (parts.hostname or "").endswith(".run.app")


def _gcloud_identity_token() -> str | None:
    gcloud = shutil.which("gcloud")
    if gcloud is None:
        return None
    try:
        done = subprocess.run(
            [gcloud, "auth", "print-identity-token"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    token = done.stdout.strip()
    return token if done.returncode == 0 and token else None


def resolve_token(url: str, token: str | None = None) -> str | None:
    """The identity token to send to `url`, or None.

    None for local URLs and plain http (a token must never travel unencrypted); otherwise the
    explicit token, then $GEMMA_FT_ID_TOKEN, then gcloud (only for Cloud Run URLs).
    """
    if is_local(url) or urllib.parse.urlsplit(url).scheme != "https":
        return None
    if token:
        return token
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if is_cloud_run(url):
        return _gcloud_identity_token()
    return None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuse redirects: urllib would otherwise resend the Authorization header to the new host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} refused", headers, fp)


def _opener(url: str) -> urllib.request.OpenerDirector:
    handlers: list[urllib.request.BaseHandler] = [_NoRedirect()]
    if is_local(url):
        handlers.append(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener(*handlers)


def _error_detail(exc: urllib.error.HTTPError) -> str:
    """The server's own error message (OpenAI shape `{"error": {"message": …}}`), shortened."""
    try:
        raw = exc.read(2000).decode("utf-8", "replace")
    except Exception:
        return ""
    try:
        body = json.loads(raw)
        err = body.get("error", body) if isinstance(body, dict) else body
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:300]
        return str(err)[:300]
    except ValueError:
        return raw.strip()[:300]


def _http_error(exc: urllib.error.HTTPError, url: str, sent_token: bool) -> ClientError:
    detail = _error_detail(exc)
    suffix = f" (server said: {detail})" if detail else ""
    if exc.code == 401:
        how = (
            "the identity token was rejected (they expire after an hour): run `gcloud auth login` again"
            if sent_token
            else f"no identity token was sent: pass --token, set ${TOKEN_ENV}, or install and log in to gcloud"
        )
        return AuthError(f"HTTP 401 from {url}: {how}{suffix}")
    if exc.code == 403:
        return AuthError(
            f"HTTP 403 from {url}: your account may not invoke this service. Grant it roles/run.invoker: "
            "gcloud run services add-iam-policy-binding SERVICE --region REGION "
            f"--member=user:YOU@example.com --role=roles/run.invoker{suffix}"
        )
    if exc.code == 404:
        return NotFoundError(
            f"HTTP 404 from {url}: check the URL (the server root, e.g. https://SERVICE-….run.app) "
            f"and the model name (`--list-models` shows what is served){suffix}"
        )
    if 300 <= exc.code < 400:
        return ClientError(f"HTTP {exc.code} from {url}: redirects are not followed; use the final URL{suffix}")
    return ClientError(f"HTTP {exc.code} from {url}{suffix}")


def _retryable_connection_error(exc: BaseException) -> bool:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return isinstance(reason, ConnectionRefusedError | ConnectionResetError | http.client.RemoteDisconnected)


def _request_json(
    method: str,
    url: str,
    payload: dict[str, Any] | None = None,
    *,
    token: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    retry: RetryPolicy = DEFAULT_RETRY,
) -> Any:
    """Send one JSON request with the retry policy; return the decoded JSON body."""
    headers = {"Accept": "application/json", "User-Agent": "gemma-finetune-client"}
    data = None
    if payload is not None:
        data = json.dumps(payload).encode()
        headers["Content-Type"] = "application/json"
    if token:
        headers["Authorization"] = f"Bearer {token}"
    opener = _opener(url)
    started = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with opener.open(request, timeout=timeout_s) as response:
                return json.loads(response.read().decode("utf-8"))
        except urllib.error.HTTPError as exc:
            if exc.code not in RETRY_STATUSES:
                raise _http_error(exc, url, sent_token=token is not None) from None
            why, retry_after = f"HTTP {exc.code}", exc.headers.get("Retry-After") if exc.headers else None
            detail = _error_detail(exc)
        except TimeoutError as exc:
            raise RequestTimeoutError(
                f"{url} did not answer within {timeout_s:g} s: the model may still be loading or generating; "
                "raise --timeout or lower --max-tokens"
            ) from exc
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            if isinstance(reason, TimeoutError):
                raise RequestTimeoutError(f"{url} did not answer within {timeout_s:g} s") from None
            if not _retryable_connection_error(exc):
                raise ClientError(f"cannot reach {url}: {reason}") from None
            why, retry_after, detail = f"connection failed ({type(reason).__name__})", None, ""
        except ValueError as exc:
            raise ClientError(f"{url} did not answer with JSON: {exc}") from None
        delay = retry.delay(attempt, retry_after)
        elapsed = time.monotonic() - started
        if attempt >= retry.attempts or elapsed + delay > retry.deadline_s:
            raise UnavailableError(
                f"{url} is not available after {attempt} tries in {elapsed:.0f} s ({why}"
                f"{': ' + detail if detail else ''}); a Cloud Run service may still be starting "
                "(check its logs), a local one may have stopped"
            )
        log.info("%s from %s, retrying in %.1f s (try %d of %d)", why, url, delay, attempt + 1, retry.attempts)
        time.sleep(delay)


def list_models(
    url: str, *, token: str | None = None, timeout_s: float = 30.0, retry: RetryPolicy = DEFAULT_RETRY
) -> list[str]:
    """Ids of the models the server offers (`GET /v1/models`)."""
    root = base_url(url)
    body = _request_json("GET", f"{root}/v1/models", token=resolve_token(root, token), timeout_s=timeout_s, retry=retry)
    try:
        return [str(item["id"]) for item in body["data"]]
    except (KeyError, TypeError) as exc:
        raise ClientError(f"{root}/v1/models answered an unexpected shape: {str(body)[:200]}") from exc


def chat_completion(
    url: str,
    messages: list[Message],
    *,
    model: str | None = None,
    max_tokens: int = 64,
    temperature: float = 0.0,
    token: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    retry: RetryPolicy = DEFAULT_RETRY,
) -> dict[str, Any]:
    """The full OpenAI-shaped response of `POST /v1/chat/completions`; the model defaults to the first served."""
    root = base_url(url)
    bearer = resolve_token(root, token)
    if model is None:
        models = list_models(root, token=bearer, retry=retry)
        if not models:
            raise ClientError(f"{root}/v1/models lists no models; pass --model")
        model = models[0]
    payload = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
    body = _request_json("POST", f"{root}/v1/chat/completions", payload, token=bearer, timeout_s=timeout_s, retry=retry)
    if not isinstance(body, dict) or not body.get("choices"):
        raise ClientError(f"{root}/v1/chat/completions answered an unexpected shape: {str(body)[:200]}")
    return body


def chat(
    url: str,
    messages: list[Message],
    *,
    model: str | None = None,
    max_tokens: int = 64,
    temperature: float = 0.0,
    token: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    retry: RetryPolicy = DEFAULT_RETRY,
) -> str:
    """The assistant's answer to `messages` (greedy by default, so smoke tests are repeatable)."""
    body = chat_completion(
        url,
        messages,
        model=model,
        max_tokens=max_tokens,
        temperature=temperature,
        token=token,
        timeout_s=timeout_s,
        retry=retry,
    )
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as exc:
        raise ClientError(f"chat response has no choices[0].message.content: {str(body)[:200]}") from exc
    return str(content or "")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m serving.client", description="Ask the served Gemma model (OpenAI-compatible API)."
    )
    p.add_argument("prompt", nargs="?", help='e.g. "Translate to emoji: I ate a banana for breakfast"')
    p.add_argument("--url", default=os.environ.get(URL_ENV), help=f"server root (default ${URL_ENV})")
    p.add_argument("--model", help="served model name (default: the first one the server lists)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--system", help="optional system message")
    p.add_argument("--token", help=f"Google identity token (default ${TOKEN_ENV}, then gcloud); never printed")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per request")
    p.add_argument("--no-retry", action="store_true", help="fail on the first 429/503/refused connection")
    p.add_argument("--list-models", action="store_true", help="print the served model ids and exit")
    args = p.parse_args(argv)
    if not args.url:
        p.error(f"--url is required (or set ${URL_ENV})")
    if not args.list_models and not args.prompt:
        p.error("give a prompt, or --list-models")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    retry = NO_RETRY if args.no_retry else DEFAULT_RETRY
    try:
        if args.list_models:
            print("\n".join(list_models(args.url, token=args.token, timeout_s=args.timeout, retry=retry)))
            return 0
        messages: list[Message] = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        messages.append({"role": "user", "content": args.prompt})
        answer = chat(
            args.url,
            messages,
            model=args.model,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            token=args.token,
            timeout_s=args.timeout,
            retry=retry,
        )
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
