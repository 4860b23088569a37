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

from danlu import proctree


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
        from danlu import env

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
            None, lambda: proctree.kill_matching(self.proc.pid, None, self.marker(), grace=1, uid=self.uid))


Spawn = Callable[[str | None, object], Awaitable[RunnerProcess]]


class WarmPool:
    """Warm runners per (kernel, account), topped up to ``size`` after each use."""

    def __init__(self, spawn: Spawn, size: int):
        self.spawn = spawn
        self.size = size
        self.closing = False
        self._pool: dict[tuple, list[RunnerProcess]] = {}

    @staticmethod
    def _key(kernel_name: str, account) -> tuple:
        return kernel_name, account.uid if account is not None else None

    async def top_up(self, kernel_name: str, account=None) -> None:
        if self.closing or self.size <= 0:
            return
        key = self._key(kernel_name, account)
        pool = self._pool.setdefault(key, [])
        for dead in [r for r in pool if r.proc.returncode is not None]:
            pool.remove(dead)
            await dead.stop()  # its kernel may have outlived it
        while len(pool) < self.size and not self.closing:
            pool.append(await self.spawn(kernel_name, account))

    def take(self, kernel_name: str, account=None) -> RunnerProcess | None:
        pool = self._pool.get(self._key(kernel_name, account), [])
        for runner in pool:
            if runner.usable:
                pool.remove(runner)
                return runner
        return None

    async def stop_all(self) -> None:
        self.closing = True
        runners = [r for pool in self._pool.values() for r in pool]
        self._pool.clear()
        await asyncio.gather(*(r.stop() for r in runners), return_exceptions=True)


def new_runner_id() -> str:
    return uuid.uuid4().hex
