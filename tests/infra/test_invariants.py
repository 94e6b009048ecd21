"""Invariants over every stack file (and the dev stack with serving on): least privilege and secrets.

These run the real program under mocks for each variant once (the `all_runs` fixture) and
look at every resource it declares.
"""

from __future__ import annotations

import json

from infra.catalog import BASIC_ROLES, PUBLIC_MEMBERS
from infra.offline.engine import MOCK_HF_TOKEN, StackRun, unwrap_secrets
from infra.offline.plan import resources_json
from tests.infra.conftest import contains, plain_paths

# IAM resources that bind a role on ONE resource (bucket, secret, repository, service, service account).
SCOPED_IAM_TYPES = {
    "gcp:storage/bucketIAMMember:BucketIAMMember",
    "gcp:secretmanager/secretIamMember:SecretIamMember",
    "gcp:artifactregistry/repositoryIamMember:RepositoryIamMember",
    "gcp:cloudrunv2/serviceIamMember:ServiceIamMember",
    "gcp:serviceaccount/iAMMember:IAMMember",
}
# Project-wide bindings allowed, each with the reason it cannot be scoped to a resource.
PROJECT_LEVEL_ALLOWED: dict[tuple[str, str], str] = {
    ("gcp:projects/iAMMember:IAMMember", "roles/container.defaultNodeServiceAccount"): (
        "GKE nodes write logs and metrics (logging.logEntries.create, monitoring.timeSeries.create): "
        "project-level permissions only"
    ),
    ("gcp:projects/iAMMember:IAMMember", "roles/logging.logWriter"): (
        "Cloud Build's builder account writes build logs (logging.logEntries.create): project level only"
    ),
}


def iam_resources(run: StackRun) -> list:
    return [r for r in run.resources if "iam" in r.type.lower() and r.custom]


class TestEveryStackRuns:
    def test_each_variant_declares_resources_and_outputs(self, all_runs: list[StackRun]) -> None:
        for run in all_runs:
            assert len(run.resources) > 10, run.stack
            assert run.outputs["bucket"].startswith("gs://"), run.stack
            assert "@sha256:" in run.outputs["trainerImage"], run.stack

    def test_every_child_has_a_parent_component(self, all_runs: list[StackRun]) -> None:
        for run in all_runs:
            for r in run.resources:
                if r.custom and not r.type.startswith("pulumi:providers:"):
                    assert "gemma-finetune:" in r.parent, f"{r.urn} is not parented to a component"


class TestLeastPrivilege:
    """No basic roles, no public principals, every binding scoped to the one resource it is for."""

    def test_no_basic_roles(self, all_runs: list[StackRun]) -> None:
        for run in all_runs:
            for r in iam_resources(run):
                assert r.plain_inputs().get("role") not in BASIC_ROLES, f"{r.urn} grants {r.plain_inputs()['role']}"

    def test_no_public_members(self, all_runs: list[StackRun]) -> None:
        for run in all_runs:
            for r in iam_resources(run):
                member = r.plain_inputs().get("member", "")
                assert member not in PUBLIC_MEMBERS, f"{r.urn} binds {member}"

    def test_every_binding_is_resource_scoped(self, all_runs: list[StackRun]) -> None:
        for run in all_runs:
            for r in iam_resources(run):
                key = (r.type, r.plain_inputs().get("role", ""))
                assert r.type in SCOPED_IAM_TYPES or key in PROJECT_LEVEL_ALLOWED, (
                    f"{r.urn}: {r.type} is not scoped to a resource; scope it or list it with a reason"
                )

    def test_no_project_storage_admin(self, all_runs: list[StackRun]) -> None:
        for run in all_runs:
            for r in iam_resources(run):
                role = r.plain_inputs().get("role", "")
                assert role != "roles/storage.admin", f"{r.urn} grants storage admin"


class TestSecrets:
    """The HF token is a secret everywhere it travels: inputs, outputs, the plan on disk."""

    def test_token_never_plain_in_inputs(self, all_runs: list[StackRun]) -> None:
        for run in all_runs:
            carriers = 0
            for r in run.resources:
                assert plain_paths(r.inputs, MOCK_HF_TOKEN) == [], f"{r.urn} carries the token in plain text"
                carriers += contains(r.inputs, MOCK_HF_TOKEN)
            assert carriers >= 1, f"{run.stack}: the token reached no resource at all"

    def test_token_never_plain_in_resource_outputs(self, all_runs: list[StackRun]) -> None:
        for run in all_runs:
            for r in run.resources:
                assert plain_paths(r.outputs, MOCK_HF_TOKEN) == [], f"{r.urn} state carries the token"

    def test_token_not_in_stack_outputs(self, all_runs: list[StackRun]) -> None:
        for run in all_runs:
            assert MOCK_HF_TOKEN not in json.dumps(unwrap_secrets(run.outputs), default=str)

    def test_token_not_in_plan_json(self, all_runs: list[StackRun]) -> None:
        for run in all_runs:
            assert MOCK_HF_TOKEN not in json.dumps(resources_json(run), default=str)


class TestLabels:
    """Cost attribution: every labelled resource carries app, stack and workload."""

    def test_labels_on_bucket_secret_registry(self, all_runs: list[StackRun]) -> None:
        for run in all_runs:
            for typ in ("gcp:storage/bucket:Bucket", "gcp:artifactregistry/repository:Repository"):
                assert run.of_type(typ), f"{run.stack} {typ}"
                for resource in run.of_type(typ):  # the stack's bucket, and the build staging bucket with Cloud Build
                    labels = resource.plain_inputs()["labels"]
                    assert {"app", "stack", "workload"} <= set(labels), resource.urn
