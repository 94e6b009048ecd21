"""The shared foundation: only needed APIs, one identity per role, a bucket that outlives destroy."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from infra.foundation import BOOTSTRAP_APIS
from infra.offline.engine import REPO_ROOT, ProviderError, run_stack, stack_names
from tests.infra.conftest import PREBUILT


class TestApis:
    def test_cloud_run_enables_only_what_it_uses(self) -> None:
        run = run_stack("dev", overrides={"imageBuild": "docker"})
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
        bucket = run.by_name("gft-dev-bucket")
        inputs = bucket.plain_inputs()
        assert inputs["uniformBucketLevelAccess"] is True
        assert inputs["publicAccessPrevention"] == "enforced"
        assert inputs["forceDestroy"] is False
        assert bucket.retain_on_delete is True
        assert run.outputs["bucketOnDestroy"].startswith("kept: `pulumi destroy` leaves gs://my-gcp-project-gft-dev ")

    def test_force_destroy_removes_bucket_and_contents(self) -> None:
        run = run_stack("dev", overrides={"bucketForceDestroy": True})
        bucket = run.by_name("gft-dev-bucket")
        assert bucket.plain_inputs()["forceDestroy"] is True
        assert bucket.retain_on_delete is False


class TestIdentities:
    def test_trainer_account_reads_and_writes_objects_of_this_bucket_only(self) -> None:
        run = run_stack("dev")
        binding = run.by_name("gft-dev-bucket-trainer").plain_inputs()
        assert binding["role"] == "roles/storage.objectUser"
        assert binding["bucket"] == run.by_name("gft-dev-bucket").plain_inputs()["name"]
        assert binding["member"] == "serviceAccount:gft-dev-train@my-gcp-project.iam.gserviceaccount.com"

    def test_serving_account_only_with_serving(self) -> None:
        assert (
            len(run_stack("dev", overrides={"imageBuild": "docker"}).of_type("gcp:serviceaccount/account:Account")) == 1
        )
        run = run_stack("dev", overrides={"servingEnabled": True}, assume_trained=True)
        assert run.by_name("gft-dev-bucket-serving").plain_inputs()["role"] == "roles/storage.objectViewer"

    def test_secret_accessor_on_the_secret_only(self) -> None:
        run = run_stack("dev")
        binding = run.one("gcp:secretmanager/secretIamMember:SecretIamMember").plain_inputs()
        assert binding["role"] == "roles/secretmanager.secretAccessor"
        assert binding["secretId"] == "gft-dev-hf-token"


class TestBootstrap:
    """The program reads through Cloud Resource Manager (every `projects.Service` read) before it can enable it."""

    def test_resource_manager_api_is_enabled_by_every_stack(self) -> None:
        for stack in stack_names():
            apis = {r.plain_inputs()["service"] for r in run_stack(stack).of_type("gcp:projects/service:Service")}
            assert "cloudresourcemanager.googleapis.com" in apis, stack

    def test_readme_enables_the_bootstrap_apis_before_the_first_up(self) -> None:
        readme = (REPO_ROOT / "README.md").read_text()
        cloud_path = readme[readme.index("## The cloud path") :]
        lines = cloud_path.splitlines()
        enable = next(i for i, line in enumerate(lines) if line.startswith("gcloud services enable"))
        assert {w for w in lines[enable].split() if w.endswith(".googleapis.com")} == set(BOOTSTRAP_APIS), lines[enable]
        first_up = next(i for i, line in enumerate(lines) if line.startswith("pulumi up"))
        assert enable < first_up, "before the first `pulumi up`"
        billing = next(i for i, line in enumerate(lines) if line.startswith("gcloud billing projects link"))
        assert billing < enable, "Service Usage enables compute and run only in a project with billing"

    @pytest.mark.parametrize("stack", stack_names())
    def test_every_api_the_preflight_reads_is_enabled_before_the_first_up(self, stack: str) -> None:
        """The preflight's invokes run before any `projects.Service` exists: each API they call must be in the
        README's one-time enable line (a fresh project answers SERVICE_DISABLED otherwise)."""
        gke = stack != "dev"
        overrides = {**PREBUILT, "capacity": "spot"} if gke else dict(PREBUILT)
        run = run_stack(stack, overrides=overrides, remove=("reservationName",) if gke else ())
        modules = {token.split(":")[1].split("/")[0] for token, _ in run.invokes if token.startswith("gcp:")}
        called = {_INVOKE_APIS[module] for module in modules & set(_INVOKE_APIS)}
        assert "cloudquotas.googleapis.com" in called, "the check must see the quota read"
        assert called <= set(BOOTSTRAP_APIS), called - set(BOOTSTRAP_APIS)


EMPTY_PROJECT_VARIANTS = [
    (stack, over)
    for stack in stack_names()
    for over in ([{}, {"servingEnabled": True, "gpuZonalRedundancy": True}] if stack == "dev" else [{}])
]


