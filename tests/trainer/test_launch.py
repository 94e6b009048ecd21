"""`python -m trainer.launch`: recipe + model config in, accelerate config + command out.

Why it matters: the GKE Job runs this on every node. The node rank must come from the
Indexed Job's JOB_COMPLETION_INDEX, num_processes must count every GPU of every node, and the
wrap class must be read from the recipe's model, or the run shards wrongly or hangs at the
rendezvous.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer import launch
from trainer.recipe import RecipeError

REPO = Path(__file__).resolve().parents[2]
RECIPE = "text-to-sql-gemma4-31b"


@pytest.fixture(scope="module")
def gemma4_model_dir(tmp_path_factory) -> Path:
    """A folder with only a tiny Gemma 4 config.json: all AutoConfig.from_pretrained needs."""
    from tests.tiny_models import gemma4_config

    directory = tmp_path_factory.mktemp("gemma4-config")
    gemma4_config(64).save_pretrained(directory)
    return directory


def make_plan(model_dir: Path, tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> launch.LaunchPlan:
    args = launch.parse_args(
        [
            "--recipe",
            RECIPE,
            "--set",
            f"model.name_or_path={model_dir}",
            "--config-out",
            str(tmp_path / "accelerate.yaml"),
            *argv,
        ]
    )
    return launch.plan(args, env=env or {})


class TestPlan:
    def test_single_node(self, gemma4_model_dir, tmp_path):
        p = make_plan(gemma4_model_dir, tmp_path, "--nproc-per-node", "8", "--set", "distributed.strategy=fsdp")
        assert p.config["num_processes"] == 8 and p.config["machine_rank"] == 0
        assert p.config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "Gemma4TextDecoderLayer"
        assert p.config["fsdp_config"]["fsdp_version"] == 2
        assert yaml.safe_load(p.config_path.read_text()) == p.config

    def test_command_runs_the_trainer_module_with_the_same_recipe_and_overrides(self, gemma4_model_dir, tmp_path):
        p = make_plan(gemma4_model_dir, tmp_path, "--nproc-per-node", "8", "--set", "training.max_steps=5")
        cmd = p.command
        assert cmd[cmd.index("--config_file") + 1] == str(p.config_path)
        assert cmd[1] == "launch" or cmd[1:3] == ["-m", "accelerate.commands.launch"]
        module_flag = cmd.index("-m", cmd.index("--config_file"))
        assert cmd[module_flag + 1] == "trainer" and cmd[cmd.index("--recipe") + 1] == RECIPE
        sets = [cmd[i + 1] for i, part in enumerate(cmd) if part == "--set"]
        assert sets == [f"model.name_or_path={gemma4_model_dir}", "training.max_steps=5"]

    def test_multi_node_rank_from_indexed_job(self, gemma4_model_dir, tmp_path):
        env = {"JOB_COMPLETION_INDEX": "1"}
        p = make_plan(
            gemma4_model_dir, tmp_path, "--nproc-per-node", "8", "--nnodes", "2", "--main-process-ip", "job-0.svc",
            "--set", "distributed.world_size=16", env=env,
        )  # fmt: skip
        c = p.config
        assert (c["num_processes"], c["num_machines"], c["machine_rank"]) == (16, 2, 1)
        assert c["main_process_ip"] == "job-0.svc" and c["main_process_port"] == 29500

    def test_cli_rank_and_master_env(self, gemma4_model_dir, tmp_path):
        env = {"JOB_COMPLETION_INDEX": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "23456"}
        p = make_plan(gemma4_model_dir, tmp_path, "--num-processes", "32", "--nnodes", "4", "--node-rank", "3",
                      # sized for 32 ranks as the world-size check says: GA 16 x 8 / 32 keeps the sequences per update
                      "--set", "distributed.world_size=32", "--set", "training.gradient_accumulation_steps=4",
                      env=env)  # fmt: skip
        c = p.config
        assert (c["num_processes"], c["machine_rank"], c["main_process_ip"], c["main_process_port"]) == (
            32,
            3,
            "10.0.0.5",
            23456,
        )

    def test_mixed_precision_follows_the_recipe_dtype(self, gemma4_model_dir, tmp_path):
        p = make_plan(
            gemma4_model_dir, tmp_path, "--nproc-per-node", "2", "--set", "model.dtype=float32",
            "--set", "distributed.world_size=2",
        )  # fmt: skip
        assert p.config["mixed_precision"] == "no"

    def test_cpu_processes_get_accelerates_cpu_switch(self, gemma4_model_dir, tmp_path):
        """accelerate's multi-process launcher does not pass `use_cpu` on: the launcher exports the variable."""
        four = ("--set", "distributed.world_size=4")
        p = make_plan(gemma4_model_dir, tmp_path, "--nproc-per-node", "4", "--cpu", *four)
        shutdown = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3600"}  # torchrun waits for a SIGTERM's checkpoint
        assert p.config["use_cpu"] is True and p.env == {"ACCELERATE_USE_CPU": "true", **shutdown}
        assert "ACCELERATE_USE_CPU=true" in p.render()
        gpu = make_plan(gemma4_model_dir, tmp_path, "--nproc-per-node", "4", *four)
        assert gpu.config["use_cpu"] is False and gpu.env == shutdown

    def test_no_fsdp_recipe_renders_data_parallel(self, tmp_path):
        argv = ["--recipe", "emoji-gemma3-1b", "--nproc-per-node", "4", "--set", "distributed.world_size=4"]
        args = launch.parse_args([*argv, "--config-out", str(tmp_path / "a.yaml")])
        p = launch.plan(args, env={})  # no model config needed: nothing to wrap
        assert p.config["distributed_type"] == "MULTI_GPU" and "fsdp_config" not in p.config

    @pytest.mark.parametrize(
        ("argv", "env"),
        [
            (["--num-processes", "9", "--nnodes", "2", "--main-process-ip", "h"], {}),
            (["--nproc-per-node", "8"], {"JOB_COMPLETION_INDEX": "zero"}),
        ],
    )
    def test_bad_settings_fail_with_a_message(self, gemma4_model_dir, tmp_path, argv, env):
        with pytest.raises(RecipeError):
            make_plan(gemma4_model_dir, tmp_path, *argv, env=env)


@pytest.mark.slow
def test_cli_dry_run(gemma4_model_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "JOB_COMPLETION_INDEX": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable, "-m", "trainer.launch", "--recipe", RECIPE, "--nproc-per-node", "8", "--nnodes", "2",
        "--main-process-ip", "job-0.svc", "--set", f"model.name_or_path={gemma4_model_dir}",
        "--set", "distributed.world_size=16", "--set", "distributed.strategy=fsdp",
        "--config-out", str(tmp_path / "acc.yaml"), "--dry-run",
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    config = yaml.safe_load((tmp_path / "acc.yaml").read_text())
    assert config["machine_rank"] == 1 and config["num_processes"] == 16
    assert "fsdp_transformer_layer_cls_to_wrap: Gemma4TextDecoderLayer" in done.stdout
    assert "launch --config_file" in done.stdout and "-m trainer --recipe text-to-sql-gemma4-31b" in done.stdout


@pytest.mark.slow
def test_cli_missing_model_fails_cleanly(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable, "-m", "trainer.launch", "--recipe", RECIPE, "--nproc-per-node", "8",
        "--set", f"model.name_or_path={tmp_path / 'missing'}", "--dry-run",
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error:"), done.stderr[-2000:]
