"""The trainer and serving images, built and wired in by digest.

Decisions (why: docs/program.md#images-pinned-by-digest-rebuilt-by-content)
- Three modes (`imageBuild`): `docker` builds locally with pulumi-docker-build; `cloud-build` runs
  `gcloud builds submit` as the stack's builder account when the context's hash changes and reads the
  digest back; `prebuilt` takes pinned references from config. The shipped stacks use `cloud-build`.
- Every workload receives `REGISTRY/NAME@sha256:…`, never a tag. A run's identity is `trainer_content`,
  the build context's content hash: known in a preview, the same from any checkout.
- What is built is what is hashed: `stage_context` copies the hashed files with normalised permission
  bits, and paths given to the providers are relative, so laptop and CI build the same thing.
- No credential is a resource input (docs/identities.md#no-credential-in-a-resource-input): `docker` mode
  pushes with the machine's Docker credential helper (`gcloud auth configure-docker`).
Not here: pushing to other registries, multi-arch builds (the GPU nodes are amd64).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_command as command
import pulumi_docker_build as docker_build

from infra.config import ImageBuild, StackConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
# Where `stage_context` writes the build contexts (under build/, which .gitignore leaves out).
STAGED_CONTEXTS = REPO_ROOT / "build" / "image-context"
FILE_MODE, EXECUTABLE_MODE, DIRECTORY_MODE = 0o644, 0o755, 0o755

# Never part of an image's content: tests, virtualenvs, caches and run outputs — everything .gitignore
# and the contexts' .dockerignore leave out, so a laptop checkout with local leftovers hashes like CI.
EXCLUDED = (
    ".git",
    ".venv",
    "tests",
    "build",
    "outputs",
    "runs",
    ".cache",
    "*.egg-info",
    "__pycache__",
    "*.pyc",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    "gha-creds-*.json",
)


@dataclass(frozen=True)
class ImageSpec:
    """One image: its name in the registry, the build context and the paths that define its content."""

    name: str
    context: Path
    dockerfile: Path
    content_paths: tuple[str, ...]
    # files from elsewhere in the repository placed in the context: (path in the context, source file)
    extra: tuple[tuple[str, Path], ...] = ()


TRAINER = ImageSpec("trainer", REPO_ROOT / "trainer", REPO_ROOT / "trainer" / "Dockerfile", (".",))
# The serving image holds only its entrypoint, the completion check it runs and the API key guard
# vLLM loads (serving/__init__.py makes it a package); edits to the client or the demo must not rebuild it.
SERVING = ImageSpec(
    "serving",
    REPO_ROOT / "serving",
    REPO_ROOT / "serving" / "Dockerfile",
    ("Dockerfile", "entrypoint.sh", "completion.py", "__init__.py", "api_key_guard.py", ".dockerignore"),
)


def trainer_spec(cfg: StackConfig) -> ImageSpec:
    """The trainer image of a stack: TRAINER, plus the stack's own recipe file (`pulumi config set recipe PATH`)
    as `recipes/<stem>.yaml`, where `python -m trainer --recipe <stem>` finds it in the image. The data files
    such a recipe reads are under trainer/ (infra/config.py `recipe_file_problem`), so they are in the context."""
    if cfg.recipe_file is None:
        return TRAINER
    source = REPO_ROOT / cfg.recipe_file
    return dataclasses.replace(TRAINER, extra=((f"recipes/{cfg.recipe}.yaml", source),))


def _source(spec: ImageSpec, rel: Path) -> Path:
    """Where the context file `rel` is read from: an `extra` file's source, else the context itself."""
    return dict((Path(dest), source) for dest, source in spec.extra).get(rel, spec.context / rel)


def _excluded(rel: Path) -> bool:
    return any(fnmatch.fnmatch(part, pattern) for part in rel.parts for pattern in EXCLUDED)


def context_files(spec: ImageSpec) -> list[Path]:
    """The files whose content defines the image, relative to the context, sorted."""
    files: list[Path] = []
    for content in spec.content_paths:
        base = (spec.context / content).resolve()
        candidates = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for path in candidates:
            rel = path.relative_to(spec.context)
            if not _excluded(rel):
                files.append(rel)
    files += [Path(dest) for dest, _ in spec.extra]
    dockerfile = spec.dockerfile.relative_to(spec.context)
    if dockerfile not in files:
        files.append(dockerfile)
    return sorted(set(files))


