"""The backlog: the pending workloads the admission model has seen, kept sorted between passes.

The service hands :meth:`~danlu.hub.service.admission.model.Model.cycle` every
pending workload on every pass. Grouping and sorting them anew each time is a
look at each one in Python, which is what made a pass over 10,000 pending jobs
slow. The backlog keeps them instead in **groups** of alike workloads (same
team, priority and request; the oldest first, in a heap) and the groups in
**asks** (same team and request, whatever the priority; the highest priority
first). A pass only finds out what changed since the previous one, with set
operations on the workloads themselves (they hash by identity), so it costs
C-speed work in the number of pending workloads and Python work in the number
of changes and of groups.

A workload changes its place only through
:meth:`~danlu.hub.service.admission.workloads.Workload.reprioritize`, which the backlog
notices (it sorts everything again). A copy of a model starts with an empty
backlog: it is a cache, filled on the copy's first pass.
"""

from __future__ import annotations

import bisect
import heapq
import itertools

from danlu.hub.service.admission import workloads
from danlu.hub.service.admission.workloads import Workload

DETACHED = -1  # a pending workload in no group (a preemptor, considered on its own)


class Group:
    """Pending workloads of one team, priority and request, oldest first (a heap with lazy deletion)."""

    __slots__ = ("gid", "ask", "priority", "heap", "size")

    def __init__(self, gid: int, ask: int, priority: int):
        self.gid = gid
        self.ask = ask
        self.priority = priority
        self.heap: list[tuple] = []  # (created, id, serial, workload); entries of removed workloads linger
        self.size = 0

    def head(self, live: dict[Workload, int]) -> Workload | None:
        """The oldest workload still in the group, or None."""
        heap = self.heap
        while heap:
            wl = heap[0][3]
            if live.get(wl) == self.gid:
                return wl
            heapq.heappop(heap)
        return None

    def members(self, live: dict[Workload, int]) -> list[Workload]:
        return [entry[3] for entry in self.heap if live.get(entry[3]) == self.gid]


class Backlog:
    """Pending workloads by group and ask, brought up to date with each pass's list (:meth:`sync`)."""

    def __init__(self):
        self.live: dict[Workload, int] = {}  # every pending workload -> its group (or DETACHED)
        self.members: set[Workload] = set()  # the same workloads
        self.ids: dict[str, int] = {}  # the same, by id: what a pass's Waiting reads
        self.by_id: dict[str, Workload] = {}
        self.groups: dict[int, Group] = {}
        self.asks: dict[int, list[Group]] = {}  # ask -> its groups, highest priority first
        self.emptied: set[int] = set()  # asks with a group that became empty
        self.detached: set[Workload] = set()  # pending workloads in no group
        self._serial = itertools.count()
        self._edits = workloads._EDITS[0]

    def __deepcopy__(self, memo) -> Backlog:
        return Backlog()

    def sync(self, pending: list[Workload]) -> None:
        """Make the backlog hold exactly ``pending``."""
        if self._edits != workloads._EDITS[0]:  # a priority changed in place: sort everything again
            self.__init__()
        members = self.members
        gone = members.copy()
        gone.difference_update(pending)  # in C: a copy, and one look-up per pending workload
        for wl in gone:
            self.remove(wl)
        new = len(pending) - len(members)  # at least as many as are new (more if ``pending`` repeats one)
        if new > 0:  # new workloads are mostly at the end of the list: look from there
            for wl in reversed(pending):
                if wl not in members:
                    self._add(wl)
                    new -= 1
                    if not new:
                        break

    def _add(self, wl: Workload) -> None:
        gid = self._join(wl)
        live_before = self.by_id.get(wl.id)
        if live_before is not None and live_before in self.live:  # the caller replaced it: the new one counts
            self.remove(live_before)
        self.live[wl] = gid
        self.members.add(wl)
        self.ids[wl.id] = gid
        self.by_id[wl.id] = wl

    def remove(self, wl: Workload) -> None:
        """``wl`` is no longer pending (admitted, or gone from the caller's list)."""
        gid = self.live.pop(wl)
        self.members.discard(wl)
        if self.by_id.get(wl.id) is wl:
            del self.ids[wl.id]
            del self.by_id[wl.id]
        if gid == DETACHED:
            self.detached.discard(wl)
            return
        group = self.groups[gid]
        group.size -= 1
        if group.size == 0:
            group.heap.clear()
            self.emptied.add(group.ask)
        elif len(group.heap) > 2 * group.size + 8:  # mostly entries of removed workloads: rebuild
            group.heap = [e for e in group.heap if self.live.get(e[3]) == gid]
            heapq.heapify(group.heap)

    def detach(self, wl: Workload) -> None:
        """Take a pending workload out of its group (it is considered on its own from now on)."""
        gid = self.live.get(wl)
        if gid is None or gid == DETACHED:
            return
        self.live[wl] = self.ids[wl.id] = DETACHED
        self.detached.add(wl)
        group = self.groups[gid]
        group.size -= 1
        if group.size == 0:
            group.heap.clear()
            self.emptied.add(group.ask)

    def attach(self, wl: Workload) -> None:
        """Put a detached workload back in its group (it is considered with its alike ones again)."""
        if self.live.get(wl) == DETACHED:
            self.detached.discard(wl)
            self.live[wl] = self.ids[wl.id] = self._join(wl)

    def _join(self, wl: Workload) -> int:
        """Count ``wl`` in its group (made when missing), and return the group's id."""
        gid = wl.group
        group = self.groups.get(gid)
        if group is None:
            group = self.groups[gid] = Group(gid, wl.ask, wl.priority)
            ask = self.asks.setdefault(wl.ask, [])
            ask.insert(bisect.bisect([-g.priority for g in ask], -wl.priority), group)
        heapq.heappush(group.heap, (wl.created, wl.id, next(self._serial), wl))
        group.size += 1
        return gid

    def tidy(self) -> None:
        """Drop the groups that became empty (and asks left with none)."""
        for ask in self.emptied:
            groups = self.asks.get(ask)
            if groups is None:
                continue
            for g in groups:
                if g.size == 0:
                    del self.groups[g.gid]
            groups[:] = [g for g in groups if g.size]
            if not groups:
                del self.asks[ask]
        self.emptied.clear()
