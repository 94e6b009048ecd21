"""Serving on every stack (infra/serving.py): the real program under the project's mocks, with runs in the bucket.

What each stack serves: `a4-gemma4` its adapters on the base its runs staged in the bucket (read from gs:// by the
Run:ai streamer, never from the Hub), `ray-gemma3-vision` and `dev` their merged exports (modules_to_save; no staged
base). The GPU holds the served model or the stack is refused with the fix; the image's CUDA suits the GPU's driver;
the probe and the price of a cold start follow the served model.
"""

from __future__ import annotations

import json

import pulumi
import pytest

from infra.config import ConfigError, image_driver_problem, validate
from infra.offline.engine import MOCK_TRAINED_RUN, run_stack
from serving.memory import served_memory
from serving.startup import STARTUP_WINDOW, Loader, cold_start, covers, window_for
from tests.infra.test_config import CLOUD_RUN
from trainer.export import SHARED_KV_VALUE_LORA

SERVICE = "gcp:cloudrunv2/service:Service"
SERVING_ON = {"servingEnabled": True, "servingInvokers": ["user:alice@example.com"]}
A4_BUCKET = "my-gcp-project-gft-a4-gemma4"
RID = MOCK_TRAINED_RUN[:8]


def container(run) -> dict:  # type: ignore[no-untyped-def]
    return run.one(SERVICE).plain_inputs()["template"]["containers"][0]


def a4_run(
    rid: str, r: int = 16, summary: float | None = 0.5, base: bool = True, value_lora: bool = True, **adapter: object
) -> dict[str, str]:
    """What a finished a4-gemma4 run leaves in its bucket (trainer/export.py publish_run, trainer/base_weights.py);
    `value_lora`: its adapter marker records the v_proj LoRA written for Gemma 4's shared-kv layers."""
    folder = f"{A4_BUCKET}/runs/{a4_stem()}-{rid}"
    config = {
        "r": r,
        "lora_alpha": 32,
        "target_modules": ["q_proj"],
        "base_model_name_or_path": "google/gemma-4-31B-it",
    }
    files = {"adapter_config.json": json.dumps({**config, **adapter}), "adapter_model.safetensors": "x" * 100}
    objects = {f"{folder}/adapter/{name}": content for name, content in files.items()}
    inventory = [{"path": n, "bytes": len(c)} for n, c in files.items()]
    marker = {"files": inventory, "kind": "adapter"} | ({SHARED_KV_VALUE_LORA: [5, 11]} if value_lora else {})
    objects[f"{folder}/adapter/_COMPLETE.json"] = json.dumps(marker)
    if summary is not None:
        objects = {f"{folder}/run_summary.json": json.dumps({"eval_loss": summary}), **objects}
    if base:
        objects[f"{folder}/_base/google--gemma-4-31B-it@main/_BASE_COMPLETE.json"] = "{}"
    return objects


def a4_stem() -> str:
    from infra.serving import served_layout

    run = run_stack("a4-gemma4")
    assert run.cfg is not None
    return served_layout(run.cfg).stem


