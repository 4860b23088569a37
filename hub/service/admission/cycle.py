"""One admission pass, in Kueue's order: what starts, what is preempted, what waits and why.

:func:`run` decides over every pending workload, with the model's books (:class:`~.model.Model`):

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
* a **cohort preempts for one workload per pass** (a team in no cohort counts as a
  cohort of its own): once a workload of the cohort has chosen victims, the cohort's
  other workloads that do not fit wait, with what they lack as their reason, and look
  for victims in a later pass, where the first of them in the order above goes first.
  Kueue v0.9 did likewise (and also stopped a cohort's preemptions after an admission
  in it, which Danlu does not: a busy cohort would never preempt); Kueue v0.19 only
  skips a preemption whose victims overlap another's in the same cycle. A cohort's
  preemptions thus take a pass each, which keeps a pass after many jobs ended from
  trying victims for every workload that does not fit. Where this and the rest of the
  model still differ from Kueue v0.19, ``tests/test_kueue_parity.py`` says how.

The pass's own state (who reclaims what in this pass, which cohorts preempted) lives on the model, so a copy
of the model (a dry run, an estimate) decides alike. Pure: no I/O, no clock.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import TYPE_CHECKING

from danlu.hub.service.admission import preemption
from danlu.hub.service.admission import reasons as wording  # a pass calls its own "reasons" (by group)
from danlu.hub.service.admission.workloads import INF, Decision, Waiting, Workload, gpu_key

if TYPE_CHECKING:
    from danlu.hub.service.admission.model import Model


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


def ask_of(m: Model, wl: Workload) -> Ask:
    ask = m._asks.get(wl.ask)
    if ask is None:
        ask = m._asks[wl.ask] = Ask(m, wl)
    return ask


def run(m: Model, pending: list[Workload], now: float, preempt: bool = True) -> Decision:
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
    backlog = m._backlog
    backlog.sync(pending)
    live = backlog.live
    m._pass += 1
    decision = Decision(pending=list(pending))
    # team -> priority -> what starving workloads of that priority hold back from the team's others
    reserved: dict[str, dict[int, dict[str, float]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    serial = 0
    heap: list[tuple] = []
    # cohort -> team -> what its waiting preemptors need: no other team's borrower takes it in this pass
    m._reclaiming = {}
    m._preempted_in = set()
    m._held_for_others = False
    if m.nominated or backlog.detached:
        m.nominated = {wid for wid in m.nominated if wid in backlog.by_id}
        for wl in [w for w in backlog.detached if w.id not in m.nominated]:
            backlog.attach(wl)  # its preemption is over: it waits with its alike ones again
        for wid in m.nominated:
            wl = backlog.by_id[wid]
            backlog.detach(wl)
            serial += 1
            heap.append((0, -wl.priority, wl.created, wl.id, serial, wl, None, 0, ask_of(m, wl)))
    # group -> why its workloads wait: words, or [workload, resource short], worded once the pass is done
    reasons: dict[int, object] = {}
    raised: list[tuple[list, Ask]] = []  # those lists, with their asks
    backlog.tidy()
    asks = m._asks
    for groups in backlog.asks.values():
        wl = groups[0].head(live)
        ask = asks.get(groups[0].ask) or ask_of(m, wl)
        serial += 1
        heap.append(
            (
                2 if ask.cohort and _borrows_now(m, ask) else 1,
                -wl.priority,
                wl.created,
                wl.id,
                serial,
                wl,
                groups,
                0,
                ask,
            )
        )
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
            if preempt and ask.circle not in m._preempted_in:  # it may look for victims
                if wl.team in failed and ask.never is None:
                    short = _short_like(m, wl, failed[wl.team])
                    if short is not None:  # a smaller ask of its team found no room and nothing to preempt
                        reason = [wl, short]
                        raised.append((reason, ask))
                        _wait_alike(m, groups, index, ask, reason, now, reserved, reasons, live)
                        continue
            elif ask.never is None and ask.team is not None and not ask.team.held:
                short = _short_of(m, wl, ask, short_of)
                if short is not None:  # it does not fit, and looks for no victims in this pass
                    reason = reasons[groups[index].gid] = [wl, short]
                    raised.append((reason, ask))
                    if now - wl.created > m.starvation_seconds:
                        _hold(ask, wl.priority, reserved)
                    failed[wl.team].append(reason)
                    if index + 1 < len(groups):
                        _wait_alike(m, groups, index + 1, ask, reason, now, reserved, reasons, live)
                    continue
        reason = _consider(m, wl, ask, now, preempt, decision, reserved, admitted_now)
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
            nxt, index = _next_of(groups, index, live)
            if nxt is not None:
                serial += 1
                heapq.heappush(heap, (order, -nxt.priority, nxt.created, nxt.id, serial, nxt, groups, index, ask))
            continue
        reasons[groups[index].gid] = reason
        if wl.id in m.nominated:  # it preempted: a lower priority of its ask may preempt others
            nxt, index = _next_of(groups, index + 1, live)
            if nxt is not None:
                serial += 1
                heapq.heappush(heap, (order, -nxt.priority, nxt.created, nxt.id, serial, nxt, groups, index, ask))
            continue
        # (short because of what another team's preemptors hold back: says nothing of asks that do not borrow)
        if type(reason) is list and not m._held_for_others:
            failed[wl.team].append(reason)
            _found_short(m, short_of, *reason)
        if index + 1 < len(groups):
            _wait_alike(m, groups, index + 1, ask, reason, now, reserved, reasons, live)
    # alike groups share one reason: [workload, resource short] becomes [what it waits for, where its team
    # stands], worded from the state after the pass, once for all of them (a Waiting joins the two when read)
    states: dict[tuple[str, str], str] = {}
    for reason, ask in raised:
        wl, resource = reason
        what = ask.what.get(resource)
        if what is None:
            what = ask.what[resource] = "waiting" if resource is None else wording.waits_for(wl, resource)
        if resource is None or resource == "gpu":  # these words say it all
            reason[0], reason[1] = what, ""
            continue
        state = states.get((ask.name, resource))
        if state is None:
            state = states[ask.name, resource] = ": " + wording.standing(m, ask.team, resource)
        reason[0], reason[1] = what, state
    decision.waiting = Waiting(backlog.ids.copy(), reasons, own)
    return decision


def _next_of(groups: list, index: int, live: dict) -> tuple[Workload | None, int]:
    """The oldest workload of the first group from ``index`` on that holds one, and that group's index."""
    while index < len(groups):
        wl = groups[index].head(live)
        if wl is not None:
            return wl, index
        index += 1
    return None, index


