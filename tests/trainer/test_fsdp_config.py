"""FSDP wrap class and accelerate config.

Why it matters: a wrong wrap class (Gemma 4's text layer is not `Gemma3DecoderLayer`) or a
misspelled accelerate key does not fail loudly: FSDP then shards nothing per layer, or
accelerate quietly uses its default. These tests build the configs from tiny model configs and
push the rendered file through accelerate's OWN launch parsing and FSDP plugin.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests import tiny_models
from trainer.fsdp import FsdpConfigError, decoder_layer_class, render_accelerate_config

REFERENCE = Path(__file__).resolve().parents[2] / "trainer" / "accelerate" / "fsdp2-gemma4-1x8.yaml"


def tiny_gemma3_text_config():
    return tiny_models.gemma3_text_config(64)


def tiny_gemma3_vision_config():
    return tiny_models.gemma3_vision_config(64, 63, 62, 61)


def tiny_gemma4_config():
    return tiny_models.gemma4_config(64)


class TestDecoderLayerClass:
    def test_gemma4_multimodal_config_gives_the_text_layer(self):
        """Gemma 4's _no_split_modules also lists vision/audio blocks; only the text layer is right."""
        assert decoder_layer_class(tiny_gemma4_config()) == "Gemma4TextDecoderLayer"

    def test_gemma3_vision_config(self):
        assert decoder_layer_class(tiny_gemma3_vision_config()) == "Gemma3DecoderLayer"

    def test_gemma3_text_config(self):
        assert decoder_layer_class(tiny_gemma3_text_config()) == "Gemma3DecoderLayer"

    @pytest.mark.parametrize(
        ("model_type", "expected"),
        [("gemma4", "Gemma4TextDecoderLayer"), ("gemma3", "Gemma3DecoderLayer"), ("gemma3_text", "Gemma3DecoderLayer")],
    )
    def test_model_type_strings(self, model_type, expected):
        assert decoder_layer_class(model_type) == expected

    def test_config_dict(self):
        assert decoder_layer_class(tiny_gemma3_text_config().to_dict()) == "Gemma3DecoderLayer"

    def test_another_family_is_looked_up_too(self):
        """No per-family string: a Llama config yields Llama's block."""
        assert decoder_layer_class("llama") == "LlamaDecoderLayer"

    def test_unknown_model_type_fails_clearly(self):
        with pytest.raises(FsdpConfigError, match="no-such-model"):
            decoder_layer_class("no-such-model")


class TestRenderedConfig:
    def test_single_node_fsdp2(self):
        config = render_accelerate_config(tiny_gemma4_config(), num_processes=8)
        fsdp = config["fsdp_config"]
        assert config["distributed_type"] == "FSDP" and config["num_processes"] == 8
        assert fsdp["fsdp_version"] == 2
        assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "Gemma4TextDecoderLayer"
        assert fsdp["fsdp_reshard_after_forward"] is True
        assert fsdp["fsdp_state_dict_type"] == "FULL_STATE_DICT"
        assert fsdp["fsdp_cpu_ram_efficient_loading"] is True
        assert fsdp["fsdp_offload_params"] is False and fsdp["fsdp_activation_checkpointing"] is False
        assert config["mixed_precision"] == "bf16" and config["rdzv_backend"] == "static"

    def test_multi_node_counts_all_processes(self):
        config = render_accelerate_config("gemma4", 16, num_machines=2, machine_rank=1, main_process_ip="10.1.0.2")
        assert (config["num_processes"], config["num_machines"], config["machine_rank"]) == (16, 2, 1)
        assert config["main_process_ip"] == "10.1.0.2"

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"num_processes": 8, "num_machines": 2},  # no main_process_ip
            {"num_processes": 9, "num_machines": 2, "main_process_ip": "h"},
            {"num_processes": 8, "num_machines": 2, "machine_rank": 2, "main_process_ip": "h"},
            {"num_processes": 8, "mixed_precision": "bfloat16"},
        ],
    )
    def test_inconsistent_settings_are_rejected(self, kwargs):
        with pytest.raises(FsdpConfigError):
            render_accelerate_config("gemma3_text", **kwargs)

    def test_reference_file_matches_the_renderer(self):
        assert yaml.safe_load(REFERENCE.read_text()) == render_accelerate_config("gemma4", 8)


