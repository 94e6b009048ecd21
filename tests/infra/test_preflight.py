"""`capacity: reservation` is checked against the project before anything is declared (`pulumi preview` too).

The mocks answer `gcp.compute.get_zones` / `gcp.compute.get_reservation` as the provider does (field names
from pulumi-gcp 10.2; "not found" as the Terraform data source returns it: an empty result), with the stack's
reservation healthy by default; each test changes one fact about it.
"""

from __future__ import annotations

from typing import Any

import pytest

from infra import preflight
from infra.offline import ProviderError, StackRun, mock_reservation, run_stack, stack_names
from infra.preflight import PreflightError
from tests.infra.conftest import PREBUILT

A4 = "a4-gemma4"
NAME = "my-a4-reservation"
PROJECT = "my-gcp-project"
GET_RESERVATION = "gcp:compute/getReservation:getReservation"
LIST_COMMAND = f"gcloud compute reservations list --project {PROJECT} --filter='name={NAME}'"


def fails(stack: str = A4, reservations: dict[str, Any] | None = None, **overrides: Any) -> str:
    with pytest.raises(PreflightError) as caught:
        run_stack(stack, overrides={**PREBUILT, **overrides}, reservations=reservations)
    assert getattr(caught.value, "declared_resources", None) == [], "preflight runs before any resource"
    return str(caught.value)


def at(zone: str, **kwargs: Any) -> dict[str, Any]:
    """The stack's reservation, in `zone`, with one fact changed."""
    project = kwargs.pop("project", PROJECT)
    return {f"{project}/{zone}/{NAME}": mock_reservation(project, zone, NAME, **kwargs)}


class TestHappyPath:
    @pytest.mark.parametrize("stack", stack_names())
    def test_every_stack_as_committed_passes(self, stack: str) -> None:
        stack_run: StackRun = run_stack(stack, overrides=PREBUILT)
        asked = [args for token, args in stack_run.invokes if token == GET_RESERVATION]
        uses_reservation = stack != "dev"
        assert bool(asked) is uses_reservation, f"{stack}: {asked}"
        if uses_reservation:
            assert {a["name"] for a in asked} == {NAME} and {a["project"] for a in asked} == {PROJECT}

    def test_the_reservation_may_sit_in_any_zone_of_the_region(self) -> None:
        run_stack(A4, overrides=PREBUILT, reservations=at("us-central1-f"))

    @pytest.mark.parametrize("capacity", ["spot", "flex-start", "on-demand"])
    def test_other_capacity_asks_nothing(self, capacity: str) -> None:
        stack_run = run_stack(A4, overrides={**PREBUILT, "capacity": capacity}, remove=("reservationName",))
        assert not [t for t, _ in stack_run.invokes if t == GET_RESERVATION]

    def test_a_shared_reservation_is_looked_up_in_its_owners_project(self) -> None:
        shared = at("us-central1-b", project="owner-project", shared_with=(PROJECT,))
        stack_run = run_stack(A4, overrides={**PREBUILT, "reservationProject": "owner-project"}, reservations=shared)
        assert {a["project"] for t, a in stack_run.invokes if t == GET_RESERVATION} == {"owner-project"}


class TestStopsBeforeAnything:
    """Each message names the key, what was found, what is needed and the command that lists reservations."""

    def test_missing(self) -> None:
        msg = fails(reservations={f"{PROJECT}/us-central1-a/{NAME}": None})
        assert f"reservationName='{NAME}' (project {PROJECT}) does not exist in region us-central1" in msg
        assert "us-central1-a, us-central1-b, us-central1-c, us-central1-f" in msg and LIST_COMMAND in msg

    def test_missing_reported_as_an_invoke_error(self) -> None:
        not_found = {
            f"{PROJECT}/us-central1-{z}/{NAME}": ProviderError("googleapi: Error 404: notFound") for z in "abcf"
        }
        assert "does not exist in region us-central1" in fails(reservations=not_found)

    def test_in_another_region(self) -> None:
        msg = fails(reservations=at("europe-west4-a"))
        assert "does not exist in region us-central1" in msg
        assert "can only use a reservation in one of its zones" in msg and LIST_COMMAND in msg

    def test_wrong_machine_type(self) -> None:
        msg = fails(reservations=at("us-central1-a", machine_type="a3-highgpu-8g"))
        assert "it reserves a3-highgpu-8g, but gpuType=nvidia-b200 with gpusPerNode=8 runs on a4-highgpu-8g" in msg
        assert "in us-central1-a cannot hold this run" in msg and LIST_COMMAND in msg

    def test_too_small_for_the_ray_workers(self) -> None:
        msg = fails("ray-gemma3-vision", reservations=at("us-central1-a", count=1))
        assert "it holds 1 machines (0 in use), and nodes=2 needs 2" in msg

    def test_not_specific(self) -> None:
        msg = fails(reservations=at("us-central1-a", specific=False))
        assert (
            "it is not SPECIFIC (specificReservationRequired=false)" in msg and "--require-specific-reservation" in msg
        )

    def test_owned_elsewhere_and_not_shared(self) -> None:
        msg = fails(reservations=at("us-central1-a", project="owner-project"), reservationProject="owner-project")
        assert f"project owner-project owns it but does not share it with gcp:project={PROJECT}" in msg
        assert f"--add-share-with {PROJECT}" in msg

    def test_no_permission_names_the_role(self) -> None:
        denied = {
            f"{PROJECT}/us-central1-a/{NAME}": ProviderError(
                "googleapi: Error 403: Required 'compute.reservations.get'"
            )
        }
        msg = fails(reservations=denied)
        assert "Error 403" in msg and "roles/compute.viewer" in msg and "compute.reservations.get" in msg

    def test_every_problem_at_once(self) -> None:
        msg = fails(
            "ray-gemma3-vision", reservations=at("us-central1-a", machine_type="a3-highgpu-8g", specific=False, count=1)
        )
        assert "not SPECIFIC" in msg and "reserves a3-highgpu-8g" in msg and "it holds 1 machines" in msg


class TestBusyReservation:
    """Machines in use at preview time may be the stack's own running training: `pulumi up` must still work."""

    @staticmethod
    def up(monkeypatch: pytest.MonkeyPatch, stack: str, **reservation: Any) -> tuple[StackRun, list[str]]:
        warnings: list[str] = []
        monkeypatch.setattr(preflight.pulumi.log, "warn", lambda message, *_, **__: warnings.append(str(message)))
        return run_stack(stack, overrides=PREBUILT, reservations=at("us-central1-a", **reservation)), warnings

    def test_a_second_up_while_the_run_holds_the_reservation(self, monkeypatch: pytest.MonkeyPatch) -> None:
        quiet, none = self.up(monkeypatch, A4, count=1, in_use=0)
        training, warnings = self.up(monkeypatch, A4, count=1, in_use=1)  # the stack's own Job holds the machine
        assert none == []
        assert training.outputs["jobName"] == quiet.outputs["jobName"], "the same run, left alone"
        assert len(warnings) == 1 and "1 of its 1 machines are in use now" in warnings[0]
        assert "gcloud compute instances list --project my-gcp-project" in warnings[0]

    def test_the_ray_stack_while_its_workers_hold_the_reservation(self, monkeypatch: pytest.MonkeyPatch) -> None:
        run, warnings = self.up(monkeypatch, "ray-gemma3-vision", count=2, in_use=2)
        assert run.outputs["rayJobName"] and len(warnings) == 1 and "nodes=2 needs 2 free" in warnings[0]
