"""Pushing the result to a private Hub repo (W1's seed did), against a local stand-in for the Hub.

Why it matters: W1 does not merge, so what it pushes is the adapter folder; a push that only
accepted merged exports failed after hours of training. The token must come from the environment
and the repository must be created private.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.hub_standin import hub_standin
from trainer.export import push_to_hub

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

TOKEN = "hf_standin_write_token"


@pytest.fixture(scope="module")
def adapter_dir(tiny_gemma3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("push") / "adapter"
    get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir), LoraConfig(target_modules=["q_proj"])
    ).save_pretrained(out)
    return out


def test_adapter_is_pushed_to_a_private_repo_with_the_environments_token(
    adapter_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with hub_standin() as hub:
        url = push_to_hub(adapter_dir, "acme/gemma-4-31b-text-to-sql", private=True, endpoint=hub.url)
    assert url == f"{hub.url}/acme/gemma-4-31b-text-to-sql"
    assert not hub.unexpected, hub.unexpected
    (created,) = hub.created
    assert (created["organization"], created["name"]) == ("acme", "gemma-4-31b-text-to-sql")
    assert created.get("private") is True or created.get("visibility") == "private", created
    assert hub.authorizations == {f"Bearer {TOKEN}"}
    pushed = hub.files["acme/gemma-4-31b-text-to-sql"]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert pushed[name] == (adapter_dir / name).read_bytes(), name


def test_without_a_token_nothing_is_sent(adapter_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with hub_standin() as hub, pytest.raises(RuntimeError, match="HF_TOKEN is not set"):
        push_to_hub(adapter_dir, "acme/x", endpoint=hub.url)
    assert not hub.created and not hub.authorizations


def test_a_folder_that_is_neither_export_nor_adapter_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    (tmp_path / "config.json").write_text("{}")  # a half-written merge: no completion marker
    with hub_standin() as hub, pytest.raises(RuntimeError, match="refusing to push"):
        push_to_hub(tmp_path, "acme/x", endpoint=hub.url)
    assert not hub.created


@pytest.mark.slow
def test_a_run_that_does_not_merge_pushes_its_adapter(
    tiny_gemma3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's own path (trainer.train.main -> push_to_hub), as W1 runs it: merge off, push on."""
    import huggingface_hub.constants

    from trainer.recipe import load_recipe
    from trainer.train import main

    recipe = load_recipe(
        "emoji-local",
        [
            f"model.name_or_path={tiny_gemma3_dir}",
            f"output.dir={tmp_path / 'run'}",
            "training.max_steps=2",
            "training.save_steps=2",
            "training.report_to=[]",
            "data.max_rows=24",
            "data.eval_rows=4",
            "output.merge=false",
            "output.push_to_hub=true",
            "output.hub_model_id=acme/emoji",
        ],
    )
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with hub_standin() as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        result = main(recipe)
    assert result.summary["hub_url"] == f"{hub.url}/acme/emoji"
    pushed = hub.files["acme/emoji"]
    adapter = tmp_path / "run/adapter"
    assert pushed["adapter_model.safetensors"] == (adapter / "adapter_model.safetensors").read_bytes()
    assert "tokenizer_config.json" in pushed and not hub.unexpected
    assert hub.created[0].get("private") is True or hub.created[0].get("visibility") == "private"
