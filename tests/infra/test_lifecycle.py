"""`pulumi up` → `pulumi destroy` → `pulumi up` with the kept bucket.

The mock cloud behaves as Cloud Storage does: a bucket name that exists answers 409 to a create, and an
import of a bucket that does not exist fails. `destroy` is modelled from what the program declared: every
resource goes except those registered with `retain_on_delete`. The second `up` must then adopt the kept
bucket (import by its name, the bucket's ID) with the very inputs the first `up` created it with, so the
engine's import finds nothing to change and the models in it stay where the stack outputs point.
"""

from __future__ import annotations

import pytest
from pulumi.runtime.mocks import MockResourceArgs

from infra.offline import Mocks, Recorded, StackRun, run_stack, stack_names
from tests.infra.conftest import PREBUILT

BUCKET = "gcp:storage/bucket:Bucket"


def up(stack: str, existing: tuple[str, ...] = (), **overrides: object) -> StackRun:
    return run_stack(stack, overrides={**PREBUILT, **overrides}, existing_buckets=existing, assume_trained=True)


def kept_after_destroy(run: StackRun) -> tuple[str, ...]:
    return tuple(sorted(r.plain_inputs()["name"] for r in run.of_type(BUCKET) if r.retain_on_delete))


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
        assert second.outputs["bucket"] == first.outputs["bucket"], "the outputs point at the same models"
        grants = [r for r in second.resources if r.type == "gcp:storage/bucketIAMMember:BucketIAMMember"]
        assert {g.plain_inputs()["bucket"] for g in grants} >= set(kept), "its identities get their grants back"

    def test_force_destroy_leaves_nothing_to_adopt(self, stack: str) -> None:
        first = up(stack, bucketForceDestroy=True)
        assert kept_after_destroy(first) == ()
        second = up(stack, bucketForceDestroy=True)
        assert all(r.import_id == "" for r in second.of_type(BUCKET))


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
