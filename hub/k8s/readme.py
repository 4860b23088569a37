"""The README.md that ``danlu render k8s`` writes beside the manifests: what to apply, in which order."""

from __future__ import annotations

from danlu.hub.k8s import names
from danlu.hub.k8s.values import CHART_VERSION

KUEUE_VERSION = "v0.19.2"
JOBSET_VERSION = "v0.12.0"
TRAINER_VERSION = "v2.3.0"


def text(settings, source: str, placeholders: list[str]) -> str:
    ns = settings.kubernetes.namespace
    todo = "".join(f"- {p}\n" for p in placeholders) or "- none: every image is pinned.\n"
    return f"""# Danlu on Kubernetes: rendered from {source}

Rendered by `danlu render k8s --config {source} --out DIR`; edit danlu.yaml and render again rather
than editing these files. docs/kubernetes.md explains the architecture, sizing and the image steps.

| file | what |
|---|---|
| `namespace.yaml` | the `{ns}` namespace, its Pod Security labels, the NetworkPolicy fencing job pods |
| `kueue.yaml` | ResourceFlavors, ClusterQueues, LocalQueues, WorkloadPriorityClasses |
| `kueue-config.yaml` | Kueue's manager Configuration (TrainJob and pod integrations, pods managed only in `{ns}`) |
| `trainer.yaml` | the ClusterTrainingRuntime `{settings.kubernetes.runtime}` every job runs on |
| `mlflow.yaml` | the `{names.CONFIG_MAP}` ConfigMap, PostgreSQL, MLflow, their NetworkPolicies |
| `rbac.yaml` | the jobs service's Role (TrainJobs, workloads, pods, token Secrets), bound to `hub` |
| `values.yaml` | Zero to JupyterHub chart {CHART_VERSION} values |

Images still on a placeholder (an all-zero digest: replace with the digest you pushed/pulled):

{todo}
## Apply, in this order

```sh
# 1. the controllers (once per cluster)
kubectl apply --server-side -f https://github.com/kubernetes-sigs/kueue/releases/download/{KUEUE_VERSION}/manifests.yaml
kubectl apply --server-side -f https://github.com/kubernetes-sigs/jobset/releases/download/{JOBSET_VERSION}/manifests.yaml
kubectl apply --server-side -k "https://github.com/kubeflow/trainer.git/manifests/overlays/manager?ref={TRAINER_VERSION}"
kubectl apply -f kueue-config.yaml
kubectl -n kueue-system rollout restart deployment/kueue-controller-manager

# 2. the namespace and the Secret (never in these files)
kubectl apply -f namespace.yaml
kubectl -n {ns} create secret generic {names.SECRET} \\
  --from-literal={names.SECRET_POSTGRES_PASSWORD}="$(openssl rand -hex 32)" \\
  --from-literal={names.SECRET_MLFLOW_AUTH}="$(openssl rand -hex 32)"

# 3. Danlu's objects
kubectl apply -f kueue.yaml -f trainer.yaml -f mlflow.yaml -f rbac.yaml

# 4. the hub
helm repo add jupyterhub https://hub.jupyter.org/helm-chart/ && helm repo update
helm upgrade --install danlu jupyterhub/jupyterhub --version {CHART_VERSION} -n {ns} -f values.yaml
```

The Kueue manager Configuration must list `integrations.frameworks: [trainer.kubeflow.org/trainjob, pod]`;
`kueue-config.yaml` replaces the release's `kueue-manager-config` with upstream's defaults plus those.
Homes need a ReadWriteMany StorageClass (`kubernetes.home_storage_class`): job pods mount their owner's
home on other nodes than the notebook's.
"""
