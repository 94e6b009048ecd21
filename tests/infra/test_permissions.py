"""The permission proof: over every stack and user variant, each identity's grants, expanded into permissions by
public role data (infra/offline/iam_roles.json) and the setup's custom roles, cover what it needs, and no granted role is
one its identity never needs. The identities are the program's own (their grants planned by the program, their
needs listed in infra/offline/permissions.py) and the CI identities (their grants from infra/bootstrap/ci-identities.yaml,
their needs derived from what the program declares: infra/offline/api_permissions.py)."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

import pytest

from infra.config import Workload
from infra.foundation import Identity, account_email, bucket_name
from infra.offline.api_permissions import ACCOUNT_SCOPES, COMMANDS, INVOKES, Need, Scope, deploy_needs, preview_needs
from infra.offline.engine import Recorded, StackRun
from infra.offline.permissions import (
    CI_DEPLOY,
    CI_DEPLOY_PREVIEW,
    CI_PREVIEW,
    CI_PREVIEW_GKE,
    ROLES_FILE,
    RUNTIMES,
    Grant,
    borrowed,
    ci_grants,
    ci_identities,
    ci_member,
    condition_holds,
    covers,
    granted_roles,
    markdown,
    missing,
    needs_of,
    permissions_of,
    planned_grants,
    role_permissions,
    stack_features,
    unneeded,
)
from tests.infra.conftest import Variant


def _grants(run: StackRun) -> list[Grant]:
    assert run.cfg is not None
    return planned_grants(run, run.cfg)


def _all(run: StackRun) -> list[Grant]:
    assert run.cfg is not None
    return [*_grants(run), *ci_grants(run.cfg)]


def _problems(runs: list[tuple[Variant, StackRun]], check: Callable[[StackRun], list[str]]) -> str:
    return "\n".join(f"[{variant.label}] {problem}" for variant, run in runs for problem in check(run))


def _setup_groups(runs: list[tuple[Variant, StackRun]]) -> dict[tuple[str, str, frozenset[str]], list[StackRun]]:
    """Variants that the CI setup cannot tell apart (same stack, workload and features) share its grants."""
    groups: dict[tuple[str, str, frozenset[str]], list[StackRun]] = defaultdict(list)
    for variant, run in runs:
        assert run.cfg is not None
        groups[(variant.stack, str(run.cfg.workload), stack_features(run.cfg))].append(run)
    return groups


@pytest.fixture(scope="session")
def proof_runs(user_variant_runs: list[tuple[Variant, StackRun]]) -> list[tuple[Variant, StackRun]]:
    """The user variants, plus for each group the setup grants for a twin whose bucket `pulumi destroy` kept: every
    stack can be in that state (the bucket is retained by default), and its next preview imports the bucket."""
    twins = []
    for runs in _setup_groups(user_variant_runs).values():
        variant = next(v for v, run in user_variant_runs if run is runs[0])
        assert runs[0].cfg is not None
        kept = replace(variant, label=f"{variant.label}, bucket kept", existing_buckets=(bucket_name(runs[0].cfg),))
        twins.append((kept, kept.run()))
    return [*user_variant_runs, *twins]


def _member(run: StackRun, account: str) -> str:
    assert run.cfg is not None
    return ci_member(account)(run.cfg)


# The 18 variant runs (a shared session fixture) take about 15 s on 2 busy cores; the proof over them ~20 s more.
@pytest.mark.slow
class TestProof:
    def test_every_needed_permission_is_granted(self, proof_runs: list[tuple[Variant, StackRun]]) -> None:
        problems = _problems(proof_runs, lambda run: missing(run, _all(run)))
        assert problems == "", problems

    def test_every_role_the_program_grants_is_needed(self, proof_runs: list[tuple[Variant, StackRun]]) -> None:
        problems = _problems(proof_runs, lambda run: unneeded([run], _grants(run)))
        assert problems == "", problems

    def test_every_role_the_ci_setup_grants_is_needed(self, proof_runs: list[tuple[Variant, StackRun]]) -> None:
        problems = []
        for group, runs in _setup_groups(proof_runs).items():
            assert runs[0].cfg is not None
            problems += [f"[{group}] {p}" for p in unneeded(runs, ci_grants(runs[0].cfg))]
        assert problems == [], "\n".join(problems)

    def test_every_identity_the_stack_creates_has_a_runtime_row(
        self, user_variant_runs: list[tuple[Variant, StackRun]]
    ) -> None:
        for variant, run in user_variant_runs:
            assert run.cfg is not None
            members = {runtime.member(run.cfg) for runtime in RUNTIMES if runtime.applies(run.cfg)}
            for account in run.of_type("gcp:serviceaccount/account:Account"):
                member = f"serviceAccount:{account.outputs['email']}"
                assert member in members, f"[{variant.label}] {account.urn} has no row in infra/offline/permissions.py"

    def test_every_ci_identity_has_a_row(self) -> None:
        rows = {runtime.name.split(":")[0] for runtime in RUNTIMES if runtime.derived}
        assert rows == set(ci_identities()["identities"]) == {CI_PREVIEW, CI_PREVIEW_GKE, CI_DEPLOY_PREVIEW, CI_DEPLOY}

    def test_the_deploy_may_grant_exactly_the_project_roles_the_program_grants(
        self, user_variant_runs: list[tuple[Variant, StackRun]]
    ) -> None:
        """The `modifiedGrantsByRole` conditions name no role the program does not grant on the project (the
        proof shows they name every one it does: a missing one is a missing setIamPolicy)."""
        granted = {
            r.plain_inputs()["role"]
            for _, run in user_variant_runs
            for r in run.of_type("gcp:projects/iAMMember:IAMMember")
        }
        allowed = {
            role
            for entry in ci_identities()["identities"][CI_DEPLOY]["grants"]
            if "modifiedGrantsByRole" in entry.get("condition", "")
            for role in re.findall(r"'(roles/[^']+)'", entry["condition"])
        }
        assert granted and allowed == granted


# Permissions IAM checks on the project (or its parent): granted on one account or bucket they give nothing.
_CHECKED_ON_THE_PROJECT = frozenset(
    {
        "resourcemanager.projects.get",
        "resourcemanager.projects.list",
        "iam.serviceAccounts.list",
        "storage.buckets.list",
    }
)


@pytest.mark.slow
class TestWhatTheDeployCanBorrow:
    """The deploy identity acts as (actAs) or binds (setIamPolicy) the stacks' own accounts. Whatever role lets it do
    that, on an account, carries nothing else it does not need there; and an account it can bind itself to (the
    trainer, whose Workload Identity binding it makes) holds nothing the deploy does not hold already."""

    def test_a_role_on_an_account_gives_only_what_is_needed_on_it(
        self, proof_runs: list[tuple[Variant, StackRun]]
    ) -> None:
        """roles/iam.serviceAccountAdmin would give delete, disable, update and serviceAccountApiKeyBindings.create
        (an API key that authenticates as the account) on the trainer: the binder role is what the binding calls."""
        problems = []
        for group, runs in _setup_groups(proof_runs).items():
            assert runs[0].cfg is not None
            needed: dict[tuple[str, Scope], set[str]] = defaultdict(set)
            for run in runs:
                for member, member_needs in needs_of(run).items():
                    for _, need in member_needs:
                        needed[(member, need.scope)].add(need.permission)
            for grant in ci_grants(runs[0].cfg):
                if grant.scope not in ACCOUNT_SCOPES.values():
                    continue
                extra = permissions_of(grant.role, grant.origin) - needed[(grant.member, grant.scope)]
                if extra - _CHECKED_ON_THE_PROJECT:
                    problems.append(f"[{group}] {grant.origin}: also gives {sorted(extra - _CHECKED_ON_THE_PROJECT)}")
        assert problems == [], "\n".join(problems)

    def test_the_trainer_holds_nothing_the_deploy_lacks(self, proof_runs: list[tuple[Variant, StackRun]]) -> None:
        """Making the trainer's Workload Identity binding needs setIamPolicy on it, which would let the deploy bind
        itself too: that must lend it no permission it lacks (and on Cloud Run stacks it may actAs the trainer)."""
        problems = []
        for variant, run in proof_runs:
            assert run.cfg is not None
            trainer = f"serviceAccount:{account_email(run.cfg, Identity.TRAINER)}"
            deploy = [g for g in ci_grants(run.cfg) if g.member == _member(run, CI_DEPLOY)]
            for grant in _grants(run):
                if grant.member != trainer:
                    continue
                for permission in sorted(permissions_of(grant.role, grant.origin) - _CHECKED_ON_THE_PROJECT):
                    need = Need(permission, grant.scope, f"the trainer's {grant.role}")
                    if not any(covers(g, need, run.cfg) for g in deploy):
                        problems.append(
                            f"[{variant.label}] the trainer's {grant.role} gives {permission} on {grant.scope}"
                        )
        assert problems == [], "\n".join(problems)

    def test_whoever_can_start_a_pod_as_the_trainer_borrows_nothing_it_lacks_unless_fenced(
        self, proof_runs: list[tuple[Variant, StackRun]]
    ) -> None:
        """container.developer (a server-side dry run needs the write verbs) lets its holder create a pod, exec into
        one or mint a token as the trainer's Kubernetes service account, whose Workload Identity binding makes it the
        trainer: the deploy holds everything the trainer does already; the preview identities do not, and the
        admission fence keeps them to dry runs (infra/admission.py, tests/infra/test_admission.py)."""
        problems = [f"[{variant.label}] {line}" for variant, run in proof_runs for line in borrowed(run)]
        assert problems == [], "\n".join(problems)

    def test_the_binder_is_smaller_than_service_account_admin(self) -> None:
        roles = role_permissions()
        binder, admin = roles["gftCiWorkloadIdentityBinder"], roles["roles/iam.serviceAccountAdmin"]
        assert binder < admin
        assert {"iam.serviceAccounts.delete", "iam.serviceAccountApiKeyBindings.create"} <= admin - binder


@pytest.mark.slow
class TestAcrossStacks:
    """The proof judges one stack at a time; this judges the stacks of one project together. A principal a stack's
    program grants (its accounts, and its pods' Workload Identity principal PROJECT.svc.id.goog[NAMESPACE/KSA], the
    same principal in every cluster of the project) is granted by that stack only: otherwise pods of one stack could
    act as another stack's trainer and read or delete its models."""

    def test_no_principal_is_granted_by_two_stacks(self, proof_runs: list[tuple[Variant, StackRun]]) -> None:
        projects = {run.cfg.project for _, run in proof_runs if run.cfg}
        assert len(projects) == 1, "the stack files share one project: the case this checks"
        stacks_of: dict[str, set[str]] = defaultdict(set)
        for _, run in proof_runs:
            for grant in _grants(run):
                stacks_of[grant.member].add(run.stack)
        shared = {member: sorted(stacks) for member, stacks in stacks_of.items() if len(stacks) > 1}
        assert len({run.stack for _, run in proof_runs}) == 3 and stacks_of
        assert shared == {}, f"principals granted by more than one stack: {shared}"

    def test_each_gke_stack_has_its_own_namespace(self, proof_runs: list[tuple[Variant, StackRun]]) -> None:
        namespaces = {
            run.stack: run.cfg.namespace for _, run in proof_runs if run.cfg and run.cfg.workload.value != "cloud-run"
        }
        assert len(namespaces) == 2 and len(set(namespaces.values())) == 2, namespaces


