""".ci/stacks.py, which decides which preview job (and which identity) each stack file gets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from infra.offline.engine import REPO_ROOT, run_stack, stack_names
from infra.offline.permissions import stack_features
from tests.lint.conftest import ci_module

SCRIPT = REPO_ROOT / ".ci" / "stacks.py"
ci_stacks = ci_module("stacks")


def listing(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(SCRIPT), "--root", str(root), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def repo(tmp_path: Path, files: dict[str, str], project: str = "name: gemma-finetune\nconfig:\n") -> Path:
    (tmp_path / "Pulumi.yaml").write_text(project)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


class TestGroups:
    def test_a_new_stack_file_joins_the_job_of_its_workload(self, tmp_path: Path) -> None:
        root = repo(
            tmp_path,
            {
                "Pulumi.lab.yaml": "config:\n  gemma-finetune:workload: 'gke-ray'   # Ray on GKE\n",
                "Pulumi.edge.yaml": "config:\n  gcp:project: p\n  gemma-finetune:workload: cloud-run\n",
            },
        )
        result = listing(root, "--outputs")
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == ['cloud-run=["edge"]', 'gke=["lab"]']
        assert listing(root, "--workload", "lab").stdout.strip() == "gke-ray"

    def test_a_stack_without_a_workload_takes_the_project_default(self, tmp_path: Path) -> None:
        project = "config:\n  workload:\n    type: string\n    default: gke-job\n  recipe:\n    type: string\n"
        root = repo(tmp_path, {"Pulumi.a.yaml": "config:\n  gcp:project: p\n"}, project)
        assert ci_stacks.stacks(root) == {"a": "gke-job"}

    def test_no_workload_and_no_default_names_the_file_and_the_fix(self, tmp_path: Path) -> None:
        root = repo(tmp_path, {"Pulumi.a.yaml": "config:\n  gcp:project: p\n"})
        result = listing(root)
        assert result.returncode == 2
        assert "Pulumi.a.yaml sets no gemma-finetune:workload" in result.stderr
        assert "gemma-finetune:workload: cloud-run" in result.stderr

    def test_an_unknown_workload_fails(self, tmp_path: Path) -> None:
        root = repo(tmp_path, {"Pulumi.a.yaml": "config:\n  gemma-finetune:workload: vertex\n"})
        result = listing(root)
        assert result.returncode == 2 and "workload='vertex' is not one of" in result.stderr

    def test_a_stack_name_that_would_reach_a_shell_fails(self, tmp_path: Path) -> None:
        root = repo(tmp_path, {"Pulumi.a$(id).yaml": "config:\n  gemma-finetune:workload: cloud-run\n"})
        result = listing(root)
        assert result.returncode == 2 and "stack names are letters" in result.stderr


class TestFeatures:
    """What else the one-time setup grants for, read from the stack files as the program reads its config."""

    def test_lines_name_the_workload_and_the_features(self, tmp_path: Path) -> None:
        project = (
            "config:\n  capacity:\n    type: string\n    default: on-demand\n"
            "  imageBuild:\n    type: string\n    default: cloud-build\n"
        )
        root = repo(
            tmp_path,
            {
                "Pulumi.a4.yaml": "config:\n  gemma-finetune:workload: gke-job\n"
                "  gemma-finetune:capacity: reservation   # on-demand | spot | flex-start | reservation\n"
                "  gemma-finetune:imageBuild: docker\n",
                "Pulumi.lab.yaml": "config:\n  gemma-finetune:workload: cloud-run\n",
                "Pulumi.spot.yaml": "config:\n  gemma-finetune:workload: gke-ray\n  gemma-finetune:capacity: 'spot'\n"
                "  gemma-finetune:imageBuild: docker\n  gemma-finetune:billingAccount: 012345-6789AB-CDEF01\n",
            },
            project,
        )
        result = listing(root, "--lines")
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == [
            "a4 gke-job reservation",
            "lab cloud-run cloud-build,gpu-quota",
            "spot gke-ray budget,gpu-quota",
        ]

    def test_components_name_what_pulumi_up_of_the_stack_runs(self, tmp_path: Path) -> None:
        root = repo(
            tmp_path,
            {
                "Pulumi.ray.yaml": "config:\n  gemma-finetune:workload: gke-ray\n",
                "Pulumi.dev.yaml": "config:\n  gemma-finetune:workload: cloud-run\n",
            },
        )
        assert listing(root, "--components", "ray").stdout == "gke-gcloud-auth-plugin,kubectl\n"
        assert listing(root, "--components", "dev").stdout == "\n"
        missing = listing(root, "--components", "nope")
        assert missing.returncode == 2 and "no stack file Pulumi.nope.yaml" in missing.stderr

    @pytest.mark.slow
    def test_every_committed_stack_file_has_the_features_its_validated_config_has(self) -> None:
        for stack in stack_names():
            run = run_stack(stack)
            assert run.cfg is not None
            expected = sorted(stack_features(run.cfg))
            assert ci_stacks.features_of(REPO_ROOT / f"Pulumi.{stack}.yaml") == expected, stack

    def test_alert_emails_are_a_feature_when_the_list_has_an_item(self, tmp_path: Path) -> None:
        """The deploy may create notification channels only for a stack that lists alert addresses (ci-identities.yaml
        `alert-emails`); the features must match what the validated configuration says (stack_features)."""
        files = {
            "block": "  gemma-finetune:alertEmails:\n    - oncall@example.com\n",
            "flow": "  gemma-finetune:alertEmails: [oncall@example.com]   # on call\n",
            "empty": "  gemma-finetune:alertEmails: []\n",
            "none": "  gemma-finetune:budgetEmails:\n    - alice@example.com\n",
        }
        for name, lines in files.items():
            (tmp_path / f"Pulumi.{name}.yaml").write_text(f"config:\n  gemma-finetune:workload: cloud-run\n{lines}")
        found = {name: "alert-emails" in ci_stacks.features_of(tmp_path / f"Pulumi.{name}.yaml", tmp_path)
                 for name in files}  # fmt: skip
        assert found == {"block": True, "flow": True, "empty": False, "none": False}
        cfg = run_stack("dev", overrides={"alertEmails": ["oncall@example.com"]}).cfg
        assert cfg is not None and "alert-emails" in stack_features(cfg)
