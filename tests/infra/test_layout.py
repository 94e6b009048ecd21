"""`infra/` is the program and `infra/offline/` the tools beside it: `pulumi up` never imports the tools.

The import graph is read statically from every `import` in the program's modules (those inside
functions too), starting at `infra/__main__.py`, the file the Pulumi language host runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

from infra.offline.engine import REPO_ROOT

LOCAL_PACKAGES = ("infra", "trainer", "serving", "demo")


def module_file(name: str) -> Path | None:
    base = REPO_ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in LOCAL_PACKAGES and module_file(name)}


def program_modules() -> set[str]:
    seen: set[str] = set()
    todo = ["infra.__main__"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        file = module_file(name)
        assert file is not None, name
        todo.extend(imported_modules(file) - seen)
    return seen


def test_pulumi_up_never_imports_the_offline_tools_or_the_demo() -> None:
    modules = program_modules()
    assert {"infra.program", "infra.cloud_run", "infra.gke_job", "infra.ray_job", "trainer.recipe"} <= modules
    assert sorted(m for m in modules if m.startswith(("infra.offline", "demo"))) == []


def test_the_check_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    """The check can fail: an import of the mock engine in a function body is found."""
    module = tmp_path / "program.py"
    module.write_text("def run():\n    from infra.offline.engine import run_stack\n    return run_stack\n")
    assert "infra.offline.engine" in imported_modules(module)


GKE_WORKLOADS = ("infra.gke_job", "infra.ray_job")
GKE_SHARED = ("infra.gke_workload", "infra.gke")


def test_gke_workloads_call_down_into_the_shared_modules_only() -> None:
    """Each GKE workload reads as one flow that calls down: the shared modules import no workload, and
    neither workload imports the other (a constant both need lives in `infra.gke_workload`)."""
    for shared in GKE_SHARED:
        file = module_file(shared)
        assert file is not None, shared
        assert sorted(imported_modules(file) & set(GKE_WORKLOADS)) == [], f"{shared} imports a workload"
    for workload in GKE_WORKLOADS:
        file = module_file(workload)
        assert file is not None, workload
        others = set(GKE_WORKLOADS) - {workload}
        assert sorted(imported_modules(file) & others) == [], f"{workload} imports the other workload"
        assert "infra.gke_workload" in imported_modules(file)
