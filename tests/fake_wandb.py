#!/usr/bin/python3
"""A fake Weights & Biases server for the tests of the W&B client (wandb/).

Implements section 9 of the wire protocol (../shared/reference/wandb-protocol.md,
docs/wandb.md): GraphQL UpsertBucket, CreateRunFiles, Viewer and
ServerFeaturesQuery; FileStream; signed storage PUTs. An UpsertBucket of a
completed run starts a new session of it (results attached later). Every request is checked (section 9.2) and each problem
is recorded as a violation; --strict also answers it with 400. Faults are
injected through POST /_fake/inject (section 9.3). GET /_fake/state returns
everything the tests assert on; POST /_fake/shutdown stops the server, which
then writes the same state to --state-file.

usage: fake_wandb.py --port-file F [--port N] [--state-file F] [--api-key KEY]
                     [--min-gap S] [--heartbeat-limit S] [--strict]
Listens on 127.0.0.1 on a free port (or --port), written to --port-file once
it accepts connections. Standard library only.
"""
import argparse
import base64
import gzip
import hashlib
import json
import math
import os
import re
import secrets
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

MAX_LINE = 10_383_360
MAX_LINES_PER_REQUEST = 10 * 1024 * 1024 + 64 * 1024  # 10 MiB of lines plus a margin
MAX_CONFIG = 15 * 1000 * 1000
RUN_ID_FORBIDDEN = set(":;,#?/'")
PROJECT_FORBIDDEN = set("/\\#?%:")
HISTORY_SPECIAL = {"_step", "_runtime", "_timestamp", "_wandb"}
FILESTREAM_FIELDS = {"files", "uploaded", "preempting", "complete", "exitcode", "dropped", "failed"}
DEFAULT_ENTITY = "fake-default-entity"

UPSERT_RE = re.compile(r"mutation\s+UpsertBucket\b")
CREATE_FILES_RE = re.compile(r"mutation\s+CreateRunFiles\b")
VIEWER_RE = re.compile(r"query\s+Viewer\b")
FEATURES_RE = re.compile(r"query\s+ServerFeaturesQuery\b")
FILESTREAM_RE = re.compile(r"^/files/([^/]+)/([^/]+)/([^/]+)/file_stream$")
STORAGE_RE = re.compile(r"^/storage/([^/]+)/([^/]+)/([^/]+)/(.+)$")


class Reply(Exception):
    """Ends a request early with this status and JSON body."""

    def __init__(self, status, body):
        super().__init__(status)
        self.status, self.body = status, body


def gql_error(message):
    return {"errors": [{"message": message}]}


