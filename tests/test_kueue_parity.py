"""Danlu's admission model and Kueue decide alike: the same danlu.yaml, the same jobs, the same admissions and victims.

Danlu reads Kueue's admission semantics three times: its own in-memory model (``Model``, built from danlu.yaml's
teams, which admits and preempts on one machine), :func:`danlu.hub.kueue.render` (the same teams as
ClusterQueues, LocalQueues, ResourceFlavors and WorkloadPriorityClasses for a cluster), and the fake cluster's
Kueue (:mod:`.k8sfake.kueue`, whose arithmetic is :mod:`.k8sfake.quota`), which the HTTP-level tests run on.
This module ties them together. Each scenario is a danlu.yaml and a list of steps: submit a job (a team, a
priority class, GPUs, maybe a flavor by name; its creation time is when it is submitted), finish one, and
settle. Both sides play every step: the model gets the workloads the jobs service would give it
(``quotas.request_for`` and ``priority_of``), the fake Kueue gets what ``render`` writes for the same
danlu.yaml and the TrainJobs the Kubernetes backend writes (:func:`danlu.hub.k8s.jobs.trainjob`). After
each settle both must have admitted the same jobs on the same flavors and preempted the same victims for
the same preemptors, and that must be what the scenario says Kueue v0.19 does (checked against Kueue's
source: ``pkg/scheduler/scheduler.go``, ``pkg/scheduler/preemption/``, ``pkg/scheduler/flavorassigner/``,
``pkg/cache/scheduler/``). Where the model does something else, the scenario is an expected failure that
names the difference, raised as :class:`ModelDisagrees` (a wrong fake fails the test outright).

The scenarios keep to what both share, by design:

* a **settle** runs passes (model) or reconciles (fake) until one changes nothing, and a victim stops at
  once: between two passes the model releases it and its job queues again with its creation time, as the
  jobs service does; the fake's victims release their quota when evicted. How many passes or cycles a
  settle takes, and in what order within it things happen, are each side's business (the model preempts
  for one workload per cohort and pass; Kueue for several per cycle when their targets do not overlap);
* jobs that must be told apart by admission time are admitted in separate settles: Kueue's ``most recently
  admitted first`` reads the QuotaReserved condition's time, which has a resolution of one second;
* ``jobs.starvation_seconds`` is out of reach (Danlu holds capacity back for a job that waited that long;
  Kueue has no such thing), notebook servers are not Kueue workloads, and CPU and memory never bind (the
  model counts them against the machine, Kueue against a ClusterQueue's quota);
* teams' nominal quotas add up to at most the devices of each flavor (beyond that, the model stops at the
  machine and Kueue at the quota);
* a flavor asked by name has ``node_labels`` declared (otherwise the TrainJob carries no nodeSelector and
  Kueue may pick any flavor).

:func:`test_random_scenarios_agree` plays random scenarios inside a narrower range where no known difference
can show (see its docstring).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from danlu.hub import gpus, kueue
from danlu.hub.config import Settings
from danlu.hub.k8s import jobs

from .k8sfake.kueue import Kueue, condition, is_true, set_condition
from .k8sfake.store import Store
from .k8sschemas import errors

# --- the Danlu side ---------------------------------------------------------------------------------------------
# isort: split
from danlu.hub.service.admission.quotas import build_model, priority_of, request_for
from danlu.hub.service.admission.workloads import Workload


def danlu_model(config: Settings):
    """The admission model the jobs service builds from danlu.yaml."""
    return build_model(config, gpus.inventory(config.gpus))


def danlu_workload(config: Settings, job: Job, created: float) -> Workload:
    """A queued job as the jobs service hands it to the model (one process, one CPU, no memory asked)."""
    resources = {"gpus": job.gpus, "cpu": 1}
    if job.flavor:
        resources["gpu_type"] = job.flavor
    return Workload(
        job.name, job.team, danlu_priority(config, job.priority)[1], created, request_for(resources, 1, None)
    )


def danlu_priority(config: Settings, name: str | None) -> tuple[str, int]:
    """A priority class's name and value (None: the default class, which Danlu labels its TrainJobs with)."""
    return priority_of(config, name)


def danlu_pass(model, pending: list[Workload], now: float) -> tuple[dict[str, str | None], dict[str, str]]:
    """One admission pass: {admitted id: its GPU flavor}, {victim id: the id it was preempted for}."""
    decision = model.cycle(pending, now)
    return (
        {wl.id: wl.flavor for wl in decision.admitted},
        {victim.id: preemptor.id for victim, preemptor in decision.preempted},
    )


def danlu_release(model, workload_id: str) -> None:
    """A job ended, or a victim stopped: its quota and devices are free."""
    model.release(workload_id)