class TestEmptyProject:
    """A new project: GPU quota 0 (Cloud Run gives none), and quotas listed only for services that are on."""

    @pytest.mark.parametrize("stack,extra", EMPTY_PROJECT_VARIANTS)
    def test_every_service_whose_quota_the_preflight_reads_is_enabled_first(
        self, stack: str, extra: dict[str, object]
    ) -> None:
        gke = stack != "dev"
        overrides = {**PREBUILT, **extra, **({"capacity": "spot"} if gke else {})}
        run = run_stack(stack, overrides=overrides, remove=("reservationName",) if gke else (), assume_trained=True)
        services = {a["service"] for t, a in run.invokes if t == "gcp:cloudquota/getSQuotaInfo:getSQuotaInfo"}
        assert services, "the preflight reads a GPU quota"
        assert services <= set(BOOTSTRAP_APIS), services - set(BOOTSTRAP_APIS)

    def test_quota_zero_stops_with_the_request_the_readme_shows(self) -> None:
        from infra.catalog import CLOUD_RUN_GPU_QUOTA
        from infra.offline.engine import mock_quota_info

        quota = CLOUD_RUN_GPU_QUOTA[("nvidia-l4", False)]
        with pytest.raises(Exception) as failed:
            run_stack(
                "dev",
                overrides={"gcp:project": "MY_PROJECT"},
                quotas={quota: mock_quota_info("run.googleapis.com", quota, 0)},
            )
        message = str(failed.value)
        assert "is 0" in message and "answers by email" in message and failed.value.declared_resources == []
        request = re.search(r"gcloud beta quotas preferences create \S.*?--email=YOU@example\.com", message)
        assert request is not None, message
        cloud_path = (REPO_ROOT / "docs" / "cloud-path.md").read_text()
        assert request.group(0) in cloud_path.splitlines(), "docs/cloud-path.md shows the command the preflight prints"
        assert "answers by email" in cloud_path, "and says how the answer comes"
        readme = (REPO_ROOT / "README.md").read_text()
        lines = readme[readme.index("## The cloud path") :].splitlines()
        at = lines.index(request.group(0))  # the README's cloud path makes the request, before the first up
        assert at < next(i for i, line in enumerate(lines) if line.startswith("pulumi up"))
        assert "answers the request by email, allow days" in lines[at - 1], lines[at - 1]

    @pytest.mark.skipif(shutil.which("gcloud") is None, reason="needs the Google Cloud CLI")
    def test_gcloud_itself_accepts_the_commands_the_preflight_prints(self, tmp_path: Path) -> None:
        """Parsed by the real gcloud, with no account: a command it accepts gets as far as asking for one
        (exit 1); a flag or a track it does not know is refused while parsing (exit 2)."""
        from infra.catalog import CLOUD_RUN_GPU_QUOTA
        from infra.offline.engine import mock_quota_info

        quota = CLOUD_RUN_GPU_QUOTA[("nvidia-l4", False)]
        commands = []
        answers = [
            mock_quota_info("run.googleapis.com", quota, 0),  # the request to make
            ProviderError("googleapi: Error 404: quota not found, notFound"),  # the list of quotas
            ProviderError("googleapi: Error 403: Cloud Quotas API has not been used in project, SERVICE_DISABLED"),
            ProviderError("googleapi: Error 403: permission denied, forbidden"),  # the grant to ask for
        ]
        for answer in answers:
            with pytest.raises(Exception) as failed:
                run_stack("dev", overrides={"gcp:project": "my-new-project"}, quotas={quota: answer})
            commands += re.findall(r"gcloud [^`;]*?(?=, or |`|;)", str(failed.value))
        for verb in ("quotas preferences create", "quotas info list", "services enable", "add-iam-policy-binding"):
            assert any(verb in c for c in commands), (verb, commands)
        readme = (REPO_ROOT / "README.md").read_text()
        block = readme[readme.index("## The cloud path") :].split("```")[1]
        typed = [line.split("  #")[0] for line in block.splitlines() if line.startswith("gcloud ")]
        assert len(typed) == 3, typed  # the billing link, the enable line, the quota request
        commands += [line.replace("MY_PROJECT", "my-new-project") for line in typed]
        env = {**os.environ, "CLOUDSDK_CONFIG": str(tmp_path), "CLOUDSDK_CORE_DISABLE_PROMPTS": "1"}
        for command in commands:
            done = subprocess.run(shlex.split(command), env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 1 and "active account" in done.stderr, (command, done.stderr)

    def test_a_quota_not_listed_names_the_service_to_enable(self) -> None:
        from infra.catalog import CLOUD_RUN_GPU_QUOTA

        quota = CLOUD_RUN_GPU_QUOTA[("nvidia-l4", False)]
        with pytest.raises(Exception) as failed:
            run_stack("dev", overrides={"gcp:project": "MY_PROJECT"}, quotas={quota: {}})
        assert "gcloud services enable run.googleapis.com --project MY_PROJECT" in str(failed.value)


# The API behind the provider module of an invoke token (`gcp:<module>/<fn>:<fn>`) the program calls in a
# project that may be fresh (a reservation's project runs VMs already, so its compute reads are left out).
_INVOKE_APIS = {"cloudquota": "cloudquotas.googleapis.com", "storage": "storage.googleapis.com"}


class TestWorkloadIdentityApi:
    """Pods that act as a Google account through Workload Identity get their tokens from the IAM Service
    Account Credentials API (the GKE metadata server's 403 otherwise: google/kctf#194): a stack that binds
    a Kubernetes service account to a Google one enables it, and its workloads wait for it
    (tests/infra/test_ordering.py: every runner waits for every API)."""

    @pytest.mark.parametrize("stack", stack_names())
    def test_stacks_that_bind_a_kubernetes_account_enable_the_credentials_api(self, stack: str) -> None:
        run = run_stack(stack)
        bound = [
            r
            for r in run.of_type("kubernetes:core/v1:ServiceAccount")
            if "iam.gke.io/gcp-service-account" in (r.plain_inputs()["metadata"].get("annotations") or {})
        ]
        apis = {r.plain_inputs()["service"] for r in run.of_type("gcp:projects/service:Service")}
        assert bool(bound) == ("iamcredentials.googleapis.com" in apis), (stack, sorted(apis))


class TestHfTokenOnlyWhereItIsRead:
    """Only the Cloud Run Job reads the token from Secret Manager; the GKE pods read a Kubernetes Secret."""

    def test_gke_stacks_keep_the_token_out_of_secret_manager(self) -> None:
        for stack in ("a4-gemma4", "ray-gemma3-vision"):
            run = run_stack(stack)
            assert [r.type for r in run.resources if r.type.startswith("gcp:secretmanager/")] == [], stack
            apis = {r.plain_inputs()["service"] for r in run.of_type("gcp:projects/service:Service")}
            assert "secretmanager.googleapis.com" not in apis, stack
            assert len(run.of_type("kubernetes:core/v1:Secret")) == 1, f"{stack}: the pods' token Secret"

    def test_cloud_run_reads_it_from_secret_manager(self) -> None:
        run = run_stack("dev")
        assert len(run.of_type("gcp:secretmanager/secretVersion:SecretVersion")) == 1


class TestNodeIdentity:
    def test_autopilot_nodes_run_as_the_stacks_node_account(self) -> None:
        for stack in ("a4-gemma4", "ray-gemma3-vision"):
            run = run_stack(stack)
            node = run.by_name(f"gft-{stack}-nodes-sa").outputs["email"]
            cluster = run.one("gcp:container/cluster:Cluster").plain_inputs()
            assert cluster["clusterAutoscaling"]["autoProvisioningDefaults"]["serviceAccount"] == node
            members = {r.plain_inputs()["member"] for r in run.resources if "iam" in r.type.lower() and r.custom}
            assert not [m for m in members if "-compute@developer" in m], "nothing goes to the default compute SA"

    def test_the_cluster_waits_for_the_node_accounts_grants(self) -> None:
        run = run_stack("a4-gemma4")
        cluster = run.one("gcp:container/cluster:Cluster")
        node = f"serviceAccount:{run.by_name('gft-a4-gemma4-nodes-sa').outputs['email']}"
        grants = [r.urn for r in run.resources if r.custom and r.plain_inputs().get("member") == node]
        assert grants and set(grants) <= set(cluster.dependencies)


class TestSoftDelete:
    """Soft delete is a per-bucket decision: off for the model bucket unless bucketSoftDeleteDays, never on staging."""

    @staticmethod
    def retention(run: object, name: str) -> int:
        bucket = run.by_name(name).plain_inputs()  # type: ignore[attr-defined]
        return int(bucket["softDeletePolicy"]["retentionDurationSeconds"])

    @pytest.mark.parametrize("stack", stack_names())
    def test_model_bucket_has_none_by_default(self, stack: str) -> None:
        assert self.retention(run_stack(stack), f"gft-{stack}-bucket") == 0

    def test_days_set_the_retention(self) -> None:
        run = run_stack("dev", overrides={"bucketSoftDeleteDays": 30, "imageBuild": "cloud-build"})
        assert self.retention(run, "gft-dev-bucket") == 30 * 86400
        assert self.retention(run, "gft-dev-build-staging") == 0, "build contexts: nothing to restore"

    @pytest.mark.parametrize("days", [1, 6, 91, -1])
    def test_a_retention_cloud_storage_refuses_fails_before_any_resource(self, days: int) -> None:
        with pytest.raises(Exception) as failed:
            run_stack("dev", overrides={"bucketSoftDeleteDays": days})
        message = str(failed.value)
        assert f"bucketSoftDeleteDays={days}" in message and "7 to 90" in message and "Fix:" in message
        assert failed.value.declared_resources == []  # type: ignore[attr-defined]

    def test_documented_where_destroy_is(self) -> None:
        assert "bucketSoftDeleteDays" in (REPO_ROOT / "docs" / "operations.md").read_text()
