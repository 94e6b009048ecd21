#!/usr/bin/env python3
"""The digest of a Pulumi plan: what reviewers approved is what `pulumi up` / `pulumi destroy` runs.

    pulumi preview --event-log events.jsonl …        # PULUMI_DEBUG_COMMANDS=true (see below)
    python3 .ci/plan_digest.py events.jsonl          # sha256:… of every step that changes something
    python3 .ci/plan_digest.py --list events.jsonl   # the steps, one a line

Decisions (why and sources: docs/ci.md#the-reviewed-plans-digest)
- Not Pulumi's update plans (experimental, and blind to resources created inside an unknown `apply`):
  deploy.yml previews again and stops unless this digest equals the reviewed one (PULUMI_REVIEWED_PLAN).
- Steps from the engine event log (`--event-log`, which needs PULUMI_DEBUG_COMMANDS=true).
- A step counts by operation, resource and the names of the properties it changes, never their values;
  `same` steps and event order are left out. Standard library only: it runs on the runner's python3.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

UNCHANGED = {"same"}


def steps(events: str) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(op, urn, type, changed properties) of every step that changes something, sorted."""
    found = set()
    for line in events.splitlines():
        if not line.strip():
            continue
        event: dict[str, Any] = json.loads(line)
        metadata = (event.get("resourcePreEvent") or {}).get("metadata")
        if not metadata or metadata.get("op") in UNCHANGED:
            continue
        detailed = metadata.get("detailedDiff") or {}
        changed = {str(key) for key in metadata.get("diffs") or []}
        changed |= {f"{key}:{(value or {}).get('diffKind', '')}" for key, value in detailed.items()}
        found.add((str(metadata["op"]), str(metadata["urn"]), str(metadata.get("type", "")), tuple(sorted(changed))))
    return sorted(found)


def digest(events: str) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(steps(events)).encode()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("events", type=Path, help="the event log of `pulumi preview` / `destroy --preview-only`")
    parser.add_argument("--list", action="store_true", help="print the steps instead of the digest")
    args = parser.parse_args(argv)
    text = args.events.read_text()
    if args.list:
        for op, urn, _, changed in steps(text):
            print(f"{op} {urn}" + (f" [{', '.join(changed)}]" if changed else ""))
    else:
        print(digest(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
