"""Run the Pulumi program offline, under mocks: the engine behind `make plan` and the infra tests.

`run_stack("dev")` loads the real `Pulumi.yaml` defaults and `Pulumi.dev.yaml`, runs
`infra.program.run` with Pulumi's real SDK classes (real argument checks) against a mock
engine, and returns every resource the program declared (type, name, parent, dependencies,
options, inputs with secrets kept wrapped) plus the stack outputs.

Decisions (why: docs/program.md#offline-the-real-sdk-under-one-mock-engine)
- One `Mocks` class fills what a real provider computes; everything else echoes the inputs.
- `preview=True` is a first preview: every computed output is the engine's unknown sentinel.
- Invokes answer as for a ready project (reservations, GPU quotas); per-run overrides model the rest.
- Warnings are kept in `StackRun.warnings`; the mock state is reset before each run; a secret from a
  stack file is a stand-in the caller passes (`hf_token=`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pulumi
import yaml
from pulumi.output import Unknown
from pulumi.runtime import mocks as pulumi_mocks
from pulumi.runtime import rpc
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await

from infra.catalog import GKE_GPU_QUOTAS
from infra.config import StackConfig, Workload

REPO_ROOT = Path(__file__).resolve().parents[2]
PROJECT = "gemma-finetune"
MOCK_PROJECT_NUMBER = "123456789012"
# Stand-in for the encrypted hfToken in tests and plans; never a real credential.
MOCK_HF_TOKEN = "mock-hf-token-not-a-real-credential"
# What the provider's client config (`gcp.organizations.get_client_config`) answers as the caller's OAuth
# token: the shape of a Google access token, so a test can find it wherever it would land.
MOCK_ACCESS_TOKEN = "ya29.mock-client-config-access-token-of-the-deploy-identity"
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
    import_id: str = ""
    """The `import_` option: the ID of an existing cloud resource the engine adopts."""
    ignore_changes: list[str] = field(default_factory=list)
    """The `ignore_changes` option, as the engine receives it (input property names)."""
    property_dependencies: dict[str, list[str]] = field(default_factory=dict)
    """Input property -> the URNs its value came from (what the engine makes unknown when one is replaced)."""
    replace_on_changes: list[str] = field(default_factory=list)
    """The `replace_on_changes` option (input property paths)."""
    delete_before_replace: bool | None = None
    """The `delete_before_replace` option, None when the program left it to the provider."""

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


def known_or_sentinel(value: Any) -> Any:
    """`value` with every `Unknown` replaced by the engine's unknown sentinel string (secrets kept wrapped)."""
    if isinstance(value, Unknown):
        return rpc.UNKNOWN
    if rpc.is_rpc_secret(value):
        return rpc.wrap_rpc_secret(known_or_sentinel(rpc.unwrap_rpc_secret(value)))
    if isinstance(value, dict):
        return {k: known_or_sentinel(v) for k, v in value.items()}
    if isinstance(value, list):
        return [known_or_sentinel(v) for v in value]
    return value


def is_unknown(value: Any) -> bool:
    return value == rpc.UNKNOWN


# Zones the mocks list for a region (gcp.compute.get_zones); us-central1 has no "-d" or "-e".
MOCK_ZONES = {"us-central1": ("a", "b", "c", "f")}
# The reservation a stack names, as `gcloud compute reservations describe` would show a healthy one.
MOCK_RESERVATION_MACHINE = "a4-highgpu-8g"
MOCK_RESERVATION_COUNT = 4


# Every GPU quota the mocks are asked for, in every region: enough for any stack here.
MOCK_QUOTA_LIMIT = 64
# The inputs that name the resource an IAM member grants on, in the order the provider's ID has them.
_IAM_RESOURCE_KEYS = ("project", "location", "repository", "bucket", "secretId", "serviceAccountId")


