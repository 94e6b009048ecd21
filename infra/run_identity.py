"""A training run's identity: what makes `pulumi up` start a paid run, and the one line that says whether it does.

Decisions (why and sources: docs/program.md#a-paid-run-only-when-asked)
- A run is named by what the user asks for: the recipe's content (its base model among them; not its comments
  or layout), the bytes of the repository data files it reads, the overrides, and `runGeneration`. Not the
  trainer image: pulling an
  update of trainer/ trains no finished run again (a run under way restarts on it, from its checkpoint), and not
  where the run's pods go (capacity, GPU type: a moved run resumes its checkpoints).
- Each run's folder holds `_RUN_KEY.json`, written by the program and kept by `destroy`: the key it started for.
  The run of the stack's key is the folder whose record says so, else a new folder named by the key.
- Run folders without a record were named by an earlier version of the program (from the image's content): the
  first `up` after it takes the newest of them as the stack's run, so a finished run stays finished and a
  running one keeps its name. From then on the record decides.
- `RunState.line()`, printed by the preview: whether this `up` starts a paid run, why, how to ask for one.
Not here: data in a bucket (unread: announce new files with `runGeneration` or a new `data.path`), manifests.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pulumi
import pulumi_gcp as gcp

from infra.config import StackConfig, Workload
from infra.foundation import RUN_MARKER, bucket_name
from trainer.cost_line import PRICE_FILE
from trainer.recipe import REPO_ROOT, parse_recipe, recipe_content_sha256

RUNS_PREFIX = "runs"
RUN_KEY_FILE = "_RUN_KEY.json"
# How each workload names a run's folder (and, on GKE, its Job or RayJob): `<stem>-<key prefix>`.
GKE_JOB_PREFIX, GKE_JOB_NAME_MAX = "train", 56  # Indexed pods are `<job>-<index>` hostnames (63 characters)
GKE_RAY_PREFIX, GKE_RAY_NAME_MAX = "ft", 40
GKE_KEY_DIGITS, CLOUD_RUN_KEY_DIGITS = 8, 12
RUN_GENERATION_KEY = "runGeneration"
GKE_WORKLOAD_KIND = {Workload.GKE_JOB: "Job", Workload.GKE_RAY: "RayJob"}
RECORD_RESOURCE = "run-key"  # the record's resource is `<stack base>-run-key-<run>`


def recipe_digest(cfg: StackConfig) -> str:
    """sha256 of what the recipe file says, parsed (a shipped name or the user's file): comments do not count."""
    return recipe_content_sha256(cfg.recipe_source)


def data_digest(cfg: StackConfig) -> str:
    """sha256 over the repository files the recipe's data needs (names and bytes), "" when it reads none (Hub, URL)."""
    files: list[Path] = []
    for needed in parse_recipe(cfg.recipe_source, cfg.recipe_overrides).data.repository_files():
        files += sorted(p for p in needed.rglob("*") if p.is_file()) if needed.is_dir() else [needed]
    if not files:
        return ""
    digest = hashlib.sha256()
    for path in files:
        name = path.resolve().relative_to(REPO_ROOT.resolve()) if path.resolve().is_relative_to(REPO_ROOT) else path
        digest.update(Path(name).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def run_inputs(cfg: StackConfig) -> dict[str, Any]:
    """Everything a run is the run of; a change to any of these is a new run."""
    return {
        "recipe": cfg.recipe,
        "recipe_sha256": recipe_digest(cfg),
        "data_sha256": data_digest(cfg),
        "overrides": list(cfg.recipe_overrides),
        "generation": cfg.run_generation,
    }


def run_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class RunNaming:
    """A workload's run folder names under runs/: `<stem>-<first digits of the key>`."""

    stem: str
    digits: int

    def name(self, key: str) -> str:
        return f"{self.stem}-{key[: self.digits]}"

    def matches(self, folder: str) -> bool:
        return re.fullmatch(rf"{re.escape(self.stem)}-[0-9a-f]{{{self.digits}}}", folder) is not None


def naming(cfg: StackConfig) -> RunNaming:
    """GKE: the Job / RayJob name, which must fit Kubernetes' limits; Cloud Run: `<recipe>-<12 hex>` (the run id)."""
    if cfg.workload is Workload.CLOUD_RUN:
        return RunNaming(cfg.recipe, CLOUD_RUN_KEY_DIGITS)
    prefix, max_len = (
        (GKE_JOB_PREFIX, GKE_JOB_NAME_MAX) if cfg.workload is Workload.GKE_JOB else (GKE_RAY_PREFIX, GKE_RAY_NAME_MAX)
    )
    room = max_len - len(prefix) - GKE_KEY_DIGITS - 2
    return RunNaming(f"{prefix}-{cfg.recipe[:room].rstrip('-')}", GKE_KEY_DIGITS)


@dataclass(frozen=True)
class Listed:
    """A run folder found in the bucket: when its newest marker file was written, and its record if it has one."""

    folder: str
    updated: str
    record: dict[str, Any] | None
    finished: bool


@dataclass(frozen=True)
class RunState:
    """This stack's run as this `up` sees it."""

    name: str
    """The run's folder under runs/ (and on GKE the Job / RayJob name)."""
    key: str
    inputs: dict[str, Any]
    origin: str
    """new (no folder yet) | recorded (its record names this key) | adopted (named by an earlier program)"""
    finished: str | None
    """gs://…/_RUN_COMPLETE.json of a finished run, else None."""
    previous: Listed | None = None
    """The newest other recorded run: what changed since it says why a new run starts."""
    trainer_content: str | None = None
    """The trainer image's content now, and (`started_with`) when the run's record was written."""
    started_with: str | None = None
    workload: str | None = None
    """The GKE object that runs it (Job, RayJob): a new trainer image replaces it, and the run restarts from its last
    checkpoint. None on Cloud Run, where an execution under way keeps its image."""

    @property
    def image_changed(self) -> bool:
        return bool(self.started_with and self.trainer_content and self.started_with != self.trainer_content)

    @property
    def folder(self) -> str:
        return f"{RUNS_PREFIX}/{self.name}"

    @property
    def starts_paid_run(self) -> bool:
        return self.finished is None and self.origin == "new"

    def line(self) -> str:
        """Whether this `up` starts a paid run, why, and how to ask for one."""
        again = f"to train again: pulumi config set {RUN_GENERATION_KEY} {self.inputs['generation'] + 1}"
        earlier = " (named by an earlier version of this program)" if self.origin == "adopted" else ""
        if self.finished is not None:
            image = (
                "; the trainer image changed since it started, which trains nothing again" if self.image_changed else ""
            )
            return f"no paid run starts: run {self.name}{earlier} has finished ({self.finished}){image}; {again}"
        if self.origin != "new":
            restart = ""
            if self.workload is not None and (self.image_changed or self.origin == "adopted"):
                why = "changed since it started" if self.image_changed else "it started with is not recorded"
                restart = (
                    f"; the trainer image {why}: a {self.workload} this preview replaces restarts the run from its "
                    "last checkpoint"
                )
            return (
                f"no new paid run starts: run {self.name}{earlier} has not finished; it goes on (or, if its workload "
                f"is gone, starts again from its last checkpoint){restart}"
            )
        return f"a paid training run starts: {self.name}, because {self.reason()}"

    def reason(self) -> str:
        if self.previous is None or self.previous.record is None:
            return f"recipe {self.inputs['recipe']} has no run in this stack's bucket yet"
        before = self.previous.record.get("inputs") or {}
        what = {
            "recipe_sha256": "the recipe file",
            "data_sha256": "its data",
            "overrides": "recipeOverrides",
            "generation": RUN_GENERATION_KEY,
        }
        changed = [label for field, label in what.items() if before.get(field) != self.inputs.get(field)]
        return f"{' and '.join(changed) or 'the run inputs'} changed since run {self.previous.folder}"


def _listing(cfg: StackConfig, stem: str, file: str) -> dict[str, str]:
    """folder -> updated time of `runs/<stem>-*/<file>` in the stack's bucket."""
    found = gcp.storage.get_bucket_objects(
        bucket=bucket_name(cfg), prefix=f"{RUNS_PREFIX}/{stem}-", match_glob=f"{RUNS_PREFIX}/{stem}-*/{file}"
    )
    return {o.name.split("/")[1]: o.updated or "" for o in found.bucket_objects or [] if o.name.count("/") == 2}


def _read(cfg: StackConfig, folder: str) -> dict[str, Any] | None:
    content = gcp.storage.get_bucket_object_content(
        bucket=bucket_name(cfg), name=f"{RUNS_PREFIX}/{folder}/{RUN_KEY_FILE}"
    ).content
    try:
        record = json.loads(content or "null")
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def list_runs(cfg: StackConfig, run_naming: RunNaming) -> list[Listed]:
    """The stack's run folders of this recipe and workload, oldest first: those with a record, a completion marker or
    a price file (the program writes one into every run it starts)."""
    records = _listing(cfg, run_naming.stem, RUN_KEY_FILE)
    markers = _listing(cfg, run_naming.stem, RUN_MARKER)
    prices = _listing(cfg, run_naming.stem, PRICE_FILE)
    folders = {f for f in (*records, *markers, *prices) if run_naming.matches(f)}
    listed = [
        Listed(
            folder=f,
            updated=max(t for t in (records.get(f), markers.get(f), prices.get(f)) if t is not None),
            record=_read(cfg, f) if f in records else None,
            finished=f in markers,
        )
        for f in folders
    ]
    return sorted(listed, key=lambda r: (_time(r.updated), r.folder))


def _time(value: str) -> datetime:
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return datetime.min.replace(tzinfo=UTC)


def resolve(cfg: StackConfig, bucket_kept: bool, trainer_content: str | None = None) -> RunState:
    """This stack's run: the folder recorded for the current key, else (a bucket never written by this program) the
    newest folder an earlier program named, else a new folder named by the key."""
    inputs = run_inputs(cfg)
    key = run_key(inputs)
    run_naming = naming(cfg)
    runs = list_runs(cfg, run_naming) if bucket_kept else []
    recorded = [r for r in runs if r.record is not None]
    mine = [r for r in recorded if r.record and r.record.get("key") == key]
    chosen, origin = None, "new"
    if mine:
        chosen, origin = mine[-1], "recorded"
    elif not recorded and runs and cfg.run_generation == 0:
        chosen, origin = runs[-1], "adopted"
    if chosen is None:
        previous = recorded[-1] if recorded else None
        name = run_naming.name(key)
        return RunState(name, key, inputs, origin, None, previous=previous, trainer_content=trainer_content)
    marker = f"gs://{bucket_name(cfg)}/{RUNS_PREFIX}/{chosen.folder}/{RUN_MARKER}" if chosen.finished else None
    started = (chosen.record or {}).get("trainerImage")
    return RunState(
        chosen.folder,
        key,
        inputs,
        origin,
        marker,
        trainer_content=trainer_content,
        started_with=started,
        workload=GKE_WORKLOAD_KIND.get(cfg.workload),
    )


def declare_record(
    name: str, cfg: StackConfig, run: RunState, bucket: pulumi.Input[str], after: list[pulumi.Resource]
) -> gcp.storage.BucketObject:
    """`runs/<run>/_RUN_KEY.json`: the key and inputs this run is the run of, and the trainer image it started with.
    One resource per run folder (its name in the URN), written once (later changes of the image are not written
    over it) and kept by `destroy` or the next run, as the run folder is. Under one URN for every run, the engine
    would create the next run's record with this run's content: an `ignore_changes` input keeps the old state's
    value in a replacement too (pulumi/pulumi step_generator.go `processIgnoreChanges`)."""
    record = {"key": run.key, "inputs": run.inputs, "trainerImage": run.started_with or run.trainer_content}
    if run.origin == "adopted":
        record["trainerImage"] = None  # started by an earlier program: its image is not known here
    return gcp.storage.BucketObject(
        f"{name}-{RECORD_RESOURCE}-{run.name}",
        bucket=bucket,
        name=f"{run.folder}/{RUN_KEY_FILE}",
        content=json.dumps(record, indent=2, sort_keys=True),
        content_type="application/json",
        opts=pulumi.ResourceOptions(depends_on=after, retain_on_delete=True, ignore_changes=["content"]),
    )
