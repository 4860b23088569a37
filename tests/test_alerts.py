"""The alerting rules (danlu.hub.alerts): each rule fires on synthetic series that should fire it, and stays
quiet on the series beside them that should not, run by ``promtool test rules`` (Debian's ``prometheus``,
which .ci/run installs). The shipped rule files are the renderer's output, and the service exports the
series the one-machine rules read.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from danlu.hub import alerts
from danlu.hub.service.admission.model import Model
from danlu.hub.service.admission.workloads import Team
from danlu.hub.service.metrics import Metrics

from .conftest import cannot_run

DOCS = Path(__file__).resolve().parent.parent / "docs"
ONE = DOCS / "prometheus-alerts.yaml"
K8S = DOCS / "prometheus-alerts-kubernetes.yaml"


def test_the_shipped_rule_files_are_the_renderers_output():
    assert ONE.read_text() == alerts.text(), "render again: python -c 'from danlu.hub import alerts; ...'"
    assert K8S.read_text() == alerts.text(kubernetes=True)


def annotations(path: Path, name: str, labels: dict, value: str = "") -> dict:
    """A rule's annotations with its labels (and value) filled in as Prometheus's templates would."""
    rule = next(r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"] if r["alert"] == name)
    out = {}
    for key, text in rule["annotations"].items():
        text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)
        out[key] = re.sub(r"\{\{ \$value[^}]*\}\}", value, text)
    return out


def alert(path: Path, name: str, at: str, labels: dict, severity: str, value: str = "") -> dict:
    return {
        "eval_time": at,
        "alertname": name,
        "exp_alerts": [
            {"exp_labels": {**labels, "severity": severity}, "exp_annotations": annotations(path, name, labels, value)}
        ],
    }


def quiet(name: str, at: str) -> dict:
    return {"eval_time": at, "alertname": name, "exp_alerts": []}


ONE_MACHINE = {
    "interval": "1m",
    "input_series": [
        # device 0: a server holds it, idle for 40 minutes; device 1: a job holds it, busy after 20 minutes;
        # device 2: idle and free
        {"series": 'danlu_gpu_utilization_ratio{device="0", flavor="a100"}', "values": "0.01x45"},
        {"series": 'danlu_gpu_held{device="0", flavor="a100", kind="server"}', "values": "1x45"},
        {"series": 'danlu_gpu_held{device="0", flavor="a100", kind="job"}', "values": "0x45"},
        {"series": 'danlu_gpu_utilization_ratio{device="1", flavor="a100"}', "values": "0.01x20 0.9x25"},
        {"series": 'danlu_gpu_held{device="1", flavor="a100", kind="job"}', "values": "1x45"},
        {"series": 'danlu_gpu_utilization_ratio{device="2", flavor="a100"}', "values": "0x45"},
        {"series": 'danlu_gpu_held{device="2", flavor="a100", kind="job"}', "values": "0x45"},
        # device 3 stops answering NVML after 40 minutes
        {"series": 'danlu_gpu_up{device="3", flavor="a100"}', "values": "1x40 0x5"},
        # queue research: its oldest job has waited since minute 0 (65 minutes at 65m); vision: 2 minutes
        {"series": 'danlu_queue_oldest_wait_seconds{queue="research"}', "values": "0+60x70"},
        {"series": 'danlu_queue_oldest_wait_seconds{queue="vision"}', "values": "120x70"},
        # research borrows 2 GPUs beyond its quota of 2 (limit 4) for 70 minutes; vision is over its limit of 1
        {"series": 'danlu_gpus_allocated{team="research", flavor="a100"}', "values": "4x70"},
        {"series": 'danlu_gpu_quota{team="research", flavor="a100"}', "values": "2x70"},
        {"series": 'danlu_gpu_borrowing_limit{team="research", flavor="a100"}', "values": "4x70"},
        {"series": 'danlu_gpus_allocated{team="vision", flavor="a100"}', "values": "4x70"},
        {"series": 'danlu_gpu_quota{team="vision", flavor="a100"}', "values": "2x70"},
        {"series": 'danlu_gpu_borrowing_limit{team="vision", flavor="a100"}', "values": "1x70"},
        # the service stops answering its scrapes at minute 30
        {"series": 'up{job="danlu", instance="127.0.0.1:8000"}', "values": "1x30 0x40"},
        # research: 4 attempts failed for infrastructure reasons within 10 minutes; vision: 5 in its users' code
        {
            "series": 'danlu_attempts_failed_total{queue="research", failure="infrastructure"}',
            "values": "0x20 1 2 3 4x45",
        },
        {"series": 'danlu_attempts_failed_total{queue="vision", failure="user"}', "values": "0x20 1 2 3 4 5x45"},
    ],
}


def one_machine_tests() -> list[dict]:
    a100 = {"flavor": "a100"}
    return [
        alert(ONE, "DanluGpuHeldIdle", "40m", {"device": "0", **a100}, "warning"),
        quiet("DanluGpuHeldIdle", "25m"),  # not yet idle for 30 minutes
        alert(ONE, "DanluQueueWaitTooLong", "67m", {"queue": "research"}, "warning", "1h 7m 0s"),
        quiet("DanluQueueWaitTooLong", "62m"),  # beyond the hour, but not for 5 minutes yet
        {  # both teams borrow
            "eval_time": "65m",
            "alertname": "DanluTeamBorrowing",
            "exp_alerts": [
                {
                    "exp_labels": {"team": team, **a100, "severity": "info"},
                    "exp_annotations": annotations(ONE, "DanluTeamBorrowing", {"team": team, **a100}),
                }
                for team in ("research", "vision")
            ],
        },
        # vision borrows too, and is beyond its limit
        {
            "eval_time": "65m",
            "alertname": "DanluTeamOverBorrowingLimit",
            "exp_alerts": [
                {
                    "exp_labels": {"team": "vision", **a100, "severity": "critical"},
                    "exp_annotations": annotations(ONE, "DanluTeamOverBorrowingLimit", {"team": "vision", **a100}),
                }
            ],
        },
        quiet("DanluTeamBorrowing", "30m"),
        alert(ONE, "DanluGpuGone", "44m", {"device": "3", **a100}, "critical"),
        quiet("DanluGpuGone", "40m"),
        alert(ONE, "DanluServiceDown", "35m", {"job": "danlu", "instance": "127.0.0.1:8000"}, "critical"),
        quiet("DanluServiceDown", "31m"),
        alert(ONE, "DanluInfrastructureFailures", "30m", {"queue": "research"}, "warning", "4"),
        quiet("DanluInfrastructureFailures", "60m"),  # the failures are older than 15 minutes
    ]


KUBERNETES = {
    "interval": "1m",
    "input_series": [
        # a GPU held by a pod of danlu's namespace, idle; one busy; one of another namespace, idle
        {
            "series": 'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0", Hostname="gpu-1", namespace="danlu", '
            'pod="jupyter-alice"}',
            "values": "0.01x45",
        },
        {
            "series": 'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="1", Hostname="gpu-1", namespace="danlu", pod="job-7-node-0"}',
            "values": "0.7x45",
        },
        {
            "series": 'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="2", Hostname="gpu-1", namespace="other", pod="theirs"}',
            "values": "0x45",
        },
        {"series": 'danlu_queue_oldest_wait_seconds{queue="research"}', "values": "0+60x70"},
        {
            "series": 'kueue_cluster_queue_resource_usage{cluster_queue="research", flavor="a100", '
            'resource="nvidia.com/gpu"}',
            "values": "6x70",
        },
        {
            "series": 'kueue_cluster_queue_nominal_quota{cluster_queue="research", flavor="a100", '
            'resource="nvidia.com/gpu"}',
            "values": "2x70",
        },
        {
            "series": 'kueue_cluster_queue_borrowing_limit{cluster_queue="research", flavor="a100", '
            'resource="nvidia.com/gpu"}',
            "values": "2x70",
        },
        # gpu-1 loses one of its 8 GPUs at minute 30; gpu-2 becomes NotReady at minute 30
        {"series": 'kube_node_status_allocatable{node="gpu-1", resource="nvidia_com_gpu"}', "values": "8x30 7x40"},
        {"series": 'kube_node_status_capacity{node="gpu-2", resource="nvidia_com_gpu"}', "values": "8x70"},
        {
            "series": 'kube_node_status_condition{node="gpu-2", condition="Ready", status="true"}',
            "values": "1x30 0x40",
        },
        {
            "series": 'danlu_attempts_failed_total{queue="research", failure="infrastructure"}',
            "values": "0x20 1 2 3x45",
        },
    ],
}


def kubernetes_tests() -> list[dict]:
    research = {"cluster_queue": "research", "flavor": "a100", "resource": "nvidia.com/gpu"}
    return [
        alert(
            K8S,
            "DanluGpuHeldIdle",
            "40m",
            {"gpu": "0", "Hostname": "gpu-1", "namespace": "danlu", "pod": "jupyter-alice"},
            "warning",
        ),
        alert(K8S, "DanluQueueWaitTooLong", "67m", {"queue": "research"}, "warning", "1h 7m 0s"),
        alert(K8S, "DanluTeamBorrowing", "65m", research, "info"),
        alert(K8S, "DanluTeamOverBorrowingLimit", "65m", research, "critical"),
        alert(K8S, "DanluGpuGone", "40m", {"node": "gpu-1", "resource": "nvidia_com_gpu"}, "critical"),
        quiet("DanluGpuGone", "20m"),
        alert(
            K8S,
            "DanluNodeNotReady",
            "40m",
            {"node": "gpu-2", "condition": "Ready", "status": "true"},
            "critical",
        ),
        alert(K8S, "DanluInfrastructureFailures", "25m", {"queue": "research"}, "warning", "3"),
    ]


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        cannot_run("promtool", "promtool is not installed (Debian's prometheus package; .ci/run installs it)")
    return found


@pytest.mark.parametrize(
    ("rules", "series", "tests"),
    [(ONE, ONE_MACHINE, one_machine_tests), (K8S, KUBERNETES, kubernetes_tests)],
    ids=["one-machine", "kubernetes"],
)
def test_each_rule_fires_on_its_series_and_not_on_the_others(promtool, tmp_path, rules, series, tests):
    spec = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [{**series, "alert_rule_test": tests()}],
    }
    tested = {t["alertname"] for t in spec["tests"][0]["alert_rule_test"]}
    assert tested == {r["alert"] for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"]}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    out = subprocess.run([promtool, "test", "rules", str(tmp_path / "test.yaml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_service_exports_the_series_the_one_machine_rules_read():
    from types import SimpleNamespace

    metrics = Metrics()
    model = Model([Team("research", {"gpu/a100": 2.0}, {"gpu/a100": 2.0})], {"a100": [0, 1]}, cpu=16)
    metrics.observe_model(model, {}, {})
    metrics.attempts_failed.labels("research", "infrastructure").inc()
    gpus = [SimpleNamespace(index=i, flavor=f, declared=False) for f, ids in model.devices.items() for i in ids]
    metrics.observe_devices(gpus, {g.index: (None if g.index == gpus[0].index else 50.0) for g in gpus})
    exported = {
        line.split("{")[0].split(" ")[0] for line in metrics.exposition().decode().splitlines() if line[:1] != "#"
    }
    read = set()
    for group in alerts.rules()["groups"]:
        for rule in group["rules"]:
            read |= set(re.findall(r"\b(danlu_\w+)", rule["expr"]))
    assert read <= exported, read - exported


class FakeNvml:
    """The calls of nvidia-ml-py (``pynvml``) that sampling makes, as the library names them; a device in
    ``lost`` raises NVMLError_GpuIsLost (a subclass of NVMLError), as a GPU fallen off the bus does."""

    class NVMLError(Exception):
        pass

    class NVMLError_GpuIsLost(NVMLError):  # noqa: N801 - pynvml's name
        pass

    def __init__(self, utilization: dict[int, int], lost: set[int]):
        self.utilization, self.lost, self.calls = utilization, lost, []

    def nvmlInit(self):  # noqa: N802 - pynvml's names
        self.calls.append("init")

    def nvmlShutdown(self):  # noqa: N802
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByIndex(self, index):  # noqa: N802
        if index in self.lost:
            raise self.NVMLError_GpuIsLost("GPU is lost")
        return index

    def nvmlDeviceGetUtilizationRates(self, handle):  # noqa: N802
        from types import SimpleNamespace

        return SimpleNamespace(gpu=self.utilization[handle], memory=0)


def test_a_device_nvml_loses_is_down_and_the_others_sampled(monkeypatch):
    import sys
    from types import SimpleNamespace

    from danlu.hub.service.usage.reports import sample_gpus

    nvml = FakeNvml({0: 3, 1: 80}, lost={2})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    session = SimpleNamespace(added=[], add=lambda row: session.added.append(row))
    gpus = [SimpleNamespace(index=i, flavor="a100", declared=False) for i in range(3)]
    samples = sample_gpus(session, [*gpus, SimpleNamespace(index=7, flavor="sim", declared=True)])
    assert samples == {0: 3.0, 1: 80.0, 2: None} and [r.utilization for r in session.added] == [3.0, 80.0]
    assert nvml.calls == ["init", "shutdown"]
    metrics = Metrics()
    metrics.observe_devices([*gpus, SimpleNamespace(index=7, flavor="sim", declared=True)], samples)
    text = metrics.exposition().decode()
    assert 'danlu_gpu_up{device="2",flavor="a100"} 0.0' in text and 'danlu_gpu_up{device="7",flavor="sim"} 1.0' in text
    assert 'danlu_gpu_utilization_ratio{device="1",flavor="a100"} 0.8' in text
