"""Bad configuration fails before any resource is declared, with a message that says how to fix it.

Each class is one invariant; each bad case is its own test and asserts on the message.
"""

from __future__ import annotations

from typing import Any

import pytest

from infra.config import ConfigError, validate
from infra.offline.engine import run_stack

CLOUD_RUN = {"gcp:project": "p", "gcp:region": "us-central1", "workload": "cloud-run", "recipe": "emoji-gemma3-1b"}
GKE = {"gcp:project": "p", "gcp:region": "us-central1", "workload": "gke-job", "recipe": "text-to-sql-gemma4-31b"}
RAY = {**GKE, "workload": "gke-ray", "recipe": "product-descriptions-gemma3-4b"}


def fails(raw: dict[str, Any], hf_token_set: bool = True) -> str:
    with pytest.raises(ConfigError) as info:
        validate(raw, "teststack", hf_token_set)
    return str(info.value)


class TestValidConfigs:
    """The shapes the three stacks use validate, with workload-dependent defaults filled in."""

    def test_cloud_run_defaults_to_one_l4(self) -> None:
        cfg = validate(CLOUD_RUN, "dev", True)
        assert (cfg.gpu_type, cfg.gpus_per_node, cfg.nodes) == ("nvidia-l4", 1, 1)
        assert cfg.timeout_minutes == 60

    def test_gke_defaults_to_eight_b200(self) -> None:
        cfg = validate(GKE, "a4", True)
        assert (cfg.gpu_type, cfg.gpus_per_node, cfg.total_gpus) == ("nvidia-b200", 8, 8)

    def test_each_stack_gets_its_own_namespace(self) -> None:
        """The Workload Identity principal is PROJECT.svc.id.goog[NAMESPACE/KSA] in every cluster of the project."""
        assert validate(GKE, "a4", True).namespace == "gft-a4"
        assert validate({**RAY, "nodes": 2}, "ray", True).namespace == "gft-ray"
        assert validate({**GKE, "namespace": "team-a"}, "a4", True).namespace == "team-a"

    def test_a_namespace_kubernetes_refuses_fails(self) -> None:
        msg = fails({**GKE, "namespace": "Gemma_Finetune"})
        assert "namespace='Gemma_Finetune' is not a Kubernetes namespace name" in msg and "Fix:" in msg

    def test_labels_always_carry_cost_attribution(self) -> None:
        cfg = validate({**CLOUD_RUN, "labels": ["team=ml"]}, "dev", True)
        assert cfg.resource_labels == {"app": "gemma-finetune", "stack": "dev", "workload": "cloud-run", "team": "ml"}

    def test_local_recipe_needs_no_token(self) -> None:
        cfg = validate({**CLOUD_RUN, "recipe": "emoji-local"}, "dev", False)
        assert not cfg.hf_token_set


class TestGpuMustExistWhereItRuns:
    """A GPU the platform does not offer would only fail at deploy time, after minutes of provisioning."""

    def test_b200_on_cloud_run_lists_cloud_run_gpus(self) -> None:
        msg = fails({**CLOUD_RUN, "gpuType": "nvidia-b200"})
        assert "gpuType='nvidia-b200' is not offered by Cloud Run" in msg
        assert "nvidia-l4" in msg and "nvidia-rtx-pro-6000" in msg
        assert "pulumi config set gpuType nvidia-l4" in msg

    def test_unknown_gke_gpu(self) -> None:
        msg = fails({**GKE, "gpuType": "nvidia-tesla-k80"})
        assert "not a GKE Autopilot accelerator" in msg and "nvidia-b200" in msg

    def test_gpu_count_the_machine_does_not_have(self) -> None:
        msg = fails({**GKE, "gpusPerNode": 4})
        assert "gpusPerNode=4 is not a machine shape for nvidia-b200 (a4-highgpu-8g)" in msg
        assert "allowed counts: 8" in msg

    def test_cloud_run_has_one_gpu_per_instance(self) -> None:
        assert "exactly one GPU per instance" in fails({**CLOUD_RUN, "gpusPerNode": 2})

    def test_region_without_cloud_run_gpus(self) -> None:
        msg = fails({**CLOUD_RUN, "gcp:region": "southamerica-east1"})
        assert "has no Cloud Run nvidia-l4 GPUs" in msg and "us-central1" in msg


