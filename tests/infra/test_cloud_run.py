"""Stack `dev`: the Cloud Run training Job and the vLLM service, under mocks with the real Pulumi.dev.yaml."""

from __future__ import annotations

import json

import pulumi
import pytest

from infra import cloud_run
from infra.config import ConfigError
from infra.offline.engine import MOCK_TRAINED_RUN, is_secret, redact_secrets, run_stack
from serving.startup import FIRST_PROBE_WITHIN_S, PROBE_LIMITS, STARTUP_WINDOW, expected_start_s
from tests.infra.conftest import PREBUILT, plain_paths

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
        assert "delete" not in inputs and inputs["update"] == cloud_run.EXECUTE_UPDATE_SCRIPT
        assert "gcloud" not in inputs["update"], "nothing but a new run id starts training"
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

    def test_same_with_another_image(self) -> None:
        """A trainer image update alone is not a new run (infra/run_identity.py)."""
        other = PREBUILT["trainerImage"].replace("1" * 64, "3" * 64)
        base = run_stack("dev", overrides=PREBUILT).outputs["runId"]
        assert run_stack("dev", overrides={**PREBUILT, "trainerImage": other}).outputs["runId"] == base

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
        """No completed run in the bucket: a message (the listing finds nothing), not a 404 from a read."""
        with pytest.raises(pulumi.RunError, match="no training run of recipe emoji-gemma3-1b has finished yet") as info:
            run_stack("dev", overrides={**PREBUILT, "servingEnabled": True})
        assert "gcloud run jobs executions list" in str(info.value)
        assert "pulumi config set servingEnabled false" in str(info.value)

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
        assert (
            probe["initialDelaySeconds"] + probe["periodSeconds"] * probe["failureThreshold"] == STARTUP_WINDOW.total_s
        )
        assert template["volumes"][0]["gcs"]["readOnly"] is True
        assert container["ports"] == {"containerPort": 8000}

    def test_vllm_serves_the_completed_run(self) -> None:
        run = run_stack("dev", overrides={**PREBUILT, "servingEnabled": True}, assume_trained=True)
        args = run.one(SERVICE).plain_inputs()["template"]["containers"][0]["args"]
        assert args[0] == f"/mnt/models/runs/emoji-gemma3-1b-{MOCK_TRAINED_RUN}/merged"
        assert args[args.index("--served-model-name") + 1] == "emoji-gemma3-1b"
        assert run.outputs["servingRunId"] == MOCK_TRAINED_RUN
        assert run.outputs["servedModelUri"].endswith(f"/runs/emoji-gemma3-1b-{MOCK_TRAINED_RUN}/merged")

    def test_zonal_redundancy_is_a_choice_for_the_service(self) -> None:
        run = run_stack(
            "dev", overrides={**PREBUILT, "servingEnabled": True, "gpuZonalRedundancy": True}, assume_trained=True
        )
        assert run.one(SERVICE).plain_inputs()["template"]["gpuZonalRedundancyDisabled"] is False

    def test_extra_vllm_flags_pass_through(self) -> None:
        run = run_stack(
            "dev",
            overrides={**PREBUILT, "servingEnabled": True, "servingExtraArgs": ["--no-enable-prefix-caching"]},
            assume_trained=True,
        )
        assert run.one(SERVICE).plain_inputs()["template"]["containers"][0]["args"][-1] == "--no-enable-prefix-caching"
        query = redact_secrets(run.outputs)["query"]
        assert query.startswith("GEMMA_FT_URL=https://") and " python -m serving.client --model " in query, query


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


SERVING = {**PREBUILT, "servingEnabled": True}
BUCKET = "my-gcp-project-gft-dev"
FILES = {"config.json": 900, "model.safetensors": 2_000_000, "tokenizer.json": 30_000}