class Fake:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.runs = {}          # (entity, project, name) -> run dict
        self.requests = []      # one entry per request, control endpoints excluded
        self.violations = []
        self.rules = []         # fault injection rules, applied in order
        self.not_before = 0.0   # earliest time allowed by Retry-After / RateLimit-Reset
        self.port = 0

    def violation(self, text):
        self.violations.append(text)
        if self.args.strict:
            raise Reply(400, gql_error("fake server: " + text))

    def take_rule(self, op, path):
        """The first rule matching this request (by operation name or path regex), consumed once;
        a rule with "for_s" matches every such request for that many seconds after it was injected."""
        for rule in self.rules:
            if rule["times"] <= 0 or time.time() >= rule.get("until", math.inf):
                continue
            m = rule["match"]
            if m != op and not re.search(m, path):
                continue
            if rule.get("after", 0) > 0:
                rule["after"] -= 1
                continue
            rule["times"] -= 1
            return rule
        return None

    def auth_ok(self, header):
        want = "Basic " + base64.b64encode(("api:" + self.args.api_key).encode()).decode()
        return header == want

    # --- GraphQL ----------------------------------------------------------

    def upsert(self, v):
        name = v.get("name")
        if not isinstance(name, str) or not name or name != name.strip() or set(name) & RUN_ID_FORBIDDEN:
            self.violation(f"UpsertBucket: bad run name {name!r}")
            raise Reply(400, gql_error("invalid run name"))
        project = v.get("project")
        if project is None:
            project = "uncategorized"
        if not isinstance(project, str) or not project or len(project) > 128 or set(project) & PROJECT_FORBIDDEN:
            self.violation(f"UpsertBucket: bad project {project!r}")
            raise Reply(400, gql_error("invalid project name"))
        entity = v.get("entity") or DEFAULT_ENTITY
        config = v.get("config")
        if config is not None:
            if not isinstance(config, str):
                self.violation("UpsertBucket: config is not a JSON string")
                raise Reply(400, gql_error("config must be a JSONString"))
            if len(config) > MAX_CONFIG:
                raise Reply(400, {"data": {"upsertBucket": None},
                                  "errors": [{"message": "run config cannot exceed 15 MB", "path": ["upsertBucket"]}]})
            try:
                config = json.loads(config)
            except ValueError:
                config = None
            if not isinstance(config, dict) or not all(isinstance(x, dict) and "value" in x for x in config.values()):
                self.violation("UpsertBucket: config is not an object of {\"value\": ...} entries")
        tags = v.get("tags")
        if tags is not None and (not isinstance(tags, list) or
                                 not all(isinstance(t, str) and 1 <= len(t) <= 64 for t in tags)):
            self.violation(f"UpsertBucket: bad tags {tags!r}")
        key = (entity, project, name)
        run = self.runs.get(key)
        inserted = run is None
        if inserted:
            run = self.runs[key] = {
                "entity": entity, "project": project, "name": name,
                "id": base64.b64encode(f"Run:v1:{name}:{project}:{entity}".encode()).decode(),
                "displayName": None, "group": None, "jobType": None, "notes": None, "tags": [],
                "host": None, "program": None, "commit": None, "repo": None, "config": None,
                "history": [], "rows": [], "summary": {}, "events": [], "output": [],
                "uploaded": [], "files": {}, "signatures": {}, "completed": False, "exitcode": None,
                "stopped": False, "duplicates": 0, "upserts": 0, "reopened": 0, "filestream_requests": 0,
                "last_request": None, "last_data": None, "retry_body": None, "complete_time": None}
        run["upserts"] += 1
        if run["completed"]:  # a new session of a finished run (results attached later): it runs until complete again
            run["completed"] = False
            run["reopened"] += 1
        run["last_request"] = time.time()  # a new session (a sync) starts its own heartbeat and retry checks
        run["retry_body"] = None
        for field, var in [("displayName", "displayName"), ("group", "groupName"), ("jobType", "jobType"),
                           ("notes", "notes"), ("host", "host"), ("program", "program"),
                           ("commit", "commit"), ("repo", "repo"), ("tags", "tags")]:
            if v.get(var) is not None:
                run[field] = v[var]
        if config is not None:
            run["config"] = config
        if run["displayName"] is None:
            run["displayName"] = "fake-" + name
        bucket = {"id": run["id"], "name": name, "displayName": run["displayName"],
                  "project": {"name": project, "entity": {"name": entity}},
                  "historyLineCount": len(run["history"])}
        return {"data": {"upsertBucket": {"bucket": bucket, "inserted": inserted}}}

    def create_run_files(self, v):
        run = self.runs.get((v.get("entity"), v.get("project"), v.get("run")))
        if run is None:
            return {"data": {"createRunFiles": {"runID": None, "uploadHeaders": [], "files": []}}}
        token = secrets.token_hex(8)  # one per call: it is both the URL signature and the header to echo
        files = []
        for name in v.get("files") or []:
            run["signatures"][name] = token
            url = (f"http://127.0.0.1:{self.port}/storage/{quote(run['entity'])}/{quote(run['project'])}/"
                   f"{quote(run['name'])}/{quote(name)}?sig={token}")
            files.append({"name": name, "uploadUrl": url})
        headers = ["Content-Type: application/octet-stream", "X-Fake-Sig: " + token]
        return {"data": {"createRunFiles": {"runID": run["id"], "uploadHeaders": headers, "files": files}}}

    def graphql(self, headers, body):
        if (headers.get("Content-Type") or "").split(";")[0].strip() != "application/json":
            self.violation("GraphQL: Content-Type is not application/json")
        try:
            req = json.loads(body)
        except ValueError:
            req = None
        if not isinstance(req, dict) or not isinstance(req.get("query"), str):
            self.violation("GraphQL: body is not a JSON object with a string query")
            raise Reply(400, gql_error("bad request"))
        op = graphql_operation(req)
        v = req.get("variables") or {}
        if op == "Viewer":
            return {"data": {"viewer": {"id": "u1", "entity": DEFAULT_ENTITY, "username": "tester"}}}
        if op == "ServerFeaturesQuery":
            return {"data": {"serverInfo": {"features": []}}}
        if op == "UpsertBucket":
            return self.upsert(v)
        if op == "CreateRunFiles":
            return self.create_run_files(v)
        raise Reply(400, gql_error("unknown operation"))

    # --- FileStream ---------------------------------------------------------

    def history(self, run, offset, lines):
        stored = run["history"]
        if offset > len(stored):
            self.violation(f"history: offset {offset} leaves a gap after {len(stored)} stored lines")
            raise Reply(400, {"error": "offset gap"})
        overlap = min(len(stored) - offset, len(lines))
        if lines[:overlap] != stored[offset:offset + overlap]:
            self.violation(f"history: resend at offset {offset} differs from the stored lines")
            raise Reply(400, {"error": "overlapping resend differs"})
        run["duplicates"] += overlap
        for line in lines[overlap:]:
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict):
                self.violation(f"history: line {len(stored)} is not a JSON object: {line[:80]!r}")
                row = {}
            prev = run["rows"][-1] if run["rows"] else None
            step, rt, ts = row.get("_step"), row.get("_runtime"), row.get("_timestamp")
            if not isinstance(step, int) or isinstance(step, bool):
                self.violation(f"history: line {len(stored)} has no integer _step")
            elif prev is not None and isinstance(prev.get("_step"), int) and step <= prev["_step"]:
                self.violation(f"history: _step {step} after {prev['_step']}")
            if not isinstance(rt, (int, float)) or rt < 0:
                self.violation(f"history: line {len(stored)} has no _runtime >= 0")
            elif prev is not None and isinstance(prev.get("_runtime"), (int, float)) and rt < prev["_runtime"]:
                self.violation(f"history: _runtime {rt} after {prev['_runtime']}")
            if not isinstance(ts, (int, float)) or abs(ts - time.time()) > 86400:
                self.violation(f"history: line {len(stored)} has no _timestamp within a day of now")
            for k in row:
                if k.startswith("_") and k not in HISTORY_SPECIAL:
                    self.violation(f"history: user key {k!r} starts with _")
            stored.append(line)
            run["rows"].append(row)

    def filestream(self, run, body, t):
        try:
            req = json.loads(body)
        except ValueError:
            req = None
        if not isinstance(req, dict):
            self.violation("FileStream: body is not a JSON object")
            raise Reply(400, {"error": "bad request"})
        extra = set(req) - FILESTREAM_FIELDS
        if extra:
            self.violation(f"FileStream: unknown fields {sorted(extra)}")
        files = req.get("files") or {}
        total, nlines = 0, 0
        for name, f in files.items():
            if (not isinstance(f, dict) or not isinstance(f.get("offset"), int) or f["offset"] < 0
                    or not isinstance(f.get("content"), list) or not all(isinstance(c, str) for c in f["content"])):
                self.violation(f"FileStream: bad entry for {name}")
                raise Reply(400, {"error": "bad file entry"})
            for c in f["content"]:
                if len(c) > MAX_LINE:
                    raise Reply(413, {"error": "line too long"})
                total += len(c)
                nlines += 1
        if total > MAX_LINES_PER_REQUEST and nlines > 1:
            self.violation(f"FileStream: {total} bytes of lines in one request")
        if "wandb-history.jsonl" in files:
            f = files["wandb-history.jsonl"]
            self.history(run, f["offset"], f["content"])
        if "wandb-summary.json" in files:
            f = files["wandb-summary.json"]
            summary = None
            if len(f["content"]) == 1:
                try:
                    summary = json.loads(f["content"][0])
                except ValueError:
                    pass
            if f["offset"] != 0 or not isinstance(summary, dict):
                self.violation("summary: not one JSON object at offset 0")
            else:
                run["summary"] = summary
        for name, key in [("wandb-events.jsonl", "events"), ("output.log", "output")]:
            if name in files:
                f, lines = files[name], run[key]
                lines[f["offset"]:f["offset"] + len(f["content"])] = f["content"]
        for name in req.get("uploaded") or []:
            if name not in run["files"]:
                self.violation(f"uploaded: {name!r} was never PUT")
            if name not in run["uploaded"]:
                run["uploaded"].append(name)
        if req.get("complete") is True:
            if not isinstance(req.get("exitcode"), int) or isinstance(req.get("exitcode"), bool):
                self.violation("complete without an integer exitcode")
            run["completed"], run["exitcode"], run["complete_time"] = True, req.get("exitcode"), t
        elif "exitcode" in req:
            self.violation("exitcode sent without complete")
        return {"stopped": run["stopped"]}

    def check_filestream_arrival(self, run, body, t, is_data, dropped):
        """Checks that depend on when the request came: after complete, identical retries, pacing, heartbeats.
        A request the server drops unanswered does not count for timing: libcurl resends at once on a
        fresh connection when a reused one dies, exactly as it would for a server's idle close."""
        if run["completed"]:
            self.violation(f"post-complete traffic to {run['name']}")
        if run["retry_body"] is not None:
            if body != run["retry_body"]:
                self.violation("FileStream: the retry after a failed request is not an identical resend")
            run["retry_body"] = None
        if dropped:
            return
        if is_data and run["last_data"] is not None and t - run["last_data"] < self.args.min_gap:
            self.violation(f"pacing: data requests {t - run['last_data']:.3f} s apart (minimum {self.args.min_gap} s)")
        if (self.args.heartbeat_limit > 0 and run["last_request"] is not None
                and t - run["last_request"] > self.args.heartbeat_limit):
            self.violation(f"heartbeat: no request for {t - run['last_request']:.3f} s "
                           f"(limit {self.args.heartbeat_limit} s)")
        if is_data:
            run["last_data"] = t
        run["last_request"] = t
        run["filestream_requests"] += 1

    # --- storage ------------------------------------------------------------

    def storage(self, run, name, query, headers, body, has_length):
        if headers.get("Authorization") is not None:
            self.violation(f"credential leak: Authorization header on the storage PUT of {name}")
        token = run["signatures"].get(name)
        if token is None or parse_qs(query).get("sig") != [token]:
            self.violation(f"storage: bad or missing signature for {name}")
            raise Reply(403, {"error": "bad signature"})
        if headers.get("X-Fake-Sig") != token or headers.get("Content-Type") != "application/octet-stream":
            self.violation(f"storage: uploadHeaders not echoed on the PUT of {name}")
        if not has_length:
            self.violation(f"storage: PUT of {name} without Content-Length")
        entry = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
        if len(body) <= 4096:
            try:
                entry["text"] = body.decode()
            except UnicodeDecodeError:
                pass
        run["files"][name] = entry

    def state(self):
        runs = []
        for run in self.runs.values():
            r = {k: v for k, v in run.items() if k not in ("signatures", "retry_body", "last_data", "last_request")}
            runs.append(r)
        return finite({"runs": runs, "requests": self.requests, "violations": self.violations,
                       "rules": self.rules})


