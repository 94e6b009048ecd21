"""The demo's decisions that need no model: output folder handling, early checks, options, the loss plot."""

from __future__ import annotations

import errno
import json
import socket
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest

from demo import pipeline as demo
from demo.pipeline import (
    DemoError,
    DemoOptions,
    PreviousRun,
    check_disk_space,
    check_port,
    plot_loss,
    prepare_output_dir,
)
from serving.vllm_args import COMPLETION_MARKER
from trainer.export import write_completion_marker


def _finished_training(output_dir: Path, steps: int) -> None:
    """What trainer.train.main leaves when it finished: a checkpoint, run_summary.json and a marked merged folder."""
    _checkpoint(output_dir, steps)
    state = {"log_history": [{"step": 5, "loss": 3.0}]}
    (output_dir / "checkpoints" / f"checkpoint-{steps}" / "trainer_state.json").write_text(json.dumps(state))
    (output_dir / "run_summary.json").write_text(json.dumps({"steps": steps}))
    (output_dir / "merged").mkdir()
    (output_dir / "merged" / "config.json").write_text("{}")
    write_completion_marker(output_dir / "merged", base_model="test", adapter=None)


def _checkpoint(output_dir: Path, step: int, complete: bool = True) -> None:
    from trainer.checkpoints import CHECKPOINT_MARKER

    ckpt = output_dir / "checkpoints" / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    if complete:
        (ckpt / CHECKPOINT_MARKER).write_text(json.dumps({"step": step}))


