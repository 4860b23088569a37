"""Admission with Kueue's semantics, in memory: quotas, cohorts, borrowing, priorities, preemption.

The model mirrors Kueue so that one ``danlu.yaml`` means the same thing on one
machine and on a cluster (where it renders to Kueue objects):

* a **team** is a ClusterQueue: a *nominal quota* per resource (``gpu/<flavor>``,
  ``cpu``, ``memory``), optionally in a **cohort** whose members lend each other
  unused nominal quota, within each team's *borrowing limit* and *lending limit*;
* a **workload** (a job, or a notebook server holding GPUs) is admitted only when
  everything it asks for fits -- its team's nominal quota plus what it may borrow,
  and the free devices of one GPU flavor -- all or nothing;
* pending workloads are considered by priority (WorkloadPriorityClass values),
  then age, best-effort FIFO: a workload that does not fit does not block smaller
  ones behind it, unless it has waited longer than ``starvation_seconds``, after
  which what it needs is held back for it;
* a workload that does not fit may **preempt**: lower-priority workloads of its
  own team (``within_team: lower_priority``), or, when it fits in its team's
  nominal quota, workloads of teams that are borrowing in the cohort
  (``reclaim: any | lower_priority``), newest and lowest priority first.

:class:`Model` is pure (no I/O, no clock), so the service, the benchmarks and
the property tests run the very same decisions. Devices are real indices: the
model never gives one device to two workloads.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field

INF = math.inf
SERVER_PRIORITY = 1 << 40  # notebook servers are never preempted


def gpu_key(flavor: str) -> str:
    return f"gpu/{flavor}"


@dataclass(frozen=True)
class Request:
    """What a workload asks for, all or nothing."""

    gpus: int = 0
    gpu_flavor: str | None = None  # None: any flavor the team may use, in its order
    cpu: float = 1.0
    memory: float = 0.0  # bytes

    @property
    def shape(self) -> tuple:
        return (self.gpus, self.gpu_flavor, self.cpu, self.memory)


@dataclass
class Team:
    """A ClusterQueue."""

    name: str
    nominal: dict[str, float] = field(default_factory=dict)
    borrowing_limit: dict[str, float] = field(default_factory=dict)  # absent: unlimited
    lending_limit: dict[str, float] = field(default_factory=dict)  # absent: all unused nominal quota
    cohort: str | None = None
    flavors: tuple[str, ...] = ()  # GPU flavors in the order they are tried
    within_team: str = "lower_priority"  # or "never"
    reclaim: str = "any"  # "lower_priority" | "never"
    held: bool = False


@dataclass
class Workload:
    id: str
    team: str
    priority: int
    created: float
    request: Request
    owner: str = ""
    kind: str = "job"  # "job" | "server"
    # while admitted
    flavor: str | None = None
    devices: tuple[int, ...] = ()
    admitted_at: float = 0.0
    stopping: bool = False  # preempted, its processes are being stopped
    stopping_for: str = ""  # the workload it was preempted for

    def usage(self) -> dict[str, float]:
        out = {"cpu": self.request.cpu, "memory": self.request.memory}
        if self.request.gpus:
            out[gpu_key(self.flavor)] = self.request.gpus
        return out


@dataclass
class Decision:
    admitted: list[Workload] = field(default_factory=list)
    preempted: list[tuple[Workload, Workload]] = field(default_factory=list)  # (victim, for whom)
    waiting: dict[str, str] = field(default_factory=dict)  # id -> human reason
    positions: dict[str, int] = field(default_factory=dict)  # id -> place in its team's queue (1 = next)


class Model:
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
        self.admitted: dict[str, Workload] = {}
        self.used: dict[str, dict[str, float]] = {name: defaultdict(float) for name in self.teams}
        self.total_used: dict[str, float] = defaultdict(float)
        self.free_devices: dict[str, list[int]] = {f: list(ids) for f, ids in self.devices.items()}

    # accounting ----------------------------------------------------------------------
    def _take(self, wl: Workload) -> None:
        for resource, amount in wl.usage().items():
            self.used[wl.team][resource] += amount
            self.total_used[resource] += amount
        free = self.free_devices.get(wl.flavor, [])
        for device in wl.devices:
            free.remove(device)
        self.admitted[wl.id] = wl

    def _give_back(self, wl: Workload) -> None:
        for resource, amount in wl.usage().items():
            self.used[wl.team][resource] -= amount
            self.total_used[resource] -= amount
        for device in wl.devices:
            bisect.insort(self.free_devices[wl.flavor], device)
        del self.admitted[wl.id]

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
    def _used(self, team: str, resource: str, without: set[str] = frozenset()) -> float:
        used = self.used[team][resource]
        for wid in without:
            wl = self.admitted.get(wid)
            if wl is not None and wl.team == team:
                used -= wl.usage().get(resource, 0.0)
        return used

    def _free(self, resource: str, without: set[str] = frozenset()) -> float:
        free = self.capacity.get(resource, 0.0) - self.total_used[resource]
        for wid in without:
            wl = self.admitted.get(wid)
            if wl is not None:
                free += wl.usage().get(resource, 0.0)
        return free

    @staticmethod
    def _quoted(team: Team, resource: str) -> bool:
        """GPUs always have a quota (0 unless given); CPU and memory only when the team sets one."""
        return resource.startswith("gpu/") or resource in team.nominal

    def _cohort_room(self, team: Team, resource: str, without: set[str] = frozenset()) -> float:
        """What the cohort still has for ``team``: all nominal quota, minus all use, minus what
        other members keep for themselves (their unused quota above their lending limit)."""
        total = 0.0
        for name in self.cohorts[team.cohort]:
            member = self.teams[name]
            if not self._quoted(member, resource):  # a team that sets no quota for it is outside its sharing
                continue
            nominal = member.nominal.get(resource, 0.0)
            used = self._used(name, resource, without)
            total += nominal - used
            if name != team.name and resource in member.lending_limit:
                total -= max(0.0, nominal - member.lending_limit[resource] - max(0.0, used))
        return total

    def available(self, team: Team, resource: str, without: set[str] = frozenset()) -> float:
        """How much more of a resource the team may use now (nominal + borrowable - used, and free)."""
        free = self._free(resource, without)
        if not self._quoted(team, resource):
            return free
        nominal = team.nominal.get(resource, 0.0)
        used = self._used(team.name, resource, without)
        if not team.cohort:
            return min(nominal - used, free)
        ceiling = nominal + team.borrowing_limit.get(resource, INF) - used
        return min(ceiling, self._cohort_room(team, resource, without), free)

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
        if request.gpu_flavor:
            return [request.gpu_flavor] if request.gpu_flavor in self.devices else []
        order = list(team.flavors) or sorted(self.devices)
        return [f for f in order if f in self.devices]

    def fit(self, wl: Workload, without: set[str] = frozenset(), reserved: dict | None = None):
        """The flavor a workload fits with now (None for CPU-only), or (False, the resource short)."""
        team = self.teams[wl.team]
        request = wl.request
        for resource, amount in (("cpu", request.cpu), ("memory", request.memory)):
            if amount and amount > self.available(team, resource, without) - (reserved or {}).get(resource, 0.0) \
                    + 1e-9:
                return False, resource
        why = None
        for flavor in self._flavors(team, request):
            if flavor is None:
                return None, None
            key = gpu_key(flavor)
            room = self.available(team, key, without) - (reserved or {}).get(key, 0.0)
            if request.gpus <= room + 1e-9:
                return flavor, None
            why = why or key
        return False, why or (gpu_key(request.gpu_flavor) if request.gpu_flavor else "gpu")

    def within_nominal(self, wl: Workload, flavor: str | None) -> bool:
        """Whether the workload fits in its team's own nominal quota (then it may reclaim lent quota)."""
        team = self.teams[wl.team]
        usage = {"cpu": wl.request.cpu, "memory": wl.request.memory}
        if wl.request.gpus:
            usage[gpu_key(flavor)] = wl.request.gpus
        return all(self.used[team.name][r] + a <= team.nominal.get(r, 0.0) + 1e-9
                   for r, a in usage.items() if a and self._quoted(team, r))

    def impossible(self, wl: Workload) -> str | None:
        """Why a workload can never be admitted (more than the machine or its team could ever have)."""
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
        return None

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
        flavor, why = self.fit(wl)
        if flavor is False:
            return False, self.reason(wl, why)
        self._admit(wl, flavor, now)
        return True, ""

    def cycle(self, pending: list[Workload], now: float, preempt: bool = True) -> Decision:
        """One scheduling pass over every pending workload (in any order; it is sorted here)."""
        decision = Decision()
        by_team: dict[str, list[Workload]] = defaultdict(list)
        for wl in pending:
            by_team[wl.team].append(wl)
        stopping = {wid for wid, wl in self.admitted.items() if wl.stopping}
        reserved: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # team -> held back
        order = sorted(pending, key=lambda w: (-w.priority, w.created, w.id))
        blocked_shapes: set[tuple] = set()
        for wl in order:
            team = self.teams.get(wl.team)
            if team is None or team.held:
                decision.waiting[wl.id] = f"queue {wl.team} is held by an admin" if team else f"no team {wl.team}"
                continue
            never = self.impossible(wl)
            if never:
                decision.waiting[wl.id] = f"{never}: it can never start"
                continue
            shape = (wl.team, wl.priority, wl.request.shape)
            if shape in blocked_shapes:  # an older workload of the same shape does not fit either
                decision.waiting[wl.id] = decision.waiting.get(f"shape:{shape}", "waiting")
                continue
            flavor, why = self.fit(wl, reserved=reserved[wl.team])
            if flavor is not False:
                decision.admitted.append(self._admit(wl, flavor, now))
                continue
            blocked_shapes.add(shape)
            reason = self.reason(wl, why)
            if self._victims_of(wl):
                reason = "waiting for the jobs it preempted to stop"
            elif preempt:
                victims = self._preemption(wl, stopping)
                for victim in victims:
                    victim.stopping = True
                    victim.stopping_for = wl.id
                    stopping.add(victim.id)
                    decision.preempted.append((victim, wl))
                if victims:
                    reason = f"preempting {len(victims)} job(s) to start"
            if now - wl.created > self.starvation_seconds:
                for resource, amount in self._needs(wl).items():  # hold it back from younger workloads
                    reserved[wl.team][resource] += amount
            decision.waiting[wl.id] = reason
            decision.waiting[f"shape:{shape}"] = reason
        for key in [k for k in decision.waiting if k.startswith("shape:")]:
            del decision.waiting[key]
        positions: dict[str, int] = defaultdict(int)
        for wl in order:
            if wl.id in decision.waiting:
                positions[wl.team] += 1
                decision.positions[wl.id] = positions[wl.team]
        return decision

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
        team = self.teams[wl.team]
        needs = {"cpu": wl.request.cpu, "memory": wl.request.memory}
        flavors = self._flavors(team, wl.request)
        if wl.request.gpus and flavors:
            needs[gpu_key(flavors[0])] = wl.request.gpus
        return needs

    def _victims_of(self, wl: Workload) -> list[Workload]:
        """Workloads still stopping because they were preempted for ``wl``."""
        return [v for v in self.admitted.values() if v.stopping and v.stopping_for == wl.id]

    def _preemption(self, wl: Workload, stopping: set[str]) -> list[Workload]:
        """The fewest workloads to stop so that ``wl`` fits, per its team's policies; [] if none."""
        team = self.teams[wl.team]
        candidates: list[Workload] = []
        if team.within_team == "lower_priority":
            candidates += [v for v in self.admitted.values()
                           if v.team == wl.team and v.priority < wl.priority and v.kind == "job" and not v.stopping]
        if team.reclaim != "never" and team.cohort:
            flavors = self._flavors(team, wl.request)
            if any(self.within_nominal(wl, f) for f in flavors):
                for v in self.admitted.values():
                    if v.team == wl.team or v.kind != "job" or v.stopping:
                        continue
                    other = self.teams[v.team]
                    if other.cohort != team.cohort or not self._borrowing(other):
                        continue
                    if team.reclaim == "lower_priority" and v.priority >= wl.priority:
                        continue
                    candidates.append(v)
        if not candidates:
            return []
        candidates.sort(key=lambda v: (v.priority, -v.admitted_at, -v.created, v.id))  # newest, least important
        chosen: list[Workload] = []
        without = set(stopping)
        for victim in candidates:
            chosen.append(victim)
            without.add(victim.id)
            flavor, _ = self.fit(wl, without=without)
            if flavor is not False:
                # drop victims that turned out unnecessary (most important first)
                for extra in sorted(chosen[:-1], key=lambda v: (-v.priority, v.admitted_at)):
                    trial = without - {extra.id}
                    if self.fit(wl, without=trial)[0] is not False:
                        chosen.remove(extra)
                        without = trial
                return chosen
        return []

    def _borrowing(self, team: Team) -> bool:
        used = self.used[team.name]
        return any(used[r] > team.nominal.get(r, 0.0) + 1e-9 for r in used if used[r] > 0 and self._quoted(team, r))

    # visibility ------------------------------------------------------------------------
    def reason(self, wl: Workload, resource: str | None) -> str:
        team = self.teams[wl.team]
        if resource is None:
            return "waiting"
        if resource.startswith("gpu/"):
            flavor = resource[4:]
            what = f"{wl.request.gpus} `{flavor}` GPU{'s' if wl.request.gpus != 1 else ''}"
        elif resource == "gpu":
            return f"waiting for {wl.request.gpus} GPUs: team {team.name} may use no GPU flavor"
        else:
            what = (f"{wl.request.cpu:g} CPU{'s' if wl.request.cpu != 1 else ''}" if resource == "cpu"
                    else f"{wl.request.memory / 2**30:.1f} GiB memory")
        used = self.used[team.name][resource]
        nominal = team.nominal.get(resource, 0.0)
        quota = f"/{nominal:g}" if self._quoted(team, resource) else ""
        parts = [f"{team.name} uses {used:g}{quota}"]
        if team.cohort:
            parts.append(f"cohort has {self.lendable(team, resource):g} to lend")
        free = self.capacity.get(resource, 0.0) - self.total_used[resource]
        if resource.startswith("gpu/") or resource == "cpu":
            parts.append(f"{free:g} free on the machine")
        return f"waiting for {what}: " + ", ".join(parts)
