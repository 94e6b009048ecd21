"""The one-time CI setup (infra/bootstrap/ci-setup.sh) grants exactly what ci-identities.yaml lists, and nothing
it grants reaches too far.

The script runs for real (bash, `set -euo pipefail`) against a recording `gcloud` on PATH that remembers
what was created, so its control flow, idempotency and input checks are exercised; the recorded calls
are parsed into grants and compared with the list, expanded with the same rules the permission proof uses
(infra/offline/permissions.py `ci_grant_applies`). That the list is what the program needs, no less and no more, is
the permission proof's job (tests/infra/test_permissions.py); the checks here are the setup's own: no role
that reaches every account, the state or the IAM policy unconditioned, previews that only read.
"""

from __future__ import annotations

import json
import re
import socketserver
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import celpy
import pytest

from infra.offline.api_permissions import Need, Scope
from infra.offline.engine import REPO_ROOT, StackRun, run_stack, stack_names
from infra.offline.permissions import ci_grant_applies, ci_grants, ci_identities, covers, permissions_of
from tests.lint.conftest import ci_module, fake_command

BOOTSTRAP = REPO_ROOT / "infra" / "bootstrap"
SCRIPT = BOOTSTRAP / "ci-setup.sh"
IDENTITIES = ci_identities()
ci_stacks = ci_module("stacks")

VALUES = {
    "PROJECT_ID": "gft-test-project",
    "PROJECT_NUMBER": "123456789012",
    "GITHUB_REPO": "acme/gemma-finetune",
    "GITHUB_REPO_ID": "811246203",
    "GITHUB_OWNER_ID": "5123456",
}
STATE_BUCKET = f"{VALUES['PROJECT_ID']}-pulumi-state"
KEYRING = f"projects/{VALUES['PROJECT_ID']}/locations/global/keyRings/gft-pulumi"


def stack_key(stack: str) -> str:
    """Each stack's own KMS key (ci-identities.yaml `state-key`)."""
    return f"gft-{stack}"


FEDERATION_APIS = {
    "sts.googleapis.com",
    "iamcredentials.googleapis.com",
    "iam.googleapis.com",
    "cloudresourcemanager.googleapis.com",
    "serviceusage.googleapis.com",
}
# Never on the project for a CI identity: each reaches every account, bucket, secret or the policy itself.
FORBIDDEN_PROJECT_ROLES = {
    "roles/owner",
    "roles/editor",
    "roles/viewer",
    "roles/iam.serviceAccountUser",
    "roles/iam.serviceAccountAdmin",
    "roles/iam.serviceAccountTokenCreator",
    "roles/iam.workloadIdentityUser",
    "roles/iam.securityAdmin",
    "roles/resourcemanager.projectIamAdmin",
    "roles/storage.admin",
    "roles/secretmanager.admin",
}
# Permissions an unconditioned project grant must not carry: impersonation of any account, IAM policy
# changes (the federation gate itself), every object (the state), every secret, every key, the APIs.
FORBIDDEN_PROJECT_PERMISSIONS = {
    "iam.serviceAccounts.actAs",
    "iam.serviceAccounts.setIamPolicy",
    "iam.serviceAccounts.getAccessToken",
    "iam.serviceAccounts.signBlob",
    "iam.serviceAccounts.signJwt",
    "iam.serviceAccounts.implicitDelegation",
    "iam.serviceAccountKeys.create",
    "resourcemanager.projects.setIamPolicy",
    "iam.roles.update",
    "iam.googleapis.com/workloadIdentityPoolProviders.update",
    "storage.buckets.setIamPolicy",
    "storage.objects.get",
    "storage.objects.create",
    "secretmanager.versions.access",
    "secretmanager.secrets.setIamPolicy",
    "cloudkms.cryptoKeyVersions.useToDecrypt",
    "serviceusage.services.enable",
    "serviceusage.services.disable",
}
READ_VERBS = ("get", "list", "useToDecrypt")

# The billing account the fake `gcloud billing projects describe` says the project is billed to.
PROJECT_BILLING_ACCOUNT = "0A1B2C-3D4E5F-6A7B8C"

# The recording gcloud on PATH is a bash client, not a Python process per call (a run makes ~150 calls): it sends
# its argv, NUL-separated, to the recorder below (fake_gcloud) over 127.0.0.1 and prints what it answers.
GCLOUD_CLIENT = r"""#!/usr/bin/env bash
exec 3<>"/dev/tcp/127.0.0.1/$FAKE_GCLOUD_PORT"
printf '%s\0' "$#" "$@" >&3
IFS= read -r rc <&3
cat <&3
exit "$rc"
"""
GCLOUD_VERBS = ("describe", "create", "create-oidc", "update-oidc", "update", "enable", "add-iam-policy-binding")


def _gcloud_key(argv: list[str]) -> str:
    index = next(i for i, a in enumerate(argv) if a in GCLOUD_VERBS)
    name = next((a for a in argv[index + 1 :] if not a.startswith("-")), "")
    if argv[:2] == ["iam", "service-accounts"]:
        name = name.split("@")[0]
    scoped = [a for a in argv if a.startswith(("--workload-identity-pool=", "--keyring="))]
    return " ".join([*argv[:index], name, *scoped])


