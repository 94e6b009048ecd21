"""Export: merge a LoRA adapter into its base model and save a folder vLLM can serve.

    .venv/bin/python -m trainer.export --base local:gemma3-270m --adapter outputs/emoji-local/adapter         --out outputs/emoji-local/merged

Decisions (docs/trainer.md#the-merged-export):
- The base is reloaded in bf16 (never the 4-bit weights, not fp16), the adapter merged, and saved as safetensors
  with the tokenizer (a vision run's processor), chat template and a generation_config that stops at `<end_of_turn>`.
- `_COMPLETE.json` (base, adapter, time, every file's size) is written LAST and atomically, a stale one removed
  first; `serving/completion.py` is the one reader that decides a folder is complete.
- A run publishes in one order on every output kind (`publish_run`): `run_summary.json` with its evaluation,
  then the adapter's and the merged model's markers: whoever finds a marker finds the run's scores. A Gemma 4
  adapter gets the v_proj LoRA vLLM reads on shared-kv layers (`add_shared_kv_value_lora`, docs/serving.md).
- Every exported file is made world-readable first (safetensors writes 0600; the serving image is uid 2000).
- `output.push_to_hub` (off by default) uploads the export, or the adapter when not merged, to a private repo
  unless `output.hub_private` is false, with HF_TOKEN from the environment, never logged.
"""

from __future__ import annotations

import argparse
import logging
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.checkpoints import write_json_atomic
from trainer.model_files import resolve_model_path, set_stop_tokens

if TYPE_CHECKING:
    from trainer.checkpoints import OutputLocation

log = logging.getLogger(__name__)

COMPLETION_MARKER = "_COMPLETE.json"
# What a run writes before any completion marker: its scores (trainer/run_eval.py) and what it cost.
SUMMARY_FILE = "run_summary.json"


def is_complete(directory: str | Path) -> bool:
    """True only when the export's completion marker exists (local folder or fsspec URL)."""
    directory = str(directory)
    if "://" in directory:
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(directory)
        return fs.exists(f"{root.rstrip('/')}/{COMPLETION_MARKER}")
    return (Path(directory) / COMPLETION_MARKER).is_file()


def file_inventory(directory: Path) -> list[dict[str, Any]]:
    return [
        {"path": p.relative_to(directory).as_posix(), "bytes": p.stat().st_size}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != COMPLETION_MARKER
    ]


def make_readable(directory: Path) -> None:
    """Give everyone read access to every file (and traversal of every folder) under `directory`."""
    for path in [directory, *directory.rglob("*")]:
        if path.is_symlink():
            continue
        extra = 0o555 if path.is_dir() else 0o444
        mode = path.stat().st_mode & 0o7777
        if mode & extra != extra:
            path.chmod(mode | extra)


def write_completion_marker(directory: Path, **details: Any) -> Path:
    """Make the folder readable and write `_COMPLETE.json` (atomically) listing every other file. Call it last."""
    make_readable(directory)
    marker = directory / COMPLETION_MARKER
    write_json_atomic(marker, {**details, "completed_at": time.time(), "files": file_inventory(directory)})
    return marker


def clear_completion_marker(directory: str | Path) -> None:
    """Remove a folder's marker before its files are written again (a retried run): never complete while rewritten."""
    (Path(directory) / COMPLETION_MARKER).unlink(missing_ok=True)


