"""A recipe runs only on the number of ranks it is sized for, at every entry point that starts ranks.

Why it matters: `distributed.world_size` is what the recipe's optimisation is computed for (W1: 1 packed
row x 16 accumulation x 8 ranks = 128 rows per update; W2: 1 x 4 x 16 workers = 64, as its seed).
Nothing compared it with the processes actually started: a4-gemma4 with `nodes: 2` trained 256 rows
per update and half the updates, and `python -m trainer` on the W1 recipe trained 16 per update, both
silently. Each entry point is called as the platform calls it and must refuse before anything loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.recipe import RecipeError, load_recipe, world_size_problem

W1 = "text-to-sql-gemma4-31b"
W2 = "product-descriptions-gemma3-4b"


def test_the_message_names_the_key_the_counts_and_the_fix() -> None:
    problem = world_size_problem(load_recipe(W1), 16, "this launch (--nproc-per-node 8 x --nnodes 2)")
    assert problem is not None
    assert "distributed.world_size=8 but this launch (--nproc-per-node 8 x --nnodes 2) starts 16" in problem
    assert "128 sequences per update" in problem and "256 per update" in problem
    assert "--set distributed.world_size=16" in problem and "gradient_accumulation_steps by 8/16" in problem
    assert world_size_problem(load_recipe(W1), 8, "x") is None


def test_launcher_refuses_a_process_count_the_recipe_is_not_sized_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m trainer.launch` as the a4-gemma4 Job runs it (here with --dry-run): 2 nodes x 8 for an 8-rank
    recipe exit 2 before the model config is read or an accelerate config is written."""
    from trainer import launch

    config = tmp_path / "accelerate.yaml"
    argv = ["--recipe", W1, "--nproc-per-node", "8", "--nnodes", "2", "--main-process-ip", "job-0.svc"]
    argv += ["--set", f"model.name_or_path={tmp_path / 'no-model'}", "--config-out", str(config), "--dry-run"]
    assert launch.main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: distributed.world_size=8 but this launch (--nproc-per-node 8 x --nnodes 2)")
    assert "--set distributed.world_size=16" in error
    assert not config.exists()


def test_ray_driver_refuses_a_worker_count_the_recipe_is_not_sized_for() -> None:
    """`python -m trainer.ray_entry` as the RayJob submits it, with 8 workers for the 16-worker W2 recipe: the
    driver's first step (`run` builds the TorchTrainer, then fits it) refuses, so Ray Train never starts
    (`main` prints the message and exits 2)."""
    from trainer.ray_entry import build_torch_trainer, parse_args

    argv = ["--recipe", W2, "--num-workers", "8", "--use-gpu", "--storage-path", "/nonexistent/ray"]
    with pytest.raises(RecipeError) as info:
        build_torch_trainer(parse_args(argv, env={}))
    assert str(info.value).startswith("distributed.world_size=16 but --num-workers 8 starts 8")
    assert "--set distributed.world_size=8" in str(info.value)
    build_torch_trainer(parse_args([*argv, "--set", "distributed.world_size=8"], env={}))  # re-sized: accepted


def test_single_process_run_of_an_eight_rank_recipe_stops_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m trainer` (no launcher: WORLD_SIZE unset) on the W1 recipe exits 2; the model does not exist, so
    any attempt to load it would fail with another error."""
    import trainer.__main__

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["--recipe", W1, "--set", f"model.name_or_path={tmp_path / 'no-model'}"]
    argv += ["--set", f"output.dir={tmp_path / 'run'}"]
    assert trainer.__main__.run(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: distributed.world_size=8 but this run starts 1 data-parallel processes"), error
    assert not (tmp_path / "run").exists()

    # as one of torchrun's 8 ranks the same run gets past the check (and then fails on the missing model)
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(Exception) as info:  # whatever loading the missing model raises
        trainer.__main__.run(argv)
    assert "world_size" not in str(info.value)
