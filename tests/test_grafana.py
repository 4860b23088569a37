"""docs/grafana-dashboard.json: well-formed, and it queries only the metrics the jobs service exports.

:data:`METRICS` is the contract with the exporter. Names are taken out of every PromQL expression
(panel targets and variable queries) by a small tokenizer: label matchers, range selectors, strings
and ``by (...)`` groupings are removed, then every identifier not followed by ``(`` and not a PromQL
keyword must be an exported metric (histograms as ``_bucket``/``_sum``/``_count``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana-dashboard.json"

METRICS = {
    "danlu_queue_pending": "gauge",
    "danlu_jobs_running": "gauge",
    "danlu_jobs_admitted_total": "counter",
    "danlu_jobs_preempted_total": "counter",
    "danlu_jobs_finished_total": "counter",
    "danlu_queue_wait_seconds": "histogram",
    "danlu_gpus_allocated": "gauge",
    "danlu_gpu_quota": "gauge",
    "danlu_admission_cycle_seconds": "histogram",
}
SERIES = {name for name, kind in METRICS.items() if kind != "histogram"} | {
    f"{name}{suffix}"
    for name, kind in METRICS.items()
    if kind == "histogram"
    for suffix in ("_bucket", "_sum", "_count")
}
KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values, regexes)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors, [$__rate_interval]
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # dashboard variables
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        name = match.group(0)
        following = text[match.end() :].lstrip()[:1]
        if following == "(" or name.lower() in KEYWORDS:
            continue  # a function or an aggregation, or a keyword
        names.add(name)
    return names


def _panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(where, expression) for every panel target and query variable."""
    out = [(f"panel {p['title']!r}", t["expr"]) for p in _panels(dashboard["panels"]) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"variable {var['name']}", re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", query)))
    return out


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_tokenizer():
    assert metric_names(
        "histogram_quantile(0.95, sum by (queue, le) (rate(danlu_queue_wait_seconds_bucket"
        '{queue=~"$queue"}[$__rate_interval])))'
    ) == {"danlu_queue_wait_seconds_bucket"}
    assert metric_names("sum(rate(a_sum[5m])) / sum(rate(a_count[5m])) > bool 0") == {"a_sum", "a_count"}
    assert metric_names('up{job="x"} or on (instance) kube_pod_info') == {"up", "kube_pod_info"}


def test_it_is_a_grafana_dashboard(dashboard):
    assert 38 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    panels = list(_panels(dashboard["panels"]))
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["refId"], panel["title"]


def test_expressions_use_only_exported_metrics(dashboard):
    used = set()
    for where, expr in _expressions(dashboard):
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        assert names <= SERIES, f"{where}: unknown metrics {sorted(names - SERIES)} in {expr!r}"
        used |= names
    assert {re.sub(r"_(bucket|sum|count)$", "", n) if n not in METRICS else n for n in used} == set(METRICS)


def test_counters_and_histograms_are_read_as_rates(dashboard):
    for where, expr in _expressions(dashboard):
        if where.startswith("variable"):
            continue
        for name in metric_names(expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if METRICS.get(name) == "counter" or METRICS.get(base) == "histogram":
                assert re.search(rf"(rate|increase)\(\s*{name}\b", expr), f"{where}: {name} is not rated in {expr!r}"
        if "_bucket" in expr:
            assert "histogram_quantile(" in expr and re.search(r"by \([^)]*\ble\b", expr), f"{where}: {expr!r}"


def test_the_panels_asked_for_are_there(dashboard):
    titles = [p["title"] for p in _panels(dashboard["panels"]) if p["type"] != "row"]
    assert titles == [
        "Queue depth (pending jobs)",
        "Running jobs",
        "Admissions and preemptions",
        "Queue wait time (p50 / p95)",
        "GPUs allocated vs nominal quota",
        "Finished jobs by state",
        "Admission cycle latency",
    ]
    wait = next(p for p in _panels(dashboard["panels"]) if p["title"].startswith("Queue wait"))
    assert [re.match(r"histogram_quantile\(([0-9.]+)", t["expr"]).group(1) for t in wait["targets"]] == ["0.5", "0.95"]
