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
| `kueue-config.yaml` | what Danlu needs in Kueue's shared Configuration: merged into it (step 2), never applied |
| `trainer.yaml` | the ClusterTrainingRuntime `{settings.kubernetes.runtime}` every job runs on |
| `mlflow.yaml` | the `{names.CONFIG_MAP}` ConfigMap, PostgreSQL, MLflow, their NetworkPolicies |
| `rbac.yaml` | the jobs service's Role (TrainJobs, workloads, pods, token Secrets), bound to `hub` |
| `values.yaml` | Zero to JupyterHub chart {CHART_VERSION} values |

Images still on a placeholder (an all-zero digest: replace with the digest you pushed/pulled):

{todo}
## Apply, in this order

```sh
# 1. the controllers (once per cluster; skip what it already runs). Trainer's manager overlay brings
#    JobSet with it: never install JobSet on its own as well. Wait for each webhook to serve.
kubectl apply --server-side -f https://github.com/kubernetes-sigs/kueue/releases/download/{KUEUE_VERSION}/manifests.yaml
kubectl -n kueue-system wait --for=condition=Available --timeout=300s deployment/kueue-controller-manager
kubectl apply --server-side -k "https://github.com/kubeflow/trainer.git/manifests/overlays/manager?ref={TRAINER_VERSION}"
kubectl -n kubeflow-system wait --for=condition=Available --timeout=300s \\
  deployment/jobset-controller-manager deployment/kubeflow-trainer-controller-manager

# 2. Kueue's configuration is shared by every team: merge Danlu's needs into it, do not replace it
kubectl -n kueue-system get configmap kueue-manager-config \\
  -o jsonpath='{{.data.controller_manager_config\\.yaml}}' > kueue-current.yaml
python -m danlu.hub.k8s.kueueconfig kueue-current.yaml kueue-config.yaml --namespace {ns} --patch \\
  > kueue-patch.json
kubectl -n kueue-system patch configmap kueue-manager-config --type merge --patch-file kueue-patch.json
kubectl -n kueue-system rollout restart deployment/kueue-controller-manager
kubectl -n kueue-system rollout status --timeout=300s deployment/kueue-controller-manager

# 3. the namespace and the Secret (never in these files)
kubectl apply -f namespace.yaml
kubectl -n {ns} create secret generic {names.SECRET} \\
  --from-literal={names.SECRET_POSTGRES_PASSWORD}="$(openssl rand -hex 32)" \\
  --from-literal={names.SECRET_MLFLOW_AUTH}="$(openssl rand -hex 32)" \\
  --from-literal={names.SECRET_AUDIT_KEY}="$(openssl rand -hex 32)"

# 4. Danlu's objects (Kueue's and Trainer's webhooks validate them: step 1 waited for those)
kubectl apply -f kueue.yaml -f trainer.yaml -f mlflow.yaml -f rbac.yaml

# 5. the hub
helm repo add jupyterhub https://hub.jupyter.org/helm-chart/ && helm repo update
helm upgrade --install danlu jupyterhub/jupyterhub --version {CHART_VERSION} -n {ns} -f values.yaml
```

`danlu.hub.k8s.kueueconfig` keeps every integration, namespace rule and setting the cluster has and adds
`trainer.kubeflow.org/trainjob`, `pod` and `waitForPodsReady` (kept as it is where the cluster has one: it
applies to every team); it refuses, naming the fix, a `managedJobsNamespaceSelector` that leaves out `{ns}`.
Homes need a ReadWriteMany StorageClass (`kubernetes.home_storage_class`): job pods mount their owner's
home on other nodes than the notebook's.
"""