def _short_like(m: Model, wl: Workload, failed: list[list]) -> str | None:
    """The resource ``wl`` is short of, when an ask of its team that it dominates already found no room
    and nothing to preempt in this pass: then ``wl`` fits nowhere either (it asks for at least as much
    of everything, on no other flavor, at no higher priority: more is held back from it) and may preempt
    no more (fewer of its team's jobs have a lower priority, and whatever it could reclaim from borrowers
    the smaller ask could reclaim too). Room only shrinks in a pass, so the smaller ask's answer holds."""
    mine = wl.request
    for other, short in failed:
        theirs = other.request
        if (
            wl.priority > other.priority
            or mine.cpu < theirs.cpu
            or mine.memory < theirs.memory
            or (mine.cpu and not theirs.cpu)
            or (mine.memory and not theirs.memory)
        ):
            continue
        if theirs.gpus:
            if mine.gpus < theirs.gpus or not (
                mine.gpu_flavor == theirs.gpu_flavor
                or theirs.gpu_flavor is None
                and mine.gpu_flavor in _flavor_set(m, other)
            ):
                continue
            if mine.gpu_flavor and short.startswith("gpu/"):
                short = gpu_key(mine.gpu_flavor)
        elif mine.gpus:
            continue
        return short
    return None


def _found_short(m: Model, short_of: dict, wl: Workload, resource: str | None) -> None:
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
        for _, key in m._flavor_keys(m.teams[wl.team], request):
            facts.setdefault(key, []).append((wl.priority, request.gpus))


def _short_of(m: Model, wl: Workload, ask: Ask, short_of: dict[str, dict]) -> str | None:
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
                rooms = m._rooms(ask.team)
            if amount > min(rooms[resource], m.capacity[resource] - m.total_used[resource]) + 1e-9:
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
            rooms = m._rooms(ask.team)
        if gpus > min(rooms[key], m.capacity[key] - m.total_used[key]) + 1e-9:
            raw[key] = gpus
            continue
        for level, least in held.get(key, ()):
            if level >= priority and gpus >= least:
                break
        else:
            return None
    return ask.keys[0][1] if ask.keys else None


def _flavor_set(m: Model, wl: Workload) -> frozenset:
    key = ("flavor set", wl.team, wl.request.gpu_flavor)
    found = m._static.get(key)
    if found is None:
        found = m._static[key] = frozenset(m._flavors(m.teams[wl.team], wl.request))
    return found


def _wait_alike(
    m: Model, groups: list, start: int, ask: Ask, reason: object, now: float, reserved: dict, reasons: dict, live: dict
) -> None:
    """Lower priorities of an ask (its groups from ``start`` on) whose first group does not fit and may preempt
    nothing: they wait for the same reason, and when it is a shortage (not a held queue, not an impossible
    ask), the starving first workloads among them hold back what they need from their team's others, as if
    each were tried."""
    starving = now - m.starvation_seconds if type(reason) is list else None  # created before: starving
    for index in range(start, len(groups)):
        group = groups[index]
        if group.size:
            reasons[group.gid] = reason
            if starving is not None and group.heap[0][0] < starving:  # the top is at most as old as the oldest
                if group.head(live).created < starving:
                    _hold(ask, group.priority, reserved)


