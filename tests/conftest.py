"""What every test shares when `make test` runs the suite on three workers (pytest-xdist).

`make test` runs `pytest -n 3 --dist loadgroup --no-loadscope-reorder`, and `pytest_xdist_make_scheduler` below
hands each worker one group of tests at a time (xdist's own `xdist_group` marks are ignored under pytest 9.2's
node ids). The rules (the why of each: docs/development.md, "How the test run is split over the workers"):
- "ray-cluster" (fixture `ray_cluster`) and "gemma3-270m" (marker `gemma3_270m`) hold every test that uses that
  resource, in the files `GROUPS` lists: a test that uses one elsewhere fails the run's group check;
- tests/infra and tests/policy run each as a whole, tests/infra/test_pulumi_install.py apart; any other module
  as a whole;
- the groups in LONGEST_FIRST start first, the others by an estimate from the slow marker;
- a worker's torch uses one thread; the image build contexts are staged under an exclusive file lock;
- the garbage collector is off while the tests are collected and the objects then alive are frozen (below).
A run without xdist (`pytest tests/...`) is unchanged but for that lock, the group check and the collector.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest

WORKER = os.environ.get("PYTEST_XDIST_WORKER")
# Collecting imports torch, transformers and the Pulumi SDKs and builds ~2,000 items: with the collector on, each
# full collection walks that growing heap again, in every worker (bench/RESULTS.md, "A fresh clone's `.ci/run`...")
gc.disable()
# group -> the files (or folders) whose tests it holds
GROUPS = {
    "ray-cluster": ("tests/trainer/test_ray_runtime.py", "tests/trainer/test_ray_entry.py"),
    "gemma3-270m": (
        "tests/e2e/test_demo.py",
        "tests/trainer/test_local_model.py",
        "tests/trainer/test_data_loading.py",
        "tests/trainer/test_recipe_run.py",
    ),
    # its own group, beside the other infra tests: it waits on pip far more than it computes
    "tests/infra/test_pulumi_install.py": ("tests/infra/test_pulumi_install.py",),
    "tests/infra/": ("tests/infra/",),
    "tests/policy/": ("tests/policy/",),
}
# what puts a test in a group: a fixture it uses, or a marker it carries
NEEDS = {"ray-cluster": ("fixture", "ray_cluster"), "gemma3-270m": ("marker", "gemma3_270m")}
# The groups that take longest (the durations pytest prints at the end of `make test`), started first, longest
# first, so that the workers end together. Only the order of the run depends on this list.
LONGEST_FIRST = (
    "ray-cluster",  # the cluster, a RayJob through job submission, an interrupted and a preempted Ray run
    "gemma3-270m",  # the demo end to end on the 270M, a LoRA run on the 270M, its tokenizer
    "tests/infra/",  # every stack and variant planned under mocks, the permission proof
    "tests/trainer/test_multirank_resume.py",  # two launches of 3 ranks
    "tests/trainer/test_fsdp_checkpoint.py",  # two FSDP2 launches of 2 ranks (one also scores held-out rows)
    "tests/bench/test_gpu_check.py",  # the GPU check's dry run: several tiny trainings
    "tests/trainer/test_startup_wait.py",  # 2 ranks, rank 0 loads late
    "tests/trainer/test_preemption.py",  # a SIGTERM mid-run and the restart
    "tests/demo/test_local_server.py",  # local servers, one per test that stops or kills its own
    "tests/lint/test_ci_setup.py",  # the one-time setup script, run many times against a recording gcloud
    "tests/infra/test_pulumi_install.py",  # Pulumi's pip install into a fresh venv
    "tests/bench/test_train_throughput.py",  # both sides of the benchmark, two memory probes
    "tests/trainer/test_run_eval.py",  # in-process runs on the tiny model
)
# after those, the other groups by an estimate: a test marked slow as SLOW_S, any other as FAST_S
SLOW_S, FAST_S = 10.0, 0.3


def group_of(nodeid: str) -> str:
    """The group of a test, from its node id alone (all the scheduler sees)."""
    module = nodeid.split("::", 1)[0]
    for group, paths in GROUPS.items():
        if any(module == path or (path.endswith("/") and module.startswith(path)) for path in paths):
            return group
    return module


def _needs(item: pytest.Item, group: str) -> bool:
    kind, name = NEEDS[group]
    return name in getattr(item, "fixturenames", ()) if kind == "fixture" else item.get_closest_marker(name) is not None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    misplaced = [
        f"{item.nodeid} needs group {group!r}: add its file to tests/conftest.py GROUPS[{group!r}]"
        for item in items
        for group in NEEDS
        if _needs(item, group) and group_of(item.nodeid) != group
    ]
    if misplaced:
        raise pytest.UsageError("\n".join(misplaced))
    if not WORKER:
        return
    weight: dict[str, float] = {}
    for item in items:
        group = group_of(item.nodeid)
        weight[group] = weight.get(group, 0.0) + (SLOW_S if item.get_closest_marker("slow") else FAST_S)

    def order(item: pytest.Item) -> tuple[int, float]:
        group = group_of(item.nodeid)
        rank = LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST)
        return rank, -weight[group]

    items.sort(key=order)  # stable: the tests of a group keep their order


def pytest_configure(config: pytest.Config) -> None:
    """xdist's controller process collects nothing (its workers do): the collector goes back on at once."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        gc.enable()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The collector back on, with what collection left alive frozen: later full collections skip it."""
    gc.collect()
    gc.freeze()
    gc.enable()


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With `--dist loadgroup`, xdist's scope scheduler cut along `group_of` (the order is the workers')."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread_per_worker() -> None:
    if WORKER:
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _image_contexts_staged_one_at_a_time() -> Iterator[None]:
    from infra.offline.staging import contexts_staged_one_at_a_time

    with contexts_staged_one_at_a_time():  # the workers and `make test`'s scanner plans share the staging folder
        yield
