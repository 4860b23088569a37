"""danlu.yaml as Kueue objects: the same teams, quotas and priorities on a Kubernetes cluster.

This module owns the rendering of :class:`~danlu.hub.config.Settings` plus the GPU
inventory into Kueue ``kueue.x-k8s.io/v1beta2`` objects (v1beta2 is the storage
version of Kueue v0.19; v1beta1 is deprecated). It is pure: one function per kind
builds a dict, :func:`render` returns all of them, :func:`to_yaml` writes them as
one multi-document stream for ``kubectl apply -f -``. Nothing here talks to a cluster.

How danlu.yaml maps onto Kueue (the in-memory model in
:mod:`danlu.hub.service.admission.model` makes the same decisions on one machine):

* each GPU flavor (``gpus.declared[].flavor`` or the detected one) is a
  **ResourceFlavor**, with the ``node_labels`` and ``tolerations`` declared for it
  (Kueue adds them to the pods it admits on that flavor, so a job lands on the
  nodes that have those GPUs); CPU and memory share one more, ``default-flavor``;
* each team is a **ClusterQueue** with a resource group per GPU resource name
  (``gpus.declared[].resource``, default ``nvidia.com/gpu``) over every GPU
  flavor of that resource (the team's own flavors first, in danlu.yaml order, then the
  rest of the inventory with a nominal quota of 0, which is what the team may try
  and borrow), and ``cpu`` + ``memory`` on ``default-flavor``. ``quota`` is
  ``nominalQuota``, ``cohort`` is ``cohortName``, ``borrowing_limit`` is
  ``borrowingLimit``, ``lending_limit`` is ``lendingLimit`` (capped at the nominal
  quota, which Kueue requires and which means the same: a team cannot lend more
  than it has). Limits appear only where danlu.yaml sets them, except for
  unquoted CPU and memory (below);
* CPU and memory a team leaves unquoted are limited only by the machine in
  Danlu. Kueue needs a nominal quota for every covered resource, so they get the
  ``resources`` values of danlu.yaml when declared, else a large value
  (:data:`UNLIMITED_CPU` cores, :data:`UNLIMITED_MEMORY` bytes = ``1Pi``) that
  leaves the limit to the cluster's nodes. A large value, rather than the CPU count
  of the machine that runs the renderer, keeps the output the same wherever it is
  rendered, and both stay far from int64 overflow when Kueue sums a cohort. In a
  cohort they also get ``borrowingLimit: 0`` and ``lendingLimit: 0``: an unquoted
  resource is not part of the cohort's shared quota, so it is neither borrowed nor
  lent, and one team never gets more than the machine;
* ``preemption.within_team`` is ``withinClusterQueue`` (``lower_priority`` ->
  ``LowerPriority``, ``never`` -> ``Never``) and ``preemption.reclaim`` is
  ``reclaimWithinCohort`` (``any`` -> ``Any``, ``lower_priority`` -> ``LowerPriority``,
  ``never`` -> ``Never``); Danlu's defaults (``lower_priority``, ``any``) are written
  out because Kueue's own defaults are ``Never``;
* ``queueingStrategy: BestEffortFIFO`` and ``flavorFungibility`` with Kueue's
  defaults written out (take the first flavor where the workload fits, borrowing
  if it must; try the next flavor before preempting), as Danlu decides;
* each team also gets a **LocalQueue** of the same name in the Danlu namespace,
  so a job's ``queue`` names the same thing on both sides (the
  ``kueue.x-k8s.io/queue-name`` label). ClusterQueues admit only from that
  namespace;
* without teams there is one ClusterQueue and LocalQueue, ``default``, holding
  the whole inventory;
* ``priority_classes`` are **WorkloadPriorityClasses**. Kueue has no default
  class: whoever submits a job labels it with Danlu's default class.

Admins' live changes (held queues, changed quotas, kept in the database) can be
passed as ``overrides``, like :func:`danlu.hub.service.admission.quotas.build_teams` takes
them; a held team's ClusterQueue gets ``stopPolicy: Hold``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import yaml

from danlu.errors import ConfigError
from danlu.hub.config import Settings
from danlu.hub.gpus import GPU
from danlu.hub.service.admission import quotas
from danlu.hub.teams import DEFAULT_QUEUE, parse_size

API_VERSION = "kueue.x-k8s.io/v1beta2"
GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_FLAVOR = "default-flavor"
LABELS = {"app.kubernetes.io/managed-by": "danlu"}
UNLIMITED_CPU = 1_000_000.0
UNLIMITED_MEMORY = float(2**50)  # 1Pi

WITHIN_TEAM = {"lower_priority": "LowerPriority", "never": "Never"}
RECLAIM = {"any": "Any", "lower_priority": "LowerPriority", "never": "Never"}
_BINARY = [("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)]


def cpu_quantity(cores: float) -> str:
    """``16`` -> ``"16"``, ``0.5`` -> ``"500m"`` (Kubernetes counts CPU in millicores)."""
    cores = float(cores)
    if cores.is_integer():
        return str(int(cores))
    return f"{round(cores * 1000)}m"


def memory_quantity(size) -> str:
    """Bytes (or a danlu.yaml size like ``64G``) -> ``"64Gi"``; whole bytes, rounded up."""
    count = math.ceil(parse_size(size))
    for suffix, unit in _BINARY:
        if count and count % unit == 0:
            return f"{count // unit}{suffix}"
    return str(count)


def count_quantity(count: float) -> str:
    """A number of devices: ``2`` -> ``"2"``."""
    return cpu_quantity(count)


def _metadata(name: str, namespace: str | None = None) -> dict:
    meta = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    meta["labels"] = dict(LABELS)
    return meta


def make_resource_flavor(
    flavor: str, node_labels: Mapping[str, str] | None = None, tolerations: Iterable[Mapping] | None = None
) -> dict:
    """A ResourceFlavor; ``node_labels`` (e.g. ``{"nvidia.com/gpu.product": "NVIDIA-H200"}``)
    steer the workloads admitted on it to the matching nodes, ``tolerations`` let them onto
    those nodes' taints (danlu.yaml's form: key, operator, value, effect)."""
    spec: dict = {}
    if node_labels:
        spec["nodeLabels"] = dict(node_labels)
    if tolerations:
        spec["tolerations"] = [dict(t) for t in tolerations]
    return {"apiVersion": API_VERSION, "kind": "ResourceFlavor", "metadata": _metadata(flavor), "spec": spec}


def _quota(resource: str, nominal: str, borrowing: str | None = None, lending: str | None = None) -> dict:
    out = {"name": resource, "nominalQuota": nominal}
    if borrowing is not None:
        out["borrowingLimit"] = borrowing
    if lending is not None:
        out["lendingLimit"] = lending
    return out


def make_cluster_queue(
    name: str,
    team_spec: Mapping,
    flavors: Iterable[str],
    *,
    cpu: float = UNLIMITED_CPU,
    memory: float = UNLIMITED_MEMORY,
    namespace: str = "danlu",
    held: bool = False,
    resources: Mapping[str, str] | None = None,
) -> dict:
    """A team's ClusterQueue from its danlu.yaml entry (``quota``, ``cohort``, ``borrowing_limit``,
    ``lending_limit``, ``preemption``).

    ``flavors`` are the GPU flavors on the machine, in inventory order; ``cpu`` (cores) and
    ``memory`` (bytes) are the nominal quota of whichever of the two the team leaves unquoted;
    ``resources`` maps a GPU flavor to its extended resource (default ``nvidia.com/gpu``): one
    resource group per resource name, in the order of their first flavor.
    """
    resources = resources or {}
    quota = team_spec.get("quota") or {}
    borrowing = team_spec.get("borrowing_limit") or {}
    lending = team_spec.get("lending_limit") or {}
    cohort = team_spec.get("cohort")
    if cohort is None and (borrowing or lending):
        raise ValueError(f"team {name} sets a borrowing or lending limit but belongs to no cohort")
    preemption = team_spec.get("preemption") or {}

    own = list(quota.get("gpus") or {})
    order = own + [f for f in flavors if f not in own]
    gpu_groups: dict[str, list] = {}
    for flavor in order:
        resource = resources.get(flavor, GPU_RESOURCE)
        nominal = float((quota.get("gpus") or {}).get(flavor, 0))
        borrow = (borrowing.get("gpus") or {}).get(flavor)
        lend = (lending.get("gpus") or {}).get(flavor)
        gpu_groups.setdefault(resource, []).append(
            {
                "name": flavor,
                "resources": [
                    _quota(
                        resource,
                        count_quantity(nominal),
                        count_quantity(borrow) if borrow is not None else None,
                        count_quantity(min(float(lend), nominal)) if lend is not None else None,
                    )
                ],
            }
        )

    machine = {"cpu": (float(cpu), cpu_quantity), "memory": (float(memory), memory_quantity)}
    cpu_memory = []
    for resource, (capacity, fmt) in machine.items():
        if resource in quota:
            nominal = parse_size(quota[resource]) if resource == "memory" else float(quota[resource])
            borrow, lend = borrowing.get(resource), lending.get(resource)
            if resource == "memory":
                borrow = parse_size(borrow) if borrow is not None else None
                lend = parse_size(lend) if lend is not None else None
            cpu_memory.append(
                _quota(
                    resource,
                    fmt(nominal),
                    fmt(borrow) if borrow is not None else None,
                    fmt(min(float(lend), nominal)) if lend is not None else None,
                )
            )
        elif cohort is not None:
            cpu_memory.append(_quota(resource, fmt(capacity), "0", "0"))
        else:
            cpu_memory.append(_quota(resource, fmt(capacity)))

    groups = [{"coveredResources": [resource], "flavors": entries} for resource, entries in gpu_groups.items()]
    groups.append(
        {"coveredResources": ["cpu", "memory"], "flavors": [{"name": DEFAULT_FLAVOR, "resources": cpu_memory}]}
    )

    spec: dict = {}
    if cohort is not None:
        spec["cohortName"] = cohort
    spec.update(
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "queueingStrategy": "BestEffortFIFO",
            "resourceGroups": groups,
            "preemption": {
                "withinClusterQueue": WITHIN_TEAM[preemption.get("within_team", "lower_priority")],
                "reclaimWithinCohort": RECLAIM[preemption.get("reclaim", "any")],
            },
            "flavorFungibility": {"whenCanBorrow": "MayStopSearch", "whenCanPreempt": "TryNextFlavor"},
        }
    )
    if held:
        spec["stopPolicy"] = "Hold"
    return {"apiVersion": API_VERSION, "kind": "ClusterQueue", "metadata": _metadata(name), "spec": spec}


def make_local_queue(team: str, namespace: str) -> dict:
    """The LocalQueue jobs of ``team`` are submitted to: same name as the team and its ClusterQueue."""
    return {
        "apiVersion": API_VERSION,
        "kind": "LocalQueue",
        "metadata": _metadata(team, namespace),
        "spec": {"clusterQueue": team},
    }


def make_workload_priority_class(name: str, value: int, description: str | None = None) -> dict:
    obj = {"apiVersion": API_VERSION, "kind": "WorkloadPriorityClass", "metadata": _metadata(name), "value": int(value)}
    if description:
        obj["description"] = description
    return obj


def flavor_specs(settings: Settings) -> dict[str, dict]:
    """GPU flavor -> what danlu.yaml declares about its nodes: ``node_labels``, ``tolerations`` and
    ``resource`` (the first declared group of a flavor that says each one wins)."""
    out: dict[str, dict] = {}
    for group in settings.gpus.declared:
        spec = out.setdefault(group.get("flavor", "gpu"), {})
        for key in ("node_labels", "tolerations", "resource"):
            if key in group:
                spec.setdefault(key, group[key])
    return out


def render(
    settings: Settings,
    inventory: list[GPU],
    namespace: str = "danlu",
    *,
    overrides: Mapping[str, dict] | None = None,
    node_labels: Mapping[str, Mapping[str, str]] | None = None,
) -> list[dict]:
    """Every Kueue object danlu.yaml stands for: ResourceFlavors, ClusterQueues, LocalQueues,
    WorkloadPriorityClasses, in the order ``kubectl apply`` should create them.

    ``node_labels`` maps a GPU flavor to the node labels of its ResourceFlavor (default: the
    ``node_labels`` danlu.yaml declares for it); tolerations and resource names come from
    danlu.yaml (:func:`flavor_specs`). Raises
    :class:`~danlu.errors.ConfigError` when a team names a GPU flavor the inventory lacks.
    """
    quotas.check(settings, inventory)
    flavors = list(quotas.flavors_of(inventory))
    if DEFAULT_FLAVOR in flavors:
        raise ConfigError(
            f"GPU flavor '{DEFAULT_FLAVOR}' is the name of the CPU and memory ResourceFlavor",
            fix="give those GPUs another flavor",
        )
    declared_flavors = flavor_specs(settings)
    if node_labels is None:
        node_labels = {f: spec["node_labels"] for f, spec in declared_flavors.items() if "node_labels" in spec}
    gpu_resources = {f: spec["resource"] for f, spec in declared_flavors.items() if "resource" in spec}
    declared = settings.resources  # on a cluster, what is not declared is unlimited, not this machine's
    cpu = declared.cpu if declared.cpu is not None else UNLIMITED_CPU
    memory = parse_size(declared.memory) if declared.memory is not None else UNLIMITED_MEMORY
    overrides = overrides or {}

    specs = quotas.team_specs(settings, dict(overrides))
    if not specs:
        counts = quotas.flavors_of(inventory)
        specs = {DEFAULT_QUEUE: {"quota": {"gpus": {f: len(ids) for f, ids in counts.items()}}}}

    objects = [
        make_resource_flavor(f, node_labels.get(f), declared_flavors.get(f, {}).get("tolerations")) for f in flavors
    ]
    objects.append(make_resource_flavor(DEFAULT_FLAVOR))
    objects += [
        make_cluster_queue(
            name,
            spec,
            flavors,
            cpu=cpu,
            memory=memory,
            namespace=namespace,
            held=bool(overrides.get(name, {}).get("held")),
            resources=gpu_resources,
        )
        for name, spec in specs.items()
    ]
    objects += [make_local_queue(name, namespace) for name in specs]
    classes = settings.priority_classes
    default = settings.default_priority_class
    for name, value in classes.items():
        description = classes.specs[name].get("description")
        if description is None and name == default:
            description = "The default: Danlu gives it to jobs that name no priority class."
        objects.append(make_workload_priority_class(name, value, description))
    return objects


def to_yaml(objects: Iterable[dict]) -> str:
    """A multi-document YAML stream (``---`` between objects), keys in the order built."""
    return yaml.safe_dump_all(list(objects), sort_keys=False, default_flow_style=False, explicit_start=True)
