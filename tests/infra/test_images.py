"""Images are pinned by digest and rebuilt only when their build context changes."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.config import ConfigError
from infra.images import (
    SERVING,
    STAGED_CONTEXTS,
    TRAINER,
    ImageSpec,
    content_hash,
    context_files,
    docker_credentials,
    stage_context,
)
from infra.offline.engine import MOCK_ACCESS_TOKEN, REPO_ROOT, Mocks, StackRun, run_stack, stack_names, unwrap_secrets
from tests.infra.conftest import PREBUILT, Variant


class TestBuildContext:
    def test_trainer_context_excludes_tests_and_outputs(self) -> None:
        files = [f.as_posix() for f in context_files(TRAINER)]
        assert "Dockerfile" in files and "recipe.py" in files and "recipes/emoji-gemma3-1b.yaml" in files
        assert not [f for f in files if f.startswith(("outputs/", ".venv/")) or "__pycache__" in f]

    def test_hash_is_stable_and_follows_content(self, tmp_path: Path) -> None:
        copy = tmp_path / "ctx"
        shutil.copytree(SERVING.context, copy, ignore=shutil.ignore_patterns("__pycache__"))
        spec = ImageSpec("serving", copy, copy / "Dockerfile", (".",))
        first = content_hash(spec)
        assert content_hash(spec) == first
        (copy / "__pycache__").mkdir(exist_ok=True)
        (copy / "__pycache__" / "x.pyc").write_bytes(b"ignored")
        assert content_hash(spec) == first, "caches must not trigger a rebuild"
        (copy / "entrypoint.sh").write_text((copy / "entrypoint.sh").read_text() + "\n# changed\n")
        assert content_hash(spec) != first


class TestStagedContext:
    """The build reads a copy of exactly the hashed files, with modes that do not depend on the checkout."""

    @staticmethod
    def checkout(tmp_path: Path, name: str, group_writable: bool) -> ImageSpec:
        copy = tmp_path / name / "serving"
        shutil.copytree(SERVING.context, copy, ignore=shutil.ignore_patterns("__pycache__"))
        if group_writable:  # umask 002
            for path in copy.rglob("*"):
                path.chmod(path.stat().st_mode | stat.S_IWGRP)
        return ImageSpec(SERVING.name, copy, copy / "Dockerfile", SERVING.content_paths)

    def test_the_copy_holds_the_hashed_files_with_fixed_modes(self, tmp_path: Path) -> None:
        spec = self.checkout(tmp_path, "laptop", group_writable=True)
        (spec.context / "local-notes.txt").write_text("not part of the image\n")
        staged = stage_context(spec, tmp_path / "build")
        files = sorted(p.relative_to(staged) for p in staged.rglob("*") if p.is_file())
        assert files == context_files(spec)
        for rel in files:
            assert (staged / rel).read_bytes() == (spec.context / rel).read_bytes()
            executable = (spec.context / rel).stat().st_mode & 0o111
            assert stat.S_IMODE((staged / rel).stat().st_mode) == (0o755 if executable else 0o644), rel

    def test_checkouts_with_other_umasks_stage_the_same_files(self, tmp_path: Path) -> None:
        def modes(folder: Path) -> dict[str, int]:
            return {p.relative_to(folder).as_posix(): p.stat().st_mode for p in sorted(folder.rglob("*"))}

        ci = stage_context(self.checkout(tmp_path, "ci", group_writable=False), tmp_path / "ci-build")
        laptop = stage_context(self.checkout(tmp_path, "laptop", group_writable=True), tmp_path / "laptop-build")
        assert modes(ci) == modes(laptop)

    def test_staging_again_drops_files_that_left_the_context(self, tmp_path: Path) -> None:
        spec = self.checkout(tmp_path, "ci", group_writable=False)
        stale = stage_context(spec, tmp_path / "build") / "stale.txt"
        stale.write_text("from an older commit\n")
        stage_context(spec, tmp_path / "build")
        assert not stale.exists()


DOCKER = {"imageBuild": "docker"}


def _holding(value: object, needle: str, path: str = "") -> list[str]:
    """Every path in `value` whose string holds `needle`, inside secrets too (state keeps secrets, encrypted)."""
    value = unwrap_secrets(value)
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _holding(v, needle, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _holding(v, needle, f"{path}[{i}]")]
    return [path or "."] if isinstance(value, str) and needle in value else []


@pytest.mark.slow
class TestNoCredentialInState:
    """State records every input of every resource, secret or not (a secret is encrypted with the stack key, which
    the preview identities can use too): no input may hold a token of whoever runs Pulumi. The mock's client config
    answers a recognisable token (infra/offline/engine.py MOCK_ACCESS_TOKEN); no registered input or output holds it, over
    every stack and user variant and each stack in each build mode."""

    def test_the_mock_client_config_answers_the_recognisable_token(self) -> None:
        args = type("Call", (), {"token": "gcp:organizations/getClientConfig:getClientConfig", "args": {}})()
        assert Mocks().call(args)[0]["accessToken"] == MOCK_ACCESS_TOKEN  # type: ignore[arg-type]

    def test_no_input_holds_the_runners_token(self, user_variant_runs: list[tuple[Variant, StackRun]]) -> None:
        runs = [(variant.label, run) for variant, run in user_variant_runs]
        for stack in stack_names():
            for mode in ("docker", "cloud-build"):
                runs.append((f"{stack}, {mode}", run_stack(stack, overrides={"imageBuild": mode})))
        serving = {"servingEnabled": True, "servingInvokers": ["user:alice@example.com"], **DOCKER}
        runs.append(("dev, docker, serving", run_stack("dev", overrides=serving, assume_trained=True)))
        found = [
            f"[{label}] {r.urn} {where}{path}"
            for label, run in runs
            for r in run.resources
            for where, values in (("inputs", r.inputs), ("outputs", r.outputs))
            for path in _holding(values, MOCK_ACCESS_TOKEN)
        ]
        assert any(run.of_type("docker-build:index:Image") for _, run in runs), "docker mode was scanned"
        assert found == [], "a credential of the runner would be written into state:\n" + "\n".join(found)


class TestDockerLogin:
    """docker mode pushes with Docker's own login for the registry host; without one the program says so."""

    HOST = "us-central1-docker.pkg.dev"

    def test_the_helper_gcloud_configure_docker_names_is_found(self, tmp_path: Path) -> None:
        # what `gcloud auth configure-docker us-central1-docker.pkg.dev` writes into ~/.docker/config.json
        (tmp_path / "config.json").write_text(json.dumps({"credHelpers": {self.HOST: "gcloud"}}))
        env = {"DOCKER_CONFIG": str(tmp_path)}
        assert docker_credentials(self.HOST, env) == "the credential helper docker-credential-gcloud"
        assert docker_credentials("europe-west4-docker.pkg.dev", env) is None, "a helper is per host"

    def test_a_default_store_or_a_stored_login_counts(self, tmp_path: Path) -> None:
        (tmp_path / ".docker").mkdir()
        (tmp_path / ".docker" / "config.json").write_text(json.dumps({"auths": {f"https://{self.HOST}": {}}}))
        assert docker_credentials(self.HOST, {"HOME": str(tmp_path)}) == "a stored login (auths)"
        (tmp_path / ".docker" / "config.json").write_text(json.dumps({"credsStore": "desktop"}))
        assert (
            docker_credentials(self.HOST, {"HOME": str(tmp_path)}) == "the credential helper docker-credential-desktop"
        )

    def test_no_login_is_a_warning_with_the_fix(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
        warned = [w for w in run_stack("dev", overrides=DOCKER).warnings if "has no login" in w]
        assert len(warned) == 1 and f"gcloud auth configure-docker {self.HOST}" in warned[0]
        (tmp_path / "config.json").write_text(json.dumps({"credHelpers": {self.HOST: "gcloud"}}))
        assert not [w for w in run_stack("dev", overrides=DOCKER).warnings if "has no login" in w]


class TestModes:
    def test_docker_mode_pushes_to_the_stack_registry_with_the_runners_credentials(self) -> None:
        run = run_stack("dev", overrides=DOCKER)
        image = run.one("docker-build:index:Image")
        inputs = image.plain_inputs()
        assert inputs["push"] is True
        assert inputs["tags"][0].startswith("us-central1-docker.pkg.dev/my-gcp-project/gemma-finetune-dev/trainer:")
        assert inputs["platforms"] == ["linux/amd64"]
        # no login in the inputs: the provider uses the Docker config's credential helper (infra/images.py)
        assert "registries" not in inputs
        assert run.outputs["trainerImage"].split("@")[1].startswith("sha256:")
        for key, path in (
            ("context", STAGED_CONTEXTS / "trainer"),
            ("dockerfile", STAGED_CONTEXTS / "trainer/Dockerfile"),
        ):
            location = inputs[key]["location"]
            assert not Path(location).is_absolute(), f"{key}.location from another checkout would rebuild"
            assert (Path.cwd() / location).resolve() == path

    def test_cloud_build_mode_rebuilds_on_content_hash(self) -> None:
        run = run_stack("dev", overrides={"imageBuild": "cloud-build"})
        build = run.by_name("gft-dev-trainer-cloudbuild").plain_inputs()
        assert build["triggers"] == [content_hash(TRAINER)[:16]]
        assert "gcloud builds submit" in build["create"] and "results.images[0].digest" in build["create"]
        assert build["environment"]["DOCKERFILE"] == "Dockerfile"
        for key, path in (
            ("CONTEXT", STAGED_CONTEXTS / "trainer"),
            ("CONFIG", REPO_ROOT / "infra" / "cloudbuild.yaml"),
        ):
            assert not Path(build["environment"][key]).is_absolute(), "another checkout would rebuild"
            assert (Path.cwd() / build["environment"][key]).resolve() == path
        assert "@sha256:" in run.outputs["trainerImage"]

    def test_prebuilt_mode_builds_nothing(self) -> None:
        run = run_stack("dev", overrides=PREBUILT)
        builds = [r for r in run.of_type("command:local:Command") if "gcp:Images" in r.parent]
        assert run.of_type("docker-build:index:Image") == [] and builds == []
        assert run.outputs["trainerImage"] == PREBUILT["trainerImage"]

    def test_prebuilt_without_reference_fails(self) -> None:
        with pytest.raises(ConfigError, match="imageBuild=prebuilt needs trainerImage"):
            run_stack("dev", overrides={"imageBuild": "prebuilt"})

    def test_serving_image_only_with_serving(self) -> None:
        run = run_stack("dev", overrides={"servingEnabled": True, **DOCKER}, assume_trained=True)
        names = sorted(r.name for r in run.of_type("docker-build:index:Image"))
        assert names == ["gft-dev-serving", "gft-dev-trainer"]


class TestServingContext:
    def test_client_and_demo_edits_do_not_rebuild_the_serving_image(self, tmp_path: Path) -> None:
        copy = tmp_path / "serving"
        shutil.copytree(SERVING.context, copy, ignore=shutil.ignore_patterns("__pycache__"))
        spec = ImageSpec("serving", copy, copy / "Dockerfile", SERVING.content_paths)
        before = content_hash(spec)
        (copy / "client.py").write_text((copy / "client.py").read_text() + "\n# changed\n")
        assert content_hash(spec) == before
        (copy / "entrypoint.sh").write_text((copy / "entrypoint.sh").read_text() + "\n# changed\n")
        assert content_hash(spec) != before


class TestCloudBuildIdentity:
    """imageBuild cloud-build runs as the stack's builder account, never a default Cloud Build account."""

    def test_build_runs_as_the_builder_with_logs_and_staging_it_can_use(self) -> None:
        run = run_stack("dev", overrides={"imageBuild": "cloud-build"})
        build = run.by_name("gft-dev-trainer-cloudbuild").plain_inputs()
        env = build["environment"]
        assert env["BUILD_SERVICE_ACCOUNT"] == run.by_name("gft-dev-build-sa").outputs["email"]
        staging = run.by_name("gft-dev-build-staging").plain_inputs()
        assert env["STAGING_BUCKET"] == staging["name"] and staging["forceDestroy"] is True
        script = build["create"]
        assert '--service-account "projects/$PROJECT/serviceAccounts/$BUILD_SERVICE_ACCOUNT"' in script
        assert '--gcs-source-staging-dir "gs://$STAGING_BUCKET/source"' in script
        config = yaml.safe_load((REPO_ROOT / "infra" / "cloudbuild.yaml").read_text())
        assert config["options"]["logging"] == "CLOUD_LOGGING_ONLY", "a user-specified account needs this"

    def test_docker_mode_creates_no_builder(self) -> None:
        run = run_stack("dev", overrides=DOCKER)
        assert not [r for r in run.of_type("gcp:serviceaccount/account:Account") if r.name.endswith("build-sa")]


# A stand-in for gcloud that answers as SDK 528.0.0 does (googlecloudsdk/command_lib/builds/submit_util.py
# `Build`): a build that did not succeed prints 'BUILD FAILURE: <detail>' and raises FailedBuildException,
# 'build ID completed with status "FAILURE"', exit 1; `builds describe --format=value(...)` prints the field.
# Each `builds submit` takes the next line of $FAKE_OUTCOMES: ok, an API error, or a FailureInfo type.
FAKE_GCLOUD = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_CALLS"
n=$(grep -c '^builds submit' "$FAKE_CALLS")
case "$1 $2" in
  "builds submit")
    outcome=$(sed -n "${n}p" "$FAKE_OUTCOMES")
    id="0000000$n-aaaa-bbbb-cccc-dddddddddddd"
    case "$outcome" in
      ok) echo "Created [https://cloudbuild.googleapis.com/v1/projects/p/locations/r/builds/$id]." >&2; echo "$id";;
      slow) echo "Created [https://cloudbuild.googleapis.com/v1/projects/p/locations/r/builds/$id]." >&2
        until [ -e "$FAKE_CALLS.release" ]; do command -p sleep 0.05; done  # the build runs until the test says
        echo "$id";;
      PERMISSION_DENIED|INVALID_ARGUMENT)
        echo "ERROR: (gcloud.builds.submit) $outcome: the API refused the request" >&2; exit 1;;
      SOURCE_403)  # the builder cannot read the staged source yet: refused before any build starts
        echo "ERROR: (gcloud.builds.submit) INVALID_ARGUMENT: could not resolve source: googleapi: Error 403:" \
          "gft-dev-build@p.iam.gserviceaccount.com does not have storage.objects.get access to the Google Cloud" \
          "Storage object. Permission 'storage.objects.get' denied on resource (or it may not exist)., forbidden" >&2
        exit 1;;
      *) echo "$outcome" > "$FAKE_CALLS.type-$id"
         echo "BUILD FAILURE: a failure of type $outcome" >&2
         echo "ERROR: (gcloud.builds.submit) build $id completed with status \"FAILURE\"" >&2; exit 1;;
    esac;;
  "builds describe")
    case "$*" in
      *failureInfo.type*) cat "$FAKE_CALLS.type-$3";;
      *digest*) echo "sha256:$(printf '%064d' 7)";;
    esac;;
