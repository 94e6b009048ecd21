"""The CRD wait step: the real script, the real `kubectl`, against a small fake Kubernetes API server on 127.0.0.1.

The fake server answers what kubectl asks for `get crd NAME` and `wait --for=condition=Established crd/NAME`:
discovery (/api, /apis, the apiextensions group), a GET of one CRD and a LIST filtered by name. A CRD
"appears" (Established) only after it has been asked for a number of times, as when the GKE Ray add-on
installs it a while after the cluster exists.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from infra.crd_wait import KUBERAY_CRDS, WAIT_SCRIPT
from infra.offline.engine import is_secret, run_stack
from tests.infra.conftest import PREBUILT

GROUP = "apiextensions.k8s.io"
CRD_PATH = f"/apis/{GROUP}/v1/customresourcedefinitions"

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


class FakeApiServer:
    def __init__(self, appear_after: int) -> None:
        self.appear_after = appear_after
        self.gets: dict[str, int] = {}
        self.requests: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                server.requests.append(self.path)
                status, body = server.answer(self.path)
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def crd(self, name: str) -> dict[str, Any]:
        return {
            "apiVersion": f"{GROUP}/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": name, "resourceVersion": "7", "uid": name},
            "spec": {},
            "status": {"conditions": [{"type": "Established", "status": "True"}]},
        }

    def answer(self, raw: str) -> tuple[int, Any]:
        url = urlparse(raw)
        path, query = url.path, parse_qs(url.query)
        if path == "/api":
            return 200, {"kind": "APIVersions", "versions": ["v1"]}
        if path == "/apis":
            version = {"groupVersion": f"{GROUP}/v1", "version": "v1"}
            return 200, {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [{"name": GROUP, "versions": [version], "preferredVersion": version}],
            }
        if path == "/api/v1":
            return 200, {"kind": "APIResourceList", "groupVersion": "v1", "resources": []}
        if path == f"/apis/{GROUP}/v1":
            resource = {
                "name": "customresourcedefinitions",
                "singularName": "customresourcedefinition",
                "namespaced": False,
                "kind": "CustomResourceDefinition",
                "verbs": ["get", "list", "watch"],
                "shortNames": ["crd", "crds"],
            }
            return 200, {"kind": "APIResourceList", "groupVersion": f"{GROUP}/v1", "resources": [resource]}
        if path.startswith(CRD_PATH + "/"):
            name = path.rsplit("/", 1)[1]
            self.gets[name] = self.gets.get(name, 0) + 1
            if self.gets[name] > self.appear_after:
                return 200, self.crd(name)
            return 404, {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "reason": "NotFound",
                "code": 404,
                "message": f'customresourcedefinitions.{GROUP} "{name}" not found',
            }
        if path == CRD_PATH:
            selector = (query.get("fieldSelector") or [""])[0]
            name = selector.removeprefix("metadata.name=")
            items = [self.crd(name)] if self.gets.get(name, 0) > self.appear_after else []
            return 200, {
                "apiVersion": f"{GROUP}/v1",
                "kind": "CustomResourceDefinitionList",
                "metadata": {"resourceVersion": "7"},
                "items": items,
            }
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}

    def __enter__(self) -> FakeApiServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def kubeconfig(server: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": server}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
            "users": [{"name": "fake", "user": {}}],
        }
    )


def wait(server: str, tmp_path: Path, wait_seconds: int, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": path if path is not None else "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(tmp_path),  # kubectl's discovery cache
        "TMPDIR": str(tmp_path),
        "KUBECONFIG_DATA": kubeconfig(server),
        "CRDS": " ".join(KUBERAY_CRDS),
        "WAIT_SECONDS": str(wait_seconds),
        "POLL_SECONDS": "0.2",
    }
    return subprocess.run(
        ["/bin/bash", "-c", WAIT_SCRIPT], env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture
def late_crds() -> Iterator[FakeApiServer]:
    with FakeApiServer(appear_after=3) as server:
        yield server


class TestCrdWait:
    @pytest.mark.slow
    def test_returns_only_once_every_crd_exists_and_is_established(
        self, late_crds: FakeApiServer, tmp_path: Path
    ) -> None:
        done = wait(late_crds.url, tmp_path, wait_seconds=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "established: rayjobs.ray.io rayclusters.ray.io"
        for crd in KUBERAY_CRDS:
            assert late_crds.gets[crd] > late_crds.appear_after, "polled until it appeared"
            listed = [r for r in late_crds.requests if r.startswith(CRD_PATH + "?") and crd in r]
            assert listed, f"kubectl wait checked crd/{crd}'s condition"
        first_wait = next(i for i, r in enumerate(late_crds.requests) if r.startswith(CRD_PATH + "?"))
        polls = [i for i, r in enumerate(late_crds.requests) if r.startswith(CRD_PATH + "/")]
        script_polls = (late_crds.appear_after + 1) * len(KUBERAY_CRDS)
        assert len(polls) >= script_polls and polls[script_polls - 1] < first_wait, "waits only after both exist"
        assert not [p for p in tmp_path.iterdir() if p.name.startswith("tmp")], "the kubeconfig file is removed"

    def test_fails_with_the_last_answer_when_a_crd_never_appears(self, tmp_path: Path) -> None:
        with FakeApiServer(appear_after=10**9) as server:
            started = time.monotonic()
            done = wait(server.url, tmp_path, wait_seconds=2)
        assert done.returncode == 1 and time.monotonic() - started < 60
        assert "crd/rayjobs.ray.io did not appear within 2s" in done.stderr
        assert "not found" in done.stderr, "the API server's last answer is shown"
        assert "Established" not in " ".join(server.requests)

    def test_says_how_to_install_kubectl(self, tmp_path: Path) -> None:
        done = wait("http://127.0.0.1:9", tmp_path, wait_seconds=1, path=str(tmp_path / "empty"))
        assert done.returncode == 1
        assert "gcloud components install kubectl gke-gcloud-auth-plugin" in done.stderr


class TestWiring:
    def test_the_ray_stack_waits_with_the_clusters_kubeconfig_kept_secret(self) -> None:
        run = run_stack("ray-gemma3-vision", overrides=PREBUILT)
        [step] = [s for s in run.of_type("command:local:Command") if "CrdWait" in s.parent]
        environment = step.inputs["environment"]
        assert is_secret(environment) or is_secret(environment["KUBECONFIG_DATA"]), "the kubeconfig stays a secret"
        assert step.plain_inputs()["environment"]["CRDS"].split() == list(KUBERAY_CRDS)
        assert run.one("gcp:container/cluster:Cluster").urn in step.dependencies

    def test_other_stacks_have_no_crd_step(self) -> None:
        for stack in ("dev", "a4-gemma4"):
            steps = run_stack(stack, overrides=PREBUILT).of_type("command:local:Command")
            assert [s.urn for s in steps if "CRDS" in (s.plain_inputs().get("environment") or {})] == []
