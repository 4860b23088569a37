"""Notebook servers' GPUs: reserved from their owner's team quota, now or never.

The spawner asks for a server's GPUs before the server starts
(``POST /allocations``) and gives them back when it stops. :class:`Servers`
admits them through the same model and ledger as jobs
(:meth:`~danlu.hub.service.admission.model.Model.try_server`), so a server's GPUs
count against its team like a job's, and records the use for usage reports.
Servers never queue: no room is a ``409 gpus_busy`` with the model's reason.
It also lists servers that hold GPUs and have been idle, for admins.
"""

from __future__ import annotations

import datetime as dt
import time

from sqlalchemy import select

from danlu.errors import Conflict, PolicyError
from danlu.hub.service.admission import quotas
from danlu.hub.service.admission.workloads import Request, Workload
from danlu.hub.service.jobs.core import Core
from danlu.hub.service.jobs.scheduler import Scheduler
from danlu.hub.service.store.database import Database
from danlu.hub.service.store.ledger import Ledger
from danlu.hub.service.store.orm import ServerUsage, utcnow


class Servers:
    def __init__(self, core: Core, scheduler: Scheduler, *, database: Database, settings, ledger: Ledger, groups):
        self.core = core
        self.scheduler = scheduler
        self.database = database
        self.settings = settings
        self.ledger = ledger
        self.groups = groups

    async def allocate(self, holder: str, owner: str, gpus: int, profile: str = "", groups=()) -> list[int]:
        """Reserve GPUs for a server from its owner's team quota, now or never (servers do not queue)."""
        core = self.core
        settings = self.settings
        team = quotas.DEFAULT_QUEUE
        if settings.teams:
            mine = [t for t in settings.teams if t in set(groups)]
            if not mine:
                raise PolicyError(
                    f"{owner} is in no team, so has no GPU quota for a server",
                    reason="no_team",
                    field="gpus",
                    fix="ask an admin to add you to a team, or start without GPUs",
                )
            team = mine[0]
        async with core.lock:
            await self._release_locked(holder)
            server = Workload(
                f"server:{holder}", team, 1 << 40, time.time(), Request(gpus, None, 0.0, 0.0), owner, kind="server"
            )
            ok, why = core.model.try_server(server)
            if not ok:
                raise Conflict(
                    f"no room for {gpus} GPUs for the server: {why.removeprefix('waiting for ')}",
                    reason="gpus_busy",
                    field="gpus",
                    fix="pick fewer GPUs, or wait for jobs to finish",
                )
            try:
                await self.database.write(
                    _claim, self.ledger, holder, owner, team, profile, server.flavor, list(server.devices)
                )
            except Exception:
                core.model.release(server.id)
                raise
            self.scheduler.observe()
        return list(server.devices)

    async def _release_locked(self, holder: str) -> None:
        self.core.model.release(f"server:{holder}")
        await self.database.write(_release, self.ledger, holder)

    async def release(self, holder: str) -> None:
        async with self.core.lock:
            await self._release_locked(holder)
        await self.scheduler.schedule()

    async def idle(self) -> list[dict]:
        """Servers holding GPUs with no activity for ``usage.idle_server_minutes``, for admins to act on
        (the idle culler stops any server after ``hub.idle_timeout_seconds``)."""
        minutes = self.settings.usage.idle_server_minutes
        holding = await self.database.read(_holding)
        idle = []
        for holder, owner, team, devices in holding:
            user, _, name = holder.partition(":")
            model = await self.groups.user(user)
            server = ((model or {}).get("servers") or {}).get(name, {})
            last = server.get("last_activity")
            if not isinstance(last, str):
                continue
            try:
                seen = dt.datetime.fromisoformat(last.replace("Z", "+00:00")).astimezone(dt.timezone.utc)
            except ValueError:
                continue
            quiet = (dt.datetime.now(dt.timezone.utc) - seen).total_seconds() / 60
            if quiet >= minutes:
                idle.append(
                    {
                        "server": holder,
                        "owner": owner,
                        "team": team,
                        "gpus": len(devices),
                        "devices": devices,
                        "idle_minutes": round(quiet, 1),
                    }
                )
        return idle


# database work (runs on the database thread pool) ---------------------------------------------
def _claim(s, ledger, holder: str, owner: str, team: str, profile: str, flavor, devices: list[int]) -> None:
    for device in devices:
        ledger.claim(s, device, "server", holder, owner, flavor)
    s.add(ServerUsage(holder=holder, owner=owner, team=team, profile=profile, flavor=flavor, devices=devices))


def _release(s, ledger, holder: str) -> None:
    ledger.release(s, "server", holder)
    for row in s.scalars(select(ServerUsage).where(ServerUsage.holder == holder, ServerUsage.ended_at.is_(None))):
        row.ended_at = utcnow()


def _holding(s) -> list[tuple]:
    return [
        (r.holder, r.owner, r.team, list(r.devices))
        for r in s.scalars(select(ServerUsage).where(ServerUsage.ended_at.is_(None)))
    ]
