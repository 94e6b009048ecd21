"""The permission proof: over every stack and user variant, each identity's planned grants, expanded into
permissions by public role data (infra/iam_roles.json), cover what its runtime needs (infra/permissions.py),
and no granted role is one its identity never needs."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import pytest

from infra.config import StackConfig
from infra.foundation import Identity, account_email
from infra.offline import StackRun
from infra.permissions import (
    ROLES_FILE,
    RUNTIMES,
    Grant,
    Scope,
    markdown,
    missing,
    planned_grants,
    role_permissions,
    unneeded,
)
from tests.infra.conftest import Variant


def _grants(run: StackRun) -> list[Grant]:
    assert run.cfg is not None
    return planned_grants(run, run.cfg)


def _problems(runs: list[tuple[Variant, StackRun]], check: Callable[[StackConfig, list[Grant]], list[str]]) -> str:
    return "\n".join(
        f"[{variant.label}] {problem}"
        for variant, run in runs
        for problem in check(run.cfg, _grants(run))  # type: ignore[arg-type]
    )


# The 16 variant runs (a shared session fixture) take about 15 s on 2 busy cores.
@pytest.mark.slow
class TestProof:
    def test_every_needed_permission_is_granted(self, user_variant_runs: list[tuple[Variant, StackRun]]) -> None:
        problems = _problems(user_variant_runs, missing)
        assert problems == "", problems

    def test_every_granted_role_is_needed(self, user_variant_runs: list[tuple[Variant, StackRun]]) -> None:
        problems = _problems(user_variant_runs, unneeded)
        assert problems == "", problems

    def test_every_identity_the_stack_creates_has_a_runtime_row(
        self, user_variant_runs: list[tuple[Variant, StackRun]]
    ) -> None:
        for variant, run in user_variant_runs:
            assert run.cfg is not None
            members = {runtime.member(run.cfg) for runtime in RUNTIMES if runtime.applies(run.cfg)}
            for account in run.of_type("gcp:serviceaccount/account:Account"):
                member = f"serviceAccount:{account.outputs['email']}"
                assert member in members, f"[{variant.label}] {account.urn} has no row in infra/permissions.py"


@pytest.mark.slow
class TestTheProofCanFail:
    """The checker itself: each kind of defect it exists for is reported."""

    @pytest.fixture(scope="class")
    def ray(self, user_variant_runs: list[tuple[Variant, StackRun]]) -> StackRun:
        return next(run for variant, run in user_variant_runs if variant.stack == "ray-gemma3-vision")

    def test_a_dropped_grant_is_a_missing_permission(self, ray: StackRun) -> None:
        assert ray.cfg is not None
        kept = [g for g in _grants(ray) if g.role != "roles/storage.bucketViewer"]
        problems = missing(ray.cfg, kept)
        assert len(problems) == 1 and "lacks storage.buckets.get on the stack's bucket" in problems[0]

    def test_a_project_role_counts_for_every_resource(self, ray: StackRun) -> None:
        assert ray.cfg is not None
        trainer = f"serviceAccount:{account_email(ray.cfg, Identity.TRAINER)}"
        on_project = [replace(g, scope=Scope.PROJECT) if g.member == trainer else g for g in _grants(ray)]
        assert missing(ray.cfg, on_project) == []
        assert any("gives" in p and "nothing it needs" in p for p in unneeded(ray.cfg, on_project))

    def test_a_role_nobody_needs_is_reported(self, ray: StackRun) -> None:
        assert ray.cfg is not None
        trainer = f"serviceAccount:{account_email(ray.cfg, Identity.TRAINER)}"
        extra = Grant(trainer, "roles/run.invoker", Scope.BUCKET, "test")
        assert unneeded(ray.cfg, [*_grants(ray), extra]) == [
            f"test: roles/run.invoker on {Scope.BUCKET} gives {trainer} nothing it needs there"
        ]

    def test_a_grant_to_a_stranger_is_reported(self, ray: StackRun) -> None:
        assert ray.cfg is not None
        stranger = Grant(
            "serviceAccount:123-compute@developer.gserviceaccount.com",
            "roles/artifactregistry.reader",
            Scope.REGISTRY,
            "test",
        )
        assert any("an identity no runtime of this stack uses" in p for p in unneeded(ray.cfg, [stranger]))


class TestRoleData:
    def test_vendored_with_its_source(self) -> None:
        data = json.loads(ROLES_FILE.read_text())
        assert "iann0036/iam-dataset" in data["source"] and "2073fa52" in data["source"]
        assert all(entry["permissions"] for entry in data["roles"].values())

    def test_objectuser_lacks_bucket_metadata_and_the_ray_grant_adds_only_that(self) -> None:
        roles = role_permissions()
        assert "storage.buckets.get" not in roles["roles/storage.objectUser"]
        # On a bucket, buckets.list grants nothing: bucketViewer adds exactly buckets.get; legacyBucketReader
        # would also repeat object listing that objectUser already gives.
        assert roles["roles/storage.bucketViewer"] - roles["roles/storage.objectUser"] == {
            "storage.buckets.get",
            "storage.buckets.list",
        }
        assert len(roles["roles/storage.bucketViewer"]) < len(roles["roles/storage.legacyBucketReader"])

    def test_table_renders_every_need(self) -> None:
        table = markdown()
        assert table.count("\n") == 1 + sum(len(r.needs) for r in RUNTIMES)
