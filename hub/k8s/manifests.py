"""The Kubernetes objects Danlu adds beside the Zero to JupyterHub chart, built by pure functions.

One function per object (``make_*(...) -> dict``), tested by comparing whole dicts
(``tests/test_k8s_render.py``) and validated against the official schemas, the way
``kubespawner/objects.py`` builds pods. Nothing here reads files or talks to a cluster;
:mod:`danlu.hub.k8s.render` decides the values and writes the files.

What is here: the ``danlu-torch`` ClusterTrainingRuntime every job runs on (Kubeflow Trainer
v2.3.0, modelled on upstream's ``torch-distributed`` runtime), the MLflow tracking server and
its PostgreSQL, their NetworkPolicies and the ConfigMap that carries danlu.yaml and profiles.yaml.
What Danlu needs of Kueue's own configuration is :mod:`danlu.hub.k8s.kueueconfig`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from danlu import env
from danlu.hub.k8s import names

TRAINER_API = "trainer.kubeflow.org/v1alpha1"
#: jovyan, the user of the Jupyter Docker Stacks images (and of the chart's singleuser default)
USER_ID, GROUP_ID = 1000, 100
#: the chart's own pod labels (Zero to JupyterHub 4.4.0)
HUB_POD = {"app": "jupyterhub", "component": "hub"}
PROXY_POD = {"app": "jupyterhub", "component": "proxy"}
NOTEBOOK_POD = {"app": "jupyterhub", "component": "singleuser-server"}
JOB_POD = {names.MANAGED_BY: names.MANAGER, names.COMPONENT: names.JOB}
MLFLOW_POD = {names.MANAGED_BY: names.MANAGER, names.COMPONENT: names.MLFLOW}
POSTGRES_POD = {names.MANAGED_BY: names.MANAGER, names.COMPONENT: names.DATABASE}
POSTGRES_USER = "danlu"
#: databases in Danlu's PostgreSQL: the jobs service's, MLflow's tracking store and its auth store
DATABASES = ("danlu", "mlflow", "mlflow_auth")
ARTIFACTS_DIR = "/mlartifacts"


def labels(component: str | None = None) -> dict:
    out = {names.MANAGED_BY: names.MANAGER}
    if component:
        out[names.COMPONENT] = component
    return out


def metadata(name: str, namespace: str | None = None, component: str | None = None) -> dict:
    meta: dict = {"name": name, "labels": labels(component)}
    if namespace is not None:
        meta["namespace"] = namespace
    return meta


def private_env(allow_outbound: bool) -> list[dict]:
    """A container's ``env`` entries that keep its libraries from phoning home (none when allowed)."""
    return [{"name": k, "value": v} for k, v in sorted(env.private_environment(allow_outbound, {}).items())]


def secret_env(name: str, key: str) -> dict:
    """An environment variable read from the Secret the admin creates (never a value in the output)."""
    return {"name": str(name), "valueFrom": {"secretKeyRef": {"name": names.SECRET, "key": key}}}


def restricted_security_context(user: int = USER_ID) -> dict:
    """A container that passes the ``restricted`` Pod Security Standard."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "runAsUser": user,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


# --- the training runtime -----------------------------------------------------------------


def make_training_runtime(
    image: str, shm_size: str, name: str = names.RUNTIME, image_pull_secrets: Sequence[str] = ()
) -> dict:
    """The ClusterTrainingRuntime every Danlu job runs on: one replicated job ``node`` whose
    container ``node`` runs ``python -m danlu.runner --kubernetes``.

    Each TrainJob sets image, env, resources, numNodes, numProcPerNode and a runtime patch
    adding its owner's home, nodeSelector and tolerations; this is only the shape they share, and
    the one place of the pod's hardening: Pod Security ``restricted`` and no service-account token.
    ``backoffLimit: 0``: Danlu retries a failed attempt itself, as a new TrainJob. Trainer v2.3.0's
    torch policy has no ``numProcPerNode`` (upstream's later ``torch-distributed`` sets ``auto``
    there); a TrainJob gives it in ``spec.trainer.numProcPerNode``, whose default is ``auto``.
    ``image_pull_secrets`` (``kubernetes.image_pull_secrets``) are the pods' ``imagePullSecrets``: without
    them a private image is never pulled and the job's pods wait until Kueue's waitForPodsReady evicts it.
    """
    pod_spec = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,  # user code gets no API credentials (policies.py fences the rest)
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": USER_ID,
            "runAsGroup": GROUP_ID,
            "fsGroup": GROUP_ID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": names.TRAINER_CONTAINER,
                "image": image,
                "command": ["python", "-m", "danlu.runner", "--kubernetes"],
                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}, {"name": "job", "mountPath": names.JOB_DIR}],
            }
        ],
        "volumes": [
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
            {"name": "job", "emptyDir": {}},
        ],
    }
    if image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": str(secret)} for secret in image_pull_secrets]
    replicated_job = {
        "name": "node",
        "template": {
            "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
            "spec": {"backoffLimit": 0, "template": {"metadata": {"labels": dict(JOB_POD)}, "spec": pod_spec}},
        },
    }
    return {
        "apiVersion": TRAINER_API,
        "kind": "ClusterTrainingRuntime",
        "metadata": metadata(name, component=names.JOB),
        "spec": {"mlPolicy": {"numNodes": 1, "torch": {}}, "template": {"spec": {"replicatedJobs": [replicated_job]}}},
    }


# --- configuration ------------------------------------------------------------------------


def make_config_map(namespace: str, danlu_yaml: str, profiles_yaml: str) -> dict:
    """danlu.yaml and profiles.yaml for the hub and MLflow, mounted at ``/etc/danlu``."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(names.CONFIG_MAP, namespace, names.HUB),
        "data": {"danlu.yaml": danlu_yaml, "profiles.yaml": profiles_yaml},
    }