esac
"""


PIPES: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}


class TestCloudBuildRetriesAFreshGrant:
    """The planned build step, run by bash as pulumi-command runs it, against a gcloud that fails as a grant
    that has not propagated yet makes it fail."""

    def _build(self, tmp_path: Path, outcomes: list[str], stream: Any = None) -> tuple[Any, list[str], list[int]]:
        import os

        run = run_stack("dev", overrides={"imageBuild": "cloud-build"})
        build = run.by_name("gft-dev-trainer-cloudbuild").plain_inputs()
        (tmp_path / "bin").mkdir()
        gcloud = tmp_path / "bin" / "gcloud"
        gcloud.write_text(FAKE_GCLOUD)
        gcloud.chmod(0o755)
        sleep = tmp_path / "bin" / "sleep"  # the waits, recorded instead of slept
        sleep.write_text('#!/bin/sh\necho "$1" >> "$FAKE_CALLS.sleeps"\n')
        sleep.chmod(0o755)
        (tmp_path / "outcomes").write_text("\n".join(outcomes) + "\n")
        calls = tmp_path / "calls"
        calls.touch()
        env = {
            **{k: str(v) for k, v in build["environment"].items()},
            "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
            "FAKE_CALLS": str(calls),
            "FAKE_OUTCOMES": str(tmp_path / "outcomes"),
        }
        if stream is not None:
            return stream(subprocess.Popen([*build["interpreter"], build["create"]], env=env, **PIPES)), [], []
        done = subprocess.run(
            [*build["interpreter"], build["create"]], env=env, capture_output=True, text=True, timeout=60
        )
        sleeps = Path(f"{calls}.sleeps")
        waits = [int(w) for w in sleeps.read_text().split()] if sleeps.exists() else []
        return done, [line.split(" --")[0] for line in calls.read_text().splitlines()], waits

    @pytest.mark.parametrize("failure", ["FETCH_SOURCE_FAILED", "PUSH_NOT_AUTHORIZED", "LOGGING_FAILURE"])
    def test_a_build_the_builder_was_not_allowed_yet_is_submitted_again(self, tmp_path: Path, failure: str) -> None:
        done, calls, waits = self._build(tmp_path, [failure, failure, "ok"])
        assert done.returncode == 0 and done.stdout == "sha256:" + "0" * 63 + "7", done.stderr
        assert sum(c.startswith("builds submit") for c in calls) == 3 and waits == [60, 120], (calls, waits)
        assert done.stderr.count(f"Cloud Build failed with {failure}") == 2, done.stderr
        assert f"a failure of type {failure}" in done.stderr, "gcloud's own lines reach Pulumi's log"

    @pytest.mark.parametrize("refusal", ["PERMISSION_DENIED", "SOURCE_403"])
    def test_a_submit_refused_for_permission_is_submitted_again(self, tmp_path: Path, refusal: str) -> None:
        done, calls, waits = self._build(tmp_path, [refusal, "ok"])
        assert done.returncode == 0 and done.stdout.startswith("sha256:"), done.stderr
        assert sum(c.startswith("builds submit") for c in calls) == 2 and waits == [60], (calls, waits)

    @pytest.mark.parametrize("failure", ["USER_BUILD_STEP", "PUSH_FAILED", "INVALID_ARGUMENT"])
    def test_any_other_failure_stops_at_once(self, tmp_path: Path, failure: str) -> None:
        done, calls, waits = self._build(tmp_path, [failure, "ok"])
        assert done.returncode == 1 and done.stdout == "" and waits == [], (done.stdout, waits)
        assert sum(c.startswith("builds submit") for c in calls) == 1, calls
        assert "ERROR: (gcloud.builds.submit)" in done.stderr

    def test_the_retries_are_bounded(self, tmp_path: Path) -> None:
        from infra.images import BUILD_ATTEMPTS

        done, calls, waits = self._build(tmp_path, ["FETCH_SOURCE_FAILED"] * 9)
        assert done.returncode == 1 and sum(c.startswith("builds submit") for c in calls) == BUILD_ATTEMPTS == 4
        assert waits == [60, 120, 240], "7 minutes in all past the propagation wait: IAM's 'sometimes 7 or more'"
        assert f"still fails with FETCH_SOURCE_FAILED after {BUILD_ATTEMPTS} attempts" in done.stderr

    def test_gclouds_lines_reach_the_log_while_the_build_runs(self, tmp_path: Path) -> None:
        """The build's URL is printed at its start; a user waiting 20 minutes for an image sees it then, not after."""
        import threading

        release = tmp_path / "calls.release"

        def watch(script: subprocess.Popen[str]) -> tuple[str, bool, str, str, int]:
            assert script.stderr is not None
            timer = threading.Timer(20, release.touch)  # the build ends anyway: a held-back line fails, never hangs
            timer.start()
            first = script.stderr.readline()
            while_building = not release.exists()
            release.touch()
            out, rest = script.communicate(timeout=60)
            timer.cancel()
            return first, while_building, rest, out, script.returncode

        first, while_building, rest, out, code = self._build(tmp_path, ["slow"], stream=watch)[0]
        assert first.startswith("Created [https://cloudbuild.googleapis.com/") and while_building, first
        assert "Created [" not in rest, "each of gcloud's lines once"
        assert code == 0 and out.startswith("sha256:"), (code, out, rest)
