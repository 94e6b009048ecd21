"""The shared foundation: only needed APIs, one identity per role, a bucket that outlives destroy."""

from __future__ import annotations

from infra.offline import run_stack


class TestApis:
    def test_cloud_run_enables_only_what_it_uses(self) -> None:
        run = run_stack("dev")
        apis = {r.plain_inputs()["service"] for r in run.of_type("gcp:projects/service:Service")}
        assert "run.googleapis.com" in apis and "secretmanager.googleapis.com" in apis
        assert "container.googleapis.com" not in apis and "cloudbuild.googleapis.com" not in apis

    def test_apis_are_never_disabled_on_destroy(self) -> None:
        for r in run_stack("dev").of_type("gcp:projects/service:Service"):
            assert r.plain_inputs()["disableOnDestroy"] is False, r.urn

    def test_cloud_build_mode_enables_cloud_build(self) -> None:
        run = run_stack("dev", overrides={"imageBuild": "cloud-build"})
        apis = {r.plain_inputs()["service"] for r in run.of_type("gcp:projects/service:Service")}
        assert "cloudbuild.googleapis.com" in apis

    def test_no_secret_manager_without_a_token(self) -> None:
        run = run_stack("dev", overrides={"recipe": "emoji-local"}, hf_token=None)
        assert run.of_type("gcp:secretmanager/secret:Secret") == []
        apis = {r.plain_inputs()["service"] for r in run.of_type("gcp:projects/service:Service")}
        assert "secretmanager.googleapis.com" not in apis


class TestBucket:
    def test_secure_bucket_kept_on_destroy_by_default(self) -> None:
        run = run_stack("dev")
        bucket = run.one("gcp:storage/bucket:Bucket")
        inputs = bucket.plain_inputs()
        assert inputs["uniformBucketLevelAccess"] is True
        assert inputs["publicAccessPrevention"] == "enforced"
        assert inputs["forceDestroy"] is False
        assert bucket.retain_on_delete is True
        assert run.outputs["bucketOnDestroy"].startswith("kept: `pulumi destroy` leaves gs://my-gcp-project-gft-dev ")

    def test_force_destroy_removes_bucket_and_contents(self) -> None:
        run = run_stack("dev", overrides={"bucketForceDestroy": True})
        bucket = run.one("gcp:storage/bucket:Bucket")
        assert bucket.plain_inputs()["forceDestroy"] is True
        assert bucket.retain_on_delete is False


class TestIdentities:
    def test_trainer_account_reads_and_writes_objects_of_this_bucket_only(self) -> None:
        run = run_stack("dev")
        binding = run.by_name("gft-dev-bucket-trainer").plain_inputs()
        assert binding["role"] == "roles/storage.objectUser"
        assert binding["bucket"] == run.one("gcp:storage/bucket:Bucket").plain_inputs()["name"]
        assert binding["member"] == "serviceAccount:gft-dev-train@my-gcp-project.iam.gserviceaccount.com"

    def test_serving_account_only_with_serving(self) -> None:
        assert len(run_stack("dev").of_type("gcp:serviceaccount/account:Account")) == 1
        run = run_stack("dev", overrides={"servingEnabled": True}, assume_trained=True)
        assert run.by_name("gft-dev-bucket-serving").plain_inputs()["role"] == "roles/storage.objectViewer"

    def test_secret_accessor_on_the_secret_only(self) -> None:
        run = run_stack("dev")
        binding = run.one("gcp:secretmanager/secretIamMember:SecretIamMember").plain_inputs()
        assert binding["role"] == "roles/secretmanager.secretAccessor"
        assert binding["secretId"] == "gft-dev-hf-token"
