"""Preemption for the admission model: whom a workload that does not fit may stop, as Kueue decides it.

:class:`Preemption` is the part of :class:`~danlu.hub.service.admission.model.Model`
that chooses victims. Candidates are lower-priority jobs of the preemptor's own
team (``within_team``) and, when it fits its team's nominal quota, jobs of cohort
members that borrow what it needs (``reclaim``). As in Kueue's classic
preemption, the borrowers' jobs go first, then its own team's, each lowest
priority and newest first; a borrower's job counts only while that team still
uses more than its nominal quota of what is reclaimed, and the preemptor must
then fit within its own; failing that, only its own team's jobs, the preemptor
allowed to borrow. Before any of that, a bound on what the candidates hold
(:meth:`Preemption._bound_for`, cached per team and per cohort) rules out most
hopeless attempts cheaply. Which workloads look for victims at all is the
pass's business (:meth:`~danlu.hub.service.admission.model.Model.cycle`: one
preemptor per cohort and pass). :class:`Freed` is what a set of victims would
give back, by team and in total, as the capacity arithmetic takes it.
"""

from __future__ import annotations

from collections import defaultdict

from danlu.hub.service.admission.workloads import Team, Workload


class Freed:
    """What stopping some admitted workloads would give back, by team and in total (a preemption being tried)."""

    __slots__ = ("by_team", "total", "_rooms")

    def __init__(self, workloads=()):
        self._rooms: dict[str, dict[str, float]] = {}  # only for a Freed that no longer changes
        self.by_team: dict[str, dict[str, float]] = {}
        self.total: dict[str, float] = defaultdict(float)
        for wl in workloads:
            self.add(wl)

    def __bool__(self) -> bool:
        return bool(self.by_team)

    def add(self, wl: Workload, sign: float = 1.0) -> None:
        mine = self.by_team.setdefault(wl.team, defaultdict(float))
        for resource, amount in wl.usage().items():
            mine[resource] += sign * amount
            self.total[resource] += sign * amount

    def remove(self, wl: Workload) -> None:
        self.add(wl, -1.0)

    def rooms(self, model, team: Team) -> dict[str, float]:
        """What ``team`` may use with all of this given back (worked out once per team)."""
        rooms = self._rooms.get(team.name)
        if rooms is None:
            rooms = self._rooms[team.name] = model.rooms_with(team, self)
        return rooms

    def of(self, team: str, resource: str) -> float:
        mine = self.by_team.get(team)
        return mine.get(resource, 0.0) if mine else 0.0


