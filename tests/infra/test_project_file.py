"""Pulumi.yaml declares every key the program reads, with a valid type, and nothing else.

The CLI applies these declarations (types, defaults, secret) before the program runs, so a
key missing here or typed differently would behave differently under `pulumi up` than in
these tests.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from infra.config import StackConfig, config_keys
from infra.offline.engine import REPO_ROOT, stack_names

PROJECT = yaml.safe_load((REPO_ROOT / "Pulumi.yaml").read_text())
DECLARED = PROJECT["config"]
PULUMI_TYPES = {"string": str, "integer": int, "boolean": bool, "array": list}


class TestProjectFile:
    def test_project_identity(self) -> None:
        assert PROJECT["name"] == "gemma-finetune"
        assert PROJECT["runtime"]["name"] == "python"
        assert PROJECT["runtime"]["options"]["virtualenv"] == ".venv"
        assert PROJECT["main"] == "infra/"
        assert (REPO_ROOT / "infra" / "__main__.py").exists()

    def test_every_program_key_is_declared(self) -> None:
        program_keys = {k for k in config_keys() if not k.startswith("gcp:")}
        assert program_keys == set(DECLARED), (
            f"missing in Pulumi.yaml: {sorted(program_keys - set(DECLARED))}; "
            f"declared but unused: {sorted(set(DECLARED) - program_keys)}"
        )

    def test_declarations_are_valid_pulumi_config_types(self) -> None:
        for key, decl in DECLARED.items():
            assert set(decl) <= {"type", "description", "default", "secret", "items"}, key
            assert decl["type"] in PULUMI_TYPES, f"{key}: Pulumi types are {sorted(PULUMI_TYPES)}"
            assert decl.get("description"), f"{key} has no description"
            if decl["type"] == "array":
                assert decl["items"]["type"] in PULUMI_TYPES, key
            if "default" in decl:
                assert isinstance(decl["default"], PULUMI_TYPES[decl["type"]]), key

    def test_defaults_match_the_typed_config(self) -> None:
        fields = {f.alias or n: f for n, f in StackConfig.model_fields.items()}
        for key, decl in DECLARED.items():
            if "default" not in decl:
                continue
            field = fields[key]
            default = field.get_default(call_default_factory=True)
            assert decl["default"] == (str(default) if hasattr(default, "value") else default), key

    def test_token_is_declared_secret(self) -> None:
        assert DECLARED["hfToken"]["secret"] is True


class TestStackFiles:
    """Every stack file uses only declared keys and never holds a plain token."""

    def test_three_stacks_exist(self) -> None:
        assert {"dev"} <= set(stack_names())

    def test_stack_files_use_declared_keys(self) -> None:
        for stack in stack_names():
            data = yaml.safe_load(Path(REPO_ROOT / f"Pulumi.{stack}.yaml").read_text())
            for key, value in data["config"].items():
                namespace, _, name = key.partition(":")
                assert namespace in {"gemma-finetune", "gcp"}, f"{stack}: {key}"
                if namespace == "gemma-finetune":
                    assert name in DECLARED, f"{stack}: {key} is not declared in Pulumi.yaml"
                    if name == "hfToken":
                        assert isinstance(value, dict) and "secure" in value, f"{stack}: hfToken in plain text"


DESCRIPTION_MAX_CHARS = 120
ADVANCED = "Advanced: "
REFERENCE = REPO_ROOT / "docs" / "program.md"
PROVIDER_KEYS = {"gcp:project", "gcp:region"}
DAY_TWO = ("new run", "restarts run", "run goes on")  # the reference's words, strongest first


def reference_rows() -> dict[str, tuple[bool, list[str]]]:
    """docs/program.md's configuration reference: key -> (in the advanced table, the row's cells after the key)."""
    text = REFERENCE.read_text(encoding="utf-8")
    section = text[
        text.index("## Configuration reference") : text.index("\n## ", text.index("## Configuration reference") + 1)
    ]
    advanced_at = section.index("### Advanced keys")
    rows: dict[str, tuple[bool, list[str]]] = {}
    for match in re.finditer(r"^\| `([\w:]+)` \|(.*)\|$", section, re.MULTILINE):
        key = match.group(1)
        assert key not in rows, f"{key}: two rows in the configuration reference"
        rows[key] = (match.start() > advanced_at, [cell.strip() for cell in match.group(2).split("|")])
    return rows


def planned_day_two() -> dict[str, str]:
    """Each key's strongest effect on a run in the committed day-two table (infra/offline/impact_results.json)."""
    runs: dict[str, set[str]] = {}
    for row in json.loads((REPO_ROOT / "infra" / "offline" / "impact_results.json").read_text())["rows"]:
        runs.setdefault(row["key"], set()).update(cell["run"] for cell in row["cells"].values())
    return {
        key: "new run" if "new run" in seen else "restarts run" if "restarts" in seen else "run goes on"
        for key, seen in runs.items()
    }


