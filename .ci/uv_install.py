#!/usr/bin/env python3
"""`uv pip install` into the running interpreter's environment, from the package sources pip is configured with.

`make venv` installs the requirements with uv when uv can be had: the same pins in a fraction of pip's
time (pip spends most of its minutes resolving; bench/RESULTS.md has the numbers). uv reads neither
pip's configuration files nor its PIP_* variables (docs.astral.sh/uv/pip/compatibility/, "Configuration
files and environment variables"), and a machine may point pip at local wheels (a CPU build of torch in
`find-links`) or extra indexes; an install that saw only PyPI could resolve differently. So the options
`pip install` would run with are read from pip's own parser (`create_command("install").parse_args([])`:
every configuration file in pip's order, site over user over global, [install] over [global], then PIP_*
variables; pip/_internal/configuration.py and cli/parser.py) and handed to uv:
index-url, extra-index-url, find-links, no-index, constraint, and cert (uv's SSL_CERT_FILE, SSL_CERT_DIR for a folder). uv chooses among all
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

pip's parser is pip's internal API: if it moves, this script fails and `make venv` installs with pip. So
does a pip configured with settings that change what is resolved and that are not translated (pre,
prefer-binary, only-/no-binary, build constraints, uploaded-prior-to, require-hashes): exit 3, pip installs.
Not done: other pip settings (trusted hosts, proxies, timeouts) are not translated; uv has its own
(UV_* variables).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PipSources:
    """Where `pip install` would look for packages, and the certificate bundle it would trust."""

    index_url: str
    extra_index_urls: list[str]
    find_links: list[str]
    constraints: list[str]
    no_index: bool
    cert: str | None
    untranslated: list[str]  # pip settings that change the resolution and that this script does not hand to uv


# pip install options (attribute, what a set value means) that pick other versions or files than the
# defaults, which uv would not know about: the install is then left to pip (`make venv` falls back to it)
UNTRANSLATED = {
    "pre": "pre-releases allowed (pre)",
    "prefer_binary": "older wheels preferred over newer sources (prefer-binary)",
    "build_constraints": "build constraints (build-constraint)",
    "uploaded_prior_to": "files uploaded before a date only (uploaded-prior-to)",
    "require_hashes": "hash-checking mode (require-hashes)",
}


def pip_sources() -> PipSources:
    """The options `pip install` runs with here: pip's own parser applies its files and variables."""
    from pip._internal.commands import create_command

    options, _ = create_command("install").parse_args([])
    untranslated = [meaning for name, meaning in UNTRANSLATED.items() if getattr(options, name, None)]
    control = getattr(options, "format_control", None)
    if control is not None and (control.no_binary or control.only_binary):
        untranslated.append("wheel or source restrictions (only-binary / no-binary)")
    return PipSources(
        index_url=options.index_url,
        extra_index_urls=list(options.extra_index_urls),
        find_links=[os.path.expanduser(link) for link in options.find_links],  # pip expands ~, uv does not
        constraints=list(options.constraints),
        no_index=bool(options.no_index),
        cert=options.cert or None,
        untranslated=untranslated,
    )


def uv_arguments(sources: PipSources) -> list[str]:
    arguments = ["--no-index"] if sources.no_index else ["--index-url", sources.index_url]
    for flag, values in (
        ("--extra-index-url", [] if sources.no_index else sources.extra_index_urls),
        ("--find-links", sources.find_links),
        ("--constraint", sources.constraints),
    ):
        for value in values:
            arguments += [flag, value]
    return arguments


def certificate_env(cert: str | None) -> dict[str, str]:
    """pip's `cert` (a bundle file or a folder of certificates) where uv reads it, unless already set."""
    if not cert or "SSL_CERT_FILE" in os.environ or "SSL_CERT_DIR" in os.environ:
        return {}
    return {"SSL_CERT_DIR": cert} if os.path.isdir(cert) else {"SSL_CERT_FILE": cert}


def main(argv: list[str]) -> int:
    show = "--print" in argv
    argv = [a for a in argv if a != "--print"]
    sources = pip_sources()
    if sources.untranslated:
        print(
            "uv_install: pip is configured with settings uv would not be given: "
            + "; ".join(sources.untranslated)
            + " (install with pip instead)",
            file=sys.stderr,
        )
        return 3
    uv = Path(sys.executable).parent / "uv"
    command = [str(uv), "pip", "install", "--python", sys.executable, "--index-strategy", "unsafe-best-match"]
    command += ["--compile-bytecode", *uv_arguments(sources), *argv]
    extra_env = certificate_env(sources.cert)
    if show:
        print(shlex.join([f"{k}={v}" for k, v in extra_env.items()] + command))
        return 0
    return subprocess.run(command, env={**os.environ, **extra_env}, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
