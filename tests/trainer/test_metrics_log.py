"""The trainer's metric lines (trainer/metrics_log.py) against the log-based metrics every stack declares.

A real tiny run's stdout goes through what the platform and Cloud Logging do with it (infra/offline/log_metrics.py:
the agent's JSON parse, each metric's own filter and EXTRACT) with the filters and extractors the stacks declare
under mocks: every metric of every stack records a value, so a field renamed on either side fails here instead of
emptying a chart in the console.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerCallback, TrainerControl, TrainerState

from infra.offline.engine import StackRun, run_stack, stack_names
from infra.offline.log_metrics import Point, record, structured_entry, trainer_resource
from tests.trainer.test_training import tiny_recipe
from trainer import metrics_log
from trainer.cost_line import PRICE_FILE
from trainer.train import main

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
METRIC = "gcp:logging/metric:Metric"
PRICE = {
    "hourly_usd": 3600.0,  # a dollar a second: the cost moves visibly within a test's run
    "unit": "node",
    "units": 1,
    "gpus": 1,
    "nodes": 1,
    "capacity": "spot",
    "hardware": "test",
    "price_status": "test",
    "prices_as_of": "test",
}


@pytest.fixture(scope="module")
def stacks() -> dict[str, StackRun]:
    return {stack: run_stack(stack) for stack in stack_names()}


def metric_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("{") and f'"{metrics_log.EVENT}"' in line]


def recorded(run: StackRun, lines: list[str]) -> dict[str, list[Point]]:
    """What each log-based metric the stack declares records from these stdout lines of its trainer."""
    assert run.cfg is not None
    resource = trainer_resource(run.cfg)
    entries = [(float(i), structured_entry(line, resource)) for i, line in enumerate(lines)]
    return {metric.plain_inputs()["name"]: record(metric.plain_inputs(), entries) for metric in run.of_type(METRIC)}


def empty_metrics(stacks: dict[str, StackRun], lines: list[str]) -> list[str]:
    return [name for run in stacks.values() for name, points in recorded(run, lines).items() if not points]


class SlowStep(TrainerCallback):
    """Step 2 takes `seconds` longer: a collective or a data loader that waits."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == 1:
            time.sleep(self.seconds)
        return control