# --- the scenarios' vocabulary --------------------------------------------------------------------------

NS = "danlu"
BASE = {
    "resources": {"cpu": 64},  # never binds: see the module docstring
    "jobs": {"starvation_seconds": 10**9},  # Danlu's starvation hold-back is out of reach
    "priority_classes": {"low": {"value": 100}, "normal": {"value": 1000, "default": True}, "high": {"value": 10000}},
}
A100 = {"count": 4, "flavor": "a100", "node_labels": {"nvidia.com/gpu.product": "NVIDIA-A100"}}


@dataclass(frozen=True)
class Job:
    """Submit a job: ``gpus`` GPUs for ``team`` at ``priority`` (None: the default class), of ``flavor``
    when asked by name."""

    name: str
    team: str
    gpus: int = 1
    priority: str | None = None
    flavor: str | None = None


@dataclass(frozen=True)
class Finish:
    """A running job ends."""

    name: str


@dataclass(frozen=True)
class Settle:
    """Passes until nothing changes; then ``running`` (names, or name -> flavor) run, and ``preempted`` (victim
    -> preemptor) are the victims of this settle."""

    running: set | dict
    preempted: dict = field(default_factory=dict)


@dataclass
class Outcome:
    admitted: dict[str, str | None]  # name -> flavor, admitted during the settle (a victim may come back)
    preempted: dict[str, str]  # victim -> preemptor
    running: dict[str, str | None]  # name -> flavor, after the settle


class ModelDisagrees(AssertionError):
    """Danlu's model decided otherwise than Kueue (and the fake Kueue) in a scenario step."""


def team(
    quota: int | dict,
    *,
    cohort: str | None = "lab",
    borrow: int | None = None,
    lend: int | None = None,
    within: str | None = None,
    reclaim: str | None = None,
) -> dict:
    """A danlu.yaml team: a quota of ``quota`` a100 GPUs (or flavor -> count); limits in a100 GPUs."""
    spec: dict = {"quota": {"gpus": quota if isinstance(quota, dict) else {"a100": quota}}}
    if cohort:
        spec["cohort"] = cohort
    if borrow is not None:
        spec["borrowing_limit"] = {"gpus": {"a100": borrow}}
    if lend is not None:
        spec["lending_limit"] = {"gpus": {"a100": lend}}
    policy = {k: v for k, v in (("within_team", within), ("reclaim", reclaim)) if v}
    if policy:
        spec["preemption"] = policy
    return spec


def danlu_yaml(teams: dict, declared: list[dict] | None = None) -> dict:
    return {**copy.deepcopy(BASE), "gpus": {"declared": declared or [A100]}, "teams": teams}


def load(config: dict) -> Settings:
    """danlu.yaml as ``danlu up`` takes it: valid by its schema, defaults filled in."""
    return Settings.from_data(config)


# --- the two sides --------------------------------------------------------------------------------------


class DanluSide:
    """Danlu's model, played as the jobs service plays it: every pass gets every queued job."""

    def __init__(self, config: Settings):
        self.config = config
        self.model = danlu_model(config)
        self.pending: dict[str, Workload] = {}
        self.running: dict[str, Workload] = {}
        self.jobs: dict[str, tuple[Job, float]] = {}

    def submit(self, job: Job, created: float) -> None:
        self.jobs[job.name] = (job, created)
        self.pending[job.name] = danlu_workload(self.config, job, created)

    def finish(self, name: str) -> None:
        del self.running[name]
        danlu_release(self.model, name)

    def settle(self, now: float, passes: int = 50) -> Outcome:
        admitted, preempted = {}, {}
        for _ in range(passes):
            now += 1.0
            started, victims = danlu_pass(self.model, list(self.pending.values()), now)
            for name, flavor in started.items():
                self.running[name] = self.pending.pop(name)
                admitted[name] = flavor
            for victim, preemptor in victims.items():  # the victim stops before the next pass, and queues again
                preempted[victim] = preemptor
                del self.running[victim]
                danlu_release(self.model, victim)
                job, created = self.jobs[victim]
                self.pending[victim] = danlu_workload(self.config, job, created)
            if not started and not victims:
                return Outcome(admitted, preempted, {n: wl.flavor for n, wl in self.running.items()})
        raise AssertionError(f"the model did not settle in {passes} passes")