def fake_gcloud(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """One gcloud call: logs argv (a JSON line in FAKE_LOG), remembers what `create` made and what
    add-iam-policy-binding bound (files beside FAKE_GCLOUD_STATE, so the memory outlives a run), answers `describe`,
    `list` and `get-iam-policy` from that memory. Returns the exit code and the standard output."""
    out: list[str] = []
    with open(env["FAKE_LOG"], "a") as log:
        log.write(json.dumps(args) + "\n")
    state_path = Path(env["FAKE_GCLOUD_STATE"])
    state = set(json.loads(state_path.read_text())) if state_path.exists() else set()
    policies_path = Path(f"{state_path}.policies")
    policies = json.loads(policies_path.read_text()) if policies_path.exists() else {}

    def target_of(verb: str) -> str:
        return " ".join([*args[: args.index(verb)], args[args.index(verb) + 1]])

    def condition_of() -> dict[str, str] | None:
        given = next((a.split("=", 1)[1] for a in args if a.startswith("--condition=")), "None")
        if given == "None":
            return None
        items = dict(item.split("=", 1) for item in given.removeprefix("^;^").split(";"))
        return {"expression": items["expression"], "title": items.get("title", "")}

    def flag(name: str) -> str:
        return next(a.split("=", 1)[1] for a in args if a.startswith(f"--{name}="))

    for verb in ("add-iam-policy-binding", "remove-iam-policy-binding"):
        if verb in args:
            entry = {"role": flag("role"), "member": flag("member"), "condition": condition_of()}
            bound = [e for e in policies.get(target_of(verb), []) if e != entry]
            policies[target_of(verb)] = bound + ([entry] if verb.startswith("add") else [])
            policies_path.write_text(json.dumps(policies))
            return 0, ""
    if args[:2] == ["projects", "get-iam-policy"] and any(a.startswith("--flatten") for a in args):
        return 0, env.get("FAKE_LEGACY_BUILD_ROLES", "") + "\n"  # the roles of the filtered member, one per line
    if "get-iam-policy" in args:
        bindings = []
        for entry in policies.get(target_of("get-iam-policy"), []):
            binding = {"role": entry["role"], "members": [entry["member"]]}
            if entry["condition"]:
                binding["condition"] = entry["condition"]
            bindings.append(binding)
        return 0, json.dumps({"bindings": bindings}) + "\n"
    if args[:3] == ["kms", "keys", "list"]:
        for made in sorted(state):
            if made.startswith("kms keys ") and "--keyring=" in made:
                out.append(f"projects/p/locations/global/keyRings/gft-pulumi/cryptoKeys/{made.split()[2]}\n")
        return 0, "".join(out)
    if args[:3] == ["iam", "service-accounts", "list"]:
        for made in sorted(state):
            if made.startswith("iam service-accounts "):
                out.append(made.split()[2] + f"@{VALUES['PROJECT_ID']}.iam.gserviceaccount.com\n")
        return 0, "".join(out)
    if args[:2] == ["projects", "describe"]:
        return 0, VALUES["PROJECT_NUMBER"] + "\n"
    if args[:3] == ["billing", "projects", "describe"]:
        return 0, f"billingAccounts/{PROJECT_BILLING_ACCOUNT}\n"
    if args[:2] == ["builds", "get-default-service-account"]:  # value(serviceAccountEmail)
        compute = f"projects/p/serviceAccounts/{VALUES['PROJECT_NUMBER']}-compute@developer.gserviceaccount.com"
        return 0, env.get("FAKE_DEFAULT_BUILD_ACCOUNT", compute) + "\n"
    verb = next((a for a in args if a in GCLOUD_VERBS), None)
    if verb == "describe":
        return (0 if _gcloud_key(args) in state else 1), ""
    if verb in ("create", "create-oidc"):
        state.add(_gcloud_key(args))
        state_path.write_text(json.dumps(sorted(state)))
    return 0, ""


class _GcloudRecorder(socketserver.ThreadingTCPServer):
    """Answers the bash clients' calls one at a time with fake_gcloud; what went wrong in it fails the test."""

    daemon_threads = True

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(("127.0.0.1", 0), _GcloudCall)
        self.env = env
        self.lock = threading.Lock()
        self.errors: list[str] = []


class _GcloudCall(socketserver.StreamRequestHandler):
    server: _GcloudRecorder

    def handle(self) -> None:
        received = b""
        while True:  # argc, then that many arguments, each ending in NUL
            parts = received.split(b"\0")
            if len(parts) > 1 and len(parts) - 2 >= int(parts[0]):
                break
            chunk = self.request.recv(65536)
            if not chunk:
                raise ConnectionError(f"the client hung up after {received!r}")
            received += chunk
        args = [part.decode() for part in parts[1 : 1 + int(parts[0])]]
        with self.server.lock:
            try:
                code, output = fake_gcloud(args, self.server.env)
            except Exception:  # reported by run_setup: a broken fake must not pass as a gcloud error
                self.server.errors.append(f"{args}: {traceback.format_exc()}")
                code, output = 1, ""
        self.wfile.write(f"{code}\n{output}".encode())


@dataclass(frozen=True)
class Grant:
    identity: str
    role: str
    on: str
    condition: str | None = None


@dataclass
class SetupRun:
    returncode: int
    stdout: str
    stderr: str
    calls: list[list[str]] = field(default_factory=list)

    def grants(self) -> set[Grant]:
        return {grant for call in self.calls if (grant := _grant(call)) is not None}

    def verbs(self, *verbs: str) -> list[list[str]]:
        return [call for call in self.calls if any(verb in call for verb in verbs)]


def _flag(call: list[str], name: str) -> str:
    prefix = f"--{name}="
    return next(arg[len(prefix) :] for arg in call if arg.startswith(prefix))


def _identity(member: str) -> str | None:
    match = re.fullmatch(
        r"serviceAccount:([a-z0-9-]+)@" + re.escape(VALUES["PROJECT_ID"]) + r"\.iam\.gserviceaccount\.com", member
    )
    return match.group(1) if match else None


def _grant(call: list[str]) -> Grant | None:
    """A recorded `… add-iam-policy-binding` as (identity, role, resource, condition); federation is elsewhere."""
    if "add-iam-policy-binding" not in call:
        return None
    identity = _identity(_flag(call, "member"))
    if identity is None:
        return None
    role = _flag(call, "role")
    target = call[call.index("add-iam-policy-binding") + 1]
    if call[:2] == ["projects", "add-iam-policy-binding"]:
        condition = _flag(call, "condition")
        expression = None
        if condition != "None":  # gcloud topic escaping: `^;^` makes `;` the separator of the condition's items
            expression = re.fullmatch(r"\^;\^expression=([^;]*);title=[^;]*", condition).group(1)  # type: ignore[union-attr]
        return Grant(identity, role, "project", expression)
    if call[:2] == ["iam", "service-accounts"]:
        return Grant(identity, role, f"account:{target}")
    if call[:2] == ["storage", "buckets"]:
        conditions = [a for a in call if a.startswith("--condition=")]
        expression = None
        if conditions:
            expression = re.fullmatch(r"\^;\^expression=([^;]*);title=[^;]*", _flag(call, "condition")).group(1)  # type: ignore[union-attr]
        return Grant(identity, role, f"bucket:{target.removeprefix('gs://')}", expression)
    if call[:2] == ["kms", "keys"]:
        return Grant(identity, role, f"key:{target}")
    if call[:2] == ["billing", "accounts"]:
        return Grant(identity, role, f"billing-account:{target}")
    raise AssertionError(f"unexpected binding command {call}")


# A recording Pulumi CLI: `stack ls --json` answers FAKE_PULUMI_STACKS (the stacks the backend holds).
FAKE_PULUMI = r"""#!{python}
import json, os, sys

with open(os.environ["FAKE_PULUMI_LOG"], "a") as log:
    log.write(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "backend": os.environ.get("PULUMI_BACKEND_URL")}) + "\n")
if sys.argv[1:3] == ["stack", "ls"]:
    print(json.dumps([{"name": name} for name in os.environ.get("FAKE_PULUMI_STACKS", "").split()]))
"""


def pulumi_calls(tmp_path: Path) -> list[dict[str, Any]]:
    """What the setup asked of the Pulumi CLI (argv, working directory, backend)."""
    log = tmp_path / "pulumi-calls.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def run_setup(tmp_path: Path, repo: Path = REPO_ROOT, **overrides: str) -> SetupRun:
    """Run ci-setup.sh with a recording gcloud and pulumi; the recorder's memory persists in tmp_path between runs."""
    base, log = fake_command(tmp_path, "gcloud", GCLOUD_CLIENT)
    fake_command(tmp_path, "pulumi", FAKE_PULUMI)
    # The script's `python3` (.ci/stacks.py, the stale-grant filter): the interpreter the tests run on, outside the
    # venv, called directly (a pyenv shim on PATH costs a chain of bash processes a call, ~20 calls a run).
    python3, interpreter = tmp_path / "bin" / "python3", Path(sys.base_prefix) / "bin" / "python3"
    if interpreter.exists() and not python3.exists():
        python3.symlink_to(interpreter)
    state = tmp_path / "gcloud-state.json"
    env = {
        **base,
        "FAKE_PULUMI_LOG": str(tmp_path / "pulumi-calls.jsonl"),
        "FAKE_GCLOUD_STATE": str(state),
        "REPO_ROOT": str(repo),
        **{k: v for k, v in VALUES.items() if k != "PROJECT_NUMBER"},
        **overrides,
    }
    with _GcloudRecorder(env) as recorder:
        env["FAKE_GCLOUD_PORT"] = str(recorder.server_address[1])
        serving = threading.Thread(target=recorder.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        serving.start()
        try:
            result = subprocess.run(
                ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120, check=False
            )
        finally:
            recorder.shutdown()
    assert not recorder.errors, recorder.errors
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return SetupRun(result.returncode, result.stdout, result.stderr, calls)


def substitute(text: str, stack: str = "") -> str:
    for name, value in {**VALUES, "STACK": stack}.items():
        text = text.replace("${" + name + "}", value)
    return " ".join(text.split())


def committed_stacks() -> dict[str, tuple[str, list[str]]]:
    """Every stack file as the setup reads it: name -> (workload, features)."""
    features = ci_stacks.stack_features()
    return {name: (workload, features[name]) for name, workload in ci_stacks.stacks().items()}


def expected_grants(found_stacks: dict[str, tuple[str, list[str]]], backend: str = "bucket") -> set[Grant]:
    """The list, expanded for these stacks and this backend, as the grants the script must make: a project,
    state-bucket or state-key grant once if any stack gets it, a workload-account grant per stack."""
    grants: set[Grant] = set()
    for identity, spec in IDENTITIES["identities"].items():
        for grant in spec["grants"]:
            role = substitute(grant["role"])
            scope = grant["scope"]
            stacks = [
                s
                for s, (workload, features) in found_stacks.items()
                if ci_grant_applies(identity, grant, workload, features)
            ]
            if not stacks:
                continue
            condition = grant.get("condition")
            if scope == "project" and "${STACK}" in (condition or ""):  # a binding per stack
                grants |= {Grant(identity, role, "project", substitute(condition, stack)) for stack in stacks}
            elif scope == "project":
                grants.add(Grant(identity, role, "project", substitute(condition) if condition else None))
            elif scope == "state-bucket":
                if backend == "bucket":
                    grants.add(
                        Grant(identity, role, f"bucket:{STATE_BUCKET}", substitute(condition) if condition else None)
                    )
            elif scope == "state-key":
                if backend == "bucket":
                    grants |= {Grant(identity, role, f"key:{stack_key(stack)}") for stack in stacks}
            elif scope == "billing-account":
                grants.add(Grant(identity, role, f"billing-account:{PROJECT_BILLING_ACCOUNT}"))
            elif scope == "workload-account":
                for stack in stacks:
                    email = f"gft-{stack}-{grant['account']}@{VALUES['PROJECT_ID']}.iam.gserviceaccount.com"
                    grants.add(Grant(identity, role, f"account:{email}"))
            else:
                raise AssertionError(f"{identity}: unknown scope {scope}")
    return grants


def a_repository(tmp_path: Path, stack_files: dict[str, str]) -> Path:
    """A checkout with these stack files only (and the real Pulumi.yaml and .ci/stacks.py)."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    (repo / ".ci" / "stacks.py").write_text((REPO_ROOT / ".ci" / "stacks.py").read_text())
    (repo / "Pulumi.yaml").write_text((REPO_ROOT / "Pulumi.yaml").read_text())
    for name, text in stack_files.items():
        (repo / name).write_text(text)
    return repo


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SetupRun]:
    tmp_path = tmp_path_factory.mktemp("setup")
    run = run_setup(tmp_path)
    assert run.returncode == 0, run.stderr + run.stdout
    return tmp_path, run


def _role_permissions(role: str) -> set[str]:
    return set(permissions_of(role, "ci-identities.yaml"))


def _all_grants() -> list[tuple[str, dict[str, Any]]]:
    return [(identity, grant) for identity, spec in IDENTITIES["identities"].items() for grant in spec["grants"]]


class TestTheScriptGrantsTheList:
    """What the script does in the cloud is what the list says, nothing more and nothing less."""

    @pytest.mark.slow
    def test_grants_equal_the_list(self, first_run: tuple[Path, SetupRun]) -> None:
        _, run = first_run
        expected = expected_grants(committed_stacks())
        granted = run.grants()
        assert granted - expected == set(), f"granted but not in ci-identities.yaml: {granted - expected}"
        assert expected - granted == set(), f"in ci-identities.yaml but not granted: {expected - granted}"

    @pytest.mark.slow
    def test_custom_roles_hold_exactly_their_permissions(self, first_run: tuple[Path, SetupRun]) -> None:
        _, run = first_run
        created = {
            call[call.index("create") + 1]: _flag(call, "permissions")
            for call in run.verbs("create")
            if call[:2] == ["iam", "roles"]
        }
        assert created == {name: ",".join(spec["permissions"]) for name, spec in IDENTITIES["custom_roles"].items()}

    @pytest.mark.slow
    def test_apis_equal_the_list(self, first_run: tuple[Path, SetupRun]) -> None:
        _, run = first_run
        [enable] = run.verbs("enable")
        assert set(enable[2 : enable.index(next(a for a in enable if a.startswith("--")))]) == set(IDENTITIES["apis"])

    def test_every_role_the_script_names_is_in_the_list(self) -> None:
        """Static pass over the script, for branches one run does not take (e.g. a backend it did not use)."""
        listed = {substitute(g["role"]).replace(VALUES["PROJECT_ID"], "$PROJECT_ID") for _, g in _all_grants()}
        listed |= {"roles/iam.workloadIdentityUser", "roles/cloudkms.cryptoKeyDecrypter"}
        # The roles a modifiedGrantsByRole condition lets the deploy identity grant.
        listed |= set(re.findall(r"roles/[a-zA-Z.]+", " ".join(g.get("condition", "") for _, g in _all_grants())))
        text = SCRIPT.read_text()
        named = set(re.findall(r"(?<![/\w])roles/[a-zA-Z.]+", text)) | {
            f"projects/$PROJECT_ID/roles/{custom}" for custom in re.findall(r'"\$custom/(\w+)"', text)
        }
        assert named <= listed, f"roles in ci-setup.sh that ci-identities.yaml does not explain: {named - listed}"
        project_roles = set(re.findall(r"^grant_project \S+ (\S+)", text, re.MULTILINE))
        assert not project_roles & FORBIDDEN_PROJECT_ROLES - {"roles/storage.admin", "roles/secretmanager.admin"}
        for role in ("roles/storage.admin", "roles/secretmanager.admin"):
            for line in re.findall(rf"^grant_project \S+ {re.escape(role)}(.*)$", text, re.MULTILINE):
                assert line.strip(), f"{role} is granted on the project without a condition"


class TestLeastPrivilege:
    """Nothing the setup grants reaches too far (whether each grant is needed: tests/infra/test_permissions.py)."""

    @pytest.mark.parametrize(("identity", "grant"), _all_grants(), ids=lambda v: v if isinstance(v, str) else v["role"])
    def test_every_grant_says_why_and_its_role_has_data(self, identity: str, grant: dict[str, Any]) -> None:
        assert str(grant.get("for", "")).strip(), f"{identity}: {grant['role']} says no reason"
        assert _role_permissions(grant["role"]), grant["role"]

    def test_custom_roles_exist_for_what_no_predefined_role_holds_alone(self) -> None:
        """Each custom role is small, and the project's IAM policy is changed only under a condition on the roles."""
        for name, spec in IDENTITIES["custom_roles"].items():
            # the Workload Identity binder: read one account, read and write its IAM policy; the fence applier: apply one
            # ClusterRole and its binding (get, create, update each) with escalate and bind (infra/admission.py), which
            # otherwise only roles/container.admin holds, with every other Kubernetes permission; the log-based metric
            # writer: the four calls of one resource type, which only roles that also route logs elsewhere hold, and
            # the descriptor list that says when Cloud Monitoring knows a new metric
            most = {"gftCiWorkloadIdentityBinder": 3, "gftCiAdmissionFenceApplier": 8, "gftCiLogMetricWriter": 5}.get(
                name, 2
            )
            assert 1 <= len(spec["permissions"]) <= most, name
        for identity, grant in _all_grants():
            if "resourcemanager.projects.setIamPolicy" in _role_permissions(grant["role"]):
                assert "modifiedGrantsByRole" in grant.get("condition", ""), f"{identity}: {grant['role']}"
            if "iam.serviceAccounts.setIamPolicy" in _role_permissions(grant["role"]):
                assert grant["scope"] == "workload-account", f"{identity}: {grant['role']} reaches other accounts"

    @pytest.mark.slow
    def test_no_forbidden_role_on_the_project_without_a_condition(self, first_run: tuple[Path, SetupRun]) -> None:
        _, run = first_run
        for grant in run.grants():
            if grant.on == "project" and grant.condition is None:
                assert grant.role not in FORBIDDEN_PROJECT_ROLES, grant
                reach = _role_permissions(grant.role)
                assert not reach & FORBIDDEN_PROJECT_PERMISSIONS, f"{grant}: {reach & FORBIDDEN_PROJECT_PERMISSIONS}"

    def test_conditioned_grants_are_limited_to_the_stacks_buckets_and_secrets(self) -> None:
        for identity, grant in _all_grants():
            if "condition" not in grant or "modifiedGrantsByRole" in grant["condition"]:
                continue
            service = grant["role"].split("/")[1].split(".")[0]
            prefixes = {"storage": "projects/_/buckets/${PROJECT_ID}-gft-", "secretmanager": "/secrets/gft-"}
            if grant["scope"] == "state-bucket":  # the lock objects of the state bucket, never the checkpoints
                prefixes["storage"] = "projects/_/buckets/${PROJECT_ID}-pulumi-state/objects/.pulumi/locks/"
            assert service in prefixes, f"{identity}: IAM Conditions on {service} names are not relied on here"
            clause = r"resource\.name(?:\.startsWith\('([^']+)'\)| == '([^']+)')"
            clauses = ["".join(found) for found in re.findall(clause, grant["condition"])]
            assert clauses and all(prefixes[service] in clause for clause in clauses), grant["condition"]
            assert set(re.sub(clause, "", grant["condition"]).split()) <= {"||"}

    def test_unreviewed_previews_only_read(self) -> None:
        """Any branch of the repository can run the Cloud Run preview: it must not write anything anywhere."""
        reach: set[str] = set()
        for grant in IDENTITIES["identities"]["gft-ci-preview"]["grants"]:
            reach |= _role_permissions(grant["role"])
        writes = sorted(p for p in reach if not p.rsplit(".", 1)[-1].startswith(READ_VERBS))
        assert not writes, f"gft-ci-preview can {writes}"
        assert not any(p.startswith(("container.", "secretmanager.", "run.", "iam.")) for p in reach)

    def test_no_secret_manager_read_for_previews(self) -> None:
        for identity in ("gft-ci-preview", "gft-ci-preview-gke"):
            for grant in IDENTITIES["identities"][identity]["grants"]:
                assert not {p for p in _role_permissions(grant["role"]) if p.startswith("secretmanager.")}, identity


class TestFederation:
    """Each identity is reachable only through its own pool, whose condition is the gate."""

    def _providers(self, run: SetupRun) -> dict[str, str]:
        return {
            _flag(call, "workload-identity-pool"): _flag(call, "attribute-condition")
            for call in run.verbs("create-oidc", "update-oidc")
        }

    @pytest.mark.slow
    def test_conditions_are_the_listed_ones(self, first_run: tuple[Path, SetupRun]) -> None:
        _, run = first_run
        expected = {
            spec["federation"]["pool"]: substitute(spec["federation"]["condition"])
            for spec in IDENTITIES["identities"].values()
        }
        assert {pool: " ".join(c.split()) for pool, c in self._providers(run).items()} == expected

    def test_every_condition_pins_the_repository_and_owner_by_number(self) -> None:
        for spec in IDENTITIES["identities"].values():
            condition = substitute(spec["federation"]["condition"])
            assert f"assertion.repository_id == '{VALUES['GITHUB_REPO_ID']}'" in condition
            assert f"assertion.repository_owner_id == '{VALUES['GITHUB_OWNER_ID']}'" in condition
            assert "||" not in condition, "a disjunction would let a second path around the gate"

    def test_deploy_is_main_and_the_deploy_workflow_only(self) -> None:
        """The owner/name typed at setup plays no part: workflow_ref is compared with the token's own repository."""
        for identity in ("gft-ci-deploy", "gft-ci-deploy-preview"):
            condition = substitute(IDENTITIES["identities"][identity]["federation"]["condition"])
            assert "assertion.ref == 'refs/heads/main'" in condition
            assert (
                "assertion.workflow_ref == assertion.repository + '/.github/workflows/deploy.yml@refs/heads/main'"
                in condition
            )
            assert VALUES["GITHUB_REPO"] not in condition
        deploy = IDENTITIES["identities"]["gft-ci-deploy"]["federation"]["condition"]
        assert "assertion.environment in ['deploy', 'destroy']" in deploy

    def test_gke_previews_need_the_reviewed_environment(self) -> None:
        condition = IDENTITIES["identities"]["gft-ci-preview-gke"]["federation"]["condition"]
        assert "assertion.environment == 'preview-gke'" in condition

    @pytest.mark.slow
    def test_each_account_trusts_its_pool_only(self, first_run: tuple[Path, SetupRun]) -> None:
        _, run = first_run
        trusted = {
            call[call.index("add-iam-policy-binding") + 1].split("@")[0]: _flag(call, "member")
            for call in run.verbs("add-iam-policy-binding")
            if _flag(call, "member").startswith("principalSet://")
        }
        prefix = f"principalSet://iam.googleapis.com/projects/{VALUES['PROJECT_NUMBER']}/locations/global/workloadIdentityPools/"
        assert trusted == {
            name: f"{prefix}{spec['federation']['pool']}/*" for name, spec in IDENTITIES["identities"].items()
        }
        for call in run.verbs("add-iam-policy-binding"):
            if _flag(call, "member").startswith("principalSet://"):
                assert _flag(call, "role") == "roles/iam.workloadIdentityUser", call


class TestTheProgramFindsWhatItNeeds:
    """The setup must match what the program declares, for every stack and the options users pick."""

    @pytest.fixture(scope="class")
    def runs(self) -> dict[tuple[str, str], StackRun]:
        """The program under mocks for every stack as committed and building with Cloud Build, and every Cloud Run
        stack serving: one run of each, which the tests below only read."""
        runs = {}
        for stack in stack_names():
            runs[stack, "committed"] = run_stack(stack)
            runs[stack, "cloud-build"] = run_stack(stack, overrides={"imageBuild": "cloud-build"})
            if ci_stacks.stacks()[stack] == "cloud-run":
                runs[stack, "serving"] = run_stack(
                    stack,
                    overrides={"servingEnabled": True, "servingInvokers": ["user:a@example.com"]},
                    assume_trained=True,
                )
        return runs

    @pytest.fixture(scope="class")
    def declared(self, runs: dict[tuple[str, str], StackRun]) -> tuple[set[str], set[str]]:
        assert set(stack_names()) == set(ci_stacks.stacks()), "the setup's stacks are the program's"
        apis: set[str] = set()
        accounts: set[str] = set()
        for run in runs.values():
            apis |= {r.plain_inputs()["service"] for r in run.of_type("gcp:projects/service:Service")}
            accounts |= {r.plain_inputs()["accountId"] for r in run.of_type("gcp:serviceaccount/account:Account")}
        return apis, accounts

    @pytest.mark.slow
    def test_every_api_the_program_declares_is_enabled_by_the_setup(self, declared: tuple[set[str], set[str]]) -> None:
        apis, _ = declared
        assert apis, "the program declares no API: the check would be empty"
        missing = (apis | FEDERATION_APIS) - set(IDENTITIES["apis"])
        assert not missing, (
            f"CI cannot enable APIs (serviceUsageViewer only): add {missing} to ci-identities.yaml and ci-setup.sh"
        )

    @pytest.mark.slow
    def test_every_workload_account_exists_before_the_first_up(
        self, first_run: tuple[Path, SetupRun], declared: tuple[set[str], set[str]]
    ) -> None:
        _, run = first_run
        _, accounts = declared
        created = {call[3] for call in run.verbs("create") if call[:2] == ["iam", "service-accounts"]}
        assert accounts, "the program declares no service account: the check would be empty"
        assert accounts <= created, f"accounts the program uses but the setup does not create: {accounts - created}"

    @pytest.mark.slow
    def test_the_program_adopts_the_pre_created_accounts_with_their_display_names(
        self, first_run: tuple[Path, SetupRun], runs: dict[tuple[str, str], StackRun]
    ) -> None:
        """The deploy identity may not bind accounts it did not get per-account grants on: the program adopts the
        setup's (a 409 on create is a read; destroy leaves them), named as the setup named them."""
        _, run = first_run
        names = {
            call[3]: _flag(call, "display-name")
            for call in run.verbs("create")
            if call[:2] == ["iam", "service-accounts"]
        }
        for stack in stack_names():
            for account in runs[stack, "committed"].of_type("gcp:serviceaccount/account:Account"):
                inputs = account.plain_inputs()
                assert inputs.get("createIgnoreAlreadyExists") is True, account.urn
                assert inputs.get("deletionPolicy") == "ABANDON", account.urn
                assert names[inputs["accountId"]] == inputs["displayName"], account.urn

    @pytest.mark.slow
    def test_one_project_iam_change_may_grant_every_project_role_of_an_update(
        self, runs: dict[tuple[str, str], StackRun]
    ) -> None:
        """google_project_iam_member is registered with `tpgiamresource.IamWithBatching`: the provider combines the
        project IAM members an update creates within `send_after` (default on, 3 s: transport_tpg
        DefaultBatchSendIntervalSec) into ONE read-modify-write (tpgiamresource/iam_batching.go), and IAM judges
        `modifiedGrantsByRole` on that one setIamPolicy. So a single grant must allow every project role one
        `pulumi up` grants, together: one grant per role would deny the batched call (a GKE stack building with
        Cloud Build grants the node and the builder roles at once)."""
        together = 0
        for stack in stack_names():
            for variant in ("committed", "cloud-build"):
                run = runs[stack, variant]
                assert run.cfg is not None
                members = run.of_type("gcp:projects/iAMMember:IAMMember")
                roles = frozenset(member.plain_inputs()["role"] for member in members)
                if not roles:
                    continue
                batched = Need("resourcemanager.projects.setIamPolicy", Scope.PROJECT, "batched", grants_roles=roles)
                assert any(covers(grant, batched, run.cfg) for grant in ci_grants(run.cfg)), (
                    f"{stack} {variant}: no grant of the deploy identity may change {sorted(roles)} in one call"
                )
                together += len(roles) > 1
        assert together, "no update grants two project roles: the check would be empty"


class TestRunningTheScript:
    @pytest.mark.slow
    def test_a_second_run_creates_nothing(self, first_run: tuple[Path, SetupRun]) -> None:
        tmp_path, first = first_run
        assert first.verbs("create", "create-oidc"), "the first run must create the resources"
        second = run_setup(tmp_path)
        assert second.returncode == 0, second.stderr
        assert second.verbs("create", "create-oidc") == [], "rerunning the setup must not create anything twice"
        assert second.grants() == first.grants()
        assert len(second.verbs("update-oidc")) == len(IDENTITIES["identities"]), "conditions are rewritten on each run"

    @pytest.mark.parametrize(
        ("name", "value", "phrase"),
        [
            ("GITHUB_REPO_ID", "acme/gemma-finetune", "GITHUB_REPO_ID='acme/gemma-finetune' is not a number"),
            ("GITHUB_OWNER_ID", "", "GITHUB_OWNER_ID='' is not a number"),
            ("PROJECT_ID", "My Project", "PROJECT_ID='My Project' is not a project id"),
            ("STATE_BACKEND", "s3", "STATE_BACKEND='s3' is not bucket or pulumi-cloud"),
        ],
    )
    def test_bad_settings_stop_before_any_call(self, tmp_path: Path, name: str, value: str, phrase: str) -> None:
        run = run_setup(tmp_path, **{name: value})
        assert run.returncode == 2 and phrase in run.stderr, run.stderr
        assert run.calls == [], "nothing may reach gcloud with a bad setting"

    LEGACY = (
        f"projects/{VALUES['PROJECT_ID']}/serviceAccounts/{VALUES['PROJECT_NUMBER']}@cloudbuild.gserviceaccount.com"
    )

    @pytest.mark.slow
    def test_a_legacy_default_build_account_with_roles_is_refused(self, tmp_path: Path) -> None:
        """A build that names no account would run as the legacy Cloud Build account, which needs no actAs and holds
        roles/cloudbuild.builds.builder: objects of every bucket. The setup stops before it grants any role."""
        run = run_setup(
            tmp_path, FAKE_DEFAULT_BUILD_ACCOUNT=self.LEGACY, FAKE_LEGACY_BUILD_ROLES="roles/cloudbuild.builds.builder"
        )
        legacy = f"{VALUES['PROJECT_NUMBER']}@cloudbuild.gserviceaccount.com"
        assert run.returncode == 2, run.stderr
        assert f"the legacy {legacy}, which holds roles/cloudbuild.builds.builder" in run.stderr
        assert f"remove-iam-policy-binding {VALUES['PROJECT_ID']} --member=serviceAccount:{legacy}" in run.stderr
        assert [c for c in run.calls if c[:2] == ["projects", "get-iam-policy"]], "the legacy account's roles were read"
        assert run.grants() == set(), "no role is granted while a default build could act as the legacy account"

    @pytest.mark.slow
    @pytest.mark.parametrize(
        ("default", "reported"),
        [
            (LEGACY, "the legacy 123456789012@cloudbuild.gserviceaccount.com, holding no project role"),
            ("projects/p/serviceAccounts/123456789012-compute@developer.gserviceaccount.com", "needs actAs on it"),
        ],
        ids=["legacy-without-roles", "compute-default"],
    )
    def test_a_default_build_account_the_deploy_cannot_use_is_reported(
        self, tmp_path: Path, default: str, reported: str
    ) -> None:
        run = run_setup(tmp_path, FAKE_DEFAULT_BUILD_ACCOUNT=default)
        assert run.returncode == 0, run.stderr
        assert reported in run.stdout
        assert Grant("gft-ci-deploy", "roles/cloudbuild.builds.editor", "project") in run.grants()

    @pytest.mark.slow
    def test_pulumi_cloud_backend_has_no_state_bucket_or_key(self, tmp_path: Path) -> None:
        run = run_setup(tmp_path, STATE_BACKEND="pulumi-cloud")
        assert run.returncode == 0, run.stderr
        assert not [c for c in run.calls if c[0] == "kms" or c[:2] == ["storage", "buckets"]]
        assert run.grants() == expected_grants(committed_stacks(), backend="pulumi-cloud")

    @pytest.mark.slow
    def test_a_new_stack_file_gets_its_accounts_and_grants(self, tmp_path: Path) -> None:
        repo = a_repository(tmp_path, {"Pulumi.l4-lab.yaml": "config:\n  gemma-finetune:workload: cloud-run\n"})
        run = run_setup(tmp_path, repo=repo)
        assert run.returncode == 0, run.stderr
        assert run.grants() == expected_grants({"l4-lab": ("cloud-run", [])})
        created = {call[3] for call in run.verbs("create") if call[:2] == ["iam", "service-accounts"]}
        assert {"gft-l4-lab-train", "gft-l4-lab-serve", "gft-l4-lab-build"} <= created
        assert not [g for g in run.grants() if g.role.startswith("roles/container.")], "no GKE stack, no GKE grant"
        assert not [g for g in run.grants() if "cloudbuild" in g.role or "gft-l4-lab-build@" in g.on], "no Cloud Build"

    @pytest.mark.slow
    def test_a_stack_that_uses_cloud_build_and_a_reservation_gets_their_grants(self, tmp_path: Path) -> None:
        stack_file = (
            "config:\n  gemma-finetune:workload: gke-job\n  gemma-finetune:capacity: reservation\n"
            "  gemma-finetune:imageBuild: cloud-build   # no Docker here\n"
        )
        repo = a_repository(tmp_path, {"Pulumi.b200.yaml": stack_file})
        run = run_setup(tmp_path, repo=repo)
        assert run.returncode == 0, run.stderr
        assert run.grants() == expected_grants({"b200": ("gke-job", ["cloud-build", "reservation"])})
        roles = {g.role for g in run.grants() if g.identity == "gft-ci-deploy"}
        assert {
            "roles/cloudbuild.builds.editor",
            f"projects/{VALUES['PROJECT_ID']}/roles/gftCiReservationReader",
        } <= roles
        build = f"account:gft-b200-build@{VALUES['PROJECT_ID']}.iam.gserviceaccount.com"
        assert Grant("gft-ci-deploy", "roles/iam.serviceAccountUser", build) in run.grants()

    @pytest.mark.slow
    @pytest.mark.parametrize(
        "stacks",
        [
            {"emoji": ("cloud-run", ["cloud-build"])},
            # a GKE stack on the default capacity draws on GPU quota (gpu-quota: the preflight reads it)
            {"emoji": ("cloud-run", ["cloud-build"]), "b200": ("gke-job", ["gpu-quota"])},
            {"emoji": ("cloud-run", []), "b200": ("gke-job", ["cloud-build", "gpu-quota"])},
        ],
        ids=["cloud-run-builds", "cloud-run-builds-and-gke", "gke-builds"],
    )
    def test_project_iam_grants_follow_which_workload_builds_with_cloud_build(
        self, tmp_path: Path, stacks: dict[str, tuple[str, list[str]]]
    ) -> None:
        """The builder's log-writer role is covered by the GKE condition (both roles, one batched call) or, for a
        Cloud Run stack building with Cloud Build, by its own."""
        files = {
            f"Pulumi.{name}.yaml": f"config:\n  gemma-finetune:workload: {workload}\n"
            + ("  gemma-finetune:imageBuild: cloud-build\n" if "cloud-build" in features else "")
            for name, (workload, features) in stacks.items()
        }
        run = run_setup(tmp_path, repo=a_repository(tmp_path, files))
        assert run.returncode == 0, run.stderr
        assert run.grants() == expected_grants(stacks)
        granter = [g for g in run.grants() if g.role.endswith("/gftCiProjectIamGranter")]
        needed = 1 if any(w.startswith("gke") for w, _ in stacks.values()) else 0
        needed += any(w == "cloud-run" and "cloud-build" in f for w, f in stacks.values())
        assert len(granter) == needed, granter

    @pytest.mark.slow
    def test_a_stack_on_gpu_quota_with_a_budget_gets_their_grants(self, tmp_path: Path) -> None:
        stack_file = (
            "config:\n  gemma-finetune:workload: gke-job\n  gemma-finetune:capacity: spot\n"
            "  gemma-finetune:billingAccount: 012345-6789AB-CDEF01\n  gemma-finetune:budgetUsd: 500\n"
        )
        repo = a_repository(tmp_path, {"Pulumi.spot.yaml": stack_file})
        run = run_setup(tmp_path, repo=repo)
        assert run.returncode == 0, run.stderr
        assert run.grants() == expected_grants({"spot": ("gke-job", ["budget", "gpu-quota"])})
        quota = f"projects/{VALUES['PROJECT_ID']}/roles/gftCiQuotaReader"
        assert {Grant("gft-ci-preview-gke", quota, "project"), Grant("gft-ci-deploy", quota, "project")} <= run.grants()
        assert Grant("gft-ci-deploy", "roles/monitoring.notificationChannelEditor", "project") in run.grants()
        billing = Grant("gft-ci-deploy", "roles/billing.costsManager", f"billing-account:{PROJECT_BILLING_ACCOUNT}")
        assert billing in run.grants()
        assert not [g for g in run.grants() if "gftCiReservationReader" in g.role], (
            "no reservation, no reservation read"
        )

    def test_shellcheck(self) -> None:
        shellcheck = Path(sys.executable).parent / "shellcheck"
        result = subprocess.run([str(shellcheck), str(SCRIPT)], capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stdout


class TestStacksOnTheirKeys:
    """Issue 23 items 2 and 5: `pulumi stack init` on a bucket backend picks the passphrase provider, which CI
    cannot use; the setup puts every stack on its own KMS key, which only the identities of its workload decrypt."""

    @pytest.mark.slow
    def test_a_preview_decrypts_only_the_stacks_of_its_workload(self, first_run: tuple[Path, SetupRun]) -> None:
        _, run = first_run
        decrypt = "roles/cloudkms.cryptoKeyDecrypter"
        keys = {g.on for g in run.grants() if g.identity == "gft-ci-preview" and g.role == decrypt}
        gke_keys = {g.on for g in run.grants() if g.identity == "gft-ci-preview-gke" and g.role == decrypt}
        stacks = ci_stacks.stacks()
        assert keys == {f"key:{stack_key(s)}" for s, w in stacks.items() if w == "cloud-run"} != set()
        assert gke_keys == {f"key:{stack_key(s)}" for s, w in stacks.items() if w != "cloud-run"} != set()
        for identity in ("gft-ci-deploy", "gft-ci-deploy-preview"):
            assert {g.on for g in run.grants() if g.identity == identity and g.role == decrypt} == {
                f"key:{stack_key(s)}" for s in stacks
            }
        created = {call[3] for call in run.verbs("create") if call[:2] == ["kms", "keys"]}
        assert created == {stack_key(s) for s in stacks}

    @pytest.mark.parametrize(
        ("identity", "roles", "workloads"),
        [
            ("gft-ci-preview", ("roles/storage.",), {"cloud-run"}),
            ("gft-ci-preview-gke", ("roles/storage.objectViewer",), {"gke-job", "gke-ray"}),
        ],
    )
    def test_a_pr_preview_reads_only_its_own_stacks_bucket(
        self, first_run: tuple[Path, SetupRun], identity: str, roles: tuple[str, ...], workloads: set[str]
    ) -> None:
        """A PR preview's Cloud Storage bindings, evaluated as CEL on `resource.name` (the bucket for a bucket-level
        call such as objects.list, `…/objects/NAME` for an object), reach the bucket of each stack it previews (a
        deployed stack's preview lists the run's completion marker: infra/foundation.py finished_run) and no other
        stack's, nor a stack whose name only starts with one of its stacks'. gft-ci-preview runs unreviewed."""
        _, run = first_run
        conditions = [
            g.condition
            for g in run.grants()
            if g.identity == identity and g.on == "project" and g.role.startswith(roles)
        ]
        assert conditions and all(conditions), conditions
        env = celpy.Environment()
        programs = [env.program(env.compile(condition)) for condition in conditions]

        def reads(name: str) -> bool:
            return any(bool(program.evaluate({"resource": celpy.json_to_cel({"name": name})})) for program in programs)

        project = VALUES["PROJECT_ID"]
        for stack, workload in ci_stacks.stacks().items():
            bucket = f"projects/_/buckets/{project}-gft-{stack}"
            mine = workload in workloads
            assert reads(bucket) is mine and reads(f"{bucket}/objects/runs/x/_RUN_COMPLETE.json") is mine, stack
            assert not reads(f"projects/_/buckets/{project}-gft-{stack}2/objects/runs/x/model.safetensors"), stack
        assert not reads(f"projects/_/buckets/{project}-pulumi-state/objects/.pulumi/stacks/x.json")

    @pytest.mark.slow
    def test_missing_stacks_are_created_and_others_moved_onto_their_key(self, tmp_path: Path) -> None:
        workload = "config:\n  gemma-finetune:workload: cloud-run\n"
        files = {
            "Pulumi.fresh.yaml": workload,  # not in the backend yet
            "Pulumi.phrase.yaml": "encryptionsalt: v1:abc:v1:def:ghi\n" + workload,  # `pulumi stack init` as before
            "Pulumi.shared.yaml": f"secretsprovider: gcpkms://{KEYRING}/cryptoKeys/stack-secrets\n" + workload,
            "Pulumi.done.yaml": f"secretsprovider: gcpkms://{KEYRING}/cryptoKeys/gft-done\n" + workload,
        }
        repo = a_repository(tmp_path, files)
        run = run_setup(tmp_path, repo=repo, FAKE_PULUMI_STACKS="phrase organization/gemma-finetune/shared done")
        assert run.returncode == 0, run.stderr + run.stdout
        calls = pulumi_calls(tmp_path)
        assert {(c["cwd"], c["backend"]) for c in calls} == {(str(repo), f"gs://{STATE_BUCKET}")}
        changes = [c["argv"] for c in calls if c["argv"][:2] != ["stack", "ls"]]
        assert sorted(changes) == sorted(
            [
                [
                    "stack",
                    "init",
                    "fresh",
                    "--secrets-provider",
                    f"gcpkms://{KEYRING}/cryptoKeys/gft-fresh",
                    "--non-interactive",
                ],
                ["stack", "change-secrets-provider", "--stack", "phrase", f"gcpkms://{KEYRING}/cryptoKeys/gft-phrase"],
                ["stack", "change-secrets-provider", "--stack", "shared", f"gcpkms://{KEYRING}/cryptoKeys/gft-shared"],
            ]
        )
        assert "Commit the stack files this run wrote" in run.stdout and "Pulumi.fresh.yaml" in run.stdout

    @pytest.mark.slow
    def test_without_the_pulumi_cli_it_prints_the_commands(self, tmp_path: Path) -> None:
        repo = a_repository(tmp_path, {"Pulumi.lab.yaml": "config:\n  gemma-finetune:workload: cloud-run\n"})
        run = run_setup(tmp_path, repo=repo, PULUMI=str(tmp_path / "no-pulumi-here"))
        assert run.returncode == 0, run.stderr
        provider = f"gcpkms://{KEYRING}/cryptoKeys/gft-lab"
        assert f"pulumi stack init lab --secrets-provider {provider}" in run.stdout
        assert f"pulumi stack change-secrets-provider --stack lab {provider}" in run.stdout
        assert pulumi_calls(tmp_path) == []

    def test_every_place_that_creates_a_stack_names_its_key(self) -> None:
        """The README's cloud path and new-stack steps, the missing-stack hint of .ci/pulumi-run.sh (which the PR
        comment quotes) and the setup: no bare `pulumi stack init`, which would pick the passphrase provider."""
        places = {
            "README.md": (REPO_ROOT / "README.md").read_text(),
            "docs/ci.md": (REPO_ROOT / "docs" / "ci.md").read_text(),
            ".ci/pulumi-run.sh": (REPO_ROOT / ".ci" / "pulumi-run.sh").read_text(),
            "ci-setup.sh": SCRIPT.read_text(),
        }
        for place, text in places.items():
            inits = re.findall(r"pulumi stack init [^\n`]*", text)
            assert inits, f"{place} says nowhere how a stack is created"
            for line in inits:
                assert "--secrets-provider" in line, f"{place}: `{line}` would put the stack on a passphrase"


class TestGrantsTheListNoLongerHas:
    """Issue 23 item 10: the setup only added bindings, so a removed stack's grants stayed; now it reports every CI
    binding it did not make this run, and PRUNE=1 removes them."""

    @pytest.mark.slow
    def test_a_removed_stacks_grants_are_reported_then_pruned(self, tmp_path: Path) -> None:
        cloud_run = "config:\n  gemma-finetune:workload: cloud-run\n"
        gke = "config:\n  gemma-finetune:workload: gke-job\n"
        both = a_repository(tmp_path / "both", {"Pulumi.lab.yaml": cloud_run, "Pulumi.big.yaml": gke})
        first = run_setup(tmp_path, repo=both)
        assert first.returncode == 0, first.stderr
        assert "Grants of the CI identities that ci-identities.yaml no longer lists\n  none" in first.stdout

        one = a_repository(tmp_path / "one", {"Pulumi.lab.yaml": cloud_run})
        second = run_setup(tmp_path, repo=one)
        assert second.returncode == 0, second.stderr
        reported = [line for line in second.stdout.splitlines() if "not in ci-identities.yaml" in line]
        member = f"serviceAccount:gft-ci-preview-gke@{VALUES['PROJECT_ID']}.iam.gserviceaccount.com"
        assert (
            f"  not in ci-identities.yaml: project {VALUES['PROJECT_ID']}: {member} roles/container.developer"
            in reported
        )
        assert any("key gft-big:" in line for line in reported), reported
        assert any("account gft-big-node@" in line for line in reported), reported
        assert not any("gft-lab" in line for line in reported), "the remaining stack's grants are listed"
        assert "rerun with PRUNE=1" in second.stdout
        assert not second.verbs("remove-iam-policy-binding"), "without PRUNE=1 nothing is removed"

        third = run_setup(tmp_path, repo=one, PRUNE="1")
        assert third.returncode == 0, third.stderr
        assert len(third.verbs("remove-iam-policy-binding")) == len(reported)
        fourth = run_setup(tmp_path, repo=one)
        assert "no longer lists\n  none" in fourth.stdout, fourth.stdout
        assert fourth.grants() == expected_grants({"lab": ("cloud-run", [])})
