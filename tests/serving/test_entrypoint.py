"""serving/entrypoint.sh: no vLLM on a half-written model; otherwise `exec vllm serve` with the args unchanged.

A stub `vllm` on PATH records what it was called with, so the test runs anywhere with bash and
python3. Folders are marked complete by the trainer's own writer (`write_completion_marker`), and
one test runs the check on a folder written by the real `merge_and_export` of a tiny model.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from serving.vllm_args import API_KEY_GUARD_MIDDLEWARE, COMPLETION_MARKER, VllmServerConfig, render_args
from tests.serving.privileges import in_child_as_nobody
from trainer.export import write_completion_marker

ENTRYPOINT = Path(__file__).resolve().parents[2] / "serving" / "entrypoint.sh"


@pytest.fixture
def stub_bin(tmp_path: Path) -> Path:
    """A `vllm` that writes its argv (one per line) to $VLLM_ARGS_FILE, its parent pid beside it, and exits 0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "vllm"
    stub.write_text(
        '#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$VLLM_ARGS_FILE"\necho "$PPID" > "$VLLM_ARGS_FILE.ppid"\n'
    )
    stub.chmod(0o755)
    return bin_dir


def _model(path: Path, complete: bool = True, adapter: bool = False) -> Path:
    path.mkdir(parents=True)
    (path / ("adapter_config.json" if adapter else "config.json")).write_text("{}")
    (path / ("adapter_model.safetensors" if adapter else "model.safetensors")).write_bytes(b"weights" * 10)
    if complete:
        write_completion_marker(path, base_model="test", adapter=None)
    return path


def _run(
    args: list[str], stub_bin: Path, tmp_path: Path, **env: str
) -> tuple[subprocess.CompletedProcess[str], list[str] | None]:
    record = tmp_path / "vllm-args.txt"
    full_env = {
        **os.environ,
        "PATH": f"{stub_bin}{os.pathsep}{os.environ['PATH']}",
        "VLLM_ARGS_FILE": str(record),
        **env,
    }
    done = subprocess.run(
        ["bash", str(ENTRYPOINT), *args], capture_output=True, text=True, env=full_env, timeout=30, check=False
    )
    recorded = record.read_text().splitlines() if record.exists() else None
    return done, recorded


def test_execs_vllm_serve_with_the_rendered_args(stub_bin: Path, tmp_path: Path) -> None:
    model = _model(tmp_path / "merged")
    args = render_args(VllmServerConfig(model=str(model), max_model_len=4096))
    done, recorded = _run(args, stub_bin, tmp_path)
    assert done.returncode == 0, done.stderr
    assert recorded == ["serve", *args]
    assert f"model at {model} is complete" in done.stderr


def test_exec_replaces_the_shell(stub_bin: Path, tmp_path: Path) -> None:
    """vLLM must be PID 1's successor, not a child: Cloud Run's SIGTERM has to reach it."""
    model = _model(tmp_path / "merged")
    done, _ = _run([str(model)], stub_bin, tmp_path)
    assert done.returncode == 0
    # exec: the stub's parent is this test process, not an intermediate bash
    assert int((tmp_path / "vllm-args.txt.ppid").read_text()) == os.getpid()


def test_refuses_a_model_without_the_marker(stub_bin: Path, tmp_path: Path) -> None:
    model = _model(tmp_path / "merged", complete=False)
    done, recorded = _run([str(model), "--port", "8000"], stub_bin, tmp_path)
    assert done.returncode != 0
    assert recorded is None, "vllm must not start"
    assert (
        f"model at {model} is not complete (no {COMPLETION_MARKER}): training has not finished or failed" in done.stderr
    )
    assert "serving/README.md" in done.stderr


def test_refuses_a_missing_folder(stub_bin: Path, tmp_path: Path) -> None:
    done, recorded = _run([str(tmp_path / "nowhere")], stub_bin, tmp_path)
    assert done.returncode != 0 and recorded is None
    assert "does not exist" in done.stderr and "bucket is not mounted" in done.stderr


def test_model_flag_forms(stub_bin: Path, tmp_path: Path) -> None:
    incomplete = _model(tmp_path / "merged", complete=False)
    for args in (["--model", str(incomplete)], [f"--model={incomplete}"]):
        done, recorded = _run(args, stub_bin, tmp_path)
        assert done.returncode != 0 and recorded is None, args


