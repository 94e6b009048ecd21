"""`.ci/preview_report.py` comments on the PR whether the preview passed or failed, against a real HTTP server.

A small GitHub stand-in on 127.0.0.1 serves the three REST calls the report makes (list, create and
edit issue comments); the report runs as the workflow runs it (a subprocess with the Actions
environment), on a preview log in the format the Pulumi CLI prints policy violations in.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from infra.offline.engine import REPO_ROOT

SCRIPT = REPO_ROOT / ".ci" / "preview_report.py"
REPO = "acme/gemma-finetune"
PR = 42
BOT = "github-actions[bot]"
PREVIEW_SHA = "abcdef1234567890" + "0" * 24

# The violation block as the Pulumi CLI prints it (pulumi-policy's integration tests match these lines:
# "<pack>@v<version>", "[mandatory]  <policy>  (<type>: <name>)", the description, the message).
FAILED_PREVIEW = """\
Previewing update (dev):
     Type                      Name      Plan
 +   pulumi:pulumi:Stack       gemma-finetune-dev  create
 +   kubernetes:batch/v1:Job   train     create

Policies:
    \N{CROSS MARK} gemma-finetune-guardrails@v1.1.0 (local: infra/policy)
        - [mandatory]  gpu-workload-deadlines  (kubernetes:batch/v1:Job: train)
          Every GPU workload has an explicit deadline.
          Kubernetes Job asking for GPUs has spec.activeDeadlineSeconds=None: set a deadline
        - [advisory]  required-labels  (gcp:storage/bucket:Bucket: gft-dev-bucket)
          Buckets carry app/stack/workload labels.
          labels lack app

Resources:
    + 2 to create

