"""The user's own recipe in a stack: `pulumi config set recipe path/to/recipe.yaml` (docs/own-data.md).

The file lies anywhere in the repository; it travels in the trainer image as `recipes/<stem>.yaml` (where
`python -m trainer --recipe <stem>` finds it), its bytes count in the run id, and its stem names the runs.
Every test runs the real program under the project's mocks (infra/offline/engine.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from infra.config import ConfigError
from infra.images import STAGED_CONTEXTS, TRAINER, content_hash, stage_context, trainer_spec
from infra.offline.engine import REPO_ROOT, run_stack

TEMPLATE = REPO_ROOT / "trainer/recipes/templates/my-data-dev.yaml"
TICKETS = "trainer/samples/own/tickets-messages.jsonl"


def dev_recipe(data_lines: str = f"path: {TICKETS}\n  eval_rows: 8") -> str:
    """The dev template as a user edits it: their rows, a held-out set that fits them."""
    text = TEMPLATE.read_text()
    text = text.replace("path: gs://your-bucket/my-data/train-*.jsonl", data_lines.split("\n", 1)[0])
    text = text.replace("  rows: 2000", "").replace("  eval_rows: 100", "  " + data_lines.split("\n", 1)[1].strip())
    return text.replace("max_samples: 50", "max_samples: 8").replace("save_steps: 50", "save_steps: 4")


def _rel(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix()


def _job_args(run: object) -> list[str]:
    job = run.one("gcp:cloudrunv2/job:Job").plain_inputs()  # type: ignore[attr-defined]
    return list(job["template"]["template"]["containers"][0]["args"])


def test_a_recipe_file_outside_trainer_recipes_plans(own_dir: Path) -> None:
    (own_dir / "tickets-dev.yaml").write_text(dev_recipe())
    run = run_stack("dev", overrides={"recipe": _rel(own_dir / "tickets-dev.yaml")})
    assert run.cfg is not None and run.cfg.recipe == "tickets-dev"
    assert run.cfg.recipe_file == _rel(own_dir / "tickets-dev.yaml")
    args = _job_args(run)
    assert args[args.index("--recipe") + 1] == "tickets-dev"
    assert any(a.endswith(f"/runs/tickets-dev-{run.outputs['runId']}") for a in args), args


def test_its_content_changes_the_run_id(own_dir: Path) -> None:
    recipe = own_dir / "tickets-dev.yaml"
    recipe.write_text(dev_recipe())
    first = run_stack("dev", overrides={"recipe": _rel(recipe)}).outputs["runId"]
    assert run_stack("dev", overrides={"recipe": _rel(recipe)}).outputs["runId"] == first, "same bytes, same run"
    recipe.write_text(dev_recipe().replace("learning_rate: 2.0e-4", "learning_rate: 1.0e-4"))
    assert run_stack("dev", overrides={"recipe": _rel(recipe)}).outputs["runId"] != first


def test_its_comments_and_layout_are_no_new_run(own_dir: Path) -> None:
    """A reworded comment, a blank line or another key order is the same recipe: no paid run starts for it."""
    recipe = own_dir / "tickets-dev.yaml"
    recipe.write_text(dev_recipe())
    first = run_stack("dev", overrides={"recipe": _rel(recipe)}).outputs["runId"]
    edited = "# my team's copy of the template\n\n" + dev_recipe().replace("# ", "#  ")
    assert edited != dev_recipe()
    recipe.write_text(edited)
    assert run_stack("dev", overrides={"recipe": _rel(recipe)}).outputs["runId"] == first


def test_the_image_context_holds_it_where_the_trainer_finds_it(own_dir: Path, tmp_path: Path) -> None:
    recipe = own_dir / "tickets-dev.yaml"
    recipe.write_text(dev_recipe())
    run = run_stack("dev", overrides={"recipe": _rel(recipe), "imageBuild": "cloud-build"})
    assert run.cfg is not None
    build_env = run.by_name("gft-dev-trainer-cloudbuild").plain_inputs()["environment"]
    assert (Path.cwd() / build_env["CONTEXT"]).resolve() == STAGED_CONTEXTS / "trainer"
    # staged again into a folder of this test's own: another xdist worker may restage the shared one meanwhile
    staged = stage_context(trainer_spec(run.cfg), tmp_path / "contexts")
    assert (staged / "recipes" / "tickets-dev.yaml").read_bytes() == recipe.read_bytes()
    assert (staged / TICKETS.removeprefix("trainer/")).is_file(), "the data it reads is in the context too"
    spec = trainer_spec(run.cfg)
    build = run.by_name("gft-dev-trainer-cloudbuild").plain_inputs()
    assert build["triggers"] == [content_hash(spec)[:16]] and content_hash(spec) != content_hash(TRAINER)


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("absolute", "is not inside this repository"),
        ("data outside trainer", "outside trainer/"),
        ("bad stem", "lowercase letters"),
        ("shipped name", "has the name of the shipped recipe"),
        ("missing", "no such file"),
    ],
)
def test_a_recipe_file_that_cannot_travel_is_a_config_error(own_dir: Path, where: str, message: str) -> None:
    name = {"bad stem": "Tickets_Dev.yaml", "shipped name": "emoji-gemma3-1b.yaml"}.get(where, "tickets-dev.yaml")
    recipe = own_dir / name
    text = dev_recipe()
    if where == "data outside trainer":
        shutil.copyfile(REPO_ROOT / TICKETS, own_dir / "tickets.jsonl")
        text = text.replace(f"path: {TICKETS}", f"path: {_rel(own_dir / 'tickets.jsonl')}")
    if where != "missing":
        recipe.write_text(text)
    value = str(recipe) if where == "absolute" else _rel(recipe)
    with pytest.raises(ConfigError, match=message) as raised:
        run_stack("dev", overrides={"recipe": value})
    assert "Fix:" in str(raised.value)


def test_bucket_data_without_rows_is_a_config_error(own_dir: Path) -> None:
    """Counting the rows of gs:// data at load needs gcsfs and a read grant, which a plan does not have."""
    recipe = own_dir / "tickets-dev.yaml"
    recipe.write_text(dev_recipe("path: gs://team-data/tickets/*.jsonl\n  eval_rows: 8"))
    with pytest.raises(ConfigError, match=r"without data\.rows") as raised:
        run_stack("dev", overrides={"recipe": _rel(recipe)})
    assert "Fix: data.rows: N" in str(raised.value)
    plans = run_stack("dev", overrides={"recipe": _rel(recipe), "recipeOverrides": ["data.rows=64"]})
    assert plans.cfg is not None and plans.cfg.recipe == "tickets-dev"


