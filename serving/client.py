"""A small OpenAI-compatible chat client for the served model: Cloud Run (vLLM) or 127.0.0.1.

    export GEMMA_FT_URL="$(pulumi stack output servingUrl)"     # the stack's service: tokens may go there
    python -m serving.client "Translate to emoji: I ate a banana for breakfast, later I'm thinking of having soup!"
    python -m serving.client --url http://127.0.0.1:8000 --list-models
    python -m serving.client --impersonate-service-account ci@PROJECT.iam.gserviceaccount.com "…"   # CI
    from serving.client import chat; chat("http://127.0.0.1:8000", [{"role": "user", "content": "I love pizza"}])

Decisions (docs/cloud-run.md#the-chat-clients-credentials): standard library only; an identity token or API key the
client found by itself (`$GEMMA_FT_ID_TOKEN`, gcloud, `$GEMMA_FT_API_KEY`) goes only to a URL in
`$GEMMA_FT_URL`/`$GEMMA_FT_TRUSTED_URLS` (API keys also to this machine), never over http, never printed, and no
redirect is followed; with an API key the token travels in `X-Serverless-Authorization`. Every failure says
why and the fix. 429/5xx and refused connections are retried with backoff, for Cloud Run until the startup
window (serving/startup.py) plus one `--timeout` has passed. `--image`: a file as base64, or a URL, in an
`image_url` part. No streaming, no tools (the `openai` client works against the same servers): smoke tests, demo.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import http.client
import json
import logging
import mimetypes
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

from serving.startup import STARTUP_WINDOW

log = logging.getLogger("serving.client")

TOKEN_ENV = "GEMMA_FT_ID_TOKEN"
API_KEY_ENV = "GEMMA_FT_API_KEY"
URL_ENV = "GEMMA_FT_URL"
# More Cloud Run URLs (comma- or space-separated) that may receive a token the client found by itself.
TRUSTED_URLS_ENV = "GEMMA_FT_TRUSTED_URLS"
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
RETRY_STATUSES = frozenset({429, 502, 503, 504})
DEFAULT_TIMEOUT_S = 120.0
GCLOUD_TIMEOUT_S = 60.0
# Cloud Run reads the identity token here when the application uses Authorization itself.
SERVERLESS_AUTH_HEADER = "X-Serverless-Authorization"

Message = dict[str, Any]

LOGIN_HELP = (
    "log in with `gcloud auth login` (a person; `gcloud auth application-default login` is not enough for "
    "identity tokens), or act as a service account with --impersonate-service-account SA_EMAIL (CI; needs "
    f"roles/iam.serviceAccountOpenIdTokenCreator on it), or pass --token / set ${TOKEN_ENV}"
)


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
    """Bounded exponential backoff: tries until `deadline_s` has passed (and at most `attempts`, unless None).

    Timeouts are retried only if asked (`retry_timeouts`).
    """

    attempts: int | None = 8
    initial_delay_s: float = 1.0
    max_delay_s: float = 20.0
    deadline_s: float = 300.0
    retry_timeouts: bool = False

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


def url_origin(url: str) -> str:
    """`https://Host.run.app/v1/x` -> `https://host.run.app`: what the token allowlist compares; "" if not https."""
    parts = urllib.parse.urlsplit(url.strip())
    try:
        port = parts.port
    except ValueError:
        return ""
    if parts.scheme != "https" or not parts.hostname:
        return ""
    return f"https://{parts.hostname.lower()}" + (f":{port}" if port not in (None, 443) else "")


def trusted_token_urls() -> frozenset[str]:
    """Origins that may receive an automatic identity token: `$GEMMA_FT_URL` (the stack's servingUrl) and
    `$GEMMA_FT_TRUSTED_URLS`."""
    listed = [os.environ.get(URL_ENV, ""), *os.environ.get(TRUSTED_URLS_ENV, "").replace(",", " ").split()]
    return frozenset(origin for origin in map(url_origin, listed) if origin)


def cold_start_deadline_s(timeout_s: float) -> float:
    """How long a request to a scaled-to-zero Cloud Run service may keep retrying: the startup window, then one answer."""
    return STARTUP_WINDOW.total_s + timeout_s


def cold_start_policy(url: str, retry: RetryPolicy, timeout_s: float) -> RetryPolicy:
    """For Cloud Run: retry timeouts too, and bound the retries by the cold-start deadline, not by a count.

    An instance starting from zero answers 429/503 (or nothing) for as long as the image pull and the
    model load take, up to the startup window; a count of tries would give up before it is ready (8 tries
    of quick 429s are over after about 70 s of backoff). Elsewhere, and with `--no-retry`, the policy is unchanged.
    """
    if not is_cloud_run(url) or retry.attempts == 1:
        return retry
    deadline = max(retry.deadline_s, cold_start_deadline_s(timeout_s))
    return dataclasses.replace(retry, attempts=None, retry_timeouts=True, deadline_s=deadline)


@dataclass(frozen=True)
class Credentials:
    """What the client sends: an identity token (and where it came from), or why there is none; an API key."""

    token: str | None = None
    source: str = ""
    missing_because: str = ""
    api_key: str | None = None
    key_withheld_because: str = ""

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
            if self.token:
                headers[SERVERLESS_AUTH_HEADER] = f"Bearer {self.token}"
        elif self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers


def _gcloud_identity_token(audience: str | None = None, impersonate: str | None = None) -> tuple[str | None, str]:
    """(token, "") or (None, why): `gcloud auth print-identity-token`, stdin closed, stderr kept."""
    gcloud = shutil.which("gcloud")
    if gcloud is None:
        return None, f"gcloud is not installed (https://cloud.google.com/sdk/docs/install); {LOGIN_HELP}"
    command = [gcloud, "auth", "print-identity-token", "--quiet"]
    if impersonate:
        command += [f"--impersonate-service-account={impersonate}", "--include-email"]
    if audience:
        command.append(f"--audiences={audience}")
    try:
        done = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=GCLOUD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"`gcloud auth print-identity-token` did not finish within {GCLOUD_TIMEOUT_S:g} s; {LOGIN_HELP}"
    except OSError as exc:
        return None, f"gcloud could not be run ({exc}); {LOGIN_HELP}"
    token = done.stdout.strip()
    if done.returncode == 0 and token:
        return token, ""
    said = " ".join(line.strip() for line in done.stderr.strip().splitlines()[-3:] if line.strip())
    return None, f"`gcloud auth print-identity-token` failed ({said or f'exit code {done.returncode}'}); {LOGIN_HELP}"


def resolve_credentials(
    url: str,
    token: str | None = None,
    *,
    audience: str | None = None,
    impersonate: str | None = None,
    api_key: str | None = None,
    trusted_urls: frozenset[str] | None = None,
) -> Credentials:
    """The credentials to send to `url`.

    Nothing goes to local URLs except an API key, and nothing travels over plain http to another
    host. An explicit `token` or `api_key` goes to any https host; `$GEMMA_FT_ID_TOKEN` and gcloud only to a
    Cloud Run URL whose origin is in `trusted_urls` (default `trusted_token_urls()`), and `$GEMMA_FT_API_KEY`
    only to such an origin or to this machine (`key_withheld_because` then says why it was not sent).
    """
    scheme = urllib.parse.urlsplit(url).scheme
    trusted = trusted_token_urls() if trusted_urls is None else frozenset(map(url_origin, trusted_urls))
    key, key_note = api_key, ""
    if key is None and os.environ.get(API_KEY_ENV):
        # a key found in the environment follows the tokens' rule: only to this machine or an allow-listed origin
        if is_local(url) or url_origin(url) in trusted:
            key = os.environ[API_KEY_ENV]
        else:
            key_note = (
                f"${API_KEY_ENV} is set but was not sent: {url_origin(url) or url} is not the stack's servingUrl "
                f'(${URL_ENV}) nor in ${TRUSTED_URLS_ENV}. Fix: export {URL_ENV}="$(pulumi stack output servingUrl)" '
                f"if this is your stack's service, or add the URL to ${TRUSTED_URLS_ENV}, or pass --api-key"
            )
    if key and scheme != "https" and not is_local(url):
        raise ClientError(f"refusing to send the API key to {url} over plain http: use https")
    creds = _credentials(url, token, key, trusted, audience, impersonate)
    return dataclasses.replace(creds, key_withheld_because=key_note) if key_note else creds


def _credentials(
    url: str,
    token: str | None,
    key: str | None,
    trusted: frozenset[str],
    audience: str | None,
    impersonate: str | None,
) -> Credentials:
    scheme = urllib.parse.urlsplit(url).scheme
    if is_local(url) or scheme != "https":
        return Credentials(api_key=key)
    if token:
        return Credentials(token, "--token", api_key=key)
    if not is_cloud_run(url):
        return Credentials(
            missing_because=f"{url} is not a Cloud Run URL (*.run.app), so ${TOKEN_ENV} and gcloud tokens are not "
            "sent there; pass --token explicitly if this host should get one",
            api_key=key,
        )
    if url_origin(url) not in trusted:
        return Credentials(
            missing_because=f"{url_origin(url)} is not the stack's servingUrl (${URL_ENV}) nor in ${TRUSTED_URLS_ENV}, "
            f"so ${TOKEN_ENV} and gcloud tokens are not sent there (anyone can deploy a *.run.app service, and your "
            f'token works on every service you may invoke). Fix: export {URL_ENV}="$(pulumi stack output servingUrl)" '
            f"if this is your stack's service, or add the URL to ${TRUSTED_URLS_ENV}, or pass --token",
            api_key=key,
        )
    if os.environ.get(TOKEN_ENV):
        return Credentials(os.environ[TOKEN_ENV], f"${TOKEN_ENV}", api_key=key)
    found, why = _gcloud_identity_token(audience, impersonate)
    if found:
        return Credentials(found, "gcloud", api_key=key)
    return Credentials(missing_because=why, api_key=key)


def resolve_token(url: str, token: str | None = None, **kwargs: Any) -> str | None:
    """The identity token to send to `url`, or None (see `resolve_credentials`)."""
    return resolve_credentials(url, token, **kwargs).token


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuse redirects: urllib would otherwise resend the Authorization header to the new host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} refused", headers, fp)


def _opener(url: str) -> urllib.request.OpenerDirector:
    handlers: list[urllib.request.BaseHandler] = [_NoRedirect()]
    if is_local(url):
        handlers.append(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener(*handlers)


def _error_body(exc: urllib.error.HTTPError) -> str:
    """The first 2 kB of an error response's body ("" if it cannot be read); an HTTPError can be read once."""
    try:
        return exc.read(2000).decode("utf-8", "replace")
    except Exception:
        return ""


def _detail(raw: str) -> str:
    """The server's own error message (OpenAI shape `{"error": {"message": …}}`), shortened."""
    try:
        body = json.loads(raw)
        err = body.get("error", body) if isinstance(body, dict) else body
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:300]
        return str(err)[:300]
    except ValueError:
        return raw.strip()[:300]


