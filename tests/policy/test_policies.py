"""The guard-rail pack (infra/policy) over every real stack, and over deliberately broken resources.

Every stack runs under mocks (plus dev serving after training) and each resource's inputs go
through every policy twice: the plain check functions, and the `ResourceValidationPolicy`
wrappers called as the analyzer calls them (props behind pulumi_policy's unknown-checking proxy).
Then each policy is shown to fail, with its message, on a real resource broken in one way.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra import catalog
from infra.offline.engine import REPO_ROOT, StackRun
from infra.policy import policies
from infra.policy.policies import (
    BUCKET,
    CLOUD_RUN_JOB,
    CLOUD_RUN_SERVICE,
    JOB_SET,
    K8S_CRON_JOB,
    K8S_DEPLOYMENT,
    K8S_JOB,
    K8S_POD,
    K8S_STATEFUL_SET,
    LONG_RUNNING_LABEL,
    RAY_CLUSTER,
    RAY_JOB,
    UNKNOWN_VALUES,
    violations,
)
from tests.policy.conftest import SERVING_PRIVATE, SERVING_PUBLIC, find, props_of, run_pack, variants

POLICY_DIR = REPO_ROOT / "infra" / "policy"
UNKNOWN_STRING = "04da6b54-80e4-46f7-96ec-b56ff0331ba9"
GPU_WORKLOADS = {CLOUD_RUN_JOB, K8S_JOB, RAY_JOB}


def _report(found: dict[str, list[str]]) -> str:
    return "; ".join(f"{name}: {' | '.join(problems)}" for name, problems in found.items())


class TestEveryStackPasses:
    """The program as committed keeps every guard rail, so `pulumi preview` with the pack stays green."""

    @pytest.mark.parametrize("variant", [v for v in variants() if v != SERVING_PUBLIC])
    def test_every_resource_passes_every_policy(self, stack_runs: dict[str, StackRun], variant: str) -> None:
        for resource in stack_runs[variant].resources:
            found = violations(resource.type, resource.plain_inputs())
            assert not found, f"{resource.urn}: {_report(found)}"

    @pytest.mark.parametrize("variant", [v for v in variants() if v != SERVING_PUBLIC])
    def test_every_resource_passes_through_the_engine_wrappers(
        self, stack_runs: dict[str, StackRun], variant: str
    ) -> None:
        for resource in stack_runs[variant].resources:
            found = run_pack(resource.type, resource.plain_inputs())
            assert not found, f"{resource.urn}: {_report(found)}"

    def test_the_checks_reach_what_they_guard(self, stack_runs: dict[str, StackRun]) -> None:
        """A check that never sees its resources would pass vacuously: each stack has a GPU workload
        whose containers (and env) the checks walk, and IAM resources they read."""
        for key, run in stack_runs.items():
            workloads = [r for r in run.resources if r.type in GPU_WORKLOADS]
            assert workloads, f"{key}: no GPU workload among {[r.type for r in run.resources]}"
            for resource in workloads:
                props = resource.plain_inputs()
                assert policies.requests_gpu(props), f"{resource.urn}: not recognised as a GPU workload"
                containers = [v for _, k, v in policies.walk(props) if k in policies.CONTAINER_LISTS]
                assert containers and all(containers), f"{resource.urn}: no containers found"
            assert any(policies.is_iam_resource(r.type) for r in run.resources), key
            assert run.of_type(BUCKET), key


class TestPublicServing:
    """A public vLLM service is an explicit choice, marked on the service itself."""

    def test_private_service_keeps_the_invoker_check(self, stack_runs: dict[str, StackRun]) -> None:
        service = stack_runs[SERVING_PRIVATE].one(CLOUD_RUN_SERVICE)
        assert service.plain_inputs().get("invokerIamDisabled") is not True, service.urn
        assert not violations(service.type, service.plain_inputs()), service.urn

    def test_invoker_check_disabled_without_the_label_fails(self, stack_runs: dict[str, StackRun]) -> None:
        props = props_of(stack_runs[SERVING_PUBLIC].one(CLOUD_RUN_SERVICE))
        props["labels"].pop("public", None)
        assert props["invokerIamDisabled"] is True
        found = violations(CLOUD_RUN_SERVICE, props)
        assert list(found) == ["no-public-principals"], _report(found)
        assert 'without the label public="true"' in found["no-public-principals"][0]

    def test_invoker_check_disabled_with_the_label_passes(self, stack_runs: dict[str, StackRun]) -> None:
        props = props_of(stack_runs[SERVING_PUBLIC].one(CLOUD_RUN_SERVICE))
        props["labels"]["public"] = "true"
        assert not violations(CLOUD_RUN_SERVICE, props)

    def test_public_stack_as_the_program_declares_it(self, stack_runs: dict[str, StackRun]) -> None:
        service = stack_runs[SERVING_PUBLIC].one(CLOUD_RUN_SERVICE)
        assert service.plain_inputs()["labels"]["public"] == "true"
        for resource in stack_runs[SERVING_PUBLIC].resources:
            found = violations(resource.type, resource.plain_inputs())
            assert not found, f"{resource.urn}: {_report(found)}"


def _set_role(role: str) -> Callable[[dict[str, Any]], None]:
    def mutate(props: dict[str, Any]) -> None:
        props["role"] = role

    return mutate


def _set_member(member: str) -> Callable[[dict[str, Any]], None]:
    def mutate(props: dict[str, Any]) -> None:
        props["member"] = member

    return mutate


def _cloud_run_image_by_tag(props: dict[str, Any]) -> None:
    props["template"]["template"]["containers"][0]["image"] = "us-central1-docker.pkg.dev/p/r/trainer:latest"


def _job_image_by_tag(props: dict[str, Any]) -> None:
    props["spec"]["template"]["spec"]["containers"][0]["image"] = "us-central1-docker.pkg.dev/p/r/trainer:v1"


def _ray_worker_image_by_tag(props: dict[str, Any]) -> None:
    props["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["image"] = (
        "rayproject/ray:2.48.0-gpu"
    )


def _job_literal_hf_token(props: dict[str, Any]) -> None:
    props["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "HF_TOKEN", "value": "hf_literal"})


def _cloud_run_literal_hf_token(props: dict[str, Any]) -> None:
    envs = props["template"]["template"]["containers"][0]["envs"]
    for env in envs:
        if env["name"] == "HF_TOKEN":
            env.pop("valueSource")
            env["value"] = "hf_literal"


def _job_literal_env(name: str) -> Callable[[dict[str, Any]], None]:
    def mutate(props: dict[str, Any]) -> None:
        props["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": name, "value": "hf_literal"})

    return mutate


def _cloud_run_literal_env(name: str) -> Callable[[dict[str, Any]], None]:
    def mutate(props: dict[str, Any]) -> None:
        props["template"]["template"]["containers"][0]["envs"].append({"name": name, "value": "hf_literal"})

    return mutate


def _ray_runtime_env_api_key(props: dict[str, Any]) -> None:
    props["spec"]["runtimeEnvYAML"] = yaml.safe_dump({"env_vars": {"HF_API_KEY": "hf_literal"}})


def _ray_runtime_env_token(props: dict[str, Any]) -> None:
    props["spec"]["runtimeEnvYAML"] = yaml.safe_dump({"env_vars": {"HUGGING_FACE_HUB_TOKEN": "hf_literal"}})


def _drop(*path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(props: dict[str, Any]) -> None:
        target = props
        for key in path[:-1]:
            target = target[key]
        target.pop(path[-1], None)

    return mutate


def _drop_label(field: str, key: str) -> Callable[[dict[str, Any]], None]:
    def mutate(props: dict[str, Any]) -> None:
        props[field].pop(key)

    return mutate


def _set(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(props: dict[str, Any]) -> None:
        target = props
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


# (id, resource type to start from, how to break it, the policy that must fail, a phrase of its message)
BROKEN: list[tuple[str, str, Callable[[dict[str, Any]], None], str, str]] = [
    (
        "basic-role-on-bucket",
        "gcp:storage/bucketIAMMember:BucketIAMMember",
        _set_role("roles/editor"),
        "no-basic-roles",
        "basic role roles/editor",
    ),
    (
        "basic-role-on-service-account",
        "gcp:serviceaccount/iAMMember:IAMMember",
        _set_role("roles/owner"),
        "no-basic-roles",
        "basic role roles/owner",
    ),
    (
        "all-users-on-bucket",
        "gcp:storage/bucketIAMMember:BucketIAMMember",
        _set_member("allUsers"),
        "no-public-principals",
        "public principal allUsers",
    ),
    (
        "all-authenticated-users-on-secret",
        "gcp:secretmanager/secretIamMember:SecretIamMember",
        _set_member("allAuthenticatedUsers"),
        "no-public-principals",
        "public principal allAuthenticatedUsers",
    ),
    (
        "bucket-without-pap",
        BUCKET,
        _set(("publicAccessPrevention",), "inherited"),
        "private-buckets",
        "publicAccessPrevention='inherited'",
    ),
    (
        "bucket-with-acls",
        BUCKET,
        _drop("uniformBucketLevelAccess"),
        "private-buckets",
        "uniformBucketLevelAccess=None",
    ),
    (
        "cloud-run-job-without-timeout",
        CLOUD_RUN_JOB,
        _drop("template", "template", "timeout"),
        "gpu-workload-deadlines",
        "Cloud Run GPU job has template.template.timeout=None",
    ),
    (
        "k8s-job-without-deadline",
        K8S_JOB,
        _drop("spec", "activeDeadlineSeconds"),
        "gpu-workload-deadlines",
        "Kubernetes Job asking for GPUs has spec.activeDeadlineSeconds=None",
    ),
    (
        "rayjob-without-deadline",
        RAY_JOB,
        _drop("spec", "activeDeadlineSeconds"),
        "gpu-workload-deadlines",
        "RayJob asking for GPUs has spec.activeDeadlineSeconds=None",
    ),
    (
        "rayjob-keeping-its-cluster",
        RAY_JOB,
        _set(("spec", "shutdownAfterJobFinishes"), False),
        "gpu-workload-deadlines",
        "spec.shutdownAfterJobFinishes is not true",
    ),
    (
        "cloud-run-image-by-tag",
        CLOUD_RUN_JOB,
        _cloud_run_image_by_tag,
        "images-pinned-by-digest",
        "template.template.containers[0].image='us-central1-docker.pkg.dev/p/r/trainer:latest' is not pinned",
    ),
    (
        "k8s-job-image-by-tag",
        K8S_JOB,
        _job_image_by_tag,
        "images-pinned-by-digest",
        "spec.template.spec.containers[0].image='us-central1-docker.pkg.dev/p/r/trainer:v1' is not pinned",
    ),
    (
        "ray-worker-image-by-tag",
        RAY_JOB,
        _ray_worker_image_by_tag,
        "images-pinned-by-digest",
        "workerGroupSpecs[0].template.spec.containers[0].image='rayproject/ray:2.48.0-gpu' is not pinned",
    ),
    (
        "k8s-job-literal-hf-token",
        K8S_JOB,
        _job_literal_hf_token,
        "tokens-from-secrets",
        "sets HF_TOKEN to a literal value",
    ),
    (
        "cloud-run-literal-hf-token",
        CLOUD_RUN_JOB,
        _cloud_run_literal_hf_token,
        "tokens-from-secrets",
        "sets HF_TOKEN to a literal value",
    ),
    (
        "k8s-job-literal-camel-case-token",
        K8S_JOB,
        _job_literal_env("HuggingFaceToken"),
        "tokens-from-secrets",
        "sets HuggingFaceToken to a literal value",
    ),
    (
        "cloud-run-literal-api-key",
        CLOUD_RUN_JOB,
        _cloud_run_literal_env("HF_API_KEY"),
        "tokens-from-secrets",
        "sets HF_API_KEY to a literal value",
    ),
    (
        "rayjob-runtime-env-api-key",
        RAY_JOB,
        _ray_runtime_env_api_key,
        "tokens-from-secrets",
        "env_vars sets HF_API_KEY to a literal value",
    ),
    (
        "rayjob-runtime-env-token",
        RAY_JOB,
        _ray_runtime_env_token,
        "tokens-from-secrets",
        "env_vars sets HUGGING_FACE_HUB_TOKEN to a literal value",
    ),
    ("bucket-without-app-label", BUCKET, _drop_label("labels", "app"), "required-labels", "labels lack app"),
    (
        "registry-without-stack-label",
        "gcp:artifactregistry/repository:Repository",
        _drop_label("labels", "stack"),
        "required-labels",
        "labels lack stack",
    ),
    (
        "secret-without-workload-label",
        "gcp:secretmanager/secret:Secret",
        _drop_label("labels", "workload"),
        "required-labels",
        "labels lack workload",
    ),
    ("cloud-run-job-without-labels", CLOUD_RUN_JOB, _drop("labels"), "required-labels", "labels lack app, stack"),
    (
        "cloud-run-service-without-labels",
        CLOUD_RUN_SERVICE,
        _drop("labels"),
        "required-labels",
        "labels lack app, stack, workload",
    ),
    (
        "cluster-without-labels",
        "gcp:container/cluster:Cluster",
        _drop("resourceLabels"),
        "required-labels",
        "resourceLabels lack app",
    ),
]


class TestEachPolicyCatchesItsViolation:
    """A real resource from a stack, broken in one way, fails exactly the policy that guards it."""

    @pytest.mark.parametrize(
        ("start", "mutate", "policy", "phrase"), [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN]
    )
    def test_check_function(
        self,
        stack_runs: dict[str, StackRun],
        start: str,
        mutate: Callable[[dict[str, Any]], None],
        policy: str,
        phrase: str,
    ) -> None:
        resource = find(stack_runs, start)
        props = props_of(resource)
        assert not violations(resource.type, props), f"{resource.urn} should pass before it is broken"
        mutate(props)
        found = violations(resource.type, props)
        assert list(found) == [policy], f"{resource.urn}: expected only {policy}, got {_report(found)}"
        assert any(phrase in problem for problem in found[policy]), _report(found)

    @pytest.mark.parametrize(
        ("start", "mutate", "policy", "phrase"), [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN]
    )
    def test_engine_wrapper(
        self,
        stack_runs: dict[str, StackRun],
        start: str,
        mutate: Callable[[dict[str, Any]], None],
        policy: str,
        phrase: str,
    ) -> None:
        resource = find(stack_runs, start)
        props = props_of(resource)
        mutate(props)
        found = run_pack(resource.type, props)
        assert list(found) == [policy], f"{resource.urn}: expected only {policy}, got {_report(found)}"
        assert any(phrase in problem for problem in found[policy]), _report(found)


class TestPolicyEdges:
    """Cases the stacks do not produce today but a change could."""

    def test_basic_role_and_public_member_inside_an_iam_policy_document(self) -> None:
        policy_data = (
            '{"bindings": [{"role": "roles/viewer", "members": ["allUsers"]},'
            ' {"role": "roles/storage.objectViewer", "members": ["user:alice@example.com"]}]}'
        )
        found = violations("gcp:storage/bucketIAMPolicy:BucketIAMPolicy", {"bucket": "b", "policyData": policy_data})
        assert set(found) == {"no-basic-roles", "no-public-principals"}, _report(found)

    def test_public_member_in_an_iam_binding(self) -> None:
        props = {"project": "p", "role": "roles/run.invoker", "members": ["user:a@example.com", "allUsers"]}
        found = violations("gcp:cloudrunv2/serviceIamBinding:ServiceIamBinding", props)
        assert list(found) == ["no-public-principals"], _report(found)

    def test_project_level_basic_role(self) -> None:
        found = violations("gcp:projects/iAMMember:IAMMember", {"project": "p", "role": "roles/editor", "member": "x"})
        assert list(found) == ["no-basic-roles"], _report(found)

    def test_tokenizer_settings_are_not_tokens(self, stack_runs: dict[str, StackRun]) -> None:
        props = props_of(find(stack_runs, K8S_JOB))
        props["spec"]["template"]["spec"]["containers"][0]["env"].append(
            {"name": "TOKENIZERS_PARALLELISM", "value": "false"}
        )
        assert not violations(K8S_JOB, props)

    def test_cpu_job_needs_no_deadline(self) -> None:
        job = {"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "r/x@sha256:" + "a" * 64}]}}}}
        assert not violations(K8S_JOB, job)

    def test_values_unknown_during_preview_are_left_for_up(self, stack_runs: dict[str, StackRun]) -> None:
        """An image built in the same update has no digest at preview: skipped, not an error, not a pass of
        anything known (the engine's proxy would raise if a check read it carelessly)."""
        resource = find(stack_runs, CLOUD_RUN_JOB)
        props = props_of(resource)
        props["template"]["template"]["containers"][0]["image"] = UNKNOWN_STRING
        assert UNKNOWN_STRING in UNKNOWN_VALUES
        assert not run_pack(resource.type, props)
        props["template"]["template"].pop("timeout")
        assert list(run_pack(resource.type, props)) == ["gpu-workload-deadlines"]

    def test_pack_copies_agree_with_the_catalog(self) -> None:
        """The pack runs without the program on its path, so it carries its own copies of these sets."""
        assert policies.BASIC_ROLES == catalog.BASIC_ROLES
        assert policies.PUBLIC_MEMBERS == catalog.PUBLIC_MEMBERS


MALFORMED_POLICY_DATA = {
    "not-json": "{bindings: [",
    "a-list": '[{"role": "roles/owner", "members": ["allUsers"]}]',
    "bindings-not-a-list": '{"bindings": {"role": "roles/owner"}}',
    "binding-not-an-object": '{"bindings": ["roles/owner"]}',
    "members-not-a-list": '{"bindings": [{"role": "roles/storage.objectViewer", "members": "allUsers"}]}',
    "role-not-a-string": '{"bindings": [{"role": 7, "members": ["user:a@example.com"]}]}',
}


class TestMalformedPolicyData:
    """An IAM policy document the rules cannot read fails both IAM rules; it never crashes the pack."""

    @pytest.mark.parametrize("policy_data", MALFORMED_POLICY_DATA.values(), ids=MALFORMED_POLICY_DATA.keys())
    def test_fails_closed_through_the_engine_wrappers(self, policy_data: str) -> None:
        props = {"bucket": "b", "policyData": policy_data}
        found = run_pack("gcp:storage/bucketIAMPolicy:BucketIAMPolicy", props)
        assert set(found) == {"no-basic-roles", "no-public-principals"}, _report(found)
        assert "cannot be checked for basic roles" in found["no-basic-roles"][-1], _report(found)
        assert "cannot be checked for public principals" in found["no-public-principals"][-1], _report(found)
        assert not any("could not check" in problem for problems in found.values() for problem in problems), (
            "the rule must read the document, not crash on it"
        )

    def test_what_can_be_read_is_still_judged(self) -> None:
        policy_data = '{"bindings": ["junk", {"role": "roles/editor", "members": ["allUsers"]}]}'
        found = violations("gcp:projects/iAMPolicy:IAMPolicy", {"project": "p", "policyData": policy_data})
        assert any("basic role roles/editor" in problem for problem in found["no-basic-roles"]), _report(found)
        assert any("public principal allUsers" in problem for problem in found["no-public-principals"]), _report(found)

    def test_a_well_formed_document_without_bindings_passes(self) -> None:
        assert not violations("gcp:storage/bucketIAMPolicy:BucketIAMPolicy", {"bucket": "b", "policyData": "{}"})

    def test_a_crashing_check_becomes_a_violation(self) -> None:
        def explode(resource_type: str, props: Any) -> list[str]:
            raise KeyError("spec")

        rail = policies.GuardRail("exploding", "a rule with a bug", explode)
        assert policies.run_check(rail, K8S_JOB, {}) == [
            "exploding could not check this kubernetes:batch/v1:Job (KeyError: 'spec'); fix the resource"
        ]


def _pod_template(runs: dict[str, StackRun]) -> dict[str, Any]:
    """The GPU pod template of a real training Job (metadata + spec), free to mutate."""
    return props_of(find(runs, K8S_JOB))["spec"]["template"]


class TestGpuWorkloadKinds:
    """Every Kubernetes kind that can hold GPUs gets its deadline checked where a deadline applies."""

    def test_gpu_pod_needs_a_deadline(self, stack_runs: dict[str, StackRun]) -> None:
        pod = _pod_template(stack_runs)
        pod["spec"].pop("activeDeadlineSeconds", None)
        assert policies.requests_gpu(pod), "the template must ask for GPUs for this test to mean anything"
        found = run_pack(K8S_POD, pod)
        assert list(found) == ["gpu-workload-deadlines"], _report(found)
        assert "Pod asking for GPUs has spec.activeDeadlineSeconds=None" in found["gpu-workload-deadlines"][0]
        pod["spec"]["activeDeadlineSeconds"] = 3600
        assert not run_pack(K8S_POD, pod)

    def test_gpu_cron_job_needs_a_deadline_in_its_job_template(self, stack_runs: dict[str, StackRun]) -> None:
        job_spec = props_of(find(stack_runs, K8S_JOB))["spec"]
        cron = {"metadata": {"name": "nightly"}, "spec": {"schedule": "0 3 * * *", "jobTemplate": {"spec": job_spec}}}
        assert not run_pack(K8S_CRON_JOB, cron)
        job_spec.pop("activeDeadlineSeconds")
        found = run_pack(K8S_CRON_JOB, cron)
        assert list(found) == ["gpu-workload-deadlines"], _report(found)
        assert "spec.jobTemplate.spec.activeDeadlineSeconds=None" in found["gpu-workload-deadlines"][0]

    def test_each_gpu_job_of_a_job_set_needs_a_deadline(self, stack_runs: dict[str, StackRun]) -> None:
        job_spec = props_of(find(stack_runs, K8S_JOB))["spec"]
        cpu_spec = {"template": {"spec": {"containers": [{"name": "c", "image": "r/x@sha256:" + "a" * 64}]}}}
        job_set = {
            "metadata": {"name": "train"},
            "spec": {
                "replicatedJobs": [
                    {"name": "coordinator", "replicas": 1, "template": {"spec": cpu_spec}},
                    {"name": "workers", "replicas": 2, "template": {"spec": job_spec}},
                ]
            },
        }
        assert not run_pack(JOB_SET, job_set)
        job_spec.pop("activeDeadlineSeconds")
        found = run_pack(JOB_SET, job_set)
        assert found == {
            "gpu-workload-deadlines": [
                "JobSet replicatedJobs[1] (workers) asking for GPUs has template.spec.activeDeadlineSeconds=None: "
                "set a deadline (from trainingTimeoutMinutes) so a hung run stops billing GPUs"
            ]
        }, _report(found)

    @pytest.mark.parametrize("kind", [K8S_DEPLOYMENT, K8S_STATEFUL_SET])
    def test_gpu_controllers_without_a_deadline_need_the_explicit_label(
        self, stack_runs: dict[str, StackRun], kind: str
    ) -> None:
        template = _pod_template(stack_runs)
        controller = {
            "metadata": {"name": "vllm", "labels": {"app": "x"}},
            "spec": {"replicas": 1, "template": template},
        }
        found = run_pack(kind, controller)
        assert list(found) == ["gpu-workload-deadlines"], _report(found)
        assert "holds its GPUs until it is deleted" in found["gpu-workload-deadlines"][0]
        controller["metadata"]["labels"][LONG_RUNNING_LABEL] = "true"
        assert not run_pack(kind, controller)

    def test_cpu_controllers_need_nothing(self) -> None:
        template = {"spec": {"containers": [{"name": "c", "image": "r/x@sha256:" + "a" * 64}]}}
        assert not run_pack(K8S_DEPLOYMENT, {"metadata": {"name": "web"}, "spec": {"template": template}})


class TestCredentialNames:
    """Credentials are found by the words of their names; references to other variables are not secrets."""

    @pytest.mark.parametrize(
        ("name", "secret"),
        [
            ("HF_TOKEN", True),
            ("HuggingFaceToken", True),
            ("HFToken", True),
            ("HF_API_KEY", True),
            ("AWS_ACCESS_KEY_ID", True),
            ("DB_PASSWORD", True),
            ("TOKENIZERS_PARALLELISM", False),
            ("max_new_tokens", False),
            ("CACHE_KEY", False),
            ("GOOGLE_APPLICATION_CREDENTIALS", False),
        ],
    )
    def test_names(self, name: str, secret: bool) -> None:
        assert policies.is_secret_name(name) is secret

    @pytest.mark.parametrize("reference", ["$(HF_TOKEN)", "${HF_TOKEN}", " ${HF_API_KEY} "])
    def test_a_reference_in_a_pod_env_passes(self, stack_runs: dict[str, StackRun], reference: str) -> None:
        props = props_of(find(stack_runs, K8S_JOB))
        props["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "HF_TOKEN_COPY", "value": reference})
        assert not run_pack(K8S_JOB, props)

    def test_a_reference_in_a_ray_runtime_env_passes(self, stack_runs: dict[str, StackRun]) -> None:
        props = props_of(find(stack_runs, RAY_JOB))
        props["spec"]["runtimeEnvYAML"] = yaml.safe_dump({"env_vars": {"HF_TOKEN": "${HF_TOKEN}"}})
        assert not run_pack(RAY_JOB, props)

    def test_a_literal_around_a_reference_is_still_literal(self, stack_runs: dict[str, StackRun]) -> None:
        props = props_of(find(stack_runs, K8S_JOB))
        props["spec"]["template"]["spec"]["containers"][0]["env"].append(
            {"name": "HF_TOKEN_COPY", "value": "hf_abc${HF_TOKEN}"}
        )
        assert list(run_pack(K8S_JOB, props)) == ["tokens-from-secrets"]


WORKLOAD_BREAKS = [b for b in BROKEN if b[1] in GPU_WORKLOADS]


class TestPreviewSeesTheWorkloads:
    """PR previews apply the pack to a plan in which no image is built yet, so every digest is unknown. The
    workloads must still be visible to the rules (their names, deadlines, containers, env), with only the
    image left unknown; a workload hidden behind an unknown spec would pass every rule silently."""

    @pytest.mark.parametrize("variant", list(variants()))
    def test_only_the_image_is_unknown_in_a_workload(self, preview_runs: dict[str, StackRun], variant: str) -> None:
        workloads = [r for r in preview_runs[variant].resources if r.type in GPU_WORKLOADS | {RAY_CLUSTER}]
        assert workloads, variant
        for resource in workloads:
            props = resource.plain_inputs()
            images = [c.get("image") for _, k, v in policies.walk(props) if k == "containers" for c in v]
            assert images and all(policies.is_unknown(i) for i in images), f"{resource.urn}: {images}"
            assert not policies.workload_known_at_preview(resource.type, props), resource.urn
            if resource.type in GPU_WORKLOADS:
                assert policies.requests_gpu(props), f"{resource.urn}: not recognised as a GPU workload"
            name = props.get("name") or props["metadata"]["name"]
            assert not policies.is_unknown(name), f"{resource.urn}: the run's name must be known at preview"

    @pytest.mark.parametrize("variant", list(variants()))
    def test_every_resource_passes_in_preview(self, preview_runs: dict[str, StackRun], variant: str) -> None:
        for resource in preview_runs[variant].resources:
            found = run_pack(resource.type, resource.plain_inputs())
            assert not found, f"{resource.urn}: {_report(found)}"

    @pytest.mark.parametrize(
        ("start", "mutate", "policy", "phrase"), [b[1:] for b in WORKLOAD_BREAKS], ids=[b[0] for b in WORKLOAD_BREAKS]
    )
    def test_each_workload_rule_fires_in_preview(
        self,
        preview_runs: dict[str, StackRun],
        start: str,
        mutate: Callable[[dict[str, Any]], None],
        policy: str,
        phrase: str,
    ) -> None:
        """The deadline, digest and token rules catch a broken workload in a preview, not only at `up`."""
        resource = find(preview_runs, start)
        props = props_of(resource)
        mutate(props)
        found = run_pack(resource.type, props)
        assert list(found) == [policy], f"{resource.urn}: expected only {policy}, got {_report(found)}"
        assert any(phrase in problem for problem in found[policy]), _report(found)

    @pytest.mark.parametrize(("start", "field"), [(K8S_JOB, "spec"), (RAY_JOB, "spec"), (CLOUD_RUN_JOB, "template")])
    def test_an_unknown_workload_is_reported_as_an_advisory(
        self, preview_runs: dict[str, StackRun], start: str, field: str
    ) -> None:
        from pulumi_policy import EnforcementLevel

        resource = find(preview_runs, start)
        props = props_of(resource)
        props[field] = UNKNOWN_STRING
        found = run_pack(resource.type, props)
        assert list(found) == ["workload-known-at-preview"], _report(found)
        assert f"{field} unknown in this preview" in found["workload-known-at-preview"][0]
        (rule,) = [p for p in policies.resource_policies() if p.name == "workload-known-at-preview"]
        assert rule.enforcement_level is EnforcementLevel.ADVISORY, "a hidden workload must not block a preview"


class TestPackFiles:
    """The pack is loadable by the Pulumi CLI (Python runtime) without importing __main__.py here."""

    def test_pulumi_policy_yaml(self) -> None:
        spec = yaml.safe_load((POLICY_DIR / "PulumiPolicy.yaml").read_text())
        assert spec["runtime"]["name"] == "python"
        assert spec["runtime"]["options"]["virtualenv"] == "venv"
        # `version` (pulumi sdk/go/common/workspace/project.go, PolicyPackProject) names the pack a run used.
        assert re.fullmatch(r"\d+\.\d+\.\d+", str(spec.get("version", ""))), spec

    def test_main_only_constructs_the_pack(self) -> None:
        tree = ast.parse((POLICY_DIR / "__main__.py").read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "PolicyPack"]
        assert len(calls) == 1
        keywords = {k.arg: k.value for k in calls[0].keywords}
        assert isinstance(keywords["policies"], ast.Call)
        assert getattr(keywords["policies"].func, "id", "") == "resource_policies"
        defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)]
        assert not defs, "policies belong in policies.py, where the tests can import them"

    def test_one_policy_per_guard_rail_with_unique_names(self) -> None:
        names = [p.name for p in policies.resource_policies()]
        assert names == [rail.name for rail in policies.GUARD_RAILS]
        assert len(set(names)) == len(names) == 9

    def test_requirements_name_the_policy_sdk(self) -> None:
        lines = Path(POLICY_DIR / "requirements.txt").read_text().splitlines()
        assert any(line.startswith("pulumi-policy") for line in lines)


