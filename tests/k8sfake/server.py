"""The fake Kubernetes API server: real HTTP on loopback, for the real client libraries.

:class:`FakeCluster` owns a :class:`~tests.k8sfake.store.Store`, a ``ThreadingHTTPServer`` (one thread per
request, so watches stream while other requests are served) and a simulator thread that reconciles the
Kueue, Trainer and kubelet simulators on every change and every :data:`TICK` seconds. The handler here
maps the API server's paths and verbs onto the store: create (with schema validation by
``tests.k8sschemas.errors`` and the API server's own pod validation, :mod:`.validation`), get, list, watch,
replace, merge, strategic merge and JSON patch (also on ``/status``), delete with ``propagationPolicy``,
pod logs, Kueue's visibility API and SelfSubjectAccessReview. A service account's requests are authorized
by the stored Roles and RoleBindings (:mod:`.rbac`). Every error is a ``kind: Status``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from . import extras, kueue, rbac, trainer, validation
from .kubelet import Kubelet
from .store import (
    KINDS,
    RESOURCES,
    ApiError,
    Store,
    api_version,
    json_patch,
    label_matcher,
    merge_patch,
    now,
    strategic_merge_patch,
)

TICK = 0.2
TOKEN = "danlu-fake-token"
VISIBILITY = ("apis", "visibility.kueue.x-k8s.io", "v1beta1")
ACCESS_REVIEW = ("apis", "authorization.k8s.io", "v1", "selfsubjectaccessreviews")


def _validation_errors(obj: dict) -> list[str]:
    from tests.k8sschemas import errors

    return errors(obj)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK wait per answer
    server: _Server

    def log_message(self, *args):  # quiet: the request log is cluster.requests
        pass

    def do_GET(self):
        self._serve("GET")

    def do_POST(self):
        self._serve("POST")

    def do_PUT(self):
        self._serve("PUT")

    def do_PATCH(self):
        self._serve("PATCH")

    def do_DELETE(self):
        self._serve("DELETE")

    # --- plumbing ---

    def _body(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise ApiError(400, "BadRequest", "the request body is not JSON") from None

    def _send(self, code: int, body, content_type="application/json"):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _serve(self, method: str):
        cluster = self.server.cluster
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        with cluster.store.lock:
            cluster.requests.append((method, url.path))
        try:
            body = self._body()
            token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
            if token != cluster.token and token not in cluster.accounts:
                raise ApiError(401, "Unauthorized", "Unauthorized")
            self.who = cluster.accounts.get(token)  # None: the cluster admin
            self._route(method, url.path, query, body)
        except ApiError as e:
            self._send(e.code, e.status())
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:  # a bug in the fake: a 500 the test can see, and the traceback kept
            cluster.errors.append(traceback.format_exc())
            self._send(500, ApiError(500, "InternalError", f"fake API server bug: {e!r}").status())

    def _route(self, method, path, query, body):
        cluster = self.server.cluster
        parts = [p for p in path.split("/") if p]
        if tuple(parts) == ACCESS_REVIEW and method == "POST":
            return self._send(201, rbac.access_review(cluster.store, self.who, body or {}))
        if cluster.extras.route(self, method, parts, body):  # the doctor's endpoints (extras.py)
            return
        if tuple(parts[:3]) == VISIBILITY:
            rest = parts[3:]
            if (
                method == "GET"
                and len(rest) == 5
                and rest[0] == "namespaces"
                and rest[2] == "localqueues"
                and rest[4] == "pendingworkloads"
            ):
                rbac.check(cluster.store, self.who, "get", VISIBILITY[1], "localqueues/pendingworkloads", rest[1])
                cluster.check_failure("get", "PendingWorkloadsSummary")
                return self._send(200, cluster.kueue.pending_summary(rest[1], rest[3]))
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if parts[:1] == ["api"] and len(parts) >= 2:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        elif rest[:1] == ["namespaces"] and group == "":
            pass  # /api/v1/namespaces[/name]
        if not rest or (group, version, rest[0]) not in RESOURCES:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        kind, namespaced = RESOURCES[(group, version, rest[0])]
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if namespaced and name is not None and namespace is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if sub not in (None, "status", "log") or (sub == "log" and kind != "Pod"):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")

        if method == "GET" and name is None:
            verb = "watch" if (query.get("watch") or "").lower() in ("true", "1") else "list"
        else:
            verb = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[method]
        if method == "POST" and name is not None:
            raise ApiError(405, "MethodNotAllowed", "POST to a named object is not allowed")
        if method in ("PUT", "PATCH", "DELETE") and name is None:
            raise ApiError(405, "MethodNotAllowed", f"{method} on a collection is not supported by the fake")
        plural = KINDS[kind][2] + (f"/{sub}" if sub else "")
        rbac.check(cluster.store, self.who, verb, group, plural, namespace)
        cluster.check_failure(verb, kind)
        store = cluster.store

        if verb == "list":
            items = store.list(kind, namespace, query.get("labelSelector"), query.get("fieldSelector"))
            return self._send(
                200,
                {
                    "kind": f"{kind}List",
                    "apiVersion": api_version(kind),
                    "metadata": {"resourceVersion": str(store.rv)},
                    "items": items,
                },
            )
        if verb == "watch":
            return self._watch(kind, namespace, query)
        if verb == "get" and sub == "log":
            return self._send(200, cluster.kubelet.log(namespace, name, query), "text/plain")
        if verb == "get":
            return self._send(200, store.get(kind, namespace, name))
        if verb == "create":
            return self._send(201, cluster.create(self._checked(body, kind, namespace, None)))
        if verb == "delete":
            options = body or {}
            grace = query.get("gracePeriodSeconds", options.get("gracePeriodSeconds"))
            policy = query.get("propagationPolicy", options.get("propagationPolicy"))
            return self._send(200, cluster.delete(kind, namespace, name, policy, None if grace is None else int(grace)))
        current = store.get(kind, namespace, name)
        if verb == "patch":
            content_type = (self.headers.get("Content-Type") or "").split(";")[0]
            if content_type == "application/json-patch+json":
                new = json_patch(current, body or [])
            elif content_type in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                if not isinstance(body, dict):  # e.g. a JSON patch sent without its content type
                    raise ApiError(
                        400,
                        "BadRequest",
                        "error decoding patch: json: cannot unmarshal "
                        f"{type(body).__name__} into Go value of type map[string]interface {{}}",
                    )
                new = (strategic_merge_patch if "strategic" in content_type else merge_patch)(current, body)
            else:
                raise ApiError(415, "UnsupportedMediaType", f"the fake does not support {content_type!r} patches")
            new["metadata"]["resourceVersion"] = (
                body.get("metadata", {}).get("resourceVersion") if isinstance(body, dict) else None
            )
        else:
            new = self._checked(body, kind, namespace, name)
        if sub == "status":  # the subresource changes status only, the main resource everything else
            new = {
                **current,
                "status": new.get("status"),
                "metadata": {**current["metadata"], "resourceVersion": new["metadata"].get("resourceVersion")},
            }
        elif "status" in current:
            new["status"] = current["status"]
        new = self._checked(new, kind, namespace, name)
        self._send(200, store.replace(new, status=sub == "status"))

    def _checked(self, obj, kind, namespace, name) -> dict:
        if not isinstance(obj, dict):
            raise ApiError(400, "BadRequest", "the request body must be a JSON object")
        obj.setdefault("kind", kind)
        obj.setdefault("apiVersion", api_version(kind))
        meta = obj.setdefault("metadata", {})
        if obj["kind"] != kind or obj["apiVersion"] != api_version(kind):
            raise ApiError(
                400, "BadRequest", f"the body is a {obj['apiVersion']}/{obj['kind']}, not a {api_version(kind)}/{kind}"
            )
        if namespace is not None:
            if meta.setdefault("namespace", namespace) != namespace:
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent on the request",
                )
        if name is not None and meta.get("name") != name:
            raise ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
        if kind not in ("Event", "Namespace") and (
            problems := _validation_errors({k: v for k, v in obj.items() if k != "status"} if kind == "Pod" else obj)
        ):
            group = KINDS[kind][0]
            resource = f"{kind}.{group}" if group else kind
            raise ApiError(
                422,
                "Invalid",
                f'{resource} "{meta.get("name")}" is invalid: ' + "; ".join(problems),
                {
                    "name": meta.get("name"),
                    "group": group,
                    "kind": kind,
                    "causes": [
                        {"reason": "FieldValueInvalid", "message": p, "field": p.split(":", 1)[0]} for p in problems
                    ],
                },
            )
        if problems := validation.errors_of(obj):
            raise validation.invalid(obj, problems, KINDS[kind][0])
        return obj

    def _watch(self, kind, namespace, query):
        store, cluster = self.server.cluster.store, self.server.cluster
        labels = label_matcher(query.get("labelSelector"))
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def write(event_type, obj):
            line = json.dumps({"type": event_type, "object": obj}).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()

        def wanted(obj):
            return (
                obj["kind"] == kind
                and (namespace is None or obj["metadata"].get("namespace") == namespace)
                and labels(obj)
            )

        rv = query.get("resourceVersion")
        try:
            if rv in (None, "", "0"):
                with store.lock:
                    initial, last = store.list(kind, namespace, query.get("labelSelector")), store.rv
                for obj in initial:
                    write("ADDED", obj)
            else:
                last = int(rv)
                try:
                    store.events_since(last)
                except ApiError as e:
                    write("ERROR", e.status())
                    return self.wfile.write(b"0\r\n\r\n")
            while time.monotonic() < deadline and not cluster.stopping:
                with store.changed:
                    events = [e for e in store.events if e.rv > last]
                    if not events:
                        store.changed.wait(min(1.0, max(0.0, deadline - time.monotonic())))
                        continue
                for event in events:
                    last = event.rv
                    if wanted(event.obj):
                        write(event.type, event.obj)
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    cluster: FakeCluster


class FakeCluster:
    """A fake Kubernetes API server with Kueue, Trainer and kubelet simulators, for tests.

    ``start()`` serves on ``127.0.0.1:<free port>`` (``url``); ``write_kubeconfig(path)`` writes a
    kubeconfig for it (bearer token, no TLS); ``stop()`` kills every pod process. ``volumes`` maps a
    PersistentVolumeClaim name to a local folder. ``objects``/``get`` read the store for assertions;
    ``requests`` is every ``(method, path)`` served; ``fail_next`` injects transient errors;
    ``errors`` collects tracebacks of the fake's own bugs (a test can assert it stays empty).
    """

    def __init__(self, namespaces=("default", "danlu"), token: str = TOKEN):
        self.store = Store()
        self.token = token
        self.volumes: dict[str, str] = {}
        self.accounts: dict[str, rbac.Subject] = {}  # bearer token -> service account (RBAC applies)
        self.requests: list[tuple[str, str]] = []
        self.errors: list[str] = []
        self.stopping = False
        self._failures: list[list] = []  # [verb, kind, status, times]
        self._wake = threading.Event()
        self.store.listeners.append(self._wake.set)
        self.workdir = tempfile.mkdtemp(prefix="k8sfake-")
        self.kubelet = Kubelet(self.store, self.volumes, self.workdir)
        self.kueue = kueue.Kueue(self.store)
        self.trainer = trainer.Trainer(self.store, self.kubelet)
        self.extras = extras.Extras(self)
        self.services: dict[tuple[str, str], str] = {}  # (namespace, Service) -> URL its proxy reaches
        for ns in namespaces:
            self.store.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        self._server: _Server | None = None
        self._threads: list[threading.Thread] = []

    # --- lifecycle ---

    def start(self) -> FakeCluster:
        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.cluster = self
        self._threads = [
            threading.Thread(
                target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, name="k8sfake-http", daemon=True
            ),
            threading.Thread(target=self._simulate, name="k8sfake-sim", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return self

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self.stopping = True
        self._wake.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)
        self.kubelet.kill_all()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def service_account_token(self, namespace: str, name: str) -> str:
        """A bearer token for the service account: its requests are authorized by the Roles and RoleBindings
        in the store (:mod:`.rbac`), as the jobs service's are on a cluster."""
        token = f"sa-{namespace}-{name}"
        self.accounts[token] = rbac.Subject(namespace, name)
        return token

    def write_kubeconfig(self, path, token: str | None = None) -> str:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": token or self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "danlu"}}],
        }
        with open(path, "w") as f:
            json.dump(config, f)  # JSON is YAML
        return str(path)

    # --- assertions and injection ---

    def objects(self, kind: str, namespace: str | None = None, label_selector: str | None = None) -> list[dict]:
        return self.store.list(kind, namespace, label_selector)

    def get(self, kind: str, namespace: str | None, name: str) -> dict | None:
        return self.store.find(kind, namespace, name)

    def fail_next(self, verb: str, kind: str, status: int = 500, times: int = 1) -> None:
        """The next ``times`` requests of ``verb`` (get, list, watch, create, update, patch, delete) on
        ``kind`` (``"TrainJob"`` or its plural) fail with ``status`` (500, 503 or 429)."""
        with self.store.lock:
            self._failures.append([verb, kind.lower(), status, times])

    def check_failure(self, verb: str, kind: str) -> None:
        names = {kind.lower(), KINDS[kind][2] if kind in KINDS else kind.lower()}
        with self.store.lock:
            for rule in self._failures:
                if rule[0] == verb and rule[1] in names and rule[3] > 0:
                    rule[3] -= 1
                    status = rule[2]
                    break
            else:
                return
        reason = {429: "TooManyRequests", 503: "ServiceUnavailable"}.get(status, "InternalError")
        details = {"retryAfterSeconds": 1} if status == 429 else None
        raise ApiError(status, reason, f"injected failure of {verb} {kind}", details)

    # --- verbs with side effects ---

    def create(self, obj: dict) -> dict:
        return self.store.create(obj)

    def delete(self, kind, namespace, name, policy=None, grace=None) -> dict:
        obj = self.store.get(kind, namespace, name)
        if kind == "Pod":
            return self.kubelet.delete(obj, grace)
        dependents = self.store.dependents(obj["metadata"]["uid"]) if policy != "Orphan" else []
        if policy == "Foreground" and dependents:

            def mark(o):
                o["metadata"].setdefault("deletionTimestamp", now())
                o["metadata"]["finalizers"] = sorted({*o["metadata"].get("finalizers", []), "foregroundDeletion"})

            obj = self.store.mutate(kind, namespace, name, mark)
        else:
            self.store.remove(kind, namespace, name)
        for dep in dependents:  # the garbage collector deletes them in the foreground when the owner waits
            try:
                self.delete(
                    dep["kind"],
                    dep["metadata"].get("namespace"),
                    dep["metadata"]["name"],
                    "Foreground" if policy == "Foreground" else "Background",
                    grace,
                )
            except ApiError:
                pass  # already gone
        return obj

    def _finish_foreground(self) -> None:
        for (kind, ns, name), obj in list(self.store.objects.items()):
            if "foregroundDeletion" in obj["metadata"].get("finalizers", []) and not self.store.dependents(
                obj["metadata"]["uid"]
            ):
                self.store.remove(kind, ns, name)

    # --- the simulators ---

    def _simulate(self) -> None:
        while not self.stopping:
            self._wake.wait(TICK)
            self._wake.clear()
            if self.stopping:
                break
            try:
                with self.store.lock:
                    self.kueue.reconcile()
                    self.trainer.reconcile()
                    self.kubelet.reconcile()
                    self.extras.reconcile()
                    self._finish_foreground()
            except Exception:
                self.errors.append(traceback.format_exc())
                time.sleep(TICK)