def merge_and_export(
    base_model: str,
    adapter_dir: str | Path,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    tokenizer: Any = None,
    mark: bool = True,
) -> Path:
    """Merge `adapter_dir` into `base_model` (reloaded in `dtype`) and save a model folder, marked unless `mark`
    is False (a run marks it in `publish_run`, after its summary).

    `tokenizer`: the run's tokenizer or a vision run's processor, already in memory (the trainer passes its own);
    else it is loaded from the adapter folder (or the base). Gemma's 262k-token tokenizer takes seconds to load.
    AutoModelForCausalLM maps a Gemma 3 or 4 vision checkpoint to its ...ForConditionalGeneration class (transformers
    5.23 MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), the class a vision run trains, so the tower is merged and saved too.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir, adapter_dir = Path(out_dir), Path(adapter_dir)
    clear_completion_marker(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base_path = resolve_model_path(base_model)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=getattr(torch, dtype))
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    untie_if_separate(merged)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(
            adapter_dir if (adapter_dir / "tokenizer_config.json").exists() else base_path
        )
    set_stop_tokens(merged, getattr(tokenizer, "tokenizer", tokenizer))  # a processor's own tokenizer
    merged.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if mark:
        write_completion_marker(out_dir, **merged_details(base_model, adapter_dir, dtype))
    log.info("exported merged model to %s", out_dir)
    return out_dir


def untie_if_separate(model: Any) -> None:
    """Say `tie_word_embeddings: false` in every config of a model whose head is no longer its input embedding.

    An adapter with `modules_to_save` [lm_head, embed_tokens] trains two copies; merged, they stay two tensors and peft
    sets the flag only on the top-level config. A vision checkpoint's text_config keeps `true`, and vLLM builds the
    language model from that text_config: it ties the head to embed_tokens and skips the saved lm_head.weight
    (Gemma3ForCausalLM, vllm/model_executor/models/gemma3.py, v0.28.0), serving a head the run never trained.
    """
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embeddings is None or head.weight.data_ptr() == embeddings.weight.data_ptr():
        return
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False


def merged_details(base_model: str, adapter_dir: str | Path, dtype: str = "bfloat16") -> dict[str, Any]:
    """What a merged export's marker records besides its files."""
    return {"base_model": base_model, "adapter": str(adapter_dir), "dtype": dtype}


def publish_run(
    location: OutputLocation,
    summary: dict[str, Any],
    adapter_dir: Path,
    merged_dir: Path | None,
    base_model: str,
    model_config: Any = None,
) -> None:
    """Write the run's summary, then mark its exports complete, in that order locally and at a remote output.dir.

    Every reader that finds a marker (the serving gate, `serving/completion.py`, a person) so finds the summary with
    the run's evaluation already there: a `pulumi up` between the two, or a job killed there, cannot see an export
    without its scores. The adapter's marker records its base, which serving loads it on. `model_config`: the trained
    model's, for the value LoRA vLLM needs on layers whose values are their keys (`add_shared_kv_value_lora`).
    """
    from trainer.checkpoints import upload_dir  # looked up per call: tests record uploads by patching it

    adapter_details: dict[str, Any] = {}
    if model_config is not None and shared_kv_layers(model_config):
        add_shared_kv_value_lora(adapter_dir, model_config)
        adapter_details[SHARED_KV_VALUE_LORA] = sorted(shared_kv_layers(model_config))

    summary_path = location.local / SUMMARY_FILE
    write_json_atomic(summary_path, summary, sort_keys=False)
    if location.remote:
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(location.remote)
        fs.makedirs(root, exist_ok=True)
        fs.put_file(str(summary_path), f"{root}/{SUMMARY_FILE}")
    write_completion_marker(adapter_dir, base_model=base_model, kind="adapter", **adapter_details)
    if merged_dir is not None:
        write_completion_marker(merged_dir, **merged_details(base_model, adapter_dir))
    if location.remote:
        upload_dir(adapter_dir, f"{location.remote}/adapter", marker=COMPLETION_MARKER)
        if merged_dir is not None:
            upload_dir(merged_dir, f"{location.remote}/merged", marker=COMPLETION_MARKER)


ADAPTER_WEIGHTS = "adapter_model.safetensors"
# In an adapter's marker: the shared-kv layers whose value LoRA vLLM reads was written (the Pulumi program refuses a
# Gemma 4 adapter published without it: infra/serving.py).
SHARED_KV_VALUE_LORA = "shared_kv_value_lora"
_K_LORA = re.compile(r"^(.*\.layers\.(\d+)\.self_attn\.)k_proj(\.lora_[AB]\.weight)$")


