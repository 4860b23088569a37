"""GPU-aware culling on one machine: a notebook server that holds GPUs and uses them for nothing is stopped.

jupyterhub-idle-culler (:mod:`.culling`) stops a server whose user has done nothing for hours; a GPU server
idle for 15 minutes already keeps a device from a queue that waits for it (jupyterhub-idle-culler's issue
45). :func:`verdict` decides, for one server that holds devices, from evidence the user cannot write:

* every device it holds is sampled by NVML (the jobs service's samples, every 30 s), and none was busy
  (``threshold`` percent or more) in the last ``timeout`` seconds. A device with no recent sample
  (declared, simulated, NVML gone) is never called idle: the server is kept;
* the hub's ``last_activity`` of the server is as old: a busy kernel keeps it fresh (Danlu's server
  extension reports a busy kernel as activity), so a kernel computing on the CPU is not culled;
* its user has no job running: a server with a job attached is kept.

Then, ``warning`` seconds before the end, the server is *warned* (:meth:`GpuCuller.warnings`, which the
API serves to JupyterLab: the time left and how to keep the server), always and for the whole warning,
even when passes are further apart; once the time it was told has passed it is stopped through the hub's
API and a ``cull_gpu_server`` entry goes in the audit log. The timeout is ``hub.gpu_idle_timeout_seconds``
(15 minutes by default), or a profile's own ``gpu_idle_timeout_seconds``; 0 turns it off. Servers without
GPUs keep the idle culler's rules only.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import quote

from sqlalchemy import select

from danlu.hub.service.store import audit
from danlu.hub.service.store.orm import GpuSample, ServerUsage

STALE = 120.0  # seconds: a device whose newest sample is older is not measured now (4 samples at 30 s)
KEEP = (
    "Run something on the GPU, or release it: stop this server and start it again with a CPU profile "
    "(File > Hub Control Panel)."
)


@dataclass(frozen=True)
class Policy:
    timeout: float  # seconds idle before the server is stopped (0: never)
    warning: float = 300.0  # seconds before that, the user is warned
    threshold: float = 5.0  # percent of utilization that counts as busy
    stale: float = STALE  # seconds: a device whose newest sample is older is not measured now


@dataclass(frozen=True)
class Verdict:
    action: str  # "keep" | "warn" | "cull"
    idle_seconds: float = 0.0
    seconds_left: float = 0.0
    why: str = ""


def verdict(
    *,
    now: float,
    started: float,
    devices: list[int],
    samples: dict[int, list[tuple[float, float]]],
    last_activity: float | None,
    jobs_running: int,
    policy: Policy,
) -> Verdict:
    """What to do with one server (times in seconds since the epoch; ``samples``: per device, (time,
    utilization percent) pairs, at least those of the last ``policy.timeout`` seconds)."""
    if not devices or policy.timeout <= 0:
        return Verdict("keep", why="holds no GPU" if not devices else "GPU culling is off")
    if jobs_running:
        return Verdict("keep", why=f"a job of its user is running ({jobs_running})")
    busy_at = started
    for device in devices:
        points = samples.get(device) or []
        if not points or now - max(at for at, _ in points) > policy.stale:
            return Verdict("keep", why=f"GPU {device} is not measured (no recent NVML sample)")
        busy = [at for at, utilization in points if utilization >= policy.threshold]
        if busy:
            busy_at = max(busy_at, max(busy))
    if last_activity is not None:
        busy_at = max(busy_at, last_activity)
    idle = max(0.0, now - busy_at)
    left = policy.timeout - idle
    gpus = ", ".join(str(d) for d in devices)
    for_ = f"{idle:.0f} seconds" if idle < 120 else f"{idle / 60:.0f} minutes"
    why = f"GPU {gpus} idle for {for_} and no kernel busy"
    if left <= 0:
        return Verdict("cull", idle, 0.0, why)
    if left <= policy.warning:
        return Verdict("warn", idle, left, why)
    return Verdict("keep", idle, left, why)


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _epoch(value) -> float | None:
    if isinstance(value, dt.datetime):
        return value.replace(tzinfo=dt.timezone.utc).timestamp() if value.tzinfo is None else value.timestamp()
    if isinstance(value, str):
        try:
            return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def _holdings(s, since: dt.datetime) -> list[tuple]:
    """Servers holding GPUs now, and the samples of their devices since ``since``."""
    rows = [
        (r.holder, r.owner, r.profile, list(r.devices or []), r.started_at)
        for r in s.scalars(select(ServerUsage).where(ServerUsage.ended_at.is_(None)))
        if r.devices
    ]
    devices = {d for row in rows for d in row[3]}
    samples: dict[int, list[tuple[float, float]]] = {}
    if devices:
        for device, at, utilization in s.execute(
            select(GpuSample.device, GpuSample.at, GpuSample.utilization).where(
                GpuSample.device.in_(devices), GpuSample.at >= since
            )
        ):
            samples.setdefault(device, []).append((_epoch(at) or 0.0, float(utilization)))
    return [(*row, samples) for row in rows]


class GpuCuller:
    """The pass over GPU servers: warnings kept in memory for the API, stops through the hub, audit entries."""

    def __init__(
        self,
        database,
        policy_for: Callable[[str], Policy],
        user: Callable[[str], Awaitable[dict | None]],
        stop: Callable[[str, str], Awaitable[None]],
        jobs_running: Callable[[str], int],
        log: logging.Logger,
        window: float = 3600.0,
    ):
        self.database = database
        self.policy_for = policy_for  # profile slug -> its policy
        self.user = user  # hub user model (servers and their last_activity)
        self.stop = stop  # (user, server name) -> stop it through the hub
        self.jobs_running = jobs_running  # user -> running jobs
        self.log = log
        self.window = window  # seconds of samples read back: beyond the longest timeout, or a busy sample is missed
        self._warnings: dict[str, dict] = {}  # holder -> warning

    def warnings(self, user: str | None = None) -> list[dict]:
        """The servers warned now (``user``: only theirs), with the seconds left as of now."""
        now = dt.datetime.now(dt.timezone.utc).timestamp()
        out = []
        for w in self._warnings.values():
            if user is None or w["user"] == user:
                left = max(0.0, _epoch(w["cull_at"]) - now)  # type: ignore[operator]
                out.append({**w, "seconds_left": round(left)})
        return out

    async def pass_once(self, now: float | None = None) -> list[tuple[str, Verdict]]:
        now = dt.datetime.now(dt.timezone.utc).timestamp() if now is None else now
        since = dt.datetime.fromtimestamp(now - self.window, dt.timezone.utc).replace(tzinfo=None)
        held = await self.database.read(_holdings, since)
        out = []
        warned: dict[str, dict] = {}
        for holder, owner, profile, devices, started, samples in held:
            user, _, name = holder.partition(":")
            policy = self.policy_for(profile)
            facts = {
                "now": now,
                "started": _epoch(started) or now,
                "devices": devices,
                "samples": samples,
                "jobs_running": self.jobs_running(owner),
                "policy": policy,
            }
            decided = verdict(**facts, last_activity=None)
            if decided.action != "keep":  # the hub is asked only then: its activity can only keep the server
                model = await self.user(user)
                if model is None:
                    decided = Verdict("keep", why="the hub did not answer for its activity")
                else:
                    server = (model.get("servers") or {}).get(name, {})
                    decided = verdict(**facts, last_activity=_epoch(server.get("last_activity")))
            if decided.action in ("warn", "cull"):
                # warned first, always, for the whole warning: a server that went from kept to due between two
                # passes is warned now, and one warned is stopped only once the time it was told has passed
                earlier = self._warnings.get(holder)
                due = _epoch(earlier["cull_at"]) if earlier else None
                if due is None:
                    due = now + (decided.seconds_left if decided.action == "warn" else policy.warning)
                if decided.action == "cull" and earlier is not None and now >= due:
                    await self._cull(holder, user, name, devices, decided)
                else:
                    decided = Verdict("warn", decided.idle_seconds, max(0.0, due - now), decided.why)
                    warned[holder] = {
                        "server": holder,
                        "user": user,
                        "name": name,
                        "cull_at": _iso(due),
                        "idle_minutes": round(decided.idle_seconds / 60, 1),
                        "devices": devices,
                        "reason": decided.why,
                        "keep": KEEP,
                    }
            out.append((holder, decided))
        self._warnings = warned
        return out

    async def _cull(self, holder: str, user: str, name: str, devices: list[int], decided: Verdict) -> None:
        try:
            await self.stop(user, name)
        except Exception as e:  # noqa: BLE001 - the next pass tries again
            self.log.warning("stopping idle GPU server %s failed: %s", holder, e)
            return
        self.log.info("stopped server %s: %s", holder, decided.why)
        await self.database.write(
            audit.append,
            "danlu",
            "cull_gpu_server",
            holder,
            None,
            {"devices": devices, "idle_minutes": round(decided.idle_seconds / 60, 1), "reason": decided.why},
        )

    async def run_forever(self, every: float = 30.0) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await self.pass_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the next pass tries again
                self.log.warning("GPU culling pass failed: %s", e)


def for_service(manager, api_url: str, token: str, log: logging.Logger) -> GpuCuller | None:
    """The jobs service's culler (None where ``hub.gpu_idle_timeout_seconds`` is 0: off everywhere)."""
    hub = manager.settings.hub
    if not hub.gpu_idle_timeout_seconds:
        return None
    profiles = {p.slug: p for p in manager.profiles}

    def policy_for(slug: str) -> Policy:
        profile = profiles.get(slug)
        own = profile.gpu_idle_timeout_seconds if profile is not None else None
        timeout = hub.gpu_idle_timeout_seconds if own is None else own
        return Policy(
            float(timeout),
            float(hub.gpu_idle_warning_seconds),
            float(hub.gpu_idle_threshold_percent),
            max(STALE, 4 * manager.scheduler.sample_interval),
        )

    def jobs_running(owner: str) -> int:
        admitted = manager.core.model.admitted.values()
        return sum(1 for w in admitted if w.kind == "job" and w.owner == owner and not w.stopping)

    async def stop(user: str, name: str) -> None:
        # deferred: tornado's client is imported by the service already; only a culling service calls the hub here
        from tornado.httpclient import AsyncHTTPClient

        path = f"users/{quote(user, safe='')}/" + (f"servers/{quote(name, safe='')}" if name else "server")
        await AsyncHTTPClient().fetch(
            f"{api_url.rstrip('/')}/{path}",
            method="DELETE",
            headers={"Authorization": f"token {token}"},
            request_timeout=30,
        )

    timeouts = [hub.gpu_idle_timeout_seconds] + [p.gpu_idle_timeout_seconds or 0 for p in profiles.values()]
    window = max(timeouts) + max(STALE, 4 * manager.scheduler.sample_interval)
    return GpuCuller(manager.database, policy_for, manager.groups.user, stop, jobs_running, log, window)
