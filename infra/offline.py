"""Run the Pulumi program offline, under mocks: the engine behind `make plan` and the infra tests.

`run_stack("dev")` loads the real `Pulumi.yaml` defaults and `Pulumi.dev.yaml`, runs
`infra.program.run` with Pulumi's real SDK classes (real argument checks) against a mock
engine, and returns every resource the program declared: type, name, parent,
dependencies, options and inputs (secrets kept wrapped, so tests can check them), plus
the stack outputs.

Decisions
- One `Mocks` class fills the computed outputs a real provider would (emails, digests,
  cluster endpoints) by resource type; everything else echoes the inputs.
- The mock state is reset before each run (`reset_options` then `set_mocks`), so several
  stacks run in one process.
- A secret config value in a stack file is encrypted and cannot be read here; the caller
  passes a stand-in (`hf_token=`), which the program must keep secret end to end.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
import yaml
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime import rpc
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await

REPO_ROOT = Path(__file__).resolve().parents[1]
PROJECT = "gemma-finetune"
MOCK_PROJECT_NUMBER = "123456789012"
# Stand-in for the encrypted hfToken in tests and plans; never a real credential.
MOCK_HF_TOKEN = "mock-hf-token-not-a-real-credential"
SECRET_MARK = "[secret]"


def stack_names() -> list[str]:
    return sorted(p.name[len("Pulumi.") : -len(".yaml")] for p in REPO_ROOT.glob("Pulumi.*.yaml"))


def project_defaults() -> dict[str, Any]:
    """Defaults declared in Pulumi.yaml's config block (the CLI applies them the same way)."""
    project = yaml.safe_load((REPO_ROOT / "Pulumi.yaml").read_text())
    defaults: dict[str, Any] = {}
    for key, decl in (project.get("config") or {}).items():
        if isinstance(decl, dict) and "default" in decl:
            defaults[key] = decl["default"]
    return defaults


def stack_file_config(stack: str) -> dict[str, Any]:
    path = REPO_ROOT / f"Pulumi.{stack}.yaml"
    if not path.exists():
        raise FileNotFoundError(f"no stack file {path.name}; stacks here: {', '.join(stack_names())}")
    data = yaml.safe_load(path.read_text()) or {}
    return dict(data.get("config") or {})


def _full_key(key: str) -> str:
    return key if ":" in key else f"{PROJECT}:{key}"


