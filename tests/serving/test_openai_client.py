"""The official `openai` client against `python -m demo.local_server`: what runs here runs against vLLM.

vLLM's OpenAI-compatible server answers `models.list`, `chat.completions.create` and
`completions.create`, streamed or not; code written against the local server must run unchanged
against the Cloud Run service, so these calls are made with the client users will use
(pinned in requirements-dev.txt), not only with serving/client.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from demo.local_server import LocalServer

openai = pytest.importorskip("openai", reason="the openai client is a test dependency (requirements-dev.txt)")

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Translate to emoji: I ate a banana"}]


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    from tests.tiny_models import build_tiny_gemma

    model = build_tiny_gemma(tmp_path_factory.mktemp("openai") / "merged")
    with LocalServer(model) as server:
        # the key is required by the client; the local server ignores it (vLLM checks it only with --api-key)
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_list(api: openai.OpenAI) -> None:
    assert [m.id for m in api.models.list()] == ["gemma"]


def test_chat_streamed_equals_not_streamed(api: openai.OpenAI) -> None:
    whole = api.chat.completions.create(model="gemma", messages=PROMPT, max_tokens=8, temperature=0)
    chunks = list(
        api.chat.completions.create(
            model="gemma",
            messages=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content, "greedy decoding streams the same answer"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_completions_streamed_equals_not_streamed(api: openai.OpenAI) -> None:
    whole = api.completions.create(model="gemma", prompt="I ate a banana", max_tokens=6, temperature=0)
    assert whole.object == "text_completion" and whole.usage.completion_tokens <= 6
    streamed = api.completions.create(model="gemma", prompt="I ate a banana", max_tokens=6, temperature=0, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_errors_reach_the_client_as_openai_errors(api: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        api.chat.completions.create(model="other", messages=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        api.completions.create(model="gemma", prompt="x", max_tokens=100_000)


def test_the_local_server_stays_up_after_a_stream_is_abandoned(api: openai.OpenAI) -> None:
    stream = api.chat.completions.create(model="gemma", messages=PROMPT, max_tokens=32, stream=True)
    next(iter(stream))
    stream.close()
    assert [m.id for m in api.models.list()] == ["gemma"]
