"""A local stand-in for the Hugging Face Hub's upload API, on 127.0.0.1, for push tests.

It answers the calls `HfApi.create_repo` + `HfApi.upload_folder` make (huggingface_hub 2.x,
hf_api.py `create_repo`, _commit_api.py `_fetch_upload_modes` / `_prepare_commit_payload`):

- `POST /api/repos/create`: records the request (name, organisation, visibility, the token);
- `POST /api/models/{org}/{name}/preupload/{revision}`: says "regular" for every file, so files travel
  base64-encoded inside the commit (no LFS/xet storage to emulate);
- `POST /api/models/{org}/{name}/commit/{revision}`: reads the NDJSON commit and keeps each file's bytes.

Anything else is answered 404 and recorded, so a test sees an unexpected call.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class HubRecord:
    url: str = ""
    created: list[dict[str, Any]] = field(default_factory=list)
    files: dict[str, dict[str, bytes]] = field(default_factory=dict)  # repo id -> path -> content
    authorizations: set[str] = field(default_factory=set)
    unexpected: list[str] = field(default_factory=list)


@contextmanager
def hub_standin() -> Iterator[HubRecord]:
    record = HubRecord()

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

        def do_POST(self) -> None:
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
