""".ci/uv_install.py: `make venv` hands uv the package sources pip is configured with, as pip applies them.

uv reads neither pip.conf nor PIP_* variables; a machine whose CPU build of torch and extra indexes are
known only to pip would otherwise get another resolution from uv. Here real pip reads a real configuration
file (the user's, under HOME) and PIP_* variables, and the script's uv command must carry each source with
pip's precedence: a variable over a file, [install] over [global].
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from infra.offline.engine import REPO_ROOT

SCRIPT = REPO_ROOT / ".ci" / "uv_install.py"


def values(words: list[str], flag: str) -> list[str]:
    return [words[i + 1] for i, word in enumerate(words[:-1]) if word == flag]


def run_script(tmp_path: Path, **variables: str) -> subprocess.CompletedProcess[str]:
    """The script with --print, HOME under tmp_path and only the PIP_* variables given."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PIP_", "XDG_")) and k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")
    }
    env |= {"HOME": str(tmp_path / "home"), "XDG_CONFIG_DIRS": str(tmp_path / "no-machine-config"), **variables}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--print", "-q", "-r", "requirements-dev.txt"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def printed_command(tmp_path: Path, **variables: str) -> list[str]:
    """The uv command the script prints."""
    done = run_script(tmp_path, **variables)
    assert done.returncode == 0, done.stderr
    return shlex.split(done.stdout)


def test_uv_gets_pips_sources_with_pips_precedence(tmp_path: Path) -> None:
    # the user's file: read after the machine's (/etc/pip.conf and the like), so its values are the ones in force
    user = tmp_path / "home" / ".config" / "pip"
    user.mkdir(parents=True)
    (user / "pip.conf").write_text(
        "[global]\nfind-links = /user/wheels\nindex-url = https://user.example/simple\ncert = /user/ca.pem\n"
        "extra-index-url =\n    file:///user/a\n    file:///user/b\n"
        "[install]\nindex-url = https://install.example/simple\n"
    )
    # the machine's file (XDG_CONFIG_DIRS): every key it shares with the user's file is overridden
    machine = tmp_path / "machine" / "pip"
    machine.mkdir(parents=True)
    (machine / "pip.conf").write_text(
        "[global]\ncert = /machine/ca.pem\nindex-url = https://machine.example/simple\n"
        "extra-index-url = file:///machine/x\nfind-links = /machine/wheels\n"
    )
    constraints = tmp_path / "constraints.txt"
    words = printed_command(
        tmp_path,
        XDG_CONFIG_DIRS=str(tmp_path / "machine"),
        PIP_FIND_LINKS="/env/wheels",
        PIP_CONSTRAINT=str(constraints),
    )

    assert words[0] == "SSL_CERT_FILE=/user/ca.pem", "pip's cert, where uv looks for one"
    assert words[1:4] == [str(Path(sys.executable).parent / "uv"), "pip", "install"]
    assert values(words, "--python") == [sys.executable], "into the interpreter that runs the script (the venv)"
    assert values(words, "--find-links") == ["/env/wheels"], "PIP_FIND_LINKS wins over the file"
    assert values(words, "--index-url") == ["https://install.example/simple"], "[install] wins over [global]"
    assert values(words, "--extra-index-url") == ["file:///user/a", "file:///user/b"], "a list: one flag each"
    assert values(words, "--constraint") == [str(constraints)]
    # pip's choice among indexes (the best version anywhere); bytecode is written at first import (the Makefile)
    assert values(words, "--index-strategy") == ["unsafe-best-match"] and "--compile-bytecode" not in words
    assert words[-3:] == ["-q", "-r", "requirements-dev.txt"], "the rest of the arguments go to uv unchanged"


def test_no_index_reaches_uv_and_no_index_url_does(tmp_path: Path) -> None:
    """PIP_NO_INDEX=1 (wheels from find-links only, an offline machine): uv must not fall back to PyPI."""
    words = printed_command(tmp_path, PIP_NO_INDEX="1", PIP_FIND_LINKS="/env/wheels")
    assert "--no-index" in words
    assert values(words, "--index-url") == [] and values(words, "--extra-index-url") == []
    assert values(words, "--find-links") == ["/env/wheels"]


def test_without_configuration_uv_uses_pips_default_index(tmp_path: Path) -> None:
    words = printed_command(tmp_path, PIP_CONFIG_FILE=os.devnull)  # pip then reads no file at all
    assert values(words, "--index-url") == ["https://pypi.org/simple"]
    assert not words[0].startswith("SSL_CERT_FILE=") and "--no-index" not in words
    assert values(words, "--find-links") == [] and values(words, "--constraint") == []


def test_a_home_relative_find_links_and_a_certificate_folder_reach_uv_as_pip_reads_them(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    certs.mkdir()
    words = printed_command(tmp_path, PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="~/wheels", PIP_CERT=str(certs))
    assert values(words, "--find-links") == [str(tmp_path / "home" / "wheels")], "pip expands ~; uv would not"
    assert words[0] == f"SSL_CERT_DIR={certs}", "a folder of certificates is uv's SSL_CERT_DIR, not a bundle file"


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("PIP_PRE", "1", "pre-releases"),
        ("PIP_ONLY_BINARY", ":all:", "only-binary"),
        ("PIP_PREFER_BINARY", "1", "prefer-binary"),
        ("PIP_REQUIRE_HASHES", "1", "require-hashes"),
    ],
)
def test_settings_uv_would_not_get_leave_the_install_to_pip(
    tmp_path: Path, variable: str, value: str, named: str
) -> None:
    """uv would resolve differently without them and without an error: the script fails and make installs with pip."""
    done = run_script(tmp_path, PIP_CONFIG_FILE=os.devnull, **{variable: value})
    assert done.returncode == 3 and done.stdout == ""
    assert named in done.stderr and "install with pip instead" in done.stderr


def test_make_lets_python_write_the_bytecode_the_install_left_out(tmp_path: Path) -> None:
    """Why: without `--compile-bytecode` a PYTHONDONTWRITEBYTECODE from the machine (CI's has one) would make
    every test process compile each module it imports again; the Makefile's recipes must run without it."""
    (tmp_path / "first_import.py").write_text("VALUE = 1\n")
    probe = tmp_path / "probe.py"  # its folder is on sys.path: the module beside it is found
    probe.write_text("import sys\nimport first_import\nprint(sys.dont_write_bytecode)\n")
    done = subprocess.run(
        ["make", "-s", "--eval", f"probe:\n\t@{sys.executable} {probe}", "probe"],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", done.stdout
    assert list((tmp_path / "__pycache__").glob("first_import.*.pyc")), "the first import wrote no bytecode"