class KueueSide:
    """The fake cluster's Kueue, on the objects ``danlu kueue render`` writes and the Kubernetes backend's TrainJobs."""

    def __init__(self, config: Settings):
        self.config = config
        self.store = Store()
        self.store.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        for obj in kueue.render(config, gpus.inventory(config.gpus), namespace=NS):
            assert errors(obj) == [], (obj, errors(obj))
            self.store.create(obj)
        self.kueue = Kueue(self.store)
        self.node_labels = {g.get("flavor", "gpu"): g.get("node_labels") for g in config.gpus.declared or []}
        self.names: dict[str, str] = {}  # TrainJob uid -> job name
        self.created = 0.0

    def submit(self, job: Job, created: float) -> None:
        """The Kubernetes backend's TrainJob for the job. Its age is the order the store created it in, which is
        the order of ``created``."""
        assert created > self.created
        self.created = created
        trainjob = self.store.create(
            jobs.trainjob(
                job_id=job.name,
                attempt=1,
                owner="alice",
                queue=job.team,
                priority_class=danlu_priority(self.config, job.priority)[0],
                namespace=NS,
                image="registry.example/x:1",
                nproc=1,
                api_url="http://127.0.0.1:1/api/v1",
                gpus=job.gpus,
                cpu=1.0,
                node_labels=self.node_labels.get(job.flavor) if job.flavor else None,
            )
        )
        self.names[trainjob["metadata"]["uid"]] = job.name

    def _workloads(self) -> dict[str, dict]:
        """Job name -> its Workload."""
        return {self.names[w["metadata"]["ownerReferences"][0]["uid"]]: w for w in self.store.list("Workload", NS)}

    def _running(self) -> dict[str, str | None]:
        out = {}
        for name, wl in self._workloads().items():
            admission = (wl.get("status") or {}).get("admission")
            if admission and not is_true(wl, "Finished"):
                out[name] = admission["podSetAssignments"][0]["flavors"].get("nvidia.com/gpu")
        return out

    def finish(self, name: str) -> None:
        wl = self._workloads()[name]
        self.store.mutate(
            "Workload",
            NS,
            wl["metadata"]["name"],
            lambda w: set_condition(w, "Finished", True, "Succeeded", "Job finished successfully"),
        )

    def settle(self, now: float, reconciles: int = 50) -> Outcome:
        """Reconciles until one changes no admission (the fake keeps no clock: ``now`` is the model's)."""
        admitted, preempted = {}, {}
        for _ in range(reconciles):
            before = self._running()
            self.kueue.reconcile()
            after = self._running()
            for name in after.keys() - before.keys():
                admitted[name] = after[name]
            workloads = self._workloads()
            names = {w["metadata"]["uid"]: n for n, w in workloads.items()}
            for name in before.keys() - after.keys():
                message = condition(workloads[name], "Preempted")["message"]
                preempted[name] = names[re.search(r"\(UID: ([^,]+),", message).group(1)]
            if before == after:
                return Outcome(admitted, preempted, after)
        raise AssertionError(f"the fake Kueue did not settle in {reconciles} reconciles")


# --- the scenarios --------------------------------------------------------------------------------------

TWO = {"vision": team(2), "nlp": team(2)}  # a cohort of two teams, 2 a100 each, nothing else set
FLAVORS = [
    {"count": 2, "flavor": "a100", "node_labels": {"nvidia.com/gpu.product": "NVIDIA-A100"}},
    {"count": 2, "flavor": "h100", "node_labels": {"nvidia.com/gpu.product": "NVIDIA-H100"}},
]

