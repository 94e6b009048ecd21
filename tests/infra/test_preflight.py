"""`capacity: reservation` is checked against the project before anything is declared (`pulumi preview` too).

The mocks answer `gcp.compute.get_zones` / `gcp.compute.get_reservation` as the provider does (field names
from pulumi-gcp 10.2; "not found" as the Terraform data source returns it: an empty result), with the stack's
reservation healthy by default; each test changes one fact about it.
"""

from __future__ import annotations

from typing import Any

import pytest

from infra import preflight
from infra.offline.engine import ProviderError, StackRun, mock_quota_info, mock_reservation, run_stack, stack_names
from infra.preflight import PreflightError
from tests.infra.conftest import PREBUILT

A4 = "a4-gemma4"
NAME = "my-a4-reservation"
PROJECT = "my-gcp-project"
GET_RESERVATION = "gcp:compute/getReservation:getReservation"
LIST_COMMAND = f"gcloud compute reservations list --project {PROJECT} --filter='name={NAME}'"

# the recipe sized for the 4 GPUs of one H100 x4 node (the stack refuses another world size)
# W1 on 4 x H100: sized for 4 ranks, its strategy picked for the H100, and checkpointing so that it fits one
# (the stack's memory check, infra/config.py `memory_fixes`)
SIZED_FOR_4 = {
    "recipeOverrides": ["distributed.world_size=4", "distributed.gpu=h100", "training.gradient_checkpointing=true"]
}


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

    def test_one_machine_short_names_both_numbers_and_the_command(self) -> None:
        msg = fails("ray-gemma3-vision", reservations=at("us-central1-a", count=1))
        assert "it holds 1 machines (0 in use), and nodes=2 needs 2" in msg
        assert LIST_COMMAND in msg
        run_stack("ray-gemma3-vision", overrides=PREBUILT, reservations=at("us-central1-a", count=2))

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


# --- GPU quota (Cloud Quotas API), the preflight setting, the cost ceiling -------------------------------------

GET_QUOTA = "gcp:cloudquota/getSQuotaInfo:getSQuotaInfo"
COMPUTE = "compute.googleapis.com"
RUN = "run.googleapis.com"
SPOT_B200 = "PREEMPTIBLE-NVIDIA-B200-GPUS-per-project-region"
FAMILY = "GPUS-PER-GPU-FAMILY-per-project-region"
ALL_REGIONS = "GPUS-ALL-REGIONS-per-project"
L4_JOB = "NvidiaL4GpuAllocNoZonalRedundancyPerProjectRegion"
L4_ZONAL = "NvidiaL4GpuAllocPerProjectRegion"
NO_RESERVATION = ("reservationName",)
DENIED = ProviderError(
    "googleapi: Error 403: Permission 'cloudquotas.quotas.get' denied on resource (or it may not exist)"
)


def quota(service: str, quota_id: str, value: int, **kwargs: Any) -> dict[str, Any]:
    return {quota_id: mock_quota_info(service, quota_id, value, **kwargs)}


def family_row(family: str, value: int) -> dict[str, Any]:
    """One row of the GPU family quota (the `gpu_family` dimension), in every region."""
    return {"dimensions": {"gpu_family": family}, "details": [{"value": str(value)}], "applicableLocations": []}


def asked(stack_run_or_exc: Any) -> dict[str, str]:
    """quota id -> service of every Cloud Quotas invoke the program made."""
    return {a["quotaId"]: a["service"] for t, a in stack_run_or_exc.invokes if t == GET_QUOTA}


def a4(capacity: str, **overrides: Any) -> dict[str, Any]:
    return {**PREBUILT, "capacity": capacity, **overrides}


def fails_with(stack: str, overrides: dict[str, Any], remove: tuple[str, ...] = (), **kwargs: Any) -> str:
    with pytest.raises(PreflightError) as caught:
        run_stack(stack, overrides=overrides, remove=remove, **kwargs)
    assert getattr(caught.value, "declared_resources", None) == [], "preflight runs before any resource"
    return str(caught.value)


class TestGpuQuotaIsAsked:
    """Each capacity type draws on its own quota; the happy path of every stack passes."""

    def test_reservation_needs_no_quota(self) -> None:
        assert asked(run_stack(A4, overrides=PREBUILT)) == {}

    @pytest.mark.parametrize("capacity", ["spot", "flex-start"])
    def test_spot_and_flex_start_draw_on_preemptible_quota(self, capacity: str) -> None:
        assert asked(run_stack(A4, overrides=a4(capacity), remove=NO_RESERVATION)) == {SPOT_B200: COMPUTE}

    def test_on_demand_draws_on_the_b200_family_and_the_all_regions_cap(self) -> None:
        stack_run = run_stack(A4, overrides=a4("on-demand"), remove=NO_RESERVATION)
        assert asked(stack_run) == {FAMILY: COMPUTE, ALL_REGIONS: COMPUTE}
        parents = {a["parent"] for t, a in stack_run.invokes if t == GET_QUOTA}
        assert parents == {f"projects/{PROJECT}"}

    def test_dev_asks_the_job_quota_and_the_service_quota(self) -> None:
        assert asked(run_stack("dev", overrides=PREBUILT)) == {L4_JOB: RUN}
        serving = {"servingEnabled": True, "gpuZonalRedundancy": True}
        assert asked(run_stack("dev", overrides={**PREBUILT, **serving}, assume_trained=True)) == {
            L4_JOB: RUN,
            L4_ZONAL: RUN,
        }