def shared_kv_layers(model_config: Any) -> set[int]:
    """The layers whose values are their keys (Gemma 4 `attention_k_eq_v`: the full-attention layers, no v_proj)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    if not getattr(text, "attention_k_eq_v", False):
        return set()
    return {n for n, kind in enumerate(getattr(text, "layer_types", None) or []) if kind == "full_attention"}


def add_shared_kv_value_lora(adapter_dir: str | Path, model_config: Any) -> list[int]:
    """Copy each shared-kv layer's k_proj LoRA to its v_proj in the saved adapter; the layers it did this for.

    In transformers such a layer has no v_proj: its values are the k_proj output, LoRA included. vLLM v0.28.0 loads
    the base's k_proj into both the key and the value slot of its packed qkv_proj (gemma4.py `_weight_iterator`) but
    applies an adapter per slot, the value slot's from `v_proj` (lora/model_manager.py `_create_merged_loras_inplace`:
    a missing one is none), so without the copy the served values miss the k_proj LoRA the run trained. peft ignores
    the extra tensors when it loads the adapter (`set_peft_model_state_dict` loads with strict=False).
    """
    layers = shared_kv_layers(model_config)
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not layers or not path.is_file():
        return []
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as weights:
        metadata = weights.metadata()
        tensors = {name: weights.get_tensor(name) for name in weights.keys()}  # noqa: SIM118 (safe_open has no iter)
    added = set()
    for name, tensor in list(tensors.items()):
        match = _K_LORA.match(name)
        if match and int(match.group(2)) in layers:
            value = f"{match.group(1)}v_proj{match.group(3)}"
            if value not in tensors:
                tensors[value] = tensor.clone()
                added.add(int(match.group(2)))
    if added:
        save_file(tensors, str(path), metadata=metadata)
        log.info("adapter: the k_proj LoRA of shared-kv layers %s copied to v_proj for vLLM", sorted(added))
    return sorted(added)


def is_adapter(directory: str | Path) -> bool:
    """True for a saved PEFT adapter folder (its config and its weights)."""
    directory = Path(directory)
    weights = (directory / "adapter_model.safetensors").is_file() or (directory / "adapter_model.bin").is_file()
    return (directory / "adapter_config.json").is_file() and weights


def push_to_hub(model_dir: str | Path, repo_id: str, private: bool = True, *, endpoint: str | None = None) -> str:
    """Upload a finished export or a saved adapter to the Hub repo `repo_id`; returns the repo URL.

    The token is HF_TOKEN from the environment (write scope). `endpoint` is the Hub's address
    (default: huggingface_hub's, i.e. https://huggingface.co or $HF_ENDPOINT).
    """
    import os

    model_dir = Path(model_dir)
    if not (is_complete(model_dir) or is_adapter(model_dir)):
        raise RuntimeError(
            f"{model_dir} is neither a complete export (no {COMPLETION_MARKER}) nor a saved adapter "
            "(adapter_config.json + weights): refusing to push it"
        )
    token = os.environ.get("HF_TOKEN")
    if not token:
        raise RuntimeError(
            f"output.push_to_hub is true but HF_TOKEN is not set: give the job a Hugging Face token with write "
            f"scope for {repo_id} (the stack's hfToken), or set output.push_to_hub: false"
        )
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    api.upload_folder(folder_path=str(model_dir), repo_id=repo_id, commit_message="gemma-finetune export")
    return f"{api.endpoint}/{repo_id}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="base model: Hub id, folder or local:gemma3-270m")
    parser.add_argument("--adapter", required=True, help="folder with the LoRA adapter")
    parser.add_argument("--out", required=True, help="folder for the merged model")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    print(merge_and_export(args.base, args.adapter, args.out, args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