class TestAccelerateReadsIt:
    """The rendered file goes through accelerate 1.15's launch parsing and its FSDP plugin."""

    @pytest.fixture
    def launched_env(self, tmp_path, monkeypatch):
        from accelerate.commands.config.config_args import ClusterConfig
        from accelerate.commands.launch import _validate_launch_command, launch_command_parser
        from accelerate.utils.launch import prepare_multi_gpu_env

        config = render_accelerate_config(
            tiny_gemma4_config(), 16, num_machines=2, machine_rank=1, main_process_ip="n0"
        )
        path = tmp_path / "accelerate.yaml"
        path.write_text(yaml.safe_dump(config))
        ClusterConfig.from_yaml_file(str(path))  # raises on an unknown top-level key
        parser = launch_command_parser()
        known = {action.dest for action in parser._actions}
        unknown = sorted(k for k in config["fsdp_config"] if k not in known)
        assert not unknown, f"accelerate launch has no argument for {unknown}: it would set them silently"
        args = parser.parse_args(["--config_file", str(path), "-m", "trainer", "--recipe", "x"])
        args, _, _ = _validate_launch_command(args)
        env = prepare_multi_gpu_env(args)
        for key, value in env.items():
            if key.startswith(("FSDP_", "ACCELERATE_")):
                monkeypatch.setenv(key, value)
        return args, env

    def test_torchrun_arguments(self, launched_env):
        args, _ = launched_env
        assert (args.nproc_per_node, args.nnodes, args.node_rank) == ("8", "2", 1)
        assert args.rdzv_backend == "static" and args.rdzv_endpoint == "n0:29500"

    def test_fsdp_plugin_sees_our_settings(self, launched_env):
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2
        assert plugin.transformer_cls_names_to_wrap == ["Gemma4TextDecoderLayer"]
        assert plugin.reshard_after_forward is True
        assert plugin.state_dict_type.name == "FULL_STATE_DICT"
        assert plugin.cpu_ram_efficient_loading is True
        assert plugin.activation_checkpointing is False
        assert launched_env[1]["ACCELERATE_MIXED_PRECISION"] == "bf16"

    def test_lora_gradients_are_accumulated_and_reduced_in_fp32(self, launched_env):
        """The policy accelerate renders from the config, after the trainer's FSDP setup, given to torch's own
        `fully_shard` (one gloo rank on the CPU): 32 accumulation micro-steps without gradient sync, then one
        with it, as accelerate's accumulation runs them. The adapter's gradient is summed in fp32 (the bf16 sum
        of the default policy is off by up to 2%), computed from bf16 activations as before."""
        import torch
        import torch.distributed as dist
        from accelerate.utils import FullyShardedDataParallelPlugin
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from trainer.fsdp import reduce_gradients_in_fp32

        plugin = FullyShardedDataParallelPlugin()
        plugin.set_mixed_precision(launched_env[1]["ACCELERATE_MIXED_PRECISION"])  # as AcceleratorState does
        reduce_gradients_in_fp32(plugin)  # trainer.lm_head.new_sft_trainer, before accelerate prepares the model
        policy = plugin.mixed_precision_policy
        assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (
            torch.bfloat16,
            torch.float32,
            torch.bfloat16,
        )

        torch.manual_seed(0)
        steps = 32
        inputs = [torch.randn(4, 16) for _ in range(steps + 1)]
        adapter = torch.nn.Linear(16, 8, bias=False)  # fp32: accelerate upcasts trainable parameters
        start = adapter.weight.detach().clone()
        reference = torch.zeros_like(start, dtype=torch.float64)  # each micro-step's bf16 gradient, summed exactly
        for x in inputs:
            w = start.to(torch.bfloat16).requires_grad_()
            (x.to(torch.bfloat16) @ w.t()).float().square().sum().backward()
            reference += w.grad.double()

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            fully_shard(adapter, mesh=init_device_mesh("cpu", (1,)), mp_policy=policy)
            adapter.set_requires_gradient_sync(False)
            for x in inputs[:-1]:
                adapter(x).float().square().sum().backward()
            (param,) = adapter._get_fsdp_state()._fsdp_param_group.fsdp_params
            assert param.reduce_dtype == torch.float32
            assert param.unsharded_accumulated_grad.dtype == torch.float32
            adapter.set_requires_gradient_sync(True)
            adapter(inputs[-1]).float().square().sum().backward()
            grad = adapter.weight.grad.to_local()
        finally:
            dist.destroy_process_group()
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad.double(), reference, rtol=1e-6, atol=1e-6)
