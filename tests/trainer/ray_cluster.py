"""A real Ray cluster on 127.0.0.1, started the way KubeRay starts one, for the Ray tests.

The head and one CPU worker node run as two process trees with the rayStartParams the plan rendered, as
KubeRay's `ray start ... --block` commands; only what a shared machine forces is changed (free ports, the
dashboard on loopback, `--num-cpus`, a small object store, a short temp dir). `KUBERAY_PROBE` is KubeRay's
own probe command, run as the probe execs it. `plan_ray_stack` plans the ray-gemma3-vision stack offline
(infra/offline/engine.py `run_stack`) with only `recipeOverrides` a user could set and hands out what KubeRay
would read from the RayJob. The KubeRay sources: docs/distributed.md#ray-tests-on-a-real-cluster.

Teardown ends only what this module started (each `ray start --block` process group, then any process naming
this cluster's temp dir, by pid); it never runs `ray stop`, which would stop every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STACK = "ray-gemma3-vision"
RAYJOB = "kubernetes:ray.io/v1:RayJob"
RAY = str(Path(sys.executable).parent / "ray")
# ray-project/kuberay ray-operator/controllers/ray/utils/constant.go
KUBERAY_PROBE = "wget -T 2 -q -O- http://localhost:{port}/{path} | grep success"
# KubeRay's readiness probe on Ray pods (ray-operator/controllers/ray/utils/constant.go):
# DefaultReadinessProbePeriodSeconds = 3, DefaultReadinessProbeFailureThreshold = 20. A pod becomes
# ready at the first success; it is marked not ready only after 20 failures in a row.
KUBERAY_PROBE_PERIOD_S = 3
KUBERAY_PROBE_FAILURE_THRESHOLD = 20
RAYLET_HEALTH_PATH = "api/local_raylet_healthz"  # RayAgentRayletHealthPath, on the dashboard agent (52365)
GCS_HEALTH_PATH = "api/gcs_healthz"  # RayDashboardGCSHealthPath, on the dashboard (8265)
OBJECT_STORE_BYTES = 200 * 1024 * 1024


def tiny_recipe_overrides(model_dir: Path) -> list[str]:
    """recipeOverrides that shrink the W2 recipe to seconds on CPUs; QLoRA, the vision collator,
    gradient checkpointing, LoRA targets and the optimizer stay as the recipe has them."""
    return [
        f"model.name_or_path={model_dir}",
        "data.source=local",
        "data.path=trainer/samples/products.jsonl",
        "data.image_dir=trainer/samples",
        "data.max_rows=8",
        "data.eval_rows=0",
        "training.max_steps=2",
        "training.save_steps=2",
        "training.logging_steps=1",
        "training.gradient_accumulation_steps=1",
        "training.max_length=512",
        "training.report_to=[]",
        "training.extra.dataloader_num_workers=1",  # the recipe's loader processes, one on 2 cores
    ]


@dataclass(frozen=True)
class RayPlan:
    """What KubeRay reads from the planned RayJob."""

    entrypoint: str
    run_name: str
    ray_version: str
    head_params: dict[str, str]
    worker_params: dict[str, str]


def plan_ray_stack(model_dir: Path) -> RayPlan:
    from infra.offline.engine import run_stack

    stack_run = run_stack(STACK, overrides={"recipeOverrides": tiny_recipe_overrides(model_dir)})
    (job,) = [r for r in stack_run.resources if r.type == RAYJOB]
    spec = job.plain_inputs()["spec"]
    cluster = spec["rayClusterSpec"]
    (workers,) = cluster["workerGroupSpecs"]
    return RayPlan(
        entrypoint=spec["entrypoint"],
        run_name=stack_run.outputs["rayJobName"],
        ray_version=cluster["rayVersion"],
        head_params=dict(cluster["headGroupSpec"]["rayStartParams"]),
        worker_params=dict(workers["rayStartParams"]),
    )


def free_ports(count: int) -> list[int]:
    """`count` distinct ports that were free a moment ago (held together while choosing)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _node_ports() -> dict[str, int]:
    names = [
        "node-manager-port",
        "object-manager-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "metrics-export-port",
        "runtime-env-agent-port",
    ]
    return dict(zip(names, free_ports(len(names)), strict=True))


def node_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the trainer image's ENV gives a pod: this venv first on PATH, the repo on PYTHONPATH, offline Hub."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            # The dashboard starts 9 module processes and gives each 30 s to come up; a loaded 2-core
            # machine needs longer (ray/dashboard/consts.py SUBPROCESS_MODULE_WAIT_READY_TIMEOUT).
            "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT": "300",
        }
    )
    env.update(extra or {})
    return env


