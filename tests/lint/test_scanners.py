"""zizmor and checkov in `make test` (.ci/scan.py): a finding the baseline lacks fails, every accepted one has a reason,
and the real scanners (from .venv-scanners, which `make test` installs from .ci/scanners.lock) report what they
should on deliberately bad inputs, offline."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.lint.conftest import ci_module

scan = ci_module("scan")
HAVE_SCANNERS = (scan.SCANNERS / "zizmor").exists() and (scan.SCANNERS / "checkov").exists()
needs_scanners = pytest.mark.skipif(not HAVE_SCANNERS, reason="make test installs .venv-scanners first")


def finding(rule: str, target: str) -> object:
    return scan.Finding("checkov", rule, target, "a title")


class TestTheBaseline:
    def test_a_new_finding_fails(self) -> None:
        accepted = [
            {"scanner": "checkov", "rule": "CKV_K8S_22", "target": "a/Job", "reason": "Triton compiles at run time"}
        ]
        found = [finding("CKV_K8S_22", "a/Job"), finding("CKV_K8S_37", "a/Job")]
        assert scan.compare(found, accepted) == ["NEW checkov CKV_K8S_37 a/Job: a title"]

    def test_an_entry_without_a_reason_or_without_a_finding_fails(self) -> None:
        accepted = [
            {"scanner": "checkov", "rule": "CKV_K8S_22", "target": "a/Job", "reason": "ok"},
            {"scanner": "checkov", "rule": "CKV_K8S_8", "target": "gone/Job", "reason": "KubeRay adds its own probes"},
        ]
        problems = scan.compare([finding("CKV_K8S_22", "a/Job")], accepted)
        assert any("gives no reason" in p for p in problems) and any("matches no finding" in p for p in problems)

    def test_every_accepted_finding_has_its_reason(self) -> None:
        for entry in scan.load_baseline():
            assert set(entry) == {"scanner", "rule", "target", "reason"}, entry
            assert len(entry["reason"].split()) >= 10, f"say why {entry['rule']} on {entry['target']} is accepted"


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every proxy variable points at a listener on 127.0.0.1 that records each connection: a scanner that tried the
    network (a guideline download, a version check, a GitHub API call) would show up here instead of waiting on a
    firewall in CI."""
    listener = socket.create_server(("127.0.0.1", 0))
    attempts: list[str] = []

    def record() -> None:
        while True:
            try:
                connection, peer = listener.accept()
            except OSError:
                return
            attempts.append(str(peer))
            connection.close()

    threading.Thread(target=record, daemon=True).start()
    proxy = f"http://127.0.0.1:{listener.getsockname()[1]}"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, proxy)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    yield attempts
    listener.close()


@needs_scanners
class TestTheRealScanners:
    def test_zizmor_offline_finds_an_unpinned_action_and_a_template_injection(
        self, tmp_path: Path, no_network: list[str]
    ) -> None:
        workflows = tmp_path / ".github" / "workflows"
        workflows.mkdir(parents=True)
        workflow = {
            "on": {"pull_request_target": None},
            "permissions": {},
            "jobs": {
                "x": {
                    "runs-on": "ubuntu-24.04",
                    "steps": [
                        {"uses": "actions/checkout@v5"},
                        {"run": "echo ${{ github.event.pull_request.title }}"},
                    ],
                }
            },
        }
        (workflows / "bad.yml").write_text(yaml.safe_dump(workflow))
        rules = {f.rule for f in scan.zizmor(tmp_path)}
        assert {"unpinned-uses", "template-injection"} <= rules, rules
        assert no_network == [], "zizmor tried the network"

    def test_checkov_reads_a_ray_pod_template_only_once_written_out_as_a_pod(
        self, tmp_path: Path, no_network: list[str]
    ) -> None:
        """The reason .ci/scan.py writes each template out: inside the RayJob checkov sees nothing wrong."""
        template = {"spec": {"containers": [{"name": "ray-head", "image": "trainer@sha256:" + "1" * 64}]}}
        ray_job = {
            "apiVersion": "ray.io/v1",
            "kind": "RayJob",
            "metadata": {"name": "run", "namespace": "ns"},
            "spec": {"rayClusterSpec": {"headGroupSpec": {"rayStartParams": {}, "template": template}}},
        }
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "run", "namespace": "ns"}, **template}
        (tmp_path / "k8s").mkdir()
        (tmp_path / "k8s" / "rayjob.yaml").write_text(yaml.safe_dump(ray_job))
        inside = {f.rule for f in scan.checkov(["k8s"], ["kubernetes"], tmp_path, {})}
        (tmp_path / "k8s" / "pod.yaml").write_text(yaml.safe_dump(pod))
        outside = {f.rule for f in scan.checkov(["k8s"], ["kubernetes"], tmp_path, {})}
        assert "CKV_K8S_37" not in inside and {"CKV_K8S_37", "CKV_K8S_38"} <= outside, (inside, outside)
        assert no_network == [], "checkov tried the network"


def test_the_scanners_venv_is_installed_from_the_hashed_lock() -> None:
    makefile = (scan.REPO_ROOT / "Makefile").read_text()
    assert "--require-hashes --only-binary :all: -r .ci/scanners.lock" in makefile
    assert "$(PY) .ci/scan.py" in makefile.split("\ntest:")[1].split("\n\n")[0], "make test runs the scanners"


def test_ci_caches_the_scanners_wheels() -> None:
    """setup-python saves pip's cache only under a new key: without the lock in the key, a CI run downloads checkov
    and its ~100 wheels again every time (77 s here on a cold cache)."""
    workflow = yaml.safe_load((scan.REPO_ROOT / ".github/workflows/test.yml").read_text())
    [setup] = [s for s in workflow["jobs"]["test"]["steps"] if "setup-python" in s.get("uses", "")]
    assert ".ci/scanners.lock" in setup["with"]["cache-dependency-path"].split()
