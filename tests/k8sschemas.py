"""Official schemas of what Danlu generates for Kubernetes, as validators (shared by the tests).

The CRDs of Kueue v0.19.2, Kubeflow Trainer v2.3.0 and JobSet v0.12.0 and the Zero to JupyterHub 4.4.0
values schema are copies under ``tests/schemas/`` (see each folder's SOURCES.md; large CRDs gzipped,
content unchanged). Built-in kinds (Pod, Service, NetworkPolicy, ...) are checked by
``kubernetes-validate``, a maintained validator of the field, not by anything written here.

:func:`errors` takes any object Danlu renders and returns what the API server would refuse, as
``path: message`` strings (empty: valid).
"""

from __future__ import annotations

import gzip
import json
import re
from decimal import Decimal
from fractions import Fraction
from functools import cache
from pathlib import Path

import jsonschema
import yaml

SCHEMAS = Path(__file__).parent / "schemas"
#: (group, kind) -> CRD file under tests/schemas
CRD_FILES = {
    ("kueue.x-k8s.io", "ClusterQueue"): "kueue/v0.19.2/kueue.x-k8s.io_clusterqueues.yaml",
    ("kueue.x-k8s.io", "LocalQueue"): "kueue/v0.19.2/kueue.x-k8s.io_localqueues.yaml",
    ("kueue.x-k8s.io", "ResourceFlavor"): "kueue/v0.19.2/kueue.x-k8s.io_resourceflavors.yaml",
    ("kueue.x-k8s.io", "WorkloadPriorityClass"): "kueue/v0.19.2/kueue.x-k8s.io_workloadpriorityclasses.yaml",
    ("kueue.x-k8s.io", "Workload"): "kueue/v0.19.2/kueue.x-k8s.io_workloads.yaml.gz",
    ("trainer.kubeflow.org", "TrainJob"): "trainer/v2.3.0/trainer.kubeflow.org_trainjobs.yaml.gz",
    (
        "trainer.kubeflow.org",
        "ClusterTrainingRuntime",
    ): "trainer/v2.3.0/trainer.kubeflow.org_clustertrainingruntimes.yaml.gz",
    ("jobset.x-k8s.io", "JobSet"): "jobset/v0.12.0/jobset.x-k8s.io_jobsets.yaml.gz",
}
Z2JH_VALUES_SCHEMA = SCHEMAS / "z2jh" / "4.4.0" / "values.schema.json"
Z2JH_VALUES = SCHEMAS / "z2jh" / "4.4.0" / "values.yaml"  # the chart's defaults
KUBERNETES_VERSION = "1.36"  # the built-in kinds' schema version given to kubernetes-validate

# --- CRD openAPIV3Schema -> JSON Schema -------------------------------------------------------

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
STRING_KEYWORDS = ("pattern", "maxLength", "minLength", "format", "enum")

