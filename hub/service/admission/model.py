"""Admission with Kueue's semantics, in memory: the books of quotas, cohorts, borrowing, and what fits.

The model mirrors Kueue so that one ``danlu.yaml`` means the same thing on one
machine and on a cluster (where it renders to Kueue objects):

* a **team** is a ClusterQueue: a *nominal quota* per resource (``gpu/<flavor>``,
  ``cpu``, ``memory``), optionally in a **cohort** whose members lend each other
  unused nominal quota, within each team's *borrowing limit* and *lending limit*;
* a **workload** (a job, or a notebook server holding GPUs) is admitted only when
  everything it asks for fits -- its team's nominal quota plus what it may borrow,
  and the free devices of one GPU flavor -- all or nothing;
* a workload that asks for more than the machine or its team could ever have
  (nominal quota plus borrowing limit, and what the cohort may lend) is told so
  at once and holds nothing back.

:class:`Model` keeps the books -- what each team and the machine use, what each cohort may still lend,
which devices are free -- and answers what fits (:meth:`Model.fit`, :meth:`Model.limit`,
:meth:`Model.impossible`). The pass that decides what starts, in Kueue's order, is :mod:`.cycle`
(:meth:`Model.cycle`); who is preempted is :mod:`.preemption`; why a workload waits, in words, is
:mod:`.reasons`. Each is functions of the model's books, none a subclass of it. The model is pure (no I/O,
no clock: time is always given), so the service, the benchmarks and the property tests run the very same
decisions. Devices are real indices: the model never gives one device to two workloads.
"""

from __future__ import annotations

import bisect
import copy
from collections import defaultdict
from typing import Any

from danlu.hub.service.admission import cycle, reasons
from danlu.hub.service.admission.backlog import Backlog
from danlu.hub.service.admission.preemption import Freed
from danlu.hub.service.admission.workloads import INF, SERVER_PRIORITY, Decision, Request, Team, Workload, gib, gpu_key


class Rooms(dict):
    """resource -> what a team's quota and cohort still let it use (:meth:`Model.limit`; the machine's free
    capacity aside, which changes with every admission), each worked out when first read."""

    __slots__ = ("model", "team", "freed")

    def __init__(self, model: Model, team: Team, freed: Freed | None = None):
        super().__init__()
        self.model, self.team, self.freed = model, team, freed

    def __missing__(self, resource: str) -> float:
        room = self[resource] = (
            self.model.limit(self.team, resource, self.freed)
            if self.freed
            else self.model._limit_now(self.team, resource)
        )
        return room


class Model:
    """Quota accounting and admission decisions for every team."""

    def __init__(
        self,
        teams: list[Team],
        devices: dict[str, list[int]],
        cpu: float,
        memory: float = INF,
        starvation_seconds: float = 600.0,
    ):
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
        self._cache: dict[tuple, Any] = {}  # key -> (the version it holds for, the value)
        self._rooms_of: dict[str, tuple[int, Rooms]] = {}  # team -> its cohort's changes, and its Rooms then
        self._never: dict[int, str | None] = {}  # ask -> why it can never start (None: it can)
        self._static: dict[tuple, Any] = {}  # what depends on the configuration only (ceilings, needs)
        self._worded: dict[tuple, str] = {}  # where a team stands, in words, by the figures they show
        self._asks: dict[int, cycle.Ask] = {}  # ask -> what is worked out once about it (in a pass)
        self.admitted: dict[str, Workload] = {}
        self._running: dict[str, dict[str, Workload]] = defaultdict(dict)  # admitted jobs not stopping, by team
        # what those jobs hold, by team, priority and resource: a bound on what preemption could free
        self._running_use: dict[str, dict[int, dict[str, float]]] = defaultdict(
            lambda: defaultdict(lambda: defaultdict(float))
        )
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
                    self._kept[team.cohort][resource] += self._keeps(team, resource, used[resource]) - self._keeps(
                        team, resource, before
                    )

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
                if not amount or member is None or member.cohort != team.cohort or not self._quoted(member, resource):
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
            found = self._static[key] = [
                (f, gpu_key(f)) for f in self._flavors(team, Request(gpus=1, gpu_flavor=request.gpu_flavor))
            ]
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
                return (
                    f"asks for {wl.request.gpus} GPUs; team {team.name} may have at most {most:g} "
                    f"(its quota and what it may borrow)"
                )
        for resource, amount, show in (
            ("cpu", wl.request.cpu, lambda v: f"{v:g} CPUs"),
            ("memory", wl.request.memory, gib),
        ):
            if amount and self._quoted(team, resource) and amount > self.ceiling(team, resource) + 1e-9:
                return (
                    f"asks for {show(amount)}; team {team.name} may have at most "
                    f"{show(self.ceiling(team, resource))} (its quota and what it may borrow)"
                )
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
                lendable += min(member.nominal.get(resource, 0.0), member.lending_limit.get(resource, INF))
            most = nominal + min(team.borrowing_limit.get(resource, INF), lendable)
        return min(most, self.capacity.get(resource, 0.0))

    # admission -----------------------------------------------------------------------
    def _admit(self, wl: Workload, flavor: str | None, now: float) -> Workload:
        wl.flavor = flavor
        wl.devices = tuple(self.free_devices[flavor][: wl.request.gpus]) if flavor else ()
        wl.admitted_at = now
        self._take(wl)
        return wl

    def try_server(self, wl: Workload, now: float = 0.0) -> tuple[bool, str]:
        """Admit a notebook server's GPUs at once or say why not (servers do not queue)."""
        wl.priority = SERVER_PRIORITY
        wl.kind = "server"
        flavor, why = self.fit(wl)
        if flavor is False:
            return False, reasons.reason(self, wl, why)
        self._admit(wl, flavor, now)
        return True, ""

    def cycle(self, pending: list[Workload], now: float, preempt: bool = True) -> Decision:
        """One scheduling pass over every pending workload (:func:`.cycle.run`)."""
        return cycle.run(self, pending, now, preempt)

    def estimate(
        self, pending: list[Workload], ends: dict[str, float], durations: dict[str, float], now: float, limit: int = 200
    ) -> dict[str, float]:
        """When pending workloads may start, if running ones end at ``ends`` and each pending one runs
        ``durations[id]`` (both from limits and history); a replay on a copy of this model, without
        preemption, over at most ``limit`` workloads."""
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
            flavors = [f for f in self._flavors(team, wl.request) if self.ceiling(team, gpu_key(f)) >= wl.request.gpus]
            if wl.request.gpus and flavors:
                needs[gpu_key(flavors[0])] = wl.request.gpus
            needs = self._static[key] = {r: a for r, a in needs.items() if a}
        return needs

    # visibility ------------------------------------------------------------------------