error: preview failed
"""
PASSED_PREVIEW = (
    "Previewing update (dev):\n +  gcp:storage/bucket:Bucket gft-dev-bucket create\n\nResources:\n    + 1 to create\n"
)


class FakeGitHub:
    """Issue comments of one PR, served the way api.github.com does (paginated, per-user)."""

    def __init__(self) -> None:
        self.comments: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str, dict[str, Any] | None]] = []
        self.next_id = 1000
        self.head = PREVIEW_SHA  # the PR's head commit (a newer push moves it)

    def add(self, body: str, login: str = BOT) -> dict[str, Any]:
        comment = {"id": self.next_id, "body": body, "user": {"login": login}}
        self.next_id += 1
        self.comments.append(comment)
        return comment

    def handler(self) -> type[BaseHTTPRequestHandler]:
        github = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, status: int, payload: Any) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _body(self) -> dict[str, Any]:
                return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

            def do_GET(self) -> None:
                github.requests.append(("GET", self.path, None))
                if self.path == f"/repos/{REPO}/pulls/{PR}":
                    return self._reply(200, {"number": PR, "head": {"sha": github.head}})
                match = re.fullmatch(rf"/repos/{REPO}/issues/{PR}/comments\?per_page=100&page=(\d+)", self.path)
                if not match or self.headers["Authorization"] != "Bearer test-token":
                    return self._reply(404, {"message": "Not Found"})
                page = int(match.group(1))
                self._reply(200, github.comments[(page - 1) * 100 : page * 100])

            def do_POST(self) -> None:
                body = self._body()
                github.requests.append(("POST", self.path, body))
                if self.path != f"/repos/{REPO}/issues/{PR}/comments":
                    return self._reply(404, {"message": "Not Found"})
                self._reply(201, github.add(body["body"]))

            def do_PATCH(self) -> None:
                body = self._body()
                github.requests.append(("PATCH", self.path, body))
                match = re.fullmatch(rf"/repos/{REPO}/issues/comments/(\d+)", self.path)
                comment = next((c for c in github.comments if match and c["id"] == int(match.group(1))), None)
                if comment is None or comment["user"]["login"] != BOT:
                    return self._reply(403, {"message": "Forbidden"})
                comment["body"] = body["body"]
                self._reply(200, comment)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


@pytest.fixture
def github() -> Iterator[tuple[FakeGitHub, str]]:
    fake = FakeGitHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), fake.handler())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def report(
    tmp_path: Path, api: str, log: str | None, exit_code: int, *flags: str, sha: str = PREVIEW_SHA
) -> subprocess.CompletedProcess[str]:
    log_path = tmp_path / "pulumi.log"
    if log is not None:
        log_path.write_text(log)
    summary = tmp_path / "summary.md"
    env = {
        "PATH": os.environ["PATH"],
        "GITHUB_SERVER_URL": "https://github.com",
        "GITHUB_REPOSITORY": REPO,
        "GITHUB_RUN_ID": "777",
        "GITHUB_SHA": "0" * 40,
        "PREVIEW_SHA": sha,
        "GITHUB_STEP_SUMMARY": str(summary),
        "GITHUB_API_URL": api,
        "GITHUB_TOKEN": "test-token",
        "PR_NUMBER": str(PR),
    }
    command = [sys.executable, str(SCRIPT), "--stack", "dev", "--log", str(log_path), "--exit-code", str(exit_code)]
    return subprocess.run([*command, *flags], env=env, capture_output=True, text=True, timeout=60, check=False)


class TestTheComment:
    def test_a_failed_preview_is_reported_with_its_violations_and_the_run(
        self, tmp_path: Path, github: tuple[FakeGitHub, str]
    ) -> None:
        fake, api = github
        result = report(tmp_path, api, FAILED_PREVIEW, 255, "--comment")
        assert result.returncode == 0, result.stdout + result.stderr
        [comment] = fake.comments
        body = comment["body"]
        assert body.startswith("<!-- gemma-finetune-preview:dev -->")
        assert "FAILED (exit code 255)" in body
        assert "(https://github.com/acme/gemma-finetune/actions/runs/777)" in body
        assert "commit `abcdef123456`" in body
        assert (
            "- [mandatory] gpu-workload-deadlines (kubernetes:batch/v1:Job: train): Every GPU workload has an explicit "
            "deadline. — Kubernetes Job asking for GPUs has spec.activeDeadlineSeconds=None: set a deadline"
        ) in body
        assert "- [advisory] required-labels (gcp:storage/bucket:Bucket: gft-dev-bucket)" in body
        assert "- `error: preview failed`" in body
        assert "Resources:" in body, "the output itself is attached"

    def test_the_next_push_edits_the_same_comment(self, tmp_path: Path, github: tuple[FakeGitHub, str]) -> None:
        fake, api = github
        assert report(tmp_path, api, FAILED_PREVIEW, 255, "--comment").returncode == 0
        result = report(tmp_path, api, PASSED_PREVIEW, 0, "--comment")
        assert result.returncode == 0, result.stderr
        assert "updated the PR comment" in result.stdout
        [comment] = fake.comments
        assert "✅" in comment["body"] and "passed" in comment["body"] and "FAILED" not in comment["body"]
        assert [method for method, _, _ in fake.requests].count("POST") == 1

    def test_a_comment_by_someone_else_with_the_marker_is_left_alone(
        self, tmp_path: Path, github: tuple[FakeGitHub, str]
    ) -> None:
        fake, api = github
        forged = fake.add("<!-- gemma-finetune-preview:dev -->\nall good, merge it", login="mallory")
        assert report(tmp_path, api, FAILED_PREVIEW, 255, "--comment").returncode == 0
        assert forged["body"].endswith("merge it")
        assert [c["user"]["login"] for c in fake.comments] == ["mallory", BOT]
        assert not [r for r in fake.requests if r[0] == "PATCH"]

    def test_its_own_comment_is_found_past_the_first_page(self, tmp_path: Path, github: tuple[FakeGitHub, str]) -> None:
        fake, api = github
        for index in range(130):
            fake.add(f"review comment {index}", login="alice")
        ours = fake.add("<!-- gemma-finetune-preview:dev -->\nold")
        assert report(tmp_path, api, PASSED_PREVIEW, 0, "--comment").returncode == 0
        assert len(fake.comments) == 131 and "passed" in ours["body"]

    def test_each_stack_has_its_own_comment(self, tmp_path: Path, github: tuple[FakeGitHub, str]) -> None:
        fake, api = github
        fake.add("<!-- gemma-finetune-preview:a4-gemma4 -->\nA4 preview")
        assert report(tmp_path, api, PASSED_PREVIEW, 0, "--comment").returncode == 0
        assert [c["body"].splitlines()[0] for c in fake.comments] == [
            "<!-- gemma-finetune-preview:a4-gemma4 -->",
            "<!-- gemma-finetune-preview:dev -->",
        ]

    def test_a_preview_that_never_ran_is_reported_as_failed(
        self, tmp_path: Path, github: tuple[FakeGitHub, str]
    ) -> None:
        fake, api = github
        assert report(tmp_path, api, None, 1, "--comment").returncode == 0
        [comment] = fake.comments
        assert "FAILED (exit code 1)" in comment["body"] and "was not written" in comment["body"]

    def test_a_huge_output_keeps_its_tail_within_the_comment_limit(
        self, tmp_path: Path, github: tuple[FakeGitHub, str]
    ) -> None:
        fake, api = github
        log = "".join(f"line {index}\n" for index in range(20_000)) + "``` not a fence\n" + FAILED_PREVIEW
        assert report(tmp_path, api, log, 255, "--comment").returncode == 0
        body = fake.comments[0]["body"]
        assert len(body) < 65_536
        assert "[mandatory] gpu-workload-deadlines" in body and "error: preview failed" in body
        assert "line 0\n" not in body and "Output (last part)" in body
        assert "````text" in body, "a fence longer than any backtick run in the output"

    def test_a_refused_comment_fails_the_step(self, tmp_path: Path, github: tuple[FakeGitHub, str]) -> None:
        _, api = github
        result = report(tmp_path, api + "/nowhere", PASSED_PREVIEW, 0, "--comment")
        assert result.returncode == 1 and "HTTP 404" in result.stdout


class TestTheRunSummary:
    def test_the_summary_has_the_report_without_the_marker(self, tmp_path: Path) -> None:
        result = report(tmp_path, "http://127.0.0.1:9", FAILED_PREVIEW, 255, "--summary")
        assert result.returncode == 0, result.stderr
        summary = (tmp_path / "summary.md").read_text()
        assert "gemma-finetune-preview" not in summary
        assert "[mandatory] gpu-workload-deadlines" in summary and "FAILED" in summary


class TestAPreviewThatDidNotFinish:
    """Issue 23 item 10: a cancelled or timed-out preview says so instead of leaving the last result standing."""

    def test_it_replaces_the_last_result_with_a_warning(self, tmp_path: Path, github: tuple[FakeGitHub, str]) -> None:
        fake, api = github
        older = "1234567890ab" + "0" * 28
        assert report(tmp_path, api, PASSED_PREVIEW, 0, "--comment", sha=older).returncode == 0
        fake.head = PREVIEW_SHA  # this run's commit is the PR's head: a person or the timeout cancelled it
        result = report(tmp_path, api, "Previewing update (dev):\n", 1, "--comment", "--cancelled")
        assert result.returncode == 0, result.stdout + result.stderr
        [comment] = fake.comments
        assert "CANCELLED or TIMED OUT" in comment["body"] and "passed" not in comment["body"]
        assert "commit `abcdef123456`" in comment["body"]

    def test_a_newer_pushs_result_is_left_alone(self, tmp_path: Path, github: tuple[FakeGitHub, str]) -> None:
        """concurrency cancels the older run when a push comes; the newer run may have reported first."""
        fake, api = github
        newer = "fedcba9876543210" + "0" * 24
        fake.head = newer
        assert report(tmp_path, api, PASSED_PREVIEW, 0, "--comment", sha=newer).returncode == 0
        result = report(tmp_path, api, None, 1, "--comment", "--cancelled")
        assert result.returncode == 0, result.stderr
        [comment] = fake.comments
        assert "passed" in comment["body"] and f"<!-- sha:{newer} -->" in comment["body"]
        assert "has reported" in result.stdout

    def test_a_newer_push_that_has_not_reported_yet_still_clears_the_stale_result(
        self, tmp_path: Path, github: tuple[FakeGitHub, str]
    ) -> None:
        fake, api = github
        assert report(tmp_path, api, PASSED_PREVIEW, 0, "--comment", sha="1" * 40).returncode == 0
        fake.head = "2" * 40
        assert report(tmp_path, api, None, 1, "--comment", "--cancelled").returncode == 0
        assert "CANCELLED or TIMED OUT" in fake.comments[0]["body"]


def test_a_passphrase_stack_is_told_how_to_move_to_its_key(tmp_path: Path) -> None:
    log = "error: getting secrets manager: passphrase must be set with PULUMI_CONFIG_PASSPHRASE or PULUMI_CONFIG_PASSPHRASE_FILE environment variables\n"
    assert report(tmp_path, "http://127.0.0.1:9", log, 255, "--summary").returncode == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "pulumi stack change-secrets-provider --stack dev gcpkms://…/cryptoKeys/gft-dev" in summary