class TestEveryStackServes:
    """Issue: only `dev` served (`servingEnabled=true is only implemented for workload cloud-run`)."""

    @pytest.mark.parametrize(
        ("stack", "gpu", "artefact"),
        [("a4-gemma4", "nvidia-rtx-pro-6000", "adapter"), ("ray-gemma3-vision", "nvidia-l4", "merged")],
    )
    def test_the_gke_stacks_serve_their_gated_run_on_cloud_run(self, stack: str, gpu: str, artefact: str) -> None:
        run = run_stack(stack, overrides=SERVING_ON, assume_trained=True)
        service = run.one(SERVICE).plain_inputs()
        assert service["template"]["nodeSelector"] == {"accelerator": gpu}, "the smallest GPU that holds the model"
        assert service["template"]["scaling"]["minInstanceCount"] == 0 and service["invokerIamDisabled"] is False
        assert run.outputs["servedArtefact"].startswith(f"{artefact}: ")
        assert run.outputs["servingRunId"] == RID
        assert "fits:" in run.outputs["servingMemory"]

    def test_a_gpu_that_cannot_hold_the_model_is_refused_with_the_fix(self) -> None:
        with pytest.raises(ConfigError) as info:
            run_stack("a4-gemma4", overrides={**SERVING_ON, "servingGpuType": "nvidia-l4"})
        message = str(info.value)
        assert "servingGpuType=nvidia-l4 cannot hold the served model: google/gemma-4-31B-it" in message
        assert "weights 61.4" in message and "does NOT fit" in message
        assert "Fix: pulumi config set servingGpuType nvidia-rtx-pro-6000" in message
        assert info.value.declared_resources == []  # type: ignore[attr-defined]

    def test_a_context_too_long_for_the_gpu_names_the_longest_that_fits(self) -> None:
        with pytest.raises(ConfigError, match=r"Fix: .*pulumi config set servingMaxModelLen \d+ \(the longest"):
            run_stack("a4-gemma4", overrides={**SERVING_ON, "servingMaxModelLen": 262144})

    def test_the_service_gpu_must_be_offered_in_the_stack_region(self) -> None:
        with pytest.raises(ConfigError, match=r"gcp:region='us-east4' has no Cloud Run nvidia-rtx-pro-6000 GPUs"):
            validate({**CLOUD_RUN, "servingEnabled": True, "servingGpuType": "nvidia-rtx-pro-6000",
                      "gcp:region": "us-east4"}, "dev", True)  # fmt: skip

    def test_the_vision_stack_serves_its_merged_export_because_its_adapter_trains_the_tower(self) -> None:
        """The shipped vision recipe trains LoRA on the vision tower too (lora.vision_tower): vLLM applies that only
        with tower/connector LoRA, not confirmed for Gemma 3, so the trainer merges the run and the service loads
        the merged export, with its image encoder."""
        run = run_stack("ray-gemma3-vision", overrides=SERVING_ON, assume_trained=True)
        assert "vision tower" in run.outputs["servedArtefact"]
        args = container(run)["args"]
        assert args[0].endswith("/merged") and "--enable-lora" not in args
        assert "--language-model-only" not in args, "it answers images"

    def test_an_adapter_with_modules_to_save_is_served_merged(self) -> None:
        """vLLM refuses an adapter that carries modules_to_save; the trainer merges such a run whatever
        `output.merge` says (Recipe.writes_merged), so serving it is no config error; where only `output.merge`
        decides (dev: no staged base), false is still refused."""
        saved = "lora.modules_to_save=[lm_head,embed_tokens]"
        run = run_stack("ray-gemma3-vision", overrides={**SERVING_ON, "recipeOverrides": [saved]}, assume_trained=True)
        assert "modules_to_save" in run.outputs["servedArtefact"] and "lm_head" in run.outputs["servedArtefact"]
        args = container(run)["args"]
        assert args[0].startswith("/mnt/models/runs/ft-product-descriptions-gemma3-") and args[0].endswith("/merged")
        assert "--enable-lora" not in args and "--language-model-only" not in args, "it answers images"
        overrides = {**SERVING_ON, "recipeOverrides": [saved, "output.merge=false"]}
        run = run_stack("ray-gemma3-vision", overrides=overrides, assume_trained=True)
        assert container(run)["args"][0].endswith("/merged")
        with pytest.raises(ConfigError, match=r"output.merge is false\. Fix: .*output.merge=true"):
            run_stack("dev", overrides={**SERVING_ON, "recipeOverrides": ["output.merge=false"]})

    def test_a_run_that_finished_without_the_export_names_the_one_new_run(self) -> None:
        """A run trained before the trainer marked the export this stack serves has `_RUN_COMPLETE.json` and no
        marked export."""
        from tests.infra.test_finished_runs import completed, up

        first = up("ray-gemma3-vision")
        with pytest.raises(pulumi.RunError) as info:
            up("ray-gemma3-vision", completed(first), after=first, **SERVING_ON)
        message = str(info.value)
        assert f"run {first.outputs['rayJobName']} finished without a merged export" in message
        assert "Fix: pulumi config set runGeneration 1 && pulumi up" in message