def _consider(
    m: Model,
    wl: Workload,
    ask: Ask,
    now: float,
    preempt: bool,
    decision: Decision,
    reserved: dict,
    admitted_now: set[str],
) -> object:
    """Admit ``wl`` (None), or preempt for it, or say why it waits (words, or what ``reason`` words)."""
    team = ask.team
    if team is None or team.held:
        return f"queue {wl.team} is held by an admin" if team else f"no team {wl.team}"
    never = ask.never
    if never:
        return f"{never}: it can never start"
    held_back = _held_back(reserved[wl.team], wl.priority) if wl.team in reserved else None
    flavor, why = m.fit(wl, reserved=held_back)
    m._held_for_others = False
    reclaiming = m._reclaiming.get(team.cohort) if team.cohort and flavor is not False else None
    if reclaiming and any(name != wl.team for name in reclaiming) and not m.within_nominal(wl, flavor):
        # it would borrow what another team's waiting preemptors need: admitted, it would be their next
        # victim, and they would preempt one borrower after another for ever. It fits only without that.
        held_back = defaultdict(float, held_back or {})
        for name, needs in reclaiming.items():
            if name != wl.team:
                for resource, amount in needs.items():
                    held_back[resource] += amount
        m._held_for_others = True
        flavor, why = m.fit(wl, reserved=held_back)
    if flavor is not False:
        decision.admitted.append(m._admit(wl, flavor, now))
        admitted_now.add(wl.id)
        m.nominated.discard(wl.id)
        return None
    reason: object = [wl, why]  # worded once the pass is done (see cycle)
    if wl.id in m.nominated and wl.id in m._cached(
        ("preemptors",), lambda: {v.stopping_for for v in m.admitted.values() if v.stopping}
    ):
        reason = "waiting for the jobs it preempted to stop"
    elif preempt and ask.circle not in m._preempted_in:
        victims = preemption.victims(m, wl, held_back, admitted_now, now)
        for victim in victims:
            m._run(victim, -1.0)
            m._changes[team.cohort or team.name] += 1
            victim.stopping = True
            victim.stopping_for = wl.id
            decision.preempted.append((victim, wl))
        if victims:
            m._version += 1  # the victims are no longer candidates
            m._preempted_in.add(ask.circle)
            m.nominated.add(wl.id)
            reason = f"preempting {len(victims)} job(s) to start"
        elif wl.id in m.nominated:
            # its victims have stopped and it finds no more: its preemption is over, and it no longer holds
            # back from its cohort's borrowers what it needs (held for good, it could stall them for ever)
            m.nominated.discard(wl.id)
    if wl.id in m.nominated or now - wl.created > m.starvation_seconds:
        _hold(ask, wl.priority, reserved)
    if wl.id in m.nominated and team.cohort:  # and one that preempted, from its cohort's borrowers
        mine = m._reclaiming.setdefault(team.cohort, {}).setdefault(wl.team, defaultdict(float))
        for resource, amount in m._needs(wl).items():
            mine[resource] += amount
    return reason


def _hold(ask: Ask, priority: int, reserved: dict) -> None:
    """A workload of ``ask`` and ``priority`` (starving, or one that preempted: its victims free only part of
    what it needs) holds back what it needs from its team's workloads of the same or a lower priority."""
    if ask.needs:
        held = reserved[ask.name][priority]
        for resource, amount in ask.needs.items():
            held[resource] += amount


def _held_back(reserved: dict[int, dict[str, float]], priority: int) -> dict[str, float]:
    """What starving workloads of the same or a higher priority hold back from one of ``priority``."""
    out: dict[str, float] = defaultdict(float)
    for level, needs in reserved.items():
        if level >= priority:
            for resource, amount in needs.items():
                out[resource] += amount
    return out


def _borrows_now(m: Model, ask: Ask) -> bool:
    """:meth:`_borrows` for a workload of ``ask``, whose team is in a cohort: :meth:`within_nominal` for
    each of its flavors, with CPU and memory looked at once."""
    used, nominal = m.used[ask.name], ask.team.nominal
    if (
        ask.cpu
        and "cpu" in nominal
        and used["cpu"] + ask.cpu > nominal["cpu"] + 1e-9
        or ask.memory
        and "memory" in nominal
        and used["memory"] + ask.memory > nominal["memory"] + 1e-9
    ):
        return True
    if not ask.gpus:
        return False
    for _, key in ask.keys:
        if used[key] + ask.gpus <= nominal.get(key, 0.0) + 1e-9:
            return False
    return True