class TestCapacity:
    """Reservation capacity without a name would leave pods pending forever."""

    def test_reservation_without_name(self) -> None:
        msg = fails({**GKE, "capacity": "reservation"})
        assert "capacity=reservation needs reservationName" in msg
        assert "gcloud compute reservations list" in msg

    def test_reservation_name_without_reservation_capacity(self) -> None:
        assert "reservationName='r1' is set but capacity=spot" in fails(
            {**GKE, "capacity": "spot", "reservationName": "r1"}
        )

    def test_unknown_capacity_mode(self) -> None:
        msg = fails({**GKE, "capacity": "cheap"})
        assert "capacity='cheap'" in msg and "'on-demand', 'spot', 'flex-start' or 'reservation'" in msg


class TestRecipe:
    """The recipe is a file under trainer/recipes/; a typo must not reach a GPU."""

    def test_unknown_recipe_suggests_the_close_one(self) -> None:
        msg = fails({**CLOUD_RUN, "recipe": "emoji-gemma3-1"})
        assert "recipe='emoji-gemma3-1' is not a file under trainer/recipes/" in msg
        assert "Did you mean 'emoji-gemma3-1b'?" in msg

    def test_bad_recipe_override(self) -> None:
        msg = fails({**CLOUD_RUN, "recipeOverrides": ["training.max_stepz=3"]})
        assert "recipeOverrides do not apply" in msg and "max_stepz" in msg


class TestWorldSize:
    """The recipe is sized for distributed.world_size ranks: a stack that starts another count fails at preview."""

    def test_two_a4_nodes_for_the_eight_rank_w1_recipe(self) -> None:
        msg = fails({**GKE, "nodes": 2})
        assert "distributed.world_size=8 but this stack (nodes=2 x gpusPerNode=8) starts 16" in msg
        assert "pulumi config set nodes 1" in msg
        assert "pulumi config set --path 'recipeOverrides[0]' distributed.world_size=16" in msg
        assert validate({**GKE, "nodes": 2, "recipeOverrides": ["distributed.world_size=16"]}, "s", True).nodes == 2

    def test_one_ray_node_for_the_sixteen_worker_w2_recipe(self) -> None:
        msg = fails({**RAY, "nodes": 1})
        assert "distributed.world_size=16 but this stack (nodes=1 x gpusPerNode=8) starts 8" in msg
        assert "pulumi config set nodes 2" in msg
        assert validate({**RAY, "nodes": 2}, "s", True).nodes == 2


class TestHfToken:
    """Gemma weights are gated: a run without a token fails after the GPU is up."""

    def test_missing_token_when_recipe_downloads_gemma(self) -> None:
        msg = fails(CLOUD_RUN, hf_token_set=False)
        assert "hfToken is missing and recipe 'emoji-gemma3-1b' needs it" in msg
        assert "pulumi config set --secret hfToken" in msg


class TestKeys:
    """Unknown keys are typos; they must not be ignored silently."""

    def test_unknown_key_with_suggestion(self) -> None:
        msg = fails({**CLOUD_RUN, "gpuTyp": "nvidia-l4"})
        assert "unknown key gemma-finetune:gpuTyp; did you mean 'gpuType'?" in msg

    def test_missing_required_key(self) -> None:
        raw = dict(CLOUD_RUN)
        del raw["workload"]
        assert "workload is required" in fails(raw)

    def test_prebuilt_images_must_be_pinned_by_digest(self) -> None:
        msg = fails({**CLOUD_RUN, "imageBuild": "prebuilt", "trainerImage": "us-docker.pkg.dev/p/r/trainer:latest"})
        assert "is not pinned by digest" in msg

    def test_public_member_in_invokers_is_refused(self) -> None:
        assert "servingPublic=true" in fails({**CLOUD_RUN, "servingInvokers": ["allUsers"]})

    def test_all_problems_are_reported_at_once(self) -> None:
        msg = fails({**GKE, "capacity": "reservation", "gpusPerNode": 2})
        assert "needs reservationName" in msg and "gpusPerNode=2" in msg