SCENARIOS = [
    pytest.param(
        danlu_yaml({"vision": team(2, cohort=None), "nlp": team(2, cohort=None)}),
        [
            Job("v1", "vision"),
            Job("v2", "vision"),
            Job("v3", "vision"),
            Settle({"v1", "v2"}),  # v3 waits: the team's nominal quota is full, and it is in no cohort
            Job("v4", "vision", gpus=3),  # more than the team could ever have: it waits for ever
            Finish("v1"),
            Settle({"v2", "v3"}),
        ],
        id="nominal-quota-fits-then-waits",
    ),
    pytest.param(
        danlu_yaml({"vision": team({"h100": 1, "a100": 2}, cohort=None)}, FLAVORS),
        [
            Job("v1", "vision"),
            Settle({"v1": "h100"}),  # the team's own flavors first, in danlu.yaml order
            Job("v2", "vision"),
            Settle({"v1": "h100", "v2": "a100"}),  # then the next one with room
            Job("v3", "vision", gpus=2),  # fits no flavor now; it does not block the next one (BestEffortFIFO)
            Job("v4", "vision", flavor="a100"),
            Settle({"v1": "h100", "v2": "a100", "v4": "a100"}),
            Job("v5", "vision", flavor="h100"),
            Settle({"v1": "h100", "v2": "a100", "v4": "a100"}),
            Finish("v1"),
            Settle({"v2": "a100", "v4": "a100", "v5": "h100"}),  # v3 still fits no flavor
            Finish("v2"),
            Finish("v4"),
            Settle({"v3": "a100", "v5": "h100"}),
        ],
        id="gpu-flavors-in-order-and-by-name",
    ),
    pytest.param(
        danlu_yaml(
            {"vision": team({"a100": 1}), "nlp": team({"h100": 1})},
            [{**FLAVORS[0], "count": 1}, {**FLAVORS[1], "count": 1}],
        ),
        [
            Job("v1", "vision"),
            Settle({"v1": "a100"}),
            Job("v2", "vision"),
            Settle({"v1": "a100", "v2": "h100"}),  # borrows nlp's h100
            Job("n1", "nlp"),
            Settle({"v1": "a100", "n1": "h100"}, preempted={"v2": "n1"}),
        ],
        id="gpu-flavors-in-a-cohort",
    ),
    pytest.param(
        danlu_yaml(TWO),
        [
            Job("v1", "vision", gpus=3),
            Settle({"v1"}),  # borrows one of nlp's
            Job("v2", "vision", gpus=2),
            Settle({"v1"}),  # 5 of 4
            Job("n1", "nlp"),
            Settle({"v1", "n1"}),  # nlp gets what it did not lend, without preempting
        ],
        id="cohort-borrowing",
    ),
    pytest.param(
        danlu_yaml({"vision": team(2, borrow=1), "nlp": team(2)}),
        [
            Job("v1", "vision", gpus=3),
            Settle({"v1"}),
            Job("v2", "vision"),
            Job("v3", "vision", gpus=4),  # beyond the borrowing limit; v3 for ever
            Job("n1", "nlp"),
            Settle({"v1", "n1"}),
        ],
        id="borrowing-limit",
    ),
    pytest.param(
        danlu_yaml({"vision": team(2), "nlp": team(2, lend=1)}),
        [
            Job("v1", "vision", gpus=3),
            Settle({"v1"}),  # nlp lends only one
            Job("v2", "vision"),
            Job("v3", "vision", gpus=4),
            Job("n1", "nlp"),  # nlp keeps one for itself
            Settle({"v1", "n1"}),
            Finish("n1"),
            Settle({"v1"}),  # what nlp keeps is not lent
        ],
        id="lending-limit",
    ),
    pytest.param(
        danlu_yaml(TWO),
        [
            Job("v1", "vision", gpus=2),
            Settle({"v1"}),
            Job("v2", "vision", gpus=2, priority="high"),
            Settle({"v1", "v2"}),  # borrows nlp's two
            # nlp reclaims (reclaim: any, whatever the priority): vision's lowest priority goes first while vision
            # still borrows, and v1 is enough
            Job("n1", "nlp", priority="low"),
            Settle({"v2", "n1"}, preempted={"v1": "n1"}),
            Finish("n1"),
            Settle({"v2", "v1"}),
        ],
        id="reclaim-any",
    ),
    pytest.param(
        danlu_yaml({"vision": team(2), "nlp": team(2, reclaim="lower_priority")}),
        [
            Job("v1", "vision", gpus=2, priority="high"),
            Settle({"v1"}),
            Job("v2", "vision", gpus=2, priority="low"),
            Settle({"v1", "v2"}),
            Job("n1", "nlp"),  # normal: may reclaim from the low borrower only
            Settle({"v1", "n1"}, preempted={"v2": "n1"}),
        ],
        id="reclaim-lower-priority-takes-a-low-borrower",
    ),
    pytest.param(
        danlu_yaml({"vision": team(2), "nlp": team(2, reclaim="lower_priority")}),
        [
            Job("v1", "vision", gpus=2, priority="high"),
            Settle({"v1"}),
            Job("v2", "vision", gpus=2, priority="high"),
            Settle({"v1", "v2"}),
            Job("n1", "nlp"),
            Settle({"v1", "v2"}),  # nothing of lower priority to reclaim from
            Finish("v2"),
            Settle({"v1", "n1"}),
        ],
        id="reclaim-lower-priority-spares-higher-borrowers",
    ),
    pytest.param(
        danlu_yaml({"vision": team(2), "nlp": team(2, reclaim="never")}),
        [
            Job("v1", "vision", gpus=2),
            Job("v2", "vision", gpus=2, priority="low"),
            Settle({"v1", "v2"}),
            Job("n1", "nlp", priority="high"),
            Settle({"v1", "v2"}),
            Finish("v2"),
            Settle({"v1", "n1"}),
        ],
        id="reclaim-never",
    ),
    pytest.param(
        danlu_yaml({"vision": team(2, within="never"), "nlp": team(2)}),
        [
            Job("v1", "vision"),
            Settle({"v1"}),
            Job("n1", "nlp"),
            Settle({"v1", "n1"}),
            Job("n2", "nlp"),
            Settle({"v1", "n1", "n2"}),
            Job("n3", "nlp"),
            Settle({"v1", "n1", "n2", "n3"}),  # nlp borrows vision's second
            # vision would borrow with v2 (1 + 2 > 2) and may preempt none of its own: it reclaims nothing
            Job("v2", "vision", gpus=2, priority="high"),
            Settle({"v1", "n1", "n2", "n3"}),
        ],
        id="a-team-that-would-borrow-reclaims-nothing",
    ),
    pytest.param(
        danlu_yaml({"vision": team(2, cohort=None)}),
        [
            Job("v1", "vision", gpus=2, priority="low"),
            Settle({"v1"}),
            Job("v2", "vision", gpus=2),
            Settle({"v2"}, preempted={"v1": "v2"}),
            Job("v3", "vision", gpus=2),
            Settle({"v2"}),  # the same priority: no preemption
            Finish("v2"),
            Settle({"v3"}),  # v1 is older, but v3 has the higher priority
        ],
        id="within-team-lower-priority",
    ),
    pytest.param(
        danlu_yaml({"vision": team(2, cohort=None, within="never")}),
        [
            Job("v1", "vision", gpus=2, priority="low"),
            Settle({"v1"}),
            Job("v2", "vision", gpus=2, priority="high"),
            Settle({"v1"}),
            Finish("v1"),
            Settle({"v2"}),
        ],
        id="within-team-never",
    ),
    pytest.param(
        danlu_yaml(TWO),
        [
            Job("v1", "vision", gpus=3, priority="low"),
            Settle({"v1"}),
            # within its nominal quota: it preempts its team's lower priority and then borrows
            Job("v2", "vision", gpus=2, priority="high"),
            Settle({"v2"}, preempted={"v1": "v2"}),
        ],
        id="within-team-in-a-cohort",
    ),
    pytest.param(
        danlu_yaml({"vision": team(4, cohort=None)}),
        [
            Job("a", "vision", priority="low"),
            Settle({"a"}),
            Job("b", "vision", priority="low"),
            Settle({"a", "b"}),
            Job("c", "vision"),
            Settle({"a", "b", "c"}),
            Job("d", "vision"),
            Settle({"a", "b", "c", "d"}),
            # lowest priority first, and of those the most recently admitted: b, then a
            Job("e", "vision", gpus=2, priority="high"),
            Settle({"c", "d", "e"}, preempted={"b": "e", "a": "e"}),
            Job("f", "vision", priority="high"),
            Settle({"c", "e", "f"}, preempted={"d": "f"}),
        ],
        id="victims-lowest-priority-newest-first",
    ),
    pytest.param(
        danlu_yaml({"vision": team(4, cohort=None)}),
        [
            Job("a", "vision", gpus=2, priority="low"),
            Settle({"a"}),
            Job("b", "vision", priority="low"),
            Settle({"a", "b"}),
            Job("c", "vision"),
            Settle({"a", "b", "c"}),
            # b goes first, then a; once a is out b is not needed: it is put back
            Job("e", "vision", gpus=2, priority="high"),
            Settle({"b", "c", "e"}, preempted={"a": "e"}),
        ],
        id="victims-are-minimal",
    ),
    pytest.param(
        danlu_yaml({"vision": team(2, cohort=None, within="never")}),
        [
            Job("r", "vision", gpus=2),
            Settle({"r"}),
            Job("p1", "vision", priority="low"),
            Job("p2", "vision", priority="high"),
            Job("p3", "vision", priority="high"),
            Job("p4", "vision"),
            Finish("r"),
            Settle({"p2", "p3"}),  # priority first, then age
            Finish("p2"),
            Settle({"p3", "p4"}),
            Finish("p3"),
            Settle({"p4", "p1"}),
        ],
        id="order-priority-then-age",
    ),
    pytest.param(
        danlu_yaml(
            {"vision": team(2, within="never", reclaim="never"), "nlp": team(2, within="never", reclaim="never")}
        ),
        [
            Job("v0", "vision", gpus=2),
            Job("n0", "nlp"),
            Settle({"v0", "n0"}),
            # one GPU left, nlp's: vision's high job would borrow it, nlp's low one fits nlp's nominal quota
            Job("v1", "vision", priority="high"),
            Job("n1", "nlp", priority="low"),
            Settle({"v0", "n0", "n1"}),
        ],
        id="order-within-nominal-before-borrowing",
    ),
    pytest.param(
        danlu_yaml({"vision": team(2, within="never"), "nlp": team(2, reclaim="never")}),
        [
            Job("v0", "vision"),
            Job("n0", "nlp"),
            Settle({"v0", "n0"}),
            # two GPUs left: one of vision's, one nlp lends. Kueue's queue is ordered by priority, then age; only
            # across ClusterQueues does a head within its nominal quota go before one that borrows
            Job("v1", "vision", priority="low"),
            Job("v2", "vision", gpus=2, priority="high"),
            Settle({"v0", "n0", "v2"}),
        ],
        id="order-within-a-team-priority-before-nominal",
        marks=pytest.mark.xfail(
            strict=True,
            raises=ModelDisagrees,
            reason=(
                "the model considers a team's workloads that fit its nominal quota before its workloads that would "
                "borrow, whatever their priority; Kueue orders a ClusterQueue by priority then creation "
                "(pkg/cache/queue/cluster_queue.go baseCompareFunc), takes one head per ClusterQueue per cycle, and "
                "applies 'under nominal quota first' only between the heads (pkg/scheduler/scheduler.go "
                "makeClassicalIterator): it admits the high job v2, the model the low job v1"
            ),
        ),
    ),
    pytest.param(
        danlu_yaml(
            {"vision": team(2, within="never"), "nlp": team(2, within="never"), "ops": team(2)}, [{**A100, "count": 6}]
        ),
        [
            Job("v0", "vision", gpus=2),
            Job("n0", "nlp", gpus=2),
            Settle({"v0", "n0"}),
            # ops lends two; vision's two high jobs and nlp's normal one would all borrow
            Job("v1", "vision", priority="high"),
            Job("v2", "vision", priority="high"),
            Job("n1", "nlp"),
            Settle({"v0", "n0", "v1", "n1"}),
        ],
        id="order-one-head-per-team-per-cycle",
        marks=pytest.mark.xfail(
            strict=True,
            raises=ModelDisagrees,
            reason=(
                "the model sorts all pending workloads of a cohort by priority and age, so vision's second high job "
                "goes before nlp's normal one; Kueue's scheduling cycle takes one head per ClusterQueue "
                "(pkg/scheduler/scheduler.go schedule: queues.Heads, nominate), so nlp's head is admitted in the same "
                "cycle as vision's first and vision's second finds the cohort full"
            ),
        ),
    ),
    pytest.param(
        danlu_yaml(TWO),
        [
            Job("v1", "vision", gpus=3, priority="low"),
            Settle({"v1"}),  # borrows one
            # more than vision's nominal quota: without borrowWithinCohort, which Danlu never renders, Kueue lets
            # it preempt no one
            Job("v2", "vision", gpus=3, priority="high"),
            Settle({"v1"}),
        ],
        id="more-than-nominal-preempts-nothing",
        marks=pytest.mark.xfail(
            strict=True,
            raises=ModelDisagrees,
            reason=(
                "the model lets a workload that asks for more than its team's nominal quota preempt its team's lower "
                "priorities and borrow; Kueue's flavor assigner considers preemption only when the request fits the "
                "flavor's nominal quota or borrowWithinCohort is set (pkg/scheduler/flavorassigner/flavorassigner.go "
                "fitsResourceQuota; docs/concepts/preemption.md 'Classic Preemption'), so v2 waits"
            ),
        ),
    ),
    pytest.param(
        danlu_yaml(TWO),
        [
            Job("v1", "vision", priority="low"),
            Settle({"v1"}),
            Job("n1", "nlp"),
            Settle({"v1", "n1"}),
            Job("n2", "nlp"),
            Settle({"v1", "n1", "n2"}),
            Job("n3", "nlp"),
            Settle({"v1", "n1", "n2", "n3"}),  # nlp borrows vision's second
            # vision is under its nominal quota but would borrow with v2 (1 + 2 > 2): Kueue reclaims nlp's borrowed
            # GPU and preempts vision's own low job together, so that v2 fits without borrowing
            Job("v2", "vision", gpus=2, priority="high"),
            Settle({"n1", "n2", "v2"}, preempted={"n3": "v2", "v1": "v2"}),
        ],
        id="reclaim-with-own-lower-priority",
        marks=pytest.mark.xfail(
            strict=True,
            raises=ModelDisagrees,
            reason=(
                "the model reclaims from borrowers only for a workload that fits its team's nominal quota with what "
                "the team uses now, and otherwise looks only at its own team's lower priorities; Kueue, when the "
                "queue is under its nominal quota, also tries borrowers and its own lower priorities together "
                "without borrowing (pkg/scheduler/preemption/preemption.go classicalPreemptions, attempt "
                "borrowing=false; classical/hierarchical_preemption.go ReclaimWithoutBorrowing; docs 'Classic "
                "Preemption' heuristic 3): it preempts n3 and v1, the model nothing"
            ),
        ),
    ),
    pytest.param(
        danlu_yaml(
            {"vision": team({"a100": 1, "h100": 1}), "nlp": team({"a100": 1})},
            [{**FLAVORS[0], "count": 2}, {**FLAVORS[1], "count": 1}],
        ),
        [
            Job("n1", "nlp"),
            Settle({"n1": "a100"}),
            Job("n2", "nlp"),
            Settle({"n1": "a100", "n2": "a100"}),  # borrows vision's a100
            Job("n3", "nlp"),
            Settle({"n1": "a100", "n2": "a100", "n3": "h100"}),  # and its h100
            # Kueue picks the flavor first (the first that preemption frees, in the team's order), then the victims
            # on it: vision reclaims its a100 from n2, although n3 was admitted more recently
            Job("v1", "vision"),
            Settle({"n1": "a100", "n3": "h100", "v1": "a100"}, preempted={"n2": "v1"}),
        ],
        id="preemption-picks-the-flavor-first",
        marks=pytest.mark.xfail(
            strict=True,
            raises=ModelDisagrees,
            reason=(
                "the model orders the candidates on every flavor the workload may use together (lowest priority, "
                "most recently admitted) and takes the first that make it fit on any flavor; Kueue's flavor assigner "
                "picks one flavor first (whenCanPreempt: TryNextFlavor keeps the best preemption mode: reclaim over "
                "priority preemption, then the least borrowing, then the first flavor; pkg/scheduler/flavorassigner/"
                "flavorassigner.go findFlavorForPodSets, isPreferred) and preempts only workloads using that flavor "
                "(frsNeedPreemption, classical/hierarchical_preemption.go WorkloadUsesResources): Kueue preempts n2 "
                "and runs v1 on a100, the model preempts n3 and runs v1 on h100; within a team alike"
            ),
        ),
    ),
    pytest.param(
        danlu_yaml({"vision": team(2), "nlp": team(1), "ops": team(1, reclaim="never")}),
        [
            Job("n1", "nlp", priority="low"),
            Settle({"n1"}),
            Job("n2", "nlp", priority="low"),
            Settle({"n1", "n2"}),
            Job("n3", "nlp", priority="low"),
            Settle({"n1", "n2", "n3"}),
            Job("n4", "nlp", priority="low"),
            Settle({"n1", "n2", "n3", "n4"}),  # nlp borrows three: the cohort is full
            Job("o1", "ops", priority="low"),
            Settle({"n1", "n2", "n3", "n4"}),  # ops may not reclaim
            # n5 preempts n4 and would then borrow; o1, within its nominal quota, goes before it and takes the GPU
            # n4 gave back, so n5 preempts again
            Job("n5", "nlp", priority="high"),
            Settle({"n1", "n2", "o1", "n5"}, preempted={"n4": "n5", "n3": "n5"}),
        ],
        id="a-preemptor-waits-its-turn",
        marks=pytest.mark.xfail(
            strict=True,
            raises=ModelDisagrees,
            reason=(
                "the model considers a workload that preempted before every other in the next passes, whether or not "
                "it borrows; Kueue v0.19 does so only with the PrioritizePreemptorWorkloads feature gate (alpha, off "
                "by default, pkg/features/kube_features.go): otherwise the preemptor is its ClusterQueue's head and "
                "the heads are ordered within nominal quota first (pkg/scheduler/scheduler.go makeClassicalIterator), "
                "so ops's o1 takes the GPU n4 gave back and n5 preempts n3 as well; the model runs n5 and keeps o1 "
                "waiting"
            ),
        ),
    ),
]