class TestGpuQuotaStops:
    """Quota below the run's need stops before anything is declared: key, number found, number needed, fix."""

    @pytest.mark.parametrize("capacity", ["spot", "flex-start"])
    def test_preemptible_quota_zero(self, capacity: str) -> None:
        msg = fails_with(A4, a4(capacity), NO_RESERVATION, quotas=quota(COMPUTE, SPOT_B200, 0))
        assert f"GPU quota {SPOT_B200} (compute.googleapis.com, region us-central1) is 0" in msg
        assert f"capacity={capacity} with nodes=1 x gpusPerNode=8 (nvidia-b200) needs 8" in msg
        assert f"--quota-id={SPOT_B200} --preferred-value=8 --dimensions=region=us-central1" in msg
        assert f"console.cloud.google.com/iam-admin/quotas?project={PROJECT}" in msg

    def test_one_gpu_short_names_both_numbers_and_the_request(self) -> None:
        msg = fails_with(
            A4,
            a4("spot", nodes=2, recipeOverrides=["distributed.world_size=16"]),
            NO_RESERVATION,
            quotas=quota(COMPUTE, SPOT_B200, 15),
        )
        assert "is 15, and capacity=spot with nodes=2 x gpusPerNode=8 (nvidia-b200) needs 16" in msg
        assert (
            f"gcloud beta quotas preferences create --service=compute.googleapis.com --quota-id={SPOT_B200} "
            f"--preferred-value=16 --dimensions=region=us-central1 --project={PROJECT}"
        ) in msg
        run_stack(
            A4,
            overrides=a4("spot", nodes=2, recipeOverrides=["distributed.world_size=16"]),
            remove=NO_RESERVATION,
            quotas=quota(COMPUTE, SPOT_B200, 16),
        )

    def test_two_nodes_need_sixteen(self) -> None:
        msg = fails_with(
            A4,
            a4("spot", nodes=2, recipeOverrides=["distributed.world_size=16"]),
            NO_RESERVATION,
            quotas=quota(COMPUTE, SPOT_B200, 8),
        )
        assert "is 8, and capacity=spot with nodes=2 x gpusPerNode=8 (nvidia-b200) needs 16" in msg

    def test_on_demand_reads_the_b200_row_of_the_family_quota(self) -> None:
        """The family quota has a row per GPU family: another family's grant does not count for B200."""
        rows = quota(
            COMPUTE,
            FAMILY,
            64,
            more=(
                family_row("NVIDIA_H100", 64),
                family_row("NVIDIA_B200", 0),
            ),
        )
        msg = fails_with(A4, a4("on-demand"), NO_RESERVATION, quotas=rows)
        assert f"GPU quota {FAMILY} (compute.googleapis.com, region us-central1) is 0" in msg
        assert "--dimensions=region=us-central1,gpu_family=NVIDIA_B200" in msg

    def test_a_family_no_row_names_is_not_read_from_the_default_row(self) -> None:
        """Only the default row and H100's: the default's 64 says nothing about B200 (the family value may be
        wrong), so the check reports that it could not check, with the listing command, instead of passing."""
        rows = quota(
            COMPUTE,
            FAMILY,
            64,
            more=(family_row("NVIDIA_H100", 64),),
        )
        msg = fails_with(A4, a4("on-demand"), NO_RESERVATION, quotas=rows)
        assert f"could not check GPU quota {FAMILY}" in msg and "names gpu_family=NVIDIA_B200" in msg
        assert f"gcloud beta quotas info list --service=compute.googleapis.com --project={PROJECT}" in msg
        assert "pulumi config set preflight warn" in msg and " is 0" not in msg

    def test_the_most_specific_row_wins(self) -> None:
        b200 = {
            "dimensions": {"gpu_family": "NVIDIA_B200", "region": "us-central1"},
            "details": [{"value": "8"}],
            "applicableLocations": ["us-central1"],
        }
        run_stack(A4, overrides=a4("on-demand"), remove=NO_RESERVATION, quotas=quota(COMPUTE, FAMILY, 0, more=(b200,)))

    @pytest.mark.parametrize(
        "empty", [{}, {"parent": f"projects/{PROJECT}", "service": COMPUTE, "quotaId": SPOT_B200}], ids=["bare", "echo"]
    )
    def test_a_quota_the_api_does_not_know_is_not_checked_not_zero(self, empty: dict[str, Any]) -> None:
        """The data source answers an unknown quota id with an empty result, not an error (HandleNotFoundError)."""
        msg = fails_with(A4, a4("spot"), NO_RESERVATION, quotas={SPOT_B200: empty})
        assert f"could not check GPU quota {SPOT_B200} (compute.googleapis.com) in project {PROJECT}" in msg
        assert f"gcloud beta quotas info list --service=compute.googleapis.com --project={PROJECT}" in msg
        assert "pulumi config set preflight warn" in msg
        assert " is 0" not in msg and "preferences create" not in msg

    def test_an_unknown_quota_only_warns_with_warn(self) -> None:
        overrides = a4("spot", preflight="warn")
        stack_run = run_stack(A4, overrides=overrides, remove=NO_RESERVATION, quotas={SPOT_B200: {}})
        assert stack_run.of_type("kubernetes:batch/v1:Job")
        assert any(f"could not check GPU quota {SPOT_B200}" in w for w in stack_run.warnings), stack_run.warnings

    def test_a_row_for_another_region_does_not_count(self) -> None:
        rows = quota(COMPUTE, SPOT_B200, 64, dimensions={"region": "europe-west4"}, locations=("europe-west4",))
        assert "is 0, and capacity=spot" in fails_with(A4, a4("spot"), NO_RESERVATION, quotas=rows)

    def test_unlimited_passes(self) -> None:
        run_stack(A4, overrides=a4("spot"), remove=NO_RESERVATION, quotas=quota(COMPUTE, SPOT_B200, -1))

    def test_the_all_regions_cap(self) -> None:
        msg = fails_with(A4, a4("on-demand"), NO_RESERVATION, quotas=quota(COMPUTE, ALL_REGIONS, 4))
        assert f"GPU quota {ALL_REGIONS} (compute.googleapis.com, all regions) is 4" in msg
        assert f"--quota-id={ALL_REGIONS} --preferred-value=8 --project={PROJECT}" in msg

    def test_cloud_run_job_quota_zero(self) -> None:
        msg = fails_with("dev", dict(PREBUILT), quotas=quota(RUN, L4_JOB, 0))
        assert f"GPU quota {L4_JOB} (run.googleapis.com, region us-central1) is 0" in msg
        assert "the training Job (gpuType=nvidia-l4, 1 task) needs 1" in msg

    def test_cloud_run_service_on_the_zonal_quota_needs_max_instances_plus_one(self) -> None:
        serving = {**PREBUILT, "servingEnabled": True, "gpuZonalRedundancy": True, "servingMaxInstances": 3}
        msg = fails_with("dev", serving, quotas=quota(RUN, L4_ZONAL, 2), assume_trained=True)
        assert f"GPU quota {L4_ZONAL} (run.googleapis.com, region us-central1) is 2" in msg
        assert "servingMaxInstances=3 + 1 while a new revision starts) needs 4" in msg

    def test_job_and_service_on_one_quota_add_up(self) -> None:
        serving = {**PREBUILT, "servingEnabled": True, "servingMaxInstances": 2}
        msg = fails_with("dev", serving, quotas=quota(RUN, L4_JOB, 3), assume_trained=True)
        assert "the training Job (gpuType=nvidia-l4, 1 task) + the vLLM service" in msg and "needs 4" in msg