def completed_run(
    rid: str, files: dict[str, int] | None = None, missing: tuple[str, ...] = (), summary: bool = True
) -> dict[str, str]:
    """What a finished training run leaves in the bucket: its summary (without held-out rows: no loss), then its
    export and the marker listing it (trainer/export.py publish_run)."""
    folder = f"{BUCKET}/runs/emoji-gemma3-1b-{rid}/merged"
    files = files or FILES
    objects = {}
    if summary:
        objects[f"{BUCKET}/runs/emoji-gemma3-1b-{rid}/run_summary.json"] = json.dumps({"eval_loss": None})
    objects.update({f"{folder}/{name}": "x" for name in files if name not in missing})
    inventory = [{"path": name, "bytes": size} for name, size in files.items()]
    objects[f"{folder}/_COMPLETE.json"] = json.dumps({"completed_at": 1, "files": inventory})
    return objects


def served_path(run) -> str:  # type: ignore[no-untyped-def]
    return run.one(SERVICE).plain_inputs()["template"]["containers"][0]["args"][0]


class TestPinnedRun:
    """Issue: serving followed the CURRENT run id, so any recipe or image change broke `up` with serving on."""

    def test_retraining_with_serving_on_keeps_serving_the_finished_run(self) -> None:
        first = run_stack("dev", overrides=PREBUILT).outputs["runId"]
        changed = run_stack(
            "dev",
            overrides={**SERVING, "recipeOverrides": ["training.learning_rate=0.0001"]},
            bucket_objects=completed_run(first),
        )
        new_run = changed.outputs["runId"]
        assert new_run != first, "the recipe change starts a new training run"
        assert changed.by_name("gft-dev-execution").plain_inputs()["triggers"] == [new_run]
        assert served_path(changed) == f"/mnt/models/runs/emoji-gemma3-1b-{first}/merged"
        assert changed.outputs["servingRunId"] == first

    def test_the_latest_completed_run_is_served(self) -> None:
        run = run_stack("dev", overrides=SERVING, bucket_objects={**completed_run("a" * 12), **completed_run("b" * 12)})
        assert served_path(run).endswith(f"-{'b' * 12}/merged")
        older_last = {**completed_run("b" * 12), **completed_run("a" * 12)}
        assert served_path(run_stack("dev", overrides=SERVING, bucket_objects=older_last)).endswith(
            f"-{'a' * 12}/merged"
        )

    def test_serving_run_id_pins_an_older_run(self) -> None:
        objects = {**completed_run("a" * 12), **completed_run("b" * 12)}
        run = run_stack("dev", overrides={**SERVING, "servingRunId": "a" * 12}, bucket_objects=objects)
        assert served_path(run).endswith(f"-{'a' * 12}/merged")

    def test_pinning_a_run_that_has_not_finished_says_which_have(self) -> None:
        with pytest.raises(pulumi.RunError, match=r"servingRunId=cccccccccccc has no complete model") as info:
            run_stack("dev", overrides={**SERVING, "servingRunId": "c" * 12}, bucket_objects=completed_run("a" * 12))
        assert f"Completed runs of emoji-gemma3-1b: {'a' * 12}" in str(info.value)

    def test_an_export_missing_a_listed_file_is_not_served(self) -> None:
        """serving/completion.py's inventory check, on the bucket listing (names; sizes are checked at start-up)."""
        with pytest.raises(pulumi.RunError, match=r"not servable: .*missing \(model\.safetensors\)"):
            run_stack("dev", overrides=SERVING, bucket_objects=completed_run("a" * 12, missing=("model.safetensors",)))

    def test_other_recipes_runs_are_not_served(self) -> None:
        foreign = {k.replace("emoji-gemma3-1b", "emoji-local"): v for k, v in completed_run("a" * 12).items()}
        with pytest.raises(pulumi.RunError, match="no training run of recipe emoji-gemma3-1b has finished"):
            run_stack("dev", overrides=SERVING, bucket_objects=foreign)

    def test_bad_run_id_fails_before_anything_is_declared(self) -> None:
        with pytest.raises(ConfigError, match="servingRunId='run-1' is not a run id") as info:
            run_stack("dev", overrides={**SERVING, "servingRunId": "run-1"})
        assert info.value.declared_resources == []  # type: ignore[attr-defined]


