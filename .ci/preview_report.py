#!/usr/bin/env python3
"""Report a `pulumi preview` as a pull-request comment and in the run summary, whether it passed or failed.

    pulumi preview --stack dev --diff --color never --policy-pack infra/policy 2>&1 | tee preview.log
    python3 .ci/preview_report.py --stack dev --log preview.log --exit-code "$rc" --comment --summary

Environment (set by GitHub Actions): GITHUB_SERVER_URL, GITHUB_REPOSITORY, GITHUB_RUN_ID, GITHUB_SHA,
GITHUB_STEP_SUMMARY (`--summary`), GITHUB_API_URL, GITHUB_TOKEN and PR_NUMBER (`--comment`).

Decisions (why and sources: docs/ci.md#the-preview-report)
- Runs whatever the preview's exit code (pulumi/actions comments only on success): passed or FAILED, the
  run link, each policy violation, every `error:` line, the output's tail within GitHub's comment limit.
- One comment per stack, by a hidden marker, edited only if the workflow's own identity wrote it.
- A cancelled preview says so (`--cancelled`) unless a newer commit's comment is already there.
- Standard library only: it runs on the runner's python3 before anything is installed.
Not here: running Pulumi (the workflow does), failing the job (the preview step's exit code does).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "<!-- gemma-finetune-preview:{stack} -->"
SHA_MARKER = "<!-- sha:{sha} -->"
COMMENT_LIMIT = 65_536
OUTPUT_TAIL = 40_000
BOT_LOGIN = "github-actions[bot]"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_VIOLATION = re.compile(r"^(?P<indent>\s*)(?:- )?\[(?P<level>mandatory|advisory|remediate)\]\s+(?P<rest>.+)$")


@dataclass(frozen=True)
class Preview:
    """What one preview produced: the stack, its exit code and its output (`cancelled`: it never finished)."""

    stack: str
    exit_code: int
    output: str
    cancelled: bool = False
    plan_digest: str = ""

    @property
    def passed(self) -> bool:
        return self.exit_code == 0 and not self.cancelled


PASSPHRASE_HINT = (
    "The stack is on the passphrase secrets provider, and CI has no passphrase: move it once onto its KMS key "
    "(`pulumi stack change-secrets-provider --stack STACK gcpkms://…/cryptoKeys/gft-STACK`, or rerun "
    'infra/bootstrap/ci-setup.sh) and commit its Pulumi.STACK.yaml (docs/ci.md, "Stacks and their keys").'
)


def clean(text: str) -> str:
    """The output without colour codes or carriage-return progress lines."""
    return _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "\n")


def policy_violations(output: str) -> list[str]:
    """Each violation as one line: `[mandatory] rule (type: name): description — message`.

    The CLI prints a violation as a `[level]  rule  (type: name)` line followed by more-indented lines
    (the rule's description, then the message); the block ends at a blank line, a line indented no
    deeper than the header, or the next violation.
    """
    lines = clean(output).splitlines()
    found: list[str] = []
    index = 0
    while index < len(lines):
        match = _VIOLATION.match(lines[index])
        if not match:
            index += 1
            continue
        depth = len(match.group("indent"))
        header = f"[{match.group('level')}] " + re.sub(r"\s{2,}", " ", match.group("rest").strip())
        details: list[str] = []
        index += 1
        while index < len(lines):
            line = lines[index]
            if not line.strip() or _VIOLATION.match(line) or len(line) - len(line.lstrip()) <= depth:
                break
            details.append(line.strip())
            index += 1
        found.append(header + (": " + " — ".join(details) if details else ""))
    return found


def error_lines(output: str) -> list[str]:
    """Every distinct `error: …` line, in order."""
    seen: list[str] = []
    for line in clean(output).splitlines():
        text = line.strip()
        if text.startswith("error:") and text not in seen:
            seen.append(text)
    return seen


def _fence(text: str) -> str:
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def render(preview: Preview, run_url: str, sha: str, title: str = "pulumi preview", marker: bool = True) -> str:
    """The Markdown report (with the stack's hidden marker first when it is a PR comment)."""
    status = "passed" if preview.passed else f"FAILED (exit code {preview.exit_code})"
    icon = "✅" if preview.passed else "❌"
    if preview.cancelled:
        status, icon = "CANCELLED or TIMED OUT: no result for this commit", "⚠️"
    parts = [MARKER.format(stack=preview.stack) + "\n" + SHA_MARKER.format(sha=sha)] if marker else []
    parts.append(f"### {icon} `{title}` of stack `{preview.stack}`: {status}")
    parts.append(f"[Run log]({run_url}) · commit `{sha[:12]}`")
    if preview.cancelled:
        parts.append(
            "The preview did not finish (the job was cancelled, or ran past its timeout-minutes): what an earlier "
            "commit's preview said no longer applies. Push again or re-run the job."
        )
    if preview.plan_digest:
        parts.append(f"Plan digest `{preview.plan_digest}`: the apply job runs this plan or nothing.")
    violations = policy_violations(preview.output)
    if violations:
        parts.append("**Policy violations** (infra/policy; mandatory ones fail the preview):")
        parts.extend(f"- {line}" for line in violations)
    errors = error_lines(preview.output)
    if errors and not preview.passed:
        parts.append("**Errors:**")
        parts.extend(f"- `{line}`" for line in errors)
    if not preview.passed and "PULUMI_CONFIG_PASSPHRASE" in preview.output:
        parts.append("**How to fix:** " + PASSPHRASE_HINT.replace("STACK", preview.stack))
    if not preview.passed and not preview.cancelled and not violations and not errors:
        parts.append("The preview stopped without an `error:` line; see the run log.")
    output = clean(preview.output).strip()
    cut = len(output) > OUTPUT_TAIL
    tail = output[-OUTPUT_TAIL:] if cut else output
    fence = _fence(tail)
    summary = "Output (last part)" if cut else "Output"
    parts.append(f"<details><summary>{summary}</summary>\n\n{fence}text\n{tail}\n{fence}\n</details>")
    body = "\n\n".join(parts) + "\n"
    return body[: COMMENT_LIMIT - 1]


class GitHub:
    """The three REST calls the comment needs, with the workflow's token."""

    def __init__(self, api_url: str, repository: str, token: str) -> None:
        self.api_url = api_url.rstrip("/")
        self.repository = repository
        self.token = token

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"{self.api_url}{path}",
            data=data,
            method=method,
            headers={
                "Accept": "application/vnd.github+json",
                "Authorization": f"Bearer {self.token}",
                "X-GitHub-Api-Version": "2022-11-28",
                "Content-Type": "application/json",
            },
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"null")

    def comments(self, number: int) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        page = 1
        while True:
            batch = self._call("GET", f"/repos/{self.repository}/issues/{number}/comments?per_page=100&page={page}")
            found.extend(batch)
            if len(batch) < 100:
                return found
            page += 1

    def head_sha(self, number: int) -> str:
        """The PR's head commit now (a newer push moves it)."""
        return str(self._call("GET", f"/repos/{self.repository}/pulls/{number}")["head"]["sha"])

    def own_comment(self, number: int, marker: str, author: str = BOT_LOGIN) -> dict[str, Any] | None:
        """This workflow's comment that starts with `marker` (one written by anyone else does not count)."""
        for comment in self.comments(number):
            if str(comment.get("body", "")).startswith(marker) and (comment.get("user") or {}).get("login") == author:
                return comment
        return None

    def upsert_comment(self, number: int, marker: str, body: str, author: str = BOT_LOGIN) -> str:
        """Edit this workflow's comment that starts with `marker`, or create one; returns 'updated' or 'created'."""
        comment = self.own_comment(number, marker, author)
        if comment is not None:
            self._call("PATCH", f"/repos/{self.repository}/issues/comments/{comment['id']}", {"body": body})
            return "updated"
        self._call("POST", f"/repos/{self.repository}/issues/{number}/comments", {"body": body})
        return "created"


def _env(name: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        raise SystemExit(f"error: {name} is not set (GitHub Actions sets it; set it by hand to run this locally)")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", required=True)
    parser.add_argument("--log", type=Path, required=True, help="the preview's combined output")
    parser.add_argument("--exit-code", type=int, default=1, help="the preview's exit code")
    parser.add_argument("--cancelled", action="store_true", help="the preview was cancelled or timed out")
    parser.add_argument("--plan-digest", default="", help="the plan digest (.ci/plan_digest.py) to show")
    parser.add_argument("--title", default="pulumi preview")
    parser.add_argument("--comment", action="store_true", help="create or update the PR comment (PR_NUMBER)")
    parser.add_argument("--summary", action="store_true", help="append the report to GITHUB_STEP_SUMMARY")
    args = parser.parse_args(argv)

    output = args.log.read_text(errors="replace") if args.log.exists() else f"(no output: {args.log} was not written)"
    preview = Preview(args.stack, args.exit_code, output, args.cancelled, args.plan_digest)
    run_url = f"{_env('GITHUB_SERVER_URL')}/{_env('GITHUB_REPOSITORY')}/actions/runs/{_env('GITHUB_RUN_ID')}"
    sha = os.environ.get("PREVIEW_SHA") or _env("GITHUB_SHA")
    if args.summary:
        with open(_env("GITHUB_STEP_SUMMARY"), "a", encoding="utf-8") as summary:
            summary.write(render(preview, run_url, sha, args.title, marker=False))
    if args.comment:
        github = GitHub(
            os.environ.get("GITHUB_API_URL", "https://api.github.com"), _env("GITHUB_REPOSITORY"), _env("GITHUB_TOKEN")
        )
        body = render(preview, run_url, sha, args.title)
        number, marker = int(_env("PR_NUMBER")), MARKER.format(stack=args.stack)
        try:
            if args.cancelled:
                head = github.head_sha(number)
                current = github.own_comment(number, marker)
                if head != sha and current is not None and SHA_MARKER.format(sha=head) in str(current.get("body")):
                    print(f"the preview of the newer head {head[:12]} has reported: its comment is left as is")
                    return 0
            action = github.upsert_comment(number, marker, body)
        except urllib.error.HTTPError as exc:
            print(f"error: commenting on PR {os.environ.get('PR_NUMBER')} failed: HTTP {exc.code} {exc.reason}")
            return 1
        print(f"{action} the PR comment for stack {args.stack}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
