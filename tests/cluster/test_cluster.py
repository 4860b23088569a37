"""The cluster tier: the same flow on a real cluster, when there is one (it skips itself otherwise).

Needs ``KUBECONFIG`` pointing at a cluster where ``danlu render k8s`` output is applied and the chart is
installed (docs/kubernetes.md), :data:`danlu.env.TEST_CLUSTER_URL` (the hub's public URL) and
:data:`danlu.env.TEST_CLUSTER_TOKEN` (an API token of a user in a team). It checks what the fake API server
cannot: the CRDs and Kueue's configuration as installed, a real TrainJob admitted by real Kueue and run by
real Trainer and kubelet, and the runner reaching the service from a pod.
"""

from __future__ import annotations

import os
import time

import pytest

from danlu import env
from danlu.client import DanluClient
from danlu.hub.k8s import names

pytestmark = pytest.mark.cluster
PATIENCE = 900.0  # image pulls and node scale-up on a real cluster; nothing here measures time
NOTEBOOK = {
    "cells": [
        {
            "cell_type": "code",
            "id": "c1",
            "metadata": {},
            "outputs": [],
            "execution_count": None,
            "source": "print('hello from a pod')",
        }
    ],
    "metadata": {},
    "nbformat": 4,
    "nbformat_minor": 5,
}


@pytest.fixture(scope="module")
def cluster():
    if not os.environ.get("KUBECONFIG") or not env.TEST_CLUSTER_URL.get() or not env.TEST_CLUSTER_TOKEN.get():
        pytest.skip(
            f"no cluster: set KUBECONFIG, {env.TEST_CLUSTER_URL} and {env.TEST_CLUSTER_TOKEN} "
            "(docs/kubernetes.md) to run the cluster tier"
        )
    kubernetes = pytest.importorskip("kubernetes")
    try:
        api = kubernetes.config.new_client_from_config(config_file=os.environ["KUBECONFIG"])
        kubernetes.client.VersionApi(api).get_code()
    except Exception as e:  # noqa: BLE001 - any reason the cluster is out of reach is a reason to skip
        pytest.skip(f"the cluster in KUBECONFIG does not answer: {e}")
    return api


def test_the_engines_danlu_needs_are_installed(cluster):
    import kubernetes

    extensions = kubernetes.client.ApiextensionsV1Api(cluster)
    crds = {c.metadata.name for c in extensions.list_custom_resource_definition().items}
    assert {
        "trainjobs.trainer.kubeflow.org",
        "clustertrainingruntimes.trainer.kubeflow.org",
        "workloads.kueue.x-k8s.io",
        "localqueues.kueue.x-k8s.io",
        "jobsets.jobset.x-k8s.io",
    } <= crds
    custom = kubernetes.client.CustomObjectsApi(cluster)
    runtime = custom.get_cluster_custom_object(
        "trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes", names.RUNTIME
    )
    assert runtime["metadata"]["labels"][names.MANAGED_BY] == names.MANAGER


def test_a_job_is_admitted_by_kueue_runs_in_a_pod_and_reports_back(cluster):
    client = DanluClient(url=env.TEST_CLUSTER_URL.get(), token=env.TEST_CLUSTER_TOKEN.get())
    job = client.submit({"notebook": NOTEBOOK, "name": "cluster-tier"})
    deadline = time.monotonic() + PATIENCE
    while job["state"] not in ("succeeded", "failed", "cancelled", "timed_out") and time.monotonic() < deadline:
        time.sleep(5)
        job = client.job(job["id"])
    assert job["state"] == "succeeded", job["reason"]
    assert job["mlflow_run_id"]
    assert "hello from a pod" in client.request("GET", f"/jobs/{job['id']}/logs").text
