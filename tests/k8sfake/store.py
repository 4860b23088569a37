"""The fake API server's object store: kinds, resource versions, selectors, patches and the watch log.

One :class:`Store` holds every object as the JSON the API server would return, keyed by
``(kind, namespace, name)`` (namespace ``None`` for cluster-scoped kinds). Every write takes the next
global ``metadata.resourceVersion`` and appends an event (``ADDED``/``MODIFIED``/``DELETED``) to a bounded
log that watches read from; a :class:`threading.Condition` wakes them. Errors are :class:`ApiError`,
which the HTTP layer turns into a ``kind: Status`` body. Nothing here knows HTTP or the simulators.
"""

from __future__ import annotations

import copy
import re
import threading
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

#: (group, version, plural) -> (kind, namespaced)
RESOURCES = {
    ("", "v1", "pods"): ("Pod", True),
    ("", "v1", "secrets"): ("Secret", True),
    ("", "v1", "events"): ("Event", True),
    ("", "v1", "namespaces"): ("Namespace", False),
    ("batch", "v1", "jobs"): ("Job", True),
    ("networking.k8s.io", "v1", "networkpolicies"): ("NetworkPolicy", True),
    ("jobset.x-k8s.io", "v1alpha2", "jobsets"): ("JobSet", True),
    ("rbac.authorization.k8s.io", "v1", "roles"): ("Role", True),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"): ("RoleBinding", True),
    ("rbac.authorization.k8s.io", "v1", "clusterroles"): ("ClusterRole", False),
    ("rbac.authorization.k8s.io", "v1", "clusterrolebindings"): ("ClusterRoleBinding", False),
    ("kueue.x-k8s.io", "v1beta2", "workloads"): ("Workload", True),
    ("kueue.x-k8s.io", "v1beta2", "localqueues"): ("LocalQueue", True),
    ("kueue.x-k8s.io", "v1beta2", "clusterqueues"): ("ClusterQueue", False),
    ("kueue.x-k8s.io", "v1beta2", "resourceflavors"): ("ResourceFlavor", False),
    ("kueue.x-k8s.io", "v1beta2", "workloadpriorityclasses"): ("WorkloadPriorityClass", False),
    ("trainer.kubeflow.org", "v1alpha1", "trainjobs"): ("TrainJob", True),
    ("trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes"): ("ClusterTrainingRuntime", False),
}
KINDS = {
    kind: (group, version, plural, namespaced) for (group, version, plural), (kind, namespaced) in RESOURCES.items()
}
HISTORY = 2000  # events a watch can resume from; older resourceVersions get 410 Gone


def api_version(kind: str) -> str:
    group, version = KINDS[kind][:2]
    return f"{group}/{version}" if group else version


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    """An API error, rendered as a ``kind: Status`` object with this code and reason."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict:
        out = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            out["details"] = self.details
        return out


def not_found(kind: str, name: str) -> ApiError:
    plural = KINDS[kind][2] if kind in KINDS else kind.lower()
    group = KINDS[kind][0] if kind in KINDS else ""
    resource = f"{plural}.{group}" if group else plural
    return ApiError(404, "NotFound", f'{resource} "{name}" not found', {"name": name, "group": group, "kind": plural})


# --- label selectors ----------------------------------------------------------------------------

_SET = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def label_matcher(selector: str | None):
    """``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a)``, ``k``, ``!k``, comma-joined (AND)."""
    tests = []
    for term in _split_selector(selector or ""):
        if match := _SET.match(term):
            key, op, values = match.group(1), match.group(2), {v.strip() for v in match.group(3).split(",")}
            if op == "in":
                tests.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                tests.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            tests.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            tests.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif term.startswith("!"):
            tests.append(lambda labels, k=term[1:].strip(): k not in labels)
        elif re.match(r"^[A-Za-z0-9./_-]+$", term):
            tests.append(lambda labels, k=term: k in labels)
        else:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {term!r}")
    return lambda obj: all(t(obj.get("metadata", {}).get("labels") or {}) for t in tests)


def field_matcher(selector: str | None):
    """``metadata.name=x``, ``metadata.namespace=x`` (and ``!=``), comma-joined."""
    tests = []
    for term in _split_selector(selector or ""):
        negate = "!=" in term
        key, value = (s.strip() for s in term.replace("!=", "=").replace("==", "=").split("=", 1))
        field = key.split(".")
        if field[0] != "metadata" or len(field) != 2:
            raise ApiError(400, "BadRequest", f"field label not supported: {key}")
        tests.append(lambda o, f=field[1], v=value, n=negate: (o["metadata"].get(f) == v) != n)
    return lambda obj: all(t(obj) for t in tests)


# --- patches ------------------------------------------------------------------------------------


def merge_patch(target, patch):
    """RFC 7386: maps merge, lists are replaced."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


