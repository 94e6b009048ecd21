"""The trainer and serving images, built and wired in by digest.

Three modes (`imageBuild`):
- `docker`: pulumi-docker-build builds with the local Docker/BuildKit and pushes to the
  stack's Artifact Registry; the provider rebuilds when the context changes.
- `cloud-build`: for users without Docker. `gcloud builds submit` runs through
  pulumi-command, only when the build context's content hash changes (the trigger); the
  digest is read back with `gcloud builds describe`, so the image is still pinned.
- `prebuilt`: references given in config, already pinned by digest; nothing is built.

Every workload receives `REGISTRY/NAME@sha256:…`, never a tag, so the Job name / execution
token derived from it changes exactly when the image content changes.

Not here: pushing to other registries, multi-arch builds (the GPU nodes are amd64).
"""

from __future__ import annotations

import fnmatch
import hashlib
from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_command as command
import pulumi_docker_build as docker_build
import pulumi_gcp as gcp

from infra.config import ImageBuild, StackConfig, Workload

REPO_ROOT = Path(__file__).resolve().parents[1]

# Never part of a build context: tests, virtualenvs, caches and run outputs.
EXCLUDED = (
    ".git",
    ".venv",
    "tests",
    "build",
    "outputs",
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


TRAINER = ImageSpec("trainer", REPO_ROOT / "trainer", REPO_ROOT / "trainer" / "Dockerfile", (".",))
# The serving image holds only its entrypoint and the completion check it runs; edits to the
# client or the demo must not rebuild it.
SERVING = ImageSpec(
    "serving",
    REPO_ROOT / "serving",
    REPO_ROOT / "serving" / "Dockerfile",
    ("Dockerfile", "entrypoint.sh", "completion.py", ".dockerignore"),
)


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
    dockerfile = spec.dockerfile.relative_to(spec.context)
    if dockerfile not in files:
        files.append(dockerfile)
    return sorted(set(files))


def content_hash(spec: ImageSpec) -> str:
    """sha256 over the context's file names and bytes: the same tree always gives the same hash."""
    digest = hashlib.sha256()
    for rel in context_files(spec):
        digest.update(rel.as_posix().encode() + b"\0")
        digest.update((spec.context / rel).read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


_CLOUD_BUILD_SCRIPT = """set -euo pipefail
build_id=$(gcloud builds submit "$CONTEXT" --project "$PROJECT" --region "$REGION" \\
  --config "$CONFIG" --substitutions "_IMAGE=$IMAGE,_DOCKERFILE=$DOCKERFILE,_VLLM_IMAGE=$VLLM_IMAGE" \\
  --suppress-logs --format='value(id)')
digest=$(gcloud builds describe "$build_id" --project "$PROJECT" --region "$REGION" \\
  --format='value(results.images[0].digest)')
case "$digest" in sha256:*) ;; *) echo "Cloud Build $build_id returned no image digest" >&2; exit 1;; esac
printf '%s' "$digest"
"""


@dataclass
class ImagesArgs:
    cfg: StackConfig
    registry_url: pulumi.Input[str]
    """REGION-docker.pkg.dev/PROJECT/REPOSITORY"""
    depends_on: list[pulumi.Resource]
    """The registry (and APIs): builds push there."""


class Images(pulumi.ComponentResource):
    """Builds (or takes) the trainer image and, when serving is on, the serving image."""

    trainer_image: pulumi.Output[str]
    serving_image: pulumi.Output[str] | None

    def __init__(self, name: str, args: ImagesArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gemma-finetune:gcp:Images", name, None, opts)
        self._args = args
        cfg = args.cfg
        self.trainer_image = self._image(name, TRAINER, cfg.trainer_image)
        self.serving_image = None
        if cfg.serving_enabled and cfg.workload is Workload.CLOUD_RUN:
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
        build_args = self._build_args(spec)
        repo = pulumi.Output.from_input(self._args.registry_url).apply(lambda url: f"{url}/{spec.name}")
        opts = pulumi.ResourceOptions(parent=self, depends_on=self._args.depends_on)
        if cfg.image_build is ImageBuild.DOCKER:
            return self._docker(name, spec, repo, tag, build_args, opts)
        return self._cloud_build(name, spec, repo, tag, build_args, opts)

    def _build_args(self, spec: ImageSpec) -> dict[str, str]:
        """Build arguments: the serving image's vLLM base (servingVllmImage); the trainer takes none."""
        return {"VLLM_IMAGE": self._args.cfg.serving_vllm_image} if spec is SERVING else {}

    def _docker(
        self,
        name: str,
        spec: ImageSpec,
        repo: pulumi.Output[str],
        tag: str,
        build_args: dict[str, str],
        opts: pulumi.ResourceOptions,
    ) -> pulumi.Output[str]:
        cfg = self._args.cfg
        token = gcp.organizations.get_client_config_output().access_token
        image = docker_build.Image(
            f"{name}-{spec.name}",
            tags=[repo.apply(lambda r: f"{r}:{tag}")],
            context=docker_build.BuildContextArgs(location=str(spec.context)),
            dockerfile=docker_build.DockerfileArgs(location=str(spec.dockerfile)),
            platforms=[docker_build.Platform.LINUX_AMD64],
            build_args=build_args or None,
            push=True,
            # A preview (every PR) must not build and push images; the digest stays unknown until `up`.
            build_on_preview=False,
            registries=[
                docker_build.RegistryArgs(
                    address=f"{cfg.region}-docker.pkg.dev",
                    username="oauth2accesstoken",
                    password=pulumi.Output.secret(token),
                )
            ],
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
        build = command.local.Command(
            f"{name}-{spec.name}-cloudbuild",
            create=_CLOUD_BUILD_SCRIPT,
            interpreter=["/bin/bash", "-c"],
            environment={
                "CONTEXT": str(spec.context),
                "PROJECT": cfg.project,
                "REGION": cfg.region,
                "CONFIG": str(REPO_ROOT / "infra" / "cloudbuild.yaml"),
                "IMAGE": repo.apply(lambda r: f"{r}:{tag}"),
                "DOCKERFILE": str(spec.dockerfile.relative_to(spec.context)),
                "VLLM_IMAGE": build_args.get("VLLM_IMAGE", ""),
            },
            triggers=[tag, *build_args.values()],
            opts=opts,
        )
        return pulumi.Output.all(repo, build.stdout).apply(lambda parts: f"{parts[0]}@{parts[1].strip()}")
