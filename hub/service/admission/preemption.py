"""Preemption for the admission model: whom a workload that does not fit may stop, as Kueue decides it.

:func:`victims` chooses them from the model's books (:class:`~.model.Model`). Candidates are lower-priority
jobs of the preemptor's own team (``within_team``) and, when it fits its team's nominal quota, jobs of cohort
members that borrow what it needs (``reclaim``). As in Kueue's classic preemption, the borrowers' jobs go
first, then its own team's, each lowest priority and newest first; a borrower's job counts only while that
team still uses more than its nominal quota of what is reclaimed, and the preemptor must then fit within its
own; failing that, only its own team's jobs, the preemptor allowed to borrow. Before any of that, a bound on
what the candidates hold (:func:`_bound_for`, cached per team and per cohort) rules out most hopeless
attempts cheaply. Which workloads look for victims at all is the pass's business (:func:`.cycle.run`: one
preemptor per cohort and pass). :class:`Freed` is what a set of victims would give back, by team and in
total, as the capacity arithmetic takes it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

from danlu.hub.service.admission.workloads import Team, Workload

if TYPE_CHECKING:
    from danlu.hub.service.admission.model import Model


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


def victims(
    m: Model,
    wl: Workload,
    reserved: dict[str, float] | None = None,
    admitted_now: AbstractSet[str] = frozenset(),
    now: float = 0.0,
) -> list[Workload]:
    """The fewest workloads to stop so that ``wl`` fits, per its team's policies; [] if none.

    Among candidates of one priority, those that would lose the least work go first: the freshest
    checkpoint, or the most recent start where none is fresher (:meth:`Workload.work_at_risk` at the pass's
    ``now``). Without checkpoints that is Kueue's order, most recently admitted first; with them Danlu
    departs from Kueue, which does not know checkpoints (kueue#477).

    Only the victims chosen here count as freed (not those stopping for another workload), what
    starving workloads hold back stays held back, and a workload admitted in this pass is no victim:
    so preemption never repeats for the same capacity."""
    if not reserved:  # what failed at one priority fails at a lower one too (fewer candidates)
        hopeless = m._cache.get(("hopeless", wl.ask))
        if (
            hopeless is not None
            and hopeless[0] == m._version
            and wl.priority <= hopeless[1]
            and hopeless[2] in (None, m._pass)
        ):
            return []
    team = m.teams[wl.team]
    needed = _needed(m, wl, team)
    if not _may_fit(m, wl, _bound_for(m, wl, team, wl.priority, needed), reserved):
        if not reserved:  # stopping all it may preempt would not be enough, in any pass until the books change
            m._cache[("hopeless", wl.ask)] = (m._version, wl.priority, None)
        return []
    # who it may preempt changes only with what its cohort admits, releases and preempts
    changes = m._changes[team.cohort or team.name]
    key, when = ("candidates", wl.team, wl.priority, needed), (m._pass, changes)
    hit = m._cache.get(key)
    if hit is None or hit[0] != when:
        hit = m._cache[key] = (when, _candidates(m, team, wl.priority, needed, admitted_now))
    candidates, everyone = hit[1]
    if not candidates or m.fit(wl, everyone, reserved, everyone.rooms(m, team))[0] is False:
        if not reserved:  # not enough in this pass: its admissions are no candidates now, but are in the next
            m._cache[("hopeless", wl.ask)] = (m._version, wl.priority, m._pass)
        return []
    # Kueue's classic preemption: what other teams borrow first, then its own team's lower priorities,
    # newest and least important first, a job of another team only while that team still borrows what the
    # preemptor reclaims, and the preemptor then within its nominal quota; failing that, only its own
    # team's, the preemptor allowed to borrow. "Newest" is the least work lost: the freshest checkpoint
    order = lambda v: (v.priority, v.work_at_risk(now), -v.created, v.id)
    mine = sorted((v for v in candidates if v.team == wl.team), key=order)
    theirs = sorted((v for v in candidates if v.team != wl.team), key=order)
    if theirs:
        chosen = _targets(m, wl, theirs + mine, reserved, needed, nominal_only=True)
        if chosen:
            return chosen
    return _targets(m, wl, mine, reserved, needed, nominal_only=False) if mine else []


def _targets(
    m: Model, wl: Workload, candidates: list[Workload], reserved: dict | None, needed: tuple | None, nominal_only: bool
) -> list[Workload]:
    """The first of ``candidates`` that, stopped, let ``wl`` fit (within its team's nominal quota when
    ``nominal_only``), less those that turned out unnecessary; [] if they never do. A job of another team
    counts only while that team still uses more than its nominal quota of a resource in ``needed``."""
    chosen: list[Workload] = []
    freed = Freed()
    for victim in candidates:
        if victim.team != wl.team and not _still_borrowing(m, victim.team, needed, freed):
            continue
        chosen.append(victim)
        freed.add(victim)
        if not _may_fit(m, wl, freed.total, reserved):
            continue  # not enough freed yet
        if _fits(m, wl, freed, reserved, nominal_only):
            # drop victims that turned out unnecessary (most important first)
            for extra in sorted(chosen[:-1], key=lambda v: (-v.priority, v.admitted_at)):
                freed.remove(extra)
                if _fits(m, wl, freed, reserved, nominal_only):
                    chosen.remove(extra)
                else:
                    freed.add(extra)
            return chosen
    return []


def _fits(m: Model, wl: Workload, freed: Freed, reserved: dict | None, nominal_only: bool) -> bool:
    """Whether ``wl`` fits with ``freed`` given back (on a flavor where it stays within its team's nominal
    quota, when ``nominal_only``)."""
    team, request, reserved = m.teams[wl.team], wl.request, reserved or {}
    used, nominal = m.used[wl.team], team.nominal

    def beyond(resource: str, amount: float) -> bool:  # beyond its nominal quota, with ``freed`` given back
        return (
            nominal_only
            and m._quoted(team, resource)
            and used[resource] - freed.of(wl.team, resource) + amount > nominal.get(resource, 0.0) + 1e-9
        )

    for resource, amount in (("cpu", request.cpu), ("memory", request.memory)):
        if amount and (
            amount > m.available(team, resource, freed) - reserved.get(resource, 0.0) + 1e-9 or beyond(resource, amount)
        ):
            return False
    if not request.gpus:
        return True
    return any(
        not beyond(key, request.gpus) and request.gpus <= m.available(team, key, freed) - reserved.get(key, 0.0) + 1e-9
        for _, key in m._flavor_keys(team, request)
    )


def _still_borrowing(m: Model, name: str, needed: tuple | None, freed: Freed) -> bool:
    """Whether team ``name`` uses more than its nominal quota of one of ``needed`` with ``freed`` given back."""
    used, nominal, given = m.used[name], m.teams[name].nominal, freed.by_team.get(name)
    for r in needed or ():
        if (r.startswith("gpu/") or r in nominal) and used[r] - (given.get(r, 0.0) if given else 0.0) > nominal.get(
            r, 0.0
        ) + 1e-9:
            return True
    return False


def _needed(m: Model, wl: Workload, team: Team) -> tuple | None:
    """What ``wl`` may reclaim from its cohort's borrowers: the resources it would use within its team's
    nominal quota and is short of now (None: it reclaims nothing)."""
    if team.reclaim == "never" or not team.cohort:
        return None
    request, used, nominal = wl.request, m.used[team.name], team.nominal
    for resource, amount in (("cpu", request.cpu), ("memory", request.memory)):
        if amount and resource in nominal and used[resource] + amount > nominal[resource] + 1e-9:
            return None  # beyond its nominal quota on every flavor (:meth:`within_nominal`)
    # as Kueue: only what it is short of (a borrower of something else gives back nothing it lacks, and
    # reclaiming it anyway lets the two teams take turns preempting each other for ever)
    rooms, total, capacity = m._rooms(team), m.total_used, m.capacity
    short = []
    if request.gpus:
        gpus, within = request.gpus, False
        for _, key in m._flavor_keys(team, request):
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


def _bound_for(m: Model, wl: Workload | None, team: Team, priority: int, needed: tuple | None) -> dict[str, float]:
    """At most what preempting for a workload of ``team`` and ``priority`` could give back, by resource: what
    its team's lower priorities hold (remembered until the team's running jobs change), and when it
    reclaims ``needed``, what the cohort's borrowers hold (until the cohort changes)."""
    key, changes = ("within", team.name, priority), m._running_changes[team.name]
    hit = m._cache.get(key)
    if hit is None or hit[0] != changes:
        out: dict[str, float] = defaultdict(float)
        if team.within_team == "lower_priority":
            _add_use(m, out, team.name, priority)
        hit = m._cache[key] = (changes, out)
    if needed is None:
        return hit[1]
    within = hit[1]
    key, changes = ("reclaim", team.name, priority, needed), (m._changes[team.cohort], within)
    hit = m._cache.get(key)
    if hit is None or hit[0][0] != changes[0] or hit[0][1] is not within:
        out = defaultdict(float, within)
        below = None if team.reclaim == "any" else priority
        for name in m.cohorts[team.cohort]:
            if name != team.name and m._running[name] and _borrowing(m, m.teams[name], needed):
                _add_use(m, out, name, below)
        hit = m._cache[key] = (changes, out)
    return hit[1]


