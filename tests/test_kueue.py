"""Pure tests of :mod:`danlu.hub.kueue`: whole objects, the example config, and the Kueue CRD schemas.

The Kueue CRDs (v0.19.2, copied under tests/schemas/kueue/, see its SOURCES.md) hold Kubernetes
structural schemas. :func:`crd_validator` turns one served version into a Draft 7 validator that
rejects what the API server would reject on ``kubectl apply`` (strict field validation): unknown
fields, wrong types, bad quantities, missing required fields, a wrong apiVersion/kind, metadata
without a valid name, and the CEL rules (``x-kubernetes-validations``) this test knows how to check.
:func:`webhook_errors` adds what Kueue's validating webhook checks on a ClusterQueue
(``pkg/webhooks/clusterqueue_webhook.go``), which no schema says.
"""

from __future__ import annotations

import copy
import json
from fractions import Fraction
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from danlu.errors import ConfigError
from danlu.hub import gpus, kueue
from danlu.hub.config import Settings, load_settings
from danlu.hub.k8s import kueueconfig, readme
from danlu.hub.service.admission.quotas import build_teams
from danlu.hub.service.admission.workloads import gpu_key

from . import k8sschemas
from .k8sschemas import KubernetesValidator, crd_schema, load_crd_of, parse_quantity, raw_schema, validator_for

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "config" / "shared-workstation.yaml"
VERSION = "v1beta2"
LABELS = {"app.kubernetes.io/managed-by": "danlu"}
FUNGIBILITY = {"whenCanBorrow": "MayStopSearch", "whenCanPreempt": "TryNextFlavor"}
NS_SELECTOR = {"matchLabels": {"kubernetes.io/metadata.name": "danlu"}}

# --- CRD schemas: tests/k8sschemas.py ----------------------------------------------------------


def load_crd(kind: str) -> dict:
    return load_crd_of("kueue.x-k8s.io", kind)


@cache
def crd_validator(kind: str, version: str = VERSION) -> jsonschema.Validator:
    return validator_for("kueue.x-k8s.io", kind, version)


def errors(obj: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in crd_validator(obj["kind"]).iter_errors(obj)]


# --- Kueue's ClusterQueue webhook --------------------------------------------------------------


def webhook_errors(cq: dict) -> list[str]:
    """What Kueue v0.19's validating webhook refuses in a v1beta2 ClusterQueue (beyond the CRD schema)."""
    out = []
    spec = cq["spec"]
    seen_resources, seen_flavors = set(), set()
    for i, group in enumerate(spec.get("resourceGroups", [])):
        for resource in group["coveredResources"]:
            if resource in seen_resources:
                out.append(f"resourceGroups[{i}]: duplicate resource {resource}")
            seen_resources.add(resource)
        for flavor in group["flavors"]:
            if flavor["name"] in seen_flavors:
                out.append(f"resourceGroups[{i}]: duplicate flavor {flavor['name']}")
            seen_flavors.add(flavor["name"])
            for covered, quota in zip(group["coveredResources"], flavor["resources"], strict=False):
                where = f"{flavor['name']}/{quota['name']}"
                if quota["name"] != covered:
                    out.append(f"{where}: must match the name in coveredResources ({covered})")
                nominal = parse_quantity(quota["nominalQuota"])
                for key in ("nominalQuota", "borrowingLimit", "lendingLimit"):
                    if key in quota and parse_quantity(quota[key]) < 0:
                        out.append(f"{where}: {key} must be greater than or equal to 0")
                    if key != "nominalQuota" and key in quota and not spec.get("cohortName"):
                        out.append(f"{where}: {key} must be nil when cohort is empty")
                if "lendingLimit" in quota and parse_quantity(quota["lendingLimit"]) > nominal:
                    out.append(f"{where}: lendingLimit must be less than or equal to the nominalQuota")
    return out


# --- the helpers themselves -------------------------------------------------------------------


def _cq(**spec) -> dict:
    base = {
        "resourceGroups": [
            {
                "coveredResources": ["nvidia.com/gpu"],
                "flavors": [{"name": "a100", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "2"}]}],
            }
        ]
    }
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ClusterQueue",
        "metadata": {"name": "team"},
        "spec": {**base, **spec},
    }