def _controller(kind: str, template: dict[str, Any]) -> dict[str, Any]:
    """A resource of `kind` that runs this pod template where that kind keeps it."""
    metadata = {"name": "gpu", "labels": {"app": "x"}}
    if kind.endswith(":RayService"):
        group = {"groupName": "gpu", "replicas": 1, "template": template}
        return {"metadata": metadata, "spec": {"rayClusterConfig": {"workerGroupSpecs": [group]}}}
    if kind.endswith(":LeaderWorkerSet"):
        return {"metadata": metadata, "spec": {"leaderWorkerTemplate": {"size": 2, "workerTemplate": template}}}
    return {"metadata": metadata, "spec": {"replicas": 1, "template": template}}


POD_BEARING_KINDS = [
    "kubernetes:apps/v1:DaemonSet",
    "kubernetes:apps/v1:ReplicaSet",
    "kubernetes:core/v1:ReplicationController",
    "kubernetes:apps/v1:DeploymentPatch",
    "kubernetes:ray.io/v1:RayService",
    "kubernetes:leaderworkerset.x-k8s.io/v1:LeaderWorkerSet",
    "kubernetes:example.com/v1beta1:TrainingRun",  # any CRD with a pod template
]


class TestEveryPodBearingKind:
    """Issue 23 item 7: the deadline rule judged an allow-list of kinds, so a GPU DaemonSet, ReplicaSet, RayService,
    RayCluster or LeaderWorkerSet passed. Every Kubernetes kind is judged by the pods it carries."""

    @pytest.mark.parametrize("kind", POD_BEARING_KINDS)
    def test_a_gpu_kind_without_a_deadline_field_needs_the_explicit_label(
        self, stack_runs: dict[str, StackRun], kind: str
    ) -> None:
        resource = _controller(kind, _pod_template(stack_runs))
        found = run_pack(kind, resource)
        assert list(found) == ["gpu-workload-deadlines"], _report(found)
        assert "holds its GPUs until it is deleted" in found["gpu-workload-deadlines"][0]
        resource["metadata"]["labels"][LONG_RUNNING_LABEL] = "true"
        assert not run_pack(kind, resource)

    def test_a_gpu_ray_cluster_needs_the_explicit_label(self, stack_runs: dict[str, StackRun]) -> None:
        """The RayJob's own cluster spec, as a standing RayCluster (rayCluster: standing) would carry it."""
        spec = props_of(find(stack_runs, RAY_JOB))["spec"]["rayClusterSpec"]
        cluster = {"metadata": {"name": "gemma-tuning", "labels": {"app": "x"}}, "spec": spec}
        found = run_pack(RAY_CLUSTER, cluster)
        assert list(found) == ["gpu-workload-deadlines"], _report(found)
        cluster["metadata"]["labels"][LONG_RUNNING_LABEL] = "true"
        assert not run_pack(RAY_CLUSTER, cluster)

    @pytest.mark.parametrize("kind", POD_BEARING_KINDS)
    def test_a_cpu_one_needs_nothing(self, kind: str) -> None:
        template = {"spec": {"containers": [{"name": "c", "image": "r/x@sha256:" + "a" * 64}]}}
        assert not run_pack(kind, _controller(kind, template))

    def test_a_gpu_cloud_run_service_is_not_a_kubernetes_controller(self, stack_runs: dict[str, StackRun]) -> None:
        service = find({SERVING_PRIVATE: stack_runs[SERVING_PRIVATE]}, CLOUD_RUN_SERVICE)
        assert policies.requests_gpu(service.plain_inputs()) and not run_pack(CLOUD_RUN_SERVICE, props_of(service))