#: the patchMergeKey of the lists a strategic merge patch merges (k8s.io/api core/v1 and meta/v1 types);
#: any other list is replaced, as in a merge patch
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "env": "name",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "tolerations": None,  # atomic in the API: replaced
    "conditions": "type",
    "ownerReferences": "uid",
}


def strategic_merge_patch(target, patch):
    """A strategic merge patch: maps merge as in RFC 7386; lists named in :data:`MERGE_KEYS` merge item by
    item on their key (``$patch: delete`` in an item removes it, ``$patch: replace`` replaces the list);
    ``$retainKeys`` and ``$deleteFromPrimitiveList`` directives are not modelled."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        merge_key = MERGE_KEYS.get(key)
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list) and merge_key and isinstance(out.get(key), list):
            out[key] = _merge_list(out[key], value, merge_key)
        else:
            out[key] = strategic_merge_patch(out.get(key), value)
    return out


def _merge_list(current: list, patch: list, key: str) -> list:
    if any(isinstance(i, dict) and i.get("$patch") == "replace" for i in patch):
        return [copy.deepcopy(i) for i in patch if not (isinstance(i, dict) and "$patch" in i)]
    out = [copy.deepcopy(i) for i in current]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise ApiError(422, "Invalid", f"the patch's list item {item!r} has no merge key {key!r}")
        at = next((n for n, i in enumerate(out) if isinstance(i, dict) and i.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if at is not None:
                del out[at]
        elif at is None:
            out.append({k: v for k, v in copy.deepcopy(item).items() if not k.startswith("$")})
        else:
            out[at] = strategic_merge_patch(out[at], item)
    return out


def _pointer(path: str) -> list:
    if path == "":
        return []
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def json_patch(doc, ops: list):
    """RFC 6902: add, remove, replace, move, copy, test."""
    doc = copy.deepcopy(doc)

    def walk(parts):
        node = doc
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        return node, parts[-1]

    def get(path):
        node = doc
        for part in _pointer(path):
            node = node[int(part)] if isinstance(node, list) else node[part]
        return node

    def put(path, value, replace=False):
        parent, key = walk(_pointer(path))
        if isinstance(parent, list):
            if key == "-":
                parent.append(value)
            elif replace:
                parent[int(key)] = value
            else:
                parent.insert(int(key), value)
        else:
            if replace and key not in parent:
                raise KeyError(key)
            parent[key] = value

    def remove(path):
        parent, key = walk(_pointer(path))
        return parent.pop(int(key) if isinstance(parent, list) else key)

    for op in ops:
        try:
            kind, path = op["op"], op["path"]
            if kind == "add":
                put(path, copy.deepcopy(op["value"]))
            elif kind == "remove":
                remove(path)
            elif kind == "replace":
                put(path, copy.deepcopy(op["value"]), replace=True)
            elif kind == "move":
                put(path, remove(op["from"]))
            elif kind == "copy":
                put(path, copy.deepcopy(get(op["from"])))
            elif kind == "test":
                if get(path) != op["value"]:
                    raise ApiError(422, "Invalid", f"the test operation at {path} failed")
            else:
                raise ApiError(400, "BadRequest", f"unknown JSON patch operation {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ApiError(422, "Invalid", f"the JSON patch {op} does not apply: {e!r}") from None
    return doc


# --- the store ----------------------------------------------------------------------------------


@dataclass
class Event:
    rv: int
    type: str
    kind: str
    obj: dict


class Store:
    def __init__(self):
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.objects: dict[tuple, dict] = {}
        self.events: list[Event] = []
        self.rv = 0
        self.created: dict[str, int] = {}  # uid -> creation order (creationTimestamp has 1 s resolution)
        self.listeners: list = []  # callables run after every write (the simulators' wake-up)

    def _key(self, kind, namespace, name):
        return (kind, namespace if KINDS[kind][3] else None, name)

    def _record(self, type_: str, obj: dict) -> None:
        self.events.append(Event(self.rv, type_, obj["kind"], copy.deepcopy(obj)))
        del self.events[:-HISTORY]
        self.changed.notify_all()
        for listener in self.listeners:
            listener()

    def _bump(self, obj: dict) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    def get(self, kind, namespace, name) -> dict:
        with self.lock:
            obj = self.objects.get(self._key(kind, namespace, name))
            if obj is None:
                raise not_found(kind, name)
            return copy.deepcopy(obj)

    def find(self, kind, namespace, name) -> dict | None:
        with self.lock:
            obj = self.objects.get(self._key(kind, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, kind, namespace=None, label_selector=None, field_selector=None) -> list[dict]:
        labels, fields = label_matcher(label_selector), field_matcher(field_selector)
        with self.lock:
            found = [
                o
                for (k, ns, _), o in self.objects.items()
                if k == kind and (namespace is None or ns == namespace) and labels(o) and fields(o)
            ]
            return copy.deepcopy(sorted(found, key=lambda o: int(o["metadata"]["resourceVersion"])))

    def create(self, obj: dict) -> dict:
        obj = copy.deepcopy(obj)
        kind, meta = obj["kind"], obj.setdefault("metadata", {})
        obj["apiVersion"] = obj.get("apiVersion") or api_version(kind)
        with self.lock:
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            key = self._key(kind, meta.get("namespace"), meta.get("name"))
            if KINDS[kind][3] and kind != "Event" and ("Namespace", None, meta.get("namespace")) not in self.objects:
                raise ApiError(
                    404,
                    "NotFound",
                    f'namespaces "{meta.get("namespace")}" not found',
                    {"name": meta.get("namespace"), "kind": "namespaces"},
                )
            if key in self.objects:
                plural, group = KINDS[kind][2], KINDS[kind][0]
                resource = f"{plural}.{group}" if group else plural
                raise ApiError(
                    409,
                    "AlreadyExists",
                    f'{resource} "{meta["name"]}" already exists',
                    {"name": meta["name"], "group": group, "kind": plural},
                )
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
            self.created[meta["uid"]] = self.rv + 1
            meta.pop("deletionTimestamp", None)
            if kind == "Pod":
                obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
            if kind == "Secret" and "stringData" in obj:
                import base64

                obj.setdefault("data", {}).update(
                    {k: base64.b64encode(v.encode()).decode() for k, v in obj.pop("stringData").items()}
                )
            self._bump(obj)
            self.objects[key] = obj
            self._record("ADDED", obj)
            return copy.deepcopy(obj)

    def replace(self, obj: dict, *, status: bool = False, check_rv: bool = True) -> dict:
        """Write ``obj`` over the stored one: its spec and metadata (``status`` kept), or with
        ``status=True`` its status only (the ``/status`` subresource). A stale resourceVersion is a 409."""
        meta = obj.get("metadata", {})
        with self.lock:
            key = self._key(obj["kind"], meta.get("namespace"), meta.get("name"))
            old = self.objects.get(key)
            if old is None:
                raise not_found(obj["kind"], meta.get("name"))
            stale = meta.get("resourceVersion") not in (None, "", old["metadata"]["resourceVersion"])
            if check_rv and stale:
                raise ApiError(
                    409,
                    "Conflict",
                    f"Operation cannot be fulfilled on {KINDS[obj['kind']][2]} "
                    f'"{meta["name"]}": the object has been modified; please apply your changes to '
                    "the latest version and try again",
                )
            new = copy.deepcopy(old)
            if status:
                if "status" in obj:
                    new["status"] = copy.deepcopy(obj["status"])
                else:
                    new.pop("status", None)
            else:
                keep = {
                    k: old["metadata"][k]
                    for k in (
                        "uid",
                        "creationTimestamp",
                        "generation",
                        "deletionTimestamp",
                        "deletionGracePeriodSeconds",
                    )
                    if k in old["metadata"]
                }
                new = {k: copy.deepcopy(v) for k, v in obj.items() if k != "status"}
                if "status" in old:
                    new["status"] = old["status"]
                new["metadata"].update(keep)
                if any(new.get(k) != old.get(k) for k in new if k not in ("metadata", "status")):
                    new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
            if new == old:
                return copy.deepcopy(old)
            self._bump(new)
            self.objects[key] = new
            self._record("MODIFIED", new)
            return copy.deepcopy(new)

    def mutate(self, kind, namespace, name, fn) -> dict | None:
        """Apply ``fn`` to a copy of the stored object (spec, metadata and status alike) and write it if it
        changed: how the simulators update what they own. Returns the new object, None if it is gone."""
        with self.lock:
            key = self._key(kind, namespace, name)
            old = self.objects.get(key)
            if old is None:
                return None
            new = copy.deepcopy(old)
            fn(new)
            if new == old:
                return copy.deepcopy(old)
            if new.get("spec") != old.get("spec"):
                new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
            self._bump(new)
            self.objects[key] = new
            self._record("MODIFIED", new)
            return copy.deepcopy(new)

    def remove(self, kind, namespace, name) -> dict | None:
        """Drop the object now (a ``DELETED`` event). Returns it, or None if it was gone."""
        with self.lock:
            obj = self.objects.pop(self._key(kind, namespace, name), None)
            if obj is not None:
                self._bump(obj)
                self._record("DELETED", obj)
            return obj

    def dependents(self, uid: str) -> list[dict]:
        with self.lock:
            return [
                copy.deepcopy(o)
                for o in self.objects.values()
                if any(ref.get("uid") == uid for ref in o["metadata"].get("ownerReferences") or [])
            ]

    def events_since(self, rv: int) -> list[Event]:
        with self.lock:
            if self.events and rv < self.events[0].rv - 1:
                raise ApiError(410, "Expired", f"too old resource version: {rv} ({self.events[0].rv - 1})")
            return [e for e in self.events if e.rv > rv]