def _error_detail(exc: urllib.error.HTTPError) -> str:
    return _detail(_error_body(exc))


def _api_key_refusal(raw: str) -> bool:
    """Whether a 401 body is the API-key refusal of vLLM or serving/api_key_guard.py: `{"error": "Unauthorized"}`.

    vLLM's AuthenticationMiddleware (vllm/entrypoints/openai/api_server.py) and the guard answer exactly this
    JSON; a request that reached them has passed Cloud Run's identity check, so the key is what is missing or
    wrong. Cloud Run's own refusal of an identity token is not this JSON (Google's front end answers with
    its own error page; its exact body is UNCONFIRMED, which is why only this exact body counts).
    """
    try:
        return json.loads(raw) == {"error": "Unauthorized"}
    except ValueError:
        return False


def _http_error(exc: urllib.error.HTTPError, url: str, creds: Credentials) -> ClientError:
    raw = _error_body(exc)
    detail = _detail(raw)
    suffix = f" (server said: {detail})" if detail else ""
    if exc.code in (401, 403) and creds.token is None and is_cloud_run(url):
        # A private Cloud Run service refuses a request without an identity token before vLLM sees it; an API key
        # alone sits in Authorization, where Cloud Run reads it as an (invalid) identity token.
        key = (
            f". Only if the service is public (servingPublic=true, no token needed) was the API key itself rejected: "
            f"then check --api-key / ${API_KEY_ENV} against the stack's servingApiKey"
            if creds.api_key and exc.code == 401
            else ""
        )
        return AuthError(
            f"HTTP {exc.code} from {url}: no identity token was sent, and a private Cloud Run service refuses "
            f"requests without one: {creds.missing_because or LOGIN_HELP}{key}{suffix}"
        )
    if exc.code == 401 and (_api_key_refusal(raw) or (creds.api_key and not creds.token)):
        passed = f"the identity token (from {creds.source or 'the caller'}) was accepted, but " if creds.token else ""
        what = (
            f"the API key was rejected: check --api-key / ${API_KEY_ENV} against the stack's servingApiKey"
            if creds.api_key
            else creds.key_withheld_because
            or f"no API key was sent and the server asks for one: pass the stack's servingApiKey as --api-key "
            f"or ${API_KEY_ENV}"
        )
        return AuthError(f"HTTP 401 from {url}: {passed}{what}{suffix}")
    if exc.code in (401, 403) and creds.token is None:
        why = creds.missing_because or (
            "tokens are never sent to local or plain-http URLs"
            if is_local(url) or url.startswith("http:")
            else LOGIN_HELP
        )
        return AuthError(f"HTTP {exc.code} from {url}: no identity token was sent: {why}{suffix}")
    if exc.code == 401:
        # the audience Cloud Run expects is the service URL: scheme and host, not the path of this request
        parts = urllib.parse.urlsplit(url)
        audience = f"{parts.scheme}://{parts.netloc}"
        how = (
            f"the identity token (from {creds.source or 'the caller'}) was rejected: it expires after an hour "
            f"(get a new one), or its audience is not this service (--audience {audience}); {LOGIN_HELP}"
        )
        return AuthError(f"HTTP 401 from {url}: {how}{suffix}")
    if exc.code == 403:
        return AuthError(
            f"HTTP 403 from {url}: the account behind the token (from {creds.source or 'the caller'}) may not invoke "
            "this service. Add it to the stack's servingInvokers and `pulumi up`, or grant roles/run.invoker: "
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
    creds: Credentials | None = None,
    token: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    retry: RetryPolicy = DEFAULT_RETRY,
) -> Any:
    """Send one JSON request with the retry policy; return the decoded JSON body."""
    creds = creds or Credentials(token, "--token" if token else "")
    headers = {"Accept": "application/json", "User-Agent": "gemma-finetune-client", **creds.headers()}
    data = None
    if payload is not None:
        data = json.dumps(payload).encode()
        headers["Content-Type"] = "application/json"
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
                raise _http_error(exc, url, creds) from None
            why, retry_after = f"HTTP {exc.code}", exc.headers.get("Retry-After") if exc.headers else None
            detail = _error_detail(exc)
        except (TimeoutError, urllib.error.URLError, ConnectionError, http.client.HTTPException) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            if isinstance(reason, TimeoutError):
                if not retry.retry_timeouts:
                    raise RequestTimeoutError(
                        f"{url} did not answer within {timeout_s:g} s: the model may still be loading or generating; "
                        "raise --timeout or lower --max-tokens"
                    ) from None
                why, retry_after, detail = f"no answer within {timeout_s:g} s (cold start?)", None, ""
            elif not _retryable_connection_error(exc):
                raise ClientError(f"cannot reach {url}: {reason}") from None
            else:
                why, retry_after, detail = f"connection failed ({type(reason).__name__})", None, ""
        except ValueError as exc:
            raise ClientError(f"{url} did not answer with JSON: {exc}") from None
        delay = retry.delay(attempt, retry_after)
        elapsed = time.monotonic() - started
        out_of_tries = retry.attempts is not None and attempt >= retry.attempts
        if out_of_tries or elapsed + delay > retry.deadline_s:
            raise UnavailableError(
                f"{url} is not available after {attempt} tries in {elapsed:.0f} s ({why}"
                f"{': ' + detail if detail else ''}); a Cloud Run service may still be starting "
                f"(its startup window is {STARTUP_WINDOW.total_s} s; check its logs), a local one may have stopped"
            )
        log.info(
            "%s from %s, retrying in %.1f s (try %d; giving up %.0f s from the first)",
            why,
            url,
            delay,
            attempt + 1,
            retry.deadline_s,
        )
        time.sleep(delay)


