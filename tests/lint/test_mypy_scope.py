"""mypy follows the Pulumi SDK modules infra uses, and only those (pyproject.toml [tool.mypy.overrides]).

`make test` type-checks infra/ against pulumi_gcp and pulumi_kubernetes so a misspelt resource argument
fails offline; the other ~180 services of those SDKs are skipped (typed Any) to keep a cold run short.
A service infra starts to use must be added to the followed list, or its arguments go unchecked.
"""

from __future__ import annotations

import ast
import tomllib

from infra.offline import REPO_ROOT

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


def sdk_modules_infra_names() -> dict[str, set[str]]:
    """`pulumi_gcp.storage`, `pulumi_kubernetes.core.v1`, ...: each SDK module infra reaches through an alias."""
    used: dict[str, set[str]] = {}
    for path in sorted((REPO_ROOT / "infra").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases = {
            alias.asname or alias.name: alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
            if alias.name in SDKS
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            chain: list[str] = []
            current: ast.expr = node
            while isinstance(current, ast.Attribute):
                chain.insert(0, current.attr)
                current = current.value
            if isinstance(current, ast.Name) and current.id in aliases:
                module = aliases[current.id]
                for part in chain:  # lower-case parts are modules, a class or function ends the chain
                    if not part.islower() or part.startswith("get_"):
                        break
                    module = f"{module}.{part}"
                used.setdefault(module, set()).add(f"{path.relative_to(REPO_ROOT)}")
    return used


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
