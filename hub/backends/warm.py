"""Runner processes of the local backend, and the pool of warm ones.

Every attempt runs in one runner process (``python -m danlu.runner``) that
waits on its stdin for a launch message (the job, the attempt, the runner
API's address and the attempt's token) before it does anything. A *warm*
runner (``--warm KERNEL``) has imported papermill and MLflow and started a
kernel of a profile beforehand and says ``ready`` on stdout, so a
single-process job handed to it skips the interpreter start, the imports and
the kernel start. Because the service records a runner's pid before it sends
the launch message, a service killed in between leaves either no runner for
the attempt or one it knows: a runner that sees end-of-file instead of a
launch message exits (with its kernel).

Each runner carries its own marker, ``DANLU_RUNNER_ID``, in its environment
from its start, and so does every kernel it starts: whatever a runner leaves
when it dies can be found and ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable

from danlu import env, proctree


class RunnerProcess:
    """One started runner, waiting for its launch message on stdin."""

    def __init__(self, proc: asyncio.subprocess.Process, runner_id: str, kernel_name: str | None, uid: int):
        self.proc = proc
        self.runner_id = runner_id
        self.kernel_name = kernel_name  # None: cold, it starts its kernel after the launch
        self.uid = uid
        self.ready = asyncio.get_running_loop().create_future()
        self.started = time.monotonic()
        if kernel_name is None:
            self.ready.set_result(True)

    @property
    def warm(self) -> bool:
        return self.kernel_name is not None

    async def watch(self) -> None:
        """Wait for a warm runner's ``ready`` (or its end)."""
        try:
            line = await self.proc.stdout.readline()
        except Exception:  # pragma: no cover - pipe torn down
            line = b""
        if not self.ready.done():
            self.ready.set_result(line.strip() == b"ready")

    @property
    def usable(self) -> bool:
        return self.ready.done() and self.ready.result() and self.proc.returncode is None

    async def launch(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        await self.proc.stdin.drain()
        self.proc.stdin.close()

    def marker(self) -> dict:
        return {env.RUNNER_ID: self.runner_id}

    async def stop(self) -> None:
        """End an unused runner and its kernel."""
        if self.proc.returncode is None:
            with contextlib.suppress(Exception):
                self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except asyncio.TimeoutError:
                pass
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: proctree.kill_matching(self.proc.pid, None, self.marker(), grace=1, uid=self.uid)
        )


Spawn = Callable[[str | None, object], Awaitable[RunnerProcess]]


class WarmPool:
    """Warm runners per (kernel, account): started on demand, topped up after each use, reaped when unused.

    *Demand* is a job taking a runner of a key, or :meth:`top_up` (a user's server starting, or a
    job of that kernel). A key is kept at ``size`` runners while it has demand; once it has had
    none for ``idle_seconds`` its runners are stopped and it is not refilled until the next
    demand, so an idle workbench holds no runner and no kernel. At most ``max_total`` runners
    wait in all pools together and at most ``max_per_account`` for one Unix account: at the
    total cap a key with newer demand takes the place of the runner whose key was used least
    recently.
    """

    def __init__(
        self,
        spawn: Spawn,
        size: int,
        idle_seconds: float = 600.0,
        max_total: int = 4,
        max_per_account: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.spawn = spawn
        self.size = size
        self.idle_seconds = idle_seconds
        self.max_total = max_total
        self.max_per_account = max_per_account
        self.clock = clock
        self.closing = False
        self._pool: dict[tuple, list[RunnerProcess]] = {}
        self._demand: dict[tuple, float] = {}  # key -> when it was last used or asked for
        self._reaper: asyncio.Task | None = None

    @staticmethod
    def _key(kernel_name: str, account) -> tuple:
        return kernel_name, account.uid if account is not None else None

    def count(self, key: tuple | None = None) -> int:
        """Runners waiting (in one key's pool, or in all)."""
        if key is not None:
            return len(self._pool.get(key, []))
        return sum(len(pool) for pool in self._pool.values())

    def _held_by(self, uid) -> int:
        return sum(len(pool) for (_kernel, owner), pool in self._pool.items() if owner == uid)

    async def _make_room(self, key: tuple) -> bool:
        """Whether one more runner of ``key`` may start, evicting the least recently used other key's at the cap."""
        if key[1] is not None and self._held_by(key[1]) >= self.max_per_account:
            return False
        if self.count() < self.max_total:
            return True
        others = [k for k, pool in self._pool.items() if pool and k != key]
        if not others:
            return False
        victim_key = min(others, key=lambda k: self._demand.get(k, 0.0))
        if self._demand.get(victim_key, 0.0) >= self._demand.get(key, 0.0):
            return False
        victim = self._pool[victim_key].pop(0)
        await victim.stop()
        return True

    async def top_up(self, kernel_name: str, account=None) -> None:
        """Demand for a kernel (and account): keep ``size`` runners of it ready."""
        if self.closing or self.size <= 0:
            return
        key = self._key(kernel_name, account)
        self._demand[key] = self.clock()
        self._start_reaper()
        pool = self._pool.setdefault(key, [])
        for dead in [r for r in pool if r.proc.returncode is not None]:
            pool.remove(dead)
            await dead.stop()  # its kernel may have outlived it
        while len(pool) < self.size and not self.closing and await self._make_room(key):
            runner = await self.spawn(kernel_name, account)
            if self.closing or self._pool.get(key) is not pool:  # stopped or reaped meanwhile
                await runner.stop()
                return
            pool.append(runner)

    def take(self, kernel_name: str, account=None) -> RunnerProcess | None:
        key = self._key(kernel_name, account)
        self._demand[key] = self.clock()
        pool = self._pool.get(key, [])
        for runner in pool:
            if runner.usable:
                pool.remove(runner)
                return runner
        return None

    async def reap(self) -> int:
        """Stop the runners of every key that had no demand for ``idle_seconds``; how many were stopped."""
        now = self.clock()
        idle = [k for k in self._pool if now - self._demand.get(k, now) >= self.idle_seconds]
        runners = []
        for key in idle:
            runners += self._pool.pop(key)
            self._demand.pop(key, None)
        await asyncio.gather(*(r.stop() for r in runners), return_exceptions=True)
        return len(runners)

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap_forever())

    async def _reap_forever(self) -> None:
        interval = max(1.0, min(60.0, self.idle_seconds / 4))
        while not self.closing and self._pool:
            await asyncio.sleep(interval)
            await self.reap()

    async def stop_all(self) -> None:
        self.closing = True
        if self._reaper is not None:
            self._reaper.cancel()
        runners = [r for pool in self._pool.values() for r in pool]
        self._pool.clear()
        await asyncio.gather(*(r.stop() for r in runners), return_exceptions=True)


def new_runner_id() -> str:
    return uuid.uuid4().hex