class TestOutputDir:
    """Continue an interrupted run, replace a finished one, and never delete what the demo did not make."""

    def test_new_folder(self, tmp_path: Path) -> None:
        out = tmp_path / "demo"
        assert prepare_output_dir(out, 30, fresh=False) == PreviousRun()
        assert (out / demo.DEMO_SENTINEL).exists()

    def test_interrupted_training_resumes(self, tmp_path: Path) -> None:
        out = tmp_path / "demo"
        prepare_output_dir(out, 30, fresh=False)
        _checkpoint(out, 15)
        _checkpoint(out, 20, complete=False)  # cut off while saving: not a checkpoint
        assert prepare_output_dir(out, 30, fresh=False) == PreviousRun(resume_step=15)
        assert (out / "checkpoints" / "checkpoint-15").exists()

    def test_finished_training_is_reused(self, tmp_path: Path) -> None:
        """Interrupted after the export (while scoring or serving): no need to train again."""
        out = tmp_path / "demo"
        prepare_output_dir(out, 30, fresh=False)
        _finished_training(out, 30)
        assert prepare_output_dir(out, 30, fresh=False) == PreviousRun(trained=True)
        result, history = demo.reuse_training(out)
        assert result.merged_dir == str(out / "merged") and result.summary["steps"] == 30
        assert history == [{"step": 5, "loss": 3.0}]

    def test_export_that_no_longer_matches_its_marker_is_not_reused(self, tmp_path: Path) -> None:
        """The demo uses the one definition of complete (serving/completion.py), not the marker's presence."""
        out = tmp_path / "demo"
        prepare_output_dir(out, 30, fresh=False)
        _finished_training(out, 30)
        (out / "merged" / "config.json").write_text('{"changed": true}')
        assert prepare_output_dir(out, 30, fresh=False) == PreviousRun()

    def test_half_written_export_is_not_reused(self, tmp_path: Path) -> None:
        out = tmp_path / "demo"
        prepare_output_dir(out, 30, fresh=False)
        _finished_training(out, 30)
        (out / "merged" / COMPLETION_MARKER).unlink()
        assert prepare_output_dir(out, 30, fresh=False) == PreviousRun()
        assert not (out / "merged").exists()

    def test_training_for_other_steps_is_not_reused(self, tmp_path: Path) -> None:
        out = tmp_path / "demo"
        prepare_output_dir(out, 30, fresh=False)
        _finished_training(out, 30)
        assert prepare_output_dir(out, 10, fresh=False) == PreviousRun()

    def test_fresh_starts_clean(self, tmp_path: Path) -> None:
        out = tmp_path / "demo"
        prepare_output_dir(out, 30, fresh=False)
        _checkpoint(out, 15)
        assert prepare_output_dir(out, 30, fresh=True) == PreviousRun()
        assert not (out / "checkpoints").exists()

    def test_finished_demo_is_replaced(self, tmp_path: Path) -> None:
        out = tmp_path / "demo"
        prepare_output_dir(out, 30, fresh=False)
        _finished_training(out, 30)
        (out / demo.DEMO_SUMMARY).write_text("{}")
        assert prepare_output_dir(out, 30, fresh=False) == PreviousRun()
        assert not (out / demo.DEMO_SUMMARY).exists()

    def test_checkpoint_past_max_steps_is_not_resumed(self, tmp_path: Path) -> None:
        out = tmp_path / "demo"
        prepare_output_dir(out, 30, fresh=False)
        _checkpoint(out, 30)
        assert prepare_output_dir(out, 10, fresh=False) == PreviousRun()

    def test_refuses_a_folder_it_did_not_make(self, tmp_path: Path) -> None:
        out = tmp_path / "mine"
        out.mkdir()
        (out / "thesis.tex").write_text("precious")
        with pytest.raises(DemoError, match="was not made by the demo"):
            prepare_output_dir(out, 30, fresh=True)
        assert (out / "thesis.tex").exists()

    def test_base_scores_are_reused_only_when_they_match(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        import trainer.evaluate

        recipe = demo.build_recipe(DemoOptions(tmp_path, 0, 2, 3))
        out = tmp_path / "eval_before.json"
        calls: list[int] = []

        def fake_evaluate(
            model_dir: Path, recipe: object, samples: int, out: Path, processing_class: object = None
        ) -> dict[str, object]:
            calls.append(samples)
            return {"model": str(model_dir), "samples": samples, "emoji_f1": 0.5}

        monkeypatch.setattr(trainer.evaluate, "evaluate", fake_evaluate)
        demo.score(tmp_path / "base", recipe, out, reuse=True)
        demo.score(tmp_path / "base", recipe, out, reuse=True)
        assert calls == [3], "the second call reuses the file"
        demo.score(tmp_path / "other", recipe, out, reuse=True)
        assert calls == [3, 3], "another model is scored again"

    def test_base_scores_are_cached_by_build_rows_and_generation_settings(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Why: a later demo run skips scoring the base model, but never reuses scores of other rows, settings or builds."""
        import trainer.evaluate
        from trainer.local_model import BUILD_MARKER

        base, cache = tmp_path / "base", tmp_path / "cache"
        base.mkdir()
        (base / BUILD_MARKER).write_text(json.dumps({"source": "gguf", "sha256": "a" * 64}))
        calls: list[tuple[int, int]] = []

        def fake_evaluate(
            model_dir: Path, recipe: Any, samples: int, out: Path, processing_class: object = None
        ) -> dict[str, object]:
            calls.append((samples, recipe.max_new_tokens))
            return {"model": str(model_dir), "samples": samples, "emoji_f1": 0.25 * len(calls)}

        monkeypatch.setattr(trainer.evaluate, "evaluate", fake_evaluate)

        def run(samples: int, run_dir: str, max_new_tokens: int | None = None) -> dict[str, object]:
            recipe = demo.build_recipe(DemoOptions(tmp_path / run_dir, 0, 2, samples))
            if max_new_tokens is not None:
                evaluation = recipe.evaluation.model_copy(update={"max_new_tokens": max_new_tokens})
                recipe = recipe.model_copy(update={"evaluation": evaluation})
            (tmp_path / run_dir).mkdir(exist_ok=True)
            return demo.score(base, recipe, tmp_path / run_dir / "eval_before.json", reuse=True, cache_dir=cache)

        first = run(3, "one")
        again = run(3, "two")  # another output folder: a later demo run
        assert calls == [(3, 16)] and again["emoji_f1"] == first["emoji_f1"], "the cached scores are reused"
        assert json.loads((tmp_path / "two" / "eval_before.json").read_text())["emoji_f1"] == first["emoji_f1"]
        run(4, "three")  # other held-out rows
        assert calls[-1] == (4, 16)
        run(3, "four", max_new_tokens=8)  # another generation budget
        assert calls[-1] == (3, 8)
        (base / BUILD_MARKER).write_text(json.dumps({"source": "gguf", "sha256": "b" * 64}))  # a rebuilt model
        run(3, "five")
        assert len(calls) == 4, calls
        run(3, "six")
        assert len(calls) == 4, "the rebuilt model's scores are cached in turn"


class TestEarlyChecks:
    def test_busy_port_before_training(self) -> None:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = holder.getsockname()[1]
            with pytest.raises(DemoError, match=f"port {port} on 127.0.0.1 is in use"):
                check_port(port)
            assert demo.main(["--port", str(port), "--output-dir", "/nonexistent/never-created"]) == 1
        check_port(0)  # 0: a free port is chosen later

    def test_low_disk_space(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        usage = namedtuple("usage", "total used free")
        monkeypatch.setattr(demo.shutil, "disk_usage", lambda _: usage(10**12, 10**12, 2 * 10**8))
        with pytest.raises(DemoError, match=r"only 0\.2 GB free on the disk holding .*needs about 1\.5 GB"):
            check_disk_space([tmp_path / "not" / "yet"], 1.5)

    def test_no_space_left_is_explained(self) -> None:
        err = demo._explain_os_error(OSError(errno.ENOSPC, "No space left on device"), "training")
        assert "no space left on device while training" in str(err)
        assert "resumes from the last complete checkpoint" in str(err)


class TestOptions:
    def test_flags(self) -> None:
        opts = demo._parse_args(["--max-steps", "3", "--eval-samples", "2", "--port", "0", "--output-dir", "/tmp/x"])
        assert opts == DemoOptions(Path("/tmp/x"), 0, 3, 2, False, 32)

    @pytest.mark.parametrize("argv", [["--max-steps", "0"], ["--eval-samples", "0"], ["--port", "70000"]])
    def test_bad_flags(self, argv: list[str]) -> None:
        with pytest.raises(SystemExit):
            demo._parse_args(argv)

    def test_recipe_overrides(self, tmp_path: Path) -> None:
        recipe = demo.build_recipe(DemoOptions(tmp_path, 0, 4, 3))
        assert recipe.name == "emoji-local"
        assert recipe.output.dir == str(tmp_path) and recipe.output.merge and not recipe.output.push_to_hub
        assert recipe.training.max_steps == 4 and recipe.training.save_steps == 2 and recipe.training.logging_steps == 1
        assert recipe.evaluation.max_samples == 3
        assert recipe.training.extra["disable_tqdm"] is False

    def test_default_steps_are_the_recipes(self, tmp_path: Path) -> None:
        from trainer.recipe import load_recipe

        recipe, original = demo.build_recipe(DemoOptions(tmp_path)), load_recipe("emoji-local")
        assert recipe.training.max_steps == original.training.max_steps
        assert recipe.training.learning_rate == original.training.learning_rate
        assert recipe.training.per_device_train_batch_size == original.training.per_device_train_batch_size


def test_loss_plot(tmp_path: Path) -> None:
    history = [{"step": s, "loss": 5.0 / s} for s in range(1, 6)] + [{"step": 5, "eval_loss": 1.2}]
    path = plot_loss(history, tmp_path / "loss.png", "test")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_loss([{"step": 1, "train_runtime": 3}], tmp_path / "none.png", "test") is None


def test_the_report_prices_the_run_on_each_stack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`make demo` ends with what its training wall time would cost on each stack's hardware (the one price table)."""
    from infra.offline.engine import stack_names

    result = demo.DemoResult(
        output_dir=tmp_path,
        base_model_dir=tmp_path,
        merged_dir=tmp_path / "merged",
        answer="🍌",
        response={},
        before={},
        after={},
        run_summary={"steps": 60, "wall_time_s": 3600.0},
        loss_curve=None,
    )
    demo.print_report(result, wall_s=4000)
    out = capsys.readouterr().out
    assert "Cost   : this training's 3600 s wall time on each stack's hardware" in out
    for stack in stack_names():
        assert f"  {stack}: about " in out, out
    assert "1.43 USD/h x 1 instance(s) x 1.00 h" in out  # dev: one L4 instance for the hour