class TestPreflightSetting:
    """strict stops (naming the missing permission and the switch), warn reports and goes on, off asks nothing."""

    def test_strict_names_the_permission_and_how_to_switch_to_warn(self) -> None:
        msg = fails_with("dev", dict(PREBUILT), quotas={L4_JOB: DENIED})
        assert "could not read GPU quota NvidiaL4GpuAllocNoZonalRedundancyPerProjectRegion" in msg
        assert "cloudquotas.quotas.get" in msg and "roles/cloudquotas.viewer" in msg
        assert "pulumi config set preflight warn" in msg

    def test_a_disabled_api_names_the_command_that_enables_it(self) -> None:
        disabled = ProviderError(
            "googleapi: Error 403: Cloud Quotas API has not been used in project 1, SERVICE_DISABLED"
        )
        msg = fails_with(A4, a4("spot"), NO_RESERVATION, quotas={SPOT_B200: disabled})
        assert f"gcloud services enable cloudquotas.googleapis.com --project {PROJECT}" in msg

    def test_user_credentials_without_a_quota_project_get_the_variable_that_fixes_it(self) -> None:
        """User ADC: the API wants a quota project and says SERVICE_DISABLED; enabling the API would not help."""
        no_quota_project = ProviderError(
            "googleapi: Error 403: Your application is authenticating by using local Application Default "
            "Credentials. The cloudquotas.googleapis.com API requires a quota project, which is not set by default. "
            "Details: [{'reason': 'SERVICE_DISABLED'}]"
        )
        msg = fails_with("dev", dict(PREBUILT), quotas={L4_JOB: no_quota_project})
        assert f"export GOOGLE_CLOUD_QUOTA_PROJECT={PROJECT}" in msg
        assert "gcloud services enable" not in msg and "pulumi config set preflight warn" in msg

    def test_warn_declares_the_stack_and_reports_the_problem(self) -> None:
        stack_run = run_stack("dev", overrides={**PREBUILT, "preflight": "warn"}, quotas={L4_JOB: DENIED})
        assert stack_run.of_type("gcp:cloudrunv2/job:Job")
        assert any("cloudquotas.quotas.get" in w for w in stack_run.warnings), stack_run.warnings

    def test_warn_covers_the_reservation_check_too(self) -> None:
        missing = {f"{PROJECT}/us-central1-a/{NAME}": None}
        stack_run = run_stack(A4, overrides={**PREBUILT, "preflight": "warn"}, reservations=missing)
        assert stack_run.of_type("kubernetes:batch/v1:Job")
        assert any("does not exist in region us-central1" in w for w in stack_run.warnings), stack_run.warnings

    def test_strict_reservation_denial_says_how_to_switch_to_warn(self) -> None:
        denied = {
            f"{PROJECT}/us-central1-a/{NAME}": ProviderError(
                "googleapi: Error 403: Required 'compute.reservations.get'"
            )
        }
        assert "pulumi config set preflight warn" in fails(reservations=denied)

    def test_off_asks_nothing(self) -> None:
        missing = {f"{PROJECT}/us-central1-a/{NAME}": None}
        stack_run = run_stack(A4, overrides={**PREBUILT, "preflight": "off"}, reservations=missing)
        assert not [t for t, _ in stack_run.invokes if t in (GET_QUOTA, GET_RESERVATION)]
        assert stack_run.of_type("kubernetes:batch/v1:Job") and not stack_run.warnings

    def test_an_unknown_mode_is_a_config_error(self) -> None:
        from infra.config import ConfigError

        with pytest.raises(ConfigError, match="preflight='loose'"):
            run_stack("dev", overrides={**PREBUILT, "preflight": "loose"})


