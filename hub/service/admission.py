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
  (``reclaim: any | lower_priority``), newest and lowest priority first. A
  workload is never preempted in the pass that admitted it, and a preemptor
  counts only its own victims as freed, so preemption settles when no job ends;
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

from danlu.hub.service.workloads import (  # noqa: F401 - the model's vocabulary, re-exported
    _GROUPS,
    INF,
    SERVER_PRIORITY,
    Decision,
    Request,
    Team,
    Workload,
    _by_age,
    gib,
    gpu_key,
)


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
        # caches: what is available is recomputed only after an admission or a release (``_version``)
        self._version = 0
        self._cache: dict[tuple, tuple[int, float]] = {}
        self._never: dict[int, str | None] = {}
        self.admitted: dict[str, Workload] = {}
        self.used: dict[str, dict[str, float]] = {name: defaultdict(float) for name in self.teams}
        self.total_used: dict[str, float] = defaultdict(float)
        self.free_devices: dict[str, list[int]] = {f: list(ids) for f, ids in self.devices.items()}
        self.nominated: set[str] = set()  # pending workloads that preempted: first in line for what frees up

    # accounting ----------------------------------------------------------------------
    def _take(self, wl: Workload) -> None:
        self._version += 1
        for resource, amount in wl.usage().items():
            self.used[wl.team][resource] += amount
            self.total_used[resource] += amount
        free = self.free_devices.get(wl.flavor, [])
        for device in wl.devices:
            free.remove(device)
        self.admitted[wl.id] = wl

    def _give_back(self, wl: Workload) -> None:
        self._version += 1
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
        if not without:
            hit = self._cache.get(("room", team.name, resource))
            if hit is not None and hit[0] == self._version:
                return hit[1]
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
        if not without:
            self._cache[("room", team.name, resource)] = (self._version, total)
        return total

    def available(self, team: Team, resource: str, without: set[str] = frozenset()) -> float:
        """How much more of a resource the team may use now (nominal + borrowable - used, and free)."""
        if not without:
            hit = self._cache.get(("available", team.name, resource))
            if hit is not None and hit[0] == self._version:
                return hit[1]
        free = self._free(resource, without)
        if not self._quoted(team, resource):
            value = free
        else:
            nominal = team.nominal.get(resource, 0.0)
            used = self._used(team.name, resource, without)
            if not team.cohort:
                value = min(nominal - used, free)
            else:
                ceiling = nominal + team.borrowing_limit.get(resource, INF) - used
                value = min(ceiling, self._cohort_room(team, resource, without), free)
        if not without:
            self._cache[("available", team.name, resource)] = (self._version, value)
        return value

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
        if without or reserved:
            return self._fit(wl, without, reserved)
        return self._cached(("fit", wl.ask), lambda: self._fit(wl, without, reserved))

    def _cached(self, key: tuple, compute):
        """``compute()``, remembered until the next admission or release."""
        hit = self._cache.get(key)
        if hit is None or hit[0] != self._version:
            hit = self._cache[key] = (self._version, compute())
        return hit[1]

    def _fit(self, wl: Workload, without: set[str], reserved: dict | None):
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
        if wl.group not in self._never:
            self._never[wl.group] = self._impossible(wl)
        return self._never[wl.group]

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
        """One scheduling pass over every pending workload (in any order; it is sorted here).

        Workloads are considered in Kueue's order: those that preempted and wait for what they freed,
        then those that fit in their team's nominal quota, then the ones that would borrow; within
        each, by priority, then age. Alike workloads (same team, priority and request) form a group
        of which only the oldest is tried: when it does not fit, the rest wait with the same reason,
        so a pass costs little more than one look at each pending workload."""
        decision = Decision(pending=list(pending))
        # team -> priority -> what starving workloads of that priority hold back from the team's others
        reserved: dict[str, dict[int, dict[str, float]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
        if self.nominated:
            self.nominated = {wl.id for wl in pending if wl.id in self.nominated}
        groups: dict[int, list[Workload]] = defaultdict(list)
        first: list[Workload] = []
        nominated = self.nominated
        for wl in pending:
            if nominated and wl.id in nominated:
                first.append(wl)
            else:
                groups[wl._group if wl._group >= 0 else wl.group].append(wl)
        heap: list[tuple] = []
        for wl in first:
            heap.append(((0, 0, -wl.priority, wl.created, wl.id), -1, [wl]))
        for gid, members in groups.items():
            wl = min(members, key=_by_age)
            heap.append(((1, self._borrows(wl), -wl.priority, wl.created, wl.id), gid, members))
        heapq.heapify(heap)
        admitted_now: set[str] = set()
        blocked: list[tuple[object, list[Workload]]] = []  # reasons are worded once the pass is done
        while heap:
            key, gid, members = heapq.heappop(heap)
            wl = next(w for w in members if w.id == key[-1])
            reason = self._consider(wl, now, preempt, decision, reserved, admitted_now)
            if reason is None:  # admitted: the next of its group, if any, takes its place
                members = [w for w in members if w is not wl]
                if members:
                    nxt = min(members, key=_by_age)
                    heapq.heappush(heap, ((1, key[1], -nxt.priority, nxt.created, nxt.id), gid, members))
                continue
            blocked.append((reason, members))
        for reason, members in blocked:
            if isinstance(reason, tuple):  # (workload, resource short): worded from the state after the pass
                reason = self.reason(*reason)
            decision.waiting.update(dict.fromkeys([other.id for other in members], reason))
        return decision

    def _consider(self, wl: Workload, now: float, preempt: bool, decision: Decision, reserved: dict,
                  admitted_now: set[str]) -> object:
        """Admit ``wl`` (None), or preempt for it, or say why it waits (words, or what ``reason`` words)."""
        team = self.teams.get(wl.team)
        if team is None or team.held:
            return f"queue {wl.team} is held by an admin" if team else f"no team {wl.team}"
        never = self.impossible(wl)
        if never:
            return f"{never}: it can never start"
        held_back = self._held_back(reserved[wl.team], wl.priority) if wl.team in reserved else None
        flavor, why = self.fit(wl, reserved=held_back)
        if flavor is not False:
            decision.admitted.append(self._admit(wl, flavor, now))
            admitted_now.add(wl.id)
            self.nominated.discard(wl.id)
            return None
        reason: object = (wl, why)
        if wl.id in self._cached(("preemptors",), lambda: {v.stopping_for for v in self.admitted.values()
                                                            if v.stopping}):
            reason = "waiting for the jobs it preempted to stop"
        elif preempt:
            victims = self._preemption(wl, held_back, admitted_now)
            for victim in victims:
                victim.stopping = True
                victim.stopping_for = wl.id
                decision.preempted.append((victim, wl))
            if victims:
                self._version += 1  # the victims are no longer candidates
                self.nominated.add(wl.id)
                reason = f"preempting {len(victims)} job(s) to start"
        if wl.id in self.nominated or now - wl.created > self.starvation_seconds:
            # a starving workload, or one that preempted (its victims free only part of what it needs),
            # holds back what it needs from its team's workloads of the same or a lower priority
            for resource, amount in self._needs(wl).items():
                reserved[wl.team][wl.priority][resource] += amount
        return reason

    @staticmethod
    def _held_back(reserved: dict[int, dict[str, float]], priority: int) -> dict[str, float]:
        """What starving workloads of the same or a higher priority hold back from one of ``priority``."""
        out: dict[str, float] = defaultdict(float)
        for level, needs in reserved.items():
            if level >= priority:
                for resource, amount in needs.items():
                    out[resource] += amount
        return out

    def _borrows(self, wl: Workload) -> bool:
        """Whether the workload would have to borrow (it fits in no flavor within its team's nominal quota)."""
        team = self.teams.get(wl.team)
        if team is None or not team.cohort:
            return False
        return self._cached(("borrows", wl.ask),
                            lambda: not any(self.within_nominal(wl, f) for f in self._flavors(team, wl.request)))

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
        # the first flavor the team could ever fit it in (its victims, if any, free that one)
        flavors = [f for f in self._flavors(team, wl.request) if self.ceiling(team, gpu_key(f)) >= wl.request.gpus]
        if wl.request.gpus and flavors:
            needs[gpu_key(flavors[0])] = wl.request.gpus
        return needs

    def _victims_of(self, wl: Workload) -> list[Workload]:
        """Workloads still stopping because they were preempted for ``wl``."""
        return [v for v in self.admitted.values() if v.stopping and v.stopping_for == wl.id]

    def _preemption(self, wl: Workload, reserved: dict[str, float] | None = None,
                    admitted_now: set[str] = frozenset()) -> list[Workload]:
        """The fewest workloads to stop so that ``wl`` fits, per its team's policies; [] if none.

        Only the victims chosen here count as freed (not those stopping for another workload), what
        starving workloads hold back stays held back, and a workload admitted in this pass is no victim:
        so preemption never repeats for the same capacity."""
        team = self.teams[wl.team]
        running = self._running_by_team()
        candidates: list[Workload] = []
        if team.within_team == "lower_priority":
            candidates += [v for v in running.get(wl.team, ()) if v.priority < wl.priority and v.id not in admitted_now]
        if team.reclaim != "never" and team.cohort:
            flavors = self._flavors(team, wl.request)
            needed = [gpu_key(f) for f in flavors if f and self.within_nominal(wl, f)]
            if needed or (not wl.request.gpus and self.within_nominal(wl, None)):
                needed += [r for r, a in (("cpu", wl.request.cpu), ("memory", wl.request.memory)) if a]
                for name in self.cohorts[team.cohort]:
                    if name == wl.team or not self._borrowing(self.teams[name], needed):
                        continue
                    candidates += [v for v in running.get(name, ()) if v.id not in admitted_now and
                                   (team.reclaim == "any" or v.priority < wl.priority)]
        if not candidates:
            return []
        if not reserved:  # what failed at one priority fails at a lower one too (fewer candidates)
            hopeless = self._cache.get(("hopeless", wl.ask))
            if hopeless is not None and hopeless[0] == self._version and wl.priority <= hopeless[1]:
                return []
        if self.fit(wl, without={v.id for v in candidates}, reserved=reserved)[0] is False:
            if not reserved:
                self._cache[("hopeless", wl.ask)] = (self._version, wl.priority)
            return []  # stopping all it may preempt would not be enough
        candidates.sort(key=lambda v: (v.priority, -v.admitted_at, -v.created, v.id))  # newest, least important
        chosen: list[Workload] = []
        without: set[str] = set()
        for victim in candidates:
            chosen.append(victim)
            without.add(victim.id)
            flavor, _ = self.fit(wl, without=without, reserved=reserved)
            if flavor is not False:
                # drop victims that turned out unnecessary (most important first)
                for extra in sorted(chosen[:-1], key=lambda v: (-v.priority, v.admitted_at)):
                    trial = without - {extra.id}
                    if self.fit(wl, without=trial, reserved=reserved)[0] is not False:
                        chosen.remove(extra)
                        without = trial
                return chosen
        return []

    def _running_by_team(self) -> dict[str, list[Workload]]:
        """Admitted jobs that are not stopping, by team (what preemption may choose from)."""
        hit = self._cache.get(("running",))
        if hit is None or hit[0] != self._version:
            running: dict[str, list[Workload]] = defaultdict(list)
            for v in self.admitted.values():
                if v.kind == "job" and not v.stopping:
                    running[v.team].append(v)
            hit = self._cache[("running",)] = (self._version, running)
        return hit[1]

    def _borrowing(self, team: Team, resources: list[str]) -> bool:
        """Whether the team uses more than its nominal quota of one of ``resources``."""
        used = self.used[team.name]
        return any(used[r] > team.nominal.get(r, 0.0) + 1e-9 for r in resources if self._quoted(team, r))

    # visibility ------------------------------------------------------------------------
    def reason(self, wl: Workload, resource: str | None) -> str:
        """Why a workload waits, short of ``resource``, in words."""
        return self._cached(("reason", wl.ask, resource), lambda: self._reason(wl, resource))

    def _reason(self, wl: Workload, resource: str | None) -> str:
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
        show = gib if resource == "memory" else (lambda v: f"{v:g}")
        used = self.used[team.name][resource]
        nominal = team.nominal.get(resource, 0.0)
        quota = f"/{show(nominal)}" if self._quoted(team, resource) else ""
        parts = [f"{team.name} uses {show(used)}{quota}"]
        if team.cohort:
            parts.append(f"cohort has {show(self.lendable(team, resource))} to lend")
        free = self.capacity.get(resource, 0.0) - self.total_used[resource]
        if resource.startswith("gpu/") or resource == "cpu":
            parts.append(f"{free:g} free on the machine")
        return f"waiting for {what}: " + ", ".join(parts)