def _gpu_quota(cq: dict) -> dict:
    return cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]


@pytest.mark.parametrize("kind", ["ClusterQueue", "LocalQueue", "ResourceFlavor", "WorkloadPriorityClass"])
def test_every_converted_crd_version_is_a_valid_schema(kind):
    crd = load_crd(kind)
    assert {v["name"] for v in crd["spec"]["versions"] if v["served"]} == {"v1beta1", "v1beta2"}
    assert next(v["name"] for v in crd["spec"]["versions"] if v["storage"]) == VERSION
    for version in ("v1beta1", "v1beta2"):
        KubernetesValidator.check_schema(crd_schema(crd, version))


def test_int_or_string_quantities_accept_both_forms():
    for value in (2, "2", "500m", "64Gi", "1.5", "1e3"):
        cq = _cq()
        _gpu_quota(cq)["nominalQuota"] = value
        assert errors(cq) == [], value


@pytest.mark.parametrize("value", ["2 GPUs", "two", "64GB", "", 2.5, None, True])
def test_an_invalid_quantity_is_caught(value):
    cq = _cq()
    _gpu_quota(cq)["nominalQuota"] = value
    assert any("nominalQuota" in e for e in errors(cq))


def test_a_misspelled_field_is_caught_where_the_raw_crd_schema_lets_it_through():
    cq = _cq(cohort="shared")  # the v1beta1 name of cohortName
    raw = raw_schema(load_crd("ClusterQueue"), VERSION)
    assert list(jsonschema.Draft7Validator(raw).iter_errors(cq)) == []  # the API server would prune it
    assert any("'cohort' was unexpected" in e for e in errors(cq))
    typo = _cq()
    _gpu_quota(typo)["nominalQouta"] = "2"
    assert any("nominalQouta" in e for e in errors(typo))


def test_wrong_types_and_values_are_caught():
    assert any(
        "is not of type 'integer'" in e for e in errors(kueue.make_workload_priority_class("x", 1) | {"value": "100"})
    )
    assert any("is not one of" in e for e in errors(_cq(preemption={"withinClusterQueue": "lowerPriority"})))
    assert any("2147483648" in e for e in errors(kueue.make_workload_priority_class("x", 2**31)))
    assert any("does not match" in e for e in errors(kueue.make_local_queue("Vision", "danlu")))


def test_missing_required_fields_are_caught():
    cq = _cq()
    del _gpu_quota(cq)["nominalQuota"]
    assert any("'nominalQuota' is a required property" in e for e in errors(cq))
    wpc = kueue.make_workload_priority_class("high", 10)
    del wpc["value"]
    assert any("'value' is a required property" in e for e in errors(wpc))
    lq = kueue.make_local_queue("vision", "danlu")
    del lq["metadata"]["namespace"]
    assert any("'namespace' is a required property" in e for e in errors(lq))
    rf = kueue.make_resource_flavor("a100")
    del rf["metadata"]["name"]
    assert any("'name' is a required property" in e for e in errors(rf))


def test_wrong_api_version_kind_and_scope_are_caught():
    old = _cq()
    old["apiVersion"] = "kueue.x-k8s.io/v1beta1"
    assert any("apiVersion" in e for e in errors(old))
    cluster_scoped = kueue.make_resource_flavor("a100")
    cluster_scoped["metadata"]["namespace"] = "danlu"
    assert errors(cluster_scoped)


def test_cel_rules_and_list_maps_are_checked():
    limit_without_cohort = _cq()
    _gpu_quota(limit_without_cohort)["borrowingLimit"] = "1"
    assert any("borrowingLimit must be nil when cohort is empty" in e for e in errors(limit_without_cohort))
    assert errors(_cq(cohortName="shared")) == []
    short = _cq()
    short["spec"]["resourceGroups"][0]["coveredResources"].append("cpu")
    assert any("same number of resources" in e for e in errors(short))
    twice = _cq()
    flavors = twice["spec"]["resourceGroups"][0]["flavors"]
    flavors.append(copy.deepcopy(flavors[0]))
    assert any("duplicate entries" in e for e in errors(twice))
    assert any("preference" in e for e in errors(_cq(flavorFungibility={"preference": "BorrowingOverPreemption"})))


