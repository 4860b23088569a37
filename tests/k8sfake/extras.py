"""What ``danlu doctor k8s`` reads besides jobs: cluster plumbing kinds, RBAC answers, the service proxy.

Registers the built-in kinds the doctor reads (ConfigMaps, Services, EndpointSlices, ServiceAccounts,
claims, Nodes, Deployments, StorageClasses, ValidatingWebhookConfigurations, APIServices, CRDs, Roles
and bindings) in the store's tables; tests seed them with their ``status`` as the controllers would
write it. :class:`Extras` adds what the real API server does about them:

* ``kubernetes.io/metadata.name`` on every Namespace (the API server's own label);
* the ``Active`` condition of ClusterQueues (False: ``Stopped`` by ``stopPolicy``, ``FlavorNotFound``)
  and LocalQueues (False when their ClusterQueue is missing or inactive), as Kueue sets them;
* ``POST .../subjectaccessreviews`` answered from the stored Roles, ClusterRoles and their bindings
  (:func:`allowed`: verbs, groups, resources and subresources, ``*``, users, groups and service
  accounts; no resourceNames, no aggregation, no non-resource URLs);
* ``GET /version`` (Kubernetes 1.36);
* the service proxy ``/api/v1/namespaces/NS/services/NAME[:PORT]/proxy/PATH``: 404 without the Service,
  503 without a ready EndpointSlice endpoint, else forwarded to the URL the test maps the Service to in
  ``cluster.services`` with the client's ``Host`` header kept, as the API server's proxy does.
"""

from __future__ import annotations

import http.client
from urllib.parse import urlsplit

from .rbac import decide as allowed
from .store import KINDS, RESOURCES, ApiError, now

#: (group, version, plural) -> (kind, namespaced): added to the store's tables, unless already there
EXTRA_RESOURCES = {
    ("", "v1", "configmaps"): ("ConfigMap", True),
    ("", "v1", "services"): ("Service", True),
    ("", "v1", "serviceaccounts"): ("ServiceAccount", True),
    ("", "v1", "persistentvolumeclaims"): ("PersistentVolumeClaim", True),
    ("", "v1", "nodes"): ("Node", False),
    ("apps", "v1", "deployments"): ("Deployment", True),
    ("discovery.k8s.io", "v1", "endpointslices"): ("EndpointSlice", True),
    ("storage.k8s.io", "v1", "storageclasses"): ("StorageClass", False),
    ("admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations"): (
        "ValidatingWebhookConfiguration",
        False,
    ),
    ("apiregistration.k8s.io", "v1", "apiservices"): ("APIService", False),
    ("apiextensions.k8s.io", "v1", "customresourcedefinitions"): ("CustomResourceDefinition", False),
    ("rbac.authorization.k8s.io", "v1", "roles"): ("Role", True),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"): ("RoleBinding", True),
    ("rbac.authorization.k8s.io", "v1", "clusterroles"): ("ClusterRole", False),
    ("rbac.authorization.k8s.io", "v1", "clusterrolebindings"): ("ClusterRoleBinding", False),
}
for _key, (_kind, _namespaced) in EXTRA_RESOURCES.items():
    if RESOURCES.setdefault(_key, (_kind, _namespaced)) == (_kind, _namespaced):
        KINDS.setdefault(_kind, (*_key, _namespaced))

SAR_PATH = ("apis", "authorization.k8s.io", "v1", "subjectaccessreviews")


