"""Record the options of `vllm serve` from vLLM's own parser, for tests/serving/test_vllm_cli.py to replay offline.

    pip download vllm==0.28.0 --no-deps -d /tmp/vllm && unzip -q /tmp/vllm/vllm-0.28.0-*.whl -d /tmp/vllm/site
    # plus vLLM's pure-Python imports the parser needs (cbor2, msgspec, pyzmq, ... into /tmp/vllm/deps)
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=/tmp/vllm/site:/tmp/vllm/deps python tests/serving/record_vllm_cli.py

The parser is built exactly as `vllm serve` builds it (vllm/entrypoints/cli/serve.py `ServeSubcommand`), on a CPU:
VLLM_TARGET_DEVICE=cpu only lets vLLM pick a platform for its defaults. Each option keeps what argparse checks
(its spellings, how many values, its choices, whether the value is JSON); help texts and defaults are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "fixtures" / "vllm_serve_cli.json"


def value_kind(convert: object) -> str:
    """What argparse converts a value with: str, int, float, json, json-or-str (a dict or a name), human-int (4096,
    4k, auto). vLLM wraps its converters (`optional_type`, `parse_type`): the wrapped one decides."""
    name = getattr(convert, "__name__", "")
    inner = [c.cell_contents for c in (getattr(convert, "__closure__", None) or ())]
    if name in {"_optional_type", "_parse_type"} and inner and callable(inner[0]):
        return value_kind(inner[0])
    if convert is None or convert is str:
        return "str"
    if convert in (int, float):
        return convert.__name__  # type: ignore[union-attr]
    if name in {"loads", "parse_dataclass"}:
        return "json"
    if name == "union_dict_and_str":
        return "json-or-str"
    if name.startswith("human_readable_int"):
        return "human-int"
    return "str"


def record() -> dict:
    import vllm
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    options = []
    for action in serve._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        kind = type(action).__name__
        options.append(
            {
                "flags": list(action.option_strings),
                "dest": action.dest,
                "nargs": action.nargs
                if action.nargs is None or isinstance(action.nargs, (int, str))
                else str(action.nargs),
                "takes_value": kind
                not in {
                    "_StoreTrueAction",
                    "_StoreFalseAction",
                    "BooleanOptionalAction",
                    "_StoreConstAction",
                    "_CountAction",
                },
                "choices": sorted(map(str, action.choices)) if action.choices else None,
                "value": value_kind(action.type),
                "action": kind,
            }
        )
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    # `--load-format` is a plain string to argparse; the loader registry decides (get_model_loader)
    return {"vllm": vllm.__version__, "options": options, "load_formats": sorted(_LOAD_FORMAT_TO_MODEL_LOADER)}


if __name__ == "__main__":
    data = record()
    OUT.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"{len(data['options'])} options of vllm {data['vllm']} serve -> {OUT}", file=sys.stderr)
