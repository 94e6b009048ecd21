"""What a run can cost: the price table keeps its dates and sources, every stack exports its ceiling, the
ceiling moves with exactly the settings that move the workload's real deadline and retries, and a new price
never touches a running workload's spec."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from infra import pricing
from infra.cost import NODE_RELEASE_S
from infra.offline import plan
from infra.offline.engine import REPO_ROOT, StackRun, run_stack, stack_names
from infra.pricing import PRICES_AS_OF, Status
from tests.infra.conftest import PREBUILT
from trainer.cost_line import PRICE_FILE, cost_line, read_price

WORKLOADS = ("gcp:cloudrunv2/job:Job", "kubernetes:batch/v1:Job", "kubernetes:ray.io/v1:RayJob")

DATE = re.compile(r"^\d{4}(-\d{2}){0,2}$")
NO_RESERVATION = ("reservationName",)

# the recipe sized for the 4 GPUs of one H100 x4 node (the stack refuses another world size)
# W1 on 4 x H100: sized for 4 ranks, its strategy picked for the H100, and checkpointing so that it fits one
# (the stack's memory check, infra/config.py `memory_fixes`)
SIZED_FOR_4 = {
    "recipeOverrides": ["distributed.world_size=4", "distributed.gpu=h100", "training.gradient_checkpointing=true"]
}


def ceiling(stack: str, remove: tuple[str, ...] = (), **overrides: Any) -> float:
    value = run_stack(stack, overrides={**PREBUILT, **overrides}, remove=remove).outputs["runCostCeilingUsd"]
    assert isinstance(value, float), value
    return value


class TestPriceTable:
    """Every figure says where it comes from and when; docs/costs.md shows the table and its date."""

    def test_every_figure_has_a_source_a_date_and_a_status(self) -> None:
        assert DATE.match(PRICES_AS_OF)
        rows = pricing.all_prices()
        assert len(rows) >= 8
        for what, price in rows:
            assert price.usd > 0, what
            assert len(price.source) > 20, f"{what}: no source"
            assert DATE.match(price.stated), f"{what}: stated {price.stated!r}"
            assert price.status in (Status.PUBLISHED, Status.SECONDARY, Status.BOUND, Status.UNCONFIRMED), what
            if price.status is Status.UNCONFIRMED:
                assert "override" in price.note or "trainingHourPriceUsd" in price.note, what

    def test_the_stacks_hardware_is_in_the_table(self) -> None:
        assert ("nvidia-b200", 8) in pricing.GKE_NODE_HOUR
        assert ("nvidia-l4", False) in pricing.CLOUD_RUN_GPU_SECOND and (
            "nvidia-l4",
            True,
        ) in pricing.CLOUD_RUN_GPU_SECOND

    def test_docs_show_the_table_and_its_date(self) -> None:
        section = _costs_doc().split("\n## The price table\n", 1)[1].split("\n## ", 1)[0]
        assert PRICES_AS_OF in section
        assert pricing.markdown() in section, (
            "docs/costs.md's table is `python -m infra.pricing`: paste its output in place of the old table"
        )

    def test_docs_give_each_stacks_ceiling_as_committed(self) -> None:
        """The worked figures under "The ceiling of one run" are what the committed stack files plan to."""
        section = _costs_doc().split("\n## The ceiling of one run\n", 1)[1].split("\n## ", 1)[0]
        flat = " ".join(section.split())
        assert f"(table of {PRICES_AS_OF})" in flat
        for stack in stack_names():
            figure = f"`{stack}` {ceiling(stack):,.2f} USD"
            assert figure in flat, f"docs/costs.md should say {figure}"


def _costs_doc() -> str:
    return (REPO_ROOT / "docs" / "costs.md").read_text()


class TestCeilingPerStack:
    """runCostCeilingUsd is a number on every stack, and `make plan` prints it."""

    @pytest.mark.parametrize("stack", stack_names())
    def test_every_stack_exports_a_ceiling(
        self, stack: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        args = ["--stack", stack, "--out", str(tmp_path)] + [
            a for k, v in PREBUILT.items() for a in ("--set", f"{k}={v}")
        ]
        assert plan.main(args) == 0
        printed = capsys.readouterr().out
        match = re.search(r"one training run at most: ([\d,]+\.\d\d) USD = ", printed)
        assert match, printed[-800:]
        assert float(match.group(1).replace(",", "")) == ceiling(stack)

    def test_plan_fails_with_a_clear_message_over_max_run_cost(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert plan.main(["--stack", "dev", "--set", "maxRunCostUsd=1"]) == 2
        err = capsys.readouterr().err
        assert "runCostCeilingUsd=4.29 exceeds maxRunCostUsd=1" in err and "nothing was created" in err

    def test_serving_cost_per_hour(self) -> None:
        on = {**PREBUILT, "servingEnabled": True, "servingMaxInstances": 3}
        outputs = run_stack("dev", overrides=on, assume_trained=True).outputs
        assert outputs["servingCostPerHourUsd"] == pytest.approx(3 * 1.43)
        zonal = run_stack("dev", overrides={**on, "gpuZonalRedundancy": True}, assume_trained=True).outputs
        assert zonal["servingCostPerHourUsd"] > outputs["servingCostPerHourUsd"], "zonal redundancy costs more"
        assert "servingCostPerHourUsd" not in run_stack("dev", overrides=PREBUILT).outputs


class TestCeilingFollowsTheWorkload:
    """The bound is true only if it follows each workload's deadline and retry semantics."""

    def test_a_kubernetes_job_deadline_covers_its_retries(self) -> None:
        assert ceiling(A4 := "a4-gemma4", trainingRetries=0) == ceiling(A4, trainingRetries=5)
        hours = (480 * 60 + NODE_RELEASE_S) / 3600
        assert ceiling(A4) == pytest.approx((148.21 + 0.10) * hours, abs=0.01)  # one node + the cluster fee
        assert ceiling(A4, nodes=2, recipeOverrides=["distributed.world_size=16"]) == pytest.approx(
            (2 * 148.21 + 0.10) * hours, abs=0.02
        ), "the fee is per cluster, not per node"
        assert ceiling(A4, trainingTimeoutMinutes=120) < ceiling(A4)

    def test_each_ray_retry_gets_a_fresh_deadline(self) -> None:
        ray = "ray-gemma3-vision"
        assert ceiling(ray, trainingRetries=3) == pytest.approx(2 * ceiling(ray, trainingRetries=1), abs=0.02)

    def test_each_cloud_run_attempt_gets_the_task_timeout(self) -> None:
        assert ceiling("dev", trainingRetries=0) * 3 == pytest.approx(ceiling("dev", trainingRetries=2), abs=0.02)

    def test_capacity_moves_the_price(self) -> None:
        """A4 has no Spot figure: Spot is priced at on-demand, its only safe bound; H200 has one and is cheaper."""
        spot = ceiling("a4-gemma4", NO_RESERVATION, capacity="spot")
        on_demand = ceiling("a4-gemma4", NO_RESERVATION, capacity="on-demand")
        flex = ceiling("a4-gemma4", NO_RESERVATION, capacity="flex-start")
        assert spot == flex == on_demand == ceiling("a4-gemma4")
        h200 = {"gpuType": "nvidia-h200-141gb", "recipeOverrides": ["distributed.gpu=h200"]}
        assert ceiling("a4-gemma4", NO_RESERVATION, capacity="spot", **h200) < ceiling(
            "a4-gemma4", NO_RESERVATION, capacity="on-demand", **h200
        )

    def test_a_missing_spot_figure_is_never_priced_below_a_real_one(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Hide the table's own H200 Spot figure: the price used instead must still bound the real Spot price."""
        key = ("nvidia-h200-141gb", 8)
        real_spot = pricing.GKE_NODE_HOUR[key]["spot"].usd
        monkeypatch.setitem(pricing.GKE_NODE_HOUR, key, {"on-demand": pricing.GKE_NODE_HOUR[key]["on-demand"]})
        cfg = run_stack(
            "a4-gemma4",
            overrides={
                **PREBUILT,
                "capacity": "spot",
                "gpuType": "nvidia-h200-141gb",
                "recipeOverrides": ["distributed.gpu=h200"],
            },
            remove=NO_RESERVATION,
        ).cfg
        hourly = pricing.gke_node_hour(cfg)
        assert hourly is not None and hourly.usd >= real_spot

    def test_an_override_replaces_the_table(self) -> None:
        outputs = run_stack("a4-gemma4", overrides={**PREBUILT, "trainingHourPriceUsd": "100"}).outputs
        hours = (480 * 60 + NODE_RELEASE_S) / 3600
        assert outputs["runCostCeilingUsd"] == pytest.approx((100 + 0.10) * hours, abs=0.01)
        assert "stack override" in str(outputs["runCostCeiling"])

    def test_a_standing_ray_cluster_has_no_ceiling(self) -> None:
        outputs = run_stack("ray-gemma3-vision", overrides={**PREBUILT, "rayCluster": "standing"}).outputs
        assert outputs["runCostCeilingUsd"] is None and "unbounded" in str(outputs["runCostCeiling"])


class TestPriceLabelsNeverTouchARunningWorkload:
    """A new price or limit changes labels on the workload object only: the pod templates (immutable on a Job,
    the RayJob's replace trigger) stay the same, so no running training is replaced."""

    @pytest.mark.parametrize(
        ("stack", "typ"),
        [("a4-gemma4", "kubernetes:batch/v1:Job"), ("ray-gemma3-vision", "kubernetes:ray.io/v1:RayJob")],
    )
    def test_gke_spec_is_unchanged(self, stack: str, typ: str) -> None:
        before = run_stack(stack, overrides=PREBUILT).one(typ).plain_inputs()
        after = run_stack(stack, overrides={**PREBUILT, "trainingHourPriceUsd": "99", "maxRunCostUsd": 100000})
        changed = after.one(typ).plain_inputs()
        assert changed["spec"] == before["spec"]
        assert changed["metadata"]["labels"]["gemma-finetune/node-hour-cents"] == "9900"
        assert changed["metadata"]["labels"]["gemma-finetune/max-run-cost-usd"] == "100000"

    def test_cloud_run_template_is_unchanged(self) -> None:
        typ = "gcp:cloudrunv2/job:Job"
        before = run_stack("dev", overrides=PREBUILT).one(typ).plain_inputs()
        changed = run_stack("dev", overrides={**PREBUILT, "trainingHourPriceUsd": "2.5"}).one(typ).plain_inputs()
        assert changed["template"] == before["template"]
        assert changed["labels"]["node-hour-cents"] == "250" and before["labels"]["node-hour-cents"] == "143"


class TestEveryRunGetsItsPrice:
    """The trainer finds the stack's price in the folder its workload writes to, and turns it into a cost line."""

    @staticmethod
    def output_dir(stack_run: StackRun) -> str:
        """The `output.dir` the workload passes the trainer (Cloud Run: the bucket mount)."""
        text = json.dumps([r.plain_inputs() for r in stack_run.resources if r.type in WORKLOADS])
        found = set(re.findall(r"output\.dir=([^\"' ]+)", text))
        assert len(found) == 1, found
        return found.pop()

    @pytest.mark.parametrize("stack", stack_names())
    def test_the_price_file_sits_in_the_run_folder(self, stack: str, tmp_path: Path) -> None:
        stack_run = run_stack(stack, overrides=PREBUILT)
        price = stack_run.by_name(f"gft-{stack}-price")
        inputs = price.plain_inputs()
        out = self.output_dir(stack_run)
        relative = out.removeprefix("/mnt/bucket/") if out.startswith("/mnt/") else out.split("/", 3)[3]
        assert inputs["name"] == f"{relative}/{PRICE_FILE}"
        # The trainer's side of the contract: read it from that folder and make the cost line.
        (tmp_path / relative).mkdir(parents=True)
        (tmp_path / inputs["name"]).write_text(inputs["content"])
        line = cost_line(read_price(tmp_path / relative), wall_seconds=1800)
        document = json.loads(inputs["content"])
        assert line["estimated_usd"] == pytest.approx(document["hourly_usd"] * document["units"] / 2, abs=0.01)
        assert line["gpus"] == stack_run.cfg.total_gpus and line["capacity"] == document["capacity"]
        assert stack_run.outputs["costLine"].startswith("gcloud storage cat gs://")

    def test_no_price_no_file(self) -> None:
        h100x4 = {**PREBUILT, "gpuType": "nvidia-h100-80gb", "gpusPerNode": 4, "capacity": "spot", **SIZED_FOR_4}
        stack_run = run_stack("a4-gemma4", overrides=h100x4, remove=NO_RESERVATION)
        assert not [r for r in stack_run.of_type("gcp:storage/bucketObject:BucketObject") if r.name.endswith("-price")]

    def test_what_the_same_run_costs_on_each_stack(self) -> None:
        """`make demo` prints this after its local run: the same wall time on each stack's hardware."""
        lines = plan.cost_on_each_stack(wall_seconds=3600)
        assert [line.split(":", 1)[0] for line in lines] == stack_names()
        by_stack = dict(line.split(": ", 1) for line in lines)
        assert by_stack["a4-gemma4"].startswith("about 148.21 USD = 148.21 USD/h x 1 node(s) x 1.00 h")
        assert by_stack["ray-gemma3-vision"].startswith("about 296.42 USD")
        assert by_stack["dev"].startswith("about 1.43 USD")
