"""What the admission model decides about: requests, teams, workloads, and a pass's decision.

Plain data with the few derived values the model leans on in its hot loop
(a workload's group of alike workloads, what it asks for as resource
amounts). :mod:`danlu.hub.service.admission` holds the model itself.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from operator import attrgetter

INF = math.inf
SERVER_PRIORITY = 1 << 40  # notebook servers are never preempted
_GROUPS: dict[tuple, int] = {}  # (team, priority, request) -> a small int: workloads that are alike
_ASKS: dict[tuple, int] = {}  # (team, request) -> a small int: what decides fit, reasons and borrowing
_by_age = attrgetter("created", "id")


def gpu_key(flavor: str) -> str:
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
    _group: int = field(default=-1, repr=False, compare=False)
    _ask: int = field(default=-1, repr=False, compare=False)

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

    def reprioritize(self, priority: int) -> None:
        self.priority = priority
        self._group = -1

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
    pending: list[Workload] = field(default_factory=list, repr=False)
    _positions: dict[str, int] | None = field(default=None, repr=False)

    @property
    def positions(self) -> dict[str, int]:
        """id -> place in its team's queue (1 = next), by priority then age; computed when first asked."""
        if self._positions is None:
            self._positions, counts = {}, defaultdict(int)
            for wl in sorted(self.pending, key=lambda w: (-w.priority, w.created, w.id)):
                if wl.id in self.waiting:
                    counts[wl.team] += 1
                    self._positions[wl.id] = counts[wl.team]
        return self._positions