class TestAdaptersNotCopies:
    def test_the_base_comes_from_the_bucket_and_each_run_is_an_adapter(self) -> None:
        run = run_stack("a4-gemma4", overrides=SERVING_ON, bucket_objects=a4_run("aaaaaaaa"))
        args = container(run)["args"]
        assert args[0] == f"gs://{A4_BUCKET}/runs/{a4_stem()}-aaaaaaaa/_base/google--gemma-4-31B-it@main"
        assert args[args.index("--load-format") + 1] == "runai_streamer"
        lora = args[args.index("--lora-modules") + 1 : args.index("--max-lora-rank")]
        assert lora == [f"text-to-sql-gemma4-31b=/mnt/models/runs/{a4_stem()}-aaaaaaaa/adapter"]
        assert container(run)["envs"][0] == {"name": "HF_HUB_OFFLINE", "value": "1"}, "never the Hub"

    def test_two_runs_side_by_side_under_their_own_names(self) -> None:
        objects = {**a4_run("aaaaaaaa", r=16), **a4_run("bbbbbbbb", r=32, summary=0.9)}
        run = run_stack(
            "a4-gemma4", overrides={**SERVING_ON, "servingCompareRunIds": ["bbbbbbbb"]}, bucket_objects=objects
        )
        args = container(run)["args"]
        lora = args[args.index("--lora-modules") + 1 : args.index("--max-lora-rank")]
        stem = a4_stem()
        assert lora == [
            f"text-to-sql-gemma4-31b=/mnt/models/runs/{stem}-aaaaaaaa/adapter",
            f"text-to-sql-gemma4-31b-bbbbbbbb=/mnt/models/runs/{stem}-bbbbbbbb/adapter",
        ], "the gate kept A (B's loss is higher); B is served beside it under its own name"
        assert args[args.index("--max-lora-rank") + 1] == "32" and args[args.index("--max-loras") + 1] == "2"
        assert run.outputs["servedModels"] == ["text-to-sql-gemma4-31b", "text-to-sql-gemma4-31b-bbbbbbbb"]

    def test_an_adapter_vllm_would_refuse_is_refused_at_preview(self) -> None:
        objects = a4_run("aaaaaaaa", modules_to_save=["lm_head"])
        with pytest.raises(pulumi.RunError, match=r"vLLM only supports modules_to_save being None"):
            run_stack("a4-gemma4", overrides=SERVING_ON, bucket_objects=objects)
        other_base = a4_run("aaaaaaaa", base_model_name_or_path="google/gemma-3-27b-it")
        with pytest.raises(
            pulumi.RunError, match=r"trained on google/gemma-3-27b-it, the service loads google/gemma-4"
        ):
            run_stack("a4-gemma4", overrides=SERVING_ON, bucket_objects=other_base)

    def test_an_adapter_without_the_value_lora_of_shared_kv_layers_is_refused(self) -> None:
        """Published before the trainer wrote it (trainer/export.py add_shared_kv_value_lora), vLLM would serve the
        31B's full-attention values without the k_proj LoRA the run trained."""
        old = a4_run("aaaaaaaa", value_lora=False)
        with pytest.raises(pulumi.RunError, match=r"run aaaaaaaa's adapter was published before .* shared-kv layers"):
            run_stack("a4-gemma4", overrides=SERVING_ON, bucket_objects=old)
        objects = {**a4_run("aaaaaaaa", value_lora=False), **a4_run("bbbbbbbb")}
        run = run_stack("a4-gemma4", overrides={**SERVING_ON, "servingRunId": "bbbbbbbb"}, bucket_objects=objects)
        assert run.outputs["servingRunId"] == "bbbbbbbb"

    def test_a_run_without_its_staged_base_is_not_served_from_the_hub(self) -> None:
        with pytest.raises(pulumi.RunError, match=r"has no staged base: .*_BASE_COMPLETE\.json.*never the Hub"):
            run_stack("a4-gemma4", overrides=SERVING_ON, bucket_objects=a4_run("aaaaaaaa", base=False))

    def test_comparing_runs_needs_a_stack_that_serves_adapters(self) -> None:
        with pytest.raises(ConfigError, match=r"servingCompareRunIds .* this stack serves merged exports"):
            run_stack("dev", overrides={**SERVING_ON, "servingCompareRunIds": ["0123456789ab"]})

    def test_run_ids_have_the_workloads_length(self) -> None:
        with pytest.raises(ConfigError, match=r"a run id of workload gke-job has 8 hex characters"):
            run_stack("a4-gemma4", overrides={**SERVING_ON, "servingRunId": "0123456789ab"})