def test_data_in_two_buckets_is_a_config_error_that_names_every_key(own_dir: Path) -> None:
    """A stack grants read access on one data bucket; the held-out file (or a source) in another one is refused,
    and the fix names the keys that can point there (not data.path and data.image_dir alone)."""
    recipe = own_dir / "tickets-dev.yaml"
    recipe.write_text(dev_recipe("path: gs://team-data/tickets/*.jsonl\n  rows: 64"))
    with pytest.raises(ConfigError, match=r"reads data from 2 buckets \(team-data, team-eval\)") as raised:
        run_stack(
            "dev",
            overrides={"recipe": _rel(recipe), "recipeOverrides": ["data.eval_path=gs://team-eval/held-out.jsonl"]},
        )
    assert "Fix: keep data.path, every data.sources path, data.eval_path and data.image_dir in one bucket" in str(
        raised.value
    )


def _data_grants(run: object) -> dict[tuple[str, ...], str]:
    """The trainer's read grants on the data bucket: the IAM binding each one makes -> the resource's name."""
    grants = {}
    for grant in run.of_type("gcp:storage/bucketIAMMember:BucketIAMMember"):  # type: ignore[attr-defined]
        if "-data-read-" in grant.name:
            inputs = grant.plain_inputs()
            condition = inputs.get("condition") or {}
            key = (inputs["bucket"], inputs["role"], inputs["member"], condition.get("expression", ""))
            grants[key] = grant.name
    return grants