def _add_use(m: Model, out: dict[str, float], team: str, below: int | None) -> None:
    """Add to ``out`` what the running jobs of ``team`` hold, at priorities below ``below`` (None: all)."""
    for level, use in m._running_use[team].items():
        if below is None or level < below:
            for resource, amount in use.items():
                out[resource] += amount


def _may_fit(m: Model, wl: Workload, bound: dict[str, float], reserved: dict | None) -> bool:
    """Whether ``wl`` could fit if ``bound`` were given back (stopping a job frees at most what it holds)."""
    team, request, reserved = m.teams[wl.team], wl.request, reserved or {}
    rooms, total, capacity = m._rooms(team), m.total_used, m.capacity
    for resource, amount in (("cpu", request.cpu), ("memory", request.memory)):
        if amount:
            free = capacity.get(resource, 0.0) - total[resource]
            if amount > min(rooms[resource], free) - reserved.get(resource, 0.0) + bound.get(resource, 0.0) + 1e-9:
                return False
    if not request.gpus:
        return True
    for _, key in m._flavor_keys(team, request):
        if (
            request.gpus
            <= min(rooms[key], capacity[key] - total[key]) - reserved.get(key, 0.0) + bound.get(key, 0.0) + 1e-9
        ):
            return True
    return False


def _candidates(
    m: Model, team: Team, priority: int, needed: tuple | None, admitted_now: set[str]
) -> tuple[list, Freed]:
    """Who a workload of ``team`` and ``priority`` may preempt (its team's lower priorities, and when it
    reclaims ``needed`` resources, the jobs of cohort members that borrow them), and what they hold."""
    running = _running_by_team(m)
    candidates: list[Workload] = []
    if team.within_team == "lower_priority":
        candidates += [v for v in running[team.name].values() if v.priority < priority and v.id not in admitted_now]
    if needed is not None:
        for name in m.cohorts[team.cohort]:
            if name == team.name or not running[name] or not _borrowing(m, m.teams[name], needed):
                continue
            candidates += [
                v
                for v in running[name].values()
                if v.id not in admitted_now and (team.reclaim == "any" or v.priority < priority)
            ]
    return candidates, Freed(candidates)


def _running_by_team(m: Model) -> dict[str, dict[str, Workload]]:
    """Admitted jobs that are not stopping, by team (what preemption may choose from), kept up to date."""
    return m._running


def _borrowing(m: Model, team: Team, resources: list[str]) -> bool:
    """Whether the team uses more than its nominal quota of one of ``resources``."""
    used, nominal = m.used[team.name], team.nominal
    for r in resources:
        if (r.startswith("gpu/") or r in nominal) and used[r] > nominal.get(r, 0.0) + 1e-9:  # quoted, beyond
            return True
    return False
