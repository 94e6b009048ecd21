"""Any Gemma size the stack's GPUs can hold: the stack's configuration check refuses a run that does not fit, with
settings that make it fit, before any resource is declared; `make plan` prints the verdict of one that does.

Every case goes through the real configuration validation (infra/config.py `validate`) or the real program under
the project's mocks (infra/offline/engine.py `run_stack`, `infra.offline.plan.main`). The memory model itself is
tests/trainer/test_memory_plan.py and tests/trainer/test_model_memory.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from infra.config import ConfigError, validate
from infra.offline import plan
from infra.offline.engine import REPO_ROOT, project_defaults, run_stack, stack_file_config
from tests.infra.test_own_recipe import dev_recipe

GEMMA3_27B = "model.name_or_path=google/gemma-3-27b-it"


def stack_raw(stack: str, **changes: Any) -> dict[str, Any]:
    """A stack's configuration as `pulumi up` reads it (Pulumi.yaml defaults + the stack file), with changes."""
    values = {**project_defaults(), **stack_file_config(stack)}
    raw = {k.removeprefix("gemma-finetune:"): v for k, v in values.items() if not isinstance(v, dict)}
    return {**raw, **changes}


def refused(stack: str, **changes: Any) -> str:
    with pytest.raises(ConfigError) as info:
        validate(stack_raw(stack, **changes), stack, hf_token_set=True)
    return str(info.value)


def apply_fix(raw: dict[str, Any], fix: str) -> dict[str, Any]:
    """What the fix's commands set: `pulumi config set KEY VALUE` and `--path 'recipeOverrides[N]' VALUE`."""
    raw = {**raw, "recipeOverrides": list(raw.get("recipeOverrides", []))}
    for command in fix.split(" && "):
        path = re.match(r"pulumi config set --path 'recipeOverrides\[(\d+)\]' (\S+)", command)
        if path:
            assert int(path.group(1)) == len(raw["recipeOverrides"]), command
            raw["recipeOverrides"].append(path.group(2))
            continue
        key, value = re.match(r"pulumi config set (\S+) (\S+)", command).groups()  # type: ignore[union-attr]
        raw[key] = int(value) if value.isdigit() else value
    return raw


def fixes_of(message: str) -> list[str]:
    """Each fix of a refusal, without its estimate: the commands joined by ' && '."""
    tail = message.split("Fix: ", 1)[1]
    return [re.sub(r" \(~\d+ GB of \d+ usable\).*$", "", part, flags=re.DOTALL) for part in tail.split("; or ")]


def test_gemma3_27b_on_the_dev_l4_is_refused_with_fixes_that_fit() -> None:
    raw = stack_raw("dev", recipeOverrides=[GEMMA3_27B])
    message = refused("dev", recipeOverrides=[GEMMA3_27B])
    assert "recipe 'emoji-gemma3-1b' does not fit 1 x nvidia-l4 (nodes=1 x gpusPerNode=1)" in message
    assert "google/gemma-3-27b-it (27.43B params, 4-bit QLoRA) on 1 x L4 (24 GB): strategy none" in message
    assert "~74 GB of 22 usable" in message and "frozen weights 17.7" in message
    fixes = fixes_of(message)
    assert fixes[0] == "pulumi config set gpuType nvidia-rtx-pro-6000", message
    for fix in fixes:  # every fix offered makes the stack valid
        cfg = validate(apply_fix(raw, fix), "dev", hf_token_set=True)
        assert cfg.gpu_type in {"nvidia-l4", "nvidia-rtx-pro-6000"}


def test_the_same_through_make_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`make plan STACK=dev SET='recipeOverrides=["model.name_or_path=google/gemma-3-27b-it"]'`."""
    code = plan.main(["--stack", "dev", "--set", f'recipeOverrides=["{GEMMA3_27B}"]', "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "dev").exists()
    assert "has invalid configuration (nothing was created)" in err and "does not fit 1 x nvidia-l4" in err
    assert "Fix: pulumi config set gpuType nvidia-rtx-pro-6000" in err


def test_a_users_recipe_file_naming_gemma3_27b_on_dev_is_refused(own_dir: Path) -> None:
    text = dev_recipe().replace("google/gemma-3-1b-it", "google/gemma-3-27b-it")  # the template, on the tickets
    recipe = own_dir / "tickets-27b.yaml"
    recipe.write_text(text)
    with pytest.raises(ConfigError, match=r"recipe 'tickets-27b' does not fit 1 x nvidia-l4") as info:
        run_stack("dev", overrides={"recipe": recipe.relative_to(REPO_ROOT).as_posix()})
    assert "google/gemma-3-27b-it (27.43B params, 4-bit QLoRA)" in str(info.value)
    assert "Fix: pulumi config set gpuType nvidia-rtx-pro-6000" in str(info.value)
    # the 1B of the template as shipped fits the same stack
    recipe.write_text(text.replace("google/gemma-3-27b-it", "google/gemma-3-1b-it"))
    run = run_stack("dev", overrides={"recipe": recipe.relative_to(REPO_ROOT).as_posix()})
    assert run.cfg is not None and run.cfg.recipe == "tickets-27b"


def test_a_fitting_run_plans_and_make_plan_prints_the_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Gemma 3 4B with QLoRA fits the dev L4 once it checkpoints; the plan says so beside the cost."""
    sets = ["model.name_or_path=google/gemma-3-4b-it", "training.gradient_checkpointing=true"]
    args = ["--stack", "dev", "--set", f"recipeOverrides={json.dumps(sets)}", "--out", str(tmp_path)]
    assert plan.main(args) == 0
    out = capsys.readouterr().out
    memory = out.split("Memory (per GPU, trainer/memory_plan.py):\n", 1)[1].splitlines()[0]
    assert "google/gemma-3-4b-it (4.30B params, 4-bit QLoRA) on 1 x L4 (24 GB): strategy none" in memory
    assert re.search(r"~\d+ GB of 22 usable", memory), memory
    assert (tmp_path / "dev" / "resources.json").is_file()
    message = refused("dev", recipeOverrides=sets[:1])  # without checkpointing: ~68 GB
    assert fixes_of(message)[1] == "pulumi config set --path 'recipeOverrides[1]' training.gradient_checkpointing=true"


