"""Shared fixtures for trainer tests: tiny model folders are built once per session, the Ray cluster once per group.

The Ray cluster stops after the last test of its group (`pytest_runtest_teardown` below), not at the session's end:
the group's tests run one after another on one worker (tests/conftest.py), and an idle cluster's daemons take
about a tenth of a core for the rest of the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from transformers import PreTrainedTokenizerFast

from tests import tiny_models as tiny

if TYPE_CHECKING:
    from tests.trainer.ray_cluster import LocalRayCluster, RayPlan


@pytest.fixture(scope="session")
def tiny_tokenizer_session() -> PreTrainedTokenizerFast:
    return tiny.tiny_tokenizer()


@pytest.fixture
def tiny_tokenizer(tiny_tokenizer_session: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    return tiny_tokenizer_session


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.save_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3")


@pytest.fixture(scope="session")
def tiny_gemma4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.save_tiny_model(tmp_path_factory.mktemp("tiny-gemma4"), "gemma4")


@pytest.fixture(scope="session")
def tiny_gemma3_vision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Gemma3ForConditionalGeneration + processor folder."""
    return tiny.save_tiny_vision_model(tmp_path_factory.mktemp("tiny-gemma3-vision"))


@pytest.fixture(scope="session")
def ray_plan(tiny_gemma3_vision_dir: Path) -> RayPlan:
    """The ray-gemma3-vision stack planned offline, with recipeOverrides pointing at the tiny model."""
    from tests.trainer.ray_cluster import plan_ray_stack

    return plan_ray_stack(tiny_gemma3_vision_dir)


class _RayClusterKeeper:
    """Starts the cluster for the first test that asks, stops it on demand; a test after a stop starts a new one."""

    def __init__(self, plan: RayPlan) -> None:
        self.plan = plan
        self.cluster: LocalRayCluster | None = None
        self._stack = contextlib.ExitStack()

    def get(self) -> LocalRayCluster:
        if self.cluster is None:
            from tests.trainer.ray_cluster import kuberay_like_cluster

            plan = self.plan
            self.cluster = self._stack.enter_context(
                kuberay_like_cluster(plan.head_params, plan.worker_params, worker_cpus=2)
            )
        return self.cluster

    def stop(self) -> None:
        self.cluster = None
        self._stack.close()


_KEEPER: list[_RayClusterKeeper] = []  # this worker's, once a test has asked for the cluster


@pytest.fixture(scope="session")
def ray_cluster_keeper(ray_plan: RayPlan) -> Iterator[_RayClusterKeeper]:
    keeper = _RayClusterKeeper(ray_plan)
    _KEEPER.append(keeper)
    try:
        yield keeper
    finally:
        keeper.stop()


@pytest.fixture
def ray_cluster(ray_cluster_keeper: _RayClusterKeeper) -> LocalRayCluster:
    """ONE KubeRay-like Ray cluster (head with dashboard + a 2-CPU worker node) for the Ray tests; always stopped."""
    return ray_cluster_keeper.get()


@pytest.hookimpl(trylast=True)  # after pytest's own teardown of the test's fixtures
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the Ray cluster when the next test is outside its group (see the module docstring)."""
    if not _KEEPER:
        return
    from tests.conftest import group_of

    group = group_of(item.nodeid)
    if group == "ray-cluster" and (nextitem is None or group_of(nextitem.nodeid) != group):
        _KEEPER[0].stop()
