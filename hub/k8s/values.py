"""Values for the Zero to JupyterHub chart 4.4.0, from danlu.yaml: the hub, user pods, the culler.

:func:`make_values` is pure; it returns only the keys Danlu sets (Helm merges them over the
chart's defaults), each valid under the chart's ``values.schema.json``. The hub runs
``danlu.hub.k8s.hubconfig.configure(c)`` (``hub.extraConfig.danlu``), which reads
``/etc/danlu/danlu.yaml`` and ``profiles.yaml`` from the ``danlu-config`` ConfigMap and sets the
spawner, the profile list and the hub-managed jobs service and MLflow gateway. The values give
those two services their URLs, ports and roles, and open the network paths they need.
"""

from __future__ import annotations

from danlu import env
from danlu.hub.k8s import manifests, mlflowserver, names
from danlu.hub.scopes import WRITE

CHART_VERSION = "4.4.0"
EXTRA_CONFIG = "from danlu.hub.k8s.hubconfig import configure\nconfigure(c)\n"
HOME = names.HOME
METADATA_IP = "169.254.169.254"  # the cloud metadata server (the chart's singleuser.cloudMetadata.ip)


def split_image(reference: str) -> dict:
    """``registry:5000/a/b:tag@sha256:...`` -> the chart's ``{name, tag}``.

    The chart writes ``name:tag``, so a digest rides in the tag (``tag@sha256:...``; the runtime
    pulls by the digest and ignores the tag). An untagged reference gets ``latest``, the tag it
    implies.
    """
    name, _, digest = reference.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = ""
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    tag = tag or "latest"
    return {"name": name, "tag": f"{tag}@{digest}" if digest else tag}


def _from(*pods: dict) -> list[dict]:
    return [{"podSelector": {"matchLabels": dict(p)}} for p in pods]


def _ports(*ports: int) -> list[dict]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def hub_network_policy() -> dict:
    """The chart's hub policy plus: the jobs service and gateway ports open to the proxy, notebooks
    and (the jobs service only) job pods; egress to MLflow and PostgreSQL."""
    return {
        "enabled": True,
        "ingress": [
            {
                "from": _from(manifests.PROXY_POD, manifests.NOTEBOOK_POD),
                "ports": _ports(names.JOBS_SERVICE_PORT, names.GATEWAY_SERVICE_PORT),
            },
            {"from": _from(manifests.JOB_POD), "ports": _ports(names.JOBS_SERVICE_PORT)},
        ],
        "egress": [
            {"to": _from(manifests.MLFLOW_POD), "ports": _ports(names.MLFLOW_PORT)},
            {"to": _from(manifests.POSTGRES_POD), "ports": _ports(names.POSTGRES_PORT)},
        ],
    }


def proxy_network_policy() -> dict:
    """The chart's proxy policy lets the proxy reach the hub pod on 8081 only, besides its
    ``privateIPs`` ``ipBlock`` rule, which the chart's schema warns does not work where Cilium
    enforces policies (GKE Dataplane V2 too; cilium/cilium#9209). The proxy's routes to the jobs
    service and the gateway (``hub.service.extraPorts`` 10101, 10102) get their own rule."""
    return {
        "egress": [
            {"to": _from(manifests.HUB_POD), "ports": _ports(names.JOBS_SERVICE_PORT, names.GATEWAY_SERVICE_PORT)},
        ]
    }


def singleuser_network_policy() -> dict:
    """Notebooks reach the internet and, inside the cluster, only the hub's services and the proxy."""
    return {
        "enabled": True,
        "egressAllowRules": {"cloudMetadataServer": False, "privateIPs": False, "nonPrivateIPs": True},
        "egress": [
            {"to": _from(manifests.HUB_POD), "ports": _ports(names.JOBS_SERVICE_PORT, names.GATEWAY_SERVICE_PORT)},
            {"to": _from(manifests.PROXY_POD), "ports": _ports(8000)},
        ],
    }


def hub_services(namespace: str) -> dict:
    """The jobs service and the MLflow gateway, run by the hub in its pod (configure(c) adds their
    commands): the chart's hub Service gets their ports, so the proxy reaches them at ``hub:PORT``."""
    return {
        "danlu": {
            "name": "danlu",
            "url": f"http://hub:{names.JOBS_SERVICE_PORT}",
            "display": True,
            "oauth_no_confirm": True,
        },
        "mlflow": {
            "name": "mlflow",
            "url": f"http://hub:{names.GATEWAY_SERVICE_PORT}",
            "display": True,
            "oauth_no_confirm": True,
        },
    }


def hub_roles() -> dict:
    """Every user may use both services; the jobs service reads users and groups (as danlu up grants)."""
    return {
        "user": {
            "description": "Every user: their own server, jobs and MLflow.",
            "scopes": ["self", "access:services!service=danlu", "access:services!service=mlflow", f"{WRITE}!user"],
        },
        "danlu-service": {
            "description": "The jobs service reads users' groups.",
            "scopes": ["read:users", "read:groups", "list:users", "read:servers"],
            "services": ["danlu"],
        },
    }


