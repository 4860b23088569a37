"""What the Zero to JupyterHub 4.4.0 chart renders from Danlu's values, as the API server sees it.

Every object of every deployment (tests/chart/conftest.py) validated by kubernetes-validate in strict
mode (unknown fields are errors) against Kubernetes 1.36's schemas, and the network paths Danlu's
hub services need present in the chart's own NetworkPolicies.
"""

from __future__ import annotations

import kubernetes_validate
import yaml

from .conftest import KUBERNETES_VERSION, find


def test_helm_renders_the_chart_with_danlus_values(deployment):
    kinds = {o["kind"] for o in deployment.objects}
    assert {"Deployment", "Service", "NetworkPolicy", "ConfigMap", "Secret"} <= kinds
    image = yaml.safe_load(deployment.values)["hub"]["image"]
    hub = find(deployment.objects, "Deployment", "hub")["spec"]["template"]["spec"]["containers"][0]
    assert hub["image"] == f"{image['name']}:{image['tag']}"  # Danlu's hub image, digest in the tag


def test_every_rendered_object_is_valid_for_kubernetes_1_36(deployment):
    refused = []
    for obj in deployment.objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            refused.append(f"{obj['kind']}/{obj['metadata']['name']}: {'/'.join(map(str, e.path))}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            refused.append(f"{obj['kind']}/{obj['metadata']['name']}: no schema: {e}")
    assert refused == []


def _selects(selector: dict, labels: dict) -> bool:
    match = selector.get("matchLabels") or {}
    return not selector.get("matchExpressions") and all(labels.get(k) == v for k, v in match.items())


def test_the_proxy_may_reach_every_port_of_the_hub_service(deployment):
    """The proxy routes /services/danlu and /services/mlflow to hub:10101 and hub:10102: its
    NetworkPolicy needs a rule to the hub pod on each of the hub Service's ports, or the routes 503
    where egress is enforced by pod (Cilium, GKE Dataplane V2)."""
    objects = deployment.objects
    hub_labels = find(objects, "Deployment", "hub")["spec"]["template"]["metadata"]["labels"]
    service = find(objects, "Service", "hub")
    ports = {p.get("targetPort", p["port"]) for p in service["spec"]["ports"]}
    ports = {8081 if p == "http" else p for p in ports}  # the chart's hub port is named
    assert {10101, 10102} <= ports
    egress = find(objects, "NetworkPolicy", "proxy")["spec"]["egress"]
    reached = {
        port["port"]
        for rule in egress
        if any("podSelector" in peer and _selects(peer["podSelector"], hub_labels) for peer in rule.get("to", []))
        for port in rule.get("ports", [])
    }
    assert ports - reached == set()
    # and the hub's own policy lets the proxy in on them
    proxy_labels = find(objects, "Deployment", "proxy")["spec"]["template"]["metadata"]["labels"]
    ingress = find(objects, "NetworkPolicy", "hub")["spec"]["ingress"]
    admitted = {
        port["port"]
        for rule in ingress
        if any("podSelector" in peer and _selects(peer["podSelector"], proxy_labels) for peer in rule.get("from", []))
        for port in rule.get("ports", [])
    }
    assert {10101, 10102} <= admitted