def test_hub_ids_are_not_checked(stub_bin: Path, tmp_path: Path) -> None:
    done, recorded = _run(["google/gemma-3-1b-it"], stub_bin, tmp_path)
    assert done.returncode == 0
    assert recorded == ["serve", "google/gemma-3-1b-it"]
    assert "not a local folder" in done.stderr


class TestLoraAdapters:
    def _args(self, base: Path, adapters: dict[str, str]) -> list[str]:
        return render_args(VllmServerConfig(model=str(base), lora_modules=adapters, max_lora_rank=8))

    def test_checks_every_adapter(self, stub_bin: Path, tmp_path: Path) -> None:
        base = _model(tmp_path / "base")
        good = _model(tmp_path / "emoji", adapter=True)
        bad = _model(tmp_path / "sql", complete=False, adapter=True)
        done, recorded = _run(self._args(base, {"emoji": str(good), "sql": str(bad)}), stub_bin, tmp_path)
        assert done.returncode != 0 and recorded is None
        assert f"LoRA adapter at {bad} is not complete" in done.stderr

    def test_all_complete_starts(self, stub_bin: Path, tmp_path: Path) -> None:
        base = _model(tmp_path / "base")
        a = _model(tmp_path / "emoji", adapter=True)
        b = _model(tmp_path / "sql", adapter=True)
        args = self._args(base, {"emoji": str(a), "sql": str(b)})
        done, recorded = _run(args, stub_bin, tmp_path)
        assert done.returncode == 0, done.stderr
        assert recorded == ["serve", *args]

    def test_adapter_needs_adapter_config(self, stub_bin: Path, tmp_path: Path) -> None:
        base = _model(tmp_path / "base")
        not_adapter = _model(tmp_path / "emoji")  # a model folder, not an adapter
        done, recorded = _run(self._args(base, {"emoji": str(not_adapter)}), stub_bin, tmp_path)
        assert done.returncode != 0 and recorded is None
        assert "no adapter_config.json" in done.stderr

    def test_json_form(self, stub_bin: Path, tmp_path: Path) -> None:
        base = _model(tmp_path / "base")
        bad = _model(tmp_path / "emoji", complete=False, adapter=True)
        item = json.dumps({"name": "emoji", "path": str(bad), "base_model_name": "gemma"})
        done, recorded = _run([str(base), "--enable-lora", "--lora-modules", item], stub_bin, tmp_path)
        assert done.returncode != 0 and recorded is None
        assert f"LoRA adapter at {bad} is not complete" in done.stderr


