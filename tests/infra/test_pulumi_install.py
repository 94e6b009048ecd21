"""A fresh clone's first `pulumi up`, replayed the way the Pulumi CLI installs and starts the program.

The steps are pulumi/pulumi v3.259.0's (each with its source file and function:
docs/program.md#how-pulumi-up-installs-the-program): `main: infra/` makes `infra/` the program directory; the pip toolchain's
venv is `<project root>/.venv`; `EnsureVenv` does nothing when `.venv/bin/python` exists, else
`python3 -m venv` (`CommandPath`: `$PULUMI_PYTHON_CMD`, else python3, else python), then, with the venv
activated (`ActivateVirtualEnv`: PATH, VIRTUAL_ENV, no PYTHONHOME) in the program directory,
`pip install --upgrade pip setuptools wheel` and, only if that directory has one, `pip install -r
requirements.txt` (pulumi/pulumi#17075's quiet skip otherwise). `Run` (after `ValidateVenv`) has the venv's
python run `pulumi-language-python-exec`, replayed by tests/infra/pulumi_exec_replay.py under the mocks.

The copy holds what a clone holds: the files git tracks, plus files not yet committed that git does not
ignore (a new file counts before its commit); never `.venv`, `build/`. pip reads the machine's own
configuration (index, find-links, wheel cache), as under Pulumi.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra.offline.engine import REPO_ROOT, stack_names

REPLAY = Path(__file__).with_name("pulumi_exec_replay.py")


def fresh_copy(dest: Path) -> Path:
    """The files a clone of this tree would hold, copied to `dest`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in filter(None, listed):
        rel = raw.decode()
        src = REPO_ROOT / rel
        if not src.is_file() or src.is_symlink():  # deleted in the work tree, or the .venv link
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    return dest


def program_directory(root: Path, main: str | None) -> Path:
    """pkg/engine/project.go getPwdMain: the pwd (ProgramDirectory) for `main`."""
    if not main:
        return root
    path = Path(main) if os.path.isabs(main) else Path(os.path.normpath(root / main))
    return path if path.is_dir() else path.parent