def mock_quota_info(
    service: str,
    quota_id: str,
    value: int = MOCK_QUOTA_LIMIT,
    dimensions: dict[str, str] | None = None,
    locations: tuple[str, ...] = (),
    more: tuple[dict[str, Any], ...] = (),
) -> dict[str, Any]:
    """A `gcp:cloudquota/getSQuotaInfo:getSQuotaInfo` result (camelCase, as on the wire; field names from
    pulumi-gcp 10.2 sdk/python/pulumi_gcp/cloudquota/get_s_quota_info.py and outputs.py): one row with
    `value` for `dimensions` (none: every region) in `locations`, plus the rows in `more`."""
    row = {
        "dimensions": dict(dimensions or {}),
        "details": [{"value": str(value)}],
        "applicableLocations": list(locations),
    }
    return {
        "service": service,
        "quotaId": quota_id,
        "id": f"projects/mock/locations/global/services/{service}/quotaInfos/{quota_id}",
        "name": f"projects/mock/locations/global/services/{service}/quotaInfos/{quota_id}",
        "metric": f"{service}/{quota_id.lower()}",
        "containerType": "PROJECT",
        "dimensions": sorted({*(dimensions or {}), "region"}),
        "dimensionsInfos": [row, *more],
        "isConcurrent": False,
        "isFixed": False,
        "isPrecise": True,
    }


def _default_quota(service: str, quota_id: str) -> dict[str, Any]:
    """`MOCK_QUOTA_LIMIT` everywhere; a quota with more dimensions (the GPU family quota) also names each value the
    catalog asks for in a row of its own, as the check requires (`infra.preflight.quota_limit`)."""
    named = sorted({dims for q in GKE_GPU_QUOTAS.values() if q.quota_id == quota_id for dims in q.dimensions})
    more = tuple(
        {"dimensions": {key: value}, "details": [{"value": str(MOCK_QUOTA_LIMIT)}], "applicableLocations": []}
        for key, value in named
    )
    return mock_quota_info(service, quota_id, more=more)


def mock_zones(region: str) -> list[str]:
    return [f"{region}-{suffix}" for suffix in MOCK_ZONES.get(region, ("a", "b", "c"))]