@dataclass
class LocalRayCluster:
    """A head (dashboard on) and one CPU worker node, each a `ray start --block` process group."""

    temp_dir: Path
    gcs_port: int
    dashboard_port: int
    head_agent_port: int
    worker_agent_port: int
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def probe(self, port: int, path: str) -> subprocess.CompletedProcess[str]:
        """KubeRay's exec probe, as the kubelet runs it in the head container."""
        command = KUBERAY_PROBE.format(port=port, path=path)
        return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30)

    def probe_as_kubelet(self, port: int, path: str) -> subprocess.CompletedProcess[str]:
        """The probe repeated as the kubelet repeats it: the first success, or the last of
        KUBERAY_PROBE_FAILURE_THRESHOLD failures `KUBERAY_PROBE_PERIOD_S` apart (a raylet still
        registering on a loaded machine fails a few probes before it is ready, on a node as here)."""
        for attempt in range(KUBERAY_PROBE_FAILURE_THRESHOLD):
            done = self.probe(port, path)
            if done.returncode == 0:
                return done
            if attempt + 1 < KUBERAY_PROBE_FAILURE_THRESHOLD:
                time.sleep(KUBERAY_PROBE_PERIOD_S)
        return done

    def logs(self, tail: int = 40) -> str:
        """The last lines of every Ray log, for a failure message."""
        out = []
        for path in sorted(self.temp_dir.glob("session_latest/logs/*")):
            if path.is_file() and path.suffix in {".log", ".err", ".out"}:
                lines = path.read_text(errors="replace").splitlines()[-tail:]
                if lines:
                    out.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def stop(self) -> None:
        """SIGTERM each `ray start --block` group (workers first), SIGKILL what is left, then strays by pid."""
        for process in reversed(self.processes):
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for process in reversed(self.processes):
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        for pid in _pids_naming(str(self.temp_dir)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _pids_naming(needle: str) -> list[int]:
    """Processes of this user whose command line contains `needle` (Ray processes carry their temp dir)."""
    found = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline:
            found.append(int(entry.name))
    return found


def _params(params: Mapping[str, str]) -> list[str]:
    """rayStartParams as KubeRay passes them: `--key=value` (values are strings in the CRD)."""
    return [f"--{key}={value}" for key, value in params.items()]


def _wait_until(check, what: str, cluster: LocalRayCluster, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in cluster.processes:
            if process.poll() is not None:
                raise RuntimeError(f"`ray start` exited with {process.returncode} before {what}\n{cluster.logs()}")
        if check():
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s\n{cluster.logs()}")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200 and b"success" in response.read()
    except OSError:
        return False


def _cpus_in_cluster(cluster: LocalRayCluster) -> float:
    try:
        with urllib.request.urlopen(f"{cluster.dashboard_url}/nodes?view=summary", timeout=5) as response:
            import json

            nodes = json.loads(response.read())["data"]["summary"]
    except (OSError, KeyError, ValueError):
        return 0.0
    return sum(
        float(node.get("raylet", {}).get("resourcesTotal", {}).get("CPU", 0))
        for node in nodes
        if node.get("raylet", {}).get("state") == "ALIVE"
    )


@contextlib.contextmanager
def kuberay_like_cluster(
    head_params: Mapping[str, str],
    worker_params: Mapping[str, str],
    worker_cpus: int,
    env: Mapping[str, str] | None = None,
    start_timeout_s: float = 240,
) -> Iterator[LocalRayCluster]:
    """Start the head, wait for KubeRay's probes to pass, start the worker node, yield; always stop."""
    head_params = {**head_params, "dashboard-host": "127.0.0.1"}
    gcs_port, dashboard_port, client_port = free_ports(3)
    head_ports, worker_ports = _node_ports(), _node_ports()
    temp_dir = Path(tempfile.mkdtemp(prefix="rayt", dir="/tmp"))
    cluster = LocalRayCluster(
        temp_dir=temp_dir,
        gcs_port=gcs_port,
        dashboard_port=dashboard_port,
        head_agent_port=head_ports["dashboard-agent-listen-port"],
        worker_agent_port=worker_ports["dashboard-agent-listen-port"],
    )
    common = [
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--temp-dir={temp_dir}",
        f"--object-store-memory={OBJECT_STORE_BYTES}",
        "--disable-usage-stats",
    ]
    head = [
        RAY,
        "start",
        "--head",
        f"--port={gcs_port}",
        f"--dashboard-port={dashboard_port}",
        f"--ray-client-server-port={client_port}",
        *_params({k: str(v) for k, v in head_ports.items()}),
        *common,
        *_params(head_params),
    ]
    worker = [
        RAY,
        "start",
        f"--address=127.0.0.1:{gcs_port}",
        f"--num-cpus={worker_cpus}",
        *_params({k: str(v) for k, v in worker_ports.items()}),
        *common,
        *_params(worker_params),
    ]
    node_env = node_environment(env)
    log = open(temp_dir / "ray-start.log", "ab")  # noqa: SIM115  # closed in finally
    try:
        cluster.processes.append(
            subprocess.Popen(head, env=node_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        _wait_until(
            lambda: (
                _http_ok(f"http://127.0.0.1:{cluster.head_agent_port}/{RAYLET_HEALTH_PATH}")
                and _http_ok(f"{cluster.dashboard_url}/{GCS_HEALTH_PATH}")
            ),
            "the head answers KubeRay's probes",
            cluster,
            start_timeout_s,
        )
        cluster.processes.append(
            subprocess.Popen(worker, env=node_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        _wait_until(lambda: _cpus_in_cluster(cluster) >= worker_cpus, "the worker node joins", cluster, start_timeout_s)
        yield cluster
    finally:
        cluster.stop()
        log.close()