def test_untranslated_cel_rules_fail_loudly(monkeypatch):
    rf = kueue.make_resource_flavor("a100")
    rf["spec"]["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert errors(rf) == []
    monkeypatch.delitem(k8sschemas.CEL_RULES, "self.all(x, !has(x.key) ? x.operator == 'Exists' : true)")
    assert any("not translated" in e for e in errors(rf))


def test_webhook_checks():
    cq = _cq(cohortName="shared")
    _gpu_quota(cq)["lendingLimit"] = "3"
    assert webhook_errors(cq) == ["a100/nvidia.com/gpu: lendingLimit must be less than or equal to the nominalQuota"]
    assert parse_quantity("500m") == Fraction(1, 2) and parse_quantity("64Gi") == 64 * 2**30
    assert parse_quantity("1e3") == 1000 and parse_quantity(7) == 7


# --- quantities and the make_* functions --------------------------------------------------------


def test_quantities():
    assert [kueue.cpu_quantity(v) for v in (16, 16.0, 0.5, 2.25)] == ["16", "16", "500m", "2250m"]
    assert kueue.memory_quantity("64G") == "64Gi"
    assert kueue.memory_quantity("1.5T") == "1536Gi"
    assert kueue.memory_quantity("512M") == "512Mi"
    assert kueue.memory_quantity(1024) == "1Ki"
    assert kueue.memory_quantity(1000) == "1000"
    assert kueue.memory_quantity(kueue.UNLIMITED_MEMORY) == "1Pi"


def test_make_resource_flavor():
    assert kueue.make_resource_flavor("default-flavor") == {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ResourceFlavor",
        "metadata": {"name": "default-flavor", "labels": LABELS},
        "spec": {},
    }
    assert kueue.make_resource_flavor("h200", {"nvidia.com/gpu.product": "NVIDIA-H200"}) == {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ResourceFlavor",
        "metadata": {"name": "h200", "labels": LABELS},
        "spec": {"nodeLabels": {"nvidia.com/gpu.product": "NVIDIA-H200"}},
    }


def test_make_resource_flavor_with_tolerations():
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    flavor = kueue.make_resource_flavor("h100", {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, [toleration])
    assert flavor == {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ResourceFlavor",
        "metadata": {"name": "h100", "labels": LABELS},
        "spec": {"nodeLabels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, "tolerations": [toleration]},
    }
    assert errors(flavor) == []


def test_render_takes_node_labels_tolerations_and_resource_from_danlu_yaml(tmp_path):
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    data = {
        "gpus": {
            "declared": [
                {
                    "count": 2,
                    "flavor": "h100",
                    "node_labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                    "tolerations": [toleration],
                },
                {"count": 2, "flavor": "mi300", "resource": "amd.com/gpu"},
            ]
        }
    }
    settings, inventory = _load(_write(tmp_path, data))
    objects = kueue.render(settings, inventory)
    flavors = _by_kind(objects, "ResourceFlavor")
    assert flavors["h100"]["spec"] == {
        "nodeLabels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [toleration],
    }
    assert flavors["mi300"]["spec"] == {}
    groups = _by_kind(objects, "ClusterQueue")["default"]["spec"]["resourceGroups"]
    assert [g["coveredResources"] for g in groups] == [["nvidia.com/gpu"], ["amd.com/gpu"], ["cpu", "memory"]]
    assert groups[1]["flavors"] == [{"name": "mi300", "resources": [{"name": "amd.com/gpu", "nominalQuota": "2"}]}]
    for obj in objects:
        assert errors(obj) == [], obj["metadata"]["name"]
        if obj["kind"] == "ClusterQueue":
            assert webhook_errors(obj) == []


def test_make_cluster_queue_in_a_cohort():
    team = {
        "cohort": "research",
        "quota": {"gpus": {"a100": 2}, "cpu": 8, "memory": "32G"},
        "borrowing_limit": {"gpus": {"a100": 1, "h100": 4}},
        "lending_limit": {"gpus": {"a100": 1}, "cpu": 100},
        "preemption": {"within_team": "never", "reclaim": "lower_priority"},
    }
    assert kueue.make_cluster_queue("vision", team, ["h100", "a100"], cpu=64, memory=256 * 2**30) == {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ClusterQueue",
        "metadata": {"name": "vision", "labels": LABELS},
        "spec": {
            "cohortName": "research",
            "namespaceSelector": NS_SELECTOR,
            "queueingStrategy": "BestEffortFIFO",
            "resourceGroups": [
                {
                    "coveredResources": ["nvidia.com/gpu"],
                    "flavors": [
                        {
                            "name": "a100",
                            "resources": [
                                {
                                    "name": "nvidia.com/gpu",
                                    "nominalQuota": "2",
                                    "borrowingLimit": "1",
                                    "lendingLimit": "1",
                                }
                            ],
                        },
                        {
                            "name": "h100",
                            "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "0", "borrowingLimit": "4"}],
                        },
                    ],
                },
                {
                    "coveredResources": ["cpu", "memory"],
                    "flavors": [
                        {
                            "name": "default-flavor",
                            "resources": [
                                {"name": "cpu", "nominalQuota": "8", "lendingLimit": "8"},  # lending capped at nominal
                                {"name": "memory", "nominalQuota": "32Gi"},
                            ],
                        },
                    ],
                },
            ],
            "preemption": {"withinClusterQueue": "Never", "reclaimWithinCohort": "LowerPriority"},
            "flavorFungibility": FUNGIBILITY,
        },
    }


def test_make_cluster_queue_alone_with_unquoted_cpu_and_memory():
    assert kueue.make_cluster_queue("solo", {"quota": {"gpus": {"t4": 1}}}, ["t4"], namespace="ml") == {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ClusterQueue",
        "metadata": {"name": "solo", "labels": LABELS},
        "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ml"}},
            "queueingStrategy": "BestEffortFIFO",
            "resourceGroups": [
                {
                    "coveredResources": ["nvidia.com/gpu"],
                    "flavors": [{"name": "t4", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "1"}]}],
                },
                {
                    "coveredResources": ["cpu", "memory"],
                    "flavors": [
                        {
                            "name": "default-flavor",
                            "resources": [
                                {"name": "cpu", "nominalQuota": "1000000"},
                                {"name": "memory", "nominalQuota": "1Pi"},
                            ],
                        },
                    ],
                },
            ],
            "preemption": {"withinClusterQueue": "LowerPriority", "reclaimWithinCohort": "Any"},
            "flavorFungibility": FUNGIBILITY,
        },
    }