class Preemption:
    """Victim selection for :class:`~danlu.hub.service.admission.model.Model` (a mixin: it uses the model's books)."""

    def _victims_of(self, wl: Workload) -> list[Workload]:
        """Workloads still stopping because they were preempted for ``wl``."""
        return [v for v in self.admitted.values() if v.stopping and v.stopping_for == wl.id]

    def _preemption(self, wl: Workload, reserved: dict[str, float] | None = None,
                    admitted_now: set[str] = frozenset()) -> list[Workload]:
        """The fewest workloads to stop so that ``wl`` fits, per its team's policies; [] if none.

        Only the victims chosen here count as freed (not those stopping for another workload), what
        starving workloads hold back stays held back, and a workload admitted in this pass is no victim:
        so preemption never repeats for the same capacity."""
        if not reserved:  # what failed at one priority fails at a lower one too (fewer candidates)
            hopeless = self._cache.get(("hopeless", wl.ask))
            if hopeless is not None and hopeless[0] == self._version and wl.priority <= hopeless[1] \
                    and hopeless[2] in (None, self._pass):
                return []
        team = self.teams[wl.team]
        needed = self._needed(wl, team)
        if not self._may_fit(wl, self._bound_for(wl, team, wl.priority, needed), reserved):
            if not reserved:  # stopping all it may preempt would not be enough, in any pass until the books change
                self._cache[("hopeless", wl.ask)] = (self._version, wl.priority, None)
            return []
        # who it may preempt changes only with what its cohort admits, releases and preempts
        changes = self._changes[team.cohort or team.name]
        key, when = ("candidates", wl.team, wl.priority, needed), (self._pass, changes)
        hit = self._cache.get(key)
        if hit is None or hit[0] != when:
            hit = self._cache[key] = (when, self._candidates(team, wl.priority, needed, admitted_now))
        candidates, everyone = hit[1]
        if not candidates or self.fit(wl, everyone, reserved, everyone.rooms(self, team))[0] is False:
            if not reserved:  # not enough in this pass: its admissions are no candidates now, but are in the next
                self._cache[("hopeless", wl.ask)] = (self._version, wl.priority, self._pass)
            return []
        # Kueue's classic preemption: what other teams borrow first, then its own team's lower priorities,
        # newest and least important first, a job of another team only while that team still borrows what the
        # preemptor reclaims, and the preemptor then within its nominal quota; failing that, only its own
        # team's, the preemptor allowed to borrow
        order = (lambda v: (v.priority, -v.admitted_at, -v.created, v.id))
        mine = sorted((v for v in candidates if v.team == wl.team), key=order)
        theirs = sorted((v for v in candidates if v.team != wl.team), key=order)
        if theirs:
            chosen = self._targets(wl, theirs + mine, reserved, needed, nominal_only=True)
            if chosen:
                return chosen
        return self._targets(wl, mine, reserved, needed, nominal_only=False) if mine else []

    def _targets(self, wl: Workload, candidates: list[Workload], reserved: dict | None, needed: tuple | None,
                 nominal_only: bool) -> list[Workload]:
        """The first of ``candidates`` that, stopped, let ``wl`` fit (within its team's nominal quota when
        ``nominal_only``), less those that turned out unnecessary; [] if they never do. A job of another team
        counts only while that team still uses more than its nominal quota of a resource in ``needed``."""
        chosen: list[Workload] = []
        freed = Freed()
        for victim in candidates:
            if victim.team != wl.team and not self._still_borrowing(victim.team, needed, freed):
                continue
            chosen.append(victim)
            freed.add(victim)
            if not self._may_fit(wl, freed.total, reserved):
                continue  # not enough freed yet
            if self._fits(wl, freed, reserved, nominal_only):
                # drop victims that turned out unnecessary (most important first)
                for extra in sorted(chosen[:-1], key=lambda v: (-v.priority, v.admitted_at)):
                    freed.remove(extra)
                    if self._fits(wl, freed, reserved, nominal_only):
                        chosen.remove(extra)
                    else:
                        freed.add(extra)
                return chosen
        return []

    def _fits(self, wl: Workload, freed: Freed, reserved: dict | None, nominal_only: bool) -> bool:
        """Whether ``wl`` fits with ``freed`` given back (on a flavor where it stays within its team's nominal
        quota, when ``nominal_only``)."""
        team, request, reserved = self.teams[wl.team], wl.request, reserved or {}
        used, nominal = self.used[wl.team], team.nominal

        def beyond(resource: str, amount: float) -> bool:  # beyond its nominal quota, with ``freed`` given back
            return nominal_only and self._quoted(team, resource) and \
                used[resource] - freed.of(wl.team, resource) + amount > nominal.get(resource, 0.0) + 1e-9

        for resource, amount in (("cpu", request.cpu), ("memory", request.memory)):
            if amount and (amount > self.available(team, resource, freed) - reserved.get(resource, 0.0) + 1e-9
                           or beyond(resource, amount)):
                return False
        if not request.gpus:
            return True
        return any(not beyond(key, request.gpus) and
                   request.gpus <= self.available(team, key, freed) - reserved.get(key, 0.0) + 1e-9
                   for _, key in self._flavor_keys(team, request))

    def _still_borrowing(self, name: str, needed: tuple | None, freed: Freed) -> bool:
        """Whether team ``name`` uses more than its nominal quota of one of ``needed`` with ``freed`` given back."""
        used, nominal, given = self.used[name], self.teams[name].nominal, freed.by_team.get(name)
        for r in needed or ():
            if (r.startswith("gpu/") or r in nominal) and \
                    used[r] - (given.get(r, 0.0) if given else 0.0) > nominal.get(r, 0.0) + 1e-9:
                return True
        return False

    def _needed(self, wl: Workload, team: Team) -> tuple | None:
        """What ``wl`` may reclaim from its cohort's borrowers: the resources it would use within its team's
        nominal quota and is short of now (None: it reclaims nothing)."""
        if team.reclaim == "never" or not team.cohort:
            return None
        request, used, nominal = wl.request, self.used[team.name], team.nominal
        for resource, amount in (("cpu", request.cpu), ("memory", request.memory)):
            if amount and resource in nominal and used[resource] + amount > nominal[resource] + 1e-9:
                return None  # beyond its nominal quota on every flavor (:meth:`within_nominal`)
        # as Kueue: only what it is short of (a borrower of something else gives back nothing it lacks, and
        # reclaiming it anyway lets the two teams take turns preempting each other for ever)
        rooms, total, capacity = self._rooms(team), self.total_used, self.capacity
        short = []
        if request.gpus:
            gpus, within = request.gpus, False
            for _, key in self._flavor_keys(team, request):
                if used[key] + gpus <= nominal.get(key, 0.0) + 1e-9:  # a flavor it would use within its quota
                    within = True
                    if gpus > min(rooms[key], capacity[key] - total[key]) + 1e-9:
                        short.append(key)
            if not within:
                return None
        for resource, amount in (("cpu", request.cpu), ("memory", request.memory)):
            if amount and amount > min(rooms[resource], capacity.get(resource, 0.0) - total[resource]) + 1e-9:
                short.append(resource)
        return tuple(short) or None

    def _bound_for(self, wl: Workload | None, team: Team, priority: int, needed: tuple | None) -> dict[str, float]:
        """At most what preempting for a workload of ``team`` and ``priority`` could give back, by resource: what
        its team's lower priorities hold (remembered until the team's running jobs change), and when it
        reclaims ``needed``, what the cohort's borrowers hold (until the cohort changes)."""
        key, changes = ("within", team.name, priority), self._running_changes[team.name]
        hit = self._cache.get(key)
        if hit is None or hit[0] != changes:
            out: dict[str, float] = defaultdict(float)
            if team.within_team == "lower_priority":
                self._add_use(out, team.name, priority)
            hit = self._cache[key] = (changes, out)
        if needed is None:
            return hit[1]
        within = hit[1]
        key, changes = ("reclaim", team.name, priority, needed), (self._changes[team.cohort], within)
        hit = self._cache.get(key)
        if hit is None or hit[0][0] != changes[0] or hit[0][1] is not within:
            out = defaultdict(float, within)
            below = None if team.reclaim == "any" else priority
            for name in self.cohorts[team.cohort]:
                if name != team.name and self._running[name] and self._borrowing(self.teams[name], needed):
                    self._add_use(out, name, below)
            hit = self._cache[key] = (changes, out)
        return hit[1]

    def _add_use(self, out: dict[str, float], team: str, below: int | None) -> None:
        """Add to ``out`` what the running jobs of ``team`` hold, at priorities below ``below`` (None: all)."""
        for level, use in self._running_use[team].items():
            if below is None or level < below:
                for resource, amount in use.items():
                    out[resource] += amount

    def _may_fit(self, wl: Workload, bound: dict[str, float], reserved: dict | None) -> bool:
        """Whether ``wl`` could fit if ``bound`` were given back (stopping a job frees at most what it holds)."""
        team, request, reserved = self.teams[wl.team], wl.request, reserved or {}
        rooms, total, capacity = self._rooms(team), self.total_used, self.capacity
        for resource, amount in (("cpu", request.cpu), ("memory", request.memory)):
            if amount:
                free = capacity.get(resource, 0.0) - total[resource]
                if amount > min(rooms[resource], free) - reserved.get(resource, 0.0) + bound.get(resource, 0.0) + 1e-9:
                    return False
        if not request.gpus:
            return True
        for _, key in self._flavor_keys(team, request):
            if request.gpus <= min(rooms[key], capacity[key] - total[key]) - reserved.get(key, 0.0) \
                    + bound.get(key, 0.0) + 1e-9:
                return True
        return False

    def _candidates(self, team: Team, priority: int, needed: tuple | None,
                    admitted_now: set[str]) -> tuple[list, Freed]:
        """Who a workload of ``team`` and ``priority`` may preempt (its team's lower priorities, and when it
        reclaims ``needed`` resources, the jobs of cohort members that borrow them), and what they hold."""
        running = self._running_by_team()
        candidates: list[Workload] = []
        if team.within_team == "lower_priority":
            candidates += [v for v in running[team.name].values() if v.priority < priority and v.id not in admitted_now]
        if needed is not None:
            for name in self.cohorts[team.cohort]:
                if name == team.name or not running[name] or not self._borrowing(self.teams[name], needed):
                    continue
                candidates += [v for v in running[name].values() if v.id not in admitted_now and
                               (team.reclaim == "any" or v.priority < priority)]
        return candidates, Freed(candidates)

    def _running_by_team(self) -> dict[str, dict[str, Workload]]:
        """Admitted jobs that are not stopping, by team (what preemption may choose from), kept up to date."""
        return self._running

    def _borrowing(self, team: Team, resources: list[str]) -> bool:
        """Whether the team uses more than its nominal quota of one of ``resources``."""
        used, nominal = self.used[team.name], team.nominal
        for r in resources:
            if (r.startswith("gpu/") or r in nominal) and used[r] > nominal.get(r, 0.0) + 1e-9:  # quoted, beyond
                return True
        return False