def list_models(
    url: str,
    *,
    token: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    retry: RetryPolicy = DEFAULT_RETRY,
    creds: Credentials | None = None,
) -> list[str]:
    """Ids of the models the server offers (`GET /v1/models`)."""
    root = base_url(url)
    creds = creds or resolve_credentials(root, token)
    body = _request_json(
        "GET", f"{root}/v1/models", creds=creds, timeout_s=timeout_s, retry=cold_start_policy(root, retry, timeout_s)
    )
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
    creds: Credentials | None = None,
) -> dict[str, Any]:
    """The full OpenAI-shaped response of `POST /v1/chat/completions`; the model defaults to the first served."""
    root = base_url(url)
    creds = creds or resolve_credentials(root, token)
    if model is None:
        models = list_models(root, timeout_s=timeout_s, retry=retry, creds=creds)
        if not models:
            raise ClientError(f"{root}/v1/models lists no models; pass --model")
        model = models[0]
    payload = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
    body = _request_json(
        "POST",
        f"{root}/v1/chat/completions",
        payload,
        creds=creds,
        timeout_s=timeout_s,
        retry=cold_start_policy(root, retry, timeout_s),
    )
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
    creds: Credentials | None = None,
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
        creds=creds,
    )
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as exc:
        raise ClientError(f"chat response has no choices[0].message.content: {str(body)[:200]}") from exc
    return str(content or "")