def _as_config_string(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


@dataclass
class Recorded:
    """One resource the program registered."""

    type: str
    name: str
    urn: str
    parent: str
    custom: bool
    inputs: dict[str, Any]
    dependencies: list[str]
    provider: str
    retain_on_delete: bool
    protect: bool
    custom_timeouts: dict[str, str]
    outputs: dict[str, Any] = field(default_factory=dict)

    def plain_inputs(self) -> dict[str, Any]:
        return unwrap_secrets(self.inputs)

    def redacted_inputs(self) -> dict[str, Any]:
        return redact_secrets(self.inputs)


def is_secret(value: Any) -> bool:
    return rpc.is_rpc_secret(value)


def unwrap_secrets(value: Any) -> Any:
    if rpc.is_rpc_secret(value):
        return unwrap_secrets(rpc.unwrap_rpc_secret(value))
    if isinstance(value, dict):
        return {k: unwrap_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unwrap_secrets(v) for v in value]
    return value


def redact_secrets(value: Any) -> Any:
    """Secrets become "[secret]"; a secret map keeps its keys (a Secret's stringData stays a map)."""
    if rpc.is_rpc_secret(value):
        inner = rpc.unwrap_rpc_secret(value)
        if isinstance(inner, dict):
            return {k: SECRET_MARK for k in inner}
        return SECRET_MARK
    if isinstance(value, dict):
        return {k: redact_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_secrets(v) for v in value]
    return value


# The run id of the finished training run `assume_trained` puts in the bucket, and its export's files.
MOCK_TRAINED_RUN = "0123456789ab"
MOCK_EXPORT_FILES = {"config.json": 900, "model.safetensors": 2_000_000, "tokenizer.json": 30_000}


def _gcs_glob(glob: str) -> re.Pattern[str]:
    """Cloud Storage matchGlob: `**` crosses folders, `*` and `?` do not."""
    out, i = "", 0
    while i < len(glob):
        if glob.startswith("**", i):
            out, i = out + ".*", i + 2
        elif glob[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif glob[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(glob[i]), i + 1
    return re.compile(out)


def _fake_digest(*parts: Any) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class Mocks(pulumi_mocks.Mocks):
    """Fills what a real provider computes; echoes everything else.

    `bucket_objects` maps `bucket/object` to its content for the storage reads the program
    makes (the serving step lists completion markers, then reads the chosen one and lists its
    folder); later entries count as newer (their `updated` time). With `assume_trained` the
    bucket also holds one finished run, `runs/<recipe>-MOCK_TRAINED_RUN/merged/`, as after a
    training run that completed before this `up`.
    """

    def __init__(self, bucket_objects: dict[str, str] | None = None, assume_trained: bool = False) -> None:
        self.bucket_objects = dict(bucket_objects or {})
        self.assume_trained = assume_trained

    def _objects(self, bucket: str, prefix: str) -> dict[str, str]:
        """Object name -> content in `bucket` under `prefix`, the assumed finished run included."""
        found = {k.split("/", 1)[1]: v for k, v in self.bucket_objects.items() if k.split("/", 1)[0] == bucket}
        if self.assume_trained and prefix.startswith("runs/"):
            # the program lists `runs/<recipe>-` or `runs/<recipe>-<run id>/…`
            recipe = prefix[len("runs/") :].split("/", 1)[0].rpartition("-")[0]
            folder = f"runs/{recipe}-{MOCK_TRAINED_RUN}/merged"
            for name, size in MOCK_EXPORT_FILES.items():
                found.setdefault(f"{folder}/{name}", "x" * size)
            inventory = [{"path": n, "bytes": b} for n, b in MOCK_EXPORT_FILES.items()]
            found.setdefault(f"{folder}/_COMPLETE.json", json.dumps({"completed_at": 0, "files": inventory}))
        return {name: content for name, content in found.items() if name.startswith(prefix)}

    def new_resource(self, args: pulumi_mocks.MockResourceArgs) -> tuple[str | None, dict]:
        inputs = dict(args.inputs)
        plain = unwrap_secrets(inputs)
        typ = args.typ
        rid = f"{args.name}-id"
        state = dict(inputs)
        project = plain.get("project", "mock-project")
        if typ == "gcp:serviceaccount/account:Account":
            email = f"{plain['accountId']}@{project}.iam.gserviceaccount.com"
            state.update(
                email=email, name=f"projects/{project}/serviceAccounts/{email}", member=f"serviceAccount:{email}"
            )
        elif typ == "gcp:storage/bucket:Bucket":
            state.update(
                url=f"gs://{plain['name']}", selfLink=f"https://www.googleapis.com/storage/v1/b/{plain['name']}"
            )
            rid = plain["name"]
        elif typ == "gcp:secretmanager/secret:Secret":
            rid = f"projects/{project}/secrets/{plain['secretId']}"
            state.update(name=rid)
        elif typ == "gcp:secretmanager/secretVersion:SecretVersion":
            rid = f"{plain['secret']}/versions/1"
            state.update(name=rid, version="1")
        elif typ == "gcp:artifactregistry/repository:Repository":
            state.update(name=plain["repositoryId"])
        elif typ == "gcp:container/cluster:Cluster":
            state.update(
                endpoint="192.0.2.10",  # TEST-NET-1: never reachable, never contacted
                masterAuth={"clusterCaCertificate": "bW9jay1jYQ==", "clientCertificate": "", "clientKey": ""},
                selfLink=f"https://container.googleapis.com/v1/projects/{project}/locations/x/clusters/{plain.get('name')}",
            )
        elif typ == "docker-build:index:Image":
            digest = _fake_digest(plain.get("tags"), plain.get("labels"))
            state.update(digest=digest, ref=f"{plain['tags'][0]}@{digest}")
        elif typ == "command:local:Command":
            state.update(stdout=_fake_digest(plain.get("environment"), plain.get("triggers")), stderr="")
        elif typ.startswith("gcp:cloudrunv2/"):
            state.update(uri=f"https://{plain.get('name', args.name)}-mock.a.run.app", uid=f"{args.name}-uid")
        elif typ.startswith("kubernetes:") and "metadata" in plain:
            meta = dict(plain.get("metadata") or {})
            meta.setdefault("name", args.name)
            state["metadata"] = meta
        return rid, state

    def call(self, args: pulumi_mocks.MockCallArgs) -> tuple[dict, list[tuple[str, str]]]:
        if args.token == "gcp:organizations/getProject:getProject":
            pid = args.args.get("projectId", "mock-project")
            return {"number": MOCK_PROJECT_NUMBER, "projectId": pid, "name": pid}, []
        if args.token == "gcp:organizations/getClientConfig:getClientConfig":
            return {"accessToken": "mock-access-token", "project": "mock-project", "region": "", "zone": ""}, []
        if args.token == "gcp:storage/getBucketObjectContent:getBucketObjectContent":
            name = str(args.args.get("name"))
            content = self._objects(str(args.args.get("bucket")), name).get(name)
            return {**dict(args.args), "content": content or ""}, []
        if args.token == "gcp:storage/getBucketObjects:getBucketObjects":
            bucket = str(args.args.get("bucket"))
            objects = self._objects(bucket, str(args.args.get("prefix") or ""))
            glob = args.args.get("matchGlob")
            pattern = _gcs_glob(str(glob)) if glob else None
            order = {name: i for i, name in enumerate(self.bucket_objects)}
            listed = [
                {
                    "name": name,
                    "contentType": "application/json" if name.endswith(".json") else "application/octet-stream",
                    "mediaLink": f"https://storage.googleapis.com/download/storage/v1/b/{bucket}/o/{name}",
                    "selfLink": f"https://www.googleapis.com/storage/v1/b/{bucket}/o/{name}",
                    "storageClass": "STANDARD",
                    # later entries of bucket_objects are newer; the assumed run is the oldest
                    "updated": f"2026-01-01T00:{order.get(f'{bucket}/{name}', -1) + 1:02d}:00Z",
                }
                for name in sorted(objects)
                if pattern is None or pattern.fullmatch(name)
            ]
            return {**dict(args.args), "bucketObjects": listed, "id": bucket}, []
        return dict(args.args), []


class RecordingMonitor(pulumi_mocks.MockMonitor):
    """A mock engine that also records parents, dependencies and options of every registration."""

    def __init__(self, mocks: pulumi_mocks.Mocks) -> None:
        super().__init__(mocks)
        self.recorded: list[Recorded] = []

    def RegisterResource(self, request: Any) -> Any:
        response = super().RegisterResource(request)
        if request.type != "pulumi:pulumi:Stack":
            urn = self.make_urn(request.parent, request.type, request.name)
            timeouts = request.customTimeouts
            self.recorded.append(
                Recorded(
                    type=request.type,
                    name=request.name,
                    urn=urn,
                    parent=request.parent,
                    custom=request.custom,
                    inputs=rpc.deserialize_properties(request.object, keep_internal=False),
                    dependencies=list(request.dependencies),
                    provider=request.provider,
                    retain_on_delete=request.retainOnDelete,
                    protect=request.protect,
                    custom_timeouts={
                        k: getattr(timeouts, k) for k in ("create", "update", "delete") if getattr(timeouts, k, "")
                    },
                    outputs=self.resources[urn].state if urn in self.resources else {},
                )
            )
        return response


@dataclass
class StackRun:
    """What one offline run of a stack declared."""

    stack: str
    resources: list[Recorded]
    outputs: dict[str, Any]
    secret_outputs: set[str]

    def of_type(self, typ: str) -> list[Recorded]:
        return [r for r in self.resources if r.type == typ]

    def one(self, typ: str) -> Recorded:
        found = self.of_type(typ)
        if len(found) != 1:
            raise AssertionError(f"expected one {typ} in stack {self.stack}, found {[r.urn for r in found]}")
        return found[0]

    def by_name(self, name: str) -> Recorded:
        for r in self.resources:
            if r.name == name:
                return r
        raise AssertionError(f"no resource named {name} in stack {self.stack}: {[r.name for r in self.resources]}")


def run_stack(
    stack: str,
    overrides: dict[str, Any] | None = None,
    remove: tuple[str, ...] = (),
    hf_token: str | None = MOCK_HF_TOKEN,
    preview: bool = False,
    bucket_objects: dict[str, str] | None = None,
    assume_trained: bool = False,
) -> StackRun:
    """Run the program for `stack` under mocks with its real stack file (plus overrides)."""
    values: dict[str, Any] = {_full_key(k): v for k, v in project_defaults().items()}
    values.update({_full_key(k): v for k, v in stack_file_config(stack).items()})
    secret_keys: list[str] = []
    for key in list(values):
        if isinstance(values[key], dict) and "secure" in values[key]:
            del values[key]  # encrypted in the file; replaced by the stand-in below
    if hf_token is not None:
        values[f"{PROJECT}:hfToken"] = hf_token
        secret_keys.append(f"{PROJECT}:hfToken")
    for key, value in (overrides or {}).items():
        values[_full_key(key)] = value
    for key in remove:
        values.pop(_full_key(key), None)

    pulumi.runtime.reset_options(project=PROJECT, stack=stack, preview=preview)
    pulumi.runtime.set_all_config({k: _as_config_string(v) for k, v in values.items()}, secret_keys)
    mocks = Mocks(bucket_objects=bucket_objects, assume_trained=assume_trained)
    monitor = RecordingMonitor(mocks)
    pulumi.runtime.set_mocks(mocks, project=PROJECT, stack=stack, preview=preview, monitor=monitor)

    from infra.program import run

    result: dict[str, Any] = {}
    secret_outputs: set[str] = set()

    async def resolve_outputs(outputs: dict[str, Any]) -> None:
        for key, value in outputs.items():
            out = pulumi.Output.from_input(value)
            result[key] = await out.future(with_unknowns=True)
            if await out.is_secret():
                secret_outputs.add(key)

    def program() -> Any:
        return resolve_outputs(run())

    try:
        _sync_await(run_pulumi_func(program))
    except Exception as exc:
        # Tests check that bad configuration declared nothing before failing.
        exc.declared_resources = list(monitor.recorded)  # type: ignore[attr-defined]
        raise
    return StackRun(stack=stack, resources=list(monitor.recorded), outputs=result, secret_outputs=secret_outputs)