def unexpected(step: Settle, outcome: Outcome) -> str | None:
    """What in ``outcome`` is not what the scenario says Kueue does, in words; None if all is."""
    running = outcome.running if isinstance(step.running, dict) else set(outcome.running)
    if running != step.running:
        return f"runs {outcome.running}"
    if outcome.preempted != step.preempted:
        return f"preempted {outcome.preempted}"
    return None


def play(config: dict, steps: list) -> None:
    """Both sides play the steps; after each settle, each must do what the scenario says and both alike."""
    settings_ = load(config)
    danlu, fake = DanluSide(settings_), KueueSide(settings_)
    now = 1_000_000.0
    for index, step in enumerate(steps):
        now += 100.0
        if isinstance(step, Job):
            danlu.submit(step, now)
            fake.submit(step, now)
        elif isinstance(step, Finish):
            danlu.finish(step.name)
            fake.finish(step.name)
        else:
            theirs, ours = fake.settle(now), danlu.settle(now)
            where = f"step {index} ({step})"
            wrong = unexpected(step, theirs)
            assert wrong is None, f"{where}: the fake Kueue {wrong}"  # the fake plays Kueue: it must be right
            wrong = unexpected(step, ours)
            if wrong is not None:
                raise ModelDisagrees(f"{where}: the model {wrong}")
            if ours != theirs:
                raise ModelDisagrees(f"{where}: the model decided {ours}, the fake Kueue {theirs}")