def graphql_operation(req):
    op = req.get("operationName")
    if isinstance(op, str) and op:
        return op
    q = req["query"]
    for name, rx in [("UpsertBucket", UPSERT_RE), ("CreateRunFiles", CREATE_FILES_RE),
                     ("Viewer", VIEWER_RE), ("ServerFeaturesQuery", FEATURES_RE)]:
        if rx.search(q):
            return name
    return "unknown"


def finite(x):
    """Strict JSON for the state: NaN and infinities become the strings "NaN", "Infinity", "-Infinity"."""
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [finite(v) for v in x]
    return x


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; every answer has a Content-Length

    def log_message(self, fmt, *args):
        pass

    def do_GET(self):
        self.serve("GET")

    def do_POST(self):
        self.serve("POST")

    def do_PUT(self):
        self.serve("PUT")

    def send(self, status, body=None, headers=()):
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def serve(self, method):
        try:
            self.serve_checked(method)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up on a delayed answer

    def serve_checked(self, method):
        fake = self.server.fake
        t = time.time()
        length = self.headers.get("Content-Length")
        body = self.rfile.read(int(length)) if length else b""
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        url = urlsplit(self.path)
        path = unquote(url.path)
        if path.startswith("/_fake/"):
            return self.control(fake, method, path, body)

        fs = FILESTREAM_RE.match(path) if method == "POST" else None
        st = STORAGE_RE.match(path) if method == "PUT" else None
        if method == "POST" and path == "/graphql":
            try:
                op = graphql_operation(json.loads(body))
            except (ValueError, KeyError, TypeError, AttributeError):
                op = "unknown"
        else:
            op = "FileStream" if fs else "Storage" if st else "unknown"
        entry = {"t": t, "method": method, "path": path, "op": op, "bytes": len(body),
                 "auth": self.headers.get("Authorization") is not None, "status": None}
        if fs:
            entry["fs"] = filestream_summary(body)
        early = None
        with fake.lock:
            fake.requests.append(entry)
            if t < fake.not_before - 0.02:
                fake.violations.append(f"{op} came {fake.not_before - t:.3f} s before Retry-After/RateLimit-Reset allowed")
            rule = fake.take_rule(op, path)
            # timing checks happen on arrival, before any injected delay or failure
            run = fake.runs.get(fs.groups()) if fs else None
            if run is not None and fake.auth_ok(self.headers.get("Authorization")):
                try:
                    fake.check_filestream_arrival(run, body, t, carries_data(body),
                                                  bool(rule and rule["action"].get("close_connection")))
                except Reply as r:
                    early = r
        if early is not None:
            entry["status"] = early.status
            return self.send(early.status, early.body)
        action = rule["action"] if rule else {}
        if "delay_ms" in action:
            time.sleep(action["delay_ms"] / 1000)
        if action.get("close_connection"):
            entry["status"] = "closed"
            if fs:
                self.note_failed_filestream(fake, fs, body)
            self.close_connection = True
            return
        if "status" in action:
            status = action["status"]
            headers = []
            if "retry_after" in action:
                headers.append(("Retry-After", str(action["retry_after"])))
                with fake.lock:
                    fake.not_before = time.time() + float(action["retry_after"])
            if fs and (status in (408, 429) or (status >= 500 and status != 501)):
                self.note_failed_filestream(fake, fs, body)
            entry["status"] = status
            return self.send(status, action.get("body", gql_error(f"injected {status}")), headers)
        if "graphql_errors" in action:
            entry["status"] = 200
            return self.send(200, {"data": None, "errors": [{"message": action["graphql_errors"]}]})

        headers = []
        if "ratelimit_headers" in action:
            rl = action["ratelimit_headers"]
            headers = [("RateLimit-Remaining", str(rl["remaining"])), ("RateLimit-Reset", str(rl["reset"]))]
        with fake.lock:
            try:
                status, answer = 200, self.route(fake, method, path, url.query, op, fs, st, body, t, action)
            except Reply as r:
                status, answer = r.status, r.body
            entry["status"] = status
            if headers and int(action["ratelimit_headers"]["remaining"]) <= 0:
                fake.not_before = time.time() + float(action["ratelimit_headers"]["reset"])
        self.send(status, answer, headers)

    def note_failed_filestream(self, fake, fs, body):
        """The client must resend exactly this body after an injected failure it may retry."""
        with fake.lock:
            run = fake.runs.get(fs.groups())
            if run is not None:
                run["retry_body"] = body

    def route(self, fake, method, path, query, op, fs, st, body, t, action):
        if method == "POST" and path == "/graphql":
            if not fake.auth_ok(self.headers.get("Authorization")):
                raise Reply(401, gql_error("permission denied"))
            return fake.graphql(self.headers, body)
        if fs:
            if not fake.auth_ok(self.headers.get("Authorization")):
                raise Reply(401, gql_error("permission denied"))
            run = fake.runs.get(fs.groups())
            if run is None:
                fake.violations.append(f"FileStream for a run that was never upserted: {path}")
                raise Reply(404, {"error": "run not found"})
            if action.get("stopped"):
                run["stopped"] = True
            return fake.filestream(run, body, t)
        if st:
            entity, project, name, fname = st.groups()
            run = fake.runs.get((entity, project, name))
            if run is None:
                raise Reply(404, {"error": "run not found"})
            fake.storage(run, fname, query, self.headers, body, self.headers.get("Content-Length") is not None)
            return None
        raise Reply(404, {"error": "no such endpoint"})

    def control(self, fake, method, path, body):
        if method == "GET" and path == "/_fake/state":
            with fake.lock:
                return self.send(200, fake.state())
        if method == "POST" and path == "/_fake/inject":
            rules = json.loads(body)
            with fake.lock:
                for rule in rules if isinstance(rules, list) else [rules]:
                    rule.setdefault("times", 1)
                    if "for_s" in rule:
                        rule["until"] = time.time() + float(rule["for_s"])
                        rule["times"] = 10**9
                    rule.setdefault("action", {})
                    fake.rules.append(rule)
            return self.send(200, {})
        if method == "POST" and path == "/_fake/shutdown":
            self.send(200, {})
            threading.Thread(target=self.server.shutdown).start()
            return None
        return self.send(404, {"error": "no such control endpoint"})


