"""Stack `dev`: the Cloud Run training Job and the vLLM service, under mocks with the real Pulumi.dev.yaml."""

from __future__ import annotations

import pulumi
import pytest

from infra.config import ConfigError
from infra.offline import redact_secrets, run_stack
from tests.infra.conftest import PREBUILT

JOB = "gcp:cloudrunv2/job:Job"
SERVICE = "gcp:cloudrunv2/service:Service"
INVOKER = "gcp:cloudrunv2/serviceIamMember:ServiceIamMember"


def job_inputs(**overrides: object) -> dict:
    return run_stack("dev", overrides={**PREBUILT, **overrides}).one(JOB).plain_inputs()


class TestTrainingJob:
    def test_one_l4_with_cpu_and_memory(self) -> None:
        template = job_inputs()["template"]["template"]
        limits = template["containers"][0]["resources"]["limits"]
        assert limits == {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "1"}
        assert template["nodeSelector"] == {"accelerator": "nvidia-l4"}
        assert template["gpuZonalRedundancyDisabled"] is True  # jobs cannot use zonal redundancy

    def test_rtx_pro_gets_its_minimum_cpu_and_memory(self) -> None:
        limits = job_inputs(gpuType="nvidia-rtx-pro-6000")["template"]["template"]["containers"][0]["resources"]
        assert limits["limits"]["cpu"] == "20" and limits["limits"]["memory"] == "80Gi"

    def test_token_by_secret_reference_only(self) -> None:
        run = run_stack("dev", overrides=PREBUILT)
        job = run.one(JOB)
        env = {e["name"]: e for e in job.plain_inputs()["template"]["template"]["containers"][0]["envs"]}
        ref = env["HF_TOKEN"]["valueSource"]["secretKeyRef"]
        assert ref["secret"] == "gft-dev-hf-token" and ref["version"] == "1"
        assert "value" not in env["HF_TOKEN"]

    def test_bucket_mounted_and_trainer_writes_there(self) -> None:
        inputs = job_inputs()
        template = inputs["template"]["template"]
        assert template["volumes"][0]["gcs"] == {"bucket": "my-gcp-project-gft-dev", "readOnly": False}
        args = template["containers"][0]["args"]
        assert args[:4] == ["-m", "trainer", "--recipe", "emoji-gemma3-1b"]
        assert args[5].startswith("output.dir=/mnt/bucket/runs/emoji-gemma3-1b-")

    def test_deadline_retries_and_service_account(self) -> None:
        template = job_inputs()["template"]["template"]
        assert template["timeout"] == "3600s" and template["maxRetries"] == 2
        assert template["serviceAccount"] == "gft-dev-train@my-gcp-project.iam.gserviceaccount.com"

    def test_destroy_is_not_blocked(self) -> None:
        assert job_inputs()["deletionProtection"] is False


class TestExecution:
    """An unchanged `pulumi up` starts nothing; a changed recipe or image starts one new execution."""

    def test_the_job_carries_no_execution_token(self) -> None:
        """A token on the Job breaks the next `up` after a by-hand execution (see test_lifecycle)."""
        inputs = job_inputs()
        assert "startExecutionToken" not in inputs and "runExecutionToken" not in inputs

    def test_one_execution_per_run_after_the_job(self) -> None:
        run = run_stack("dev", overrides=PREBUILT)
        execution = run.by_name("gft-dev-execution")
        inputs = execution.plain_inputs()
        assert inputs["triggers"] == [run.outputs["runId"]]
        assert "gcloud run jobs execute" in inputs["create"] and "--async" in inputs["create"]
        assert inputs["environment"] == {"JOB": "gft-dev-train", "PROJECT": "my-gcp-project", "REGION": "us-central1"}
        assert "update" not in inputs and "delete" not in inputs, "nothing but a new run id starts training"
        assert run.one(JOB).urn in execution.dependencies, "the execution uses the Job's updated template"

    def test_stable_for_same_inputs(self) -> None:
        assert (
            run_stack("dev", overrides=PREBUILT).outputs["runId"]
            == run_stack("dev", overrides=PREBUILT).outputs["runId"]
        )

    def test_changes_with_recipe_overrides(self) -> None:
        base = run_stack("dev", overrides=PREBUILT).outputs["runId"]
        changed = run_stack("dev", overrides={**PREBUILT, "recipeOverrides": ["training.learning_rate=0.0001"]})
        assert changed.outputs["runId"] != base

    def test_changes_with_image(self) -> None:
        other = PREBUILT["trainerImage"].replace("1" * 64, "3" * 64)
        base = run_stack("dev", overrides=PREBUILT).outputs["runId"]
        assert run_stack("dev", overrides={**PREBUILT, "trainerImage": other}).outputs["runId"] != base

    def test_run_id_names_the_run_folder(self) -> None:
        run = run_stack("dev", overrides=PREBUILT)
        rid = run.outputs["runId"]
        assert len(rid) == 12
        args = run.one(JOB).plain_inputs()["template"]["template"]["containers"][0]["args"]
        assert args[5] == f"output.dir=/mnt/bucket/runs/emoji-gemma3-1b-{rid}"
        assert run.outputs["runUri"] == f"gs://my-gcp-project-gft-dev/runs/emoji-gemma3-1b-{rid}"

    def test_rerun_by_hand_is_an_output(self) -> None:
        out = run_stack("dev", overrides=PREBUILT).outputs
        assert (
            out["rerunTraining"]
            == "gcloud run jobs execute gft-dev-train --region us-central1 --project my-gcp-project"
        )