def content_hash(spec: ImageSpec) -> str:
    """sha256 over the context's file names and bytes: the same tree always gives the same hash."""
    digest = hashlib.sha256()
    for rel in context_files(spec):
        digest.update(rel.as_posix().encode() + b"\0")
        digest.update(_source(spec, rel).read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def stage_context(spec: ImageSpec, root: Path = STAGED_CONTEXTS) -> Path:
    """A fresh copy of the image's `context_files` in `root/<name>`, with permission bits that do not depend on
    the checkout's umask (docs/program.md#images-pinned-by-digest-rebuilt-by-content); returns the copy's folder, the context the
    build reads."""
    target = root / spec.name
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for rel in context_files(spec):
        source, copy = _source(spec, rel), target / rel
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, copy)
        copy.chmod(EXECUTABLE_MODE if source.stat().st_mode & 0o111 else FILE_MODE)
    for folder in [target, *(p for p in target.rglob("*") if p.is_dir())]:
        folder.chmod(DIRECTORY_MODE)
    return target


def docker_credentials(host: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """How Docker on this machine authenticates to `host`, resolved as docker/cli does (cli/config/config.go `Dir`:
    `DOCKER_CONFIG` or `~/.docker`; cli/config/configfile/file.go `getConfiguredCredentialStore`: the host's
    `credHelpers` entry, else `credsStore`; else a stored `auths` login), or None when it has none."""
    folder = (
        Path(environ["DOCKER_CONFIG"]) if environ.get("DOCKER_CONFIG") else Path(environ.get("HOME", "~")) / ".docker"
    )
    try:
        config = json.loads((folder.expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    helper = (config.get("credHelpers") or {}).get(host) or config.get("credsStore")
    if helper:
        return f"the credential helper docker-credential-{helper}"
    logins = {key.removeprefix("https://").removeprefix("http://").split("/")[0] for key in config.get("auths") or {}}
    return "a stored login (auths)" if host in logins else None


def provider_path(path: Path) -> str:
    """`path` relative to the working directory the program and its providers share (see the module
    docstring): the same string for the same commit wherever it is checked out."""
    return os.path.relpath(path, Path.cwd())


# A build that failed only because a fresh grant to its builder had not reached Cloud Build yet (IAM: typically
# 2 minutes, sometimes 7 or more, past the propagation wait it already had) is submitted again, up to
# BUILD_ATTEMPTS times, 60, 120 and 240 s apart: a submit refused because the builder cannot read the staged
# source yet ('could not resolve source: googleapi: Error 403'), or refused with PERMISSION_DENIED, and a build
# that failed with a type of Cloud Build's FailureInfo a grant explains (source, push, logs). A failed build step
# (the Dockerfile) is not retried. gcloud names a failed build on stderr as 'build ID completed with status
# "FAILURE"' (googlecloudsdk/command_lib/builds/submit_util.py) and an API error as 'STATUS: message'.
BUILD_ATTEMPTS = 4
BUILD_RETRIED_FAILURES = ("FETCH_SOURCE_FAILED", "PUSH_NOT_AUTHORIZED", "LOGGING_FAILURE")
CLOUD_BUILD_SCRIPT = f"""set -euo pipefail
err=$(mktemp)
trap 'rm -f "$err"' EXIT
attempt=1
# gcloud's stderr reaches Pulumi's log as it is written (the build's URL, then the wait) and is kept to be read
until build_id=$( {{ gcloud builds submit "$CONTEXT" --project "$PROJECT" --region "$REGION" \\
  --config "$CONFIG" --substitutions "_IMAGE=$IMAGE,_DOCKERFILE=$DOCKERFILE,_VLLM_IMAGE=$VLLM_IMAGE" \\
  --service-account "projects/$PROJECT/serviceAccounts/$BUILD_SERVICE_ACCOUNT" \\
  --gcs-source-staging-dir "gs://$STAGING_BUCKET/source" \\
  --suppress-logs --format='value(id)' 2>&1 >&3 | tee "$err" >&2; }} 3>&1 ); do
  failed=$(sed -n 's/.*build \\([^ ]*\\) completed with status.*/\\1/p' "$err" | tail -n 1)
  reason=PERMISSION_DENIED
  if [ -n "$failed" ]; then
    reason=$(gcloud builds describe "$failed" --project "$PROJECT" --region "$REGION" \\
      --format='value(failureInfo.type)' || true)
  elif grep -q 'could not resolve source: googleapi: Error 403' "$err"; then
    reason=SOURCE_NOT_READABLE
  elif ! grep -q PERMISSION_DENIED "$err"; then
    exit 1
  fi
  case "$reason" in {"|".join(("PERMISSION_DENIED", "SOURCE_NOT_READABLE", *BUILD_RETRIED_FAILURES))}) ;; *) exit 1;; esac
  if [ "$attempt" -ge {BUILD_ATTEMPTS} ]; then
    echo "Cloud Build still fails with $reason after {BUILD_ATTEMPTS} attempts: check the builder's grants" >&2
    exit 1
  fi
  wait_s=$(( 60 << (attempt - 1) ))
  attempt=$((attempt + 1))
  echo "Cloud Build failed with $reason, which a grant that has not propagated yet causes: attempt $attempt of \\
{BUILD_ATTEMPTS} in $wait_s s" >&2
  sleep "$wait_s"
done
digest=$(gcloud builds describe "$build_id" --project "$PROJECT" --region "$REGION" \\
  --format='value(results.images[0].digest)')
case "$digest" in sha256:*) ;; *) echo "Cloud Build $build_id returned no image digest" >&2; exit 1;; esac
printf '%s' "$digest"
"""


def image_content(spec: ImageSpec, build: ImageBuild, prebuilt: str | None) -> str:
    """The image's identity before it exists: the prebuilt reference, or `<name>:<content hash>`."""
    if build is ImageBuild.PREBUILT:
        assert prebuilt is not None, "config validation guarantees a prebuilt reference"
        return prebuilt
    return f"{spec.name}:{content_hash(spec)}"


@dataclass
class ImagesArgs:
    cfg: StackConfig
    registry_url: pulumi.Input[str]
    """REGION-docker.pkg.dev/PROJECT/REPOSITORY"""
    depends_on: list[pulumi.Resource]
    """The registry (and APIs): builds push there; with cloud-build also every grant to the builder account."""
    build_service_account: pulumi.Input[str] | None = None
    """imageBuild cloud-build: email of the account the build runs as."""
    staging_bucket: pulumi.Input[str] | None = None
    """imageBuild cloud-build: the bucket gcloud uploads the build context to."""


class Images(pulumi.ComponentResource):
    """Builds (or takes) the trainer image and, when serving is on, the serving image."""

    trainer_image: pulumi.Output[str]
    """REGISTRY/trainer@sha256:… (unknown in a preview until the image is built)."""
    trainer_content: str
    """What defines the trainer image, known before any build: its context's content hash, or the
    prebuilt reference. Run names and run ids derive from this, never from the digest."""
    serving_image: pulumi.Output[str] | None

    def __init__(self, name: str, args: ImagesArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gemma-finetune:gcp:Images", name, None, opts)
        self._args = args
        cfg = args.cfg
        trainer = trainer_spec(cfg)
        self.trainer_image = self._image(name, trainer, cfg.trainer_image)
        self.trainer_content = image_content(trainer, cfg.image_build, cfg.trainer_image)
        self.serving_image = None
        if cfg.serving_enabled:  # every stack serves on Cloud Run (infra/serving.py)
            self.serving_image = self._image(name, SERVING, cfg.serving_image)
        outputs: dict[str, pulumi.Output[str]] = {"trainer_image": self.trainer_image}
        if self.serving_image is not None:
            outputs["serving_image"] = self.serving_image
        self.register_outputs(outputs)

    def _image(self, name: str, spec: ImageSpec, prebuilt: str | None) -> pulumi.Output[str]:
        cfg = self._args.cfg
        if cfg.image_build is ImageBuild.PREBUILT:
            assert prebuilt is not None, "config validation guarantees a prebuilt reference"
            return pulumi.Output.from_input(prebuilt)
        if not spec.dockerfile.exists():
            raise pulumi.RunError(
                f"{spec.dockerfile.relative_to(REPO_ROOT)} is missing: the {spec.name} image cannot be built"
            )
        tag = content_hash(spec)[:16]
        context = stage_context(spec)
        staged = ImageSpec(spec.name, context, context / spec.dockerfile.relative_to(spec.context), spec.content_paths)
        build_args = self._build_args(spec)
        repo = pulumi.Output.from_input(self._args.registry_url).apply(lambda url: f"{url}/{spec.name}")
        opts = pulumi.ResourceOptions(parent=self, depends_on=self._args.depends_on)
        if cfg.image_build is ImageBuild.DOCKER:
            return self._docker(name, staged, repo, tag, build_args, opts)
        return self._cloud_build(name, staged, repo, tag, build_args, opts)

    def _build_args(self, spec: ImageSpec) -> dict[str, str]:
        """Build arguments: the serving image's vLLM base (servingVllmImage); the trainer takes none."""
        return {"VLLM_IMAGE": self._args.cfg.serving_vllm_image} if spec.name == SERVING.name else {}

    def _docker(
        self,
        name: str,
        spec: ImageSpec,
        repo: pulumi.Output[str],
        tag: str,
        build_args: dict[str, str],
        opts: pulumi.ResourceOptions,
    ) -> pulumi.Output[str]:
        host = f"{self._args.cfg.region}-docker.pkg.dev"
        if docker_credentials(host) is None:
            pulumi.log.warn(
                f"imageBuild=docker: Docker on this machine has no login for {host} (DOCKER_CONFIG or "
                f"~/.docker/config.json), so the push of `pulumi up` would be refused. Fix: gcloud auth configure-docker "
                f"{host} (or pulumi config set imageBuild cloud-build)"
            )
        image = docker_build.Image(
            f"{name}-{spec.name}",
            tags=[repo.apply(lambda r: f"{r}:{tag}")],
            context=docker_build.BuildContextArgs(location=provider_path(spec.context)),
            dockerfile=docker_build.DockerfileArgs(location=provider_path(spec.dockerfile)),
            platforms=[docker_build.Platform.LINUX_AMD64],
            build_args=build_args or None,
            push=True,
            # A preview (every PR) must not build and push images; the digest stays unknown until `up`.
            build_on_preview=False,
            # No `registries`: the push authenticates with the runner's own Docker credentials (module
            # docstring), so no token is ever an input, and state never holds one.
            labels={"org.opencontainers.image.source": "gemma-finetune", "gemma-finetune.content": tag},
            opts=opts,
        )
        return pulumi.Output.all(repo, image.digest).apply(lambda parts: f"{parts[0]}@{parts[1]}")

    def _cloud_build(
        self,
        name: str,
        spec: ImageSpec,
        repo: pulumi.Output[str],
        tag: str,
        build_args: dict[str, str],
        opts: pulumi.ResourceOptions,
    ) -> pulumi.Output[str]:
        cfg = self._args.cfg
        assert self._args.build_service_account is not None and self._args.staging_bucket is not None, (
            "the foundation creates the builder account and staging bucket for imageBuild cloud-build"
        )
        build = command.local.Command(
            f"{name}-{spec.name}-cloudbuild",
            create=CLOUD_BUILD_SCRIPT,
            interpreter=["/bin/bash", "-c"],
            environment={
                "CONTEXT": provider_path(spec.context),
                "PROJECT": cfg.project,
                "REGION": cfg.region,
                "CONFIG": provider_path(REPO_ROOT / "infra" / "cloudbuild.yaml"),
                "IMAGE": repo.apply(lambda r: f"{r}:{tag}"),
                "DOCKERFILE": str(spec.dockerfile.relative_to(spec.context)),
                "BUILD_SERVICE_ACCOUNT": self._args.build_service_account,
                "STAGING_BUCKET": self._args.staging_bucket,
                "VLLM_IMAGE": build_args.get("VLLM_IMAGE", ""),
            },
            triggers=[tag, *build_args.values()],
            opts=opts,
        )
        return pulumi.Output.all(repo, build.stdout).apply(lambda parts: f"{parts[0]}@{parts[1].strip()}")
