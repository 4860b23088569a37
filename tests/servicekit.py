"""A jobs service without JupyterHub, for backends that run real runners: the manager plus the runner API.

:class:`RunnerAPIService` wires a :class:`~danlu.hub.service.manager.JobManager` the way
:mod:`danlu.hub.service.app` does -- kernelspecs of the builtin profile under ``<state>/share/jupyter``,
the backend from a factory, the database in the state folder -- and serves over HTTP, on a loopback port,
only the runner API (:func:`danlu.hub.service.api.runner.routes`): runners fetch their spec and report
there with their attempt's token, exactly as under ``danlu up``. Tests call the manager directly. It runs on
an event loop of its own in a background thread (:class:`LoopThread`), so one service can be shared by a
module's tests; :meth:`RunnerAPIService.restart` stops it as a SIGKILL would leave things (running jobs go on)
and starts a new one on the same database, state folder and port.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import psutil
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from danlu import env
from danlu.hub.backends.base import Backend
from danlu.hub.config import Settings
from danlu.hub.environments import prepare_profiles
from danlu.hub.profiles import builtin_profiles
from danlu.hub.service.api.routes import routes
from danlu.hub.service.manager import JobManager
from danlu.states import FINAL

from .fakes import admin, make_manager, make_settings

T = TypeVar("T")
PREFIX = "/services/danlu/api/v1"
#: a backend factory: settings -> a backend (built on the service's event loop)
BackendFactory = Callable[[Settings], Backend]


def jupyter_path_of(settings: Settings) -> Path:
    """Where app.py has every runner find the profiles' kernelspecs (``JUPYTER_PATH``)."""
    return settings.state_dir / "share" / "jupyter"


class LoopThread:
    """An asyncio event loop running in a daemon thread; :meth:`run` waits for a coroutine's result."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="service-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class RunnerAPIService:
    """A JobManager on a real backend, its admission loop, and its runner API on ``127.0.0.1:<port>``."""

    def __init__(
        self,
        state_dir: Path,
        backend_factory: BackendFactory,
        *,
        profiles=None,
        settings=None,
        groups=None,
        mlflow=None,
        **jobs,
    ):
        self.state_dir = state_dir
        self.groups = groups
        self.mlflow = mlflow
        self.factory = backend_factory
        self.profiles = profiles
        self.settings = settings or make_settings(
            state_dir,
            jobs={
                "warm_runners": 1,
                "grace_period_seconds": 3,
                "preemption_grace_seconds": 3,
                "retry_backoff_seconds": 0.2,
                **jobs,
            },
        )
        self.loop = LoopThread()
        self.sockets = bind_sockets(0, "127.0.0.1")  # kept across restarts: runners know this address
        self.port = self.sockets[0].getsockname()[1]
        self.api = f"http://127.0.0.1:{self.port}{PREFIX}"
        self.manager: JobManager | None = None
        self._server: HTTPServer | None = None
        self._admission: asyncio.Task | None = None

    # life ---------------------------------------------------------------------------------------------------
    def open(self) -> RunnerAPIService:
        prepare_profiles(self.state_dir, builtin_profiles())
        self.settings.jobs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.run(self._start())
        return self

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300.0) -> T:
        """Run ``coro`` on the service's loop and wait for its result (``timeout`` bounds a hang)."""
        return self.loop.run(coro, timeout)

    async def _start(self) -> None:
        backend = self.factory(self.settings)
        self.manager = manager = make_manager(
            backend,
            self.state_dir,
            settings=self.settings,
            service_api=self.api,
            profiles=self.profiles,
            groups=self.groups,
            mlflow=self.mlflow,
        )
        await manager.recover()  # before runners are answered, as app.py does
        runner_api = [route for route in routes(PREFIX.removesuffix("/api/v1")) if "/runner/" in route[0]]
        self._server = HTTPServer(web.Application(runner_api, danlu_manager=manager))
        self._server.add_sockets(self.sockets)
        warm = getattr(backend, "warm", None)
        if warm is not None:
            await warm(manager.profiles.default.kernel_name)
        self._admission = asyncio.ensure_future(manager.run_forever(0.2))

    async def _stop(self) -> None:
        """Stop answering and stop the manager; running jobs are left alone (as after a SIGKILL)."""
        self._server.stop()  # closes the listening sockets: a new server binds the port again
        await self._server.close_all_connections()  # and the runners' keep-alive connections, as a dead process would
        self._admission.cancel()
        await asyncio.gather(self._admission, return_exceptions=True)
        await self.manager.stop()

    async def _restart(self) -> None:
        await self._stop()
        self.sockets = bind_sockets(self.port, "127.0.0.1")
        await self._start()

    def restart(self) -> None:
        self.run(self._restart())

    def close(self) -> None:
        """Cancel whatever has not ended, stop the service and its loop."""

        async def finish():
            who = admin()
            for job in await self.manager.list(who, limit=1000):
                if job.state not in {s.value for s in FINAL}:
                    await self.manager.cancel(who, job.id)
            await self._stop()

        try:
            self.run(finish())
        finally:
            self.loop.close()

    # what is left of it -----------------------------------------------------------------------------------
    def processes(self, job_id: str | None = None, runner_id: str | None = None) -> list[psutil.Process]:
        """Live processes with a job's marker or a runner's (or, with neither, any runner of this service's)."""
        jupyter_path = str(jupyter_path_of(self.settings))
        found = []
        for proc in psutil.process_iter():
            try:
                environ = proc.environ()
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
            except (psutil.Error, OSError):
                continue
            if job_id is None and runner_id is None:
                mine = environ.get("JUPYTER_PATH") == jupyter_path and env.RUNNER_ID in environ
            else:
                mine = (job_id is not None and environ.get(env.JOB_ID) == job_id) or (
                    runner_id is not None and environ.get(env.RUNNER_ID) == runner_id
                )
            if mine:
                found.append(proc)
        return found