@pytest.fixture(scope="module")
def real_run(tiny_gemma3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 4-step run with an evaluation every 2 steps, the stack's price file in its folder, a heartbeat every
    0.1 s and one step that waits 1 s; the metric lines it wrote to stdout (where the platform collects them)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("metric-lines") / "runs" / "emoji-local-0123456789ab"
    out.mkdir(parents=True)
    (out / PRICE_FILE).write_text(json.dumps(PRICE))
    captured = io.StringIO()
    previous = metrics_log.HEARTBEAT_S
    metrics_log.HEARTBEAT_S = 0.1
    try:
        with contextlib.redirect_stdout(captured):
            main(tiny_recipe(tiny_gemma3_dir, out, "training.eval_steps=2"), callbacks=[SlowStep(1.0)])
    finally:
        metrics_log.HEARTBEAT_S = previous
    return {"lines": metric_lines(captured.getvalue()), "run": out.name, "threads": threading.enumerate()}


@pytest.mark.slow
class TestARealRunFeedsEveryMetric:
    def test_every_metric_of_every_stack_records_the_run(
        self, real_run: dict[str, Any], stacks: dict[str, StackRun]
    ) -> None:
        assert real_run["lines"], "the run wrote no metric line"
        assert empty_metrics(stacks, real_run["lines"]) == []
        for run in stacks.values():
            for name, points in recorded(run, real_run["lines"]).items():
                assert {p.labels["run"] for p in points} == {real_run["run"]}, name

    def test_the_values_are_the_runs(self, real_run: dict[str, Any], stacks: dict[str, StackRun]) -> None:
        points = recorded(stacks["dev"], real_run["lines"])
        assert [p.value for p in points["gft/dev/step"]] == [1, 2, 3, 4]
        assert all(0 < p.value < 20 for p in points["gft/dev/loss"])
        assert points["gft/dev/tokens_per_second"] and all(p.value > 0 for p in points["gft/dev/tokens_per_second"])
        costs = [p.value for p in points["gft/dev/cost_usd"]]
        assert costs == sorted(costs) and costs[-1] > 0, "a dollar a second: the cost grows with the run"
        assert points["gft/dev/eval_loss"] and points["gft/dev/base_eval_loss"]

    def test_the_heartbeat_reports_a_step_that_waits(
        self, real_run: dict[str, Any], stacks: dict[str, StackRun]
    ) -> None:
        """While step 2 waits (1 s), the heartbeat thread keeps writing, and what it reports grows past 0.5 s."""
        waits = [p.value for p in recorded(stacks["dev"], real_run["lines"])["gft/dev/since_step_s"]]
        assert max(waits) >= 0.5, waits

    def test_the_start_up_beats_before_the_first_step(self, real_run: dict[str, Any]) -> None:
        """Loading the model and building the trainer come before any step: the heartbeat already runs (a rank that
        never joins, a download that hangs, raise the stall alert too), naming the phase it is in."""
        events = [json.loads(line) for line in real_run["lines"]]
        first_train = next(i for i, e in enumerate(events) if e[metrics_log.EVENT] == "train")
        early = [e for e in events[:first_train] if e[metrics_log.EVENT] == "heartbeat"]
        assert early and early[0]["message"].startswith("starting: "), events[:first_train]
        assert all(e[metrics_log.STEP] == 0 for e in early)

    def test_no_heartbeat_outlives_the_run(self, real_run: dict[str, Any]) -> None:
        assert not [t for t in real_run["threads"] if t.name == "gft-metrics-heartbeat"]

    def test_a_renamed_field_empties_its_metric(self, real_run: dict[str, Any], stacks: dict[str, StackRun]) -> None:
        """The check can fail: the trainer writing `train_loss` instead of `loss` leaves every loss metric empty."""
        renamed = [line.replace('"loss":', '"train_loss":') for line in real_run["lines"]]
        assert sorted(empty_metrics(stacks, renamed)) == sorted(f"gft/{stack}/loss" for stack in stacks)


def _state(world_zero: bool, step: int = 3) -> TrainerState:
    state = TrainerState()
    state.is_world_process_zero = world_zero
    state.global_step = step
    state.max_steps = 10
    state.epoch = 0.3
    return state


def _drive(callback: Any, state: TrainerState) -> None:
    args, control = None, TrainerControl()  # the callback reads the state only
    callback.on_train_begin(args, state, control)
    callback.on_step_end(args, state, control)
    callback.on_log(args, state, control, logs={"loss": 1.5, "num_input_tokens_seen": 100})
    callback.on_evaluate(args, state, control, metrics={"eval_loss": 1.2})
    callback.on_train_end(args, state, control)


class TestOneLineForTheWholeRun:
    def test_only_world_rank_zero_writes(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        recipe = tiny_recipe(tmp_path, tmp_path / "run")
        _drive(metrics_log.metrics_log_callback(recipe, interval=60), _state(world_zero=False))
        assert metric_lines(capsys.readouterr().out) == []
        _drive(metrics_log.metrics_log_callback(recipe, interval=60), _state(world_zero=True))
        events = [json.loads(line)[metrics_log.EVENT] for line in metric_lines(capsys.readouterr().out)]
        assert sorted(events) == ["eval", "heartbeat", "train"]

    def test_without_a_price_file_no_cost_is_written(self, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
        _drive(metrics_log.metrics_log_callback(tiny_recipe(tmp_path, tmp_path / "run"), 60), _state(True))
        assert all(metrics_log.COST_USD not in json.loads(line) for line in metric_lines(capsys.readouterr().out))


class TestWhereTheLinesGo:
    """A Ray worker's stdout is a file of Ray's; in a pod the lines go to the container's own stdout."""

    def test_in_a_pod_to_the_containers_stdout(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        container = tmp_path / "container-stdout"
        container.write_text("")
        monkeypatch.setattr(metrics_log, "CONTAINER_STDOUT", str(container))
        monkeypatch.setattr(metrics_log, "_stream_path", None)
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.32.1")
        assert metrics_log.send_to_container_stdout() == str(container)
        _drive(metrics_log.metrics_log_callback(tiny_recipe(tmp_path, tmp_path / "run"), 60), _state(True))
        assert len(metric_lines(container.read_text())) == 3 and metric_lines(capsys.readouterr().out) == []

    def test_a_first_process_it_may_not_reach_leaves_the_lines_on_stdout(self) -> None:
        """/proc/1/fd/1 of a first process of another user (or with capabilities this one lacks) refuses even a
        stat with EACCES: the worker goes on, its lines on its own stdout. Run for real: in a process that cannot
        reach this machine's PID 1 (this one, or one dropped to `nobody`)."""
        import os
        import shutil
        import subprocess
        import sys

        drop: list[str] = []
        try:
            os.stat(metrics_log.CONTAINER_STDOUT)
        except PermissionError:
            pass  # this process already cannot reach it
        else:
            if os.geteuid() != 0 or shutil.which("setpriv") is None:
                pytest.skip("this process can reach PID 1's stdout and cannot drop to another user")
            drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        code = (
            "import os\n"
            "from trainer import metrics_log as m\n"
            "try:\n    os.stat(m.CONTAINER_STDOUT)\nexcept PermissionError:\n    print('refused')\n"
            "print('path', m.send_to_container_stdout())\n"
            'm._write(\'{"gft_event":"train"}\')\n'
        )
        env = {**os.environ, "KUBERNETES_SERVICE_HOST": "10.0.32.1", "PYTHONDONTWRITEBYTECODE": "1"}
        done = subprocess.run(
            [*drop, sys.executable, "-c", code], env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == ["refused", "path None", '{"gft_event":"train"}'], done.stdout

    def test_elsewhere_to_stdout(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        monkeypatch.setattr(metrics_log, "CONTAINER_STDOUT", str(tmp_path / "container-stdout"))
        monkeypatch.setattr(metrics_log, "_stream_path", None)
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        assert metrics_log.send_to_container_stdout() is None


@pytest.mark.slow
def test_the_ray_workers_vision_trainer_writes_them_too(
    tiny_gemma3_vision_dir: Path, tmp_path: Path, stacks: dict[str, StackRun], capsys: pytest.CaptureFixture[str]
) -> None:
    """The Ray stack's vision recipe builds its own SFTTrainer (trainer/ray_entry.py build_vision_trainer): its steps
    reach the Ray stack's training metrics the same way."""
    from tests.trainer.test_ray_entry import _recipe
    from trainer.checkpoints import OutputLocation
    from trainer.ray_entry import build_vision_trainer

    recipe = _recipe(tiny_gemma3_vision_dir, tmp_path / "out", "quantization=null", "training.max_steps=2")
    trainer, _ = build_vision_trainer(recipe, OutputLocation.from_dir(recipe.output.dir))
    trainer.train()
    points = recorded(stacks["ray-gemma3-vision"], metric_lines(capsys.readouterr().out))
    for key in ("loss", "step", "epoch", "tokens_per_second", "since_step_s", "elapsed_s"):
        assert points[f"gft/ray-gemma3-vision/{key}"], key


class TestStartupHeartbeat:
    """trainer/metrics_log.py `StartupHeartbeat`: from the process's start to the training loop, on world rank 0."""

    def test_a_phase_that_hangs_grows_and_the_next_phase_is_progress(
        self, capsys: pytest.CaptureFixture[str], tmp_path: Path
    ) -> None:
        beat = metrics_log.StartupHeartbeat(tiny_recipe(tmp_path, tmp_path / "run"), interval=0.05, enabled=True)
        try:
            beat.progress("wait_for_ranks")
            time.sleep(0.4)  # the other node never joins
            hung = [json.loads(line) for line in metric_lines(capsys.readouterr().out)]
            beat.progress("build_trainer")
            time.sleep(0.15)
        finally:
            beat.stop()
        after = [json.loads(line) for line in metric_lines(capsys.readouterr().out)]
        assert max(e[metrics_log.SINCE_STEP_S] for e in hung) >= 0.3, hung
        assert any(e["message"].startswith("starting: wait_for_ranks") for e in hung)
        assert after and all(e[metrics_log.SINCE_STEP_S] < 0.3 for e in after), after
        assert not [t for t in threading.enumerate() if t.name == "gft-metrics-heartbeat"]

    def test_only_world_rank_zero_beats(
        self, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("RANK", "3")
        beat = metrics_log.StartupHeartbeat(tiny_recipe(tmp_path, tmp_path / "run"), interval=0.05)
        time.sleep(0.15)
        beat.stop()
        assert metric_lines(capsys.readouterr().out) == []
