"""`pulumi up` → `pulumi destroy` → `pulumi up` with the kept bucket and the kept service accounts.

The mock cloud behaves as Cloud Storage and IAM do: a bucket name that exists answers 409 to a create, and an
import of a bucket that does not exist fails; a service account id that exists answers 409 to a create
unless the resource says `createIgnoreAlreadyExists`. `destroy` is modelled from what the program declared:
every resource goes except those registered with `retain_on_delete` and the accounts whose provider
`deletionPolicy` is ABANDON. The second `up` must then adopt the kept bucket (import by its name, the
bucket's ID) with the very inputs the first `up` created it with, and the engine's import must find nothing
to replace in what the provider reads back (`import_then_update`), so the models in it stay where the stack
outputs point; and it must adopt the kept accounts, as the first `up` in a project the CI setup prepared
(infra/bootstrap/ci-setup.sh creates them) must.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import pytest
from pulumi.runtime.mocks import MockResourceArgs

from infra.offline.engine import Mocks, Recorded, StackRun, run_stack, stack_names
from infra.offline.impact import classify, covers, diff_paths, rules
from tests.infra.conftest import PREBUILT

BUCKET = "gcp:storage/bucket:Bucket"
ACCOUNT = "gcp:serviceaccount/account:Account"


def up(stack: str, existing: tuple[str, ...] = (), accounts: tuple[str, ...] = (), **overrides: object) -> StackRun:
    return run_stack(
        stack,
        overrides={**PREBUILT, **overrides},
        existing_buckets=existing,
        existing_accounts=accounts,
        assume_trained=True,
    )


def accounts_kept_after_destroy(run: StackRun) -> tuple[str, ...]:
    return tuple(sorted(r.plain_inputs()["accountId"] for r in run.of_type(ACCOUNT) if abandoned(r)))


def abandoned(account: Recorded) -> bool:
    return account.plain_inputs().get("deletionPolicy") == "ABANDON"


def kept_after_destroy(run: StackRun) -> tuple[str, ...]:
    return tuple(sorted(r.plain_inputs()["name"] for r in run.of_type(BUCKET) if r.retain_on_delete))


def import_then_update(bucket: Recorded, created: dict[str, object]) -> tuple[list[str], list[str]]:
    """What `pulumi up` does to a kept bucket it adopts, as the pinned CLI does it: the import reads the existing bucket
    (created with `created`) and takes what it read as the old state without comparing (pulumi/pulumi
    pkg/resource/deploy/step.go `ImportStep.Apply`, from v3.175), and the step generator then diffs the program's
    inputs against it (step_generator.go `continueStepsFromImport`). The provider reads an imported bucket's labels
    into `effectiveLabels` only (terraform-provider-google tpgresource.SetLabels keeps configured keys, an import has
    none; pulumi-gcp #1961), so `labels` differ. Returns the paths that would replace the bucket, which fails the
    `up` ("previously-imported resources that still specify an ID may not be replaced", step_generator.go), and the
    paths the update sets."""
    read = {**created, "labels": {}}
    planned = dict(bucket.plain_inputs())
    for key in set(bucket.ignore_changes) & set(read):
        planned[key] = read[key]
    changed = diff_paths(read, planned)
    rule = rules()[BUCKET]
    return [p for p in changed if covers(rule.replace, p)], [p for p in changed if not covers(rule.replace, p)]


def stack_bucket(run: StackRun) -> Recorded:
    return next(r for r in run.of_type(BUCKET) if r.plain_inputs()["name"] == run.outputs["bucket"][len("gs://") :])


@pytest.mark.parametrize("stack", stack_names())
class TestUpDestroyUp:
    def test_first_up_in_a_fresh_project_creates_the_bucket(self, stack: str) -> None:
        first = up(stack)
        assert [r.import_id for r in first.of_type(BUCKET)] == ["" for _ in first.of_type(BUCKET)]

    def test_second_up_adopts_the_kept_bucket(self, stack: str) -> None:
        first = up(stack)
        kept = kept_after_destroy(first)
        assert kept == (first.outputs["bucket"][len("gs://") :],), "destroy keeps the stack's bucket, only it"

        second = up(stack, existing=kept)  # a create would get Cloud Storage's 409 here

        bucket = stack_bucket(second)
        assert bucket.import_id == kept[0]
        assert bucket.plain_inputs() == stack_bucket(first).plain_inputs()
        replaced, updated = import_then_update(bucket, stack_bucket(first).plain_inputs())
        assert replaced == [], "the adopted bucket would be replaced: the up fails"
        assert any(p.startswith("labels") for p in updated), "the update after the import sets the labels"
        assert second.outputs["bucket"] == first.outputs["bucket"], "the outputs point at the same models"
        grants = [r for r in second.resources if r.type == "gcp:storage/bucketIAMMember:BucketIAMMember"]
        assert {g.plain_inputs()["bucket"] for g in grants} >= set(kept), "its identities get their grants back"

    def test_labels_reach_the_bucket_on_every_up(self, stack: str) -> None:
        """The bucket is in the state, so `import_` is a no-op and a label change is an update of it: no
        `ignore_changes` keeps the labels of the first `up` (nor of the adoption after a destroy)."""
        first = up(stack)
        kept = kept_after_destroy(first)
        for existing in ((), kept):
            before = up(stack, existing=existing)
            after = up(stack, existing=existing, labels=["team=ml-platform", "owner=alice"])
            impact = classify(before, after)[stack_bucket(after).urn]
            assert impact.action == "update" and any(r.startswith("labels") for r in impact.reasons), impact
            assert stack_bucket(after).plain_inputs()["labels"]["owner"] == "alice"

    def test_force_destroy_leaves_nothing_to_adopt(self, stack: str) -> None:
        first = up(stack, bucketForceDestroy=True)
        assert kept_after_destroy(first) == ()
        second = up(stack, bucketForceDestroy=True)
        assert all(r.import_id == "" for r in second.of_type(BUCKET))


@pytest.mark.parametrize("stack", stack_names())
class TestKeptAccounts:
    def test_destroy_keeps_every_account_and_no_grant_to_it(self, stack: str) -> None:
        first = up(stack, servingEnabled=True) if stack == "dev" else up(stack)
        accounts = first.of_type(ACCOUNT)
        assert accounts and all(abandoned(a) for a in accounts), "destroy leaves every account in place"
        grants = [r for r in first.resources if r.custom and "iam" in r.type.lower() and "member" in r.inputs]
        assert grants and not [g for g in grants if g.retain_on_delete], "every grant goes with destroy"

    def test_second_up_adopts_the_kept_accounts(self, stack: str) -> None:
        first = up(stack)
        kept = accounts_kept_after_destroy(first)
        assert kept == tuple(sorted(a.plain_inputs()["accountId"] for a in first.of_type(ACCOUNT))), "all are kept"
        second = up(stack, existing=kept_after_destroy(first), accounts=kept)  # a plain create would get 409
        assert {a.outputs["email"] for a in second.of_type(ACCOUNT)} == {
            a.outputs["email"] for a in first.of_type(ACCOUNT)
        }

    def test_first_up_adopts_the_accounts_the_ci_setup_created(self, stack: str) -> None:
        everything = up(stack, imageBuild="cloud-build", servingEnabled=True) if stack == "dev" else up(stack)
        created_by_setup = tuple(a.plain_inputs()["accountId"] for a in everything.of_type(ACCOUNT))
        run = up(stack, accounts=created_by_setup)
        assert run.of_type(ACCOUNT), stack

    def test_the_display_name_never_forces_an_update(self, stack: str) -> None:
        for account in up(stack).of_type(ACCOUNT):
            assert "displayName" in account.ignore_changes, account.urn


class TestMockCloud:
    """The mock cloud is as strict as Cloud Storage: without adoption the second `up` fails as the real one did."""

    @staticmethod
    def register(existing: tuple[str, ...], import_id: str) -> None:
        args = MockResourceArgs(typ=BUCKET, name="b", inputs={"name": "kept"}, provider="", resource_id=import_id)
        Mocks(existing_buckets=existing).new_resource(args)

    def test_create_over_an_existing_bucket_is_a_409(self) -> None:
        with pytest.raises(Exception, match="409"):
            self.register(("kept",), "")

    def test_import_of_a_missing_bucket_fails(self) -> None:
        with pytest.raises(Exception, match="does not exist"):
            self.register((), "kept")

    def test_import_of_an_existing_bucket_succeeds(self) -> None:
        self.register(("kept",), "kept")

    def test_create_over_an_existing_account_is_a_409_unless_it_adopts(self) -> None:
        inputs = {"accountId": "gft-dev-train", "project": "p"}
        with pytest.raises(Exception, match="409"):
            Mocks(existing_accounts=("gft-dev-train",)).new_resource(
                MockResourceArgs(typ=ACCOUNT, name="a", inputs=inputs, provider="", resource_id="")
            )
        adopt = {**inputs, "createIgnoreAlreadyExists": True}
        Mocks(existing_accounts=("gft-dev-train",)).new_resource(
            MockResourceArgs(typ=ACCOUNT, name="a", inputs=adopt, provider="", resource_id="")
        )


@pytest.mark.parametrize("stack", stack_names())
def test_nothing_pulumi_deletes_lives_in_a_run_folder(stack: str) -> None:
    """A run folder belongs to its run: `destroy`, or the next run id replacing an object under a new name,
    must not delete a file of it (the trainer reads `_PRICE.json` when the run ends)."""
    run = up(stack)
    folder = str(run.outputs.get("runUri") or run.outputs["runDir"]).removeprefix(f"{run.outputs['bucket']}/")
    inside = [
        r
        for r in run.of_type("gcp:storage/bucketObject:BucketObject")
        if str(r.plain_inputs()["name"]).startswith(f"{folder}/")
    ]
    assert inside, "the price file lies in the run folder"
    assert [r.name for r in inside if not r.retain_on_delete] == []


NETWORK = "gcp:compute/network:Network"
SUBNET = "gcp:compute/subnetwork:Subnetwork"
CLUSTER = "gcp:container/cluster:Cluster"


def delete_schedule(run: StackRun) -> list[set[str]]:
    """The rounds in which `pulumi destroy` deletes the stack's resources, first round first.

    A transcription of the engine's scheduler (pulumi/pulumi v3.259.0 pkg/resource/deploy/step_generator.go
    `ScheduleDeletes`): every resource in the state is condemned; repeatedly, those whose dependencies are all
    gone from the condemned set form a round; the list of rounds is then reversed, so a resource is deleted only
    after everything that depends on it. Its dependencies are those of `DependenciesOf`
    (pkg/resource/graph/dependency_graph.go): the registered dependencies, the provider, the parent, and the
    children a component dependency registered before it. A `retain_on_delete` resource takes its round too
    (its step calls no provider)."""
    order = {r.urn: i for i, r in enumerate(run.resources)}
    children: dict[str, list[str]] = {}
    for r in run.resources:
        children.setdefault(r.parent, []).append(r.urn)
    custom = {r.urn: r.custom for r in run.resources}

    def dependencies_of(r: Recorded) -> set[str]:
        direct = set(r.dependencies) | ({r.provider.rsplit("::", 1)[0]} if r.provider else set())
        found = {d for d in direct if d in order and order[d] < order[r.urn]}
        for d in list(found):
            if not custom[d]:
                found |= {c for c in children.get(d, []) if order[c] < order[r.urn]}
        if r.parent in order:
            found.add(r.parent)
        return found

    deps = {r.urn: dependencies_of(r) for r in run.resources}
    condemned = set(order)
    rounds: list[set[str]] = []
    while condemned:
        free = {urn for urn in condemned if not deps[urn] & condemned}
        assert free, f"a dependency cycle among {sorted(condemned)}"
        condemned -= free
        rounds.append(free)
    rounds.reverse()
    return rounds


def destroy_order_problems(run: StackRun) -> list[str]:
    """`destroy` deletes the cluster before its subnet and the subnet before the VPC (a subnet in use by the
    cluster's nodes, or a VPC with a subnet, cannot be deleted: Compute Engine answers `resourceInUseByAnotherResource`)."""
    rounds = delete_schedule(run)
    when = {urn: i for i, round_ in enumerate(rounds) for urn in round_}
    chain = [run.one(CLUSTER), run.one(SUBNET), run.one(NETWORK)]
    return [
        f"{after.urn} is not deleted after {before.urn}"
        for before, after in pairwise(chain)
        if not when[before.urn] < when[after.urn]
    ]


GKE_STACKS = [s for s in stack_names() if s != "dev"]


@pytest.mark.parametrize("stack", GKE_STACKS)
class TestDestroyRemovesTheNetwork:
    def test_cluster_then_subnet_then_network(self, stack: str) -> None:
        assert destroy_order_problems(up(stack)) == []

    def test_nothing_of_the_network_is_kept(self, stack: str) -> None:
        first = up(stack)
        kept = [r.urn for r in (*first.of_type(NETWORK), *first.of_type(SUBNET)) if r.retain_on_delete]
        assert first.of_type(NETWORK) and first.of_type(SUBNET) and kept == []
        second = up(stack, existing=kept_after_destroy(first), accounts=accounts_kept_after_destroy(first))
        assert all(r.import_id == "" for r in (*second.of_type(NETWORK), *second.of_type(SUBNET))), "created anew"

    def test_the_check_can_fail(self, stack: str) -> None:
        """A cluster that depended on what the subnet depends on, and not on the subnet, would be deleted in the
        subnet's round, in parallel: the subnet's delete then fails while the cluster's nodes still use it."""
        run = up(stack)
        subnet = run.one(SUBNET)
        cut = [replace(r, dependencies=list(subnet.dependencies)) if r.type == CLUSTER else r for r in run.resources]
        problems = destroy_order_problems(replace(run, resources=cut))
        assert problems and "Subnetwork" in problems[0], problems


def test_the_schedule_deletes_dependents_first() -> None:
    """The transcription itself: the Kubernetes objects go before the cluster whose provider they use."""
    run = up("a4-gemma4")
    when = {urn: i for i, round_ in enumerate(delete_schedule(run)) for urn in round_}
    cluster = run.one(CLUSTER).urn
    objects = [r.urn for r in run.resources if r.type.startswith("kubernetes:")]
    assert objects and all(when[o] < when[cluster] for o in objects)
