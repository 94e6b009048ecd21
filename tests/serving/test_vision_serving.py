"""Images in, text out: the vision stack's served model answers OpenAI chat requests with `image_url` parts.

The model is what the `ray-gemma3-vision` stack serves, on a tiny Gemma 3 vision checkpoint: the recipe's LoRA
(all linear layers, the vision tower, `modules_to_save` lm_head and embed_tokens) merged by the trainer's own
`merge_and_export` with the run's processor. It is served through the local serving path (demo/local_server.py:
transformers serve behind its thin layer) and asked with the official `openai` client and serving/client.py, the
image as an http URL (a server on 127.0.0.1) and as base64.
"""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from demo.local_server import LocalServer
from tests.tiny_models import IMAGE_SEQ_LENGTH, IMAGE_SIZE, save_tiny_vision_model

openai = pytest.importorskip("openai", reason="the openai client is a test dependency (requirements-dev.txt)")

pytestmark = pytest.mark.slow
NAME = "product-descriptions-gemma3-4b"
ASK = "Create a Short Product description"


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The vision recipe's adapter on the tiny checkpoint, merged and exported as a run does it."""
    from peft import get_peft_model
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from trainer.export import merge_and_export
    from trainer.modeling import lora_config
    from trainer.recipe import load_recipe

    root = tmp_path_factory.mktemp("vision")
    base = save_tiny_vision_model(root / "base")
    recipe = load_recipe("product-descriptions-gemma3-4b")
    assert recipe.writes_merged, "the recipe's adapter trains the vision tower: why it is served merged"
    model = get_peft_model(AutoModelForImageTextToText.from_pretrained(base), lora_config(recipe.lora))
    model.save_pretrained(root / "adapter")
    processor = AutoProcessor.from_pretrained(base)
    return merge_and_export(str(base), root / "adapter", root / "merged", dtype="float32", tokenizer=processor)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A PNG file and the http URL a server on 127.0.0.1 serves it at."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("images")
    path = folder / "shoe.png"
    Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (200, 30, 30)).save(path)
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(folder), **k)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield path, f"http://127.0.0.1:{httpd.server_address[1]}/shoe.png"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def server(merged: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with LocalServer(merged, served_model_name=NAME, log_path=log) as running:
        yield running


def ask(server: LocalServer, content: object, max_tokens: int = 6) -> object:
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    return api.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0
    )


def test_an_image_by_url_and_by_base64_reaches_the_model(server: LocalServer, image: tuple[Path, str]) -> None:
    path, url = image
    data = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    text_only = ask(server, ASK)
    by_url = ask(server, [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": ASK}])
    by_data = ask(server, [{"type": "image_url", "image_url": {"url": data}}, {"type": "text", "text": ASK}])
    for answer in (by_url, by_data):
        assert answer.model == NAME and isinstance(answer.choices[0].message.content, str)  # type: ignore[attr-defined]
        # the image became its soft tokens in the prompt: the processor saw it
        assert answer.usage.prompt_tokens >= text_only.usage.prompt_tokens + IMAGE_SEQ_LENGTH  # type: ignore[attr-defined]
    assert by_url.choices[0].message.content == by_data.choices[0].message.content  # type: ignore[attr-defined]
    assert by_url.usage.prompt_tokens == by_data.usage.prompt_tokens  # type: ignore[attr-defined]


def test_serving_client_sends_an_image(
    server: LocalServer, image: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from serving import client

    path, _ = image
    message = client.user_message(ASK, [str(path)])
    assert message["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert client.main(["--url", server.url, "--model", NAME, "--max-tokens", "4", "--image", str(path), ASK]) == 0
    expected = ask(server, message["content"], max_tokens=4).choices[0].message.content  # type: ignore[attr-defined]
    assert capsys.readouterr().out == f"{expected}\n"
    with pytest.raises(client.ClientError, match="not an image file"):
        client.image_url(str(path.with_suffix(".txt")))
