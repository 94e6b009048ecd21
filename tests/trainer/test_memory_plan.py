"""The per-GPU memory model in recipe validation: it picks W1's data-parallel strategy, the launcher renders
what it picked, and a strategy that does not fit is refused before any GPU is rented.

Why it matters: FSDP2 resharding after forward all-gathers W1's 62 GB frozen base twice per micro-step
(~150 ms of NVLink for ~100 ms of compute); the base fits on each 180 GB B200 beside the activations, so
replicating it (DDP over LoRA) moves only the adapters' gradients.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainer import launch, memory_plan
from trainer.recipe import RecipeError, load_recipe, resolve_strategy, step_plan

W1 = "text-to-sql-gemma4-31b"


def test_w1_auto_picks_ddp_on_b200_and_keeps_the_tokens_per_update() -> None:
    recipe = load_recipe(W1)
    assert (recipe.distributed.strategy, recipe.distributed.gpu) == ("auto", "b200")
    chosen = resolve_strategy(recipe)
    assert chosen.name == "ddp" and chosen.problem is None
    ddp, gathered, resharded = (chosen.estimates[s] for s in ("ddp", "fsdp-gathered", "fsdp"))
    assert ddp.fits and 110 < ddp.total_gb < 140, ddp.line()  # 61 GB of base + 48 GB of activations + the rest
    assert ddp.terms["frozen weights"] == pytest.approx(61.4, abs=0.2)
    assert resharded.total_gb < ddp.total_gb < gathered.total_gb  # ddp wins on traffic, not on memory
    plan = step_plan(recipe)
    assert plan.sequences_per_update * recipe.training.max_length == 131_072  # 128 packed rows of 1,024


def test_longer_rows_that_ddp_cannot_hold_fall_back_to_fsdp() -> None:
    """Same tokens per update (2,048-token rows x 8 accumulation): DDP and gathered FSDP no longer fit."""
    recipe = load_recipe(W1, ["training.max_length=2048", "training.gradient_accumulation_steps=8"])
    chosen = resolve_strategy(recipe)
    assert not chosen.estimates["ddp"].fits and not chosen.estimates["fsdp-gathered"].fits
    assert (chosen.name, chosen.reshard_after_forward) == ("fsdp", True)


def test_a_strategy_that_does_not_fit_is_refused_with_key_value_and_fix() -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(
            W1, ["distributed.strategy=ddp", "training.max_length=4096", "training.gradient_accumulation_steps=4"]
        )
    message = str(info.value)
    assert "distributed.strategy=ddp does not fit one b200 at training.max_length=4096" in message
    assert "activations 194" in message and "Fix:" in message and "gradient_checkpointing=true" in message
    with pytest.raises(RecipeError, match=r"fsdp_reshard_after_forward=false does not fit.*Fix: .*strategy=auto"):
        load_recipe(
            W1,
            [
                "distributed.strategy=fsdp",
                "distributed.fsdp_reshard_after_forward=false",
                "training.max_length=2048",
                "training.gradient_accumulation_steps=8",
            ],
        )
    unknown = resolve_strategy(load_recipe(W1, ["distributed.gpu=null"]))  # nothing to estimate: least memory
    assert (unknown.name, unknown.reshard_after_forward, unknown.problem) == ("fsdp", True, None)
    assert "distributed.gpu is unset" in (unknown.note or "")
    with pytest.raises(RecipeError, match=r"distributed.gpu='a100'"):
        load_recipe(W1, ["distributed.gpu=a100"])
    load_recipe(W1, ["distributed.strategy=fsdp"])  # the seed's FSDP stays selectable


@pytest.fixture
def gemma4_config(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The recipe keeps its Hub id (the memory model reads its published shape); the wrap class comes from a
    tiny Gemma 4 config instead of the Hub."""
    from tests.tiny_models import gemma4_config

    config = gemma4_config(64)
    monkeypatch.setattr(launch, "load_model_config", lambda recipe: config)
    return config


def _rendered(tmp_path: Path, *sets: str) -> dict:
    argv = ["--recipe", W1, "--nproc-per-node", "8", "--config-out", str(tmp_path / "accelerate.yaml")]
    for item in sets:
        argv += ["--set", item]
    plan = launch.plan(launch.parse_args(argv), env={})
    assert yaml.safe_load(plan.config_path.read_text()) == plan.config
    return plan.config


def test_the_launch_config_is_the_strategy_validation_picked(gemma4_config, tmp_path: Path) -> None:
    ddp = _rendered(tmp_path)
    assert ddp["distributed_type"] == "MULTI_GPU" and "fsdp_config" not in ddp and ddp["num_processes"] == 8
    seed = _rendered(tmp_path, "distributed.strategy=fsdp")
    assert seed["distributed_type"] == "FSDP" and seed["fsdp_config"]["fsdp_reshard_after_forward"] is True
    gathered = _rendered(tmp_path, "distributed.strategy=fsdp", "distributed.fsdp_reshard_after_forward=false")
    assert gathered["fsdp_config"]["fsdp_reshard_after_forward"] is False
    longer = _rendered(tmp_path, "training.max_length=2048", "training.gradient_accumulation_steps=8")
    assert longer["distributed_type"] == "FSDP" and longer["fsdp_config"]["fsdp_reshard_after_forward"] is True


def test_accelerates_fsdp_plugin_reads_the_gathered_setting(gemma4_config, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The rendered `fsdp_reshard_after_forward: false` reaches accelerate 1.15's FSDP2 plugin through its launcher."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    _rendered(tmp_path, "distributed.strategy=fsdp", "distributed.fsdp_reshard_after_forward=false")
    args = launch_command_parser().parse_args(
        ["--config_file", str(tmp_path / "accelerate.yaml"), "-m", "trainer", "--recipe", W1]
    )
    args, _, _ = _validate_launch_command(args)
    for key, value in prepare_multi_gpu_env(args).items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is False


def test_the_gemma4_31b_shape_is_what_transformers_builds() -> None:
    """The table's widths, built by transformers' Gemma 4 on the meta device: 30.7B parameters, as published."""
    import torch
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

    s = memory_plan.MODEL_SHAPES["google/gemma-4-31b-it"]
    config = Gemma4TextConfig(
        hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim, vocab_size=s.vocab,
        global_head_dim=s.global_head_dim, num_global_key_value_heads=s.global_kv_heads, attention_k_eq_v=s.k_eq_v,
        sliding_window=s.sliding_window, layer_types=list(s.layer_types), hidden_size_per_layer_input=0,
        num_kv_shared_layers=0, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
    counted = sum(p.numel() for p in model.parameters())
    assert abs(counted - s.params) / counted < 1e-3 and 30.6e9 < counted < 30.8e9
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    from_modules = sum(
        16 * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
    )
    assert s.lora_params(16, targets) == from_modules


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_activation_model_matches_the_measurement() -> None:
    """The fitted bytes per token per layer against bench/activation_memory.py at a width it was not fitted at."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from activation_memory import saved_bytes_per_token

    shape = memory_plan.ModelShape(hidden=768, intermediate=3072, layers=1, heads=6, kv_heads=2, head_dim=64, vocab=16)
    measured = saved_bytes_per_token(16, 768, 3072, 6, 2, 64)
    assert memory_plan.activation_bytes_per_token(shape, 0) == pytest.approx(measured, rel=0.03)
