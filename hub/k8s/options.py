"""The ``kubernetes:`` section of danlu.yaml: how Danlu runs on a cluster (``danlu render k8s``, the jobs
service's Kubernetes backend), with its ``mlflow:`` sub-section. See docs/kubernetes.md.
"""

from __future__ import annotations

from traitlets import Bool, Integer, Unicode

from danlu.hub.options import DIGEST, DNS_LABEL, Section
from danlu.hub.traits import List, Size, Text


class KubernetesMlflowConfig(Section):
    """MLflow and its PostgreSQL on the cluster (danlu render k8s)."""

    image = Text(
        None,
        allow_none=True,
        pattern=DIGEST,
        help="The MLflow server image, pinned by digest (default the hub image, which has MLflow and danlu).",
    ).tag(config=True)
    postgres_image = Text(
        None,
        allow_none=True,
        pattern=DIGEST,
        help="The PostgreSQL image for MLflow's and Danlu's databases, pinned by digest (default a "
        "placeholder that no registry serves).",
    ).tag(config=True)
    storage_class = Unicode(
        None,
        allow_none=True,
        help="The StorageClass of the database and artifact volumes (default the cluster's default).",
    ).tag(config=True)
    database_size = Size("10Gi", help="The size of the database volume.").tag(config=True)
    artifacts_size = Size("50Gi", help="The size of the artifacts volume (none with artifacts_destination).").tag(
        config=True
    )
    artifacts_destination = Text(
        None,
        allow_none=True,
        pattern=r"^(s3|gs|wasbs)://",
        help="An object store for artifacts instead of a volume (s3://bucket/prefix, gs://...).",
    ).tag(config=True)


class KubernetesConfig(Section):
    """How Danlu runs on a Kubernetes cluster (danlu render k8s; jobs.backend kubernetes). See docs/kubernetes.md."""

    sections = {"mlflow": KubernetesMlflowConfig}
    mlflow: KubernetesMlflowConfig

    namespace = Text(
        "danlu", pattern=DNS_LABEL, help="The one namespace of the hub, user pods, jobs and LocalQueues."
    ).tag(config=True)
    hub_image = Text(
        None,
        allow_none=True,
        pattern=DIGEST,
        help="The hub image (the chart's hub image plus danlu), pinned by digest (default a placeholder "
        "that no registry serves).",
    ).tag(config=True)
    runtime = Text(
        "danlu-torch", pattern=DNS_LABEL, help="The ClusterTrainingRuntime jobs run on (rendered by danlu render k8s)."
    ).tag(config=True)
    home_storage_class = Unicode(
        None,
        allow_none=True,
        help="The StorageClass of user homes (default the cluster's default). Jobs mount "
        "their owner's home, so it must be ReadWriteMany (NFS, CephFS, a cloud file "
        "store) for a job to run on another node than its notebook.",
    ).tag(config=True)
    home_size = Size("10Gi", help="The size of each user's home volume.").tag(config=True)
    shm_size = Size("8Gi", help="The size of the memory-backed /dev/shm of notebook and job pods.").tag(config=True)
    trial = Bool(
        False,
        help="A throwaway trial: the hub lets anyone log in as anyone, admins included (JupyterHub's "
        "DummyAuthenticator). Without it, danlu render k8s requires an auth section with an identity "
        "provider (oidc, github, gitlab).",
    ).tag(config=True)
    gpu_notebook_start_timeout_seconds = Integer(
        3600,
        min=0,
        help="How long a notebook with GPUs may take to start, waiting in its team's Kueue queue "
        "included, before JupyterHub gives up (other notebooks: the chart's singleuser.startTimeout, 300).",
    ).tag(config=True)
    image_pull_secrets = List(
        Text(pattern=DNS_LABEL),
        help="Secrets (in the Danlu namespace) that job pods pull their images with: the training runtime's "
        "imagePullSecrets. Needed when the profile images are in a private registry.",
    ).tag(config=True)
    pods_ready_timeout = Integer(
        600,
        min=0,
        help="Seconds an admitted job's pods may take to start (image pulls included) before Kueue evicts it and "
        "Danlu ends the attempt with the reason (waitForPodsReady in kueue-config.yaml; 0: no limit).",
    ).tag(config=True)