@pytest.mark.parametrize(("config", "steps"), SCENARIOS)
def test_scenario(config, steps):
    play(config, steps)


# --- random scenarios -----------------------------------------------------------------------------------


@st.composite
def random_scenarios(draw):
    """2-3 teams in a cohort (or in none) with random quotas, limits and policies, and 1-14 events. Either one
    flavor, a100, with every policy, or two, a100 and h100, in random order of the teams' own, with no
    preemption (see :func:`test_random_scenarios_agree`). Each team's jobs ask for the same number of GPUs."""
    cohort = draw(st.sampled_from(["lab", None]))
    two_flavors = draw(st.booleans())
    teams, sizes = {}, {}
    for name in ("vision", "nlp", "ops")[: draw(st.integers(2, 3))]:
        if two_flavors:
            quota = {f: draw(st.integers(0, 2)) for f in draw(st.permutations(["a100", "h100"]))}
            quota = {f: n for f, n in quota.items() if n} or {"a100": 1}
            teams[name] = team(quota, cohort=cohort, within="never", reclaim="never")
            sizes[name] = 1
            continue
        nominal = draw(st.integers(1, 3))
        sizes[name] = draw(st.sampled_from([d for d in (1, 2, 3) if nominal % d == 0]))
        teams[name] = team(
            nominal,
            cohort=cohort,
            borrow=draw(st.none() | st.integers(0, 3)) if cohort else None,
            lend=draw(st.none() | st.integers(0, nominal)) if cohort else None,
            within=draw(st.sampled_from([None, "never"])),
            reclaim=draw(st.sampled_from([None, None, "lower_priority", "never"])) if cohort else None,
        )
    declared = []
    for flavor in ("a100", "h100"):
        count = sum(spec["quota"]["gpus"].get(flavor, 0) for spec in teams.values())
        if count:
            declared.append({"count": count, "flavor": flavor, "node_labels": {"nvidia.com/gpu.product": flavor}})
    events = draw(
        st.lists(
            st.tuples(
                st.sampled_from([True, True, False]),
                st.sampled_from(sorted(teams)),
                st.sampled_from(["low", "normal", "high"]),
                st.integers(0, 9),
            ),
            min_size=1,
            max_size=14,
        )
    )
    return danlu_yaml(teams, declared), sizes, events


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_scenarios())
def test_random_scenarios_agree(scenario):
    """Random scenarios, each event followed by a settle: both sides decide alike. They keep clear of the known
    differences (the expected failures above): a team's jobs all ask for the same number of GPUs, a divisor of
    its nominal quota (so none asks for more than the nominal quota, a team's waiting jobs would all borrow or
    none would, and a team under its nominal quota has room for one more job without borrowing); with two
    flavors nothing preempts; and a scenario ends before a settle where two teams have jobs waiting and one of
    them several (Kueue takes one head per ClusterQueue per cycle), or where a job waits although its team
    is under its nominal quota (it could not reclaim: Kueue then lets it go before a borrowing preemptor)."""
    config, sizes, events = scenario
    settings_ = load(config)
    danlu, fake = DanluSide(settings_), KueueSide(settings_)
    nominal = {name: sum(spec["quota"]["gpus"].values()) for name, spec in config["teams"].items()}
    now, serial = 1_000_000.0, 0
    for submit, name, priority, pick in events:
        used = dict.fromkeys(nominal, 0)
        for wl in danlu.running.values():
            used[wl.team] += wl.request.gpus
        if any(used[wl.team] + sizes[wl.team] <= nominal[wl.team] for wl in danlu.pending.values()):
            return
        now += 100.0
        if submit:
            serial += 1
            job = Job(f"j{serial}", name, sizes[name], priority)
            danlu.submit(job, now)
            fake.submit(job, now)
        elif danlu.running:
            ended = sorted(danlu.running)[pick % len(danlu.running)]
            danlu.finish(ended)
            fake.finish(ended)
        else:
            continue
        waiting = [wl.team for wl in danlu.pending.values()]
        if len(set(waiting)) > 1 and len(waiting) > len(set(waiting)):
            return
        theirs = fake.settle(now)
        ours = danlu.settle(now)
        assert ours == theirs, f"after {events}: the model decided {ours}, Kueue {theirs}"