class TestStartupWindow:
    def test_the_programs_docstring_states_the_window_it_renders(self) -> None:
        """infra/cloud_run.py said 120 s + 24 x 10 s = 360 s after serving/startup.py moved to 30 s and 270 s."""
        import infra.serving

        w = STARTUP_WINDOW
        stated = f"{w.initial_delay_s} s initial delay + {w.failure_threshold} x {w.period_s} s = {w.total_s} s"
        assert stated in " ".join((infra.serving.__doc__ or "").split())

    def test_probe_starts_early_and_spans_the_stated_window_within_cloud_run_limits(self) -> None:
        """A ready vLLM must not sit idle on a billed L4: the first probe comes within FIRST_PROBE_WITHIN_S.

        The probe used to wait 240 s (initial_delay_seconds) before its first request, so every cold start
        took at least 240 s. The rest of the window is failures x period, checked against the limits table
        (PROBE_LIMITS, each limit with the page that states it).
        """
        run = run_stack("dev", overrides=SERVING, assume_trained=True)
        container = run.one(SERVICE).plain_inputs()["template"]["containers"][0]
        probe = container["startupProbe"]
        assert probe["initialDelaySeconds"] <= FIRST_PROBE_WITHIN_S <= expected_start_s()[0]
        # the start the probe is fitted to: vLLM eager (no compile, no CUDA graphs), weights read whole
        args = container["args"]
        assert "--enforce-eager" in args
        assert args[args.index("--safetensors-load-strategy") + 1] == "eager"
        rendered = {
            "initialDelaySeconds": probe["initialDelaySeconds"],
            "periodSeconds": probe["periodSeconds"],
            "timeoutSeconds": probe["timeoutSeconds"],
            "failureThresholdTimesPeriodSeconds": probe["periodSeconds"] * probe["failureThreshold"],
        }
        assert set(rendered) == set(PROBE_LIMITS)
        for field, value in rendered.items():
            low, high, source = PROBE_LIMITS[field]
            assert low <= value <= high, f"{field}={value} outside {low}..{high} ({source})"
            assert "https://" in source, f"{field}'s limit names no source"
        assert probe["timeoutSeconds"] <= probe["periodSeconds"]
        window = int(probe["initialDelaySeconds"] + probe["periodSeconds"] * probe["failureThreshold"])
        assert window == STARTUP_WINDOW.total_s
        # the probe's share is as large as the limit allows: the window is not shortened for nothing
        assert rendered["failureThresholdTimesPeriodSeconds"] == PROBE_LIMITS["failureThresholdTimesPeriodSeconds"][1]
        env = {e["name"]: e.get("value") for e in container["envs"]}
        assert env["GEMMA_FT_STARTUP_WINDOW_S"] == str(window)
        # the entrypoint's marker wait is spent inside the window, never on top of it, and is capped by startup.py
        assert int(env["GEMMA_FT_WAIT_FOR_MODEL_S"]) + STARTUP_WINDOW.vllm_budget_s == window
        assert env["GEMMA_FT_MAX_MARKER_WAIT_S"] == str(STARTUP_WINDOW.max_marker_wait_s)

    def test_the_marker_wait_is_not_a_stack_setting_and_the_refusal_says_why(self) -> None:
        """servingEnv refuses the entrypoint's variables; the message must not point at a setting that does not exist."""
        with pytest.raises(ConfigError) as info:
            run_stack("dev", overrides={**SERVING, "servingEnv": ["GEMMA_FT_WAIT_FOR_MODEL_S=120"]})
        message = str(info.value)
        assert "typed setting" not in message
        assert "serving/startup.py" in message and "marker wait is 0" in message, message


