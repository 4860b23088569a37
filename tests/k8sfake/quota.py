"""The fake Kueue's arithmetic: quotas and usage, flavor assignment and classic preemption, as Kueue v0.19 does them.

:class:`View` is one scheduling cycle's snapshot of the ClusterQueues (flat cohorts: a cohort is the
``cohortName`` its members share and holds no quota of its own). What a queue may still use is
``ClusterQueueSnapshot.Available`` (``pkg/cache/scheduler/resource_node.go``): what it keeps for itself
(nominal quota above its ``lendingLimit``) plus what the cohort has left of what its members lend, capped by
its ``borrowingLimit``. :meth:`View.assign` picks a flavor per resource group like ``flavorassigner`` with
Danlu's ``flavorFungibility`` (the first flavor that fits, borrowing or not; when none does, the flavor
whose preemption is best: reclaim before priority preemption, then the least borrowing, then the first).
A flavor is tried only when the pod's ``nodeSelector`` agrees with the flavor's ``nodeLabels`` on their
common keys. :meth:`View.targets` is ``classicalPreemptions`` (``pkg/scheduler/preemption/preemption.go``
and ``classical/``): a workload may preempt only when its request fits its queue's nominal quota; the
candidates are its queue's lower priorities (``withinClusterQueue``) and the workloads of cohort members
above their nominal quota in what it needs (``reclaimWithinCohort``), the other queues' first, each lowest
priority and most recently admitted first; it removes them in that order while their queue is still above
its nominal quota until the workload fits (borrowing allowed or not, in the order Kueue tries), then puts
back, last but one first, those it can do without.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from ..k8sschemas import parse_quantity as quantity

ZERO = Fraction(0)
FIT, RECLAIM, PREEMPT, NO_CANDIDATES, NO_FIT = "fit", "reclaim", "preempt", "no candidates", "no fit"
RANK = {NO_FIT: 0, NO_CANDIDATES: 1, PREEMPT: 2, RECLAIM: 3, FIT: 4}  # Kueue's preemptionMode order


def show(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{round(value * 1000)}m"


@dataclass(eq=False)
class Admitted:
    """An admitted workload as preemption sees it: its queue, priority, when it got its quota, what it uses."""

    uid: str
    cq: str
    priority: int
    seq: int  # admission order: a higher one was admitted more recently
    usage: dict[tuple[str, str], Fraction]  # (flavor, resource) -> amount
    obj: dict = field(repr=False, default_factory=dict)


@dataclass
class Choice:
    """Where a workload would go: a flavor per resource, how (fit, or preempting ``targets``), and whether its
    queue would then borrow; ``reasons`` say why it does not fit."""

    mode: str
    flavors: dict[str, str] = field(default_factory=dict)
    borrows: bool = False
    targets: list[Admitted] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def requests(self, need: dict[str, Fraction]) -> dict[tuple[str, str], Fraction]:
        return {(self.flavors[r], r): amount for r, amount in need.items() if r in self.flavors}


class View:
    """The ClusterQueues, their usage and admitted workloads in one cycle, and Kueue's arithmetic on them."""

    def __init__(self, queues: list[dict], flavors: list[dict], admitted: list[Admitted]):
        self.queues = {q["metadata"]["name"]: q for q in queues}
        self.node_labels = {f["metadata"]["name"]: (f.get("spec") or {}).get("nodeLabels") or {} for f in flavors}
        # queue -> (flavor, resource) -> (nominal, borrowingLimit or None, lendingLimit or None)
        self.quota: dict[str, dict[tuple[str, str], tuple]] = {}
        self.groups: dict[str, list[tuple[list[str], list[str]]]] = {}
        for name, cq in self.queues.items():
            self.quota[name], self.groups[name] = {}, []
            for group in cq["spec"].get("resourceGroups") or []:
                self.groups[name].append((group["coveredResources"], [f["name"] for f in group["flavors"]]))
                for flavor in group["flavors"]:
                    for r in flavor["resources"]:
                        self.quota[name][(flavor["name"], r["name"])] = (
                            quantity(r["nominalQuota"]),
                            quantity(r["borrowingLimit"]) if "borrowingLimit" in r else None,
                            quantity(r["lendingLimit"]) if "lendingLimit" in r else None,
                        )
        self.usage: dict[str, dict[tuple[str, str], Fraction]] = {name: {} for name in self.queues}
        self.workloads: list[Admitted] = []  # the preemption candidates: admitted before this cycle
        self.evicted: set[str] = set()  # uids preempted in this cycle (still holding their quota)
        for wl in admitted:
            self.add(wl.cq, wl.usage, 1)
            self.workloads.append(wl)

    # --- quota arithmetic (flat cohorts) ---

    def add(self, cq: str, usage: dict[tuple[str, str], Fraction], sign: int) -> None:
        mine = self.usage.setdefault(cq, {})
        for key, amount in usage.items():
            mine[key] = mine.get(key, ZERO) + sign * amount

    def cohort(self, name: str) -> list[str]:
        cohort = self.queues[name]["spec"].get("cohortName")
        return [q for q, cq in self.queues.items() if cq["spec"].get("cohortName") == cohort] if cohort else [name]

    def path(self, name: str) -> str:
        """``/<cohort>/<queue>``, as Kueue's preemption messages name a queue (``buildCQPath``)."""
        cohort = self.queues[name]["spec"].get("cohortName")
        return f"/{cohort}/{name}" if cohort else f"/{name}"

    def used(self, name: str, key: tuple[str, str]) -> Fraction:
        return self.usage.get(name, {}).get(key, ZERO)

    def nominal(self, name: str, key: tuple[str, str]) -> Fraction:
        return self.quota[name].get(key, (ZERO, None, None))[0]

    def _kept(self, name: str, key: tuple[str, str]) -> Fraction:
        """What the queue never lends (``localQuota``): its nominal quota above its lending limit."""
        nominal, _, lending = self.quota[name].get(key, (ZERO, None, None))
        return max(ZERO, nominal - lending) if lending is not None else ZERO

    def _cohort_left(self, name: str, key: tuple[str, str]) -> Fraction:
        """What the cohort has left of what its members lend (its SubtreeQuota less its Usage)."""
        lent = sum((self.nominal(m, key) - self._kept(m, key) for m in self.cohort(name)), ZERO)
        used = sum((max(ZERO, self.used(m, key) - self._kept(m, key)) for m in self.cohort(name)), ZERO)
        return lent - used

    def available(self, name: str, key: tuple[str, str]) -> Fraction:
        """How much more of ``key`` the queue may use now (``ClusterQueueSnapshot.Available``)."""
        nominal, borrowing, _ = self.quota[name].get(key, (ZERO, None, None))
        used = self.used(name, key)
        if not self.queues[name]["spec"].get("cohortName"):
            return max(ZERO, nominal - used)
        kept = self._kept(name, key)
        parent = self._cohort_left(name, key)
        if borrowing is not None:
            parent = min(parent, (nominal - kept) - max(ZERO, used - kept) + borrowing)
        return max(ZERO, max(ZERO, kept - used) + parent)

    def potential(self, name: str, key: tuple[str, str]) -> Fraction:
        """The most of ``key`` the queue could ever use (``PotentialAvailable``)."""
        nominal, borrowing, _ = self.quota[name].get(key, (ZERO, None, None))
        if not self.queues[name]["spec"].get("cohortName"):
            return nominal
        most = self._kept(name, key) + sum((self.nominal(m, key) - self._kept(m, key) for m in self.cohort(name)), ZERO)
        return min(most, nominal + borrowing) if borrowing is not None else most

    def borrowing_with(self, name: str, key: tuple[str, str], amount: Fraction = ZERO) -> bool:
        return self.nominal(name, key) < self.used(name, key) + amount

    def within_nominal(self, name: str, keys) -> bool:
        return not any(self.borrowing_with(name, key) for key in keys)

    def reclaim(self, name: str) -> str:
        return (self.queues[name]["spec"].get("preemption") or {}).get("reclaimWithinCohort", "Never")

    def to_reserve(self, name: str, requests: dict[tuple[str, str], Fraction], borrows: bool):
        """What a workload that must preempt but found no one holds for the rest of the cycle when its queue cannot
        always reclaim (``quotaResourcesToReserve``): up to its nominal quota, or its borrowing limit if it borrows."""
        out = {}
        for key, amount in requests.items():
            nominal, borrowing, _ = self.quota[name].get(key, (ZERO, None, None))
            if not borrows:
                out[key] = max(ZERO, min(amount, nominal - self.used(name, key)))
            else:
                out[key] = amount if borrowing is None else min(amount, nominal + borrowing - self.used(name, key))
        return out

    def matches(self, flavor: str, selector: dict[str, str]) -> bool:
        """The pod's nodeSelector agrees with the flavor's nodeLabels on the keys the flavor has."""
        labels = self.node_labels.get(flavor, {})
        return all(selector[k] == v for k, v in labels.items() if k in selector)

    def why_not(self, name: str, key: tuple[str, str], amount: Fraction) -> str:
        flavor, resource = key
        most = self.potential(name, key)
        if amount > most:
            return (
                f"insufficient quota for {resource} in flavor {flavor}, request > maximum capacity "
                f"({show(amount)} > {show(most)})"
            )
        return (
            f"insufficient unused quota for {resource} in flavor {flavor}, "
            f"{show(amount - self.available(name, key))} more needed"
        )

    # --- flavor assignment ---

    def assign(self, name: str, need: dict[str, Fraction], selector: dict[str, str], priority: int) -> Choice:
        """Where a workload of queue ``name`` asking ``need`` would go now: fit, preempt, or neither."""
        choice = Choice(FIT)
        for resource in need:
            if not any(resource in covered for covered, _ in self.groups[name]):
                choice.reasons.append(f"resource {resource} unavailable in ClusterQueue")
        if choice.reasons:
            choice.mode = NO_FIT
            return choice
        for covered, flavors in self.groups[name]:
            wanted = [r for r in covered if r in need]
            if not wanted:
                continue
            best: Choice | None = None
            for flavor in flavors:
                if not self.matches(flavor, selector):
                    choice.reasons.append(f"flavor {flavor} doesn't match node affinity")
                    continue
                option = self._try_flavor(name, {(flavor, r): need[r] for r in wanted}, priority)
                option.flavors = {r: flavor for r in wanted}
                choice.reasons += option.reasons
                if best is None or _preferred(option, best):
                    best = option
                if option.mode == FIT:  # whenCanBorrow: MayStopSearch; whenCanPreempt: TryNextFlavor
                    break
            if best is None or best.mode == NO_FIT:
                choice.mode = NO_FIT
                return choice
            choice.flavors.update(best.flavors)
            choice.borrows = choice.borrows or best.borrows
            if RANK[best.mode] < RANK[choice.mode]:
                choice.mode = best.mode
        if choice.mode in (RECLAIM, PREEMPT):
            choice.targets = self.targets(
                name,
                choice.requests(need),
                priority,
                {key for key in choice.requests(need) if need[key[1]] > self.available(name, key)},
            )
            choice.mode = _mode(name, choice.targets)
        return choice

    def _try_flavor(self, name: str, requests: dict[tuple[str, str], Fraction], priority: int) -> Choice:
        """One flavor for one resource group (``fitsResourceQuota`` per resource, the worst one counts)."""
        option = Choice(FIT)
        for key, amount in requests.items():
            if amount > self.potential(name, key):
                option.reasons.append(self.why_not(name, key, amount))
                return Choice(NO_FIT, reasons=option.reasons)
            if amount <= self.available(name, key):
                option.borrows = option.borrows or self.borrowing_with(name, key, amount)
                continue
            option.reasons.append(self.why_not(name, key, amount))
            if amount > self.nominal(name, key):  # no borrowWithinCohort: no preemption for more than nominal
                return Choice(NO_FIT, reasons=option.reasons)
            targets = self.targets(name, {key: amount}, priority, {key})  # the preemption oracle
            mode = _mode(name, targets)
            if RANK[mode] < RANK[option.mode]:
                option.mode = mode
            removed = [self._remove(t) for t in targets]
            option.borrows = option.borrows or self.borrowing_with(name, key, amount)
            for t in removed:
                self._restore(t)
        return option

    # --- classic preemption ---

    def _remove(self, wl: Admitted) -> Admitted:
        self.add(wl.cq, wl.usage, -1)
        return wl

    def _restore(self, wl: Admitted) -> None:
        self.add(wl.cq, wl.usage, 1)

    def fits(self, name: str, requests: dict[tuple[str, str], Fraction], borrowing: bool = True) -> bool:
        return all(
            (borrowing or not self.borrowing_with(name, key, amount)) and amount <= self.available(name, key)
            for key, amount in requests.items()
        )

    def fits_without(self, name: str, requests: dict[tuple[str, str], Fraction], gone: list[Admitted]) -> bool:
        """Whether the requests fit once ``gone`` have given their quota back."""
        removed = [self._remove(wl) for wl in gone]
        try:
            return self.fits(name, requests)
        finally:
            for wl in removed:
                self._restore(wl)

    def targets(
        self, name: str, requests: dict[tuple[str, str], Fraction], priority: int, keys: set[tuple[str, str]]
    ) -> list[Admitted]:
        """``classicalPreemptions``: whom a workload of queue ``name`` and ``priority`` asking ``requests`` would
        preempt, short of ``keys``; [] if it cannot fit."""
        policy = self.queues[name]["spec"].get("preemption") or {}
        within, reclaim = policy.get("withinClusterQueue", "Never"), policy.get("reclaimWithinCohort", "Never")

        def allowed(rule: str, wl: Admitted) -> bool:
            return rule == "Any" or rule == "LowerPriority" and wl.priority < priority

        def uses(wl: Admitted) -> bool:
            return any(key in wl.usage for key in keys)

        def order(wl: Admitted):  # CandidatesOrdering: evicted first, lowest priority, most recently admitted
            return (wl.uid not in self.evicted, wl.priority, -wl.seq, wl.uid)

        same = sorted(
            (w for w in self.workloads if w.cq == name and within != "Never" and uses(w) and allowed(within, w)),
            key=order,
        )
        others: list[Admitted] = []
        advantage = False
        if self.queues[name]["spec"].get("cohortName") and reclaim != "Never":
            # hierarchical advantage: the request fits the queue's own nominal quota at its usage now
            advantage = all(
                self.used(name, key) + amount <= self.nominal(name, key) for key, amount in requests.items()
            )
            others = sorted(
                (
                    w
                    for w in self.workloads
                    if w.cq != name
                    and w.cq in self.cohort(name)
                    and uses(w)
                    and not self.within_nominal(w.cq, keys)
                    and allowed(reclaim, w)
                ),
                key=order,
            )
        if not others or not all(self.nominal(name, key) > self.used(name, key) for key in keys):
            attempts = [True]  # only its own queue's lower priorities, borrowing allowed
        elif not advantage:
            attempts = [False, True]  # reclaim without borrowing (no borrowWithinCohort), then its own, borrowing
        else:
            attempts = [True, False]
        candidates = others + same
        for borrowing in attempts:
            chosen: list[Admitted] = []
            for wl in candidates:
                if wl.cq != name and ((borrowing and not advantage) or self.within_nominal(wl.cq, keys)):
                    continue  # ReclaimWithoutBorrowing while borrowing, or its queue no longer borrows
                chosen.append(self._remove(wl))
                if self.fits(name, requests, borrowing):
                    for i in range(len(chosen) - 2, -1, -1):  # fillBackWorkloads
                        self._restore(chosen[i])
                        if self.fits(name, requests, borrowing):
                            chosen[i] = chosen[-1]
                            chosen.pop()
                        else:
                            self._remove(chosen[i])
                    for victim in chosen:
                        self._restore(victim)
                    return chosen
            for victim in chosen:
                self._restore(victim)
        return []


def _mode(name: str, targets: list[Admitted]) -> str:
    if not targets:
        return NO_CANDIDATES
    return PREEMPT if any(t.cq == name for t in targets) else RECLAIM


def _preferred(a: Choice, b: Choice) -> bool:
    """``isPreferred`` with no preference set: a better mode, then less borrowing (BorrowingOverPreemption)."""
    if RANK[a.mode] != RANK[b.mode]:
        return RANK[a.mode] > RANK[b.mode]
    return not a.borrows and b.borrows
