"""One definition of "a complete model folder", shared by every reader of the trainer's exports.

    python3 serving/completion.py /mnt/models/runs/abc/merged            # exit 0, or 3 with the reason
    python3 serving/completion.py --vllm-args /mnt/models/base --lora-modules emoji=/mnt/models/emoji
    from serving.completion import verify; verify("outputs/demo/merged")  # IncompleteModelError says what is wrong

Decision: a folder is complete when the trainer's marker (`_COMPLETE.json`, written last by
`trainer.export.write_completion_marker`) parses and lists an inventory (`files`: relative path and size) the
folder still matches (each file exists, has its size, is readable by this process), plus `config.json` for a
model or `adapter_config.json` for an adapter. A marker alone passes an interrupted copy, an overwritten file or
0600 weights, which then fail inside vLLM after minutes (docs/trainer.md#the-merged-export). The serving image's
entrypoint (this file, run with the image's python3), the local server, the demo and the Pulumi program use these
rules; the program checks the inventory's names against a listing (`check_inventory`, sizes unknown).
Standard library only. It does not wait (the entrypoint does) and does not know about buckets.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Must equal trainer.export.COMPLETION_MARKER (tests/serving/test_marker_contract.py).
COMPLETION_MARKER = "_COMPLETE.json"
MODEL, ADAPTER = "model", "adapter"
REQUIRED_FILE = {MODEL: "config.json", ADAPTER: "adapter_config.json"}
LABEL = {MODEL: "model", ADAPTER: "LoRA adapter"}
EXIT_INCOMPLETE = 3
HELP = "see the training job's logs (gcloud run jobs executions list / kubectl logs) and serving/README.md"


class IncompleteModelError(RuntimeError):
    """The folder is not a complete export; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class Inventory:
    """What the marker promises: relative path -> size in bytes."""

    files: dict[str, int]

    @classmethod
    def from_marker(cls, marker: Any, where: str) -> Inventory:
        files = marker.get("files") if isinstance(marker, dict) else None
        if not isinstance(files, list) or not files:
            raise IncompleteModelError(
                f"{where}/{COMPLETION_MARKER} lists no files: it was not written by this trainer's export "
                "(trainer.export.write_completion_marker); export the model again"
            )
        out: dict[str, int] = {}
        for item in files:
            if (
                not isinstance(item, dict)
                or not isinstance(item.get("path"), str)
                or not isinstance(item.get("bytes"), int)
            ):
                raise IncompleteModelError(f"{where}/{COMPLETION_MARKER} has a malformed files entry: {item!r}")
            path = item["path"]
            if path.startswith("/") or ".." in Path(path).parts:
                raise IncompleteModelError(f"{where}/{COMPLETION_MARKER} lists a path outside the folder: {path!r}")
            out[path] = item["bytes"]
        return cls(out)


def check_inventory(inventory: Inventory, present: Mapping[str, int | None], where: str, kind: str = MODEL) -> None:
    """Compare the marker's inventory with what is there (`present`: path -> size, or None when unknown)."""
    required = REQUIRED_FILE[kind]
    if required not in inventory.files:
        raise IncompleteModelError(
            f"{LABEL[kind]} at {where} has no {required} in its inventory: "
            + (
                "point lora_modules at the adapter folder the trainer exported"
                if kind == ADAPTER
                else "point at the merged model folder the trainer exported"
            )
        )
    missing = sorted(p for p in inventory.files if p not in present)
    if missing:
        raise IncompleteModelError(
            f"{LABEL[kind]} at {where} is not complete: {len(missing)} file(s) listed in {COMPLETION_MARKER} are missing "
            f"({', '.join(missing[:5])}{', …' if len(missing) > 5 else ''}): the copy was interrupted or files were "
            f"deleted; export or copy the model again; {HELP}"
        )
    wrong = sorted(
        f"{p} ({present[p]} bytes, marker says {size})"
        for p, size in inventory.files.items()
        if present[p] is not None and present[p] != size
    )
    if wrong:
        raise IncompleteModelError(
            f"{LABEL[kind]} at {where} does not match {COMPLETION_MARKER}: {', '.join(wrong[:5])}: a file was changed or "
            "is still being written after the export finished; export the model again"
        )


def read_marker(directory: Path) -> Any:
    marker = directory / COMPLETION_MARKER
    try:
        return json.loads(marker.read_text(encoding="utf-8"))
    except PermissionError:
        raise IncompleteModelError(
            f"{marker} is not readable by uid {os.getuid()}: {_readable_fix(directory)}"
        ) from None
    except (OSError, ValueError) as exc:
        raise IncompleteModelError(f"{marker} cannot be read as JSON ({exc}): export the model again") from None


def verify(directory: str | Path, kind: str = MODEL) -> Inventory:
    """Raise `IncompleteModelError` unless `directory` is a complete, readable export of `kind`."""
    directory = Path(directory)
    where = str(directory)
    if not directory.is_dir():
        raise IncompleteModelError(
            f"{LABEL[kind]} at {where} does not exist: training has not written it yet, or the bucket is not mounted there; {HELP}"
        )
    if not (directory / COMPLETION_MARKER).is_file():
        raise IncompleteModelError(
            f"{LABEL[kind]} at {where} is not complete (no {COMPLETION_MARKER}): training has not finished or failed; {HELP}"
        )
    inventory = Inventory.from_marker(read_marker(directory), where)
    present: dict[str, int | None] = {}
    unreadable: list[str] = []
    for rel in inventory.files:
        path = directory / rel
        try:
            present[rel] = path.stat().st_size
        except OSError:
            continue
        if not os.access(path, os.R_OK):
            unreadable.append(rel)
    check_inventory(inventory, present, where, kind)
    if unreadable:
        raise IncompleteModelError(
            f"{LABEL[kind]} at {where}: {', '.join(sorted(unreadable)[:5])} not readable by uid {os.getuid()} "
            f"(the serving image runs as uid 2000, gid 0): {_readable_fix(directory)}"
        )
    return inventory


