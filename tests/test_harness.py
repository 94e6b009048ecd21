"""What tests/conftest.py does to every test process besides scheduling: the collector is off only while collecting.

Why it matters: a run whose collector stayed off would keep every cyclic object the tests make (models, servers'
clients, Pulumi resources) until the worker exits.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_the_collector_is_on_during_the_tests_and_collection_left_its_objects_frozen() -> None:
    assert gc.isenabled(), "tests/conftest.py did not turn the garbage collector back on after collection"
    assert gc.get_freeze_count() > 10_000, "the objects alive after collection were not frozen"


def test_the_collector_is_on_in_xdists_controller_too(tmp_path: Path) -> None:
    """xdist's controller never collects, so `pytest_collection_finish` never turns its collector back on."""
    report = tmp_path / "controller.txt"
    (tmp_path / "controller_probe.py").write_text(
        "import gc, os\n"
        "def pytest_unconfigure(config):\n"
        "    if not hasattr(config, 'workerinput'):\n"
        f"        open({str(report)!r}, 'w').write(str(gc.isenabled()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider", "-p", "controller_probe",
         "tests/test_harness.py::test_the_collector_is_on_during_the_tests_and_collection_left_its_objects_frozen"],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert report.read_text() == "True", "the controller's collector stayed off for the whole run"
