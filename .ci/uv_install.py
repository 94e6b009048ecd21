#!/usr/bin/env python3
"""`uv pip install` into the running interpreter's environment, from the package sources pip is configured with.

`make venv` installs the requirements with uv (the same pins, much faster). uv reads neither pip's
configuration files nor PIP_* variables, so the options `pip install` would run with are read from pip's
own parser (its files and variables, with pip's precedence) and handed to uv: index-url,
extra-index-url, find-links, no-index, constraint, and cert (as SSL_CERT_FILE, or SSL_CERT_DIR for a
folder). uv chooses among all indexes as pip does (`--index-strategy unsafe-best-match`). Bytecode is
not compiled here: the first import of a module writes it (the Makefile lets Python write it), and the
tests import a fraction of site-packages (docs/development.md#uv-with-pips-sources). A pip setting that changes what is resolved and is not
handed on (pre, prefer-binary, only-/no-binary, build constraints, uploaded-prior-to, require-hashes)
exits 3, and `make venv` installs with pip; so does any failure here (pip's parser is internal API).
The evidence: docs/development.md#uv-with-pips-sources.

    .venv/bin/python .ci/uv_install.py -r requirements-dev.txt          # what `make venv` runs
    .venv/bin/python .ci/uv_install.py --print -r requirements-dev.txt  # print the uv command (and its env) instead
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

# pip install options that pick other versions or files than uv would without them
UNTRANSLATED = {
    "pre": "pre-releases allowed (pre)",
    "prefer_binary": "older wheels preferred over newer sources (prefer-binary)",
    "build_constraints": "build constraints (build-constraint)",
    "uploaded_prior_to": "files uploaded before a date only (uploaded-prior-to)",
    "require_hashes": "hash-checking mode (require-hashes)",
}


def main(argv: list[str]) -> int:
    from pip._internal.commands import create_command

    show = "--print" in argv
    options, _ = create_command("install").parse_args([])
    refused = [meaning for name, meaning in UNTRANSLATED.items() if getattr(options, name, None)]
    if options.format_control.no_binary or options.format_control.only_binary:
        refused.append("wheel or source restrictions (only-binary / no-binary)")
    if refused:
        print(f"uv_install: pip is configured with settings uv would not be given: {'; '.join(refused)}"
              " (install with pip instead)", file=sys.stderr)  # fmt: skip
        return 3

    def each(flag: str, values: list[str]) -> list[str]:
        return [word for value in values for word in (flag, value)]

    uv = str(Path(sys.executable).parent / "uv")
    command = [uv, "pip", "install", "--python", sys.executable, "--index-strategy", "unsafe-best-match"]
    if options.no_index:
        command += ["--no-index"]
    else:
        command += ["--index-url", options.index_url, *each("--extra-index-url", options.extra_index_urls)]
    command += each("--find-links", [os.path.expanduser(link) for link in options.find_links])  # as pip does
    command += each("--constraint", options.constraints) + [a for a in argv if a != "--print"]
    env = {}
    if options.cert and not {"SSL_CERT_FILE", "SSL_CERT_DIR"} & os.environ.keys():
        env = {"SSL_CERT_DIR" if os.path.isdir(options.cert) else "SSL_CERT_FILE": options.cert}
    if show:
        print(shlex.join([f"{k}={v}" for k, v in env.items()] + command))
        return 0
    return subprocess.run(command, env={**os.environ, **env}, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