def test_the_shipped_stacks_print_their_strategy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert plan.main(["--stack", "a4-gemma4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "google/gemma-4-31B-it (30.70B params, bf16 LoRA) on 8 x B200 (180 GB): strategy ddp (DDP over LoRA)" in out


def test_w1_on_h100_needs_its_gpu_named_then_fits_one_of_the_ways_offered() -> None:
    message = refused("a4-gemma4", gpuType="nvidia-h100-80gb")
    assert "sizes its run for distributed.gpu=b200, but this stack trains on gpuType=nvidia-h100-80gb (h100)" in message
    assert "Fix: pulumi config set --path 'recipeOverrides[0]' distributed.gpu=h100" in message
    raw = stack_raw("a4-gemma4", gpuType="nvidia-h100-80gb", recipeOverrides=["distributed.gpu=h100"])
    message = refused("a4-gemma4", **{k: raw[k] for k in ("gpuType", "recipeOverrides")})
    assert "does not fit 8 x nvidia-h100-80gb (nodes=1 x gpusPerNode=8)" in message
    assert "strategy fsdp (FSDP resharded after forward), ~74 GB of 72 usable" in message
    fixes = fixes_of(message)
    assert (
        "pulumi config set nodes 2 && pulumi config set --path 'recipeOverrides[1]' distributed.world_size=16" in fixes
    )
    assert "pulumi config set --path 'recipeOverrides[1]' training.gradient_checkpointing=true" in fixes
    for fix in fixes:
        assert validate(apply_fix(raw, fix), "a4-gemma4", hf_token_set=True).gpu_type in {
            "nvidia-h100-80gb",
            "nvidia-rtx-pro-6000",
        }


def test_an_explicit_strategy_that_does_not_fit_gets_the_stack_fixes() -> None:
    sets = ["distributed.strategy=ddp", "training.max_length=4096", "training.gradient_accumulation_steps=4"]
    message = refused("a4-gemma4", recipeOverrides=sets)
    assert "strategy ddp (DDP over LoRA), ~276 GB of 162 usable" in message
    assert "Fix: pulumi config set --path 'recipeOverrides[3]' training.gradient_checkpointing=true" in message


def test_an_unknown_remote_model_is_refused_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    message = refused("dev", recipeOverrides=["model.name_or_path=someone/gemma-3-9b-custom"])
    assert (
        "model.name_or_path='someone/gemma-3-9b-custom': someone/gemma-3-9b-custom is not a Gemma the memory" in message
    )
    assert "so whether it fits 1 x nvidia-l4 (nodes=1 x gpusPerNode=1) cannot be checked" in message
    assert (
        "Fix: a Gemma the memory model knows" in message
        and "`hf download someone/gemma-3-9b-custom config.json`" in message
        and "pulumi config set preflight warn" in message
    )


def test_preflight_warn_lets_an_unknown_model_through_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CI runner has no Hugging Face cache: with `preflight: warn` the unknown model is planned, and said unchecked."""
    import pulumi

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    warned: list[str] = []
    monkeypatch.setattr(pulumi.log, "warn", lambda message, *args, **kwargs: warned.append(message))
    overrides = {"recipeOverrides": ["model.name_or_path=someone/gemma-3-9b-custom"], "preflight": "warn"}
    run = run_stack("dev", overrides=overrides)
    assert any(r.type == "gcp:cloudrunv2/job:Job" for r in run.resources)
    assert [m for m in warned if m.startswith("memory per GPU not checked: someone/gemma-3-9b-custom: ")], warned


def test_an_unknown_local_model_folder_is_read_from_its_config_json(tmp_path: Path) -> None:
    config = {"model_type": "gemma3_text", "hidden_size": 3072, "intermediate_size": 12288, "num_hidden_layers": 40,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 192, "vocab_size": 262144}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = f"model.name_or_path={tmp_path}"
    message = refused("dev", recipeOverrides=[model])  # emoji-gemma3-1b's 2 x 512 tokens, no checkpointing
    assert f"{tmp_path} (6.47B params, 4-bit QLoRA) on 1 x L4 (24 GB)" in message and "~34 GB of 22" in message
    checkpointing = [model, "training.gradient_checkpointing=true"]
    cfg = validate(stack_raw("dev", recipeOverrides=checkpointing), "dev", hf_token_set=True)
    assert cfg.recipe_overrides == checkpointing


def test_preview_logs_the_verdict_of_a_run_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pulumi preview` / `up` run the same program: it logs the verdict once the configuration has passed."""
    import pulumi

    logged: list[str] = []
    monkeypatch.setattr(pulumi.log, "info", lambda message, *args, **kwargs: logged.append(message))
    run_stack("ray-gemma3-vision")
    memory = [m for m in logged if m.startswith("memory per GPU: ")]
    assert len(memory) == 1, logged
    assert memory[0].startswith(
        "memory per GPU: google/gemma-3-4b-it (4.30B params, 4-bit QLoRA) on 16 x B200 (180 GB): strategy none "
        "(one replica per GPU), "
    )
    assert re.search(r"~\d+ GB of 162 usable \(frozen weights 3\.3, ", memory[0]), memory[0]