# CEL rules of the Kueue CRDs, translated. Keyed by the exact rule text, so a changed rule in a newer
# CRD is reported as untranslated instead of passing silently. Defaults apply before CEL runs.
CEL_RULES = {
    "!has(self.cohortName) && has(self.resourceGroups) ? self.resourceGroups.all(rg, rg.flavors.all(f, "
    "f.resources.all(r, !has(r.borrowingLimit)))) : true": lambda s: (
        "cohortName" in s
        or "resourceGroups" not in s
        or all("borrowingLimit" not in r for rg in s["resourceGroups"] for f in rg["flavors"] for r in f["resources"])
    ),
    "self.flavors.all(x, size(x.resources) == size(self.coveredResources))": lambda rg: all(
        len(f["resources"]) == len(rg["coveredResources"]) for f in rg["flavors"]
    ),
    "!(self.reclaimWithinCohort == 'Never' && has(self.borrowWithinCohort) &&  "
    "self.borrowWithinCohort.policy != 'Never')": lambda p: (
        not (
            p.get("reclaimWithinCohort", "Never") == "Never"
            and "borrowWithinCohort" in p
            and p["borrowWithinCohort"].get("policy", "Never") != "Never"
        )
    ),
    "!has(self.preference) || (self.whenCanBorrow == 'TryNextFlavor' && self.whenCanPreempt == 'TryNextFlavor')": lambda f: (  # noqa: E501 - the CRD's rule, as written
        "preference" not in f
        or (
            f.get("whenCanBorrow", "MayStopSearch") == "TryNextFlavor"
            and f.get("whenCanPreempt", "TryNextFlavor") == "TryNextFlavor"
        )
    ),
    # Kubeflow Trainer v2.3.0 TrainJob: its name is a DNS label that starts with a letter
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')": lambda o: bool(
        re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", o.get("metadata", {}).get("name", ""))
    ),
    "size(self.metadata.name) <= 63": lambda o: len(o.get("metadata", {}).get("name", "")) <= 63,
    "self in ['trainer.kubeflow.org/trainjob-controller', 'kueue.x-k8s.io/multikueue']": lambda v: (
        v in ("trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue")
    ),
    "self == '' || self.matches('^[A-Za-z][A-Za-z0-9+.-]*://.+$')": lambda v: (
        v == "" or bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://.+$", v))
    ),
    # Kueue v0.19.2 ResourceFlavor: tolerations (and nodeTaints) as the core API checks them
    "self.all(x, !has(x.key) ? x.operator == 'Exists' : true)": lambda ts: all(
        "key" in t or t.get("operator") == "Exists" for t in ts
    ),
    "self.all(x, has(x.tolerationSeconds) ? x.effect == 'NoExecute' : true)": lambda ts: all(
        "tolerationSeconds" not in t or t.get("effect") == "NoExecute" for t in ts
    ),
    "self.all(x, !has(x.operator) || x.operator in ['Equal', 'Exists'])": lambda ts: all(
        t.get("operator", "Equal") in ("Equal", "Exists") for t in ts
    ),
    "self.all(x, has(x.operator) && x.operator == 'Exists' ? !has(x.value) : true)": lambda ts: all(
        not (t.get("operator") == "Exists" and "value" in t) for t in ts
    ),
    "self.all(x, !has(x.effect) || x.effect in ['NoSchedule', 'PreferNoSchedule', 'NoExecute'])": lambda ts: all(
        t.get("effect", "NoSchedule") in ("NoSchedule", "PreferNoSchedule", "NoExecute") for t in ts
    ),
    "self.all(x, x.effect in ['NoSchedule', 'PreferNoSchedule', 'NoExecute'])": lambda ts: all(
        t.get("effect") in ("NoSchedule", "PreferNoSchedule", "NoExecute") for t in ts
    ),
    # Kubeflow Trainer v2.3.0 ClusterTrainingRuntime: one ML policy at most; JobSet's startup order
    "[has(self.torch), has(self.mpi), has(self.jax), has(self.xgboost),has(self.flux)].filter(x, x).size() <= 1": lambda p: (  # noqa: E501 - the CRD's rule, as written
        sum(k in p for k in ("torch", "mpi", "jax", "xgboost", "flux")) <= 1
    ),
    "!(has(self.startupPolicy) && self.startupPolicy.startupPolicyOrder == 'InOrder' && "
    "self.replicatedJobs.exists(x, has(x.dependsOn)))": lambda s: (
        not (
            s.get("startupPolicy", {}).get("startupPolicyOrder") == "InOrder"
            and any("dependsOn" in j for j in s.get("replicatedJobs", []))
        )
    ),
    "!has(self.topologyName) || self.nodeLabels.size() >= 1": lambda s: (
        "topologyName" not in s or len(s.get("nodeLabels") or {}) >= 1
    ),
    # Kueue v0.19.2 Workload (the rules of the fields a Workload of a TrainJob has)
    "has(self.status) && has(self.status.conditions) && self.status.conditions.exists(c, c.type == 'QuotaReserved' "
    "&& c.status == 'True') && has(self.status.admission) ? size(self.spec.podSets) == "
    "size(self.status.admission.podSetAssignments) : true": lambda w: (
        not (
            any(
                c.get("type") == "QuotaReserved" and c.get("status") == "True"
                for c in (w.get("status") or {}).get("conditions") or []
            )
            and "admission" in (w.get("status") or {})
        )
        or len(w["spec"]["podSets"]) == len(w["status"]["admission"].get("podSetAssignments") or [])
    ),
    "!has(self.priorityClassRef) || has(self.priority)": lambda s: "priorityClassRef" not in s or "priority" in s,
    "has(self.minCount) ? self.minCount <= self.count : true": lambda p: (
        "minCount" not in p or p["minCount"] <= p.get("count", 1)
    ),
    "(self.group == 'scheduling.k8s.io') ? self.kind == 'PriorityClass' : true": lambda r: (
        r.get("group") != "scheduling.k8s.io" or r.get("kind") == "PriorityClass"
    ),
    "(self.group == 'kueue.x-k8s.io') ? self.kind == 'WorkloadPriorityClass' : true": lambda r: (
        r.get("group") != "kueue.x-k8s.io" or r.get("kind") == "WorkloadPriorityClass"
    ),
    "!has(self.clusterName) || (!has(self.nominatedClusterNames) || (has(self.nominatedClusterNames) && "
    "size(self.nominatedClusterNames) == 0))": lambda s: "clusterName" not in s or not s.get("nominatedClusterNames"),
}