def activated(venv: Path) -> dict[str, str]:
    """toolchain.go ActivateVirtualEnv. PYTHONPATH is dropped too: a test runner's would leak the dev venv."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONHOME", "PYTHONPATH"}}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def base_python() -> str:
    """pip.go CommandPath: $PULUMI_PYTHON_CMD, else python3, else python, on PATH."""
    for cmd in [os.environ["PULUMI_PYTHON_CMD"]] if os.environ.get("PULUMI_PYTHON_CMD") else ["python3", "python"]:
        if found := shutil.which(cmd):
            return found
    return sys.executable


def install_like_pulumi(root: Path) -> tuple[Path, Path, list[list[str]]]:
    """Pulumi's EnsureVenv -> InstallDependencies for the project at `root`; returns the program
    directory, the venv and the pip commands it ran."""
    project = yaml.safe_load((root / "Pulumi.yaml").read_text())
    runtime = project["runtime"]
    assert isinstance(runtime, dict) and runtime["name"] == "python"
    options = runtime.get("options") or {}
    assert options.get("toolchain", "pip") == "pip", "this replay follows pip's toolchain (pip.go)"
    program_dir = program_directory(root, project.get("main"))
    virtualenv = options.get("virtualenv")
    assert virtualenv, "without `virtualenv` Pulumi installs into the ambient Python"
    venv = Path(virtualenv) if os.path.isabs(virtualenv) else root / virtualenv
    assert not (venv / "bin" / "python").exists()  # EnsureVenv: a fresh clone has none
    subprocess.run([base_python(), "-m", "venv", str(venv)], check=True, capture_output=True)
    ran = []
    steps = [["--upgrade", "pip", "setuptools", "wheel"]]
    if (program_dir / "requirements.txt").exists():
        steps.append(["-r", "requirements.txt"])
    for args in steps:
        # --no-compile: pip's byte-compiling of the ~10,000 modules of pulumi_gcp only writes .pyc caches (the
        # installed files and what imports are the same) and is three quarters of the install's CPU time
        cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", *args]
        done = subprocess.run(cmd, cwd=program_dir, env=activated(venv), capture_output=True, text=True)
        assert done.returncode == 0, f"{' '.join(cmd)} in {program_dir}:\n{done.stderr[-3000:]}"
        ran.append(cmd)
    return program_dir, venv, ran


@pytest.mark.slow
def test_fresh_clone_installs_and_runs_the_program_as_pulumi_does(tmp_path: Path) -> None:
    root = fresh_copy(tmp_path / "gemma-finetune")
    program_dir, venv, ran = install_like_pulumi(root)
    assert program_dir == root / "infra"
    stacks = stack_names()
    done = subprocess.run(
        [str(venv / "bin" / "python"), str(REPLAY), str(root), str(program_dir), *stacks],
        cwd=program_dir,
        env=activated(venv),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (
        f"pip ran {[c[-2:] for c in ran]} in {program_dir} (Pulumi installs its requirements.txt only):\n"
        + done.stderr[-4000:]
    )
    runs = {r["stack"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert set(runs) == set(stacks)
    for stack, run in runs.items():
        assert Path(run["pulumi_file"]).is_relative_to(venv), run["pulumi_file"]  # the SDK of that venv
        assert run["resources"] > 10, (stack, run)
        assert "gcp:storage/bucket:Bucket" in run["types"], stack
        assert {"bucket", "trainerImage"} <= set(run["outputs"]), (stack, run["outputs"])
    # no dev requirement came along: the program runs without them
    listed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
        env=activated(venv),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    installed = {p["name"].lower().replace("_", "-") for p in json.loads(listed)}
    assert {"pulumi", "pulumi-gcp"} <= installed
    assert not installed & {"torch", "transformers", "pytest", "ray"}, installed


def test_an_older_python_stops_with_the_fix_before_the_program_runs(tmp_path: Path) -> None:
    """pip.go CommandPath makes `.venv` with the `python3` on PATH (3.10 on Ubuntu 22.04): the entry point must
    say what to do instead of failing deep in the program (`from enum import StrEnum`)."""
    replay = (
        "import runpy, sys; sys.version_info = (3, 10, 12, 'final', 0); "
        f"runpy.run_path({str(REPO_ROOT / 'infra')!r}, run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", replay], cwd=REPO_ROOT / "infra", capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "needs Python 3.11 or newer" in done.stderr and "Python 3.10.12" in done.stderr, done.stderr[-2000:]
    assert "PULUMI_PYTHON_CMD=python3.11" in done.stderr and "remove .venv" in done.stderr


def test_the_readme_selects_a_stack_a_fresh_backend_does_not_have_yet() -> None:
    """pulumi/pulumi v3.259.0 pkg/cmd/pulumi/stack/stack_select.go: a named stack the backend lacks is
    `StackNotFoundError` ("no stack named 'dev' found") unless `--create` (`-c`) is passed; a new user's
    backend holds none of the three stacks, so the cloud path's `select` must create it (or `init` it first)."""
    readme = (REPO_ROOT / "README.md").read_text()
    cloud_path = readme[readme.index("## The cloud path") :]
    block = cloud_path[cloud_path.index("```bash") : cloud_path.index("```", cloud_path.index("```bash") + 3)]
    commands = [line.split("#")[0].split() for line in block.splitlines()]
    inits = {c[3] for c in commands if c[:3] == ["pulumi", "stack", "init"] and len(c) > 3}
    selects = [c for c in commands if c[:3] == ["pulumi", "stack", "select"]]
    assert selects, "the cloud path selects a stack"
    for cmd in selects:
        name = next(w for w in cmd[3:] if not w.startswith("-"))
        assert {"--create", "-c"} & set(cmd) or name in inits, " ".join(cmd)