def test_make_cluster_queue_without_gpus_held():
    cq = kueue.make_cluster_queue("cpu-only", {"quota": {"cpu": 4}}, [], cpu=16, memory=2**30, held=True)
    assert cq["spec"]["resourceGroups"] == [
        {
            "coveredResources": ["cpu", "memory"],
            "flavors": [
                {
                    "name": "default-flavor",
                    "resources": [{"name": "cpu", "nominalQuota": "4"}, {"name": "memory", "nominalQuota": "1Gi"}],
                }
            ],
        }
    ]
    assert cq["spec"]["stopPolicy"] == "Hold"
    assert errors(cq) == [] and webhook_errors(cq) == []


def test_make_cluster_queue_refuses_limits_without_a_cohort():
    with pytest.raises(ValueError, match="no cohort"):
        kueue.make_cluster_queue("x", {"quota": {}, "borrowing_limit": {"gpus": {"a": 1}}}, ["a"])


def test_make_local_queue():
    assert kueue.make_local_queue("vision", "danlu") == {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "LocalQueue",
        "metadata": {"name": "vision", "namespace": "danlu", "labels": LABELS},
        "spec": {"clusterQueue": "vision"},
    }


def test_make_workload_priority_class():
    assert kueue.make_workload_priority_class("high", 10000, "Deadlines.") == {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "WorkloadPriorityClass",
        "metadata": {"name": "high", "labels": LABELS},
        "value": 10000,
        "description": "Deadlines.",
    }
    assert kueue.make_workload_priority_class("low", -5) == {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "WorkloadPriorityClass",
        "metadata": {"name": "low", "labels": LABELS},
        "value": -5,
    }


# --- render --------------------------------------------------------------------------------------


def _load(path: Path) -> tuple[Settings, list]:
    settings = load_settings(path, environ={})
    return settings, gpus.inventory(settings.gpus)


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "danlu.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