def structural_to_jsonschema(node: dict) -> dict:
    """A Kubernetes structural schema node as plain JSON Schema (Draft 7).

    * ``x-kubernetes-int-or-string``: an integer, or a string meeting the string keywords (``pattern``);
    * ``format: int32/int64``: the integer range, which jsonschema does not check itself;
    * ``nullable: true``: null is allowed too (otherwise the API server rejects null);
    * an object with ``properties`` and no ``additionalProperties`` or
      ``x-kubernetes-preserve-unknown-fields`` rejects unknown fields (kubectl's strict field validation;
      without this a misspelled field would pass and be pruned by the API server);
    * ``x-kubernetes-validations`` and ``x-kubernetes-list-type`` stay, checked by keywords of
      :func:`crd_validator`; ``description`` goes.
    """
    out: dict = {}
    for key, value in node.items():
        if key == "description":
            continue
        if key == "properties":
            out[key] = {name: structural_to_jsonschema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = structural_to_jsonschema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [structural_to_jsonschema(sub) for sub in value]
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        string = {"type": "string", **{k: out.pop(k) for k in STRING_KEYWORDS if k in out}}
        out.pop("anyOf", None)
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, string]
    if node.get("type") == "integer" and node.get("format") in INT_RANGES:
        low, high = INT_RANGES[node["format"]]
        out.setdefault("minimum", low)
        out.setdefault("maximum", high)
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (
        node.get("type") == "object"
        and "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _object_meta(namespaced: bool) -> dict:
    """What the API server requires of metadata on create (ObjectMeta, the fields Danlu sets)."""
    meta = {
        "type": "object",
        "required": ["name", "namespace"] if namespaced else ["name"],
        "properties": {
            "name": {"type": "string", "maxLength": 253, "pattern": DNS_SUBDOMAIN},
            "labels": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }
    if namespaced:
        meta["properties"]["namespace"] = {"type": "string", "pattern": DNS_LABEL}
    else:
        meta["not"] = {"required": ["namespace"]}  # a cluster-scoped object in a namespace is a mistake
    return meta


def _cel(validator, rules, instance, schema):
    for rule in rules:
        if "oldSelf" in rule["rule"]:
            continue  # a transition rule: it applies to updates only
        check = CEL_RULES.get(rule["rule"])
        if check is None:
            yield jsonschema.ValidationError(f"CEL rule not translated in tests/k8sschemas.py: {rule['rule']}")
        elif not check(instance):
            yield jsonschema.ValidationError(rule.get("message") or rule["rule"])


def _list_type(validator, list_type, instance, schema):
    if not validator.is_type(instance, "array"):
        return
    if list_type == "set":
        keys = [repr(item) for item in instance]
    elif list_type == "map":
        keys = [tuple(item.get(k) for k in schema.get("x-kubernetes-list-map-keys", [])) for item in instance]
    else:
        return
    dupes = sorted({str(k) for k in keys if keys.count(k) > 1})
    if dupes:
        yield jsonschema.ValidationError(f"duplicate entries in a list of type {list_type}: {', '.join(dupes)}")


KubernetesValidator = jsonschema.validators.extend(
    jsonschema.Draft7Validator, {"x-kubernetes-validations": _cel, "x-kubernetes-list-type": _list_type}
)


def raw_schema(crd: dict, version: str) -> dict:
    return next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]


def crd_schema(crd: dict, version: str) -> dict:
    """The JSON Schema of one served version of a CRD, with apiVersion, kind and metadata pinned down."""
    served = {v["name"]: v for v in crd["spec"]["versions"] if v["served"]}
    if version not in served:
        raise ValueError(f"{crd['metadata']['name']} does not serve {version}; it serves {', '.join(served)}")
    schema = structural_to_jsonschema(served[version]["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"const": f"{crd['spec']['group']}/{version}"}
    schema["properties"]["kind"] = {"const": crd["spec"]["names"]["kind"]}
    schema["properties"]["metadata"] = _object_meta(crd["spec"]["scope"] == "Namespaced")
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    return schema


def load_crd_file(relative: str) -> dict:
    path = SCHEMAS / relative
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return yaml.safe_load(text)


@cache
def load_crd_of(group: str, kind: str) -> dict:
    try:
        return load_crd_file(CRD_FILES[(group, kind)])
    except KeyError:
        raise KeyError(f"no CRD copy for {kind}.{group} under tests/schemas (add it to CRD_FILES)") from None


@cache
def validator_for(group: str, kind: str, version: str) -> jsonschema.Validator:
    return KubernetesValidator(crd_schema(load_crd_of(group, kind), version))


def errors(obj: dict) -> list[str]:
    """What the API server would refuse in ``obj`` (a CRD kind or a built-in one); [] when valid."""
    api_version, kind = obj.get("apiVersion", ""), obj.get("kind", "")
    group, _, version = api_version.rpartition("/")
    if (group, kind) in CRD_FILES:
        return [
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator_for(group, kind, version).iter_errors(obj)
        ]
    return builtin_errors(obj)


def builtin_errors(obj: dict) -> list[str]:
    """Errors of a built-in kind from kubernetes-validate (strict: unknown fields are errors too)."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'/'.join(map(str, e.path))}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"no schema for {obj.get('apiVersion')}/{obj.get('kind')}: {e}"]
    return []


@cache
def z2jh_validator() -> jsonschema.Validator:
    return jsonschema.Draft7Validator(json.loads(Z2JH_VALUES_SCHEMA.read_text()))


def with_chart_defaults(values: dict) -> dict:
    """``values`` merged over the chart's own values.yaml the way Helm merges them (maps deeply,
    lists and scalars replaced, null deletes): what Helm validates against the values schema."""

    def merge(base, over):
        if not (isinstance(base, dict) and isinstance(over, dict)):
            return over
        out = dict(base)
        for key, value in over.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = merge(base.get(key), value)
        return out

    return merge(yaml.safe_load(Z2JH_VALUES.read_text()), values)


def values_errors(values: dict) -> list[str]:
    """What the Zero to JupyterHub 4.4.0 chart's values schema refuses in ``values``."""
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in z2jh_validator().iter_errors(values)]


# --- quantities ---------------------------------------------------------------------------------

_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$")
_SUFFIX = {
    "": 1,
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def parse_quantity(value) -> Fraction:
    """A Kubernetes quantity as an exact number: ``"500m"`` -> 1/2, ``"64Gi"`` -> 64 * 2**30."""
    if isinstance(value, int | float):
        return Fraction(value)
    match = _QUANTITY.match(str(value))
    if not match:
        raise ValueError(f"not a quantity: {value!r}")
    number, suffix = match.group(1), match.group(2) or ""
    if suffix[:1] in ("e", "E"):
        return Fraction(Decimal(number)) * Fraction(10) ** int(suffix[1:])
    return Fraction(Decimal(number)) * _SUFFIX[suffix]
