"""Stand-ins for `useradd`, `id`, `mkdir`, `chown` and `chmod` that work on a user table in files.

tests/serving/test_dockerfile.py runs serving/Dockerfile's RUN with only these on PATH, against the
base image's /etc/passwd and /etc/group (tests/serving/fixtures/vllm_base_users.json), so the build
step's user handling is replayed without Docker. Exit codes follow shadow-utils useradd(8): 4 UID
already in use, 6 group does not exist, 9 user name (or, with -U, group name) already in use.

    python fake_accounts.py COMMAND ARGS...     (FAKE_ETC: folder with passwd and group; FAKE_LOG: a log)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _table(name: str) -> list[list[str]]:
    path = Path(os.environ["FAKE_ETC"]) / name
    return [line.split(":") for line in path.read_text().splitlines() if line]


def _append(name: str, fields: list[str]) -> None:
    with (Path(os.environ["FAKE_ETC"]) / name).open("a") as f:
        f.write(":".join(fields) + "\n")


def _group_id(spec: str) -> str | None:
    for g in _table("group"):
        if spec in (g[0], g[2]):
            return g[2]
    return None


def useradd(args: list[str]) -> int:
    opts: dict[str, str] = {}
    flags: set[str] = set()
    name = None
    takes_value = {"-u": "uid", "--uid": "uid", "-g": "gid", "--gid": "gid", "-d": "home", "--home-dir": "home"}
    takes_value |= {"-s": "shell", "--shell": "shell"}
    it = iter(args)
    for arg in it:
        if arg in takes_value:
            opts[takes_value[arg]] = next(it)
        elif arg.startswith("-"):
            flags.add(arg)
        else:
            name = arg
    if name is None:
        print("useradd: no user name", file=sys.stderr)
        return 2
    users = _table("passwd")
    if any(u[0] == name for u in users):
        print(f"useradd: user '{name}' already exists", file=sys.stderr)
        return 9
    uid = opts.get("uid", str(1 + max(int(u[2]) for u in users if int(u[2]) < 60000)))
    if any(u[2] == uid for u in users) and "-o" not in flags:
        print(f"useradd: UID {uid} is not unique", file=sys.stderr)
        return 4
    if {"-U", "--user-group"} & flags:
        if _group_id(name) is not None:
            print(
                f"useradd: group {name} exists - if you want to add this user to that group, use -g.", file=sys.stderr
            )
            return 9
        gid = uid
        _append("group", [name, "x", gid, ""])
    else:
        gid = _group_id(opts.get("gid", "100")) or ""
        if not gid:
            print(f"useradd: group '{opts.get('gid')}' does not exist", file=sys.stderr)
            return 6
    _append("passwd", [name, "x", uid, gid, "", opts.get("home", f"/home/{name}"), opts.get("shell", "/bin/sh")])
    return 0


def id_(args: list[str]) -> int:
    which, name = args[0], args[1]
    for u in _table("passwd"):
        if u[0] == name:
            print(u[2] if which == "-u" else u[3])
            return 0
    print(f"id: '{name}': no such user", file=sys.stderr)
    return 1


def chown(args: list[str]) -> int:
    owner = next(a for a in args if not a.startswith("-"))
    user, _, group = owner.partition(":")
    known_user = user.isdigit() or any(u[0] == user for u in _table("passwd"))
    if not known_user or (group and not group.isdigit() and _group_id(group) is None):
        print(f"chown: invalid user: '{owner}'", file=sys.stderr)
        return 1
    return 0


COMMANDS = {"useradd": useradd, "id": id_, "chown": chown, "mkdir": lambda a: 0, "chmod": lambda a: 0}


def main() -> int:
    command, args = sys.argv[1], sys.argv[2:]
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write(json.dumps([command, *args]) + "\n")
    return COMMANDS[command](args)


if __name__ == "__main__":
    sys.exit(main())
