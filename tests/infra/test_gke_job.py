"""The a4-gemma4 stack under mocks: the training Job, its identity, capacity and re-run semantics.

Every run uses the real `Pulumi.a4-gemma4.yaml` (images prebuilt by digest so the image is a
controlled input); every Kubernetes object it declares is validated strictly against the 1.33 schemas.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from infra import gke_job, gke_workload
from infra.config import ConfigError
from infra.offline.engine import MOCK_HF_TOKEN, Recorded, StackRun, is_secret, run_stack
from tests.infra.conftest import PREBUILT, contains, plain_paths
from tests.infra.k8s_validate import k8s_resources, manifest, validate_object, validate_pod_template
from trainer import launch
from trainer import recipe as trainer_recipe

STACK = "a4-gemma4"
JOB = "kubernetes:batch/v1:Job"
SERVICE = "kubernetes:core/v1:Service"
OTHER_IMAGE = "us-central1-docker.pkg.dev/p/r/trainer@sha256:" + "9" * 64


def run(**overrides: Any) -> StackRun:
    return run_stack(STACK, overrides={**PREBUILT, **overrides})


@pytest.fixture(scope="module")
def single() -> StackRun:
    return run()


@pytest.fixture(scope="module")
def multi() -> StackRun:
    return run(nodes=2, recipeOverrides=["distributed.world_size=16"])


def job_of(stack_run: StackRun) -> dict[str, Any]:
    return manifest(stack_run.one(JOB))


def container_of(job: dict[str, Any]) -> dict[str, Any]:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """The kubelet's `$(VAR)` expansion of container args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


class TestEveryObjectValidates:
    """A wrong field name or type ships silently to a cluster that rejects it at apply time."""

    @pytest.mark.parametrize("fixture", ["single", "multi"])
    def test_strict_schema(self, fixture: str, request: pytest.FixtureRequest) -> None:
        stack_run: StackRun = request.getfixturevalue(fixture)
        objects = k8s_resources(stack_run.resources)
        assert {r.type for r in objects} >= {JOB, "kubernetes:core/v1:Namespace", "kubernetes:core/v1:Secret"}
        for r in objects:
            validate_object(manifest(r))

    def test_pod_template_is_a_valid_pod(self, single: StackRun) -> None:
        validate_pod_template(job_of(single)["spec"]["template"])

    def test_every_k8s_object_uses_the_cluster_provider(self, single: StackRun) -> None:
        provider = single.one("pulumi:providers:kubernetes")
        for r in k8s_resources(single.resources):
            assert r.provider.startswith(provider.urn), f"{r.urn} uses {r.provider or 'the default provider'}"


