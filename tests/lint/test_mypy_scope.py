"""mypy follows the Pulumi SDK modules infra uses, and only those (pyproject.toml [tool.mypy.overrides]).

`make test` type-checks infra/ against pulumi_gcp and pulumi_kubernetes so a misspelt resource argument
fails offline; the other ~180 services of those SDKs are skipped (typed Any) to keep a cold run short.
A service infra starts to use must be added to the followed list, or its arguments go unchecked.
"""

from __future__ import annotations

import ast
import tomllib

from infra.offline.engine import REPO_ROOT

SDKS = ("pulumi_gcp", "pulumi_kubernetes")


def follow_mode(module: str, overrides: list[dict]) -> str:
    """mypy's choice for `module`: the most specific matching override wins (exact name over pattern)."""
    best: tuple[int, str] | None = None
    for override in overrides:
        if "follow_imports" not in override:
            continue
        patterns = override["module"] if isinstance(override["module"], list) else [override["module"]]
        for pattern in patterns:
            if pattern == module:
                rank = 10_000
            elif pattern.endswith(".*") and (module == pattern[:-2] or module.startswith(pattern[:-1])):
                rank = pattern.count(".")
            else:
                continue
            if best is None or rank > best[0]:
                best = (rank, override["follow_imports"])
    return "normal" if best is None else best[1]


def _sdk(name: str) -> bool:
    return name.split(".", 1)[0] in SDKS


def _is_module(part: str) -> bool:
    """SDK modules are lower-case names (`storage`, `v1`); classes and `get_*` functions end a chain."""
    return part.islower() and not part.startswith(("get_", "_"))


def sdk_modules_in(source: str) -> set[str]:
    """Every SDK module a Python source reaches: imported in any form, or named through an alias,
    in code or in a string annotation (`"gcp.dns.ManagedZone"`)."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # a name bound in the module -> the SDK module it stands for
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _sdk(alias.name):
                    used.add(alias.name)
                    bound = alias.asname or alias.name.split(".", 1)[0]
                    aliases[bound] = alias.name if alias.asname else bound
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _sdk(node.module):
            used.add(node.module)
            for alias in node.names:
                if _is_module(alias.name):
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    expressions: list[ast.AST] = [tree]
    for node in ast.walk(tree):  # string annotations are expressions too
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                expressions.append(ast.parse(node.value, mode="eval"))
            except SyntaxError:
                continue
    for expression in expressions:
        for node in ast.walk(expression):
            if not isinstance(node, ast.Attribute):
                continue
            chain: list[str] = []
            current: ast.expr = node
            while isinstance(current, ast.Attribute):
                chain.insert(0, current.attr)
                current = current.value
            if isinstance(current, ast.Name) and current.id in aliases:
                module = aliases[current.id]
                for part in chain:
                    if not _is_module(part):
                        break
                    module = f"{module}.{part}"
                used.add(module)
    for name in list(aliases.values()):
        used.add(name)
    return used


def sdk_modules_infra_names() -> dict[str, set[str]]:
    """`pulumi_gcp.storage`, `pulumi_kubernetes.core.v1`, ...: each SDK module infra reaches, with its files."""
    used: dict[str, set[str]] = {}
    for path in sorted((REPO_ROOT / "infra").rglob("*.py")):
        for module in sdk_modules_in(path.read_text()):
            used.setdefault(module, set()).add(str(path.relative_to(REPO_ROOT)))
    return used


def test_the_scan_finds_every_way_of_naming_a_module() -> None:
    source = """
import pulumi_gcp as gcp
import pulumi_gcp.pubsub
import pulumi_kubernetes.apps.v1 as apps
from pulumi_gcp import bigquery
from pulumi_gcp.dns import ManagedZone
from pulumi_kubernetes.core import v1 as core

def f(zone: "gcp.dns.ManagedZone") -> None:
    gcp.storage.Bucket("b")
    gcp.get_project()
    pulumi_gcp.pubsub.Topic("t")
    apps.Deployment("d")
    bigquery.Dataset("d")
    core.Pod("p")
    gcp.Provider("p")
"""
    assert sdk_modules_in(source) == {
        "pulumi_gcp", "pulumi_gcp.pubsub", "pulumi_kubernetes.apps.v1", "pulumi_gcp.bigquery", "pulumi_gcp.dns",
        "pulumi_kubernetes.core", "pulumi_kubernetes.core.v1", "pulumi_gcp.storage",
    }  # fmt: skip


def test_every_sdk_module_infra_uses_is_followed() -> None:
    overrides = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    used = sdk_modules_infra_names()
    assert {"pulumi_gcp.storage", "pulumi_kubernetes.core.v1"} <= set(used), sorted(used)
    skipped = {module: files for module, files in used.items() if follow_mode(module, overrides) != "normal"}
    assert not skipped, f"add these to the followed list in pyproject.toml [tool.mypy.overrides]: {skipped}"


def test_the_other_services_are_skipped() -> None:
    overrides = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    assert follow_mode("pulumi_gcp.bigquery", overrides) == "skip"
    assert follow_mode("pulumi_gcp.bigquery.dataset", overrides) == "skip"
    assert follow_mode("pulumi_kubernetes.apps.v1", overrides) == "skip"
    assert follow_mode("pulumi_gcp", overrides) == "normal"
    assert follow_mode("pulumi_gcp.provider", overrides) == "normal", "gcp.Provider: __init__ re-exports it"
    assert follow_mode("pulumi_gcp.storage.bucket", overrides) == "normal"
    assert follow_mode("transformers.trainer", overrides) == "skip"
    assert follow_mode("pulumi", overrides) == "normal"


def test_follow_mode_reads_patterns_as_mypy_does() -> None:
    overrides = [
        {"module": ["a.*"], "follow_imports": "skip"},
        {"module": ["a", "a.b.*"], "follow_imports": "normal"},
    ]
    assert follow_mode("a", overrides) == "normal"  # the exact name beats a.*
    assert follow_mode("a.c", overrides) == "skip"
    assert follow_mode("a.b", overrides) == "normal" and follow_mode("a.b.c.d", overrides) == "normal"
    assert follow_mode("ab", overrides) == "normal"  # a.* is not a prefix match of ab
