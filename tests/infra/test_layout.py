"""`infra/` is the program and `infra/offline/` the tools beside it: `pulumi up` never imports the tools.

The import graph is read statically from every `import` in the program's modules (those inside
functions too), starting at `infra/__main__.py`, the file the Pulumi language host runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

from infra.offline.engine import REPO_ROOT
from tests.infra.test_ordering import ancestors  # every node a node reaches in a graph

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


# --------------------------------------------------------------------------------------
# The trainer's modules import in one direction: a lower module knows nothing of a higher one


def local_import_graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (anywhere in the file), for every module of the package."""
    modules = {f"{package}.{path.stem}" for path in (REPO_ROOT / package).glob("*.py")}
    graph = {}
    for name in modules:
        file = module_file(name)
        assert file is not None, name
        graph[name] = (imported_modules(file) & modules) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for child in sorted(graph.get(node, ())):
            if state.get(child) == 1:
                return [*path[path.index(child) :], child]
            if child not in state and (found := visit(child)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_trainer_modules_have_no_import_circle() -> None:
    cycle = find_cycle(local_import_graph("trainer"))
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_check_finds_a_circle_and_the_floor_modules_import_nothing_above() -> None:
    """The check can fail: a circle through three modules is found; and the floor is where the graph says."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    graph = local_import_graph("trainer")
    assert graph["trainer.errors"] == set() and graph["trainer.data_files"] == {"trainer.errors"}
    assert "trainer.data" not in ancestors(graph, "trainer.recipe")  # the schema counts rows without the loader


def test_the_training_path_never_imports_the_local_model_builder() -> None:
    """`local:gemma3-270m` is built by the entry points and the demo; training, evaluation and export find it."""
    graph = local_import_graph("trainer")
    for start in ("trainer.train", "trainer.ray_entry", "trainer.evaluate", "trainer.export", "trainer.data"):
        assert "trainer.local_model" not in ancestors(graph, start), start
