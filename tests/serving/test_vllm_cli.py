"""Every stack's `vllm serve` arguments, parsed as the pinned vLLM's own parser would parse them.

tests/serving/fixtures/vllm_serve_cli.json is `vllm serve`'s option table, recorded from vLLM's parser by
tests/serving/record_vllm_cli.py (its docstring has the commands). The parser here is rebuilt from that table:
each option's spellings, how many values it takes, its choices and how its value converts (int, float, JSON, 4k);
`--load-format` is checked against the loader registry the table also recorded. So an argument the pinned vLLM
would refuse at start-up on Cloud Run (after minutes of image pull) fails here, for every stack as planned.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest

from infra.offline.engine import run_stack
from serving.vllm_args import VLLM_IMAGE, VllmServerConfig, render_args

CLI = json.loads((Path(__file__).resolve().parent / "fixtures" / "vllm_serve_cli.json").read_text())
SERVICE = "gcp:cloudrunv2/service:Service"
SERVING_ON = {"servingEnabled": True, "servingInvokers": ["user:alice@example.com"]}


def _human_int(value: str) -> int | str:
    """vLLM's human_readable_int_or_auto: 4096, 4k, 1M, auto, -1."""
    if value in {"auto", "-1"}:
        return value
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", value)
    if not match:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of tokens")
    return int(float(match.group(1)) * {"": 1, "k": 1000, "m": 10**6, "g": 10**9}[match.group(2).lower()])


def _json_or_str(value: str) -> Any:
    return json.loads(value) if value.lstrip().startswith("{") else value


CONVERT = {"str": str, "int": int, "float": float, "json": json.loads, "json-or-str": _json_or_str}
CONVERT["human-int"] = _human_int


class Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # type: ignore[override]
        raise Refused(message)


def vllm_serve_parser() -> _Parser:
    """`vllm serve` as recorded: a positional model, then the options."""
    parser = _Parser(prog="vllm serve", allow_abbrev=False, add_help=False)
    for option in CLI["options"]:
        if not option["flags"]:
            parser.add_argument(option["dest"], nargs=option["nargs"])
            continue
        kwargs: dict[str, Any] = {"dest": option["dest"]}
        if option["takes_value"]:
            kwargs["type"] = CONVERT[option["value"]]
            if option["nargs"] is not None:
                kwargs["nargs"] = option["nargs"]
            if option["choices"]:
                kwargs["choices"] = [kwargs["type"](c) for c in option["choices"]]
            if option["action"] == "_AppendAction":
                kwargs["action"] = "append"
        else:
            kwargs["action"] = "store_true"
        parser.add_argument(*option["flags"], **kwargs)
    return parser


def parse(args: list[str]) -> argparse.Namespace:
    namespace = vllm_serve_parser().parse_args(args)
    if namespace.load_format is not None and namespace.load_format not in CLI["load_formats"]:
        raise Refused(f"--load-format {namespace.load_format}: vLLM {CLI['vllm']} knows {CLI['load_formats']}")
    return namespace


def served_args(stack: str) -> list[str]:
    run = run_stack(stack, overrides=SERVING_ON, assume_trained=True)
    return run.one(SERVICE).plain_inputs()["template"]["containers"][0]["args"]


def test_the_table_is_the_pinned_release() -> None:
    assert f"v{CLI['vllm']}" in VLLM_IMAGE, "record tests/serving/fixtures/vllm_serve_cli.json from the pinned vLLM"


@pytest.mark.parametrize("stack", ["dev", "a4-gemma4", "ray-gemma3-vision"])
def test_every_stack_renders_arguments_the_pinned_vllm_accepts(stack: str) -> None:
    namespace = parse(served_args(stack))
    assert namespace.model_tag and namespace.max_model_len == 4096


def test_the_adapter_stack_serves_its_base_from_the_bucket_with_its_adapter() -> None:
    namespace = parse(served_args("a4-gemma4"))
    assert namespace.model_tag.startswith("gs://my-gcp-project-gft-a4-gemma4/runs/train-text-to-sql-gemma4-31b-")
    assert "/_base/google--gemma-4-31B-it@main" in namespace.model_tag, "the staged copy, never the Hub"
    assert namespace.load_format == "runai_streamer" and namespace.enable_lora
    assert namespace.max_lora_rank == 16 and namespace.max_loras == 1
    (adapter,) = namespace.lora_modules
    name, _, path = adapter.partition("=")
    assert name == "text-to-sql-gemma4-31b" and path.endswith("/adapter") and path.startswith("/mnt/models/runs/")


def test_a_flag_the_pinned_vllm_does_not_know_is_refused_here() -> None:
    """The replay can fail: a typo'd flag, a rank outside vLLM's choices, a load format without a loader."""
    good = render_args(VllmServerConfig(model="/m", lora_modules={"a": "/a"}, max_lora_rank=16))
    parse(good)
    with pytest.raises(Refused, match="unrecognized"):
        parse([*good, "--enable-lora-bias-typo"])
    with pytest.raises(Refused, match="invalid choice"):
        parse([arg if arg != "16" else "24" for arg in good])
    with pytest.raises(Refused, match="load-format"):
        parse([*good, "--load-format", "gcsfuse"])