def carries_data(body):
    """Data-bearing FileStream requests (files or uploaded) are the ones paced."""
    try:
        req = json.loads(body)
    except ValueError:
        return False
    return isinstance(req, dict) and bool(req.get("files") or req.get("uploaded"))


def filestream_summary(body):
    """What a FileStream request carried, for the request log."""
    try:
        req = json.loads(body)
    except ValueError:
        return {"json": False}
    if not isinstance(req, dict):
        return {"json": False}
    files = req.get("files") or {}
    hist = files.get("wandb-history.jsonl") or {}
    return {"json": True, "heartbeat": req == {},
            "history_offset": hist.get("offset"), "history_lines": len(hist.get("content") or []),
            "summary": "wandb-summary.json" in files, "uploaded": req.get("uploaded") or [],
            "complete": req.get("complete") is True}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--port", type=int, default=0, help="port to listen on (0: a free one)")
    ap.add_argument("--state-file")
    ap.add_argument("--api-key", default="test-key")
    ap.add_argument("--min-gap", type=float, default=0.0, help="minimum seconds between data-bearing FileStream requests")
    ap.add_argument("--heartbeat-limit", type=float, default=0.0, help="maximum seconds between requests of a live run (0: off)")
    ap.add_argument("--strict", action="store_true", help="answer every violation with 400")
    args = ap.parse_args()

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    server.fake = Fake(args)
    server.fake.port = server.server_address[1]
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{server.fake.port}\n")
    os.replace(tmp, args.port_file)  # the port file appearing is the readiness signal
    server.serve_forever()
    if args.state_file:
        with server.fake.lock:
            state = server.fake.state()
        with open(args.state_file + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(args.state_file + ".tmp", args.state_file)


if __name__ == "__main__":
    main()
