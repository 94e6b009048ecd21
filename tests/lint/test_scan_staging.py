"""`make test` runs the scanners' plans (.ci/scan.py) beside pytest's workers, and both stage the images' build
contexts into build/image-context (infra/images.py `stage_context`: remove, then copy). Run at once, one removed the
other's files and the scan died with FileNotFoundError. Both now take one lock (infra/offline/staging.py): while a
worker holds it, the scan's plans wait instead of planning.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import time
from pathlib import Path

from infra.offline.staging import LOCK

REPO_ROOT = Path(__file__).resolve().parents[2]
SCAN_PLANS = "import sys; sys.path.insert(0, '.ci'); import scan; from pathlib import Path; scan.rendered_manifests(Path(sys.argv[1]))"


def test_the_scans_plans_wait_while_a_worker_stages(tmp_path: Path) -> None:
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a test worker in the middle of staging
        scan = subprocess.Popen([sys.executable, "-c", SCAN_PLANS, str(tmp_path)], cwd=REPO_ROOT)
        try:
            time.sleep(8)  # imports, then the first stack's plan: it stages the images first
            assert scan.poll() is None, "the scan ended while the staging folder was in use"
            planned = list((tmp_path / "plan").glob("*/resources.json"))
            assert planned == [], f"the scan planned a stack while a worker staged: {planned}"
        finally:
            scan.kill()
            scan.wait()