def make_namespace(namespace: str) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": metadata(namespace)}


# --- MLflow and PostgreSQL ----------------------------------------------------------------


def make_mlflow_deployment(
    namespace: str, image: str, *, artifacts_claim: str | None, allow_outbound: bool = False
) -> dict:
    """The MLflow tracking server: ``python -m danlu.hub.k8s.mlflowserver`` starts ``mlflow server``
    with the arguments and the basic-auth configuration ``danlu up`` uses on one machine, and, unless
    ``privacy.allow_outbound``, its telemetry off (:func:`danlu.env.private_environment`)."""
    mounts = [{"name": "config", "mountPath": names.CONFIG_DIR, "readOnly": True}, {"name": "tmp", "mountPath": "/tmp"}]
    volumes = [{"name": "config", "configMap": {"name": names.CONFIG_MAP}}, {"name": "tmp", "emptyDir": {}}]
    if artifacts_claim:
        mounts.append({"name": "artifacts", "mountPath": ARTIFACTS_DIR})
        volumes.append({"name": "artifacts", "persistentVolumeClaim": {"claimName": artifacts_claim}})
    # the Host header MLflow's --allowed-hosts accepts (the kubelet would send the pod's IP)
    health = {
        "httpGet": {
            "path": "/services/mlflow/health",
            "port": "http",
            "httpHeaders": [{"name": "Host", "value": f"localhost:{names.MLFLOW_PORT}"}],
        }
    }
    container = {
        "name": "mlflow",
        "image": image,
        "command": ["python", "-m", "danlu.hub.k8s.mlflowserver"],
        "env": [
            {"name": str(env.CONFIG), "value": f"{names.CONFIG_DIR}/danlu.yaml"},
            secret_env(env.MLFLOW_AUTH_SECRET, names.SECRET_MLFLOW_AUTH),
            secret_env("PGPASSWORD", names.SECRET_POSTGRES_PASSWORD),
            *private_env(allow_outbound),
        ],
        "ports": [{"name": "http", "containerPort": names.MLFLOW_PORT}],
        "readinessProbe": {**health, "periodSeconds": 10},
        "livenessProbe": {**health, "initialDelaySeconds": 60, "periodSeconds": 30},
        "resources": {"requests": {"cpu": "250m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "securityContext": restricted_security_context(),
        "volumeMounts": mounts,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(names.MLFLOW_SERVICE, namespace, names.MLFLOW),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},  # a ReadWriteOnce artifact volume has one user at a time
            "selector": {"matchLabels": dict(MLFLOW_POD)},
            "template": {
                "metadata": {"labels": dict(MLFLOW_POD)},
                "spec": {"securityContext": {"fsGroup": GROUP_ID}, "containers": [container], "volumes": volumes},
            },
        },
    }


def make_service(
    name: str, namespace: str, component: str, selector: Mapping[str, str], port: int, *, headless: bool = False
) -> dict:
    spec: dict = {"selector": dict(selector), "ports": [{"name": "tcp", "port": port, "targetPort": port}]}
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(name, namespace, component), "spec": spec}


def make_pvc(name: str, namespace: str, component: str, size: str, storage_class: str | None = None) -> dict:
    spec: dict = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}
    if storage_class:
        spec["storageClassName"] = storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(name, namespace, component),
        "spec": spec,
    }