class Extras:
    """The API server's behaviour for the doctor's kinds (see the module's docs), on a FakeCluster."""

    def __init__(self, cluster):
        self.cluster = cluster

    # --- the simulator's side ---

    def reconcile(self) -> None:
        store = self.cluster.store
        for ns in store.list("Namespace"):
            name = ns["metadata"]["name"]
            if (ns["metadata"].get("labels") or {}).get("kubernetes.io/metadata.name") != name:
                store.mutate(
                    "Namespace",
                    None,
                    name,
                    lambda o, n=name: o["metadata"].setdefault("labels", {}).update({"kubernetes.io/metadata.name": n}),
                )
        flavors = {f["metadata"]["name"] for f in store.list("ResourceFlavor")}
        active = {}
        for cq in store.list("ClusterQueue"):
            spec = cq.get("spec") or {}
            missing = [
                f["name"]
                for g in spec.get("resourceGroups") or []
                for f in g.get("flavors") or []
                if f["name"] not in flavors
            ]
            if spec.get("stopPolicy", "None") != "None":
                state = (False, "Stopped", "Can't admit new workloads: is stopped")
            elif missing:
                state = (
                    False,
                    "FlavorNotFound",
                    f"Can't admit new workloads: references missing ResourceFlavor(s): {missing}",
                )
            else:
                state = (True, "Ready", "Can admit new workloads")
            active[cq["metadata"]["name"]] = state[0]
            self._set_active("ClusterQueue", None, cq, state)
        for lq in store.list("LocalQueue"):
            cq = (lq.get("spec") or {}).get("clusterQueue")
            if cq not in active:
                state = (False, "ClusterQueueDoesNotExist", "Can't submit new workloads to clusterQueue")
            elif not active[cq]:
                state = (False, "ClusterQueueIsInactive", "Can't submit new workloads to clusterQueue")
            else:
                state = (True, "Ready", "Can submit new workloads to localQueue")
            self._set_active("LocalQueue", lq["metadata"]["namespace"], lq, state)

    def _set_active(self, kind, namespace, obj, state) -> None:
        status, reason, message = state
        old = next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == "Active"), {})
        if old.get("status") == ("True" if status else "False") and old.get("reason") == reason:
            return

        def update(o):
            conditions = [c for c in o.setdefault("status", {}).get("conditions") or [] if c.get("type") != "Active"]
            conditions.append(
                {
                    "type": "Active",
                    "status": "True" if status else "False",
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": now(),
                }
            )
            o["status"]["conditions"] = conditions

        self.cluster.store.mutate(kind, namespace, obj["metadata"]["name"], update)

    # --- the API server's side ---

    def route(self, handler, method: str, parts: list[str], body) -> bool:
        """Serve the request if it is one of the extra endpoints; True when it was."""
        if parts == ["version"] and method == "GET":
            handler._send(200, {"major": "1", "minor": "36", "gitVersion": "v1.36.0-k8sfake"})
            return True
        if tuple(parts) == SAR_PATH and method == "POST":
            spec = (body or {}).get("spec") or {}
            ok, reason = allowed(
                self.cluster.store, spec.get("user", ""), spec.get("groups") or [], spec.get("resourceAttributes") or {}
            )
            answer = {**(body or {}), "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview"}
            answer["status"] = {"allowed": ok, **({"reason": reason} if reason else {})}
            handler._send(201, answer)
            return True
        if (
            len(parts) >= 7
            and parts[:3] == ["api", "v1", "namespaces"]
            and parts[4] == "services"
            and parts[6] == "proxy"
        ):
            self._proxy(handler, method, parts[3], parts[5], "/" + "/".join(parts[7:]))
            return True
        return False

    def _proxy(self, handler, method: str, namespace: str, service: str, path: str) -> None:
        name = service.split(":")[-2] if service.count(":") == 2 else service.split(":")[0]
        store = self.cluster.store
        if store.find("Service", namespace, name) is None:
            raise ApiError(404, "NotFound", f'services "{name}" not found')
        slices = store.list("EndpointSlice", namespace, f"kubernetes.io/service-name={name}")
        ready = [
            e for s in slices for e in s.get("endpoints") or [] if (e.get("conditions") or {}).get("ready") is not False
        ]
        target = self.cluster.services.get((namespace, name))
        if not ready or target is None:
            raise ApiError(503, "ServiceUnavailable", f'no endpoints available for service "{name}"')
        url = urlsplit(target)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
        try:
            headers = {"Host": handler.headers.get("Host", ""), "Accept": handler.headers.get("Accept", "*/*")}
            conn.request(method, url.path.rstrip("/") + path, headers=headers)
            answer = conn.getresponse()
            data = answer.read()
            handler.send_response(answer.status)
            handler.send_header("Content-Type", answer.getheader("Content-Type", "text/plain"))
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
        finally:
            conn.close()