class TestTheGateOnEveryStack:
    def test_a_worse_run_is_kept_back_and_an_unscored_one_never_chosen(self) -> None:
        objects = {**a4_run("aaaaaaaa", summary=0.5), **a4_run("bbbbbbbb", summary=0.9)}
        run = run_stack("a4-gemma4", overrides=SERVING_ON, bucket_objects=objects)
        assert run.outputs["servingRunId"] == "aaaaaaaa"
        assert any("serving keeps run aaaaaaaa" in w for w in run.warnings)
        unscored = {**a4_run("aaaaaaaa", summary=0.5), **a4_run("cccccccc", summary=None)}
        assert (
            run_stack("a4-gemma4", overrides=SERVING_ON, bucket_objects=unscored).outputs["servingRunId"] == "aaaaaaaa"
        )


class TestDriver:
    """The image's CUDA against the Cloud Run GPU's driver (NVIDIA's compatibility rules; docs/serving.md)."""

    @pytest.mark.parametrize(
        ("image", "gpu", "refused"),
        [
            ("vllm/vllm-openai:v0.28.0-cu129", "nvidia-l4", None),
            ("vllm/vllm-openai:v0.28.0-cu129", "nvidia-rtx-pro-6000", None),
            ("vllm/vllm-openai:v0.28.0", "nvidia-rtx-pro-6000", None),
            ("vllm/vllm-openai:v0.28.0", "nvidia-l4", "a newer CUDA major needs a newer driver"),
            ("vllm/vllm-openai:v0.31.0-cu131", "nvidia-rtx-pro-6000", "no PTX JIT"),
            ("vllm/vllm-openai:v0.8.5-cu126", "nvidia-rtx-pro-6000", "first that compiles for sm_120"),
            ("vllm/vllm-openai@sha256:" + "a" * 64, "nvidia-rtx-pro-6000", None),
        ],
    )
    def test_each_image_against_each_driver(self, image: str, gpu: str, refused: str | None) -> None:
        problem = image_driver_problem(image, gpu)
        assert (problem is None) if refused is None else (refused in (problem or "")), problem

    def test_a_refused_image_fails_the_stack_with_the_fix(self) -> None:
        with pytest.raises(ConfigError, match=r"no PTX JIT.*Fix: pulumi config set servingVllmImage vllm/vllm-openai"):
            run_stack("a4-gemma4", overrides={**SERVING_ON, "servingVllmImage": "vllm/vllm-openai:v0.31.0-cu131"})


