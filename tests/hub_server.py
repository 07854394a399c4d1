"""A small Hugging Face Hub-compatible HTTP server on 127.0.0.1, for push/pull round trips in tests.

It speaks the endpoints huggingface_hub's ``create_repo``, ``create_branch``, ``list_repo_files``,
``upload_folder`` (preupload + ndjson commit, every file "regular", so no LFS) and ``hf_hub_download``
(HEAD/GET ``/{repo}/resolve/{rev}/{path}``) use, with bearer-token checks on writes. Repos live in memory.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class HubState:
    def __init__(self, token: str):
        self.token = token
        self.repos: dict[str, dict] = {}  # repo_id -> {"private": bool, "branches": {name: {"files": {}, "sha": str}}}
        self.commits: list[dict] = []
        self.auth_headers_seen: list[str] = []


def _sha(files: dict[str, bytes]) -> str:
    h = hashlib.sha1()
    for k in sorted(files):
        h.update(k.encode() + hashlib.sha1(files[k]).digest())
    return h.hexdigest()


def make_handler(state: HubState, endpoint: list[str]):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep test output clean
            pass

        # -- helpers ------------------------------------------------------------------------------------------
        def _send(self, code: int, body: bytes | dict | list = b"", headers: dict | None = None, head: bool = False):
            if isinstance(body, (dict, list)):
                body = json.dumps(body).encode()
                headers = {"Content-Type": "application/json", **(headers or {})}
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head and self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, code: int, error_code: str, message: str):
            self._send(code, {"error": message}, {"X-Error-Code": error_code, "X-Error-Message": message})

        def _body(self) -> bytes:
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _authorized(self) -> bool:
            auth = self.headers.get("Authorization", "")
            state.auth_headers_seen.append(auth)
            return auth == f"Bearer {state.token}"

        def _branch(self, repo: str, rev: str):
            r = state.repos.get(repo)
            if r is None:
                return None, "RepoNotFound"
            b = r["branches"].get(rev) or r["snapshots"].get(rev)  # a branch name or a commit sha
            if b is None:
                return None, "RevisionNotFound"
            return b, None

        # -- routes -------------------------------------------------------------------------------------------
        def do_HEAD(self):
            self._resolve(head=True)

        def do_GET(self):
            path = unquote(urlparse(self.path).path)
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path)
            if m:
                b, err = self._branch(m.group(1), m.group(2))
                if b is None:
                    return self._error(404, err, "not found")
                return self._send(200, [{"type": "file", "path": p, "size": len(c), "oid": hashlib.sha1(c).hexdigest()}
                                        for p, c in sorted(b["files"].items())])
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
            if m:
                b, err = self._branch(m.group(1), m.group(2) or "main")
                if b is None:
                    return self._error(404, err, "not found")
                return self._send(200, {"id": m.group(1), "modelId": m.group(1), "sha": b["sha"],
                                        "private": state.repos[m.group(1)]["private"],
                                        "siblings": [{"rfilename": p} for p in sorted(b["files"])]})
            self._resolve(head=False)

        def _resolve(self, head: bool):
            path = unquote(urlparse(self.path).path)
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if not m:
                return self._error(404, "EntryNotFound", f"no route {path}")
            repo, rev, name = m.groups()
            b, err = self._branch(repo, rev)
            if b is None:
                return self._error(404, err, "not found")
            if name not in b["files"]:
                return self._error(404, "EntryNotFound", f"{name} not found")
            content = b["files"][name]
            etag = '"' + hashlib.sha256(content).hexdigest() + '"'
            self._send(200, content, {"X-Repo-Commit": b["sha"], "ETag": etag, "Content-Type": "application/octet-stream"}, head=head)

        def do_POST(self):
            path = unquote(urlparse(self.path).path)
            body = self._body()
            if not self._authorized():
                return self._error(401, "Unauthorized", "Invalid credentials in Authorization header")
            if path == "/api/validate-yaml":  # the Hub checks the model card's metadata before a commit
                import yaml

                content = json.loads(body).get("content", "")
                parts = content.split("---")
                try:
                    meta = yaml.safe_load(parts[1]) if content.startswith("---") and len(parts) > 2 else None
                    ok = isinstance(meta, dict) and isinstance(meta.get("tags", []), list)
                except yaml.YAMLError:
                    ok = False
                if not ok:
                    return self._send(400, {"errors": [{"message": "invalid model card metadata"}], "warnings": []})
                return self._send(200, {"errors": [], "warnings": []})
            if path == "/api/repos/create":
                req = json.loads(body)
                repo = f"{req.get('organization') or 'user'}/{req['name']}"
                if repo in state.repos:
                    return self._send(409, {"error": "You already created this model repo", "url": f"{endpoint[0]}/{repo}"})
                private = bool(req.get("private")) or req.get("visibility") == "private"  # older and newer clients
                state.repos[repo] = {"private": private, "branches": {"main": {"files": {}, "sha": _sha({})}},
                                     "snapshots": {}}
                return self._send(200, {"url": f"{endpoint[0]}/{repo}", "name": repo})
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/branch/([^/]+)", path)
            if m:
                r = state.repos.get(m.group(1))
                if r is None:
                    return self._error(404, "RepoNotFound", "not found")
                if m.group(2) in r["branches"]:
                    return self._send(409, {"error": "Reference already exists"})
                r["branches"][m.group(2)] = dict(r["branches"]["main"], files=dict(r["branches"]["main"]["files"]))
                return self._send(200, {})
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/preupload/([^/]+)", path)
            if m:
                files = json.loads(body)["files"]
                return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/commit/([^/]+)", path)
            if m:
                b, err = self._branch(m.group(1), m.group(2))
                if b is None:
                    return self._error(404, err, "not found")
                header = None
                for line in body.splitlines():
                    item = json.loads(line)
                    if item["key"] == "header":
                        header = item["value"]
                    elif item["key"] == "file":
                        v = item["value"]
                        b["files"][v["path"]] = base64.b64decode(v["content"]) if v.get("encoding") == "base64" else v["content"].encode()
                    elif item["key"] == "deletedFile":
                        b["files"].pop(item["value"]["path"], None)
                b["sha"] = _sha(b["files"])
                state.repos[m.group(1)]["snapshots"][b["sha"]] = {"files": dict(b["files"]), "sha": b["sha"]}
                state.commits.append({"repo": m.group(1), "revision": m.group(2), "summary": (header or {}).get("summary")})
                return self._send(200, {"commitUrl": f"{endpoint[0]}/{m.group(1)}/commit/{b['sha']}", "commitOid": b["sha"]})
            self._error(404, "EntryNotFound", f"no route {path}")

        def do_PUT(self):  # update_repo_settings: visibility
            path = unquote(urlparse(self.path).path)
            body = self._body()
            if not self._authorized():
                return self._error(401, "Unauthorized", "Invalid credentials in Authorization header")
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/settings", path)
            if m and m.group(1) in state.repos:
                req = json.loads(body or b"{}")
                if "private" in req or "visibility" in req:
                    state.repos[m.group(1)]["private"] = bool(req.get("private")) or req.get("visibility") == "private"
                return self._send(200, {})
            self._error(404, "RepoNotFound", f"no route {path}")

    return Handler


class HubServer:
    def __init__(self, token: str = "hf_test_secret_token"):
        self.state = HubState(token)
        endpoint = [""]
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(self.state, endpoint))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        endpoint[0] = self.url
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
