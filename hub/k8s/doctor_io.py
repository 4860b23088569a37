"""The doctor's thin I/O layer: what each check of :mod:`danlu.hub.k8s.doctor` reads from the live cluster.

:class:`Cluster` is the ``kubernetes`` client's configuration (the admin's kubeconfig, or the pod's
service account in a pod, as the jobs backend chooses) and its REST client, used for plain JSON paths
so every answer is the API's own dict. :func:`gather` reads, for check N, only what that check
needs; nothing here judges. Check 2 creates ``SubjectAccessReview`` objects (they are not stored)
and check 9 creates one short-lived pod (:func:`probe_pod`), always deleted.
"""

from __future__ import annotations

import json
import os
import time
from urllib.parse import quote

import yaml

from danlu.hub.k8s import doctor, doctor_checks, manifests, names
from danlu.hub.k8s.doctor import Expected, Failed

TIMEOUT = 10  # seconds per API call: the doctor never hangs on a silent API server
PROBE_SCRIPT = """import os, socket, sys
for target in sys.argv[1:]:
    name, _, address = target.partition("=")
    address = os.path.expandvars(address)
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=3).close()
        print("probe", name, address, "reached", flush=True)
    except (OSError, ValueError) as e:
        print("probe", name, address, "failed", repr(e), flush=True)
"""


class Cluster:
    """The API server as the admin reaches it; ``request`` is one REST call (JSON in, JSON or text out)."""

    def __init__(self, api_client):
        self.client = api_client
        self.server = api_client.configuration.host

    @classmethod
    def connect(cls, kubeconfig: str | None = None, context: str | None = None) -> Cluster:
        # deferred: the kubernetes client takes ~1 s to import; only danlu doctor needs it here
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException  # deferred: as above

        cfg = client.Configuration()
        try:
            if kubeconfig or context or not os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
            else:
                config.load_incluster_config(client_configuration=cfg)
        except (ConfigException, OSError, TypeError, ValueError) as e:
            raise Failed(
                f"no cluster configuration: {e}",
                "give --kubeconfig FILE (or set KUBECONFIG, or --context NAME); kubectl config current-context "
                "shows which cluster kubectl would use",
            ) from None
        cfg.retries = 1
        return cls(client.ApiClient(cfg))

    def request(self, method: str, path: str, body=None, headers=None) -> tuple[int, bytes]:
        # deferred: as in connect
        import urllib3
        from kubernetes.client.exceptions import ApiException

        cfg = self.client.configuration
        sent = {"Accept": "application/json", "Content-Type": "application/json", **(headers or {})}
        for auth in cfg.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                sent[auth["key"]] = auth["value"]
        try:
            answer = self.client.rest_client.request(
                method, cfg.host + path, headers=sent, body=body, _request_timeout=TIMEOUT
            )
        except ApiException as e:  # older clients raise on a non-2xx answer
            return e.status, (e.body or b"") if isinstance(e.body, bytes) else str(e.body or "").encode()
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise Failed(
                f"the API server at {cfg.host} is unreachable ({type(e).__name__}: {e})",
                "check the kubeconfig's server and that you reach it (VPN, firewall); kubectl get --raw /version",
            ) from None
        data = answer.read() if callable(getattr(answer, "read", None)) else answer.data
        return answer.status, data or b""

    def json(self, method: str, path: str, body=None, *, missing_ok: bool = True):
        """The JSON answer, None for a 404 with ``missing_ok``; any other failure is :class:`Failed`."""
        status, data = self.request(method, path, body)
        if status == 404 and missing_ok:
            return None
        if not 200 <= status < 300:
            raise Failed(f"{method} {path}: the API answered {status}: {_message(data)}", _fix_for(status))
        return json.loads(data or b"{}")

    def get(self, path: str):
        return self.json("GET", path)

    def items(self, path: str) -> list[dict]:
        return (self.get(path) or {}).get("items") or []


def _message(data: bytes) -> str:
    try:
        return str(json.loads(data).get("message", ""))[:300]
    except (ValueError, AttributeError):
        return data.decode(errors="replace")[:300]


def _fix_for(status: int) -> str:
    if status == 401:
        return "your credentials were refused: renew them (kubectl get --raw /version to try)"
    if status == 403:
        return "run the doctor as a cluster admin (it reads cluster-wide objects and creates SubjectAccessReviews)"
    return "see the API server's message; run again once it answers"