class TestColdStart:
    def test_the_estimate_counts_from_the_request(self) -> None:
        cold = cold_start(61.4, Loader.STREAMER, large=True)
        steps = [step for step, _, _ in cold.parts]
        assert steps[0].startswith("instance and GPU") and steps[1].startswith("serving image pulled")
        assert any(s.startswith("weights: 61.4 GB") for s in steps) and any(s.startswith("imports") for s in steps)
        assert cold.from_request_s()[0] > cold.in_container_s()[0], "instance and image come before the container"

    def test_each_stacks_probe_holds_its_models_slowest_start(self) -> None:
        for stack in ("dev", "ray-gemma3-vision", "a4-gemma4"):
            run = run_stack(stack, overrides=SERVING_ON, assume_trained=True)
            probe = container(run)["startupProbe"]
            total = probe["initialDelaySeconds"] + probe["periodSeconds"] * probe["failureThreshold"]
            assert probe["periodSeconds"] * probe["failureThreshold"] <= 240 and probe["initialDelaySeconds"] <= 240
            from infra.serving import served_cold_start

            assert run.cfg is not None and total >= served_cold_start(run.cfg).in_container_s()[1], stack
        assert window_for(cold_start(2.0, Loader.MOUNT)) == STARTUP_WINDOW, "dev's 1B keeps its 270 s window"

    def test_the_query_waits_out_a_longer_window(self) -> None:
        """The client keeps a first request alive for the 270 s window plus one --timeout; the 31B's is longer."""
        from infra.offline.engine import redact_secrets

        query = redact_secrets(run_stack("a4-gemma4", overrides=SERVING_ON, assume_trained=True).outputs)["query"]
        assert " --timeout 320 " in query, query  # 470 s window - 270 s + 120 s
        dev = redact_secrets(run_stack("dev", overrides=SERVING_ON, assume_trained=True).outputs)["query"]
        assert "--timeout" not in dev

    def test_a_start_no_window_can_hold_is_reported(self) -> None:
        """62 GB over the FUSE mount (80 MB/s at worst) outlasts the longest probe Cloud Run allows: why the 31B
        base is streamed from gs:// instead."""
        slow = cold_start(61.4, Loader.MOUNT, large=True)
        assert not covers(window_for(slow), slow)

    def test_plan_prints_what_a_cold_start_and_an_idle_instance_cost(self) -> None:
        run = run_stack("ray-gemma3-vision", overrides=SERVING_ON, assume_trained=True)
        text = run.outputs["servingColdStart"]
        assert " s from the request (instance and GPU attached: " in text
        assert "USD per cold start" in text and "USD for an idle instance until scale-in (15 min" in text
        rtx = run_stack("a4-gemma4", overrides=SERVING_ON, assume_trained=True).outputs["servingColdStart"]
        assert "at least" in rtx and "no Cloud Run nvidia-rtx-pro-6000 GPU figure" in rtx


def test_the_memory_model_counts_what_vllm_reserves() -> None:
    """The 31B's bf16 weights (~61 GB) leave room for a 4096-token request on 96 GB, none on 24 GB; LoRA slots
    and the context add memory."""
    rtx = served_memory("google/gemma-4-31B-it", "nvidia-rtx-pro-6000", 4096, language_model_only=True)
    assert 60 < rtx.weights_gb < 63 and rtx.fits
    assert not served_memory("google/gemma-4-31B-it", "nvidia-l4", 4096).fits
    with_loras = served_memory("google/gemma-4-31B-it", "nvidia-rtx-pro-6000", 4096, lora_rank=64, loras=4)
    assert with_loras.lora_gb > 1 and with_loras.kv_room_gb < rtx.kv_room_gb
    longer = served_memory("google/gemma-4-31B-it", "nvidia-rtx-pro-6000", 32768, language_model_only=True)
    assert longer.kv_per_request_gb > rtx.kv_per_request_gb


def test_the_vision_stacks_merged_export_counts_its_own_head() -> None:
    """A vision run that trains lm_head whole (the seed's modules_to_save, one override away): its merged export
    saves the head as a tensor of its own, which vLLM loads beside embed_tokens (trainer/export.py
    `untie_if_separate`): 262,208 x 2,560 bf16 more. The shipped recipe trains no head: its export shares it."""
    from infra.serving import served_memory_of

    saved = {**SERVING_ON, "recipeOverrides": ["lora.modules_to_save=[lm_head,embed_tokens]"]}
    run = run_stack("ray-gemma3-vision", overrides=saved, assume_trained=True)
    assert run.cfg is not None
    served = served_memory_of(run.cfg)
    shared = served_memory("google/gemma-3-4b-it", "nvidia-l4", run.cfg.serving_max_model_len)
    assert served.weights_gb == pytest.approx(shared.weights_gb + 262_208 * 2560 * 2 / 1e9)
    assert served.fits and served.kv_room_gb < shared.kv_room_gb
    assert f"weights {served.weights_gb:.1f}" in run.outputs["servingMemory"]
    shipped = run_stack("ray-gemma3-vision", overrides=SERVING_ON, assume_trained=True)
    assert shipped.cfg is not None and served_memory_of(shipped.cfg).weights_gb == pytest.approx(shared.weights_gb)
