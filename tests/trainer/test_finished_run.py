"""A finished run is never trained again: both entry points exit 0 before loading anything.

Why it matters: `ttlSecondsAfterFinished` removes a finished a4-gemma4 Job; after a `pulumi refresh`
the next `pulumi up` creates it again with the same run directory. Without this check the new Job
provisions an A4 node, downloads 31B, resumes at the last step and exports again.

The run directory is a `file://` "bucket" holding the run marker the trainer writes last. The
recipe names a model folder and a data file that do not exist: any attempt to load a model, a
tokenizer, a model config or the data would fail, and so would the recipe's run checks, which count
the data file's rows. Exit code 0 shows none of them ran. The same commands without the marker fail
at the run checks, which shows that an unfinished run is still checked against its data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.checkpoints import RUN_MARKER, OutputLocation

REPO = Path(__file__).resolve().parents[2]
RECIPE = "text-to-sql-gemma4-31b"
SUMMARY = {"recipe": RECIPE, "steps": 42, "final_train_loss": 0.5}


def nothing_to_load(tmp_path: Path, url: str) -> list[str]:
    return [
        "--set",
        f"model.name_or_path={tmp_path / 'no-model'}",
        "--set",
        "data.source=local",
        "--set",
        f"data.path={tmp_path / 'no-rows.jsonl'}",
        "--set",
        f"output.dir={url}",
    ]


def run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "GEMMA_FT_STAGING": str(tmp_path / "staging")}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def finished_url(tmp_path: Path) -> str:
    """A bucket folder holding a finished run, marked the way the trainer marks it."""
    url = f"file://{tmp_path / 'bucket' / 'finished'}"
    location = OutputLocation.from_dir(url, staging_root=tmp_path / "first-machine")
    location.local.mkdir(parents=True)
    location.mark_run_complete(
        {"recipe": RECIPE, "adapter_dir": f"{url}/adapter", "merged_dir": None, "summary": SUMMARY}
    )
    assert (tmp_path / "bucket" / "finished" / RUN_MARKER).is_file()
    return url


@pytest.mark.parametrize("entry", ["trainer", "trainer.launch"])
def test_the_marker_is_read_before_the_run_checks_read_the_data(
    entry: str, tmp_path: Path, finished_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In process (fast): the order of the two checks at both entry points; the data check stays for a run that is
    not finished."""
    import trainer.__main__
    import trainer.launch

    main = trainer.__main__.run if entry == "trainer" else trainer.launch.main
    head = ["--recipe", RECIPE]
    if entry == "trainer.launch":
        head += ["--nproc-per-node", "8", "--config-out", str(tmp_path / "accelerate.yaml")]
    assert main([*head, *nothing_to_load(tmp_path, finished_url)]) == 0, capsys.readouterr().err
    said = "already holds a finished run" if entry == "trainer.launch" else f"adapter: {finished_url}/adapter"
    assert said in capsys.readouterr().out

    assert main([*head, *nothing_to_load(tmp_path, f"{finished_url}-not")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error:") and f"data.path='{tmp_path / 'no-rows.jsonl'}': no such file" in error, error


@pytest.mark.slow
def test_trainer_entry_point_exits_at_once_on_a_finished_run(tmp_path: Path, finished_url: str) -> None:
    done = run(["-m", "trainer", "--recipe", RECIPE, *nothing_to_load(tmp_path, finished_url)], tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "already holds a finished run" in done.stderr
    summary = json.loads(done.stdout[: done.stdout.rindex("}") + 1])
    assert summary == SUMMARY
    assert f"adapter: {finished_url}/adapter" in done.stdout

    fresh = run(["-m", "trainer", "--recipe", RECIPE, *nothing_to_load(tmp_path, f"{finished_url}-not")], tmp_path)
    assert fresh.returncode != 0, "without the marker the same command must try to load the missing model"


@pytest.mark.slow
def test_launcher_launches_nothing_for_a_finished_run(tmp_path: Path, finished_url: str) -> None:
    config = tmp_path / "accelerate.yaml"
    launch = ["-m", "trainer.launch", "--recipe", RECIPE, "--nproc-per-node", "8", "--config-out", str(config)]
    done = run([*launch, *nothing_to_load(tmp_path, finished_url)], tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "already holds a finished run" in done.stdout
    assert not config.exists(), "an accelerate config was rendered: the model config was read"

    fresh = run([*launch, *nothing_to_load(tmp_path, f"{finished_url}-not")], tmp_path)
    assert fresh.returncode == 2 and fresh.stderr.startswith("error:"), fresh.stderr[-2000:]
