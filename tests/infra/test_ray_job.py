"""The ray-gemma3-vision stack under mocks: RayJob / RayCluster against our KubeRay schema, strict pods.

KubeRay's CRDs are on no registry, so `infra/offline/schemas/kuberay.schema.json` describes the fields we
use and `$ref`s kubernetes-validate's strict PodTemplateSpec; the first tests prove that the
schema really rejects what KubeRay would reject, so the stack tests below mean something.
"""

from __future__ import annotations

import copy
import shlex
from typing import Any

import jsonschema
import pytest

from infra import gke_workload, ray_job
from infra.offline.engine import MOCK_HF_TOKEN, StackRun, run_stack
from tests.infra.conftest import PREBUILT, contains, plain_paths
from tests.infra.k8s_validate import (
    k8s_resources,
    manifest,
    pod_templates,
    validate_kuberay,
    validate_object,
    validate_pod_template,
)

STACK = "ray-gemma3-vision"
RAYJOB = "kubernetes:ray.io/v1:RayJob"
RAYCLUSTER = "kubernetes:ray.io/v1:RayCluster"
OTHER_IMAGE = "us-central1-docker.pkg.dev/p/r/trainer@sha256:" + "9" * 64


def run(**overrides: Any) -> StackRun:
    return run_stack(STACK, overrides={**PREBUILT, **overrides})


@pytest.fixture(scope="module")
def ephemeral() -> StackRun:
    return run()


@pytest.fixture(scope="module")
def standing() -> StackRun:
    return run(rayCluster="standing")


def rayjob_of(stack_run: StackRun) -> dict[str, Any]:
    return manifest(stack_run.one(RAYJOB))


def cluster_spec(stack_run: StackRun) -> dict[str, Any]:
    return rayjob_of(stack_run)["spec"]["rayClusterSpec"]


def worker_group(spec: dict[str, Any]) -> dict[str, Any]:
    (group,) = spec["workerGroupSpecs"]
    return group


def entrypoint_args(stack_run: StackRun) -> list[str]:
    return shlex.split(rayjob_of(stack_run)["spec"]["entrypoint"])