RICH = {
    "gpus": {"declared": [{"count": 4, "flavor": "a100"}, {"count": 2, "flavor": "t4"}]},
    "resources": {"cpu": 32, "memory": "128G"},
    "teams": {
        "vision": {
            "cohort": "lab",
            "quota": {"gpus": {"t4": 1, "a100": 2}, "cpu": 8},
            "borrowing_limit": {"gpus": {"a100": 1}},
            "lending_limit": {"gpus": {"a100": 5}, "cpu": 4},
        },
        "nlp": {
            "cohort": "lab",
            "quota": {"gpus": {"a100": 2}, "memory": "64G"},
            "preemption": {"within_team": "never", "reclaim": "lower_priority"},
        },
        "ops": {"quota": {"gpus": {"t4": 1}}, "preemption": {"reclaim": "never"}},
    },
    "priority_classes": {
        "batch": {"value": -10, "description": "Runs when nothing else does."},
        "normal": {"value": 0, "default": True},
    },
}


def _by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def test_render_the_shared_workstation_example():
    settings, inventory = _load(EXAMPLE)
    objects = kueue.render(settings, inventory)
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("ResourceFlavor", "sim"),
        ("ResourceFlavor", "default-flavor"),
        ("ClusterQueue", "vision"),
        ("ClusterQueue", "nlp"),
        ("LocalQueue", "vision"),
        ("LocalQueue", "nlp"),
        ("WorkloadPriorityClass", "low"),
        ("WorkloadPriorityClass", "normal"),
        ("WorkloadPriorityClass", "high"),
    ]
    queues = _by_kind(objects, "ClusterQueue")
    for name in ("vision", "nlp"):
        assert queues[name] == {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ClusterQueue",
            "metadata": {"name": name, "labels": LABELS},
            "spec": {
                "cohortName": "shared",
                "namespaceSelector": NS_SELECTOR,
                "queueingStrategy": "BestEffortFIFO",
                "resourceGroups": [
                    {
                        "coveredResources": ["nvidia.com/gpu"],
                        "flavors": [
                            {
                                "name": "sim",
                                "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "2", "borrowingLimit": "2"}],
                            }
                        ],
                    },
                    {
                        "coveredResources": ["cpu", "memory"],
                        "flavors": [
                            {
                                "name": "default-flavor",
                                "resources": [
                                    {"name": "cpu", "nominalQuota": "16", "borrowingLimit": "0", "lendingLimit": "0"},
                                    {
                                        "name": "memory",
                                        "nominalQuota": "64Gi",
                                        "borrowingLimit": "0",
                                        "lendingLimit": "0",
                                    },
                                ],
                            },
                        ],
                    },
                ],
                "preemption": {"withinClusterQueue": "LowerPriority", "reclaimWithinCohort": "Any"},
                "flavorFungibility": FUNGIBILITY,
            },
        }
    local = _by_kind(objects, "LocalQueue")
    assert {n: (q["metadata"]["namespace"], q["spec"]["clusterQueue"]) for n, q in local.items()} == {
        "vision": ("danlu", "vision"),
        "nlp": ("danlu", "nlp"),
    }
    classes = _by_kind(objects, "WorkloadPriorityClass")
    assert {n: c["value"] for n, c in classes.items()} == {"low": 100, "normal": 1000, "high": 10000}
    assert "description" in classes["normal"] and "description" not in classes["low"]


