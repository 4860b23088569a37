"""The namespace's Pod Security level and the job fence, with the chart's own pods and policies.

Every pod the chart renders, the notebook pods the hub builds after the chart's own configuration (every
user, profile and GPU option of :mod:`.test_hub_pod`), Danlu's own pods and a job's pods pass the level the
namespace enforces (:data:`danlu.hub.k8s.policies.POD_SECURITY`), and ``restricted``, only warned about,
is failed by one of them (so the enforced level is the strictest they allow). The chart's NetworkPolicies
joined to Danlu's keep job pods to the runner API and MLflow, and notebooks from the metadata address
(the chart's policy does that job once its privileged iptables init container is off).
"""

from __future__ import annotations

from danlu.hub.k8s import names, policies, render
from tests.podsecurity import pod_specs, violations
from tests.test_k8s_fencing import (
    HUB,
    METADATA_IP,
    MLFLOW,
    NOTEBOOK,
    PROXY,
    allowed,
    danlu_policies,
    example,
    job_pod,
    job_pods,
)

from .test_hub_pod import spawns  # noqa: F401 - the fixture: every user, profile and GPU option spawned


def test_the_namespace_enforces_the_strictest_level_every_pod_in_it_passes(deployment, spawns):  # noqa: F811
    pods = list(pod_specs(deployment.objects))
    for s in spawns:
        assert s.pod is not None, s.error
        assert NOTEBOOK["labels"].items() <= s.pod["metadata"]["labels"].items()  # the policy tests' notebook
        pods.append((f"notebook {s.user} {s.options}", s.pod["spec"], s.pod["metadata"].get("annotations")))
    settings, profiles = example()
    pods += pod_specs([o for objs in render.objects(settings, profiles).values() for o in objs])
    pods += [(f"job pod {i}", p["spec"], None) for i, p in enumerate(job_pods(nnodes=2))]
    enforced = policies.POD_SECURITY["enforce"]
    assert {name: violations(spec, enforced, ann) for name, spec, ann in pods} == {n: [] for n, _, _ in pods}
    stricter = {"baseline": "restricted", "restricted": None}[enforced]
    if stricter:
        assert any(violations(spec, stricter, ann) for _, spec, ann in pods), f"every pod passes {stricter}"
    assert policies.POD_SECURITY["warn"] == policies.POD_SECURITY["audit"] == "restricted"


def test_with_the_charts_policies_the_runner_api_and_mlflow_let_job_pods_in(deployment):
    """The other end: the hub's (chart-rendered) ingress admits job pods on the runner API only."""
    netpols = [o for o in deployment.objects if o["kind"] == "NetworkPolicy"] + danlu_policies()
    for p in netpols:
        p["metadata"].setdefault("namespace", deployment.namespace)
    a = job_pod("danlu-j1-1", deployment.namespace)
    assert allowed(netpols, a, HUB, names.JOBS_SERVICE_PORT)
    assert allowed(netpols, a, MLFLOW, names.MLFLOW_PORT)
    assert not allowed(netpols, a, HUB, 8081)
    assert not allowed(netpols, a, PROXY, 8000)
    assert not allowed(netpols, a, {"ip": METADATA_IP}, 80)
    assert not allowed(netpols, NOTEBOOK, a, 29400)  # the chart's notebook egress meets the job fence
    # notebooks: the chart's policy, not its privileged iptables init container, keeps the metadata address out
    assert not allowed(netpols, NOTEBOOK, {"ip": METADATA_IP}, 80)
    assert allowed(netpols, NOTEBOOK, {"ip": "8.8.8.8"}, 443)
