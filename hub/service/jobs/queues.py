"""Operating the queues: what every queue holds, and the admins' live changes.

:class:`Queues` answers ``GET /queues`` (quota, use, borrowing and waiting
jobs of every team; it names no one's jobs, so everyone may read it) and
carries out the admin operations: a live change of a team's quota or limits
(validated against the schema of danlu.yaml's teams), a reset to danlu.yaml,
a hold, the drain, and a new priority for a job. Each is recorded with an
audit record in the transaction of the change, then a pass runs.
"""

from __future__ import annotations

from danlu.errors import Conflict, DanluError, NotFound, ValidationError
from danlu.hub.service import validation
from danlu.hub.service.admission import quotas
from danlu.hub.service.auth import require_admin
from danlu.hub.service.jobs.core import Core, overrides_of
from danlu.hub.service.jobs.scheduler import Scheduler
from danlu.hub.service.states import FINAL, JobState
from danlu.hub.service.store import audit
from danlu.hub.service.store.database import Database
from danlu.hub.service.store.orm import Flag, Job, QueueSetting, isoformat, utcnow


class Queues:
    def __init__(self, core: Core, scheduler: Scheduler, *, database: Database, settings, inventory):
        self.core = core
        self.scheduler = scheduler
        self.database = database
        self.settings = settings
        self.inventory = inventory

    def _team(self, name: str):
        if name not in self.core.model.teams:
            raise NotFound(f"no queue '{name}'", field="name", fix=f"queues: {', '.join(self.core.model.teams)}")
        return self.core.model.teams[name]

    async def overrides(self) -> dict:
        return await self.database.read(overrides_of)

    async def list(self) -> list[dict]:
        """Every queue: quota, use, borrowing, held; everyone may see them (no other user's jobs)."""
        core = self.core
        specs = quotas.team_specs(self.settings, await self.overrides())
        pending = core.pending_by_queue()
        out = []
        for team in core.model.teams.values():
            usage = {r: v for r, v in core.model.used[team.name].items() if v}
            spec = specs.get(team.name, {})
            out.append(
                {
                    "name": team.name,
                    "cohort": team.cohort,
                    "held": team.held,
                    "quota": spec.get("quota") or gpu_amounts(team.nominal),
                    "borrowing_limit": spec.get("borrowing_limit") or {},
                    "lending_limit": spec.get("lending_limit") or {},
                    "usage": gpu_amounts(usage),
                    "pending": pending.get(team.name, 0),
                    "running": sum(1 for w in core.model.admitted.values() if w.team == team.name and w.kind == "job"),
                    "servers": sum(
                        1 for w in core.model.admitted.values() if w.team == team.name and w.kind == "server"
                    ),
                    "borrowing": {
                        k[4:]: v - team.nominal.get(k, 0)
                        for k, v in usage.items()
                        if k.startswith("gpu/") and v > team.nominal.get(k, 0)
                    },
                }
            )
        return out

    async def _one(self, name: str) -> dict:
        return next(q for q in await self.list() if q["name"] == name)

    def _danlu_admits(self, what: str) -> None:
        """Queue changes act on Danlu's own admission model; a backend that queues itself has its own."""
        if self.scheduler.owns_queues:
            raise Conflict(
                f"{what} is Kueue's on this workbench (jobs run on Kubernetes)",
                reason="kueue_owns_queues",
                fix="edit the teams in danlu.yaml, then danlu render k8s and kubectl apply -f kueue.yaml "
                "(or edit the ClusterQueue: spec.stopPolicy Hold holds it)",
            )

    async def change(self, principal, name: str, changes) -> dict:
        """Change a team's quota or limits live (validated against the schema of danlu.yaml's teams)."""
        require_admin(principal)
        self._danlu_admits(f"queue {name}'s quota")
        self._team(name)
        core = self.core
        if not self.settings.teams:
            raise Conflict(
                "the default queue holds the whole machine; define teams in danlu.yaml to set quotas", reason="no_teams"
            )
        validation.check_team_change(changes, core.model.devices)
        async with core.lock:
            await self.database.write(_change, self.settings, self.inventory, principal.name, name, changes)
            await self.scheduler.rebuild_locked()
        await self.scheduler.schedule()
        return await self._one(name)

    async def reset(self, principal, name: str) -> dict:
        """Drop an admin's live changes to a queue: danlu.yaml's values apply again."""
        require_admin(principal)
        self._danlu_admits(f"queue {name}'s quota")
        self._team(name)
        async with self.core.lock:
            await self.database.write(_reset, self.settings, principal.name, name)
            await self.scheduler.rebuild_locked()
        await self.scheduler.schedule()
        return await self._one(name)

    async def hold(self, principal, name: str, held: bool) -> dict:
        require_admin(principal)
        self._danlu_admits(f"holding queue {name}")
        team = self._team(name)
        async with self.core.lock:
            await self.database.write(_hold, principal.name, name, held)
            team.held = held
        await self.scheduler.schedule()
        return await self._one(name)

    async def drain(self, principal, on: bool) -> dict:
        require_admin(principal)
        core = self.core
        async with core.lock:
            await self.database.write(_drain, principal.name, on, core.draining)
            core.draining = on
        await self.scheduler.schedule()
        return {"draining": on}

    async def reprioritize(self, principal, job: Job, priority: str) -> None:
        require_admin(principal)
        self._danlu_admits("a submitted job's priority")
        if JobState(job.state) in FINAL:
            raise Conflict(f"job {job.id} already ended ({job.state})", reason="already_final")
        core = self.core
        name, value = quotas.priority_of(self.settings, priority)
        async with core.lock:
            await self.database.write(_reprioritize, principal.name, job.id, name, value)
            for wl in (core.pending.get(job.id), core.model.admitted.get(job.id)):
                if wl is not None:
                    wl.reprioritize(value)
        await self.scheduler.schedule()