def test_waits_for_the_marker(stub_bin: Path, tmp_path: Path) -> None:
    """With GEMMA_FT_WAIT_FOR_MODEL_S the entrypoint polls, so a service started just before the export ends still comes up."""
    model = _model(tmp_path / "merged", complete=False)
    record = tmp_path / "vllm-args.txt"
    env = {**os.environ, "PATH": f"{stub_bin}{os.pathsep}{os.environ['PATH']}", "VLLM_ARGS_FILE": str(record)}
    env["GEMMA_FT_WAIT_FOR_MODEL_S"] = "20"
    proc = subprocess.Popen(["bash", str(ENTRYPOINT), str(model)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        write_completion_marker(model, base_model="test", adapter=None)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert record.read_text().splitlines() == ["serve", str(model)]


def test_rejects_a_bad_wait_value(stub_bin: Path, tmp_path: Path) -> None:
    model = _model(tmp_path / "merged")
    done, recorded = _run([str(model)], stub_bin, tmp_path, GEMMA_FT_WAIT_FOR_MODEL_S="soon")
    assert done.returncode != 0 and recorded is None
    assert "not a whole number" in done.stderr


def test_no_model(stub_bin: Path, tmp_path: Path) -> None:
    done, recorded = _run(["--port", "8000"], stub_bin, tmp_path)
    assert done.returncode != 0 and recorded is None
    assert "no model given" in done.stderr


def test_marker_constant_matches_python() -> None:
    match = re.search(r'^COMPLETION_MARKER="([^"]+)"$', ENTRYPOINT.read_text(), re.MULTILINE)
    assert match and match.group(1) == COMPLETION_MARKER


@pytest.fixture(scope="module")
def real_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder written by the real `trainer.export.merge_and_export` (tiny Gemma 3 + a LoRA adapter)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import build_tiny_gemma
    from trainer.export import merge_and_export

    root = tmp_path_factory.mktemp("export")
    base = build_tiny_gemma(root / "base", marker=False)
    adapter = root / "adapter"
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(target_modules=["q_proj"]))
    peft_model.save_pretrained(adapter)
    return merge_and_export(str(base), adapter, root / "merged")


class TestOneDefinitionOfComplete:
    """The entrypoint runs serving/completion.py: the marker AND the inventory the trainer wrote, files readable."""

    @pytest.mark.slow  # the real merge_and_export of a tiny model (module fixture)
    def test_a_real_export_is_served(self, real_export: Path, stub_bin: Path, tmp_path: Path) -> None:
        done, recorded = _run([str(real_export), "--port", "8000"], stub_bin, tmp_path)
        assert done.returncode == 0, done.stderr
        assert recorded == ["serve", str(real_export), "--port", "8000"]

    @pytest.mark.slow  # the real merge_and_export of a tiny model (module fixture)
    def test_export_files_are_readable_by_the_image_user(self, real_export: Path) -> None:
        """safetensors saves 0600; the serving image runs as uid 2000 (gid 0), so the export makes every file a+r."""
        modes = {p.name: p.stat().st_mode & 0o777 for p in real_export.iterdir()}
        assert modes["model.safetensors"] & 0o044 == 0o044, oct(modes["model.safetensors"])
        assert all(mode & 0o444 == 0o444 for mode in modes.values()), {k: oct(v) for k, v in modes.items()}

    @pytest.mark.slow
    @pytest.mark.parametrize("damage", ["truncate", "delete", "drop_inventory"])
    def test_a_marker_that_no_longer_matches_is_refused(
        self, real_export: Path, stub_bin: Path, tmp_path: Path, damage: str
    ) -> None:
        import shutil

        copy = tmp_path / "merged"
        shutil.copytree(real_export, copy)
        if damage == "truncate":  # an interrupted copy into the bucket
            with open(copy / "model.safetensors", "r+b") as f:
                f.truncate(100)
            expected = "does not match _COMPLETE.json: model.safetensors (100 bytes"
        elif damage == "delete":
            (copy / "tokenizer.json").unlink()
            expected = "listed in _COMPLETE.json are missing (tokenizer.json)"
        else:  # a marker from something other than this trainer's export
            (copy / COMPLETION_MARKER).write_text(json.dumps({"status": "complete"}))
            expected = "lists no files"
        done, recorded = _run([str(copy)], stub_bin, tmp_path)
        assert done.returncode == 3 and recorded is None, done.stderr
        assert expected in done.stderr

    @pytest.mark.slow  # the real merge_and_export of a tiny model (module fixture)
    def test_unreadable_weights_are_refused_before_vllm(self, real_export: Path, tmp_path: Path) -> None:
        """Run the check as an unprivileged uid (root reads anything) on a 0600 copy of the weights."""
        import shutil
        import tempfile

        from serving.completion import verify

        shared = Path(tempfile.mkdtemp(dir="/tmp", prefix="gemma-readable-"))
        try:
            shared.chmod(0o755)
            copy = shared / "merged"
            shutil.copytree(real_export, copy)
            copy.chmod(0o755)
            (copy / "model.safetensors").chmod(0o600)  # what safetensors leaves without make_readable
            assert "not readable by uid 65534" in in_child_as_nobody(lambda: verify(copy))
            (copy / "model.safetensors").chmod(0o644)
            assert in_child_as_nobody(lambda: verify(copy)) == "ok"
        finally:
            shutil.rmtree(shared, ignore_errors=True)

    def test_every_json_lora_path_is_checked(self, stub_bin: Path, tmp_path: Path) -> None:
        """vLLM's JSON form; a JSON list with several adapters must not be reduced to its last path."""
        base = _model(tmp_path / "base")
        bad = _model(tmp_path / "bad", complete=False, adapter=True)
        good = _model(tmp_path / "good", adapter=True)
        item = json.dumps([{"name": "a", "path": str(bad)}, {"name": "b", "path": str(good)}])
        done, recorded = _run([str(base), "--enable-lora", "--lora-modules", item], stub_bin, tmp_path)
        assert done.returncode == 3 and recorded is None
        assert f"LoRA adapter at {bad} is not complete" in done.stderr


def _service_env() -> dict[str, str]:
    """The plain environment the Pulumi program gives the vLLM container (stack dev, serving on)."""
    from infra.offline.engine import run_stack
    from tests.infra.conftest import PREBUILT

    run = run_stack("dev", overrides={**PREBUILT, "servingEnabled": True}, assume_trained=True)
    service = run.one("gcp:cloudrunv2/service:Service").plain_inputs()
    return {e["name"]: e["value"] for e in service["template"]["containers"][0]["envs"] if "value" in e}


class TestStartupWindow:
    """One rule for the marker wait, serving/startup.py's: vLLM keeps MIN_VLLM_BUDGET_S of the window."""

    def test_under_the_services_env_the_entrypoint_applies_startup_py(self, stub_bin: Path, tmp_path: Path) -> None:
        """A wait that leaves vLLM less than startup.py requires is refused by the container, not only by Python.

        The entrypoint used to allow any wait shorter than the window (479 s of 480 left vLLM 1 s).
        """
        from serving.startup import MIN_VLLM_BUDGET_S, STARTUP_WINDOW

        env = _service_env()
        longest = STARTUP_WINDOW.total_s - MIN_VLLM_BUDGET_S
        model = _model(tmp_path / "merged")
        done, recorded = _run(
            [str(model)], stub_bin, tmp_path, **{**env, "GEMMA_FT_WAIT_FOR_MODEL_S": str(longest + 1)}
        )
        assert done.returncode == 3 and recorded is None, done.stderr
        assert f"longer than the {longest} s the startup window of {STARTUP_WINDOW.total_s} s allows" in done.stderr
        done, recorded = _run([str(model)], stub_bin, tmp_path, **{**env, "GEMMA_FT_WAIT_FOR_MODEL_S": str(longest)})
        assert done.returncode == 0 and recorded == ["serve", str(model)], done.stderr
        assert env["GEMMA_FT_WAIT_FOR_MODEL_S"] == "0", "the service itself never waits (its run is complete)"

    def test_the_window_is_announced(self, stub_bin: Path, tmp_path: Path) -> None:
        model = _model(tmp_path / "merged")
        done, _ = _run(
            [str(model)],
            stub_bin,
            tmp_path,
            GEMMA_FT_WAIT_FOR_MODEL_S="60",
            GEMMA_FT_STARTUP_WINDOW_S="480",
            GEMMA_FT_MAX_MARKER_WAIT_S="360",
        )
        assert done.returncode == 0, done.stderr
        assert "startup window 480 s: up to 60 s waiting" in done.stderr


class TestMiddlewareAndKey:
    """The guard is imported before vLLM starts, and a key without the guard is refused (a hand `docker run`)."""

    REPO = Path(__file__).resolve().parents[2]

    def _env(self, **extra: str) -> dict[str, str]:
        # the interpreter of this test run (it has starlette, as the vLLM image does); the repo root stands for
        # /opt/gemma-serving, where serving/Dockerfile copies the guard
        return {"PYTHON": sys.executable, "PYTHONPATH": str(self.REPO), **extra}

    def test_the_rendered_guard_is_imported_and_vllm_starts(self, stub_bin: Path, tmp_path: Path) -> None:
        model = _model(tmp_path / "merged")
        args = render_args(VllmServerConfig(model=str(model), api_key_guard=True))
        assert API_KEY_GUARD_MIDDLEWARE in args
        done, recorded = _run(args, stub_bin, tmp_path, **self._env(VLLM_API_KEY="sk-not-a-real-key"))
        assert done.returncode == 0, done.stderr
        assert recorded == ["serve", *args]

    @pytest.mark.parametrize("form", ["split", "equals"])
    def test_a_middleware_that_cannot_be_imported_stops_before_vllm(
        self, form: str, stub_bin: Path, tmp_path: Path
    ) -> None:
        """vLLM imports --middleware only after the engine loaded the model; the entrypoint fails first."""
        model = _model(tmp_path / "merged")
        missing = "serving.not_in_this_image.Guard"
        mw = ["--middleware", missing] if form == "split" else [f"--middleware={missing}"]
        done, recorded = _run([str(model), *mw], stub_bin, tmp_path, **self._env())
        assert done.returncode == 3 and recorded is None, done.stderr
        assert f"--middleware {missing} cannot be imported" in done.stderr
        assert "No module named 'serving.not_in_this_image'" in done.stderr and "serving/Dockerfile" in done.stderr

    def test_a_guard_missing_from_the_image_stops_before_vllm(self, stub_bin: Path, tmp_path: Path) -> None:
        """An image built without serving/api_key_guard.py on PYTHONPATH (here: an empty PYTHONPATH elsewhere)."""
        model = _model(tmp_path / "merged")
        args = render_args(VllmServerConfig(model=str(model), api_key_guard=True))
        empty = tmp_path / "site"
        empty.mkdir()
        env = {"PYTHON": sys.executable, "PYTHONPATH": str(empty), "VLLM_API_KEY": "sk-not-a-real-key"}
        done, recorded = (
            subprocess.run(
                ["bash", str(ENTRYPOINT), *args],
                capture_output=True,
                text=True,
                cwd=empty,  # the repository is not the working directory either
                env={
                    **os.environ,
                    "PATH": f"{stub_bin}{os.pathsep}{os.environ['PATH']}",
                    "VLLM_ARGS_FILE": str(tmp_path / "rec.txt"),
                    **env,
                },
                timeout=30,
                check=False,
            ),
            (tmp_path / "rec.txt").exists(),
        )
        assert done.returncode == 3 and recorded is False, done.stderr
        assert f"--middleware {API_KEY_GUARD_MIDDLEWARE} cannot be imported" in done.stderr

    @pytest.mark.parametrize("extra", [[], ["--middleware", "some.Other"]])
    def test_a_key_without_the_guard_is_refused(self, extra: list[str], stub_bin: Path, tmp_path: Path) -> None:
        model = _model(tmp_path / "merged")
        done, recorded = _run([str(model), *extra], stub_bin, tmp_path, **self._env(VLLM_API_KEY="sk-not-a-real-key"))
        assert done.returncode == 3 and recorded is None, done.stderr
        assert f"Add: --middleware {API_KEY_GUARD_MIDDLEWARE}" in done.stderr
        assert "sk-not-a-real-key" not in done.stderr + done.stdout, "the key is never printed"

    def test_no_key_and_no_middleware_starts_as_before(self, stub_bin: Path, tmp_path: Path) -> None:
        model = _model(tmp_path / "merged")
        done, recorded = _run([str(model)], stub_bin, tmp_path, **self._env(VLLM_API_KEY=""))
        assert done.returncode == 0 and recorded == ["serve", str(model)], done.stderr


class TestStreamedBase:
    """A base read from gs:// (the adapter stacks) needs the Run:ai streamer in the image: checked before vLLM starts."""

    def args(self, tmp_path: Path) -> list[str]:
        adapter = _model(tmp_path / "adapter", adapter=True)
        return render_args(
            VllmServerConfig(
                model="gs://bucket/runs/r/_base/google--gemma-4-31B-it@main",
                load_format="runai_streamer",
                lora_modules={"sql": str(adapter)},
            )
        )

    def test_an_image_without_the_streamer_stops_before_vllm(self, stub_bin: Path, tmp_path: Path) -> None:
        done, recorded = _run(self.args(tmp_path), stub_bin, tmp_path)  # this venv has no Run:ai streamer
        assert done.returncode == 3 and recorded is None
        assert "Run:ai streamer cannot be imported" in done.stderr and "runai-model-streamer-gcs" in done.stderr
        assert "LoRA adapter at" in done.stderr and "is complete" in done.stderr, "the adapter was checked first"

    def test_with_the_streamer_vllm_gets_the_args(self, stub_bin: Path, tmp_path: Path) -> None:
        modules = tmp_path / "site"
        for name in ("runai_model_streamer", "runai_model_streamer_gcs"):
            (modules / name).mkdir(parents=True)
            (modules / name / "__init__.py").write_text("")
        args = self.args(tmp_path)
        done, recorded = _run(args, stub_bin, tmp_path, PYTHONPATH=str(modules))
        assert done.returncode == 0, done.stderr
        assert recorded == ["serve", *args]
        assert "is not a local folder; vLLM will fetch it" in done.stderr
