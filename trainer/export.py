"""Export: merge a LoRA adapter into its base model and save a folder vLLM can serve.

    .venv/bin/python -m trainer.export --base local:gemma3-270m --adapter outputs/emoji-local/adapter \
        --out outputs/emoji-local/merged

Decisions:
- The base is reloaded in bf16 (never the 4-bit QLoRA weights, and not fp16: Gemma 3 is trained
  in bf16 and overflows in fp16), the adapter merged, and the result saved as safetensors with the
  tokenizer, chat template and a generation_config whose stop tokens include `<end_of_turn>`.
- `_COMPLETE.json` is written LAST and atomically; the serving image waits for exactly this file
  name. A stale marker is removed before anything else is written, so a folder being rewritten, or a
  half-written export, is never mistaken for a model. The marker records the base model, the adapter,
  the time and the list of files with their sizes; `serving/completion.py` is the one reader that
  decides whether a folder is complete (marker + that inventory + every file readable).
- Every exported file is made world-readable before the marker is written: safetensors (used by
  transformers 5.x `save_pretrained`) writes through a 0600 temporary file (observed with
  safetensors 0.8: `model.safetensors` 0600 under umask 022), and the serving image runs as
  uid 2000 (gid 0), so a `docker run` of a local export, or a cache shared by several users, could not
  read the weights.
- Pushing to the Hub (`output.push_to_hub`, off by default) uploads the merged export, or the
  adapter when the recipe does not merge (W1's seed pushed its adapter to a private repo), into a
  repository created private unless `output.hub_private` is false. The token is HF_TOKEN from the
  environment (the platforms fill it from the stack's secret; it needs write scope) and is never
  logged. Tests point `huggingface_hub` at a local stand-in server, never at the Hub.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

from trainer.checkpoints import write_json_atomic

log = logging.getLogger(__name__)

COMPLETION_MARKER = "_COMPLETE.json"


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


def merge_and_export(
    base_model: str, adapter_dir: str | Path, out_dir: str | Path, dtype: str = "bfloat16", tokenizer: Any = None
) -> Path:
    """Merge `adapter_dir` into `base_model` (reloaded in `dtype`) and save a complete, marked model folder.

    `tokenizer`: the run's tokenizer, already in memory (the trainer passes its own); else it is loaded
    from the adapter folder (or the base). Gemma's 262k-token tokenizer takes seconds to load.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.local_model import resolve_model_path, set_stop_tokens

    out_dir, adapter_dir = Path(out_dir), Path(adapter_dir)
    (out_dir / COMPLETION_MARKER).unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    base_path = resolve_model_path(base_model)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=getattr(torch, dtype))
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(
            adapter_dir if (adapter_dir / "tokenizer_config.json").exists() else base_path
        )
    set_stop_tokens(merged, tokenizer)
    merged.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    write_completion_marker(out_dir, base_model=base_model, adapter=str(adapter_dir), dtype=dtype)
    log.info("exported merged model to %s", out_dir)
    return out_dir


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