def _readable_fix(directory: Path) -> str:
    return (
        f"make the files readable (`chmod -R a+rX {directory}`); exports made by this trainer are "
        "(trainer.export.make_readable)"
    )


# --------------------------------------------------------------------------- `vllm serve` arguments


def folders_in_vllm_args(args: list[str]) -> tuple[str | None, list[str]]:
    """The model (first positional or --model) and every --lora-modules path, in vLLM's forms.

    vLLM accepts `name=path` items and JSON items (`{"name": …, "path": …}`); a JSON list of
    such objects is accepted here too, and every path in it is returned.
    """
    model: str | None = None
    adapters: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--model="):
            model = arg.split("=", 1)[1]
        elif arg == "--model" and i + 1 < len(args):
            model = args[i + 1]
            i += 1
        elif arg.startswith("--lora-modules="):
            adapters += _lora_paths(arg.split("=", 1)[1])
        elif arg == "--lora-modules":
            # name=path or JSON items follow until the next flag
            while i + 1 < len(args) and not args[i + 1].startswith("-"):
                i += 1
                adapters += _lora_paths(args[i])
        elif i == 0 and not arg.startswith("-"):
            model = arg
        i += 1
    return model, adapters


def _lora_paths(item: str) -> list[str]:
    text = item.strip()
    if text.startswith(("{", "[")):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise IncompleteModelError(f"--lora-modules item {item!r} is not valid JSON: {exc}") from None
        entries = data if isinstance(data, list) else [data]
        paths = []
        for entry in entries:
            if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
                raise IncompleteModelError(f'--lora-modules item {item!r}: every JSON entry needs a "path"')
            paths.append(entry["path"])
        return paths
    if "=" not in text:
        raise IncompleteModelError(f"--lora-modules item {item!r}: use name=path or vLLM's JSON form")
    return [text.split("=", 1)[1]]


def is_local_path(model: str) -> bool:
    """A folder (absolute or relative path, or an existing directory); a Hub id has no marker to check."""
    return model.startswith(("/", "./", "../")) or Path(model).is_dir()


def check_vllm_args(args: list[str], wait_s: float = 0, poll_s: float = 5, log: Any = None) -> list[str]:
    """Verify the model and every adapter `vllm serve args` would load; wait up to `wait_s` for the markers.

    Returns one line per checked folder; raises `IncompleteModelError` on the first problem after the wait.
    """
    say = log or (lambda message: print(f"entrypoint: {message}", file=sys.stderr, flush=True))
    model, adapters = folders_in_vllm_args(args)
    if not model:
        raise IncompleteModelError(
            "no model given: pass the model folder as the first argument (serving/vllm_args.py renders it)"
        )
    targets: list[tuple[str, str]] = []
    if is_local_path(model):
        targets.append((MODEL, model))
    else:
        say(f"model {model} is not a local folder; vLLM will fetch it (no completion check)")
    targets += [(ADAPTER, path) for path in adapters]
    deadline = time.monotonic() + wait_s
    checked = []
    for kind, folder in targets:
        announced = 0.0
        while True:
            try:
                verify(folder, kind)
                break
            except IncompleteModelError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                if time.monotonic() >= announced:
                    say(f"waiting for {folder}/{COMPLETION_MARKER} ({left:.0f} s left of GEMMA_FT_WAIT_FOR_MODEL_S)")
                    announced = time.monotonic() + 30
                time.sleep(min(poll_s, max(left, 0.01)))
        checked.append(f"{LABEL[kind]} at {folder} is complete")
        say(checked[-1])
    return checked


def _main(argv: Iterable[str] | None = None) -> int:
    """`completion.py [--wait-s N] [--adapter] FOLDER…` or `completion.py [--wait-s N] --vllm-args ARGS…`."""
    args = list(sys.argv[1:] if argv is None else argv)
    vllm_args: list[str] | None = None
    if "--vllm-args" in args:  # everything after it belongs to vLLM, never to this parser
        cut = args.index("--vllm-args")
        args, vllm_args = args[:cut], args[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="completion.py",
        description="Check that model folders are complete exports of the trainer.",
        allow_abbrev=False,
    )
    parser.add_argument("--wait-s", type=float, default=0, help="wait this long for the markers")
    parser.add_argument("--adapter", action="store_true", help="the folders are LoRA adapters")
    parser.add_argument("folders", nargs="*")
    ns = parser.parse_args(args)
    try:
        if vllm_args is not None:
            check_vllm_args(vllm_args, ns.wait_s)
        else:
            for folder in ns.folders:
                verify(folder, ADAPTER if ns.adapter else MODEL)
                print(f"{folder} is complete")
    except IncompleteModelError as exc:
        print(f"entrypoint: ERROR: {exc}", file=sys.stderr)
        return EXIT_INCOMPLETE
    return 0


if __name__ == "__main__":
    sys.exit(_main())