class TestTrainingJob:
    def test_whole_a4_node(self, single: StackRun) -> None:
        resources = container_of(job_of(single))["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == "8"
        assert resources["requests"] == resources["limits"], "requests = limits"
        assert set(resources["limits"]) == {"nvidia.com/gpu", "cpu", "memory", "ephemeral-storage"}

    def test_stays_below_the_a4_machine(self) -> None:
        share = gke_workload.GPU_SHARE["nvidia-b200"]
        assert share.cpu * 8 < 224 and share.memory_gib * 8 * 1.074 < 3968, "a4-highgpu-8g: 224 vCPU / 3,968 GB"

    def test_every_gke_accelerator_has_a_pod_share(self) -> None:
        from infra.catalog import GKE_ACCELERATORS

        assert set(gke_workload.GPU_SHARE) == set(GKE_ACCELERATORS)

    def test_accelerate_gets_eight_processes(self, single: StackRun) -> None:
        container = container_of(job_of(single))
        assert container["command"] == ["python", "-m", "trainer.launch"]
        args = launch.parse_args(container["args"])
        assert args.nproc_per_node == 8 and args.nnodes == 1 and args.recipe == "text-to-sql-gemma4-31b"
        assert launch.total_processes(args.nproc_per_node, args.num_processes, args.nnodes) == 8

    def test_image_by_digest(self, single: StackRun) -> None:
        assert container_of(job_of(single))["image"] == PREBUILT["trainerImage"] == single.outputs["trainerImage"]

    def test_output_dir_is_the_run_dir_output(self, single: StackRun) -> None:
        args = launch.parse_args(container_of(job_of(single))["args"])
        job_name = single.outputs["jobName"]
        assert args.overrides[-1] == f"output.dir={single.outputs['runDir']}"
        assert single.outputs["runDir"] == f"gs://my-gcp-project-gft-a4-gemma4/runs/{job_name}"
        assert single.outputs["tensorboardLogs"] == f"{single.outputs['runDir']}/logs"

    def test_recipe_overrides_pass_through_in_order(self) -> None:
        overrides = ["training.max_steps=10", "training.learning_rate=2e-5"]
        stack_run = run(recipeOverrides=overrides)
        args = launch.parse_args(container_of(job_of(stack_run))["args"])
        assert args.overrides[:2] == overrides and args.overrides[2].startswith("output.dir=gs://")

    def test_pulumi_does_not_wait_for_training(self, single: StackRun) -> None:
        """A `waitFor` met at creation (pulumi-kubernetes' Job await would wait for the run); no `skipAwait`, which
        would skip the delete await too (tests/infra/test_delete_timeouts.py)."""
        annotations = job_of(single)["metadata"]["annotations"]
        assert annotations["pulumi.com/waitFor"] == "jsonpath={.metadata.uid}"
        assert "pulumi.com/skipAwait" not in annotations

    def test_failure_policy_and_deadlines(self, single: StackRun) -> None:
        spec = job_of(single)["spec"]
        pod = spec["template"]["spec"]
        assert pod["restartPolicy"] == "Never"
        assert spec["podFailurePolicy"]["rules"] == [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
        ]
        assert spec["backoffLimit"] == 2, "trainingRetries in the stack file"
        assert spec["activeDeadlineSeconds"] == 480 * 60
        assert spec["ttlSecondsAfterFinished"] > 0
        assert pod["terminationGracePeriodSeconds"] >= 300, "time to flush a checkpoint"

    def test_shared_memory(self, single: StackRun) -> None:
        pod = job_of(single)["spec"]["template"]["spec"]
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container_of(job_of(single))["volumeMounts"]

    def test_runs_as_non_root(self, single: StackRun) -> None:
        job = job_of(single)
        pod = job["spec"]["template"]["spec"]
        assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        assert pod["automountServiceAccountToken"] is False
        assert container_of(job)["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }

    def test_no_tolerations(self, single: StackRun) -> None:
        assert "tolerations" not in job_of(single)["spec"]["template"]["spec"], "Autopilot adds them itself"

    def test_outputs_tell_how_to_watch(self, single: StackRun) -> None:
        out = single.outputs
        assert out["clusterName"] == "gft-a4-gemma4"
        assert out["getCredentials"] == (
            "gcloud container clusters get-credentials gft-a4-gemma4 --region us-central1 --project my-gcp-project"
        )
        assert out["logs"] == f"kubectl logs -f job/{out['jobName']} -n gft-a4-gemma4"
        assert out["adapter"].startswith(out["runDir"])
        assert out["worldSize"] == 8


class TestSecretsAndIdentity:
    def test_hf_token_only_by_reference(self, single: StackRun) -> None:
        env = container_of(job_of(single))["env"]
        hf = [e for e in env if e["name"] == "HF_TOKEN"]
        assert hf == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-secret", "key": "hf_api_token"}}}]
        secret = manifest(single.one("kubernetes:core/v1:Secret"))
        assert secret["metadata"]["name"] == "hf-secret" and "hf_api_token" in secret["stringData"]

    def test_token_never_plain(self, single: StackRun) -> None:
        for r in single.resources:
            assert not plain_paths(r.inputs, MOCK_HF_TOKEN), f"{r.urn} holds the token in plain text"
        assert not contains(single.one(JOB).inputs, MOCK_HF_TOKEN), "the Job carries no token at all"
        assert MOCK_HF_TOKEN not in repr(single.outputs)

    def test_k8s_secret_is_wrapped(self, single: StackRun) -> None:
        string_data = single.one("kubernetes:core/v1:Secret").inputs["stringData"]
        assert is_secret(string_data) or is_secret(string_data.get("hf_api_token"))

    def test_workload_identity(self, single: StackRun) -> None:
        gsa = single.by_name("gft-a4-gemma4-trainer-sa").outputs["email"]
        ksa = manifest(single.one("kubernetes:core/v1:ServiceAccount"))
        assert ksa["metadata"]["annotations"] == {"iam.gke.io/gcp-service-account": gsa}
        binding = single.one("gcp:serviceaccount/iAMMember:IAMMember")
        inputs = binding.plain_inputs()
        assert inputs["role"] == "roles/iam.workloadIdentityUser"
        assert inputs["member"] == "serviceAccount:my-gcp-project.svc.id.goog[gft-a4-gemma4/trainer]"
        assert inputs["serviceAccountId"].endswith(gsa), "bound on the trainer GSA, not the project"
        assert job_of(single)["spec"]["template"]["spec"]["serviceAccountName"] == ksa["metadata"]["name"]

    def test_binding_waits_for_the_identity_pool(self, single: StackRun) -> None:
        cluster = single.one("gcp:container/cluster:Cluster")
        assert cluster.urn in single.one("gcp:serviceaccount/iAMMember:IAMMember").dependencies

    def test_project_level_iam_only_for_node_logs_and_metrics(self, single: StackRun) -> None:
        project_level = [r.plain_inputs() for r in single.resources if r.type.startswith("gcp:projects/iAM")]
        node = "serviceAccount:gft-a4-gemma4-node@my-gcp-project.iam.gserviceaccount.com"
        assert project_level == [
            {"project": "my-gcp-project", "role": "roles/container.defaultNodeServiceAccount", "member": node}
        ]
        for r in single.resources:
            assert r.plain_inputs().get("role") != "roles/storage.admin", r.urn


class TestJobName:
    """`pulumi up` re-runs training exactly when the image, the recipe or the run's shape changed."""

    def test_stable_for_the_same_inputs(self, single: StackRun) -> None:
        assert run().outputs["jobName"] == single.outputs["jobName"]

    def test_shape(self, single: StackRun) -> None:
        name = single.outputs["jobName"]
        assert re.fullmatch(r"train-text-to-sql-gemma4-31b-[0-9a-f]{8}", name), name
        assert len(name) <= gke_job.JOB_NAME_MAX

    def test_new_image_same_run(self, single: StackRun) -> None:
        """An update of the trainer image is not a new run: the Job keeps its name (infra/run_identity.py)."""
        assert run(trainerImage=OTHER_IMAGE).outputs["jobName"] == single.outputs["jobName"]

    def test_run_generation_new_job(self, single: StackRun) -> None:
        assert run(runGeneration=1).outputs["jobName"] != single.outputs["jobName"]

    def test_new_overrides_new_job(self, single: StackRun) -> None:
        assert run(recipeOverrides=["training.max_steps=5"]).outputs["jobName"] != single.outputs["jobName"]

    def test_edited_recipe_new_job(self, single: StackRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        recipes = tmp_path / "recipes"
        shutil.copytree(trainer_recipe.RECIPES_DIR, recipes)
        path = recipes / "text-to-sql-gemma4-31b.yaml"
        path.write_text(path.read_text().replace("learning_rate: 1.0e-5", "learning_rate: 2.0e-5"))
        monkeypatch.setattr(trainer_recipe, "RECIPES_DIR", recipes)
        assert run().outputs["jobName"] != single.outputs["jobName"]

    def test_capacity_is_not_identity(self, single: StackRun) -> None:
        moved = run_stack(STACK, overrides={**PREBUILT, "capacity": "spot"}, remove=("reservationName",))
        assert moved.outputs["jobName"] == single.outputs["jobName"], "moving a run resumes its checkpoints"


class TestCapacity:
    """Each capacity mode renders exactly the nodeSelector GKE Autopilot expects (GKE docs how-to/autopilot-gpus, consume-reservations, autopilot-spot-pods)."""

    BASE: ClassVar[dict[str, str]] = {
        "cloud.google.com/gke-accelerator": "nvidia-b200",
        "cloud.google.com/gke-accelerator-count": "8",
        "cloud.google.com/gke-gpu-driver-version": "latest",
    }

    @pytest.mark.parametrize(
        ("overrides", "extra"),
        [
            (
                {},
                {
                    "cloud.google.com/reservation-name": "my-a4-reservation",
                    "cloud.google.com/reservation-affinity": "specific",
                },
            ),
            (
                {"reservationProject": "owner-project"},
                {
                    "cloud.google.com/reservation-name": "my-a4-reservation",
                    "cloud.google.com/reservation-affinity": "specific",
                    "cloud.google.com/reservation-project": "owner-project",
                },
            ),
            ({"capacity": "spot", "reservationName": None}, {"cloud.google.com/gke-spot": "true"}),
            ({"capacity": "flex-start", "reservationName": None}, {"cloud.google.com/gke-flex-start": "true"}),
            ({"capacity": "on-demand", "reservationName": None}, {}),
        ],
        ids=["reservation", "shared-reservation", "spot", "flex-start", "on-demand"],
    )
    def test_node_selector(self, overrides: dict[str, Any], extra: dict[str, str]) -> None:
        remove = tuple(k for k, v in overrides.items() if v is None)
        stack_run = run_stack(
            STACK, overrides={**PREBUILT, **{k: v for k, v in overrides.items() if v is not None}}, remove=remove
        )
        job = job_of(stack_run)
        assert job["spec"]["template"]["spec"]["nodeSelector"] == {**self.BASE, **extra}
        validate_object(job)


class TestMultiNode:
    """nodes: 2 → an Indexed Job + headless Service whose pods agree on rank, world size and address."""

    def test_indexed_job_and_headless_service(self, multi: StackRun) -> None:
        job = job_of(multi)
        service = manifest(multi.one(SERVICE))
        name = job["metadata"]["name"]
        assert job["spec"]["completionMode"] == "Indexed"
        assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
        assert job["spec"]["backoffLimit"] == 2 * 2, "one failed run fails every pod"
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"] == {"job-name": name}
        assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
        assert multi.one(SERVICE).urn in multi.one(JOB).dependencies

    def test_pods_share_a_zone(self, multi: StackRun) -> None:
        template = job_of(multi)["spec"]["template"]
        (term,) = template["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "topology.kubernetes.io/zone"
        selector = term["labelSelector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items(), "pod 0 matches itself"

    def test_pods_agree(self, multi: StackRun) -> None:
        job = job_of(multi)
        name = job["metadata"]["name"]
        subdomain = job["spec"]["template"]["spec"]["subdomain"]
        container = container_of(job)
        (rank_env,) = [e for e in container["env"] if e["name"] == gke_job.NODE_RANK_ENV]
        assert rank_env["valueFrom"]["fieldRef"]["fieldPath"] == (
            "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        )
        seen = []
        for index in range(2):
            # What the Job controller and kubelet give pod `index`: the annotation → NODE_RANK, hostname <job>-<i>.
            env = {gke_job.NODE_RANK_ENV: str(index), "JOB_COMPLETION_INDEX": str(index)}
            args = launch.parse_args(expand(container["args"], env))
            hostname = f"{name}-{index}"
            seen.append(
                (
                    launch.resolve_node_rank(args.node_rank, env),
                    launch.total_processes(args.nproc_per_node, args.num_processes, args.nnodes),
                    args.main_process_ip,
                    args.main_process_port,
                    hostname,
                )
            )
        assert [s[0] for s in seen] == [0, 1]
        assert {s[1] for s in seen} == {16} and multi.outputs["worldSize"] == 16
        assert {s[2] for s in seen} == {f"{seen[0][4]}.{subdomain}"}, "everyone dials pod 0 under the Service"
        assert {s[3] for s in seen} == {29500}

    def test_multi_node_name_differs(self, single: StackRun, multi: StackRun) -> None:
        assert multi.outputs["jobName"] != single.outputs["jobName"]


class TestBadConfig:
    """Bad GKE configs fail with a clear message before any resource is declared."""

    @pytest.mark.parametrize(
        ("overrides", "remove", "message"),
        [
            ({}, ("reservationName",), "capacity=reservation needs reservationName"),
            ({"gpusPerNode": 4}, (), "gpusPerNode=4 is not a machine shape for nvidia-b200"),
            ({"gpuType": "nvidia-a999"}, (), "gpuType='nvidia-a999' is not a GKE Autopilot accelerator"),
        ],
        ids=["reservation-without-name", "four-b200", "unknown-gpu"],
    )
    def test_fails_before_any_resource(self, overrides: dict[str, Any], remove: tuple[str, ...], message: str) -> None:
        with pytest.raises(ConfigError) as caught:
            run_stack(STACK, overrides={**PREBUILT, **overrides}, remove=remove)
        assert message in str(caught.value)
        assert "Fix:" in str(caught.value)
        assert getattr(caught.value, "declared_resources", None) == []


class TestRenderer:
    """`render_training_job` is pure: plain values in, manifests out."""

    def spec(self, nodes: int) -> gke_workload.GpuRun:
        return gke_workload.GpuRun(
            name="train-x-0123abcd",
            namespace="ns",
            image=PREBUILT["trainerImage"],
            recipe="x",
            output_dir="gs://b/runs/train-x-0123abcd",
            gpus_per_node=8,
            nodes=nodes,
            node_selector={"cloud.google.com/gke-accelerator": "nvidia-b200"},
            resources={"limits": {"nvidia.com/gpu": "8"}, "requests": {"nvidia.com/gpu": "8"}},
            service_account="trainer",
            hf_secret_name=None,
            retries=1,
            timeout_seconds=60,
        )

    def test_single_node_is_one_job(self) -> None:
        (job,) = gke_job.render_training_job(self.spec(1))
        assert job["kind"] == "Job" and "completionMode" not in job["spec"]
        assert "subdomain" not in job["spec"]["template"]["spec"]
        assert not [e for e in container_of(job)["env"] if e["name"] == "HF_TOKEN"], "no secret, no env"
        validate_object(job)

    def test_multi_node_renders_service_first(self) -> None:
        service, job = gke_job.render_training_job(self.spec(3))
        assert service["kind"] == "Service" and job["spec"]["completions"] == 3
        for obj in (service, job):
            validate_object(obj)

    def test_manifests_round_trip_as_yaml(self) -> None:
        rendered = gke_job.render_training_job(self.spec(2))
        assert list(yaml.safe_load_all(yaml.safe_dump_all(rendered))) == rendered


def test_recorded_is_a_component_child(single: StackRun) -> None:
    job: Recorded = single.one(JOB)
    assert job.parent.endswith("gemma-finetune:k8s:TrainingJob::gft-a4-gemma4")
