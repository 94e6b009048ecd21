"""A model reference made a folder, and what every model folder gets: the chat template, the stop tokens.

The training path (trainer/train.py, modeling.py, evaluate.py, export.py) resolves `local:gemma3-270m` here to the
folder this machine built, and never builds it: the builder (trainer/local_model.py, GGUF parsing, a file lock)
is the demo's and the entry points' (`python -m trainer`, `trainer.launch`), which build it first when a recipe
names it. A folder that is not built is a `LocalModelError` naming the command that builds it.

Decisions (docs/development.md#the-local-gemma-3-270m): the cache root is `~/.cache/gemma-finetune` (`GEMMA_FT_CACHE`
overrides it); a build is complete when its marker exists.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.recipe import LOCAL_MODEL_PREFIX

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

LOCAL_MODEL_NAME = "gemma3-270m"
CACHE_ENV = "GEMMA_FT_CACHE"
BUILD_MARKER = "_BUILD_COMPLETE.json"
END_OF_TURN = "<end_of_turn>"


class LocalModelError(RuntimeError):
    """The local model could not be built or found (disk full, package missing, …); the message says how to fix it."""


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where local models are cached: the argument, else `$GEMMA_FT_CACHE`, else `~/.cache/gemma-finetune`."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gemma-finetune"


def is_built(model_dir: Path) -> bool:
    return (model_dir / BUILD_MARKER).is_file()


def local_model_dir(name_or_path: str, cache_dir: str | Path | None = None) -> Path:
    """The cache folder of a `local:` reference (built or not); LocalModelError for a name that is no local model."""
    name = name_or_path.removeprefix(LOCAL_MODEL_PREFIX)
    if name != LOCAL_MODEL_NAME:
        raise LocalModelError(
            f"unknown local model {name_or_path!r}: the only one is {LOCAL_MODEL_PREFIX}{LOCAL_MODEL_NAME}"
        )
    return cache_root(cache_dir) / name


def resolve_model_path(name_or_path: str, cache_dir: str | Path | None = None) -> str:
    """`local:gemma3-270m` as its built folder (LocalModelError when this machine has not built it); any other
    reference unchanged."""
    if not name_or_path.startswith(LOCAL_MODEL_PREFIX):
        return name_or_path
    folder = local_model_dir(name_or_path, cache_dir)
    if not is_built(folder):
        raise LocalModelError(
            f"{name_or_path} is not built on this machine ({folder} has no {BUILD_MARKER}). "
            "Fix: `python -m trainer.local_model` builds it once (about a minute); `python -m trainer` and "
            "`make demo` build it themselves"
        )
    return str(folder)


def trl_chat_template(name: str) -> str:
    """The text of trl's bundled chat template `trl/chat_templates/<name>.jinja`."""
    import trl

    path = Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja"
    if not path.exists():
        available = sorted(p.stem for p in path.parent.glob("*.jinja"))
        raise LocalModelError(
            f"chat template {name!r} is not shipped by trl {trl.__version__}; choose one of {available}"
        )
    return path.read_text()


def set_stop_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Generation stops at `<end_of_turn>` (the end of a chat turn) as well as at the tokenizer's eos."""
    stop_ids = [tokenizer.eos_token_id]
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if end_of_turn is not None and end_of_turn != tokenizer.unk_token_id and end_of_turn not in stop_ids:
        stop_ids.append(end_of_turn)
    model.generation_config.eos_token_id = stop_ids
    if tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