def test_adding_a_held_out_file_keeps_the_training_datas_read_grant(own_dir: Path) -> None:
    """Why: one grant per prefix, named by its place in the sorted prefixes, moved the training data's binding to
    another resource when a held-out file sorted before it. The provider's delete of the replaced resource removes
    its binding (terraform-provider-google tpgiamresource/resource_iam_member.go resourceIamMemberDelete,
    subtractFromBindings), and Pulumi deletes replaced resources last: the binding the other resource had just
    'created' (already there) was gone, and the new run could not read its data. One grant per bucket, covering
    every prefix, never leaves a binding to another resource."""
    recipe = own_dir / "tickets-dev.yaml"
    recipe.write_text(dev_recipe("path: gs://team-data/tickets/*.jsonl\n  rows: 64"))
    before = _data_grants(run_stack("dev", overrides={"recipe": _rel(recipe)}))
    held_out = ["data.eval_rows=0", "data.eval_path=gs://team-data/held/eval.jsonl"]
    after = _data_grants(run_stack("dev", overrides={"recipe": _rel(recipe), "recipeOverrides": held_out}))
    moved = {key: (before[key], after[key]) for key in before.keys() & after.keys() if before[key] != after[key]}
    assert not moved, f"a binding changed resources (the old one's delete removes it): {moved}"
    (expression,) = [key[3] for key in after]
    assert "objects/tickets/'" in expression and "objects/held/eval.jsonl'" in expression
    # a stack whose data has one prefix keeps the very grant it has (no replacement on the next `up`)
    assert [key[3] for key in before] == [
        "resource.name.startsWith('projects/_/buckets/team-data/objects/tickets/') || "
        "api.getAttribute('storage.googleapis.com/objectListPrefix', '').startsWith('tickets/')"
    ]
    assert list(before.values()) == list(after.values()) == ["gft-dev-data-read-0"]


@pytest.mark.parametrize(
    ("stack", "template", "output"),
    [
        ("a4-gemma4", "my-data-a4-gemma4.yaml", "jobName"),
        ("ray-gemma3-vision", "my-data-ray-vision.yaml", "rayJobName"),
    ],
)
def test_the_gke_run_names_follow_the_file(own_dir: Path, stack: str, template: str, output: str) -> None:
    recipe = own_dir / template.replace("my-data", "team")
    recipe.write_text((REPO_ROOT / "trainer/recipes/templates" / template).read_text())
    first = run_stack(stack, overrides={"recipe": _rel(recipe)}).outputs[output]
    assert recipe.stem in first or recipe.stem[:20] in first, first
    recipe.write_text(recipe.read_text().replace("seed: 42", "seed: 7"))
    assert run_stack(stack, overrides={"recipe": _rel(recipe)}).outputs[output] != first


def test_a_prebuilt_image_cannot_carry_a_recipe_file(own_dir: Path) -> None:
    from tests.infra.conftest import PREBUILT

    (own_dir / "tickets-dev.yaml").write_text(dev_recipe())
    with pytest.raises(ConfigError, match="only an image this stack builds carries") as raised:
        run_stack("dev", overrides={"recipe": _rel(own_dir / "tickets-dev.yaml"), **PREBUILT})
    assert "Fix: pulumi config set imageBuild cloud-build" in str(raised.value)


@pytest.mark.parametrize(
    "override",
    ["data.eval_path={file}", "data.path={file}"],
)
def test_an_override_that_points_the_data_outside_trainer_is_a_config_error(own_dir: Path, override: str) -> None:
    """Why: the check that a recipe's local data travels in the image read the recipe file without its overrides,
    so `recipeOverrides=[data.eval_path=...]` naming a file outside trainer/ planned, and the job stopped at start
    (no such file in the image) after a GPU was rented."""
    held = own_dir / "held-out.jsonl"
    shutil.copyfile(REPO_ROOT / TICKETS, held)
    recipe = own_dir / "tickets-dev.yaml"
    recipe.write_text(dev_recipe())
    overrides = ["data.eval_rows=0", override.format(file=_rel(held))]
    with pytest.raises(
        ConfigError, match=r"recipeOverrides make recipe 'tickets-dev' read .*held-out\.jsonl, outside trainer/"
    ) as raised:
        run_stack("dev", overrides={"recipe": _rel(recipe), "recipeOverrides": overrides})
    assert "Fix:" in str(raised.value)
    inside = ["data.eval_rows=0", override.format(file=TICKETS)]
    assert run_stack("dev", overrides={"recipe": _rel(recipe), "recipeOverrides": inside}).cfg is not None