def _subject(kind: str, name: str) -> dict[str, str]:
    return {"kind": kind, "name": name, "apiGroup": "rbac.authorization.k8s.io"}


class TestEveryWayOfMakingItPublic:
    """Issue 23 item 7: a binding to everyone, a LoadBalancer Service, Cloud Run v1's invoker-iam-disabled
    annotation and public Cloud Storage ACLs all passed no-public-principals."""

    RULE = "no-public-principals"

    @pytest.mark.parametrize(
        ("kind", "subject"),
        [
            ("ClusterRoleBinding", _subject("Group", "system:authenticated")),
            ("RoleBinding", _subject("Group", "system:unauthenticated")),
            ("ClusterRoleBinding", _subject("User", "system:anonymous")),
        ],
    )
    def test_a_kubernetes_binding_to_everyone(self, kind: str, subject: dict[str, str]) -> None:
        binding = {"metadata": {"name": "b"}, "roleRef": {"kind": "ClusterRole", "name": "view"}, "subjects": [subject]}
        resource_type = f"kubernetes:rbac.authorization.k8s.io/v1:{kind}"
        found = run_pack(resource_type, binding)
        assert list(found) == [self.RULE] and subject["name"] in found[self.RULE][0], _report(found)
        binding["subjects"] = [{"kind": "ServiceAccount", "name": "trainer", "namespace": "gemma-finetune"}]
        assert not run_pack(resource_type, binding)

    def test_a_load_balancer_service(self) -> None:
        service = {"metadata": {"name": "ray-head"}, "spec": {"type": "LoadBalancer", "ports": [{"port": 8265}]}}
        found = run_pack(K8S_SERVICE_TYPE, service)
        assert list(found) == [self.RULE] and "LoadBalancer" in found[self.RULE][0], _report(found)
        service["spec"]["type"] = "ClusterIP"
        assert not run_pack(K8S_SERVICE_TYPE, service)

    @pytest.mark.parametrize(
        ("spec", "annotations", "public"),
        [
            ({}, {}, True),
            ({"ingressClassName": "gce"}, {}, True),
            ({}, {"kubernetes.io/ingress.class": "gce"}, True),
            ({"ingressClassName": "gce-internal"}, {}, False),
            ({}, {"kubernetes.io/ingress.class": "gce-internal"}, False),
        ],
        ids=["no-class", "gce", "gce-annotation", "internal", "internal-annotation"],
    )
    def test_an_ingress_with_an_external_load_balancer(
        self, spec: dict[str, Any], annotations: dict[str, str], public: bool
    ) -> None:
        backend = {"service": {"name": "ray-head", "port": {"number": 8265}}}
        ingress = {
            "metadata": {"name": "dashboard", "annotations": annotations},
            "spec": {**spec, "defaultBackend": backend},
        }
        found = run_pack("kubernetes:networking.k8s.io/v1:Ingress", ingress)
        if public:
            assert list(found) == [self.RULE] and "Ingress" in found[self.RULE][0], _report(found)
        else:
            assert not found, _report(found)

    @pytest.mark.parametrize(
        ("gateway_class", "public"),
        [("gke-l7-global-external-managed", True), ("gke-l7-gxlb", True), ("gke-l7-rilb", False)],
    )
    def test_a_gateway_with_an_external_load_balancer(self, gateway_class: str, public: bool) -> None:
        gateway = {
            "metadata": {"name": "serving"},
            "spec": {
                "gatewayClassName": gateway_class,
                "listeners": [{"name": "http", "port": 80, "protocol": "HTTP"}],
            },
        }
        found = run_pack("kubernetes:gateway.networking.k8s.io/v1:Gateway", gateway)
        assert (list(found) == [self.RULE]) is public, _report(found)

    def test_cloud_run_v1_invoker_iam_disabled(self) -> None:
        annotations = {"run.googleapis.com/invoker-iam-disabled": "true"}
        service = {
            "location": "us-central1",
            "metadata": {"annotations": annotations, "labels": {"app": "x"}},
            "template": {"spec": {"containers": [{"image": "r/x@sha256:" + "a" * 64}]}},
        }
        found = run_pack("gcp:cloudrun/service:Service", service)
        assert list(found) == [self.RULE] and "invoker-iam-disabled" in found[self.RULE][0], _report(found)
        service["metadata"]["labels"]["public"] = "true"  # the same explicit choice v2 asks for
        assert not run_pack("gcp:cloudrun/service:Service", service)

    @pytest.mark.parametrize(
        ("resource_type", "props"),
        [
            (
                "gcp:storage/defaultObjectAccessControl:DefaultObjectAccessControl",
                {"bucket": "b", "entity": "allUsers", "role": "READER"},
            ),
            (
                "gcp:storage/objectAccessControl:ObjectAccessControl",
                {"bucket": "b", "object": "o", "entity": "allAuthenticatedUsers", "role": "READER"},
            ),
            (
                "gcp:storage/bucketAccessControl:BucketAccessControl",
                {"bucket": "b", "entity": "allUsers", "role": "READER"},
            ),
            (
                "gcp:storage/bucketACL:BucketACL",
                {"bucket": "b", "roleEntities": ["OWNER:project-owners-1", "READER:allUsers"]},
            ),
            (
                "gcp:storage/defaultObjectACL:DefaultObjectACL",
                {"bucket": "b", "roleEntities": ["READER:allAuthenticatedUsers"]},
            ),
            ("gcp:storage/objectACL:ObjectACL", {"bucket": "b", "object": "o", "predefinedAcl": "publicRead"}),
        ],
        ids=[
            "default-object-access-control",
            "object-access-control",
            "bucket-access-control",
            "bucket-acl",
            "default-object-acl",
            "object-acl-predefined",
        ],
    )
    def test_a_public_cloud_storage_acl(self, resource_type: str, props: dict[str, Any]) -> None:
        found = run_pack(resource_type, props)
        assert list(found) == [self.RULE], _report(found)

    def test_an_acl_for_a_named_principal_passes(self) -> None:
        props = {"bucket": "b", "entity": "user-alice@example.com", "role": "READER"}
        assert not run_pack("gcp:storage/defaultObjectAccessControl:DefaultObjectAccessControl", props)
        assert not run_pack(
            "gcp:storage/bucketACL:BucketACL", {"bucket": "b", "roleEntities": ["READER:group-ml@example.com"]}
        )


K8S_SERVICE_TYPE = "kubernetes:core/v1:Service"