def test_render_without_teams_is_one_default_queue(tmp_path):
    settings, inventory = _load(
        _write(tmp_path, {"gpus": {"declared": [{"count": 2, "flavor": "a100"}, {"count": 1, "flavor": "t4"}]}})
    )
    objects = kueue.render(settings, inventory, namespace="ml")
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("ResourceFlavor", "a100"),
        ("ResourceFlavor", "t4"),
        ("ResourceFlavor", "default-flavor"),
        ("ClusterQueue", "default"),
        ("LocalQueue", "default"),
        ("WorkloadPriorityClass", "normal"),
    ]
    assert objects[3]["spec"] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ml"}},
        "queueingStrategy": "BestEffortFIFO",
        "resourceGroups": [
            {
                "coveredResources": ["nvidia.com/gpu"],
                "flavors": [
                    {"name": "a100", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "2"}]},
                    {"name": "t4", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "1"}]},
                ],
            },
            {
                "coveredResources": ["cpu", "memory"],
                "flavors": [
                    {
                        "name": "default-flavor",
                        "resources": [
                            {"name": "cpu", "nominalQuota": "1000000"},
                            {"name": "memory", "nominalQuota": "1Pi"},
                        ],
                    }
                ],
            },
        ],
        "preemption": {"withinClusterQueue": "LowerPriority", "reclaimWithinCohort": "Any"},
        "flavorFungibility": FUNGIBILITY,
    }
    assert objects[4]["metadata"]["namespace"] == "ml" and objects[4]["spec"] == {"clusterQueue": "default"}
    assert objects[5]["value"] == 0


def test_render_without_teams_or_gpus():
    objects = kueue.render(Settings.from_data({"gpus": {"detect": False}, "resources": {"cpu": 4}}), [])
    cq = _by_kind(objects, "ClusterQueue")["default"]
    assert cq["spec"]["resourceGroups"] == [
        {
            "coveredResources": ["cpu", "memory"],
            "flavors": [
                {
                    "name": "default-flavor",
                    "resources": [{"name": "cpu", "nominalQuota": "4"}, {"name": "memory", "nominalQuota": "1Pi"}],
                }
            ],
        }
    ]
    assert [o["kind"] for o in objects].count("ResourceFlavor") == 1


def test_render_refuses_a_flavor_the_inventory_lacks(tmp_path):
    settings, inventory = _load(
        _write(
            tmp_path,
            {"gpus": {"declared": [{"count": 1, "flavor": "t4"}]}, "teams": {"a": {"quota": {"gpus": {"a100": 1}}}}},
        )
    )
    with pytest.raises(ConfigError, match="no GPU of flavor 'a100'"):
        kueue.render(settings, inventory)
    clash = [gpus.GPU(0, "default-flavor")]
    with pytest.raises(ConfigError, match="default-flavor"):
        kueue.render(Settings(), clash)


def test_render_applies_admins_live_changes(tmp_path):
    settings, inventory = _load(_write(tmp_path, RICH))
    objects = kueue.render(settings, inventory, overrides={"ops": {"held": True, "quota": {"gpus": {"t4": 2}}}})
    ops = _by_kind(objects, "ClusterQueue")["ops"]
    assert ops["spec"]["stopPolicy"] == "Hold"
    assert ops["spec"]["resourceGroups"][0]["flavors"][0] == {
        "name": "t4",
        "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "2"}],
    }
    assert "stopPolicy" not in _by_kind(objects, "ClusterQueue")["nlp"]["spec"]


def test_render_means_what_the_admission_model_means(tmp_path):
    """Every team's ClusterQueue read back equals the in-memory Team that quotas.build_teams makes."""
    settings, inventory = _load(_write(tmp_path, RICH))
    queues = _by_kind(kueue.render(settings, inventory), "ClusterQueue")
    machine = {"cpu": Fraction(32), "memory": Fraction(128 * 2**30)}
    preemption = {"lower_priority": "LowerPriority", "never": "Never", "any": "Any"}
    teams = build_teams(settings, inventory)
    assert sorted(queues) == sorted(t.name for t in teams)
    for team in teams:
        spec = queues[team.name]["spec"]
        assert spec.get("cohortName") == team.cohort
        assert spec["preemption"] == {
            "withinClusterQueue": preemption[team.within_team],
            "reclaimWithinCohort": preemption[team.reclaim],
        }
        gpu_group, cpu_group = spec["resourceGroups"]
        assert [f["name"] for f in gpu_group["flavors"]] == list(team.flavors)
        for flavor in gpu_group["flavors"]:
            (quota,) = flavor["resources"]
            key = gpu_key(flavor["name"])
            nominal = team.nominal.get(key, 0.0)
            assert parse_quantity(quota["nominalQuota"]) == nominal
            assert ("borrowingLimit" in quota) == (key in team.borrowing_limit)
            if key in team.borrowing_limit:
                assert parse_quantity(quota["borrowingLimit"]) == team.borrowing_limit[key]
            if key in team.lending_limit:
                assert parse_quantity(quota["lendingLimit"]) == min(team.lending_limit[key], nominal)
        for quota in cpu_group["flavors"][0]["resources"]:
            resource = quota["name"]
            if resource in team.nominal:
                assert parse_quantity(quota["nominalQuota"]) == Fraction(team.nominal[resource])
            else:  # unquoted: the machine, neither borrowed nor lent
                assert parse_quantity(quota["nominalQuota"]) == machine[resource]
                if team.cohort:
                    assert (quota["borrowingLimit"], quota["lendingLimit"]) == ("0", "0")
    vision_cpu = queues["vision"]["spec"]["resourceGroups"][1]["flavors"][0]["resources"][0]
    assert vision_cpu == {"name": "cpu", "nominalQuota": "8", "lendingLimit": "4"}


