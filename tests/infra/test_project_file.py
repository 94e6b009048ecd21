"""Pulumi.yaml declares every key the program reads, with a valid type, and nothing else.

The CLI applies these declarations (types, defaults, secret) before the program runs, so a
key missing here or typed differently would behave differently under `pulumi up` than in
these tests.
"""

from __future__ import annotations

from pathlib import Path

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