def gpu_amounts(resources: dict) -> dict:
    out: dict = {}
    for key, value in resources.items():
        if key.startswith("gpu/"):
            out.setdefault("gpus", {})[key[4:]] = value
        else:
            out[key] = value
    return out


def _merge(current: dict, change: dict) -> dict:
    out = {**current, **{k: v for k, v in change.items() if k != "gpus"}}
    if "gpus" in change:
        out["gpus"] = {**(current.get("gpus") or {}), **change["gpus"]}
    return out


# database work (runs on the database thread pool) ---------------------------------------------
def _change(s, settings, inventory, actor: str, name: str, changes: dict) -> None:
    row = s.get(QueueSetting, name) or QueueSetting(name=name, changes={}, held=False)
    overrides = overrides_of(s)
    current = quotas.team_specs(settings, overrides).get(name, {})
    # a change names what changes: other flavors, cpu and memory keep their values
    merged = {section: _merge(current.get(section) or {}, amounts) for section, amounts in changes.items()}
    after = {**row.changes, **merged}
    try:  # the model is built from it at every rebuild and restart: refuse what it cannot be built from
        quotas.build_model(settings, inventory, {**overrides, name: {**after, "held": row.held}})
    except (DanluError, ValueError, ArithmeticError) as e:
        raise ValidationError(
            f"this change cannot be applied: {str(e)[:300]}",
            field=next(iter(changes), "body"),
            reason="invalid_quota",
            fix="give amounts this machine can hold",
        ) from None
    row.changes = after
    s.merge(row)
    audit.append(s, actor, "change_quota", name, before={k: current.get(k) for k in changes}, after=merged)


def _reset(s, settings, actor: str, name: str) -> None:
    row = s.get(QueueSetting, name)
    before = dict(row.changes) if row else {}
    if row is not None:
        row.changes = {}
    audit.append(
        s, actor, "reset_quota", name, before=before, after={k: (settings.teams.get(name) or {}).get(k) for k in before}
    )


def _hold(s, actor: str, name: str, held: bool) -> None:
    row = s.get(QueueSetting, name) or QueueSetting(name=name, changes={}, held=False)
    before = row.held
    row.held = held
    s.merge(row)
    audit.append(s, actor, "hold" if held else "release", name, before={"held": before}, after={"held": held})


def _drain(s, actor: str, on: bool, before: bool) -> None:
    flag = s.get(Flag, "drain") or Flag(key="drain", value={})
    flag.value = {"on": on, "by": actor, "at": isoformat(utcnow())}
    s.merge(flag)
    audit.append(
        s, actor, "drain" if on else "undrain", "workbench", before={"draining": before}, after={"draining": on}
    )


def _reprioritize(s, actor: str, job_id: str, name: str, value: int) -> None:
    row = s.get(Job, job_id)
    before = {"priority": row.priority_class, "value": row.priority}
    row.priority_class, row.priority = name, value
    audit.append(s, actor, "reprioritize", job_id, before=before, after={"priority": name, "value": value})
