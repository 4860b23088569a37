"""What the admission model decides about: requests, teams, workloads, and a pass's decision.

Plain data with the few derived values the model leans on in its hot loop
(a workload's group of alike workloads, what it asks for as resource
amounts). A workload is an entity: it compares and hashes by identity, so the
model can keep the pending ones in sets between passes
(:mod:`danlu.hub.service.admission.backlog`). :mod:`danlu.hub.service.admission.model` holds the
model itself.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import ItemsView, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter

INF = math.inf
SERVER_PRIORITY = 1 << 40  # notebook servers are never preempted
_GROUPS: dict[tuple, int] = {}  # (team, priority, request) -> a small int: workloads that are alike
_ASKS: dict[tuple, int] = {}  # (team, request) -> a small int: what decides fit, reasons and borrowing
_by_age = attrgetter("created", "id")
_EDITS = [0]  # bumped when a workload's priority changes: a backlog sorted by it must be sorted again


def gpu_key(flavor: str | None) -> str:
    return f"gpu/{flavor}"


def gib(amount: float) -> str:
    """Bytes as people read them: ``6 GiB``, ``1.5 GiB``."""
    return "unlimited" if amount == INF else f"{amount / 2**30:.3g} GiB"


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


@dataclass(eq=False)
class Workload:
    """A job or a server, pending or admitted. Its team, priority, creation time and request place it in the
    queue; change its priority only with :meth:`reprioritize` (the model keeps pending workloads sorted)."""

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
    checkpointed_at: float = 0.0  # when it last saved a checkpoint (0: never), on the clock of admitted_at
    stopping: bool = False  # preempted, its processes are being stopped
    stopping_for: str = ""  # the workload it was preempted for
    _group: int = field(default=-1, repr=False, compare=False)
    _ask: int = field(default=-1, repr=False, compare=False)
    _usage: tuple | None = field(default=None, repr=False, compare=False)  # (flavor, usage)

    @property
    def group(self) -> int:
        """Workloads of one team, priority and request are alike: if the oldest does not fit, none does."""
        if self._group < 0:
            self._group = _GROUPS.setdefault((self.team, self.priority, self.request), len(_GROUPS))
        return self._group

    @property
    def ask(self) -> int:
        """Workloads of one team and request fit (or not) alike, whatever their priority."""
        if self._ask < 0:
            self._ask = _ASKS.setdefault((self.team, self.request), len(_ASKS))
        return self._ask

    def work_at_risk(self, now: float) -> float:
        """Seconds of work stopping it now would lose: since its last checkpoint, or since it started this
        attempt when that is later (a checkpoint of an earlier attempt is where this one began). Not clamped
        at 0, so that it orders workloads as their times do whatever ``now`` a caller passes."""
        return now - max(self.admitted_at, self.checkpointed_at)

    def reprioritize(self, priority: int) -> None:
        self.priority = priority
        self._group = -1
        _EDITS[0] += 1

    def usage(self) -> dict[str, float]:
        """What it holds while admitted, by resource (the same dict each time: do not change it)."""
        if self._usage is None or self._usage[0] != self.flavor:
            out = {"cpu": self.request.cpu, "memory": self.request.memory}
            if self.request.gpus:
                out[gpu_key(self.flavor)] = self.request.gpus
            self._usage = (self.flavor, out)
        return self._usage[1]


class Waiting(MutableMapping):
    """id -> why a workload waits, as one pass left it: one reason per group of alike workloads (they wait for
    the same thing, see :attr:`Workload.group`) and the reasons of workloads that have their own (a preemptor).

    A look-up is two dict look-ups; the pass writes one entry per group, not one per waiting workload. It reads
    and compares like a dict; what is set later (the service adds the jobs it holds in back-off) is kept apart.
    """

    def __init__(
        self,
        groups: dict[str, int] | None = None,
        reasons: dict[int, str] | None = None,
        own: dict[str, str] | None = None,
    ):
        self._groups = groups or {}  # id -> group, a copy the pass owns
        self._reasons = reasons or {}  # group -> reason, or its two parts
        self._own: dict[str, str | tuple[str, str]] = {}
        for wid, reason in (own or {}).items():
            self[wid] = reason

    def __getitem__(self, wid: str) -> str:
        reason = self._own.get(wid)
        if reason is None:
            reason = self._reasons[self._groups[wid]]
        return reason if isinstance(reason, str) else reason[0] + reason[1]  # (what, where the team stands)

    def __setitem__(self, wid: str, reason: str | tuple[str, str]) -> None:
        self._groups.pop(wid, None)
        self._own[wid] = reason

    def __delitem__(self, wid: str) -> None:
        if self._own.pop(wid, None) is None:
            del self._groups[wid]

    def __contains__(self, wid: object) -> bool:
        return wid in self._own or wid in self._groups

    def __iter__(self) -> Iterator[str]:
        return chain(self._own, self._groups)

    def items(self) -> ItemsView:
        return _WaitingItems(self)

    def _pairs(self) -> Iterator[tuple[str, str]]:
        """(id, reason) for every waiting workload, each group's reason joined once."""
        words = {
            gid: reason if isinstance(reason, str) else reason[0] + reason[1] for gid, reason in self._reasons.items()
        }
        own = ((wid, reason if isinstance(reason, str) else reason[0] + reason[1]) for wid, reason in self._own.items())
        return chain(own, zip(self._groups.keys(), map(words.__getitem__, self._groups.values()), strict=True))

    def __len__(self) -> int:
        return len(self._own) + len(self._groups)

    def __repr__(self) -> str:
        return repr(dict(self))


class _WaitingItems(ItemsView):
    _mapping: Waiting

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return self._mapping._pairs()


@dataclass
class Decision:
    admitted: list[Workload] = field(default_factory=list)
    preempted: list[tuple[Workload, Workload]] = field(default_factory=list)  # (victim, for whom)
    waiting: Mapping[str, str] = field(default_factory=dict)  # id -> human reason (a dict, or a pass's Waiting)
    pending: list[Workload] = field(default_factory=list, repr=False)
    _positions: dict[str, int] | None = field(default=None, repr=False)

    @property
    def positions(self) -> dict[str, int]:
        """id -> place in its team's queue (1 = next), by priority then age; computed when first asked."""
        if self._positions is None:
            self._positions = {}
            counts: dict[str, int] = defaultdict(int)
            for wl in sorted(self.pending, key=lambda w: (-w.priority, w.created, w.id)):
                if wl.id in self.waiting:
                    counts[wl.team] += 1
                    self._positions[wl.id] = counts[wl.team]
        return self._positions