@pytest.mark.slow
class TestTheProofCanFail:
    """The checker itself: each kind of defect it exists for is reported."""

    @pytest.fixture(scope="class")
    def ray(self, user_variant_runs: list[tuple[Variant, StackRun]]) -> StackRun:
        return next(run for variant, run in user_variant_runs if variant.stack == "ray-gemma3-vision")

    @pytest.fixture(scope="class")
    def dev(self, user_variant_runs: list[tuple[Variant, StackRun]]) -> StackRun:
        return next(run for variant, run in user_variant_runs if variant.label == "dev, serving")

    def test_a_dropped_grant_is_a_missing_permission(self, ray: StackRun) -> None:
        kept = [g for g in _all(ray) if g.role != "roles/storage.bucketViewer"]
        problems = missing(ray, kept)
        assert len(problems) == 1 and "lacks storage.buckets.get on the stack's bucket" in problems[0]

    def test_an_unfenced_preview_borrows_the_trainers_bucket_rights(self, ray: StackRun) -> None:
        unfenced = replace(ray, resources=[r for r in ray.resources if "preview-fence" not in r.name])
        problems = borrowed(unfenced)
        for account in (CI_PREVIEW_GKE, CI_DEPLOY_PREVIEW):
            assert any(
                line.startswith(f"serviceAccount:{account}@") and "storage.objects.create" in line for line in problems
            ), problems
        assert not any(line.startswith(f"serviceAccount:{CI_DEPLOY}@") for line in problems), problems

    def test_a_project_role_counts_for_every_resource(self, ray: StackRun) -> None:
        assert ray.cfg is not None
        trainer = f"serviceAccount:{account_email(ray.cfg, Identity.TRAINER)}"
        on_project = [replace(g, scope=Scope.PROJECT) if g.member == trainer else g for g in _grants(ray)]
        assert missing(ray, [*on_project, *ci_grants(ray.cfg)]) == []
        assert any("gives" in p and "nothing it needs" in p for p in unneeded([ray], on_project))

    def test_a_role_nobody_needs_is_reported(self, ray: StackRun) -> None:
        assert ray.cfg is not None
        trainer = f"serviceAccount:{account_email(ray.cfg, Identity.TRAINER)}"
        extra = Grant(trainer, "roles/run.invoker", Scope.BUCKET, "test")
        assert unneeded([ray], [*_grants(ray), extra]) == [
            f"test: roles/run.invoker on {Scope.BUCKET} gives {trainer} nothing it needs there"
        ]

    def test_a_grant_to_a_stranger_is_reported(self, ray: StackRun) -> None:
        stranger = Grant(
            "serviceAccount:123-compute@developer.gserviceaccount.com",
            "roles/artifactregistry.reader",
            Scope.REGISTRY,
            "test",
        )
        assert any("an identity no runtime of this stack uses" in p for p in unneeded([ray], [stranger]))

    def test_a_ci_grant_dropped_from_the_setup_is_a_missing_permission(self, ray: StackRun) -> None:
        """The kept-bucket check runs in every preview: without the lister role the deploy cannot even preview."""
        deploy = _member(ray, CI_DEPLOY)
        kept = [g for g in _all(ray) if not (g.member == deploy and g.role.endswith("/gftCiBucketLister"))]
        problems = missing(ray, kept)
        assert len(problems) == 1, problems
        assert f"({deploy}) lacks storage.buckets.list on the project" in problems[0]
        assert "gcp:storage/getBuckets:getBuckets" in problems[0]

    def test_actas_follows_the_account_a_resource_runs_as(self, dev: StackRun) -> None:
        deploy = _member(dev, CI_DEPLOY)
        kept = [g for g in _all(dev) if not (g.member == deploy and g.scope is Scope.SERVING_ACCOUNT)]
        problems = missing(dev, kept)
        assert any(f"lacks iam.serviceAccounts.actAs on {Scope.SERVING_ACCOUNT}" in p for p in problems), problems
        assert any("gcp:cloudrunv2/service:Service" in p for p in problems), problems

    def test_the_api_key_is_read_only_through_its_accessor_grant(
        self, user_variant_runs: list[tuple[Variant, StackRun]]
    ) -> None:
        """The vLLM Service resolves VLLM_API_KEY as the serving account: the foundation's grant is what gives it."""
        keyed = next(run for variant, run in user_variant_runs if "API key" in variant.label)
        kept = [g for g in _all(keyed) if g.scope is not Scope.API_KEY_SECRET]
        problems = missing(keyed, kept)
        assert len(problems) == 1, problems
        assert f"lacks secretmanager.versions.access on {Scope.API_KEY_SECRET}" in problems[0]

    def test_a_condition_that_does_not_name_the_granted_role_is_a_missing_permission(self, ray: StackRun) -> None:
        swapped = [
            replace(g, condition=g.condition.replace("container.defaultNodeServiceAccount", "run.invoker"))
            if g.condition and "modifiedGrantsByRole" in g.condition
            else g
            for g in _all(ray)
        ]
        problems = missing(ray, swapped)
        assert len(problems) == 1 and "lacks resourcemanager.projects.setIamPolicy on the project" in problems[0]

    def test_a_bucket_condition_does_not_reach_the_state_bucket(self, ray: StackRun) -> None:
        assert ray.cfg is not None
        deploy = _member(ray, CI_DEPLOY)
        [admin] = [g for g in _all(ray) if g.member == deploy and g.role == "roles/storage.admin"]
        write = Need("storage.objects.create", Scope.STATE_BUCKET, "test")
        assert not condition_holds(admin.condition, write, ray.cfg)
        assert condition_holds(admin.condition, replace(write, scope=Scope.BUCKET), ray.cfg)

    @pytest.fixture(scope="class")
    def ray_states(self, ray: StackRun, proof_runs: list[tuple[Variant, StackRun]]) -> list[StackRun]:
        """The Ray stack as the setup grants for it: new, and after a destroy kept its bucket."""
        kept = [run for v, run in proof_runs if v.existing_buckets and run.cfg == ray.cfg]
        assert len(kept) == 1
        return [ray, *kept]

    def test_a_ci_role_the_program_never_needs_is_reported(self, ray: StackRun, ray_states: list[StackRun]) -> None:
        """E.g. Cloud Run admin on a GKE stack: of what it gives, the deploy needs only what it already has."""
        extra = Grant(_member(ray, CI_DEPLOY), "roles/run.admin", Scope.PROJECT, "test")
        assert ray.cfg is not None
        assert unneeded(ray_states, [*ci_grants(ray.cfg), extra]) == [
            f"test: roles/run.admin on {Scope.PROJECT} gives {extra.member} only what other grants give: "
            "['resourcemanager.projects.get']"
        ]

    def test_a_role_granted_for_a_permission_another_grant_gives_is_reported(
        self, ray: StackRun, ray_states: list[StackRun]
    ) -> None:
        """roles/browser for resourcemanager.projects.get, which the registry admin role carries already."""
        browser = Grant(_member(ray, CI_DEPLOY), "roles/browser", Scope.PROJECT, "test")
        assert ray.cfg is not None
        [problem] = unneeded(ray_states, [*ci_grants(ray.cfg), browser])
        assert problem.startswith("test: roles/browser") and "only what other grants give" in problem

    def test_a_resource_type_without_a_row_fails_the_proof(self, ray: StackRun) -> None:
        firewall = Recorded(
            type="gcp:compute/firewall:Firewall",
            name="open",
            urn="urn:pulumi:s::p::gcp:compute/firewall:Firewall::open",
            parent="",
            custom=True,
            inputs={"project": "my-gcp-project"},
            dependencies=[],
            provider="",
            retain_on_delete=False,
            protect=False,
            custom_timeouts={},
        )
        with pytest.raises(ValueError, match="resource type gcp:compute/firewall:Firewall is unknown"):
            deploy_needs(replace(ray, resources=[*ray.resources, firewall]))

    def test_an_invoke_without_a_row_fails_the_proof(self, ray: StackRun) -> None:
        account = ("gcp:billing/getAccount:getAccount", {"billingAccount": "012345-6789AB-CDEF01"})
        with pytest.raises(ValueError, match="getAccount is unknown"):
            preview_needs(replace(ray, invokes=[*ray.invokes, account]))


