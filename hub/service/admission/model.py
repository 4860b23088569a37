"""Admission with Kueue's semantics, in memory: quotas, cohorts, borrowing, priorities, preemption.

The model mirrors Kueue so that one ``danlu.yaml`` means the same thing on one
machine and on a cluster (where it renders to Kueue objects):

* a **team** is a ClusterQueue: a *nominal quota* per resource (``gpu/<flavor>``,
  ``cpu``, ``memory``), optionally in a **cohort** whose members lend each other
  unused nominal quota, within each team's *borrowing limit* and *lending limit*;
* a **workload** (a job, or a notebook server holding GPUs) is admitted only when
  everything it asks for fits -- its team's nominal quota plus what it may borrow,
  and the free devices of one GPU flavor -- all or nothing;
* pending workloads that fit in their team's nominal quota are considered before
  those that would borrow (as Kueue does), then by priority (WorkloadPriorityClass
  values), then age, best-effort FIFO: a workload that does not fit does not block
  smaller ones behind it, unless it has waited longer than ``starvation_seconds``,
  after which what it needs is held back for it from its team's workloads of the
  same or lower priority;
* a workload that does not fit may **preempt**: lower-priority workloads of its
  own team (``within_team: lower_priority``), or, when it fits in its team's
  nominal quota, workloads of teams that are borrowing in the cohort
  (``reclaim: any | lower_priority``). As in Kueue's classic preemption, the
  borrowers' workloads are taken first, then its own team's, each group lowest
  priority and newest first; a borrower's workload only while that team still
  uses more than its nominal quota of what is reclaimed, and the preemptor must
  then fit within its own nominal quota; failing that, it may take its own
  team's lower priorities and borrow. A workload is never preempted in the pass
  that admitted it, and a preemptor counts only its own victims as freed, so
  preemption settles when no job ends. A preemptor goes first in the next passes
  and holds back what it needs from its team's lower priorities and from its
  cohort's borrowers until it starts; if, once its victims have stopped, it still
  does not fit and finds nothing more to preempt, its preemption is over and it
  waits like any other workload (held back for good, what it needs could keep
  another team from starting for ever);
* as in Kueue's scheduler, a **cohort preempts for one workload per pass** (a team
  in no cohort counts as a cohort of its own): once a workload of the cohort has
  chosen victims, the cohort's other workloads that do not fit wait, with what they
  lack as their reason, and look for victims in a later pass, where the first of
  them in the order above goes first. (Kueue, in its classic mode, also stops a
  cohort's preemptions after an admission in it; Danlu does not, or a busy cohort
  would never preempt.) A cohort's preemptions thus take a pass each, which keeps a
  pass after many jobs ended from trying victims for every workload that does not fit;
* a workload that asks for more than the machine or its team could ever have
  (nominal quota plus borrowing limit, and what the cohort may lend) is told so
  at once and holds nothing back.

:class:`Model` is pure (no I/O, no clock), so the service, the benchmarks and
the property tests run the very same decisions. Devices are real indices: the
model never gives one device to two workloads.
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict

from danlu.hub.service.admission.backlog import Backlog
from danlu.hub.service.admission.preemption import Freed, Preemption
from danlu.hub.service.admission.workloads import (  # noqa: F401 - the model's vocabulary, re-exported
    _GROUPS,
    INF,
    SERVER_PRIORITY,
    Decision,
    Request,
    Team,
    Waiting,
    Workload,
    _by_age,
    gib,
    gpu_key,
)


class Rooms(dict):
    """resource -> what a team's quota and cohort still let it use (:meth:`Model.limit`; the machine's free
    capacity aside, which changes with every admission), each worked out when first read."""

    __slots__ = ("model", "team", "freed")

    def __init__(self, model: Model, team: Team, freed: Freed | None = None):
        super().__init__()
        self.model, self.team, self.freed = model, team, freed

    def __missing__(self, resource: str) -> float:
        room = self[resource] = self.model.limit(self.team, resource, self.freed) if self.freed else \
            self.model._limit_now(self.team, resource)
        return room


class Ask:
    """What the model works out once about an *ask* (a team and a request, :attr:`Workload.ask`) and reads on
    every pass: the request's amounts, the GPU flavors it may use with their resource keys, why it can never
    start (None: it can), what it holds back while it starves, and what it waits for, in words."""

    __slots__ = ("name", "team", "cohort", "circle", "cpu", "memory", "gpus", "keys", "never", "needs", "what")

    def __init__(self, model: Model, wl: Workload):
        request, team = wl.request, model.teams.get(wl.team)
        self.name, self.team, self.cohort = wl.team, team, team.cohort if team else None
        self.circle = model._circles.get(wl.team)
        self.cpu, self.memory, self.gpus = request.cpu, request.memory, request.gpus
        self.keys = model._flavor_keys(team, request) if team is not None and request.gpus else []
        self.never = model.impossible(wl)
        self.needs = model._needs(wl) if team is not None else {}
        self.what: dict[str | None, str] = {}  # resource short -> what a workload of it waits for, in words


class Model(Preemption):
    """Quota accounting and admission decisions for every team."""

    def __init__(self, teams: list[Team], devices: dict[str, list[int]], cpu: float, memory: float = INF,
                 starvation_seconds: float = 600.0):
        self.teams = {t.name: t for t in teams}
        self.devices = {flavor: sorted(ids) for flavor, ids in devices.items()}
        self.capacity = {gpu_key(f): float(len(ids)) for f, ids in self.devices.items()}
        self.capacity.update(cpu=float(cpu), memory=float(memory))
        self.starvation_seconds = starvation_seconds
        self.cohorts: dict[str, list[str]] = defaultdict(list)
        for team in teams:
            if team.cohort:
                self.cohorts[team.cohort].append(team.name)
        # caches: what is available is recomputed only after an admission or a release (``_version``)
        self._version = 0
        self._changes: dict[str, int] = defaultdict(int)  # per cohort (or lone team): its admissions, releases, victims
        self._running_changes: dict[str, int] = defaultdict(int)  # per team: its running jobs came or went
        self._cache: dict[tuple, tuple[int, object]] = {}
        self._rooms_of: dict[str, tuple[int, Rooms]] = {}  # team -> its cohort's changes, and its Rooms then
        self._never: dict[int, str | None] = {}  # ask -> why it can never start (None: it can)
        self._static: dict[tuple, object] = {}  # what depends on the configuration only (ceilings, needs)
        self._worded: dict[tuple, str] = {}  # where a team stands, in words, by the figures they show
        self._asks: dict[int, Ask] = {}  # ask -> what is worked out once about it
        self.admitted: dict[str, Workload] = {}
        self._running: dict[str, dict[str, Workload]] = defaultdict(dict)  # admitted jobs not stopping, by team
        # what those jobs hold, by team, priority and resource: a bound on what preemption could free
        self._running_use: dict[str, dict[int, dict[str, float]]] = defaultdict(
            lambda: defaultdict(lambda: defaultdict(float)))
        self.used: dict[str, dict[str, float]] = {name: defaultdict(float) for name in self.teams}
        self.total_used: dict[str, float] = defaultdict(float)
        # per cohort and quoted resource: the members' unused nominal quota (``_pool``) and what those with a
        # lending limit keep for themselves (``_kept``), kept up to date so that what a team may borrow is O(1)
        self._pool: dict[str, dict[str, float]] = {c: defaultdict(float) for c in self.cohorts}
        self._kept: dict[str, dict[str, float]] = {c: defaultdict(float) for c in self.cohorts}
        for team in teams:
            if team.cohort:
                for resource in set(self.capacity) | set(team.nominal):
                    if self._quoted(team, resource):
                        self._pool[team.cohort][resource] += team.nominal.get(resource, 0.0)
                        self._kept[team.cohort][resource] += self._keeps(team, resource, 0.0)
        self.free_devices: dict[str, list[int]] = {f: list(ids) for f, ids in self.devices.items()}
        self.nominated: set[str] = set()  # pending workloads that preempted: first in line for what frees up
        self._backlog = Backlog()
        self._pass = 0
        self._reclaiming: dict[str, dict[str, dict[str, float]]] = {}  # in a pass: see cycle()
        # who shares one preemption per pass: a team's cohort, or the team itself when it is in none
        self._circles = {t.name: ("cohort", t.cohort) if t.cohort else ("team", t.name) for t in teams}
        self._preempted_in: set[tuple[str, str]] = set()  # in a pass: the circles that preempted
        self._held_for_others = False

    def __deepcopy__(self, memo) -> Model:
        """A copy that decides as this model does (a dry run, an estimate), without its caches."""
        import copy

        clone = object.__new__(Model)
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            setattr(clone, name, {} if name in ("_cache", "_rooms_of") else copy.deepcopy(value, memo))
        return clone

    # accounting ----------------------------------------------------------------------
    @staticmethod
    def _keeps(team: Team, resource: str, used: float) -> float:
        """What a cohort member keeps for itself of a resource (unused quota above its lending limit)."""
        if resource not in team.lending_limit:
            return 0.0
        return max(0.0, team.nominal.get(resource, 0.0) - team.lending_limit[resource] - max(0.0, used))

    def _account(self, wl: Workload, sign: float) -> None:
        self._version += 1
        team = self.teams.get(wl.team)
        self._changes[team.cohort or team.name if team else wl.team] += 1
        used = self.used[wl.team]
        for resource, amount in wl.usage().items():
            before = used[resource]
            used[resource] = before + sign * amount
            self.total_used[resource] += sign * amount
            if team is not None and team.cohort and self._quoted(team, resource):
                self._pool[team.cohort][resource] -= sign * amount
                if resource in team.lending_limit:
                    self._kept[team.cohort][resource] += (self._keeps(team, resource, used[resource])
                                                          - self._keeps(team, resource, before))

    def _take(self, wl: Workload) -> None:
        self._account(wl, 1.0)
        if wl.kind == "job" and not wl.stopping:
            self._run(wl, 1.0)
        free = self.free_devices.get(wl.flavor, [])
        for device in wl.devices:
            free.remove(device)
        self.admitted[wl.id] = wl

    def _give_back(self, wl: Workload) -> None:
        self._account(wl, -1.0)
        self._run(wl, -1.0)
        for device in wl.devices:
            bisect.insort(self.free_devices[wl.flavor], device)
        del self.admitted[wl.id]

    def _run(self, wl: Workload, sign: float) -> None:
        """A job starts (1) or stops (-1) being one preemption may choose."""
        running = self._running[wl.team]
        if sign > 0:
            running[wl.id] = wl
        elif running.pop(wl.id, None) is None:
            return
        self._running_changes[wl.team] += 1
        use = self._running_use[wl.team][wl.priority]
        for resource, amount in wl.usage().items():
            use[resource] += sign * amount

    def restore(self, wl: Workload) -> None:
        """Account for a workload admitted earlier (at start-up, from the database)."""
        if wl.request.gpus and (wl.flavor is None or len(wl.devices) != wl.request.gpus):
            raise ValueError(f"workload {wl.id} holds no devices for its {wl.request.gpus} GPUs")
        self._take(wl)

    def release(self, workload_id: str) -> Workload | None:
        """A workload ended (or its preemption completed): its quota and devices are free."""
        wl = self.admitted.get(workload_id)
        if wl is not None:
            self._give_back(wl)
        return wl

    # capacity ------------------------------------------------------------------------
    # ``freed``: what stopping some admitted workloads would give back (a preemption being tried), or None
    def _used(self, team: str, resource: str, freed: Freed | None = None) -> float:
        used = self.used[team][resource]
        return used - freed.of(team, resource) if freed else used

    def _free(self, resource: str, freed: Freed | None = None) -> float:
        free = self.capacity.get(resource, 0.0) - self.total_used[resource]
        return free + freed.total.get(resource, 0.0) if freed else free

    @staticmethod
    def _quoted(team: Team, resource: str) -> bool:
        """GPUs always have a quota (0 unless given); CPU and memory only when the team sets one."""
        return resource.startswith("gpu/") or resource in team.nominal

    def _cohort_room(self, team: Team, resource: str, freed: Freed | None = None) -> float:
        """What the cohort still has for ``team``: all nominal quota, minus all use, minus what
        other members keep for themselves (their unused quota above their lending limit)."""
        room = self._pool[team.cohort][resource] - self._kept[team.cohort][resource]
        if resource in team.lending_limit and self._quoted(team, resource):  # what it keeps is its own
            room += self._keeps(team, resource, self.used[team.name][resource])
        if freed:
            for name, amounts in freed.by_team.items():
                amount = amounts.get(resource, 0.0)
                member = self.teams.get(name)
                if not amount or member is None or member.cohort != team.cohort or \
                        not self._quoted(member, resource):
                    continue
                room += amount
                if name != team.name and resource in member.lending_limit:
                    used = self.used[name][resource]
                    room += self._keeps(member, resource, used) - self._keeps(member, resource, used - amount)
        return room

    def available(self, team: Team, resource: str, freed: Freed | None = None) -> float:
        """How much more of a resource the team may use now (nominal + borrowable - used, and free)."""
        return min(self.limit(team, resource, freed), self._free(resource, freed))

    def limit(self, team: Team, resource: str, freed: Freed | None = None) -> float:
        """How much more of a resource the team's quota and cohort let it use now (the machine aside): it
        changes only with what the team's cohort (or the team, alone) admits and releases."""
        if not self._quoted(team, resource):
            return INF
        nominal = team.nominal.get(resource, 0.0)
        used = self._used(team.name, resource, freed)
        if not team.cohort:
            return nominal - used
        ceiling = nominal + team.borrowing_limit.get(resource, INF) - used
        return min(ceiling, self._cohort_room(team, resource, freed))

    def _limit_now(self, team: Team, resource: str) -> float:
        """:meth:`limit` with nothing freed, in one step (what :class:`Rooms` reads on every pass)."""
        nominal = team.nominal
        if not (resource.startswith("gpu/") or resource in nominal):  # not quoted
            return INF
        used = self.used[team.name][resource]
        if not team.cohort:
            return nominal.get(resource, 0.0) - used
        cohort = team.cohort
        room = self._pool[cohort][resource] - self._kept[cohort][resource]
        if resource in team.lending_limit:  # what it keeps is its own
            room += self._keeps(team, resource, used)
        return min(nominal.get(resource, 0.0) + team.borrowing_limit.get(resource, INF) - used, room)

    def lendable(self, team: Team, resource: str) -> float:
        """What the team could borrow from its cohort right now."""
        if not team.cohort:
            return 0.0
        nominal = team.nominal.get(resource, 0.0)
        used = self.used[team.name][resource]
        borrow_room = team.borrowing_limit.get(resource, INF) - max(0.0, used - nominal)
        return max(0.0, min(borrow_room, self._cohort_room(team, resource) - max(0.0, nominal - used)))

    def _flavors(self, team: Team, request: Request) -> list[str]:
        if not request.gpus:
            return [None]
        key = ("flavors", team.name, request.gpu_flavor)
        order = self._static.get(key)
        if order is None:
            if request.gpu_flavor:
                order = [request.gpu_flavor] if request.gpu_flavor in self.devices else []
            else:
                order = [f for f in (list(team.flavors) or sorted(self.devices)) if f in self.devices]
            order = self._static[key] = order
        return order

    def fit(self, wl: Workload, freed: Freed | None = None, reserved: dict | None = None, rooms: Rooms | None = None):
        """The flavor a workload fits with now (None for CPU-only), or (False, the resource short).

        ``rooms``: what its team's quota and cohort let it use with ``freed`` given back, when the caller has it."""
        team = self.teams[wl.team]
        if rooms is None:
            rooms = self._rooms(team) if not freed else Rooms(self, team, freed)
        request = wl.request
        reserved = reserved or {}
        total, capacity = self.total_used, self.capacity
        given = freed.total if freed else {}
        for resource, amount in (("cpu", request.cpu), ("memory", request.memory)):
            if amount:
                free = capacity.get(resource, 0.0) - total[resource] + given.get(resource, 0.0)
                if amount > min(rooms[resource], free) - reserved.get(resource, 0.0) + 1e-9:
                    return False, resource
        if not request.gpus:
            return None, None
        why = None
        for flavor, key in self._flavor_keys(team, request):
            free = capacity[key] - total[key] + given.get(key, 0.0)
            if request.gpus <= min(rooms[key], free) - reserved.get(key, 0.0) + 1e-9:
                return flavor, None
            why = why or key
        return False, why or (gpu_key(request.gpu_flavor) if request.gpu_flavor else "gpu")

    def _rooms(self, team: Team) -> Rooms:
        """What the team's quota and cohort let it use now, remembered until its cohort changes."""
        changes = self._changes[team.cohort or team.name]
        hit = self._rooms_of.get(team.name)
        if hit is None or hit[0] != changes:
            hit = self._rooms_of[team.name] = (changes, Rooms(self, team))
        return hit[1]

    def rooms_with(self, team: Team, freed: Freed) -> Rooms:
        """What the team's quota and cohort would let it use with ``freed`` given back."""
        return Rooms(self, team, freed)

    def _flavor_keys(self, team: Team, request: Request) -> list[tuple[str, str]]:
        key = ("flavor keys", team.name, request.gpu_flavor)
        found = self._static.get(key)
        if found is None:
            found = self._static[key] = [(f, gpu_key(f)) for f in self._flavors(team, Request(gpus=1,
                                                                                          gpu_flavor=request.gpu_flavor))]
        return found

    def _cached(self, key: tuple, compute):
        """``compute()``, remembered until the next admission or release."""
        hit = self._cache.get(key)
        if hit is None or hit[0] != self._version:
            hit = self._cache[key] = (self._version, compute())
        return hit[1]

    def within_nominal(self, wl: Workload, flavor: str | None) -> bool:
        """Whether the workload fits in its team's own nominal quota (then it may reclaim lent quota)."""
        team = self.teams[wl.team]
        used, nominal, request = self.used[team.name], team.nominal, wl.request
        if request.gpus:
            key = gpu_key(flavor)
            if used[key] + request.gpus > nominal.get(key, 0.0) + 1e-9:
                return False
        for resource, amount in (("cpu", request.cpu), ("memory", request.memory)):
            if amount and resource in nominal and used[resource] + amount > nominal[resource] + 1e-9:
                return False
        return True

    def impossible(self, wl: Workload) -> str | None:
        """Why a workload can never be admitted (more than the machine or its team could ever have)."""
        ask = wl.ask
        if ask not in self._never:
            self._never[ask] = self._impossible(wl)
        return self._never[ask]

    def _impossible(self, wl: Workload) -> str | None:
        team = self.teams.get(wl.team)
        if team is None:
            return f"no team '{wl.team}'"
        flavors = self._flavors(team, wl.request)
        if wl.request.gpus and not flavors:
            return f"no GPUs of flavor '{wl.request.gpu_flavor}'"
        if wl.request.gpus and all(wl.request.gpus > self.capacity[gpu_key(f)] for f in flavors):
            most = max(self.capacity[gpu_key(f)] for f in flavors)
            return f"asks for {wl.request.gpus} GPUs; at most {most:g} of one flavor exist"
        if wl.request.cpu > self.capacity["cpu"]:
            return f"asks for {wl.request.cpu:g} CPUs; jobs may use {self.capacity['cpu']:g}"
        if wl.request.memory > self.capacity["memory"]:
            return f"asks for {gib(wl.request.memory)} memory; jobs may use {gib(self.capacity['memory'])}"
        if wl.request.gpus:
            ceilings = {f: self.ceiling(team, gpu_key(f)) for f in flavors}
            if all(wl.request.gpus > c + 1e-9 for c in ceilings.values()):
                most = max(ceilings.values())
                return (f"asks for {wl.request.gpus} GPUs; team {team.name} may have at most {most:g} "
                        f"(its quota and what it may borrow)")
        for resource, amount, show in (("cpu", wl.request.cpu, lambda v: f"{v:g} CPUs"),
                                       ("memory", wl.request.memory, gib)):
            if amount and self._quoted(team, resource) and amount > self.ceiling(team, resource) + 1e-9:
                return (f"asks for {show(amount)}; team {team.name} may have at most "
                        f"{show(self.ceiling(team, resource))} (its quota and what it may borrow)")
        return None

    def ceiling(self, team: Team, resource: str) -> float:
        """The most of a quoted resource the team could ever hold: its nominal quota, plus what it may
        borrow (within its borrowing limit, from what the other members of its cohort may lend)."""
        nominal = team.nominal.get(resource, 0.0)
        most = nominal
        if team.cohort:
            lendable = 0.0
            for name in self.cohorts[team.cohort]:
                member = self.teams[name]
                if name == team.name or not self._quoted(member, resource):
                    continue
                lendable += min(member.nominal.get(resource, 0.0),
                                member.lending_limit.get(resource, INF))
            most = nominal + min(team.borrowing_limit.get(resource, INF), lendable)
        return min(most, self.capacity.get(resource, 0.0))

    # admission -----------------------------------------------------------------------
    def _admit(self, wl: Workload, flavor: str | None, now: float) -> Workload:
        wl.flavor = flavor
        wl.devices = tuple(self.free_devices[flavor][:wl.request.gpus]) if flavor else ()
        wl.admitted_at = now
        self._take(wl)
        return wl

    def try_server(self, wl: Workload, now: float = 0.0) -> tuple[bool, str]:
        """Admit a notebook server's GPUs at once or say why not (servers do not queue)."""
        wl.priority = SERVER_PRIORITY
        wl.kind = "server"
        flavor, why = self.fit(wl)
        if flavor is False:
            return False, self.reason(wl, why)
        self._admit(wl, flavor, now)
        return True, ""

    def cycle(self, pending: list[Workload], now: float, preempt: bool = True) -> Decision:
        """One scheduling pass over every pending workload (in any order; the backlog keeps them sorted).

        Workloads are considered in Kueue's order: those that preempted and wait for what they freed,
        then those that fit in their team's nominal quota, then the ones that would borrow; within
        each, by priority, then age. Alike workloads (same team, priority and request) form a group
        of which only the oldest is tried: when it does not fit, the rest wait with the same reason.
        The groups of one team and request (an *ask*) differ only in priority: when the first of them
        does not fit and can preempt nothing, the lower ones cannot either (they fit no better and may
        preempt no more), so they wait with the same reason at once. Once a cohort has preempted in the
        pass, its workloads only try to fit: an ask that a smaller or higher-priority one of its team
        already showed to be short of something, or that lacks something even with nothing held back,
        waits at once (:meth:`_short_of`). A pass thus costs a few steps per ask, group and admission,
        a victim search per ask at most until each cohort preempts, plus set operations over the pending
        list (:class:`Backlog`)."""
        backlog = self._backlog
        backlog.sync(pending)
        live = backlog.live
        self._pass += 1
        decision = Decision(pending=list(pending))
        # team -> priority -> what starving workloads of that priority hold back from the team's others
        reserved: dict[str, dict[int, dict[str, float]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
        serial = 0
        heap: list[tuple] = []
        # cohort -> team -> what its waiting preemptors need: no other team's borrower takes it in this pass
        self._reclaiming = {}
        self._preempted_in = set()
        self._held_for_others = False
        if self.nominated or backlog.detached:
            self.nominated = {wid for wid in self.nominated if wid in backlog.by_id}
            for wl in [w for w in backlog.detached if w.id not in self.nominated]:
                backlog.attach(wl)  # its preemption is over: it waits with its alike ones again
            for wid in self.nominated:
                wl = backlog.by_id[wid]
                backlog.detach(wl)
                serial += 1
                heap.append((0, -wl.priority, wl.created, wl.id, serial, wl, None, 0, self._ask(wl)))
        # group -> why its workloads wait: words, or [workload, resource short], worded once the pass is done
        reasons: dict[int, object] = {}
        raised: list[tuple[list, Ask]] = []  # those lists, with their asks
        backlog.tidy()
        asks = self._asks
        for groups in backlog.asks.values():
            wl = groups[0].head(live)
            ask = asks.get(groups[0].ask) or self._ask(wl)
            serial += 1
            heap.append((2 if ask.cohort and self._borrows_now(ask) else 1, -wl.priority, wl.created, wl.id, serial, wl,
                         groups, 0, ask))
        heapq.heapify(heap)
        admitted_now: set[str] = set()
        own: dict[str, object] = {}  # preemptors' reasons
        failed: dict[str, list[list]] = defaultdict(list)  # team -> [workload, resource short]: nothing to preempt
        # team -> "raw" -> resource -> the least found short of it with nothing held back in this pass, and
        # "held" -> resource -> (priority, amount) found short of it with what that priority holds back
        short_of: dict[str, dict[str, dict]] = {}
        while heap:
            order, _, _, _, _, wl, groups, index, ask = heapq.heappop(heap)
            if groups is not None:
                if preempt and ask.circle not in self._preempted_in:  # it may look for victims
                    if wl.team in failed and ask.never is None:
                        short = self._short_like(wl, failed[wl.team])
                        if short is not None:  # a smaller ask of its team found no room and nothing to preempt
                            reason = [wl, short]
                            raised.append((reason, ask))
                            self._wait_alike(groups, index, ask, reason, now, reserved, reasons, live)
                            continue
                elif ask.never is None and ask.team is not None and not ask.team.held:
                    short = self._short_of(wl, ask, short_of)
                    if short is not None:  # it does not fit, and looks for no victims in this pass
                        reason = reasons[groups[index].gid] = [wl, short]
                        raised.append((reason, ask))
                        if now - wl.created > self.starvation_seconds:
                            self._hold(ask, wl.priority, reserved)
                        failed[wl.team].append(reason)
                        if index + 1 < len(groups):
                            self._wait_alike(groups, index + 1, ask, reason, now, reserved, reasons, live)
                        continue
            reason = self._consider(wl, ask, now, preempt, decision, reserved, admitted_now)
            if type(reason) is list:
                raised.append((reason, ask))
            if groups is None:  # a preemptor, on its own
                if reason is None:
                    backlog.remove(wl)
                else:
                    own[wl.id] = reason
                continue
            if reason is None:  # admitted: the next of its ask, if any, takes its place
                backlog.remove(wl)
                nxt, index = self._next_of(groups, index, live)
                if nxt is not None:
                    serial += 1
                    heapq.heappush(heap, (order, -nxt.priority, nxt.created, nxt.id, serial, nxt, groups, index, ask))
                continue
            reasons[groups[index].gid] = reason
            if wl.id in self.nominated:  # it preempted: a lower priority of its ask may preempt others
                nxt, index = self._next_of(groups, index + 1, live)
                if nxt is not None:
                    serial += 1
                    heapq.heappush(heap, (order, -nxt.priority, nxt.created, nxt.id, serial, nxt, groups, index, ask))
                continue
            # (short because of what another team's preemptors hold back: says nothing of asks that do not borrow)
            if type(reason) is list and not self._held_for_others:
                failed[wl.team].append(reason)
                self._found_short(short_of, *reason)
            if index + 1 < len(groups):
                self._wait_alike(groups, index + 1, ask, reason, now, reserved, reasons, live)
        # alike groups share one reason: [workload, resource short] becomes [what it waits for, where its team
        # stands], worded from the state after the pass, once for all of them (a Waiting joins the two when read)
        states: dict[tuple[str, str], str] = {}
        for reason, ask in raised:
            wl, resource = reason
            what = ask.what.get(resource)
            if what is None:
                what = ask.what[resource] = "waiting" if resource is None else self._what(wl, resource)
            if resource is None or resource == "gpu":  # these words say it all
                reason[0], reason[1] = what, ""
                continue
            state = states.get((ask.name, resource))
            if state is None:
                state = states[ask.name, resource] = ": " + self._words(ask.team, resource)
            reason[0], reason[1] = what, state
        decision.waiting = Waiting(backlog.ids.copy(), reasons, own)
        return decision

    @staticmethod
    def _next_of(groups: list, index: int, live: dict) -> tuple[Workload | None, int]:
        """The oldest workload of the first group from ``index`` on that holds one, and that group's index."""
        while index < len(groups):
            wl = groups[index].head(live)
            if wl is not None:
                return wl, index
            index += 1
        return None, index

    def _short_like(self, wl: Workload, failed: list[list]) -> str | None:
        """The resource ``wl`` is short of, when an ask of its team that it dominates already found no room
        and nothing to preempt in this pass: then ``wl`` fits nowhere either (it asks for at least as much
        of everything, on no other flavor, at no higher priority: more is held back from it) and may preempt
        no more (fewer of its team's jobs have a lower priority, and whatever it could reclaim from borrowers
        the smaller ask could reclaim too). Room only shrinks in a pass, so the smaller ask's answer holds."""
        mine = wl.request
        for other, short in failed:
            theirs = other.request
            if (wl.priority > other.priority or mine.cpu < theirs.cpu or mine.memory < theirs.memory
                    or (mine.cpu and not theirs.cpu) or (mine.memory and not theirs.memory)):
                continue
            if theirs.gpus:
                if mine.gpus < theirs.gpus or not (mine.gpu_flavor == theirs.gpu_flavor or theirs.gpu_flavor is None
                                                   and mine.gpu_flavor in self._flavor_set(other)):
                    continue
                if mine.gpu_flavor and short.startswith("gpu/"):
                    short = gpu_key(mine.gpu_flavor)
            elif mine.gpus:
                continue
            return short
        return None

    def _found_short(self, short_of: dict, wl: Workload, resource: str | None) -> None:
        """Remember that ``wl`` found too little of ``resource`` (of GPUs: on every flavor it may use) in this pass,
        with what workloads of its priority and higher hold back."""
        if resource is None:
            return
        facts = short_of.get(wl.team)
        if facts is None:
            facts = short_of[wl.team] = {"raw": {}, "held": {}}
        facts = facts["held"]
        request = wl.request
        if resource == "cpu" or resource == "memory":
            facts.setdefault(resource, []).append((wl.priority, request.cpu if resource == "cpu" else request.memory))
        else:
            for _, key in self._flavor_keys(self.teams[wl.team], request):
                facts.setdefault(key, []).append((wl.priority, request.gpus))

    def _short_of(self, wl: Workload, ask: Ask, short_of: dict[str, dict]) -> str | None:
        """A resource ``wl`` is short of (of GPUs: on every flavor it may use), each either because it finds too
        little of it even with nothing held back, or because a workload of its team found too little of it in
        this pass and ``wl`` asks for at least as much: with nothing held back (``short_of[team]["raw"]``), or at
        the same or a higher priority (``short_of[team]["held"]``). Room only shrinks in a pass and more is held
        back from a lower priority, so it is short of it too. None if there is none. Unlike :meth:`_short_like`,
        this says nothing of what it could preempt. CPU first, then memory, then GPUs."""
        facts = short_of.get(ask.name)
        if facts is None:
            facts = short_of[ask.name] = {"raw": {}, "held": {}}
        raw, held, priority, rooms = facts["raw"], facts["held"], wl.priority, None
        for resource in ("cpu", "memory"):  # (the model's capacity names both)
            amount = ask.cpu if resource == "cpu" else ask.memory
            if amount:
                if amount >= raw.get(resource, INF):
                    return resource
                if rooms is None:
                    rooms = self._rooms(ask.team)
                if amount > min(rooms[resource], self.capacity[resource] - self.total_used[resource]) + 1e-9:
                    raw[resource] = amount
                    return resource
                for level, least in held.get(resource, ()):
                    if level >= priority and amount >= least:
                        return resource
        gpus = ask.gpus
        if not gpus:
            return None
        for _, key in ask.keys:
            if gpus >= raw.get(key, INF):
                continue
            if rooms is None:
                rooms = self._rooms(ask.team)
            if gpus > min(rooms[key], self.capacity[key] - self.total_used[key]) + 1e-9:
                raw[key] = gpus
                continue
            for level, least in held.get(key, ()):
                if level >= priority and gpus >= least:
                    break
            else:
                return None
        return ask.keys[0][1] if ask.keys else None

    def _flavor_set(self, wl: Workload) -> frozenset:
        key = ("flavor set", wl.team, wl.request.gpu_flavor)
        found = self._static.get(key)
        if found is None:
            found = self._static[key] = frozenset(self._flavors(self.teams[wl.team], wl.request))
        return found

    def _wait_alike(self, groups: list, start: int, ask: Ask, reason: object, now: float, reserved: dict,
                    reasons: dict, live: dict) -> None:
        """Lower priorities of an ask (its groups from ``start`` on) whose first group does not fit and may preempt
        nothing: they wait for the same reason, and when it is a shortage (not a held queue, not an impossible
        ask), the starving first workloads among them hold back what they need from their team's others, as if
        each were tried."""
        starving = now - self.starvation_seconds if type(reason) is list else None  # created before: starving
        for index in range(start, len(groups)):
            group = groups[index]
            if group.size:
                reasons[group.gid] = reason
                if starving is not None and group.heap[0][0] < starving:  # the top is at most as old as the oldest
                    if group.head(live).created < starving:
                        self._hold(ask, group.priority, reserved)

    def _consider(self, wl: Workload, ask: Ask, now: float, preempt: bool, decision: Decision, reserved: dict,
                  admitted_now: set[str]) -> object:
        """Admit ``wl`` (None), or preempt for it, or say why it waits (words, or what ``reason`` words)."""
        team = ask.team
        if team is None or team.held:
            return f"queue {wl.team} is held by an admin" if team else f"no team {wl.team}"
        never = ask.never
        if never:
            return f"{never}: it can never start"
        held_back = self._held_back(reserved[wl.team], wl.priority) if wl.team in reserved else None
        flavor, why = self.fit(wl, reserved=held_back)
        self._held_for_others = False
        reclaiming = self._reclaiming.get(team.cohort) if team.cohort and flavor is not False else None
        if reclaiming and any(name != wl.team for name in reclaiming) and not self.within_nominal(wl, flavor):
            # it would borrow what another team's waiting preemptors need: admitted, it would be their next
            # victim, and they would preempt one borrower after another for ever. It fits only without that.
            held_back = defaultdict(float, held_back or {})
            for name, needs in reclaiming.items():
                if name != wl.team:
                    for resource, amount in needs.items():
                        held_back[resource] += amount
            self._held_for_others = True
            flavor, why = self.fit(wl, reserved=held_back)
        if flavor is not False:
            decision.admitted.append(self._admit(wl, flavor, now))
            admitted_now.add(wl.id)
            self.nominated.discard(wl.id)
            return None
        reason: object = [wl, why]  # worded once the pass is done (see cycle)
        if wl.id in self.nominated and wl.id in self._cached(
                ("preemptors",), lambda: {v.stopping_for for v in self.admitted.values() if v.stopping}):
            reason = "waiting for the jobs it preempted to stop"
        elif preempt and ask.circle not in self._preempted_in:
            victims = self._preemption(wl, held_back, admitted_now)
            for victim in victims:
                self._run(victim, -1.0)
                self._changes[team.cohort or team.name] += 1
                victim.stopping = True
                victim.stopping_for = wl.id
                decision.preempted.append((victim, wl))
            if victims:
                self._version += 1  # the victims are no longer candidates
                self._preempted_in.add(ask.circle)
                self.nominated.add(wl.id)
                reason = f"preempting {len(victims)} job(s) to start"
            elif wl.id in self.nominated:
                # its victims have stopped and it finds no more: its preemption is over, and it no longer holds
                # back from its cohort's borrowers what it needs (held for good, it could stall them for ever)
                self.nominated.discard(wl.id)
        if wl.id in self.nominated or now - wl.created > self.starvation_seconds:
            self._hold(ask, wl.priority, reserved)
        if wl.id in self.nominated and team.cohort:  # and one that preempted, from its cohort's borrowers
            mine = self._reclaiming.setdefault(team.cohort, {}).setdefault(wl.team, defaultdict(float))
            for resource, amount in self._needs(wl).items():
                mine[resource] += amount
        return reason

    @staticmethod
    def _hold(ask: Ask, priority: int, reserved: dict) -> None:
        """A workload of ``ask`` and ``priority`` (starving, or one that preempted: its victims free only part of
        what it needs) holds back what it needs from its team's workloads of the same or a lower priority."""
        if ask.needs:
            held = reserved[ask.name][priority]
            for resource, amount in ask.needs.items():
                held[resource] += amount

    @staticmethod
    def _held_back(reserved: dict[int, dict[str, float]], priority: int) -> dict[str, float]:
        """What starving workloads of the same or a higher priority hold back from one of ``priority``."""
        out: dict[str, float] = defaultdict(float)
        for level, needs in reserved.items():
            if level >= priority:
                for resource, amount in needs.items():
                    out[resource] += amount
        return out

    def _ask(self, wl: Workload) -> Ask:
        ask = self._asks.get(wl.ask)
        if ask is None:
            ask = self._asks[wl.ask] = Ask(self, wl)
        return ask

    def _borrows(self, wl: Workload) -> bool:
        """Whether the workload would have to borrow (it fits in no flavor within its team's nominal quota)."""
        ask = self._ask(wl)
        return bool(ask.cohort) and self._borrows_now(ask)

    def _borrows_now(self, ask: Ask) -> bool:
        """:meth:`_borrows` for a workload of ``ask``, whose team is in a cohort: :meth:`within_nominal` for
        each of its flavors, with CPU and memory looked at once."""
        used, nominal = self.used[ask.name], ask.team.nominal
        if (ask.cpu and "cpu" in nominal and used["cpu"] + ask.cpu > nominal["cpu"] + 1e-9
                or ask.memory and "memory" in nominal and used["memory"] + ask.memory > nominal["memory"] + 1e-9):
            return True
        if not ask.gpus:
            return False
        for _, key in ask.keys:
            if used[key] + ask.gpus <= nominal.get(key, 0.0) + 1e-9:
                return False
        return True

    def estimate(self, pending: list[Workload], ends: dict[str, float], durations: dict[str, float],
                 now: float, limit: int = 200) -> dict[str, float]:
        """When pending workloads may start, if running ones end at ``ends`` and each pending one runs
        ``durations[id]`` (both from limits and history); a replay on a copy of this model, without
        preemption, over at most ``limit`` workloads."""
        import copy

        sim = copy.deepcopy(self)
        waiting = [copy.copy(w) for w in sorted(pending, key=lambda w: (-w.priority, w.created, w.id))[:limit]]
        events = sorted((max(t, now), wid) for wid, t in ends.items() if wid in sim.admitted)
        starts: dict[str, float] = {}
        while waiting and events:
            t, wid = events.pop(0)
            sim.release(wid)
            while events and events[0][0] <= t:
                sim.release(events.pop(0)[1])
            for wl in sim.cycle(waiting, t, preempt=False).admitted:
                starts[wl.id] = t
                bisect.insort(events, (t + durations.get(wl.id, 3600.0), wl.id))
            waiting = [w for w in waiting if w.id not in starts]
        return starts

    def _needs(self, wl: Workload) -> dict[str, float]:
        key = ("needs", wl.ask)
        needs = self._static.get(key)
        if needs is None:
            team = self.teams[wl.team]
            needs = {"cpu": wl.request.cpu, "memory": wl.request.memory}
            # the first flavor the team could ever fit it in (its victims, if any, free that one)
            flavors = [f for f in self._flavors(team, wl.request)
                       if self.ceiling(team, gpu_key(f)) >= wl.request.gpus]
            if wl.request.gpus and flavors:
                needs[gpu_key(flavors[0])] = wl.request.gpus
            needs = self._static[key] = {r: a for r, a in needs.items() if a}
        return needs

    # visibility ------------------------------------------------------------------------
    def reason(self, wl: Workload, resource: str | None) -> str:
        """Why a workload waits, short of ``resource``, in words."""
        words = self._reason_parts(wl, resource)
        return words if isinstance(words, str) else words[0] + words[1]

    def _reason_parts(self, wl: Workload, resource: str | None) -> str | tuple[str, str]:
        """:meth:`reason`, or its two parts (what it waits for, and where its team stands now), which a
        :class:`Waiting` joins when it is read."""
        if resource is None:
            return "waiting"
        key = ("reason", wl.ask, resource)
        what = self._static.get(key)
        if what is None:
            what = self._static[key] = self._what(wl, resource)
        return what if resource == "gpu" else (what, self._state(self.teams[wl.team], resource))

    def _what(self, wl: Workload, resource: str) -> str:
        """What the workload waits for (the part of its reason that depends on the request only)."""
        request = wl.request
        if resource == "gpu":
            return f"waiting for {request.gpus} GPUs: team {wl.team} may use no GPU flavor"
        if resource.startswith("gpu/"):
            return f"waiting for {request.gpus} `{resource[4:]}` GPU{'s' if request.gpus != 1 else ''}"
        if resource == "cpu":
            return f"waiting for {request.cpu:g} CPU{'s' if request.cpu != 1 else ''}"
        return f"waiting for {request.memory / 2**30:.1f} GiB memory"

    def _state(self, team: Team, resource: str) -> str:
        """Where the team stands on the resource now (the part of a reason its alike workloads share)."""
        return self._cached(("state", team.name, resource), lambda: ": " + self._words(team, resource))

    def _words(self, team: Team, resource: str) -> str:
        """Where the team stands on the resource, in words (remembered by the figures they show)."""
        used = self.used[team.name][resource]
        lend = self.lendable(team, resource) if team.cohort else None
        free = self.capacity.get(resource, 0.0) - self.total_used[resource] \
            if resource.startswith("gpu/") or resource == "cpu" else None
        key = (team.name, resource, used, lend, free)
        words = self._worded.get(key)
        if words is None:
            if len(self._worded) > 10_000:
                self._worded.clear()
            show = gib if resource == "memory" else (lambda v: f"{v:g}")
            quota = f"/{show(team.nominal.get(resource, 0.0))}" if self._quoted(team, resource) else ""
            parts = [f"{team.name} uses {show(used)}{quota}"]
            if lend is not None:
                parts.append(f"cohort has {show(lend)} to lend")
            if free is not None:
                parts.append(f"{free:g} free on the machine")
            words = self._worded[key] = ", ".join(parts)
        return words
