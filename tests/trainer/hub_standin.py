"""A local stand-in for the Hugging Face Hub's upload API, on 127.0.0.1, for push tests.

It answers what `HfApi.create_repo` + `HfApi.upload_folder` call (huggingface_hub 2.x hf_api.py `create_repo`,
_commit_api.py `_fetch_upload_modes` / `_prepare_commit_payload`): `POST /api/repos/create` (recorded: name,
organisation, visibility, token); `POST /api/models/{org}/{name}/preupload/{revision}` ("regular" for every file,
so files travel base64 inside the commit, no LFS/xet to emulate); `POST .../commit/{revision}` (the NDJSON
commit, each file's bytes kept).

With `models` ({repo id: local folder}) it also serves `snapshot_download` (_snapshot_download.py,
file_download.py `get_hf_file_metadata` / `hf_hub_download`): `GET /api/models/{org}/{name}/revision/{revision}`
(a fixed commit `sha`), `GET .../tree/{commit}` (every file: path, size, git-blob-like oid, one page), and
`HEAD`/`GET /{org}/{name}/resolve/{commit}/{path}` (`X-Repo-Commit`, `ETag`, `Content-Length`, the bytes).

Every request is kept in `requests`, so a test can say "no Hub request at all"; anything else is answered 404
and recorded, so a test sees an unexpected call.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

COMMIT = "2" * 40


@dataclass
class HubRecord:
    url: str = ""
    created: list[dict[str, Any]] = field(default_factory=list)
    files: dict[str, dict[str, bytes]] = field(default_factory=dict)  # repo id -> path -> content
    authorizations: set[str] = field(default_factory=set)
    unexpected: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # "METHOD /path", every one


@contextmanager
def hub_standin(models: dict[str, Path] | None = None) -> Iterator[HubRecord]:
    record = HubRecord()
    models = dict(models or {})

    def files_of(repo_id: str) -> dict[str, Path]:
        root = models[repo_id]
        return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}

    def served(path: str) -> tuple[str, str, str] | None:
        """(kind, repo id, rest) for the read routes above, else None."""
        parts = path.split("?")[0].strip("/").split("/")
        api = len(parts) >= 5 and parts[:2] == ["api", "models"] and f"{parts[2]}/{parts[3]}" in models
        if api and parts[4] in ("revision", "tree"):
            return parts[4], f"{parts[2]}/{parts[3]}", "/".join(parts[5:])
        if len(parts) >= 5 and f"{parts[0]}/{parts[1]}" in models and parts[2] == "resolve":
            return "resolve", f"{parts[0]}/{parts[1]}", "/".join(parts[4:])
        return None

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _file(self, repo_id: str, name: str, body: bool) -> None:
            path = files_of(repo_id).get(name)
            if path is None:
                return self._reply(404, {"error": f"{name} not in {repo_id}"})
            data = path.read_bytes()
            self.send_response(200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_HEAD(self) -> None:
            record.requests.append(f"HEAD {self.path}")
            route = served(self.path)
            if route and route[0] == "resolve":
                return self._file(route[1], route[2], body=False)
            record.unexpected.append(f"HEAD {self.path}")
            self._reply(404, {"error": "not in the stand-in"})

        def do_POST(self) -> None:
            record.requests.append(f"POST {self.path}")
            record.authorizations.add(self.headers.get("Authorization", ""))
            parts = self.path.split("?")[0].strip("/").split("/")
            if parts[:3] == ["api", "repos", "create"]:
                body = json.loads(self._body())
                record.created.append(body)
                repo_id = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
                record.files.setdefault(repo_id, {})
                return self._reply(200, {"url": f"{record.url}/{repo_id}", "name": repo_id})
            if parts[:2] == ["api", "validate-yaml"]:
                self._body()
                return self._reply(200, {"warnings": []})
            if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] == "preupload":
                files = json.loads(self._body())["files"]
                modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                return self._reply(200, {"files": modes})
            if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] == "commit":
                repo_id = f"{parts[2]}/{parts[3]}"
                for line in self._body().decode().splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        content = base64.b64decode(item["value"]["content"])
                        record.files.setdefault(repo_id, {})[item["value"]["path"]] = content
                commit = "1" * 40
                return self._reply(200, {"commitUrl": f"{record.url}/{repo_id}/commit/{commit}", "commitOid": commit})
            record.unexpected.append(f"POST {self.path}")
            return self._reply(404, {"error": "not in the stand-in"})

        def do_GET(self) -> None:
            record.requests.append(f"GET {self.path}")
            route = served(self.path)
            if route and route[0] == "revision":
                siblings = [{"rfilename": name} for name in files_of(route[1])]
                return self._reply(200, {"id": route[1], "sha": COMMIT, "siblings": siblings, "private": False})
            if route and route[0] == "tree":
                tree = [
                    {
                        "type": "file",
                        "path": name,
                        "size": p.stat().st_size,
                        "oid": hashlib.sha1(p.read_bytes()).hexdigest(),
                    }
                    for name, p in files_of(route[1]).items()
                ]
                data = json.dumps(tree).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return None
            if route and route[0] == "resolve":
                return self._file(route[1], route[2], body=True)
            if (
                self.path.split("?")[0] == "/api/agent-harnesses"
            ):  # huggingface_hub's user-agent registry, at most once a process
                return self._reply(404, {"error": "not in the stand-in"})
            record.unexpected.append(f"GET {self.path}")
            self._reply(404, {"error": "not in the stand-in"})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    record.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield record
    finally:
        server.shutdown()
        server.server_close()