def make_postgres_init(namespace: str) -> dict:
    """The databases besides the first (``POSTGRES_DB``), created on the volume's first start."""
    sql = "".join(f"CREATE DATABASE {db} OWNER {POSTGRES_USER};\n" for db in DATABASES[1:])
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(f"{names.POSTGRES_SERVICE}-init", namespace, names.DATABASE),
        "data": {"10-danlu.sql": sql},
    }


def make_postgres(namespace: str, image: str, size: str, storage_class: str | None = None) -> dict:
    """One PostgreSQL for the jobs service and MLflow (StatefulSet; its volume from a claim template)."""
    claim: dict = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}
    if storage_class:
        claim["storageClassName"] = storage_class
    ready = {"exec": {"command": ["pg_isready", "-U", POSTGRES_USER, "-d", DATABASES[0]]}}
    container = {
        "name": "postgres",
        "image": image,
        "env": [
            {"name": "POSTGRES_USER", "value": POSTGRES_USER},
            {"name": "POSTGRES_DB", "value": DATABASES[0]},
            secret_env("POSTGRES_PASSWORD", names.SECRET_POSTGRES_PASSWORD),
            {"name": "PGDATA", "value": "/var/lib/postgresql/data/pgdata"},
        ],
        "ports": [{"name": "postgres", "containerPort": names.POSTGRES_PORT}],
        "readinessProbe": {**ready, "periodSeconds": 10},
        "livenessProbe": {**ready, "initialDelaySeconds": 30, "periodSeconds": 30},
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "securityContext": restricted_security_context(999),  # the image's postgres user
        "volumeMounts": [
            {"name": "data", "mountPath": "/var/lib/postgresql/data"},
            {"name": "init", "mountPath": "/docker-entrypoint-initdb.d", "readOnly": True},
            {"name": "run", "mountPath": "/var/run/postgresql"},
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(names.POSTGRES_SERVICE, namespace, names.DATABASE),
        "spec": {
            "serviceName": names.POSTGRES_SERVICE,
            "replicas": 1,
            "selector": {"matchLabels": dict(POSTGRES_POD)},
            "template": {
                "metadata": {"labels": dict(POSTGRES_POD)},
                "spec": {
                    "securityContext": {"fsGroup": 999},
                    "containers": [container],
                    "volumes": [
                        {"name": "init", "configMap": {"name": f"{names.POSTGRES_SERVICE}-init"}},
                        {"name": "run", "emptyDir": {}},
                    ],
                },
            },
            "volumeClaimTemplates": [{"metadata": {"name": "data", "labels": labels(names.DATABASE)}, "spec": claim}],
        },
    }


def make_ingress_policy(
    name: str, namespace: str, component: str, pod: Mapping[str, str], port: int, sources: list[Mapping[str, str]]
) -> dict:
    """A NetworkPolicy: pods ``pod`` accept connections on ``port`` only from pods matching ``sources``."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(name, namespace, component),
        "spec": {
            "podSelector": {"matchLabels": dict(pod)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": dict(s)}} for s in sources],
                    "ports": [{"protocol": "TCP", "port": port}],
                }
            ],
        },
    }


def make_mlflow_policies(namespace: str) -> list[dict]:
    """MLflow is reached only from the hub (its gateway) and job pods; PostgreSQL only from MLflow and
    the hub (the jobs service)."""
    return [
        make_ingress_policy(
            names.MLFLOW_SERVICE, namespace, names.MLFLOW, MLFLOW_POD, names.MLFLOW_PORT, [HUB_POD, JOB_POD]
        ),
        make_ingress_policy(
            names.POSTGRES_SERVICE, namespace, names.DATABASE, POSTGRES_POD, names.POSTGRES_PORT, [MLFLOW_POD, HUB_POD]
        ),
    ]


#: what the jobs service (in the hub pod, as the chart's ``hub`` service account) does with jobs
JOBS_RULES = [
    {
        "apiGroups": ["trainer.kubeflow.org"],
        "resources": ["trainjobs"],
        "verbs": ["create", "get", "list", "watch", "delete"],
    },
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["visibility.kueue.x-k8s.io"], "resources": ["localqueues/pendingworkloads"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "delete"]},
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "get", "update", "delete"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["create"]},  # policies.py
]


def make_jobs_rbac(namespace: str, service_account: str = "hub") -> list[dict]:
    """A Role for what the jobs service does with TrainJobs, Kueue workloads, pods and token Secrets in the
    Danlu namespace, bound to the hub's service account (the chart's own Role covers notebook pods only)."""
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata("danlu-jobs", namespace, names.HUB),
        "rules": JOBS_RULES,
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata("danlu-jobs", namespace, names.HUB),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "danlu-jobs"},
        "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}],
    }
    return [role, binding]
