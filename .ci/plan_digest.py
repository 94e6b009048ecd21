#!/usr/bin/env python3
"""The digest of a Pulumi plan: what reviewers approved is what `pulumi up` / `pulumi destroy` runs.

    pulumi preview --event-log events.jsonl …        # PULUMI_DEBUG_COMMANDS=true (see below)
    python3 .ci/plan_digest.py events.jsonl          # sha256:… of every step that changes something
    python3 .ci/plan_digest.py --list events.jsonl   # the steps, one a line

Decisions
- Pulumi's own way, update plans (`pulumi preview --save-plan`, `pulumi up --plan`), is experimental ("Update
  plans are currently in experimental preview", pulumi.com/docs/iac/concepts/update-plans/) and, by its own
  limitations, cannot record resources created inside an `apply` whose input is unknown at preview time,
  which this program does. So deploy.yml previews again in the apply job and stops unless this digest equals
  the reviewed preview's (.ci/pulumi-run.sh, PULUMI_REVIEWED_PLAN).
- The steps come from the engine event log, not the text output: one JSON event a line, a step as
  `resourcePreEvent.metadata` {op, urn, type, diffs, detailedDiff} (the Automation API reads the same file:
  pulumi sdk/python/lib/pulumi/automation/events.py StepEventMetadata, and _stack.py passes `--event-log`
  with PULUMI_DEBUG_COMMANDS=true, which the CLI needs to offer the flag: pkg/cmd/pulumi/operations/up.go).
- A step counts by its operation, its resource and the names (and kinds) of the properties it changes, not
  their values: secrets stay out, and a value unknown at preview time compares equal. `same` steps change
  nothing and are left out; the order of events is not part of the plan.
Standard library only: it runs on the runner's python3.
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