def mock_reservation(
    project: str,
    zone: str,
    name: str,
    machine_type: str = MOCK_RESERVATION_MACHINE,
    count: int = MOCK_RESERVATION_COUNT,
    in_use: int = 0,
    specific: bool = True,
    shared_with: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A `gcp:compute/getReservation:getReservation` result (camelCase, as on the wire; field names from
    pulumi-gcp 10.2 sdk/python/pulumi_gcp/compute/get_reservation.py and outputs.py)."""
    result: dict[str, Any] = {
        "name": name,
        "project": project,
        "zone": zone,
        "id": f"projects/{project}/zones/{zone}/reservations/{name}",
        "selfLink": f"https://www.googleapis.com/compute/v1/projects/{project}/zones/{zone}/reservations/{name}",
        "creationTimestamp": "2026-11-01T00:00:00.000-07:00",
        "status": "READY",
        "specificReservationRequired": specific,
        "specificReservations": [
            {
                "count": count,
                "inUseCount": in_use,
                "assuredCount": count,
                "instanceProperties": [{"machineType": machine_type, "guestAccelerators": [], "localSsds": []}],
            }
        ],
        "shareSettings": [],
    }
    if shared_with:
        result["shareSettings"] = [
            {
                "shareType": "SPECIFIC_PROJECTS",
                "projects": list(shared_with),
                "projectMaps": [{"id": p, "projectId": p} for p in shared_with],
            }
        ]
    return result


class ProviderError(grpc.RpcError):
    """A provider function failing as it does for real: the engine answers the invoke with a gRPC error, which
    the SDK raises in the program as `Exception("invoke of <token> failed: <details>")`."""

    def __init__(self, details: str) -> None:
        super().__init__(details)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNKNOWN

    def details(self) -> str:
        return self._details


# The run id of the finished training run `assume_trained` puts in the bucket, and its export's files.
MOCK_TRAINED_RUN = "0123456789ab"
MOCK_EXPORT_FILES = {"config.json": 900, "model.safetensors": 2_000_000, "tokenizer.json": 30_000}


def assumed_run(cfg: StackConfig, rid: str = MOCK_TRAINED_RUN) -> dict[str, str]:
    """What one finished run of this stack leaves in its bucket, as the trainer publishes it (trainer/export.py
    `publish_run`): its summary, the adapter and the merged export each with its marker, and on GKE the base it
    staged (trainer/base_weights.py). Its id is `rid` (MOCK_TRAINED_RUN), cut to the stack's run id length."""
    from infra.serving import run_id_length, served_layout
    from trainer.export import SHARED_KV_VALUE_LORA
    from trainer.memory_plan import model_shape
    from trainer.recipe import REPO_ROOT, load_recipe

    recipe = load_recipe(cfg.recipe_source, cfg.recipe_overrides)
    layout = served_layout(cfg, recipe)
    rid = rid[: run_id_length(cfg)]
    folder = layout.folder(rid)
    adapter_config = {
        "r": recipe.lora.r,
        "lora_alpha": recipe.lora.alpha,
        "target_modules": recipe.lora.target_modules,
        "base_model_name_or_path": recipe.model.name_or_path,
        "modules_to_save": recipe.lora.modules_to_save or None,
    }
    exports = {
        "merged": {name: "x" * size for name, size in MOCK_EXPORT_FILES.items()},
        "adapter": {"adapter_config.json": json.dumps(adapter_config), "adapter_model.safetensors": "x" * 4000},
    }
    shape = model_shape(recipe.model.name_or_path, REPO_ROOT)
    shared_kv = [n for n in range(shape.layers) if shape.is_global(n)] if shape is not None and shape.k_eq_v else None
    objects = {f"{folder}/run_summary.json": json.dumps({"recipe": recipe.name, "eval_loss": 0.5})}
    for kind, files in exports.items():
        objects.update({f"{folder}/{kind}/{name}": content for name, content in files.items()})
        marker: dict[str, Any] = {"completed_at": 0, "files": [{"path": n, "bytes": len(c)} for n, c in files.items()]}
        if kind == "adapter" and shared_kv is not None:
            marker[SHARED_KV_VALUE_LORA] = shared_kv  # trainer/export.py add_shared_kv_value_lora
        objects[f"{folder}/{kind}/_COMPLETE.json"] = json.dumps(marker)
    if cfg.workload is not Workload.CLOUD_RUN:
        base = layout.base_folder(rid)
        objects[f"{base}/config.json"] = "{}"
        objects[f"{base}/_BASE_COMPLETE.json"] = json.dumps({"repo_id": recipe.model.name_or_path})
    return objects


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

    `bucket_objects` maps `bucket/object` to its content for the storage reads the program makes
    (later entries are newer); `assume_trained` adds one finished run of the stack (`assumed_run`), or, given run ids,
    one per id (oldest first, all older than `bucket_objects`). `existing_buckets` are already in the project: the
    bucket list answers with them, and creating one fails with 409 unless it is imported.
    `existing_accounts` are service account ids already in the project: creating one fails with 409
    unless the account says `createIgnoreAlreadyExists` (docs/program.md#offline-the-real-sdk-under-one-mock-engine).
    """

    def __init__(
        self,
        bucket_objects: dict[str, str] | None = None,
        assume_trained: bool | tuple[str, ...] = False,
        preview: bool = False,
        reservations: dict[str, dict[str, Any] | ProviderError | None] | None = None,
        project: str = "mock-project",
        existing_buckets: tuple[str, ...] = (),
        quotas: dict[str, dict[str, Any] | ProviderError] | None = None,
        existing_accounts: tuple[str, ...] = (),
    ) -> None:
        self.project = project
        self.quotas = dict(quotas or {})
        self.existing_accounts = set(existing_accounts)
        self.invokes: list[tuple[str, dict[str, Any]]] = []
        self.bucket_objects = dict(bucket_objects or {})
        self.assumed_ids: tuple[str, ...] = (
            (MOCK_TRAINED_RUN,) if assume_trained is True else tuple(assume_trained or ())
        )
        # the validated configuration of the run (set by `run_stack` once the program has loaded it): what a
        # finished run of this stack leaves in its bucket depends on its workload and recipe (`assumed_run`)
        self.stack_cfg: StackConfig | None = None
        self._assumed_objects: dict[str, tuple[str, int]] | None = None
        self.preview = preview
        self.reservations = dict(reservations or {})
        self.existing_buckets = set(existing_buckets)

    def _objects(self, bucket: str, prefix: str) -> dict[str, str]:
        """Object name -> content in `bucket` under `prefix`, the assumed finished run included."""
        found = {k.split("/", 1)[1]: v for k, v in self.bucket_objects.items() if k.split("/", 1)[0] == bucket}
        if prefix.startswith("runs/"):
            for name, (content, _) in self._assumed().items():
                found.setdefault(name, content)
        return {name: content for name, content in found.items() if name.startswith(prefix)}

    def _assumed(self) -> dict[str, tuple[str, int]]:
        """The assumed runs' objects: name -> (content, which run), once the program has loaded its configuration."""
        if self.stack_cfg is None:
            return {}
        if self._assumed_objects is None:
            self._assumed_objects = {
                name: (content, i)
                for i, rid in enumerate(self.assumed_ids)
                for name, content in assumed_run(self.stack_cfg, rid).items()
            }
        return self._assumed_objects

    def _age(self, bucket: str, name: str) -> int:
        """An object's place in time: the assumed runs in their order, then `bucket_objects` in theirs."""
        order = {key: i for i, key in enumerate(self.bucket_objects)}
        if f"{bucket}/{name}" in order:
            return len(self.assumed_ids) + order[f"{bucket}/{name}"]
        return self._assumed().get(name, ("", 0))[1]

    def new_resource(self, args: pulumi_mocks.MockResourceArgs) -> tuple[str | None, dict]:
        rid, state = self._new_resource(args)
        if self.preview:
            # Nothing exists yet: what the cloud computes is unknown, only the inputs are known.
            inputs = known_or_sentinel(dict(args.inputs))
            state = {key: inputs.get(key, rpc.UNKNOWN) for key in state}
        return rid, known_or_sentinel(state)

    def _new_resource(self, args: pulumi_mocks.MockResourceArgs) -> tuple[str, dict]:
        inputs = known_or_sentinel(dict(args.inputs))
        plain = unwrap_secrets(inputs)
        typ = args.typ
        rid = f"{args.name}-id"
        state = dict(inputs)
        project = plain.get("project", "mock-project")
        if typ == "gcp:serviceaccount/account:Account":
            if plain["accountId"] in self.existing_accounts and not plain.get("createIgnoreAlreadyExists"):
                raise Exception(
                    f"Error creating service account: googleapi: Error 409: Service account {plain['accountId']} "
                    f"already exists within project projects/{project}., alreadyExists"
                )
            email = f"{plain['accountId']}@{project}.iam.gserviceaccount.com"
            state.update(
                email=email, name=f"projects/{project}/serviceAccounts/{email}", member=f"serviceAccount:{email}"
            )
        elif typ == "gcp:storage/bucket:Bucket":
            exists = plain["name"] in self.existing_buckets
            if exists and not args.resource_id:
                raise Exception(
                    f"googleapi: Error 409: Your previous request to create the named bucket succeeded "
                    f"and you already own it., conflict ({plain['name']})"
                )
            if args.resource_id and not exists:
                raise Exception(f"importing {args.resource_id}: bucket does not exist (404)")
            state.update(
                url=f"gs://{plain['name']}",
                selfLink=f"https://www.googleapis.com/storage/v1/b/{plain['name']}",
                projectNumber=int(MOCK_PROJECT_NUMBER),
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
        elif typ == "gcp:compute/network:Network":
            # The provider's ID formats (terraform-provider-google google/services/compute: resource_compute_network.go
            # and resource_compute_subnetwork.go, `id`)
            rid = f"projects/{project}/global/networks/{plain['name']}"
            state.update(selfLink=f"https://www.googleapis.com/compute/v1/{rid}")
        elif typ == "gcp:compute/subnetwork:Subnetwork":
            rid = f"projects/{project}/regions/{plain['region']}/subnetworks/{plain['name']}"
            state.update(selfLink=f"https://www.googleapis.com/compute/v1/{rid}")
        elif typ == "gcp:container/cluster:Cluster":
            state.update(
                endpoint="192.0.2.10",  # TEST-NET-1: never reachable, never contacted
                masterAuth={"clusterCaCertificate": "bW9jay1jYQ==", "clientCertificate": "", "clientKey": ""},
                selfLink=f"https://container.googleapis.com/v1/projects/{project}/locations/x/clusters/{plain.get('name')}",
            )
        elif typ.lower().endswith("iammember"):
            # The provider's ID: the resource, the role, the member and any condition (terraform-provider-google
            # google/tpgiamresource/resource_iam_member.go, resourceIamMemberCreate `d.SetId`): a replacement that
            # moves a grant changes it, as it does in the cloud.
            where = [str(plain[k]) for k in _IAM_RESOURCE_KEYS if k in plain]
            condition = plain.get("condition") or {}
            keyed = [condition.get(k, "") for k in ("title", "description", "expression")] if condition else []
            kind, _, principal = str(plain["member"]).partition(":")  # the email lower-cased, not the kind
            rid = "/".join([*where, str(plain["role"]), f"{kind}:{principal.lower()}", *keyed])
        elif typ == "docker-build:index:Image":
            digest = _fake_digest(plain.get("tags"), plain.get("labels"))
            state.update(digest=digest, ref=f"{plain['tags'][0]}@{digest}")
        elif typ == "command:local:Command":
            state.update(stdout=_fake_digest(plain.get("environment"), plain.get("triggers")), stderr="")
        elif typ.startswith("gcp:cloudrunv2/"):
            state.update(uri=f"https://{plain.get('name', args.name)}-mock.a.run.app", uid=f"{args.name}-uid")
        elif typ.startswith("kubernetes:") and isinstance(plain.get("metadata"), dict):
            meta = dict(plain.get("metadata") or {})
            meta.setdefault("name", args.name)
            state["metadata"] = meta
        return rid, state

    def call(self, args: pulumi_mocks.MockCallArgs) -> tuple[dict, list[tuple[str, str]]]:
        self.invokes.append((args.token, dict(args.args)))
        if args.token == "gcp:organizations/getProject:getProject":
            pid = args.args.get("projectId", "mock-project")
            return {"number": MOCK_PROJECT_NUMBER, "projectId": pid, "name": pid}, []
        if args.token == "gcp:organizations/getClientConfig:getClientConfig":
            return {"accessToken": MOCK_ACCESS_TOKEN, "project": "mock-project", "region": "", "zone": ""}, []
        if args.token == "gcp:compute/getZones:getZones":
            region = args.args.get("region", "us-central1")
            return {**dict(args.args), "id": region, "names": mock_zones(region)}, []
        if args.token == "gcp:compute/getReservation:getReservation":
            return self._reservation(dict(args.args)), []
        if args.token == "gcp:cloudquota/getSQuotaInfo:getSQuotaInfo":
            found = self.quotas.get(args.args["quotaId"])
            if isinstance(found, ProviderError):
                raise found
            if found is not None:  # {} is the data source's answer for a quota it does not know
                return found, []
            return _default_quota(args.args["service"], args.args["quotaId"]), []
        if args.token == "gcp:storage/getBuckets:getBuckets":
            prefix = args.args.get("prefix") or ""
            names = sorted(b for b in self.existing_buckets if b.startswith(prefix))
            return {**dict(args.args), "buckets": [{"name": n, "selfLink": "", "labels": {}} for n in names]}, []
        if args.token == "gcp:storage/getBucketObjectContent:getBucketObjectContent":
            name = str(args.args.get("name"))
            content = self._objects(str(args.args.get("bucket")), name).get(name)
            return {**dict(args.args), "content": content or ""}, []
        if args.token == "gcp:storage/getBucketObjects:getBucketObjects":
            bucket = str(args.args.get("bucket"))
            objects = self._objects(bucket, str(args.args.get("prefix") or ""))
            glob = args.args.get("matchGlob")
            pattern = _gcs_glob(str(glob)) if glob else None
            listed = [
                {
                    "name": name,
                    "contentType": "application/json" if name.endswith(".json") else "application/octet-stream",
                    "mediaLink": f"https://storage.googleapis.com/download/storage/v1/b/{bucket}/o/{name}",
                    "selfLink": f"https://www.googleapis.com/storage/v1/b/{bucket}/o/{name}",
                    "storageClass": "STANDARD",
                    # later entries of bucket_objects are newer; the assumed runs are older, in their order
                    "updated": f"2026-01-01T00:{self._age(bucket, name):02d}:00Z",
                }
                for name in sorted(objects)
                if pattern is None or pattern.fullmatch(name)
            ]
            return {**dict(args.args), "bucketObjects": listed, "id": bucket}, []
        return dict(args.args), []

    def _reservation(self, query: dict[str, Any]) -> dict[str, Any]:
        """The reservation at project/zone/name: as configured in `reservations`, else the healthy default in
        the region's first zone. Not found answers with the query only, as the provider's data source does
        (terraform-provider-google data_source_google_compute_reservation.go reads through the resource's
        Read, which on 404 clears the id and returns no error: every other field stays empty)."""
        project, zone, name = query.get("project", "mock-project"), query["zone"], query["name"]
        key = f"{project}/{zone}/{name}"
        if key in self.reservations:
            found = self.reservations[key]
        elif any(k.startswith(f"{project}/") and k.endswith(f"/{name}") for k in self.reservations):
            found = None  # configured, but in another zone
        else:
            region = zone.rsplit("-", 1)[0]
            shared = (self.project,) if project != self.project else ()
            found = mock_reservation(project, zone, name, shared_with=shared) if zone == mock_zones(region)[0] else None
        if isinstance(found, ProviderError):
            raise found
        return found if found is not None else {"name": name, "zone": zone, "project": project, "id": ""}


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
                    inputs=known_or_sentinel(rpc.deserialize_properties(request.object, keep_internal=False)),
                    dependencies=list(request.dependencies),
                    provider=request.provider,
                    retain_on_delete=request.retainOnDelete,
                    protect=request.protect,
                    custom_timeouts={
                        k: getattr(timeouts, k) for k in ("create", "update", "delete") if getattr(timeouts, k, "")
                    },
                    outputs=self.resources[urn].state if urn in self.resources else {},
                    import_id=request.importId,
                    ignore_changes=list(request.ignoreChanges),
                    property_dependencies={
                        key: list(deps.urns) for key, deps in request.propertyDependencies.items() if deps.urns
                    },
                    replace_on_changes=list(request.replaceOnChanges),
                    delete_before_replace=request.deleteBeforeReplace if request.deleteBeforeReplaceDefined else None,
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
    invokes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    """Every provider function the program called (token, arguments), in order."""
    warnings: list[str] = field(default_factory=list)
    """Every warning the program logged (`pulumi.log.warn`)."""
    cfg: StackConfig | None = None
    """The validated configuration the program ran with."""

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


def mock_engine(
    stack: str,
    overrides: dict[str, Any] | None = None,
    remove: tuple[str, ...] = (),
    hf_token: str | None = MOCK_HF_TOKEN,
    preview: bool = False,
    bucket_objects: dict[str, str] | None = None,
    assume_trained: bool | tuple[str, ...] = False,
    reservations: dict[str, dict[str, Any] | ProviderError | None] | None = None,
    existing_buckets: tuple[str, ...] = (),
    quotas: dict[str, dict[str, Any] | ProviderError] | None = None,
    existing_accounts: tuple[str, ...] = (),
) -> tuple[Mocks, RecordingMonitor, _WarningRecorder]:
    """Set the stack's configuration and the mock engine for one run, as the CLI would set the
    configuration and the engine before it starts the program (`run_stack`'s arguments)."""
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
    mocks = Mocks(
        bucket_objects=bucket_objects,
        assume_trained=assume_trained,
        preview=preview,
        reservations=reservations,
        project=str(values.get("gcp:project", "mock-project")),
        existing_buckets=existing_buckets,
        quotas=quotas,
        existing_accounts=existing_accounts,
    )
    monitor = RecordingMonitor(mocks)
    warnings = _WarningRecorder()
    pulumi.runtime.set_mocks(
        mocks, project=PROJECT, stack=stack, preview=preview, monitor=monitor, logger=warnings.logger
    )
    return mocks, monitor, warnings


def run_stack(
    stack: str,
    overrides: dict[str, Any] | None = None,
    remove: tuple[str, ...] = (),
    hf_token: str | None = MOCK_HF_TOKEN,
    preview: bool = False,
    bucket_objects: dict[str, str] | None = None,
    assume_trained: bool | tuple[str, ...] = False,
    reservations: dict[str, dict[str, Any] | ProviderError | None] | None = None,
    existing_buckets: tuple[str, ...] = (),
    quotas: dict[str, dict[str, Any] | ProviderError] | None = None,
    existing_accounts: tuple[str, ...] = (),
) -> StackRun:
    """Run the program for `stack` under mocks with its real stack file (plus overrides).

    `preview=True` runs it as a first `pulumi preview` (see the module docstring)."""
    mocks, monitor, warnings = mock_engine(
        stack,
        overrides=overrides,
        remove=remove,
        hf_token=hf_token,
        preview=preview,
        bucket_objects=bucket_objects,
        assume_trained=assume_trained,
        reservations=reservations,
        existing_buckets=existing_buckets,
        quotas=quotas,
        existing_accounts=existing_accounts,
    )

    from infra import config as stack_config
    from infra.program import run

    result: dict[str, Any] = {}
    secret_outputs: set[str] = set()

    async def resolve_outputs(outputs: dict[str, Any]) -> None:
        for key, value in outputs.items():
            out = pulumi.Output.from_input(value)
            result[key] = known_or_sentinel(await out.future(with_unknowns=True))
            if await out.is_secret():
                secret_outputs.add(key)

    loaded: list[StackConfig] = []

    def program() -> Any:
        loaded.append(stack_config.load().cfg)
        mocks.stack_cfg = loaded[-1]
        return resolve_outputs(run())

    try:
        _sync_await(run_pulumi_func(program))
    except Exception as exc:
        # Tests check that bad configuration declared nothing before failing.
        exc.declared_resources = list(monitor.recorded)  # type: ignore[attr-defined]
        exc.invokes = list(mocks.invokes)  # type: ignore[attr-defined]
        exc.warnings = list(warnings.messages)  # type: ignore[attr-defined]
        raise
    return StackRun(
        stack=stack,
        resources=list(monitor.recorded),
        outputs=result,
        secret_outputs=secret_outputs,
        invokes=list(mocks.invokes),
        warnings=list(warnings.messages),
        cfg=loaded[0] if loaded else None,
    )


class _WarningRecorder(logging.Handler):
    """The mock engine's logger for one run: keeps the warning messages (other levels pass through)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []
        self.logger = logging.Logger(f"{__name__}.run")  # not registered globally: one per run
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
