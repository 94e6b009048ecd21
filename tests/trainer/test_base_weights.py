"""The base weights are staged once per run in the bucket: a restarted run reads them there, not from the Hub.

Why it matters: each retried pod (a Spot or flex-start preemption) pulled W1's 62 GB base from the Hub again.
Here a tiny Gemma 3 is served as a Hub repository by tests/trainer/hub_standin.py (the Hub's read API, the
calls `snapshot_download` makes) and `output.dir` is a `file://` bucket. The first run (node 1) downloads
from the Hub and stages the folder under `<output.dir>/_base/`, marker last; the restart (node 2, an empty
staging folder) must fetch nothing from the Hub (peft's config.json check at each adapter save aside), and the
adapter config must still name the Hub id.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainer.hub_standin import COMMIT, hub_standin
from trainer.base_weights import BASE_MARKER, BASE_SUBDIR, is_hub_id
from trainer.checkpoints import OutputLocation

HUB_ID = "acme/tiny-gemma3"


def _adapter_base(recipe, location: OutputLocation, out: Path) -> tuple[str, str]:
    """(the folder the model was loaded from, the adapter config's base_model_name_or_path)."""
    from peft import get_peft_model

    from trainer.modeling import load_model_and_tokenizer, lora_config

    model, _ = load_model_and_tokenizer(recipe, location)
    loaded_from = model.config.to_dict().get("_name_or_path")
    get_peft_model(model, lora_config(recipe.lora, model)).save_pretrained(out)
    return loaded_from, json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]


def test_a_restart_reads_the_base_from_the_bucket_and_the_adapter_names_the_hub_id(
    tiny_gemma3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants as hub_constants
    from huggingface_hub import hf_api

    from trainer.recipe import load_recipe

    bucket = tmp_path / "bucket" / "run"
    url = f"file://{bucket}"
    recipe = load_recipe(
        "emoji-gemma3-1b",
        [f"model.name_or_path={HUB_ID}", "model.dtype=float32", "quantization=null", f"output.dir={url}"],
    )
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    # no cache to fall back on, and none of the machine's written (huggingface_hub reads these at import)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(hub_constants, "HF_XET_CACHE", str(tmp_path / "xet-cache"))
    with hub_standin(models={HUB_ID: tiny_gemma3_dir}) as hub:
        # what HF_ENDPOINT sets when huggingface_hub is imported (huggingface_hub/constants.py)
        monkeypatch.setattr(hub_constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(
            hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(hf_api.api, "endpoint", hub.url)  # the module's HfApi(), built at import

        first = OutputLocation.from_dir(url, staging_root=tmp_path / "node-1")
        loaded, base = _adapter_base(recipe, first, tmp_path / "adapter-1")
        assert not hub.unexpected, hub.unexpected
        assert any(r.startswith(f"GET /{HUB_ID}/resolve/{COMMIT}/") for r in hub.requests), "\n".join(hub.requests)
        staged = bucket / BASE_SUBDIR / f"{HUB_ID.replace('/', '--')}@main"
        assert (staged / BASE_MARKER).is_file() and (staged / "model.safetensors").is_file()
        for path in tiny_gemma3_dir.iterdir():  # the Hub's files, staged whole
            assert (staged / path.name).read_bytes() == path.read_bytes(), path.name
        assert base == loaded == HUB_ID

        hub.requests.clear()
        restart = OutputLocation.from_dir(url, staging_root=tmp_path / "node-2")
        loaded, base = _adapter_base(recipe, restart, tmp_path / "adapter-2")
        # No file of the model and no listing from the Hub. What remains is peft's own vocabulary check at each
        # adapter save (peft utils/save_and_load.py `get_peft_model_state_dict`, save_embedding_layers="auto":
        # does the base's config.json exist on the Hub), made with or without staging, a few hundred bytes.
        peft_check = {f"HEAD /{HUB_ID}/resolve/main/config.json", f"GET /api/models/{HUB_ID}/revision/main"}
        assert set(hub.requests) <= peft_check, f"the restart must read the staged base, not the Hub: {hub.requests}"
        assert (restart.local / BASE_SUBDIR / staged.name / "model.safetensors").is_file()
        assert base == loaded == HUB_ID

        # the merge at the run's end reloads the staged folder, not the Hub, while the run's nodes wait
        from trainer.base_weights import merge_base
        from trainer.export import merge_and_export

        hub.requests.clear()
        source = merge_base(HUB_ID, None, restart)
        assert source == str(restart.local / BASE_SUBDIR / staged.name)
        merge_and_export(source, tmp_path / "adapter-2", tmp_path / "merged", dtype="float32")
        assert set(hub.requests) <= peft_check, f"the merge must read the staged base, not the Hub: {hub.requests}"


def test_only_hub_ids_are_staged(tmp_path: Path) -> None:
    assert is_hub_id("google/gemma-4-31b-it") and is_hub_id("gpt2")
    assert not is_hub_id("local:gemma3-270m") and not is_hub_id(str(tmp_path)) and not is_hub_id("gs://b/model")
    from trainer.base_weights import stage_base_model

    local_output = OutputLocation.from_dir(str(tmp_path / "out"))
    assert stage_base_model("google/gemma-4-31b-it", None, local_output) == "google/gemma-4-31b-it"


def test_shards_move_several_at_once_and_the_marker_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why: W1's base is ~62 GB in shards of a few GB; one stream at a time made staging it (and every restart's
    read) the longest wait before training. Each copy of this file:// bucket takes 0.4 s (a slow network)."""
    import threading
    import time

    from fsspec.implementations.local import LocalFileSystem

    from trainer.checkpoints import TRANSFER_WORKERS, download_dir, upload_dir

    finished: dict[str, float] = {}
    lock = threading.Lock()

    def slow(method: str):  # type: ignore[no-untyped-def]
        original = getattr(LocalFileSystem, method)

        def copy(self, source, target, *args, **kwargs):  # type: ignore[no-untyped-def]
            time.sleep(0.4)
            result = original(self, source, target, *args, **kwargs)
            with lock:
                finished[Path(target).name] = time.monotonic()
            return result

        monkeypatch.setattr(LocalFileSystem, method, copy)

    slow("put_file")
    slow("get_file")
    shards = tmp_path / "model"
    shards.mkdir()
    for n in range(TRANSFER_WORKERS):
        (shards / f"model-{n:05d}.safetensors").write_bytes(bytes([n]) * 1024)
    (shards / BASE_MARKER).write_text("{}")
    bucket = f"file://{tmp_path / 'bucket' / 'base'}"

    started = time.monotonic()
    upload_dir(shards, bucket, marker=BASE_MARKER)
    uploaded = time.monotonic() - started
    assert finished[BASE_MARKER] >= max(t for name, t in finished.items() if name != BASE_MARKER)
    assert uploaded < 0.4 * (TRANSFER_WORKERS + 1) / 2, f"{uploaded:.2f} s: one file at a time"

    finished.clear()
    started = time.monotonic()
    download_dir(bucket, tmp_path / "node-2")
    assert time.monotonic() - started < 0.4 * (TRANSFER_WORKERS + 1) / 2
    assert sorted(p.name for p in (tmp_path / "node-2").iterdir()) == sorted(p.name for p in shards.iterdir())
    assert all((tmp_path / "node-2" / p.name).read_bytes() == p.read_bytes() for p in shards.iterdir())