class TestCostCeiling:
    """maxRunCostUsd stops preview/up when one run can cost more, naming both numbers and what moves them."""

    def test_over_the_limit(self) -> None:
        msg = fails_with(A4, {**PREBUILT, "maxRunCostUsd": 1})
        assert "runCostCeilingUsd=1,211.20 exceeds maxRunCostUsd=1" in msg
        assert (
            "($148.21/h x 1 node(s) + $0.10/h cluster fee) x 8.17 h (deadline 480 min + 10 min release) x 1 attempt(s)"
        ) in msg
        assert "trainingTimeoutMinutes, nodes, capacity (now reservation)" in msg
        assert "pulumi config set maxRunCostUsd 1212" in msg

    def test_dev_over_the_limit_names_its_retries(self) -> None:
        msg = fails_with("dev", {**PREBUILT, "maxRunCostUsd": 1})
        assert "runCostCeilingUsd=4.29 exceeds maxRunCostUsd=1" in msg and "x 3 attempt(s)" in msg
        assert "trainingTimeoutMinutes, trainingRetries, gpuType" in msg

    def test_at_the_limit_passes_and_off_does_not_lift_it(self) -> None:
        run_stack(A4, overrides={**PREBUILT, "maxRunCostUsd": 1212})
        assert "exceeds maxRunCostUsd=1211" in fails_with(A4, {**PREBUILT, "maxRunCostUsd": 1211, "preflight": "off"})

    def test_a_standing_ray_cluster_has_no_ceiling(self) -> None:
        msg = fails_with("ray-gemma3-vision", {**PREBUILT, "rayCluster": "standing", "maxRunCostUsd": 100000})
        assert "cannot hold with rayCluster=standing" in msg and "296.52 USD/h" in msg  # 2 nodes + the cluster fee

    def test_hardware_without_a_price_asks_for_one(self) -> None:
        h100x4 = {**PREBUILT, "gpuType": "nvidia-h100-80gb", "gpusPerNode": 4, "maxRunCostUsd": 100, **SIZED_FOR_4}
        msg = fails_with(A4, {**h100x4, "capacity": "spot"}, NO_RESERVATION)
        assert "maxRunCostUsd=100 cannot be checked" in msg and "trainingHourPriceUsd" in msg
        run_stack(A4, overrides={**h100x4, "capacity": "spot", "trainingHourPriceUsd": "10.5"}, remove=NO_RESERVATION)