def ready_endpoints(cluster: Cluster, namespace: str, service: str) -> int:
    selector = quote(f"kubernetes.io/service-name={service}")
    return doctor_checks.endpoints_ready(
        cluster.items(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices?labelSelector={selector}")
    )


# --- the facts of each check ------------------------------------------------------------------


def api_facts(cluster: Cluster, exp: Expected) -> dict:
    status, data = cluster.request("GET", "/version")
    if status != 200:
        return {"error": f"GET {cluster.server}/version answered {status}: {_message(data)}", "fix": _fix_for(status)}
    version = json.loads(data).get("gitVersion", "?")
    return {
        "server": cluster.server,
        "version": version,
        "namespace": cluster.get(f"/api/v1/namespaces/{exp.namespace}"),
    }


def rbac_facts(cluster: Cluster, exp: Expected) -> dict:
    """One SubjectAccessReview per (verb, resource) of the rendered Role, as ``kubectl auth can-i --as``."""
    ns, sa = exp.namespace, exp.service_account
    answers = []
    for verb, group, resource in exp.rules:
        resource, _, sub = resource.partition("/")
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": f"system:serviceaccount:{ns}:{sa}",
                "groups": ["system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated"],
                "resourceAttributes": {
                    "namespace": ns,
                    "verb": verb,
                    "group": group,
                    "resource": resource,
                    **({"subresource": sub} if sub else {}),
                },
            },
        }
        answer = cluster.json("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review, missing_ok=False)
        full = f"{resource}/{sub}" if sub else resource
        answers.append(((verb, group, full), bool((answer.get("status") or {}).get("allowed"))))
    account = cluster.get(f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}")
    return {"answers": answers, "service_account": account is not None}


def kueue_facts(cluster: Cluster, exp: Expected) -> dict:
    crds = {}
    for plural in doctor_checks.KUEUE_CRDS:
        crd = cluster.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{plural}.kueue.x-k8s.io")
        if crd is not None:
            crds[plural] = [v["name"] for v in (crd.get("spec") or {}).get("versions") or [] if v.get("served")]
    config_map = cluster.get(
        f"/api/v1/namespaces/{doctor_checks.KUEUE_NAMESPACE}/configmaps/{doctor_checks.KUEUE_CONFIG_MAP}"
    )
    config = None
    if config_map is not None:
        try:
            config = yaml.safe_load((config_map.get("data") or {}).get(doctor_checks.KUEUE_CONFIG_KEY) or "") or {}
        except yaml.YAMLError as e:
            raise Failed(
                f"{doctor_checks.KUEUE_CONFIG_MAP}'s {doctor_checks.KUEUE_CONFIG_KEY} is not YAML ({e})",
                "kubectl apply -f kueue-config.yaml",
            ) from None
    namespace = cluster.get(f"/api/v1/namespaces/{exp.namespace}") or {}
    objects = {}
    if len(crds) == len(doctor_checks.KUEUE_CRDS):
        for obj in exp.kueue_objects:
            plural = obj["kind"].lower() + ("es" if obj["kind"].endswith("s") else "s")
            scope = f"namespaces/{exp.namespace}/" if obj["kind"] == "LocalQueue" else ""
            live = cluster.get(f"/apis/kueue.x-k8s.io/v1beta2/{scope}{plural}/{obj['metadata']['name']}")
            if live is not None:
                objects[(obj["kind"], obj["metadata"]["name"])] = live
    return {
        "crds": crds,
        "config": config,
        "namespace_labels": (namespace.get("metadata") or {}).get("labels") or {},
        "objects": objects,
    }


def visibility_facts(cluster: Cluster, exp: Expected) -> dict:
    service = cluster.get(f"/apis/apiregistration.k8s.io/v1/apiservices/{doctor_checks.VISIBILITY_APISERVICE}")
    queue = next((o["metadata"]["name"] for o in exp.kueue_objects if o["kind"] == "LocalQueue"), "default")
    status, data = cluster.request(
        "GET",
        f"/apis/visibility.kueue.x-k8s.io/v1beta1/namespaces/{exp.namespace}/localqueues/{queue}/pendingworkloads",
    )
    pending = True if status == 200 else f"{status} {_message(data)}"
    return {"apiservice": service, "pending": pending, "queue": queue}


def trainer_facts(cluster: Cluster, exp: Expected) -> dict:
    deployments = {
        name: cluster.items(f"/apis/apps/v1/deployments?fieldSelector={quote('metadata.name=' + name)}")
        for name in (doctor_checks.TRAINER_DEPLOYMENT, doctor_checks.JOBSET_DEPLOYMENT)
    }
    configurations = cluster.items("/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations")
    webhooks: dict[str, list] = {}
    for controller, (group, resource) in doctor_checks.WEBHOOKS.items():
        found = webhooks.setdefault(controller, [])
        for conf in configurations:
            for hook in conf.get("webhooks") or []:
                if not any(
                    group in r.get("apiGroups", []) and resource in r.get("resources", [])
                    for r in hook.get("rules") or []
                ):
                    continue
                svc = (hook.get("clientConfig") or {}).get("service")
                if svc:
                    ready = ready_endpoints(cluster, svc["namespace"], svc["name"])
                    found.append((hook["name"], f"{svc['namespace']}/{svc['name']}", ready > 0))
                else:
                    found.append((hook["name"], None, True))
    runtime = cluster.get(f"/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes/{exp.runtime}")
    return {"deployments": deployments, "webhooks": webhooks, "runtime": runtime is not None}


def storage_facts(cluster: Cluster, exp: Expected) -> dict:
    return {
        "classes": cluster.items("/apis/storage.k8s.io/v1/storageclasses"),
        "claims": cluster.items(f"/api/v1/namespaces/{exp.namespace}/persistentvolumeclaims"),
    }


def gpu_facts(cluster: Cluster, exp: Expected) -> dict:
    return {"nodes": cluster.items("/api/v1/nodes") if exp.flavors else []}


def mlflow_facts(cluster: Cluster, exp: Expected) -> dict:
    """The Service, its ready endpoints, and MLflow's health through the API server's service proxy with the
    Host header the hub and jobs send (the proxy passes it on), so MLflow's --allowed-hosts is exercised."""
    from urllib.parse import urlsplit  # deferred: only this check parses the URL

    ns = exp.namespace
    service = cluster.get(f"/api/v1/namespaces/{ns}/services/{names.MLFLOW_SERVICE}")
    ready = ready_endpoints(cluster, ns, names.MLFLOW_SERVICE) if service else 0
    health = (0, "")
    if ready:
        url = urlsplit(exp.mlflow_url)
        path = f"/api/v1/namespaces/{ns}/services/{names.MLFLOW_SERVICE}:{url.port or 80}/proxy{url.path}/health"
        status, data = cluster.request("GET", path, headers={"Host": url.netloc, "Accept": "*/*"})
        health = (status, data.decode(errors="replace").strip())
    return {"service": service is not None, "ready": ready, "health": health}


# --- the probe pod ----------------------------------------------------------------------------


def probe_pod(namespace: str, image: str, targets: list[doctor.ProbeTarget]) -> dict:
    """A pod with the job pods' labels (so their NetworkPolicies select it) that tries each target once
    and prints what it reached; restricted Pod Security, no service-account token, two minutes at most."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "danlu-doctor-probe-",
            "namespace": namespace,
            "labels": {**manifests.JOB_POD, doctor.PROBE_LABEL: "probe"},
        },
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "activeDeadlineSeconds": 120,
            "terminationGracePeriodSeconds": 0,
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "probe",
                    "image": image,
                    "command": ["python3", "-c", PROBE_SCRIPT, *(f"{t.name}={t.address}" for t in targets)],
                    "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
                    "securityContext": manifests.restricted_security_context(),
                }
            ],
        },
    }


def probe_facts(cluster: Cluster, exp: Expected, wait: float = 180.0) -> dict:
    if not exp.probe_image:
        return {
            "error": "no image for the probe pod (kubernetes.hub_image and the default profile's image "
            "are placeholders)",
            "fix": "set kubernetes.hub_image in danlu.yaml, or run with --no-probe",
        }
    ns = exp.namespace
    created = cluster.json("POST", f"/api/v1/namespaces/{ns}/pods", probe_pod(ns, exp.probe_image, exp.probe_targets))
    name = created["metadata"]["name"]
    try:
        deadline, pod = time.monotonic() + wait, created
        while time.monotonic() < deadline:
            pod = cluster.get(f"/api/v1/namespaces/{ns}/pods/{name}") or pod
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                break
            time.sleep(0.3)
        else:
            waiting = [
                (c.get("state") or {}).get("waiting", {}).get("reason", "")
                for c in (pod.get("status") or {}).get("containerStatuses") or []
            ]
            state = ", ".join([str((pod.get("status") or {}).get("phase")), *filter(None, waiting)])
            return {
                "error": f"the probe pod {ns}/{name} did not finish in {wait:g} s ({state})",
                "fix": f"kubectl -n {ns} get events: an image pull ({exp.probe_image}), a quota or admission "
                "policy; or run with --no-probe",
            }
        status, data = cluster.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}/log")
        log = data.decode(errors="replace") if status == 200 else ""
        return {"log": log, "targets": exp.probe_targets, "pod": f"{ns}/{name}"}
    finally:
        cluster.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}?gracePeriodSeconds=0")


GATHER = {
    1: api_facts,
    2: rbac_facts,
    3: kueue_facts,
    4: visibility_facts,
    5: trainer_facts,
    6: storage_facts,
    7: gpu_facts,
    8: mlflow_facts,
    9: probe_facts,
}


def diagnose(exp: Expected, *, kubeconfig=None, context=None, probe: bool = True) -> list[doctor.Result]:
    """Connect and run every check (:func:`danlu.hub.k8s.doctor.run`); a failed connection fails check 1."""
    try:
        cluster = Cluster.connect(kubeconfig, context)
    except Failed as e:
        error = {"error": e.problem, "fix": e.fix}
        return doctor.run(lambda n, _exp: error, exp)

    def gather(number: int, exp: Expected) -> dict:
        try:
            return GATHER[number](cluster, exp)
        except Failed as e:
            if number == 1:
                return {"error": e.problem, "fix": e.fix}
            raise

    try:
        return doctor.run(gather, exp, skip=() if probe else (9,))
    finally:
        cluster.client.close()