class TestDescriptions:
    """`Pulumi.yaml` says what a key is in one line; the detail lives in docs/program.md's reference."""

    def test_every_description_is_one_short_line(self) -> None:
        long = {k: len(d["description"]) for k, d in DECLARED.items() if len(d["description"]) > DESCRIPTION_MAX_CHARS}
        assert long == {}, f"descriptions over {DESCRIPTION_MAX_CHARS} characters: move the detail to docs/program.md"
        assert [k for k, d in DECLARED.items() if "\n" in d["description"].strip()] == []

    def test_the_advanced_keys_are_the_reference_s_advanced_table(self) -> None:
        marked = {k for k, d in DECLARED.items() if d["description"].startswith(ADVANCED)}
        assert marked, "no key is marked advanced"
        assert marked == {k for k, (advanced, _) in reference_rows().items() if advanced}

    def test_no_stack_file_sets_an_advanced_key(self) -> None:
        """An advanced key is one no shipped stack needs: a stack that sets one makes it an everyday key."""
        for stack in stack_names():
            data = yaml.safe_load(Path(REPO_ROOT / f"Pulumi.{stack}.yaml").read_text())
            advanced = {k for k, d in DECLARED.items() if d["description"].startswith(ADVANCED)}
            assert {k.partition(":")[2] for k in data["config"]} & advanced == set(), stack


class TestConfigReference:
    """docs/program.md has a row per key, with the default Pulumi.yaml declares and the day-two effect `make impact`
    planned, so the page a user reads cannot drift from what `pulumi up` does."""

    def test_every_key_has_one_row(self) -> None:
        rows = set(reference_rows())
        assert rows == set(DECLARED) | PROVIDER_KEYS, (
            f"no row: {sorted(set(DECLARED) - rows)}; no such key: {sorted(rows - set(DECLARED) - PROVIDER_KEYS)}"
        )

    def test_each_declared_default_is_the_row_s_default(self) -> None:
        rows = reference_rows()
        for key, decl in DECLARED.items():
            if "default" not in decl:
                continue
            default = decl["default"]
            shown = "[]" if default == [] else str(default).lower() if isinstance(default, bool) else str(default)
            cells = rows[key][1]
            default_cell = cells[1]  # what it sets | default | allowed | …
            assert f"`{shown}`" in default_cell, (
                f"{key}: the reference's default {default_cell!r}, Pulumi.yaml {shown!r}"
            )

    def test_the_day_two_column_is_the_planned_effect(self) -> None:
        rows = reference_rows()
        for key, expected in planned_day_two().items():
            if key not in rows:
                continue  # a what-if of the repository (a trainer pull, a recipe edit), not a key
            cell = rows[key][1][-1]
            said = (
                min((cell.index(word), word) for word in DAY_TWO if word in cell)[1]
                if any(w in cell for w in DAY_TWO)
                else None
            )
            assert said == expected, f"{key}: the reference says {said!r}, the day-two table plans {expected!r}"

    def test_the_check_sees_a_wrong_day_two_word(self, monkeypatch) -> None:
        rows = reference_rows()
        wrong = {k: (adv, [*cells[:-1], "[run goes on][day2]"]) for k, (adv, cells) in rows.items()}
        monkeypatch.setattr(sys.modules[__name__], "reference_rows", lambda: wrong)
        with pytest.raises(AssertionError, match="the reference says 'run goes on', the day-two table plans"):
            self.test_the_day_two_column_is_the_planned_effect()