@pytest.mark.parametrize("config", ["example", "rich", "no-teams"])
def test_every_rendered_object_is_valid(config, tmp_path):
    if config == "example":
        settings, inventory = _load(EXAMPLE)
    else:
        data = RICH if config == "rich" else {"gpus": {"declared": [{"count": 8, "flavor": "h200"}]}}
        settings, inventory = _load(_write(tmp_path, data))
    objects = kueue.render(settings, inventory, node_labels={"h200": {"nvidia.com/gpu.product": "NVIDIA-H200"}})
    for obj in objects:
        assert errors(obj) == [], obj["metadata"]["name"]
        if obj["kind"] == "ClusterQueue":
            assert webhook_errors(obj) == [], obj["metadata"]["name"]
    flavors = set(_by_kind(objects, "ResourceFlavor"))
    queues = _by_kind(objects, "ClusterQueue")
    for cq in queues.values():
        assert {f["name"] for g in cq["spec"]["resourceGroups"] for f in g["flavors"]} <= flavors
    assert {lq["spec"]["clusterQueue"] for lq in _by_kind(objects, "LocalQueue").values()} == set(queues)
    assert len({(o["kind"], o["metadata"]["name"]) for o in objects}) == len(objects)


def test_to_yaml_is_a_multi_document_stream():
    settings, inventory = _load(EXAMPLE)
    objects = kueue.render(settings, inventory)
    text = kueue.to_yaml(objects)
    assert text.startswith("---\n") and text.count("\n---\n") == len(objects) - 1
    assert list(yaml.safe_load_all(text)) == objects
    assert "nominalQuota: '2'" in text  # quantities stay strings


# --- kueue-config.yaml: what Danlu needs, merged into the cluster's shared configuration (issue 16) ------------

#: the Configuration of Kueue v0.19.2's release manifests (config/components/manager/controller_manager_config.yaml),
#: comments dropped: other teams' integrations that the old kueue-config.yaml switched off by replacing it
UPSTREAM_CONFIG = """
apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
health: {healthProbeBindAddress: ":8081"}
metrics: {bindAddress: ":8443"}
webhook: {port: 9443}
leaderElection: {leaderElect: true, resourceName: c1f6bfd2.kueue.x-k8s.io}
controller:
  groupKindConcurrency: {Job.batch: 5, Pod: 5, Workload.kueue.x-k8s.io: 10, LocalQueue.kueue.x-k8s.io: 5,
    Cohort.kueue.x-k8s.io: 1, ClusterQueue.kueue.x-k8s.io: 5, ResourceFlavor.kueue.x-k8s.io: 1}
clientConnection: {qps: 300, burst: 500}
integrations:
  frameworks: [batch/job, kubeflow.org/mpijob, ray.io/rayjob, ray.io/raycluster, ray.io/rayservice,
    jobset.x-k8s.io/jobset, workload.codeflare.dev/appwrapper, trainer.kubeflow.org/trainjob, pod, deployment,
    statefulset, leaderworkerset.x-k8s.io/leaderworkerset]
"""


