"""`make plan`: the offline plan prints every resource and writes resources.json with secrets hidden."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.offline import plan
from infra.offline.engine import MOCK_HF_TOKEN


class TestPlan:
    def test_dev_plan_writes_resources_json(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert plan.main(["--stack", "dev", "--out", str(tmp_path)]) == 0
        printed = capsys.readouterr().out
        assert "gcp:cloudrunv2/job:Job" in printed and "gft-dev-job" in printed
        resources = json.loads((tmp_path / "dev" / "resources.json").read_text())
        assert all({"type", "name", "inputs"} <= set(r) for r in resources)
        version = next(r for r in resources if r["type"] == "gcp:secretmanager/secretVersion:SecretVersion")
        assert version["inputs"]["secretData"] == "[secret]"
        assert MOCK_HF_TOKEN not in (tmp_path / "dev" / "resources.json").read_text()

    def test_serving_plan_lists_the_service(self, tmp_path: Path) -> None:
        args = ["--stack", "dev", "--set", "servingEnabled=true", "--assume-trained", "--out", str(tmp_path)]
        assert plan.main(args) == 0
        types = {r["type"] for r in json.loads((tmp_path / "dev" / "resources.json").read_text())}
        assert "gcp:cloudrunv2/service:Service" in types

    def test_bad_config_exits_2_with_the_message(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        code = plan.main(["--stack", "dev", "--set", "gpuType=nvidia-b200", "--out", str(tmp_path)])
        assert code == 2
        assert "not offered by Cloud Run" in capsys.readouterr().err

    def test_unknown_stack(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert plan.main(["--stack", "nope"]) == 2
        assert "unknown stack" in capsys.readouterr().err
