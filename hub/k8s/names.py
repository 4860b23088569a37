"""Kubernetes labels, annotations and object names Danlu writes, named once.

The renderer, the spawner and the job backend all import these; docs/kubernetes.md lists them.
"""

from __future__ import annotations

import hashlib
import re

# Kueue v0.19 (pkg/controller/constants): labels, not annotations
QUEUE_NAME = "kueue.x-k8s.io/queue-name"
PRIORITY_CLASS = "kueue.x-k8s.io/priority-class"

# the recommended labels
MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "danlu"
COMPONENT = "app.kubernetes.io/component"
PART_OF = "app.kubernetes.io/part-of"

# Danlu's own
JOB_ID = "danlu.io/job-id"
ATTEMPT = "danlu.io/attempt"
OWNER = "danlu.io/owner"  # the JupyterHub user, escaped to a label value (see owner_label)
TEAM = "danlu.io/team"
OWNER_ANNOTATION = "danlu.io/owner"  # the user name unescaped

# components (COMPONENT values)
JOB = "job"
NOTEBOOK = "notebook"
HUB = "hub"
MLFLOW = "mlflow"
DATABASE = "database"

#: the ClusterTrainingRuntime every job runs on (danlu render k8s writes it), and its trainer container
RUNTIME = "danlu-torch"
TRAINER_CONTAINER = "node"
#: where a job pod's scratch folder (its job folder) and the owner's home are mounted
JOB_DIR = "/danlu/job"
HOME = "/home/jovyan"
CHECKPOINTS = ".danlu/checkpoints"  # under the owner's home: a job's checkpoints, in a folder named by its id


def checkpoint_dir(job_id: str) -> str:
    """Where a job's pods keep ``$DANLU_CHECKPOINT_DIR``: in the owner's home claim, keyed by the job (not the
    attempt, pod or node), so that a checkpoint outlives the eviction it was saved for."""
    return f"{HOME}/{CHECKPOINTS}/{job_id}"


_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def owner_label(username: str) -> str:
    """A JupyterHub user name as a label value (63 characters of [A-Za-z0-9-_.]); a digest keeps it unique."""
    if len(username) <= 63 and _LABEL_VALUE.match(username):
        return username
    clean = re.sub(r"[^A-Za-z0-9_.-]", "-", username).strip("-_.")[:50].strip("-_.")
    return f"{clean}-{hashlib.sha256(username.encode()).hexdigest()[:8]}".lstrip("-")


#: KubeSpawner 7's pvc_name_template (the chart leaves singleuser.storage.dynamic.pvcNameTemplate null)
HOME_CLAIM_TEMPLATE = "claim-{user_server}"


class _DefaultServer:
    """What KubeSpawner's name expansion reads of a spawner, for a user's default (unnamed) server
    under its default ``safe`` slug scheme."""

    name = ""
    slug_scheme = "safe"

    def __init__(self, username: str, namespace: str):
        self.user = type("User", (), {"name": username, "id": None})()
        self.namespace = namespace

    def _namespace_default(self) -> str:
        return self.namespace


def home_claim(username: str, template: str = HOME_CLAIM_TEMPLATE, namespace: str = "danlu") -> str:
    """The PersistentVolumeClaim KubeSpawner names for ``username``'s home: ``template`` expanded
    by KubeSpawner's own code, so a job mounts the claim the notebook did, for every user name
    (``alice.smith`` -> ``claim-alice-smith---63425827``). Its safe slugs carry a digest of the
    name wherever they change it, so no crafted name expands to another user's claim."""
    from kubespawner.spawner import KubeSpawner  # deferred: imports kubernetes_asyncio (seconds)

    return KubeSpawner._expand_user_properties(_DefaultServer(username, namespace), template)


def trainjob_name(job_id: str, attempt: int) -> str:
    """A TrainJob's name: a DNS label that starts with a letter (Danlu job ids may start with a digit)."""
    return f"danlu-{job_id}-{attempt}"


# objects danlu render k8s writes (docs/kubernetes.md, "What danlu render k8s writes")
CONFIG_MAP = "danlu-config"  # danlu.yaml and profiles.yaml, mounted at CONFIG_DIR in the hub and MLflow
CONFIG_DIR = "/etc/danlu"
SECRET = "danlu-secrets"  # created by the admin: SECRET_POSTGRES_PASSWORD, SECRET_MLFLOW_AUTH, SECRET_AUDIT_KEY
SECRET_POSTGRES_PASSWORD = "postgres-password"
SECRET_MLFLOW_AUTH = "mlflow-auth-secret"
SECRET_AUDIT_KEY = "audit-key"  # the audit chain's HMAC key (danlu.hub.service.store.audit)
MLFLOW_SERVICE = "danlu-mlflow"
MLFLOW_PORT = 5000
POSTGRES_SERVICE = "danlu-postgres"
POSTGRES_PORT = 5432
#: the hub-managed services' ports in the hub pod (the chart's hub Service gets them as extraPorts)
JOBS_SERVICE_PORT = 10101
GATEWAY_SERVICE_PORT = 10102