@pytest.mark.slow
class TestDerivedNeeds:
    """What the CI identities need follows the program, not a list."""

    def test_previews_run_no_command_and_change_nothing(self, proof_runs: list[tuple[Variant, StackRun]]) -> None:
        for variant, run in proof_runs:
            for need in preview_needs(run):
                verb = need.permission.rsplit(".", 1)[-1]
                if not need.permission.startswith("container."):  # a Kubernetes dry run needs the write verbs
                    assert verb in ("get", "list"), f"[{variant.label}] a preview calls {need.permission}: {need.why}"
                assert not any(command.name in need.why for command in COMMANDS.values()), variant.label

    def test_the_dev_deploy_needs_to_start_the_job_and_the_ray_deploy_to_read_crds(
        self, user_variant_runs: list[tuple[Variant, StackRun]]
    ) -> None:
        runs = {variant.label: run for variant, run in user_variant_runs}
        assert "run.jobs.run" in {n.permission for n in deploy_needs(runs["dev"])}
        ray_needs = {n.permission for n in deploy_needs(runs["ray, standing"])}
        assert {"container.customResourceDefinitions.get", "container.customResourceDefinitions.list"} <= ray_needs
        builds = {(n.permission, n.scope) for n in deploy_needs(runs["dev, serving"])}
        assert {("cloudbuild.builds.create", Scope.PROJECT), ("storage.objects.create", Scope.BUILD_STAGING)} <= builds

    def test_a_reservation_is_read_only_when_a_stack_uses_one(
        self, user_variant_runs: list[tuple[Variant, StackRun]]
    ) -> None:
        for variant, run in user_variant_runs:
            assert run.cfg is not None
            reads = "compute.reservations.get" in {n.permission for n in preview_needs(run)}
            assert reads == ("reservation" in stack_features(run.cfg)), variant.label

    def test_gpu_quota_is_read_where_the_run_draws_on_it(
        self, user_variant_runs: list[tuple[Variant, StackRun]]
    ) -> None:
        """Every preview of a Cloud Run stack, and of a GKE stack whose capacity is not a reservation, reads GPU
        quota (so each CI identity of such a stack needs cloudquotas.quotas.get on the project); no other does."""
        for variant, run in user_variant_runs:
            assert run.cfg is not None
            reads = {(n.permission, n.scope) for n in preview_needs(run) if n.permission.startswith("cloudquotas.")}
            draws = run.cfg.workload.value == "cloud-run" or "gpu-quota" in stack_features(run.cfg)
            assert reads == ({("cloudquotas.quotas.get", Scope.PROJECT)} if draws else set()), variant.label

    def test_a_budget_is_managed_on_its_billing_account(
        self, user_variant_runs: list[tuple[Variant, StackRun]]
    ) -> None:
        """The deploy manages the budget on the billing account and its channels in the project; a preview reads
        nothing for it; a grant on the project does not reach a billing account."""
        run = {variant.label: run for variant, run in user_variant_runs}["a4, spot, budget, alert emails"]
        needs = {(n.permission, n.scope) for n in deploy_needs(run)}
        assert {
            ("billing.budgets.create", Scope.BILLING_ACCOUNT),
            ("billing.budgets.delete", Scope.BILLING_ACCOUNT),
            ("monitoring.notificationChannels.create", Scope.PROJECT),
        } <= needs
        assert not [n for n in preview_needs(run) if n.permission.startswith(("billing.", "monitoring."))]
        assert missing(run, _all(run)) == []
        moved = [replace(g, scope=Scope.PROJECT) if g.scope is Scope.BILLING_ACCOUNT else g for g in _all(run)]
        assert any(f"lacks billing.budgets.create on {Scope.BILLING_ACCOUNT}" in p for p in missing(run, moved))

    def test_a_preview_after_destroy_reads_the_kept_bucket(self, proof_runs: list[tuple[Variant, StackRun]]) -> None:
        """After `pulumi destroy` kept the bucket, the next preview imports it, and the engine's ImportStep reads it in
        a preview too: both preview identities need storage.buckets.get on it, which the listing alone does not give."""
        kept = [(variant, run) for variant, run in proof_runs if variant.existing_buckets]
        assert {run.cfg.workload for _, run in kept if run.cfg} >= {
            Workload.CLOUD_RUN,
            Workload.GKE_JOB,
            Workload.GKE_RAY,
        }
        for variant, run in proof_runs:
            imported = [r for r in run.of_type("gcp:storage/bucket:Bucket") if r.import_id]
            reads = [n for n in preview_needs(run) if (n.permission, n.scope) == ("storage.buckets.get", Scope.BUCKET)]
            assert bool(imported) == bool(variant.existing_buckets) == bool(reads), variant.label
            assert all("ImportStep" in n.why for n in reads), reads
            if reads:
                preview = CI_PREVIEW if run.cfg and run.cfg.workload is Workload.CLOUD_RUN else CI_PREVIEW_GKE
                dropped = [g for g in _all(run) if not (g.member == _member(run, preview) and "bucketViewer" in g.role)]
                assert any(
                    f"({_member(run, preview)}) lacks storage.buckets.get on {Scope.BUCKET}" in problem
                    for problem in missing(run, dropped)
                ), variant.label

    def test_every_invoke_row_is_one_the_program_calls(self, user_variant_runs: list[tuple[Variant, StackRun]]) -> None:
        called = {token for _, run in user_variant_runs for token, _ in run.invokes}
        assert called == set(INVOKES)