def option(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


class TestSchemaRejects:
    """The schema fails on what KubeRay (or the API server) would reject; otherwise passing it proves little."""

    @pytest.fixture
    def good(self, ephemeral: StackRun) -> dict[str, Any]:
        obj = rayjob_of(ephemeral)
        validate_kuberay(obj)
        return copy.deepcopy(obj)

    def test_typo_in_a_kuberay_field(self, good: dict[str, Any]) -> None:
        good["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParam"] = {}
        with pytest.raises(jsonschema.ValidationError, match="rayStartParam"):
            validate_kuberay(good)

    def test_typo_at_the_top_of_the_spec(self, good: dict[str, Any]) -> None:
        good["spec"]["shutdownAfterJobFinish"] = True
        with pytest.raises(jsonschema.ValidationError, match="shutdownAfterJobFinish"):
            validate_kuberay(good)

    def test_ray_start_param_must_be_a_string(self, good: dict[str, Any]) -> None:
        good["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
        with pytest.raises(jsonschema.ValidationError, match="is not of type 'string'"):
            validate_kuberay(good)

    def test_ray_start_params_always_present(self, good: dict[str, Any]) -> None:
        del worker_group(good["spec"]["rayClusterSpec"])["rayStartParams"]
        with pytest.raises(jsonschema.ValidationError, match="rayStartParams"):
            validate_kuberay(good)

    def test_typo_inside_the_pod_template(self, good: dict[str, Any]) -> None:
        """The PodTemplateSpec $ref resolves to kubernetes-validate's strict definitions."""
        worker_group(good["spec"]["rayClusterSpec"])["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "x"
        with pytest.raises(jsonschema.ValidationError, match="imagePullPolicyy"):
            validate_kuberay(good)

    def test_ttl_needs_shutdown(self, good: dict[str, Any]) -> None:
        good["spec"]["shutdownAfterJobFinishes"] = False
        with pytest.raises(jsonschema.ValidationError):
            validate_kuberay(good)

    def test_cluster_spec_or_selector_not_both(self, good: dict[str, Any]) -> None:
        good["spec"]["clusterSelector"] = {"ray.io/cluster": "x"}
        with pytest.raises(jsonschema.ValidationError):
            validate_kuberay(good)

    def test_name_limit(self, good: dict[str, Any]) -> None:
        good["metadata"]["name"] = "a" * 48
        with pytest.raises(jsonschema.ValidationError):
            validate_kuberay(good)


class TestEveryObjectValidates:
    @pytest.mark.parametrize("fixture", ["ephemeral", "standing"])
    def test_every_object(self, fixture: str, request: pytest.FixtureRequest) -> None:
        stack_run: StackRun = request.getfixturevalue(fixture)
        objects = k8s_resources(stack_run.resources)
        assert RAYJOB in {r.type for r in objects}
        for r in objects:
            validate_object(manifest(r))

    @pytest.mark.parametrize("fixture", ["ephemeral", "standing"])
    def test_every_pod_template_is_a_strict_pod(self, fixture: str, request: pytest.FixtureRequest) -> None:
        stack_run: StackRun = request.getfixturevalue(fixture)
        found = 0
        for r in stack_run.resources:
            if r.type in (RAYJOB, RAYCLUSTER):
                for where, template in pod_templates(manifest(r)):
                    validate_pod_template(template, name=f"x-{where}")
                    found += 1
        assert found >= 2, "head and GPU workers"


class TestRayJob:
    def test_gpu_workers_hold_sigterm_until_the_step_is_saved(self, ephemeral: StackRun) -> None:
        """Preemption: the preStop hook writes the trainer's notice and waits (trainer/preemption.py)."""
        from trainer.preemption import NOTICE_FILE, prestop_command

        pod = worker_group(cluster_spec(ephemeral))["template"]["spec"]
        (worker,) = pod["containers"]
        command = worker["lifecycle"]["preStop"]["exec"]["command"]
        assert command == prestop_command(NOTICE_FILE, wait_s=pod["terminationGracePeriodSeconds"] - 30)
        assert pod["terminationGracePeriodSeconds"] >= 60

    def test_lifecycle(self, ephemeral: StackRun) -> None:
        spec = rayjob_of(ephemeral)["spec"]
        assert spec["shutdownAfterJobFinishes"] is True, "no GPU idles after the run"
        assert 0 < spec["ttlSecondsAfterFinished"] <= 300
        assert spec["activeDeadlineSeconds"] == 240 * 60
        assert spec["backoffLimit"] == 1, "trainingRetries in the stack file"
        assert spec["submissionMode"] == "K8sJobMode"
        assert "runtimeEnvYAML" not in spec, "no pip installs at job start"
        assert rayjob_of(ephemeral)["metadata"]["annotations"]["pulumi.com/skipAwait"] == "true"

    def test_entrypoint(self, ephemeral: StackRun) -> None:
        args = entrypoint_args(ephemeral)
        name = ephemeral.outputs["rayJobName"]
        assert args[:3] == ["python", "-m", "trainer.ray_entry"]
        assert option(args, "--recipe") == "product-descriptions-gemma3-4b"
        assert option(args, "--num-workers") == "16" and ephemeral.outputs["rayWorkers"] == 16
        assert "--use-gpu" in args
        assert option(args, "--storage-path") == "gs://my-gcp-project-gft-ray-gemma3-vision/ray"
        assert option(args, "--name") == name
        assert ephemeral.outputs["checkpoints"] == f"gs://my-gcp-project-gft-ray-gemma3-vision/ray/{name}"
        assert args[-2:] == ["--set", f"output.dir={ephemeral.outputs['runDir']}"]

    def test_overrides_reach_the_entrypoint(self) -> None:
        args = entrypoint_args(run(recipeOverrides=["training.max_steps=5"]))
        assert args[-4:-2] == ["--set", "training.max_steps=5"]

    def test_head(self, ephemeral: StackRun) -> None:
        head = cluster_spec(ephemeral)["headGroupSpec"]
        assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
        assert all(isinstance(v, str) for v in head["rayStartParams"].values())
        (container,) = head["template"]["spec"]["containers"]
        assert {p["containerPort"] for p in container["ports"]} == {6379, 8265, 10001}
        assert "nvidia.com/gpu" not in container["resources"]["limits"], "the head holds no GPU"
        assert "nodeSelector" not in head["template"]["spec"]
        assert container["image"] == PREBUILT["trainerImage"]
        assert cluster_spec(ephemeral)["rayVersion"] == "2.48.0"

    def test_gpu_workers(self, ephemeral: StackRun) -> None:
        group = worker_group(cluster_spec(ephemeral))
        assert group["groupName"] == "gpu-group"
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 2
        assert group["rayStartParams"] == {}
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert container["resources"]["requests"] == container["resources"]["limits"]
        assert container["image"] == PREBUILT["trainerImage"]
        assert pod["nodeSelector"] == {
            "cloud.google.com/gke-accelerator": "nvidia-b200",
            "cloud.google.com/gke-accelerator-count": "8",
            "cloud.google.com/gke-gpu-driver-version": "latest",
            "cloud.google.com/reservation-name": "my-a4-reservation",
            "cloud.google.com/reservation-affinity": "specific",
        }
        assert "tolerations" not in pod
        assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        (term,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "topology.kubernetes.io/zone", "2 nodes: NCCL stays in one zone"
        assert term["labelSelector"]["matchLabels"].items() <= group["template"]["metadata"]["labels"].items()

    def test_spot_workers(self) -> None:
        stack_run = run_stack(STACK, overrides={**PREBUILT, "capacity": "spot"}, remove=("reservationName",))
        selector = worker_group(cluster_spec(stack_run))["template"]["spec"]["nodeSelector"]
        assert selector["cloud.google.com/gke-spot"] == "true"
        assert not any("reservation" in k for k in selector)

    def test_depends_on_the_cluster(self, ephemeral: StackRun) -> None:
        job = ephemeral.one(RAYJOB)
        assert ephemeral.one("gcp:container/cluster:Cluster").urn in job.dependencies
        assert job.provider.startswith(ephemeral.one("pulumi:providers:kubernetes").urn)

    def test_outputs(self, ephemeral: StackRun) -> None:
        out = ephemeral.outputs
        name = out["rayJobName"]
        assert out["rayJobStatus"] == f"kubectl get rayjob {name} -n gft-ray-gemma3-vision"
        assert out["dashboard"].startswith("kubectl port-forward -n gft-ray-gemma3-vision service/")
        assert out["dashboard"].endswith("-head-svc 8265:8265") and name in out["dashboard"]


class TestSecretsAndIdentity:
    def test_hf_token_only_by_reference(self, ephemeral: StackRun) -> None:
        spec = cluster_spec(ephemeral)
        for template in (spec["headGroupSpec"]["template"], worker_group(spec)["template"]):
            env = template["spec"]["containers"][0]["env"]
            assert {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": "hf-secret", "key": "hf_api_token"}},
            } in env
        assert not contains(ephemeral.one(RAYJOB).inputs, MOCK_HF_TOKEN)
        for r in ephemeral.resources:
            assert not plain_paths(r.inputs, MOCK_HF_TOKEN), f"{r.urn} holds the token in plain text"
        assert MOCK_HF_TOKEN not in repr(ephemeral.outputs)

    def test_workload_identity(self, ephemeral: StackRun) -> None:
        gsa = ephemeral.by_name("gft-ray-gemma3-vision-trainer-sa").outputs["email"]
        ksa = manifest(ephemeral.one("kubernetes:core/v1:ServiceAccount"))
        assert ksa["metadata"]["annotations"]["iam.gke.io/gcp-service-account"] == gsa
        member = ephemeral.one("gcp:serviceaccount/iAMMember:IAMMember").plain_inputs()["member"]
        assert member == f"serviceAccount:my-gcp-project.svc.id.goog[gft-ray-gemma3-vision/{ksa['metadata']['name']}]"
        spec = cluster_spec(ephemeral)
        for template in (spec["headGroupSpec"]["template"], worker_group(spec)["template"]):
            assert template["spec"]["serviceAccountName"] == ksa["metadata"]["name"]

    def test_no_project_level_storage_role(self, ephemeral: StackRun, standing: StackRun) -> None:
        for stack_run in (ephemeral, standing):
            project_roles = {
                r.plain_inputs()["role"] for r in stack_run.resources if r.type.startswith("gcp:projects/iAM")
            }
            assert project_roles == {"roles/container.defaultNodeServiceAccount"}, "only the nodes' logs and metrics"
            roles = {r.plain_inputs().get("role") for r in stack_run.resources}
            assert not roles & {"roles/storage.admin", "roles/storage.objectAdmin", "roles/editor"}


class TestJobName:
    def test_stable(self, ephemeral: StackRun) -> None:
        assert run().outputs["rayJobName"] == ephemeral.outputs["rayJobName"]

    def test_kuberay_limit(self, ephemeral: StackRun) -> None:
        assert len(ephemeral.outputs["rayJobName"]) <= 47

    def test_new_image_same_run(self, ephemeral: StackRun) -> None:
        assert run(trainerImage=OTHER_IMAGE).outputs["rayJobName"] == ephemeral.outputs["rayJobName"]

    def test_new_recipe_new_job(self, ephemeral: StackRun) -> None:
        changed = run(recipeOverrides=["training.learning_rate=1e-4"])
        assert changed.outputs["rayJobName"] != ephemeral.outputs["rayJobName"]


class TestStandingCluster:
    def test_raycluster_and_selector(self, standing: StackRun) -> None:
        cluster = manifest(standing.one(RAYCLUSTER))
        assert cluster["metadata"]["name"] == ray_job.STANDING_CLUSTER_NAME
        spec = rayjob_of(standing)["spec"]
        assert spec["clusterSelector"] == {"ray.io/cluster": ray_job.STANDING_CLUSTER_NAME}
        assert "rayClusterSpec" not in spec and "ttlSecondsAfterFinished" not in spec
        assert spec["shutdownAfterJobFinishes"] is False
        assert worker_group(cluster["spec"])["template"]["spec"]["containers"][0]["image"] == PREBUILT["trainerImage"]

    def test_job_waits_for_the_cluster(self, standing: StackRun) -> None:
        assert standing.one(RAYCLUSTER).urn in standing.one(RAYJOB).dependencies

    def test_dashboard(self, standing: StackRun) -> None:
        assert standing.outputs["dashboard"] == (
            "kubectl port-forward -n gft-ray-gemma3-vision service/gemma-tuning-head-svc 8265:8265"
        )


class TestRenderer:
    def test_pure(self) -> None:
        run = gke_workload.GpuRun(
            name="ft-x-0123abcd",
            namespace="ns",
            image=PREBUILT["trainerImage"],
            recipe="x",
            output_dir="gs://b/runs/ft-x-0123abcd",
            gpus_per_node=8,
            nodes=1,
            node_selector={"cloud.google.com/gke-accelerator": "nvidia-b200"},
            resources={"limits": {"nvidia.com/gpu": "8"}, "requests": {"nvidia.com/gpu": "8"}},
            service_account="trainer",
            hf_secret_name=None,
            retries=0,
            timeout_seconds=60,
        )
        spec = ray_job.RayRunSpec(run=run, ray_version="2.48.0", storage_path="gs://b/ray")
        job = ray_job.render_ray_job(spec)
        validate_object(job)
        assert "--num-workers 8" in job["spec"]["entrypoint"]
        head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        assert [e["name"] for e in head["env"]] == ["PYTHONUNBUFFERED"], "no token, no HF_TOKEN env"


class TestTrainerContract:
    """The RayJob speaks the trainer's language: its entrypoint parses and its Ray matches the image's."""

    def test_entrypoint_parses(self, ephemeral: StackRun) -> None:
        ray_entry = pytest.importorskip("trainer.ray_entry")
        args = entrypoint_args(ephemeral)
        assert args[:3] == ["python", "-m", "trainer.ray_entry"]
        run_spec = ray_entry.parse_args(args[3:], env={})
        assert run_spec.recipe == "product-descriptions-gemma3-4b"
        assert run_spec.num_workers == 16 and run_spec.use_gpu is True
        assert run_spec.name == ephemeral.outputs["rayJobName"]
        assert f"{run_spec.storage_path}/{run_spec.name}" == ephemeral.outputs["checkpoints"]
        assert run_spec.overrides[-1] == f"output.dir={ephemeral.outputs['runDir']}"

    def test_ray_version_matches_the_image(self, ephemeral: StackRun) -> None:
        ray_entry = pytest.importorskip("trainer.ray_entry")
        assert cluster_spec(ephemeral)["rayVersion"] == ray_entry.RAY_VERSION