class TestNothingBlocksDestroy:
    """Direct VPC egress keeps a subnet's IPs for 1-2 h after the service is deleted (Cloud Run docs), so
    `pulumi destroy` could not delete the network it had created: the stacks declare none."""

    @pytest.mark.parametrize("public", [False, True])
    def test_serving_declares_no_network_and_no_vpc_egress(self, public: bool) -> None:
        overrides = {**PREBUILT, "servingEnabled": True, "servingPublic": public}
        run = run_stack("dev", overrides=overrides, assume_trained=True)
        assert not [r.urn for r in run.resources if r.type.startswith("gcp:compute/")]
        for r in run.of_type(SERVICE) + run.of_type(JOB):
            template = r.plain_inputs()["template"]
            assert "vpcAccess" not in template and "vpcAccess" not in template.get("template", {}), r.urn

    def test_no_network_keys(self) -> None:
        with pytest.raises(ConfigError, match="unknown key gemma-finetune:network"):
            run_stack("dev", overrides={**PREBUILT, "network": "default", "subnetwork": "default"})


class TestServing:
    def test_disabled_means_no_service(self) -> None:
        run = run_stack("dev", overrides=PREBUILT)
        assert run.of_type(SERVICE) == [] and "servingEnabled true" in run.outputs["nextStep"]

    def test_service_waits_for_a_complete_model(self) -> None:
        with pytest.raises(pulumi.RunError, match="the training run has not finished") as info:
            run_stack("dev", overrides={**PREBUILT, "servingEnabled": True})
        assert "gcloud run jobs executions list" in str(info.value)

    def test_private_by_default_with_configured_invokers_only(self) -> None:
        run = run_stack(
            "dev",
            overrides={**PREBUILT, "servingEnabled": True, "servingInvokers": ["user:a@example.com"]},
            assume_trained=True,
        )
        assert run.one(SERVICE).plain_inputs()["invokerIamDisabled"] is False
        members = [r.plain_inputs()["member"] for r in run.of_type(INVOKER)]
        assert members == ["user:a@example.com"]

    def test_public_only_when_the_stack_says_so(self) -> None:
        run = run_stack(
            "dev", overrides={**PREBUILT, "servingEnabled": True, "servingPublic": True}, assume_trained=True
        )
        assert run.one(SERVICE).plain_inputs()["invokerIamDisabled"] is True
        assert run.of_type(INVOKER) == []

    def test_gpu_probe_volume_and_scaling(self) -> None:
        run = run_stack("dev", overrides={**PREBUILT, "servingEnabled": True}, assume_trained=True)
        template = run.one(SERVICE).plain_inputs()["template"]
        container = template["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert container["resources"]["cpuIdle"] is False
        assert template["nodeSelector"] == {"accelerator": "nvidia-l4"}
        assert template["gpuZonalRedundancyDisabled"] is True
        assert template["scaling"] == {"minInstanceCount": 0, "maxInstanceCount": 1}
        probe = container["startupProbe"]
        assert probe["initialDelaySeconds"] + probe["periodSeconds"] * probe["failureThreshold"] == 240
        assert template["volumes"][0]["gcs"]["readOnly"] is True
        assert container["ports"] == {"containerPort": 8000}

    def test_vllm_serves_the_run_that_trained(self) -> None:
        run = run_stack("dev", overrides={**PREBUILT, "servingEnabled": True}, assume_trained=True)
        args = run.one(SERVICE).plain_inputs()["template"]["containers"][0]["args"]
        run_id = run.outputs["runId"]
        assert args[0] == f"/mnt/models/runs/emoji-gemma3-1b-{run_id}/merged"
        assert args[args.index("--served-model-name") + 1] == "emoji-gemma3-1b"

    def test_zonal_redundancy_is_a_choice_for_the_service(self) -> None:
        run = run_stack(
            "dev", overrides={**PREBUILT, "servingEnabled": True, "gpuZonalRedundancy": True}, assume_trained=True
        )
        assert run.one(SERVICE).plain_inputs()["template"]["gpuZonalRedundancyDisabled"] is False

    def test_extra_vllm_flags_pass_through(self) -> None:
        run = run_stack(
            "dev",
            overrides={**PREBUILT, "servingEnabled": True, "servingExtraArgs": ["--enable-prefix-caching"]},
            assume_trained=True,
        )
        assert run.one(SERVICE).plain_inputs()["template"]["containers"][0]["args"][-1] == "--enable-prefix-caching"
        assert redact_secrets(run.outputs)["query"].startswith("python -m serving.client --url https://")


class TestEditedRecipe:
    def test_edited_recipe_file_starts_a_new_execution(self, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
        import shutil

        from trainer import recipe as trainer_recipe

        before = run_stack("dev", overrides=PREBUILT).outputs["runId"]
        recipes = tmp_path / "recipes"
        shutil.copytree(trainer_recipe.RECIPES_DIR, recipes)
        path = recipes / "emoji-gemma3-1b.yaml"
        path.write_text(path.read_text().replace("learning_rate: 2.0e-4", "learning_rate: 1.0e-4"))
        monkeypatch.setattr(trainer_recipe, "RECIPES_DIR", recipes)
        after = run_stack("dev", overrides=PREBUILT)
        assert after.outputs["runId"] != before
        assert after.by_name("gft-dev-execution").plain_inputs()["triggers"] == [after.outputs["runId"]]