def image_url(image: str) -> str:
    """What an `image_url` part carries: an http(s) URL as given, a file as a base64 data URL (vLLM and transformers
    serve accept both: the OpenAI chat format's two forms)."""
    if image.startswith(("http://", "https://", "data:")):
        return image
    path = os.path.expanduser(image)
    mime = mimetypes.guess_type(path)[0] or ""
    if not mime.startswith("image/"):
        raise ClientError(f"--image {image!r}: not an image file by its name (.jpg, .png, .webp, ...)")
    try:
        with open(path, "rb") as f:
            data = base64.b64encode(f.read()).decode("ascii")
    except OSError as exc:
        raise ClientError(f"--image {image!r} cannot be read: {exc.strerror or exc}") from None
    return f"data:{mime};base64,{data}"


def user_message(text: str, images: list[str] | None = None) -> Message:
    """A user turn: plain text, or OpenAI content parts with the images first, then the text."""
    if not images:
        return {"role": "user", "content": text}
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": image_url(i)}} for i in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m serving.client", description="Ask the served Gemma model (OpenAI-compatible API)."
    )
    p.add_argument("prompt", nargs="?", help='e.g. "Translate to emoji: I ate a banana for breakfast"')
    p.add_argument(
        "--url",
        default=os.environ.get(URL_ENV),
        help=f"server root (default ${URL_ENV}, the stack's servingUrl; identity tokens the client finds itself go "
        f"only to that URL or those in ${TRUSTED_URLS_ENV})",
    )
    p.add_argument("--model", help="served model name (default: the first one the server lists)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--system", help="optional system message")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        help="an image for a vision model: a file (sent as base64) or an http(s) URL; repeat for several",
    )
    p.add_argument(
        "--token", help=f"Google identity token, sent to the given https host (default ${TOKEN_ENV}, then gcloud)"
    )
    p.add_argument("--audience", help="audience of the gcloud token (service accounts; default: gcloud's)")
    p.add_argument(
        "--impersonate-service-account",
        metavar="SA_EMAIL",
        help="mint the token as this service account (gcloud; CI); the audience defaults to the URL",
    )
    p.add_argument("--api-key", help=f"the service's API key (servingApiKey; default ${API_KEY_ENV}); never printed")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per request")
    p.add_argument("--no-retry", action="store_true", help="fail on the first 429/503/refused connection/timeout")
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
        root = base_url(args.url)
        audience = args.audience or (root if args.impersonate_service_account else None)
        creds = resolve_credentials(
            root, args.token, audience=audience, impersonate=args.impersonate_service_account, api_key=args.api_key
        )
        if creds.token is None and creds.missing_because and is_cloud_run(root):
            log.warning("no identity token: %s", creds.missing_because)
        if args.list_models:
            print("\n".join(list_models(root, timeout_s=args.timeout, retry=retry, creds=creds)))
            return 0
        messages: list[Message] = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        messages.append(user_message(args.prompt, args.image))
        answer = chat(
            root,
            messages,
            model=args.model,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            timeout_s=args.timeout,
            retry=retry,
            creds=creds,
        )
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
