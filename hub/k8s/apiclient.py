"""The jobs service's Kubernetes API client, and what stops one from being made, said plainly.

:func:`load` tries, in order: the kubeconfig the admin named (``KubernetesBackend.kubeconfig``),
the pod's service account (in a cluster, where the kubelet sets ``$KUBERNETES_SERVICE_HOST``),
then ``~/.kube/config``. kubernetes_asyncio says only ``Invalid kube-config file. No
configuration found.`` when none works; in the hub pod that meant the hub had not passed the
in-cluster address on to the jobs service (JupyterHub starts managed services with a stripped
environment; :mod:`danlu.hub.k8s.hubconfig` passes it on). A failure here is a
:class:`~danlu.errors.ConfigError` that names what was tried and the fix.
"""

from __future__ import annotations

import os

from danlu.errors import ConfigError

IN_CLUSTER_HOST = "KUBERNETES_SERVICE_HOST"


async def load(kubeconfig: str = "", environ=os.environ):
    """A ``kubernetes_asyncio`` ``ApiClient`` (see the module's docs)."""
    # deferred: kubernetes_asyncio takes ~1 s to import; only a service with a cluster needs it
    from kubernetes_asyncio import client, config

    in_cluster = not kubeconfig and bool(environ.get(IN_CLUSTER_HOST))
    cfg = client.Configuration()
    try:
        if in_cluster:
            config.load_incluster_config(client_configuration=cfg, environ=environ)
        else:
            await config.load_kube_config(config_file=kubeconfig or None, client_configuration=cfg)
    except (config.ConfigException, OSError) as e:
        raise _unusable(kubeconfig, in_cluster, e) from None
    return client.ApiClient(cfg)


def _unusable(kubeconfig: str, in_cluster: bool, e: Exception) -> ConfigError:
    if in_cluster:
        return ConfigError(
            f"the jobs service cannot use its pod's service account to reach the Kubernetes API: {e}",
            fix="let the hub pod mount its service account's token (the chart's default; "
            "hub.serviceAccount) and see docs/kubernetes.md, RBAC",
        )
    if kubeconfig:
        return ConfigError(
            f"the jobs service cannot load the kubeconfig {kubeconfig}: {e}",
            fix="set KubernetesBackend.kubeconfig to a readable kubeconfig file",
        )
    return ConfigError(
        f"the jobs service has no way to the Kubernetes API: ${IN_CLUSTER_HOST} is not in its environment "
        f"(it does not run in a pod, or the hub did not pass the variable on) and ~/.kube/config: {e}",
        fix="in the hub pod, configure JupyterHub with danlu.hub.k8s.hubconfig.configure(c), which passes "
        "KUBERNETES_SERVICE_HOST/PORT and PGPASSWORD on to the jobs service; outside a cluster, set "
        "KubernetesBackend.kubeconfig",
    )
