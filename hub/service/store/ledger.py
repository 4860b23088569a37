"""The GPU ledger: which device is held by which job or notebook server.

One table (:class:`~danlu.hub.service.store.orm.Allocation`) keyed by device
index, shared by jobs and servers, so a device is never given twice and a
server's GPUs count like a job's. All methods work inside the caller's
database session; the caller commits, so an admission that allocates devices
and marks a job running is one transaction.
"""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from danlu.hub.gpus import GPU
from danlu.hub.service.store.orm import Allocation


class Ledger:
    def __init__(self, inventory: list[GPU]):
        self.inventory = list(inventory)
        self.by_index = {g.index: g for g in self.inventory}

    @property
    def total(self) -> int:
        return len(self.inventory)

    def allocations(self, session: Session) -> list[Allocation]:
        return list(session.scalars(select(Allocation).order_by(Allocation.device)))

    def held_by(self, session: Session, kind: str, holder: str) -> list[int]:
        return list(
            session.scalars(
                select(Allocation.device)
                .where(Allocation.holder_kind == kind, Allocation.holder_id == holder)
                .order_by(Allocation.device)
            )
        )

    def claim(self, session: Session, device: int, kind: str, holder: str, owner: str, flavor: str | None) -> None:
        """Record that a device (chosen by the admission model) is held; a second claim fails on the key."""
        session.add(
            Allocation(
                device=device,
                holder_kind=kind,
                holder_id=holder,
                owner=owner,
                flavor=flavor or self.by_index[device].flavor,
            )
        )
        session.flush()

    def release(self, session: Session, kind: str, holder: str) -> list[int]:
        devices = self.held_by(session, kind, holder)
        session.execute(delete(Allocation).where(Allocation.holder_kind == kind, Allocation.holder_id == holder))
        return devices