class TestNothingDeclaredOnBadConfig:
    """Validation runs before the first resource: a bad stack creates nothing at all."""

    @pytest.mark.parametrize(
        "stack, overrides, expected",
        [
            ("dev", {"gpuType": "nvidia-b200"}, "not offered by Cloud Run"),
            ("dev", {"recipe": "nope"}, "is not a file under trainer/recipes/"),
        ],
    )
    def test_bad_stack_declares_no_resource(self, stack: str, overrides: dict[str, Any], expected: str) -> None:
        with pytest.raises(ConfigError) as info:
            run_stack(stack, overrides=overrides)
        assert expected in str(info.value)
        assert info.value.declared_resources == []  # type: ignore[attr-defined]

    def test_missing_token_declares_no_resource(self) -> None:
        with pytest.raises(ConfigError) as info:
            run_stack("dev", hf_token=None)
        assert "hfToken is missing" in str(info.value)
        assert info.value.declared_resources == []  # type: ignore[attr-defined]


class TestServingApiKey:
    """A key vLLM cannot compare (non-ASCII, spaces, too short or long) is refused at config, never echoed."""

    @pytest.mark.parametrize(
        "key",
        [
            "clé-zqv-du-service-0001",  # non-ASCII: the guard matched it, vLLM's /v1 check did not
            "zqv key with spaces 0001",
            "tab\there-zqv-key-0001",
            "short-zqv",
            "zqv" * 86,  # 258 characters
        ],
    )
    def test_unusable_key_is_refused_without_echo(self, key: str) -> None:
        with pytest.raises(ConfigError) as info:
            validate({**CLOUD_RUN, "servingApiKey": key}, "dev", hf_token_set=True)
        message = str(info.value)
        assert "servingApiKey" in message and "visible ASCII" in message, message
        assert "pulumi config set --secret servingApiKey" in message
        assert key not in message and "zqv" not in message, "the key is never repeated"

    @pytest.mark.parametrize("key", ["k" * 16, "A1b2-C3d4_E5f6.G7h8~!@#$%^&*()", "z" * 256])
    def test_visible_ascii_keys_pass(self, key: str) -> None:
        cfg = validate({**CLOUD_RUN, "servingApiKey": key}, "dev", hf_token_set=True)
        assert cfg.serving_api_key_set


class TestServingEnvOpensNoDevelopmentRoutes:
    """vLLM switches that add routes for every invoker (vLLM v0.28.0) are refused, with the reason and the fix."""

    @pytest.mark.parametrize(
        ("name", "route"),
        [("VLLM_SERVER_DEV_MODE", "/collective_rpc"), ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "/v1/load_lora_adapter")],
    )
    def test_refused_with_the_routes_it_opens(self, name: str, route: str) -> None:
        msg = fails({**CLOUD_RUN, "servingEnv": ["VLLM_LOGGING_LEVEL=DEBUG", f"{name}=1"]})
        assert f"servingEnv sets {name}" in msg and route in msg, msg
        assert "Fix: pulumi config rm --path 'servingEnv[1]'" in msg

    def test_other_vllm_settings_pass(self) -> None:
        cfg = validate({**CLOUD_RUN, "servingEnv": ["VLLM_LOGGING_LEVEL=DEBUG"]}, "dev", True)
        assert cfg.serving_env == ["VLLM_LOGGING_LEVEL=DEBUG"]


def test_serving_env_leaves_ld_library_path_to_the_image_and_names_the_cuda_switch() -> None:
    """The old 803/804 advice (`LD_LIBRARY_PATH=…` in servingEnv) would replace the image's own path; in v0.28 the
    compat libraries are vLLM's opt-in VLLM_ENABLE_CUDA_COMPATIBILITY=1 (vllm/env_override.py)."""
    msg = fails({**CLOUD_RUN, "servingEnv": ["LD_LIBRARY_PATH=/usr/local/nvidia/lib64"]})
    assert "servingEnv sets LD_LIBRARY_PATH" in msg and "VLLM_ENABLE_CUDA_COMPATIBILITY=1" in msg, msg
    cfg = validate({**CLOUD_RUN, "servingEnv": ["VLLM_ENABLE_CUDA_COMPATIBILITY=1"]}, "dev", True)
    assert cfg.serving_env == ["VLLM_ENABLE_CUDA_COMPATIBILITY=1"]


def test_serving_extra_args_open_no_development_routes() -> None:
    """The same rule for the stack's servingExtraArgs: vLLM's profiler routes would be open to every invoker."""
    msg = fails({**CLOUD_RUN, "servingExtraArgs": ["--profiler-config.profiler", "torch"]})
    assert "servingExtraArgs[0]" in msg and "/start_profile" in msg, msg
