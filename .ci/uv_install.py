#!/usr/bin/env python3
"""`uv pip install` into the running interpreter's environment, from the package sources pip is configured with.

`make venv` installs the requirements with uv when uv can be had: the same pins in a fraction of pip's
time (pip spends most of its minutes resolving; README "Development" has the numbers). uv reads neither
pip's configuration files nor its PIP_* variables (docs.astral.sh/uv/pip/compatibility/, "Configuration
files and environment variables"), and a machine may point pip at local wheels (a CPU build of torch in
`find-links`) or extra indexes; an install that saw only PyPI could resolve differently. So pip's
effective settings for `pip install` are read with `pip config list` (the [global] section, then
[install], then PIP_* variables, each later one winning, as pip applies them: pip/_internal/cli/parser.py
`_get_ordered_configuration_items`) and handed to uv:
index-url, extra-index-url, find-links, constraint, and cert (uv's SSL_CERT_FILE). uv chooses among all
indexes as pip does (`--index-strategy unsafe-best-match`; uv's default takes the first index that has a
package at all: same page, "Packages that exist on multiple indexes") and compiles every module to
bytecode as pip does (`--compile-bytecode`; uv compiles lazily by default: same page, "Bytecode
compilation"), since without it each new process compiles what it imports, every time where
PYTHONDONTWRITEBYTECODE is set (an import of torch + transformers + trl then took 22 s of CPU instead of
12). uv 0.13.9 compiles only the packages it installs itself ("Bytecode compiled 3 files" for a one-package
reinstall), so it installs everything, torch too: from pip's find-links it takes the same local CPU build
pip takes (`torch==2.13.0` matches `2.13.0+cpu`, the highest such version among the sources).

    .venv/bin/python .ci/uv_install.py -r requirements-dev.txt        # what `make venv` runs
    .venv/bin/python .ci/uv_install.py --print -r requirements-dev.txt  # print the uv command (and its env) instead

Not done: other pip settings (trusted hosts, proxies, timeouts) are not translated; uv has its own
(UV_* variables).
"""

from __future__ import annotations

import ast
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

# pip option -> uv flag; each value may be a whitespace-separated list, as in pip.conf
SOURCES = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
# pip applies its configuration in this order, a later section overriding an earlier one
SECTIONS = ("global", "install", ":env:")


def pip_settings(listing: str) -> dict[str, str]:
    """The effective value of each pip option for `pip install`, from `pip config list` output."""
    by_section: dict[str, dict[str, str]] = {section: {} for section in SECTIONS}
    for line in listing.splitlines():
        key, sep, quoted = line.partition("=")
        section, dot, option = key.rpartition(".")
        if not sep or not dot or section not in by_section:
            continue
        try:
            value = ast.literal_eval(quoted)  # pip prints each value with %r (commands/configuration.py list_values)
        except (ValueError, SyntaxError):
            continue
        by_section[section][option] = str(value)
    settings: dict[str, str] = {}
    for section in SECTIONS:
        settings.update(by_section[section])
    return settings


def uv_arguments(settings: Mapping[str, str]) -> list[str]:
    arguments: list[str] = []
    for option, flag in SOURCES.items():
        for value in settings.get(option, "").split():
            arguments += [flag, value]
    return arguments


def main(argv: list[str]) -> int:
    show = "--print" in argv
    argv = [a for a in argv if a != "--print"]
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    settings = pip_settings(listing)
    uv = Path(sys.executable).parent / "uv"
    command = [str(uv), "pip", "install", "--python", sys.executable, "--index-strategy", "unsafe-best-match"]
    command += ["--compile-bytecode", *uv_arguments(settings), *argv]
    extra_env = {}
    if settings.get("cert") and "SSL_CERT_FILE" not in os.environ:
        extra_env["SSL_CERT_FILE"] = settings["cert"]
    if show:
        print(shlex.join([f"{k}={v}" for k, v in extra_env.items()] + command))
        return 0
    return subprocess.run(command, env={**os.environ, **extra_env}, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
