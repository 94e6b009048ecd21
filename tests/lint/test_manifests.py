"""Strict validation of the manifests `make plan` writes, and of deliberately broken ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.offline import validate_manifests as vm

DIGEST = "us-central1-docker.pkg.dev/p/r/trainer@sha256:" + "1" * 64


def job(**spec_extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "train", "namespace": "gemma-finetune"},
        "spec": {
            "backoffLimit": 2,
            "activeDeadlineSeconds": 3600,
            "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "trainer", "image": DIGEST}]}},
            **spec_extra,
        },
    }


def write(tmp_path: Path, *documents: dict[str, Any]) -> Path:
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    return path


class TestEveryPlannedManifest:
    def test_every_stack_plans_and_every_manifest_is_valid(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        assert vm.main(["--out", str(tmp_path)]) == 0, capsys.readouterr().out
        out = capsys.readouterr().out
        assert "0 invalid" in out, out
        assert list(tmp_path.glob("*/manifests/*.yaml")), "the GKE stacks write manifests"


class TestBrokenManifests:
    def test_a_valid_job_passes(self, tmp_path: Path) -> None:
        [outcome] = vm.validate_file(write(tmp_path, job()))
        assert outcome.status == "valid", outcome

    def test_a_typo_in_a_field_name_fails_with_its_path(self, tmp_path: Path) -> None:
        broken = job()
        broken["spec"]["activeDeadlineSecond"] = broken["spec"].pop("activeDeadlineSeconds")
        [outcome] = vm.validate_file(write(tmp_path, broken))
        assert outcome.status == "invalid"
        assert any(e.startswith(".spec:") and "'activeDeadlineSecond' was unexpected" in e for e in outcome.errors), (
            outcome.errors
        )

    def test_a_typo_inside_the_pod_template_fails(self, tmp_path: Path) -> None:
        broken = job()
        broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
        [outcome] = vm.validate_file(write(tmp_path, broken))
        assert any("spec.template.spec.containers[0]" in e and "imagePullPolicyy" in e for e in outcome.errors)

    def test_a_wrong_type_fails(self, tmp_path: Path) -> None:
        [outcome] = vm.validate_file(write(tmp_path, job(backoffLimit="two")))
        assert any(".spec.backoffLimit" in e and "'two' is not of type 'integer'" in e for e in outcome.errors)

    def test_the_command_line_fails_and_names_the_field(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        broken = job()
        broken["spec"]["template"]["spec"]["containres"] = broken["spec"]["template"]["spec"].pop("containers")
        assert vm.main(["--files", str(write(tmp_path, broken))]) == 1
        out = capsys.readouterr().out
        assert "INVALID" in out and "containres" in out and "1 invalid" in out, out

    @pytest.mark.skipif(not vm.KUBERAY_SCHEMA.exists(), reason="no KubeRay schema in infra/schemas")
    def test_a_typo_in_a_rayjob_fails(self, tmp_path: Path) -> None:
        rayjob = {
            "apiVersion": "ray.io/v1",
            "kind": "RayJob",
            "metadata": {"name": "ft"},
            "spec": {"entrypoint": "python -m trainer", "shutdownAfterJobFinish": True},
        }
        [outcome] = vm.validate_file(write(tmp_path, rayjob))
        assert outcome.status == "invalid" and any("shutdownAfterJobFinish" in e for e in outcome.errors), outcome

    def test_a_kind_without_schema_is_skipped_and_said_so(self, tmp_path: Path) -> None:
        custom = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {}}
        [outcome] = vm.validate_file(write(tmp_path, custom))
        assert outcome.status == "skipped" and "no schema for example.com/v1 Widget" in outcome.notes[0]

    def test_a_redacted_secret_is_noted_not_failed_but_a_typo_beside_it_fails(self, tmp_path: Path) -> None:
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf"}, "stringData": "[secret]"}
        [outcome] = vm.validate_file(write(tmp_path, secret))
        assert outcome.status == "valid" and any("redacted" in note for note in outcome.notes), outcome
        secret["typ"] = "Opaque"
        [outcome] = vm.validate_file(write(tmp_path, secret))
        assert outcome.status == "invalid" and any("'typ' was unexpected" in e for e in outcome.errors), outcome

    def test_not_a_kubernetes_object_fails(self, tmp_path: Path) -> None:
        path = tmp_path / "x.yaml"
        path.write_text("just: a map\n")
        [outcome] = vm.validate_file(path)
        assert outcome.status == "invalid"
