"""Shared fixtures for trainer tests: tiny model folders and the one Ray cluster are built once per session."""

from __future__ import annotations

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


@pytest.fixture(scope="session")
def ray_cluster(ray_plan: RayPlan) -> Iterator[LocalRayCluster]:
    """ONE KubeRay-like Ray cluster (head with dashboard + a 2-CPU worker node) for every Ray test; always stopped."""
    from tests.trainer.ray_cluster import kuberay_like_cluster

    with kuberay_like_cluster(ray_plan.head_params, ray_plan.worker_params, worker_cpus=2) as cluster:
        yield cluster
