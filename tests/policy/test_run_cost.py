"""`run-cost-within-limit` on real plans: the pack's ceiling, read from the rendered workload, is the program's
`runCostCeilingUsd`; a workload that could cost more than its `max-run-cost-usd` label fails, however it got so.

The pack sees resources, not config: it reads the price label the program writes from infra/pricing.py and
takes nodes, deadline and retries from the workload itself, so each break below changes one of those.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest

from infra import cost, pricing
from infra.offline.engine import Recorded, StackRun, run_stack
from infra.policy import policies
from infra.policy.policies import CLOUD_RUN_JOB, K8S_JOB, RAY_CLUSTER, RAY_JOB, violations
from tests.infra.conftest import PREBUILT
from tests.policy.conftest import run_pack
from tests.policy.test_policies import _set

RULE = "run-cost-within-limit"
WORKLOADS = (K8S_JOB, RAY_JOB, CLOUD_RUN_JOB)
NO_RESERVATION = ("reservationName",)
# Every stack, each capacity, more nodes, more retries, serving on: (stack, overrides, remove).
CASES: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "a4": ("a4-gemma4", {}, ()),
    "a4-spot-2-nodes": (
        "a4-gemma4",
        {"capacity": "spot", "nodes": 2, "recipeOverrides": ["distributed.world_size=16"]},
        NO_RESERVATION,
    ),
    "a4-flex-start": ("a4-gemma4", {"capacity": "flex-start"}, NO_RESERVATION),
    "a4-on-demand-retries": ("a4-gemma4", {"capacity": "on-demand", "trainingRetries": 4}, NO_RESERVATION),
    "ray": ("ray-gemma3-vision", {}, ()),
    "ray-spot-1-node-3-retries": (
        "ray-gemma3-vision",
        {"capacity": "spot", "nodes": 1, "trainingRetries": 3, "recipeOverrides": ["distributed.world_size=8"]},
        NO_RESERVATION,
    ),
    "dev": ("dev", {}, ()),
    "dev-serving-no-retries": ("dev", {"servingEnabled": True, "trainingRetries": 0}, ()),
}


def _run(stack: str, overrides: dict[str, Any], remove: tuple[str, ...], preview: bool = False) -> StackRun:
    base = run_stack(stack, overrides={**PREBUILT, **overrides}, remove=remove, assume_trained=True)
    limit = math.ceil(base.outputs["runCostCeilingUsd"])  # the tightest whole-dollar limit the run fits
    with_limit = {**PREBUILT, **overrides, "maxRunCostUsd": limit}
    return run_stack(stack, overrides=with_limit, remove=remove, assume_trained=True, preview=preview)


@pytest.fixture(scope="module")
def limited() -> dict[str, StackRun]:
    """Each case with maxRunCostUsd set to its own ceiling, rounded up (so every workload just passes)."""
    return {key: _run(*case) for key, case in CASES.items()}


def workload(stack_run: StackRun) -> Recorded:
    (found,) = [r for r in stack_run.resources if r.type in WORKLOADS]
    return found


class TestThePackAgreesWithTheProgram:
    @pytest.mark.parametrize("case", CASES)
    def test_the_ceiling_read_from_the_workload_is_run_cost_ceiling_usd(
        self, limited: dict[str, StackRun], case: str
    ) -> None:
        stack_run = limited[case]
        resource = workload(stack_run)
        props = resource.plain_inputs()
        labels = policies._cost_labels(resource.type, props)
        assert labels is not None
        parts = policies.ceiling_parts(resource.type, props)
        assert not isinstance(parts, str), parts
        cents = int(policies._label(labels, resource.type, policies.NODE_HOUR_CENTS))
        assert parts.usd(cents) == stack_run.outputs["runCostCeilingUsd"], f"{resource.urn}: {parts}"

    @pytest.mark.parametrize("case", CASES)
    def test_every_resource_passes_at_its_own_ceiling(self, limited: dict[str, StackRun], case: str) -> None:
        for resource in limited[case].resources:
            assert RULE not in run_pack(resource.type, resource.plain_inputs()), resource.urn

    def test_the_node_release_tail_is_the_programs(self) -> None:
        assert policies.NODE_RELEASE_S == cost.NODE_RELEASE_S

    def test_the_cluster_fee_is_the_programs(self) -> None:
        assert policies.GKE_CLUSTER_FEE_CENTS == pricing.GKE_CLUSTER_FEE_CENTS

    def test_a_preview_plan_is_judged_too(self) -> None:
        """PR previews run before images exist: the labels and the spec the rule reads are known then."""
        stack_run = _run("a4-gemma4", {}, (), preview=True)
        resource = workload(stack_run)
        props = resource.plain_inputs()
        assert not run_pack(resource.type, props).get(RULE)
        props["metadata"]["labels"]["gemma-finetune/max-run-cost-usd"] = "100"
        assert "above max-run-cost-usd=100" in " ".join(run_pack(resource.type, props)[RULE])


def _scale_ray_workers(props: dict[str, Any]) -> None:
    group = props["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    group["replicas"] = group["minReplicas"] = group["maxReplicas"] = 3


# (case, how the workload is changed, phrase of the violation)
BREAKS: list[tuple[str, str, Callable[[dict[str, Any]], None], str]] = [
    ("job-longer-deadline", "a4", _set(("spec", "activeDeadlineSeconds"), 12 * 3600), "43200 s deadline"),
    ("job-more-nodes", "a4", _set(("spec", "parallelism"), 2), "x 2 + $0.10/h cluster fee) x"),
    (
        "job-lower-limit",
        "a4",
        _set(("metadata", "labels", "gemma-finetune/max-run-cost-usd"), "1000"),
        "above max-run-cost-usd=1000",
    ),
    ("rayjob-more-retries", "ray", _set(("spec", "backoffLimit"), 3), "x 4 attempt(s)"),
    ("rayjob-more-workers", "ray", _scale_ray_workers, "x 3 + $0.10/h cluster fee) x"),
    ("rayjob-longer-deadline", "ray", _set(("spec", "activeDeadlineSeconds"), 8 * 3600), "28800 s deadline"),
    ("cloud-run-more-retries", "dev", _set(("template", "template", "maxRetries"), 5), "x 6 attempt(s)"),
    ("cloud-run-longer-timeout", "dev", _set(("template", "template", "timeout"), "7200s"), "7200 s deadline"),
    ("cloud-run-more-tasks", "dev", _set(("template", "taskCount"), 2), "x 2 x"),
]


class TestItCatchesWhatRaisesTheCost:
    @pytest.mark.parametrize(("case", "mutate", "phrase"), [b[1:] for b in BREAKS], ids=[b[0] for b in BREAKS])
    def test_check_function_and_engine_wrapper(
        self, limited: dict[str, StackRun], case: str, mutate: Callable[[dict[str, Any]], None], phrase: str
    ) -> None:
        resource = workload(limited[case])
        props = copy.deepcopy(resource.plain_inputs())
        mutate(props)
        for found in (violations(resource.type, props), run_pack(resource.type, props)):
            assert list(found) == [RULE], f"{resource.urn}: {found}"
            assert phrase in found[RULE][0] and "one run can cost" in found[RULE][0], found[RULE]

    def test_a_missing_price_label_cannot_pass(self, limited: dict[str, StackRun]) -> None:
        resource = workload(limited["a4"])
        props = copy.deepcopy(resource.plain_inputs())
        del props["metadata"]["labels"]["gemma-finetune/node-hour-cents"]
        assert "cannot be checked: the label node-hour-cents" in violations(resource.type, props)[RULE][0]

    def test_a_standing_ray_cluster_with_a_limit_fails(self) -> None:
        stack_run = run_stack("ray-gemma3-vision", overrides={**PREBUILT, "rayCluster": "standing"})
        cluster = stack_run.one(RAY_CLUSTER)
        props = copy.deepcopy(cluster.plain_inputs())
        assert not violations(cluster.type, props).get(RULE), "no limit, nothing to enforce"
        props["metadata"]["labels"]["gemma-finetune/max-run-cost-usd"] = "1000"
        assert "a standing RayCluster has no deadline" in violations(cluster.type, props)[RULE][0]
        job = stack_run.one(RAY_JOB)
        job_props = copy.deepcopy(job.plain_inputs())
        job_props["metadata"]["labels"]["gemma-finetune/max-run-cost-usd"] = "1000"
        assert "runs on a standing RayCluster" in violations(job.type, job_props)[RULE][0]

    def test_the_standing_variant_passes_the_whole_pack(self) -> None:
        """`rayCluster: standing` is a choice the user made in config: its cluster holds GPUs until deleted by
        design, so it carries the long-running label the deadline rule asks for, and the pack passes it."""
        stack_run = run_stack("ray-gemma3-vision", overrides={**PREBUILT, "rayCluster": "standing"})
        for kind in (RAY_CLUSTER, RAY_JOB):
            resource = stack_run.one(kind)
            assert not run_pack(resource.type, resource.plain_inputs()), resource.urn
        from infra import ray_job

        assert ray_job.LONG_RUNNING_LABEL == policies.LONG_RUNNING_LABEL

    def test_without_a_limit_the_rule_is_silent(self) -> None:
        resource = workload(run_stack("a4-gemma4", overrides=PREBUILT))
        props = copy.deepcopy(resource.plain_inputs())
        props["spec"]["activeDeadlineSeconds"] = 10**7
        assert RULE not in violations(resource.type, props)