def make_values(
    *,
    namespace: str,
    hub_image: str,
    notebook_image: str,
    home_size: str,
    home_storage_class: str | None,
    idle_timeout: int,
    allow_outbound: bool = False,
) -> dict:
    """The chart values (keys sorted on output). Quantities are strings. Unless ``allow_outbound``
    (``privacy``), the hub pod's environment switches telemetry off (its services and the notebook
    pods get the same from ``hubconfig.configure``)."""
    mlflow_url = mlflowserver.url(namespace)
    dynamic: dict = {"storageAccessModes": ["ReadWriteMany"]}  # job pods mount their owner's home elsewhere
    if home_storage_class:
        dynamic["storageClass"] = home_storage_class
    cull: dict = {"enabled": bool(idle_timeout)}
    if idle_timeout:
        cull.update({"timeout": int(idle_timeout), "every": min(600, max(60, int(idle_timeout) // 6)), "users": False})
    return {
        "hub": {
            "image": split_image(hub_image),
            "extraConfig": {"danlu": EXTRA_CONFIG},
            "extraVolumes": [{"name": "danlu-config", "configMap": {"name": names.CONFIG_MAP}}],
            "extraVolumeMounts": [{"name": "danlu-config", "mountPath": names.CONFIG_DIR, "readOnly": True}],
            "extraEnv": {
                str(env.CONFIG): f"{names.CONFIG_DIR}/danlu.yaml",
                str(env.MLFLOW_URL): mlflow_url,
                str(env.MLFLOW_AUTH_SECRET): {
                    "valueFrom": {"secretKeyRef": {"name": names.SECRET, "key": names.SECRET_MLFLOW_AUTH}}
                },
                "PGPASSWORD": {
                    "valueFrom": {"secretKeyRef": {"name": names.SECRET, "key": names.SECRET_POSTGRES_PASSWORD}}
                },
                # the audit chain's key, outside the database (and off the hub's volume, which holds it)
                str(env.AUDIT_KEY): {
                    "valueFrom": {"secretKeyRef": {"name": names.SECRET, "key": names.SECRET_AUDIT_KEY}}
                },
                **env.private_environment(allow_outbound, {}),
            },
            "services": hub_services(namespace),
            "loadRoles": hub_roles(),
            "service": {
                "extraPorts": [
                    {"name": "danlu", "port": names.JOBS_SERVICE_PORT, "targetPort": names.JOBS_SERVICE_PORT},
                    {
                        "name": "mlflow-gateway",
                        "port": names.GATEWAY_SERVICE_PORT,
                        "targetPort": names.GATEWAY_SERVICE_PORT,
                    },
                ]
            },
            "networkPolicy": hub_network_policy(),
            "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        },
        "proxy": {"https": {"enabled": False}, "chp": {"networkPolicy": proxy_network_policy()}},
        "singleuser": {
            # the chart's privileged iptables init container would keep the namespace's Pod Security at
            # privileged; networkPolicy's egressAllowRules.cloudMetadataServer: false blocks the address
            "cloudMetadata": {"blockWithIptables": False, "ip": METADATA_IP},
            "image": split_image(notebook_image),
            "uid": manifests.USER_ID,
            "fsGid": manifests.GROUP_ID,
            "defaultUrl": "/lab",
            "extraLabels": manifests.labels(names.NOTEBOOK),
            "storage": {
                "type": "dynamic",
                "capacity": home_size,
                "homeMountPath": HOME,
                "dynamic": dynamic,
            },
            "networkPolicy": singleuser_network_policy(),
        },
        "scheduling": {
            "userScheduler": {"enabled": True},
            "podPriority": {"enabled": True},
            "userPods": {"nodeAffinity": {"matchNodePurpose": "prefer"}},
        },
        "cull": cull,
    }


COMMENTS = {
    "hub": (
        "hub.image: the chart's hub image plus danlu (kernel-images/hub/Dockerfile), pinned by digest;\n"
        "the chart writes name:tag, so the digest rides in the tag."
    ),
    "proxy": (
        "proxy.https is left off: terminate TLS at your ingress or load balancer, or set\n"
        "proxy.https (letsencrypt, manual or secret) as the chart's documentation describes.\n"
        "proxy.chp.networkPolicy.egress: the proxy's routes to the hub's extra ports (jobs service, gateway)."
    ),
    "scheduling": (
        "The chart's user scheduler packs notebook pods onto few nodes, which leaves whole GPU\n"
        "nodes free for jobs and lets an autoscaler remove idle ones."
    ),
    "cull": "The chart's idle culler stops servers idle for hub.idle_timeout_seconds of danlu.yaml.",
}