def test_kueue_config_adds_danlus_needs_and_keeps_every_other_teams_integration():
    current = yaml.safe_load(UPSTREAM_CONFIG)
    required = kueueconfig.requirements(600)
    merged, notes = kueueconfig.merge(current, required, "danlu")
    assert merged["integrations"]["frameworks"] == current["integrations"]["frameworks"]
    assert merged["waitForPodsReady"]["timeout"] == "600s" and merged["waitForPodsReady"]["blockAdmission"] is False
    assert {k: v for k, v in merged.items() if k != "waitForPodsReady"} == current and notes == []
    minimal = {
        "apiVersion": kueueconfig.API_VERSION,
        "kind": "Configuration",
        "integrations": {"frameworks": ["batch/job"]},
    }
    merged, _ = kueueconfig.merge(minimal, required, "danlu")
    assert merged["integrations"]["frameworks"] == ["batch/job", "trainer.kubeflow.org/trainjob", "pod"]
    theirs = {**current, "waitForPodsReady": {"timeout": "5m"}}
    merged, notes = kueueconfig.merge(theirs, required, "danlu")
    assert merged["waitForPodsReady"] == {"timeout": "5m"} and "kept the cluster's waitForPodsReady" in notes[0]


@pytest.mark.parametrize(
    "change, fix",
    [
        ({"managedJobsNamespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ml"}}}, "add 'danlu'"),
        (
            {
                "managedJobsNamespaceSelector": {
                    "matchExpressions": [
                        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["danlu"]}
                    ]
                }
            },
            "add 'danlu'",
        ),
        (
            {"manageJobsWithoutQueueName": True, "integrations": {"frameworks": ["batch/job"]}},
            "manageJobsWithoutQueueName: false",
        ),
        ({"apiVersion": "config.kueue.x-k8s.io/v1beta1"}, "install Kueue v0.19"),
    ],
)
def test_kueue_config_refuses_what_would_change_other_teams_or_skip_danlu(change, fix):
    current = {**yaml.safe_load(UPSTREAM_CONFIG), **change}
    with pytest.raises(ConfigError, match=fix.replace("'", ".")):
        kueueconfig.merge(current, kueueconfig.requirements(600), "danlu")


def test_kueue_config_command_merges_files_and_refuses_in_one_line(tmp_path, capsys):
    current, required = tmp_path / "current.yaml", tmp_path / "kueue-config.yaml"
    current.write_text(UPSTREAM_CONFIG)
    required.write_text("# a header\n---\n" + yaml.safe_dump(kueueconfig.requirements(300)))
    assert kueueconfig.main([str(current), str(required), "--namespace", "danlu"]) == 0
    merged = yaml.safe_load(capsys.readouterr().out)
    assert merged["waitForPodsReady"]["timeout"] == "300s" and "ray.io/rayjob" in merged["integrations"]["frameworks"]
    assert kueueconfig.main([str(current), str(required), "--namespace", "danlu", "--patch"]) == 0
    patch = json.loads(capsys.readouterr().out)
    assert yaml.safe_load(patch["data"]["controller_manager_config.yaml"]) == merged
    assert kueueconfig.main([str(current), str(required), "--namespace", "kube-system"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_the_install_sequence_installs_jobset_once_waits_for_webhooks_and_merges_kueues_config():
    """Fault 10: JobSet was applied on its own and again inside Trainer's manager overlay, nothing waited for
    the webhooks that validate the next step's objects, and kueue-config.yaml replaced Kueue's whole
    configuration."""
    text = readme.text(load_settings(EXAMPLE), "shared-workstation.yaml", [])
    commands = [line for line in text.splitlines() if line.startswith("kubectl") or line.startswith("python")]
    assert not any("kubernetes-sigs/jobset" in c for c in commands)  # the overlay's third-party/jobset
    overlay = next(i for i, c in enumerate(commands) if "trainer.git/manifests/overlays/manager" in c)
    waits = [i for i, c in enumerate(commands) if " wait --for=condition=Available" in c]
    objects = next(i for i, c in enumerate(commands) if "-f kueue.yaml" in c)
    assert len(waits) == 2 and waits[0] < overlay < waits[1] < objects
    assert "deployment/jobset-controller-manager" in text and "deployment/kubeflow-trainer-controller-manager" in text
    assert not any(c.startswith("kubectl apply -f kueue-config.yaml") for c in commands)
    assert any(
        c.startswith("python -m danlu.hub.k8s.kueueconfig kueue-current.yaml kueue-config.yaml") for c in commands
    )