class TestRoleData:
    def test_one_vendored_file_with_its_source(self) -> None:
        data = json.loads(ROLES_FILE.read_text())
        assert "iann0036/iam-dataset" in data["source"] and "2073fa52" in data["source"]
        assert all(entry["permissions"] for entry in data["roles"].values())
        assert not list(ROLES_FILE.parent.glob("bootstrap/*.json")), "the CI setup uses the same role data"

    def test_every_role_the_setup_grants_has_data(self) -> None:
        assert granted_roles() <= set(role_permissions())

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

    def test_the_legacy_build_account_reaches_every_bucket(self) -> None:
        """Why the setup refuses a legacy default Cloud Build account that keeps its project role
        (infra/bootstrap/ci-setup.sh): granted on the project, it reads and writes objects of every bucket."""
        builder = role_permissions()["roles/cloudbuild.builds.builder"]
        assert {"storage.objects.get", "storage.objects.create", "storage.objects.delete"} <= builder

    def test_table_renders_every_listed_need(self) -> None:
        table = markdown()
        assert table.count("\n") == 1 + sum(len(r.needs) for r in RUNTIMES)


class TestDataInAnotherBucket:
    """The user's recipe reads gs:// rows outside the stack's bucket (infra/data_access.py): the trainer gets read
    access to exactly that prefix; Hub and local data get no grant."""

    @pytest.fixture(scope="class")
    def data_run(self, user_variant_runs: list[tuple[Variant, StackRun]]) -> StackRun:
        return next(run for variant, run in user_variant_runs if variant.label == "dev, data in another bucket")

    def _data_grants(self, run: StackRun) -> list[Grant]:
        return [g for g in _grants(run) if g.scope is Scope.DATA]

    def test_the_trainer_reads_exactly_the_prefix(self, data_run: StackRun) -> None:
        assert data_run.cfg is not None
        (grant,) = self._data_grants(data_run)
        assert grant.member == f"serviceAccount:{account_email(data_run.cfg, Identity.TRAINER)}"
        assert grant.role == "roles/storage.objectViewer"
        data = "projects/_/buckets/my-gcp-project-gft-data"
        inside = Need("storage.objects.get", Scope.DATA, "t", resource=f"{data}/objects/tickets/train-0.jsonl")
        listing = Need("storage.objects.list", Scope.DATA, "t", resource=data, list_prefix="tickets/")
        assert covers(grant, inside, data_run.cfg) and covers(grant, listing, data_run.cfg)
        for outside in (
            replace(inside, resource=f"{data}/objects/tickets/secret.jsonl"),  # same folder, not the prefix
            replace(inside, resource=f"{data}/objects/payroll/train-0.jsonl"),
            replace(listing, list_prefix="payroll/"),
            replace(listing, list_prefix=""),  # the whole bucket
            Need("storage.objects.create", Scope.DATA, "t", resource=f"{data}/objects/tickets/train-9.jsonl"),
        ):
            assert not covers(grant, outside, data_run.cfg), outside

    def test_without_the_grant_the_trainer_cannot_read_its_data(self, data_run: StackRun) -> None:
        problems = missing(data_run, [g for g in _all(data_run) if g.scope is not Scope.DATA])
        assert any(f"lacks storage.objects.get on {Scope.DATA}" in p for p in problems), problems
        assert any(f"lacks storage.objects.list on {Scope.DATA}" in p for p in problems), problems

    def test_a_hub_or_local_dataset_gets_no_grant(self, user_variant_runs: list[tuple[Variant, StackRun]]) -> None:
        for variant, run in user_variant_runs:
            if variant.label != "dev, data in another bucket":
                assert self._data_grants(run) == [], variant.label

    def test_a_held_out_file_beside_the_data_is_read_through_the_same_one_grant(self) -> None:
        """Every prefix of the data's bucket (sources, data.eval_path, data.image_dir) in one grant whose condition
        covers each and nothing else (infra/data_access.py `data_read_grants`)."""
        from infra.offline.engine import run_stack
        from tests.infra.conftest import OWN_DATA_PATH, OWN_DATA_RECIPE

        held_out = ["data.eval_rows=0", "data.eval_path=gs://my-gcp-project-gft-data/held/eval.jsonl"]
        run = run_stack("dev", overrides={"recipe": OWN_DATA_RECIPE, "recipeOverrides": [OWN_DATA_PATH, *held_out]})
        assert run.cfg is not None
        (grant,) = self._data_grants(run)
        data = "projects/_/buckets/my-gcp-project-gft-data"
        for name in ("tickets/train-0.jsonl", "held/eval.jsonl"):
            assert covers(
                grant, Need("storage.objects.get", Scope.DATA, "t", resource=f"{data}/objects/{name}"), run.cfg
            )
        for folder in ("tickets/", "held/"):
            listing = Need("storage.objects.list", Scope.DATA, "t", resource=data, list_prefix=folder)
            assert covers(grant, listing, run.cfg)
        outside = Need("storage.objects.get", Scope.DATA, "t", resource=f"{data}/objects/held/other.jsonl")
        assert not covers(grant, outside, run.cfg)
        assert missing(run, _all(run)) == []  # the permission proof: the trainer reads both, CI may grant it

    def test_a_bucket_the_deploy_does_not_administer_is_reported(self) -> None:
        """CI's deploy identity administers PROJECT-gft-* buckets only: a grant on another bucket needs its owner."""
        from infra.offline.engine import run_stack
        from tests.infra.conftest import OWN_DATA_RECIPE

        run = run_stack(
            "dev", overrides={"recipe": OWN_DATA_RECIPE, "recipeOverrides": ["data.path=gs://team/t/x.jsonl"]}
        )
        (grant,) = self._data_grants(run)
        assert grant.condition is not None and "objects/t/x.jsonl" in grant.condition
        problems = missing(run, _all(run))
        assert problems and all(CI_DEPLOY in p and f"on {Scope.DATA}" in p for p in problems), problems
        assert any("storage.buckets.setIamPolicy" in p for p in problems)