class TestServingSettings:
    def test_concurrency_matches_vllms_batch(self) -> None:
        for gpu, expected in (("nvidia-l4", 256), ("nvidia-rtx-pro-6000", 1000)):
            run = run_stack("dev", overrides={**SERVING, "servingGpuType": gpu}, assume_trained=True)
            template = run.one(SERVICE).plain_inputs()["template"]
            args = template["containers"][0]["args"]
            assert template["maxInstanceRequestConcurrency"] == expected
            assert args[args.index("--max-num-seqs") + 1] == str(expected)
        run = run_stack("dev", overrides={**SERVING, "servingConcurrency": 32}, assume_trained=True)
        assert run.one(SERVICE).plain_inputs()["template"]["maxInstanceRequestConcurrency"] == 32

    def test_extra_env_reaches_the_container(self) -> None:
        run = run_stack("dev", overrides={**SERVING, "servingEnv": ["VLLM_LOGGING_LEVEL=DEBUG"]}, assume_trained=True)
        envs = run.one(SERVICE).plain_inputs()["template"]["containers"][0]["envs"]
        assert {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"} in envs

    @pytest.mark.parametrize(
        ("entry", "message"),
        [
            ("HF_HUB_OFFLINE=0", "which the program or Cloud Run sets itself"),
            ("PORT=9000", "which the program or Cloud Run sets itself"),
            ("MY_API_KEY=abc", "secrets belong in Secret Manager"),
            ("no-equals", "must be NAME=value"),
        ],
    )
    def test_extra_env_refusals(self, entry: str, message: str) -> None:
        with pytest.raises(ConfigError, match=message):
            run_stack("dev", overrides={**SERVING, "servingEnv": [entry]})

    @pytest.mark.parametrize(
        ("extra", "flag", "index"),
        [
            (["--api-k", "sk-not-a-real-key-123"], "--api-key", 0),
            (["--disable-log-requests", "--hf-t=hf_notarealtoken123"], "--hf-token", 1),
            (["--middle", "not.a.RealMiddleware"], "--middleware", 0),
            (["--po", "9"], "--port", 0),
        ],
    )
    def test_abbreviated_refused_flags_in_extra_args_are_refused_at_config(
        self, extra: list[str], flag: str, index: int
    ) -> None:
        """vLLM's argparse expands a unique prefix (allow_abbrev): `--api-k KEY` would start vLLM with --api-key KEY."""
        with pytest.raises(ConfigError) as info:
            run_stack("dev", overrides={**SERVING, "servingExtraArgs": extra})
        message = str(info.value)
        assert f"servingExtraArgs[{index}] is vLLM's" in message and flag in message, message
        assert f"pulumi config rm --path 'servingExtraArgs[{index}]'" in message
        assert "not-a-real" not in message and "notarealtoken" not in message and "RealMiddleware" not in message

    @pytest.mark.parametrize(
        ("extra", "flag", "index"),
        [
            (["--api-key", "sk-not-a-real-key-123"], "--api-key", 0),
            (["--disable-log-requests", "--api_key=sk-not-a-real-key-123"], "--api-key", 1),
            (["--hf-token", "hf_notarealtoken123"], "--hf-token", 0),
        ],
    )
    def test_secret_flags_in_extra_args_are_refused(self, extra: list[str], flag: str, index: int) -> None:
        """A credential as a container arg is plain text in the state and the revision: servingApiKey is the way."""
        with pytest.raises(ConfigError) as info:
            run_stack("dev", overrides={**SERVING, "servingExtraArgs": extra})
        message = str(info.value)
        assert f"servingExtraArgs[{index}] is vLLM's {flag}" in message, message
        assert f"pulumi config rm --path 'servingExtraArgs[{index}]'" in message
        if flag == "--api-key":
            assert "pulumi config set --secret servingApiKey" in message
        assert "not-a-real" not in message and "notarealtoken" not in message, "the secret is never repeated"


class TestApiKey:
    KEY = "vllm-key-not-a-real-credential"

    def test_key_goes_secret_manager_to_env_by_reference(self) -> None:
        run = run_stack(
            "dev", overrides={**SERVING, "servingPublic": True, "servingApiKey": self.KEY}, assume_trained=True
        )
        version = next(r for r in run.of_type("gcp:secretmanager/secretVersion:SecretVersion") if "api-key" in r.name)
        assert is_secret(version.inputs["secretData"])
        envs = {e["name"]: e for e in run.one(SERVICE).plain_inputs()["template"]["containers"][0]["envs"]}
        ref = envs["VLLM_API_KEY"]["valueSource"]["secretKeyRef"]
        assert ref["secret"] == "gft-dev-vllm-api-key" and "value" not in envs["VLLM_API_KEY"]
        grant = next(r for r in run.of_type("gcp:secretmanager/secretIamMember:SecretIamMember") if "api-key" in r.name)
        assert grant.plain_inputs()["member"] == "serviceAccount:gft-dev-serve@my-gcp-project.iam.gserviceaccount.com"
        assert grant.plain_inputs()["role"] == "roles/secretmanager.secretAccessor"
        assert grant.urn in run.one(SERVICE).dependencies, "a Service referencing a secret needs the grant first"
        for resource in run.resources:
            assert plain_paths(resource.inputs, self.KEY) == [], resource.urn
        assert "secretmanager.googleapis.com" in {
            r.plain_inputs()["service"] for r in run.of_type("gcp:projects/service:Service")
        }

    @staticmethod
    def _container(overrides: dict[str, object]) -> dict[str, object]:
        run = run_stack("dev", overrides={**SERVING, **overrides}, assume_trained=True)
        return run.one(SERVICE).plain_inputs()["template"]["containers"][0]

    def test_with_a_key_vllm_loads_the_guard_for_every_route(self) -> None:
        """vLLM alone checks the key only under /v1, /v2, /inference, /cohere; /invocations served completions
        without it (vllm-project/vllm#58144). With a key the service must load serving/api_key_guard.py."""
        from serving.vllm_args import API_KEY_GUARD_MIDDLEWARE

        for public in (True, False):
            args = self._container({"servingPublic": public, "servingApiKey": self.KEY})["args"]
            assert args[args.index("--middleware") + 1] == API_KEY_GUARD_MIDDLEWARE, args
            assert args.count("--middleware") == 1
            assert self.KEY not in args

    def test_without_a_key_no_guard(self) -> None:
        """Nothing to check without a key (the guard would pass everything): the args stay vLLM's plain ones."""
        for public in (True, False):
            assert "--middleware" not in self._container({"servingPublic": public})["args"]

    def test_startup_probe_is_the_one_path_the_guard_leaves_open(self) -> None:
        """Cloud Run's probe sends no Authorization header; with the guard every other path needs the key
        (tests/serving/test_api_key_guard.py shows both over HTTP), so the probe must use an open path."""
        from serving.api_key_guard import OPEN_PATHS

        container = self._container({"servingPublic": True, "servingApiKey": self.KEY})
        assert container["startupProbe"]["httpGet"]["path"] in OPEN_PATHS
        assert "livenessProbe" not in container or container["livenessProbe"]["httpGet"]["path"] in OPEN_PATHS

    def test_public_warns_only_without_a_key(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without a key a public service is free GPU inference; with one every route but /health needs it."""
        warned: list[str] = []
        monkeypatch.setattr(pulumi.log, "warn", lambda message, *a, **k: warned.append(str(message)))
        run_stack("dev", overrides={**SERVING, "servingPublic": True}, assume_trained=True)
        assert any("servingPublic=true without servingApiKey" in w for w in warned), warned
        warned.clear()
        run_stack("dev", overrides={**SERVING, "servingPublic": True, "servingApiKey": self.KEY}, assume_trained=True)
        assert not [w for w in warned if "servingPublic" in w or "servingApiKey" in w], warned

    def test_every_description_of_the_keys_scope_says_what_is_guarded(self) -> None:
        """The docs used to say the key guards /v1 only, then that /invocations stays open; with the guard the
        key covers every route except /health, and each description must say so and not the old scope. The
        one-line key descriptions say the scope; the pages say why (/invocations, open in vLLM alone)."""
        from pathlib import Path

        import yaml

        from infra import serving as serving_module
        from serving.vllm_args import VLLM_HEALTH_PATH, VLLM_KEYLESS_INFERENCE_ROUTE

        root = Path(__file__).resolve().parents[2]
        config = yaml.safe_load((root / "Pulumi.yaml").read_text())["config"]
        serving = (root / "docs" / "serving.md").read_text()
        cloud_run_page = (root / "docs" / "cloud-run.md").read_text()
        guard = cloud_run_page[cloud_run_page.index("### The API key guard") :]
        docs = {
            "Pulumi.yaml servingApiKey": config["servingApiKey"]["description"],
            "Pulumi.yaml servingPublic": config["servingPublic"]["description"],
            "docs/serving.md": serving[serving.index("**`servingPublic: true`") :][:1800],
            "infra/serving.py": serving_module.__doc__ or "",
        }
        guard = guard[: guard.find("\n#", 1)]
        flat_guard = " ".join(guard.split()).replace("`", "")
        assert "except OPEN_PATHS, /health only" in flat_guard and VLLM_KEYLESS_INFERENCE_ROUTE in flat_guard, guard
        program = (root / "docs" / "program.md").read_text()
        docs["docs/program.md servingApiKey"] = next(
            row for row in program.splitlines() if "| `servingApiKey` |" in row
        )
        for where, text in docs.items():
            flat = " ".join(text.split()).replace("`", "")
            if where == "Pulumi.yaml servingPublic":  # one line: pair it with the key; no scope to state
                assert "servingApiKey" in flat and not any(s in flat for s in ("/v1 routes", "stays open")), flat
                continue
            assert f"every route except {VLLM_HEALTH_PATH}" in flat or f"every route but {VLLM_HEALTH_PATH}" in flat, (
                f"{where} does not say the key covers every route but {VLLM_HEALTH_PATH}"
            )
            for stale in ("/v1 routes", "does not close it", "stays open", "stay open", "is not access control"):
                assert stale not in flat, f"{where} still says {stale!r}"
            if not where.startswith(("Pulumi.yaml", "docs/program.md")):  # one line: the why is on the linked pages
                assert VLLM_KEYLESS_INFERENCE_ROUTE in flat, f"{where} does not say why: vLLM alone leaves it open"

    def test_no_key_no_secret(self) -> None:
        run = run_stack("dev", overrides=SERVING, assume_trained=True)
        assert not [r for r in run.resources if "api-key" in r.name]


DOCKER_SERVING = {"servingEnabled": True, "imageBuild": "docker"}


class TestVllmImage:
    """servingVllmImage is a typed setting that reaches the serving build as VLLM_IMAGE (it used to be never passed)."""

    def test_docker_build_gets_the_build_argument(self) -> None:
        image = "vllm/vllm-openai:v0.27.1-cu129"
        run = run_stack("dev", overrides={**DOCKER_SERVING, "servingVllmImage": image}, assume_trained=True)
        builds = {r.name: r.plain_inputs() for r in run.of_type("docker-build:index:Image")}
        assert builds["gft-dev-serving"]["buildArgs"] == {"VLLM_IMAGE": image}
        assert "buildArgs" not in builds["gft-dev-trainer"]

    def test_default_is_the_dockerfile_default(self) -> None:
        from serving.vllm_args import VLLM_IMAGE

        run = run_stack("dev", overrides=DOCKER_SERVING, assume_trained=True)
        serving = next(r for r in run.of_type("docker-build:index:Image") if r.name == "gft-dev-serving")
        assert serving.plain_inputs()["buildArgs"] == {"VLLM_IMAGE": VLLM_IMAGE}

    def test_cloud_build_gets_it_and_a_change_rebuilds(self) -> None:
        def build(image: str) -> dict:  # type: ignore[type-arg]
            run = run_stack(
                "dev",
                overrides={"servingEnabled": True, "imageBuild": "cloud-build", "servingVllmImage": image},
                assume_trained=True,
            )
            return next(r for r in run.of_type("command:local:Command") if "serving" in r.name).plain_inputs()

        first, second = build("vllm/vllm-openai:v0.27.1-cu129"), build("vllm/vllm-openai:v0.28.0-cu129")
        assert first["environment"]["VLLM_IMAGE"] == "vllm/vllm-openai:v0.27.1-cu129"
        assert first["triggers"] != second["triggers"], "another base image must trigger another build"

    @pytest.mark.parametrize(
        ("image", "gpu", "message"),
        [
            ("vllm/vllm-openai:latest", "nvidia-l4", "exact tag or digest"),
            ("vllm/vllm-openai", "nvidia-l4", "exact tag or digest"),
            ("vllm/vllm-openai:v0.28.0-cu130", "nvidia-l4", "CUDA 13 build"),
        ],
    )
    def test_refusals(self, image: str, gpu: str, message: str) -> None:
        with pytest.raises(ConfigError, match=message):
            run_stack("dev", overrides={**SERVING, "servingVllmImage": image, "servingGpuType": gpu})

    @pytest.mark.parametrize(
        "image",
        ["vllm/vllm-openai:v0.28.0", "vllm/vllm-openai:v0.20.0", "docker.io/vllm/vllm-openai:v0.28.0-ubuntu2404"],
    )
    def test_a_bare_tag_from_v0_20_is_cuda13_and_refused_on_l4(self, image: str) -> None:
        """From vLLM v0.20 the unsuffixed tag is the CUDA 13.0 build (vllm-project/vllm#39878); L4's driver is 535."""
        with pytest.raises(ConfigError) as info:
            run_stack("dev", overrides={**SERVING, "servingVllmImage": image})
        message = str(info.value)
        release = image.split(":")[1].split("-")[0]
        assert f"servingVllmImage={image!r} is a CUDA 13 build" in message, message
        assert "-cu129" in message and "driver is 535" in message, "what is allowed, and why"
        repo = image.split(":")[0]
        assert f"pulumi config set servingVllmImage {repo}:{release}-cu129" in message, "the command that fixes it"

    @pytest.mark.parametrize(
        "image", ["vllm/vllm-openai:v0.28.0-cu129", "vllm/vllm-openai:v0.19.1", "vllm/vllm-openai@sha256:" + "a" * 64]
    )
    def test_cuda12_builds_are_fine_on_l4(self, image: str) -> None:
        run = run_stack("dev", overrides={**DOCKER_SERVING, "servingVllmImage": image}, assume_trained=True)
        serving = next(r for r in run.of_type("docker-build:index:Image") if r.name == "gft-dev-serving")
        assert serving.plain_inputs()["buildArgs"] == {"VLLM_IMAGE": image}

    def test_the_default_is_a_cuda12_build_that_l4_accepts(self) -> None:
        from serving.vllm_args import VLLM_IMAGE, image_cuda_major

        assert image_cuda_major(VLLM_IMAGE) == 12, VLLM_IMAGE
        run_stack("dev", overrides={**SERVING, "servingGpuType": "nvidia-l4"}, assume_trained=True)

    def test_cuda13_is_fine_on_rtx_pro_6000(self) -> None:
        run_stack(
            "dev",
            overrides={
                **SERVING,
                "servingVllmImage": "vllm/vllm-openai:v0.28.0-cu130",
                "servingGpuType": "nvidia-rtx-pro-6000",
            },
            assume_trained=True,
        )
