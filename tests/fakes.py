"""Fake job backends, named by what their jobs do, and a JobManager built on them: no processes, no HTTP.

Each fake keeps the backend contract of :mod:`danlu.hub.backends.base`. Its "runner" is an asyncio task on
a :class:`FakeMachine` that, like a real runner, knows only its :class:`~danlu.hub.backends.base.Launch`
(the job, the attempt, the attempt's token) and tells the service anything only through the runner API:
the manager's :class:`~danlu.hub.service.jobs.runner_api.Reports`, called in-process where a real runner makes an
HTTP request. The machine outlives any one JobManager, as real runners outlive a SIGKILLed service, and
its runners reach whichever service is up now (:meth:`FakeMachine.attach`), waiting while none is.

===========================  =================================================================================
``InstantBackend``           fetches its spec, writes a log and an output notebook, reports success
``UserErrorBackend``         reports ``failed`` with an error in the user's code (not the infrastructure's)
``CrashingBackend``          its runner dies without reporting (the first ``crashes`` attempts; None: all)
``FailingBackend``           ``start`` raises before anything runs
``FailsAfterLaunchBackend``  ``start`` launches the runner and, once it runs, raises
``NeverStartsBackend``       ``start`` records where the attempt will be, then blocks until it is cancelled
``SlowBackend``              runs until told (:meth:`SlowBackend.finish`) or signalled; on SIGTERM it asks the
                             service why and reports that stop reason
``GatedBackend``             a SlowBackend whose start and cancel wait for the test where races need them
``HostileBackend``           forges reports (another job, another attempt, forged and earlier tokens), tampers
                             with its folder, and ends as its job's parameters say
===========================  =================================================================================

:func:`make_manager` builds a :class:`~danlu.hub.service.manager.JobManager` the way
:mod:`danlu.hub.service.app` does, on a fresh SQLite database (:func:`danlu.hub.service.store.schema.prepare`), with
the builtin profile (opened to GPUs, :func:`gpu_profiles`), two declared GPUs of flavor ``sim``,
:class:`FakeGroups` for the hub's user directory, no MLflow, and a runner API address nothing listens on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from danlu.errors import DanluError
from danlu.hub import gpus, scopes
from danlu.hub.backends.base import Backend, Launch, Outcome, Record
from danlu.hub.config import Settings
from danlu.hub.profiles import ProfileSet, builtin_profiles
from danlu.hub.service.app import scheduler_class_for
from danlu.hub.service.auth import Principal
from danlu.hub.service.manager import JobManager
from danlu.hub.service.store import schema
from danlu.hub.service.store.database import Database
from danlu.states import FINAL

UNUSED_API = "http://127.0.0.1:1/unused"


def user(name: str, *groups: str) -> Principal:
    """A hub user calling with the scopes every user holds: their own jobs."""
    return Principal(
        name, "user", frozenset({f"{scopes.WRITE}!user={name}", f"{scopes.READ}!user={name}"}), tuple(groups)
    )


def admin(name: str = "admin") -> Principal:
    return Principal(name, "user", frozenset({scopes.ADMIN}))


def notebook(*sources: str) -> dict:
    """An nbformat 4 notebook with one code cell per source."""
    cells = [
        {"cell_type": "code", "id": f"c{i}", "metadata": {}, "outputs": [], "execution_count": None, "source": source}
        for i, source in enumerate(sources, 1)
    ]
    return {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


# the machine the fake runners run on -----------------------------------------------------------------------
@dataclass(eq=False)
class FakeRun:
    """One fake runner process: the attempt it was launched for, and what it saw of the service."""

    launch: Launch
    machine: FakeMachine
    signalled: asyncio.Event = field(default_factory=asyncio.Event)  # SIGTERM
    released: asyncio.Event = field(default_factory=asyncio.Event)  # SlowBackend: told to finish
    running: asyncio.Event = field(default_factory=asyncio.Event)  # it has its spec
    task: asyncio.Task | None = None
    spec: dict | None = None
    #: (what it tried, the status the runner API answered) for every call it made
    answers: list[tuple[str, int]] = field(default_factory=list)
    #: what the runner API said when it asked why it got SIGTERM
    stop: dict | None = None
    exit_code: int | None = None
    error: BaseException | None = None  # a bug in the fake itself

    @property
    def job_id(self) -> str:
        return self.launch.job_id

    @property
    def attempt(self) -> int:
        return self.launch.attempt

    @property
    def folder(self) -> dict[str, bytes]:
        """The job's folder (kept across attempts): the job's to write, the service's to read only through
        the backend."""
        return self.machine.folders.setdefault(self.job_id, {})

    def write(self, path: str, data: str | bytes) -> None:
        self.folder[path] = self.folder.get(path, b"") + (data.encode() if isinstance(data, str) else data)

    # the runner API, as a real runner's ServiceLink calls it ---------------------------------------------
    async def call(self, what: str, call: Callable[[Any], Awaitable[Any]]) -> Any:
        """``call(api)`` on the service that is up now (waiting while none is); records the answer's status.

        A call in flight when its service stops gets no answer (status 0) and is made again to the next service,
        as a real runner's ServiceLink does when its connection drops: the stopping service's runner API fails
        it with a cancellation or a closed executor, which would otherwise end the fake runner as if killed."""
        while True:
            await self.machine.up.wait()
            api = self.machine.api
            try:
                answer = await call(api)
            except DanluError as e:
                self.answers.append((what, e.status))
                return None
            except (asyncio.CancelledError, RuntimeError) as e:
                if not self.machine.went_away(api, e):
                    raise
                self.answers.append((what, 0))
                continue
            self.answers.append((what, 200))
            return answer

    async def fetch_spec(self) -> dict | None:
        launch = self.launch
        self.spec = await self.call("spec", lambda api: api.spec(launch.job_id, launch.attempt, launch.token))
        if self.spec is not None:
            self.running.set()
        return self.spec

    async def report(
        self, state: str, reason: str = "", *, infrastructure: bool = False, exit_code: int | None = 0
    ) -> bool:
        launch = self.launch
        event = {
            "event": "finished",
            "state": state,
            "reason": reason,
            "exit_code": exit_code,
            "infrastructure": infrastructure,
            "notes": [],
        }
        answer = await self.call(
            f"finished {state}", lambda api: api.event(launch.job_id, launch.attempt, launch.token, event)
        )
        return answer is not None

    async def ask_stop(self) -> dict | None:
        launch = self.launch
        self.stop = await self.call("stop", lambda api: api.stop(launch.job_id, launch.attempt, launch.token))
        return self.stop


Behaviour = Callable[[FakeRun], Awaitable[int | None]]


class FakeMachine:
    """Where fake runners run. It outlives a JobManager, and its runners reach the service that is up now."""

    def __init__(self):
        self.api = None  # the runner API (JobManager.reports) of the service that is up, if any
        self.up = asyncio.Event()
        self.gone: set[int] = set()  # id() of the runner APIs of services that stopped
        self.runs: dict[str, FakeRun] = {}  # "<job id>/<attempt>" -> its runner
        #: job id -> its folder (path -> bytes), written only by the job's runners
        self.folders: dict[str, dict[str, bytes]] = {}

    def attach(self, reports) -> None:
        """A service is up: runners reach its runner API from now on."""
        self.api = reports
        self.up.set()

    def detach(self) -> None:
        """The service went away: runners wait for the next one."""
        if self.api is not None:
            self.gone.add(id(self.api))
        self.api = None
        self.up.clear()

    def went_away(self, api, error: BaseException) -> bool:
        """Whether ``error``, raised by a call to ``api``, is that service stopping under the call (not a bug,
        nor this runner being killed: a cancellation of the runner's own task)."""
        if id(api) not in self.gone:
            return False
        if isinstance(error, asyncio.CancelledError):
            task = asyncio.current_task()
            return task is not None and not task.cancelling()
        return "after shutdown" in str(error)

    def spawn(self, launch: Launch, behaviour: Behaviour) -> FakeRun:
        run = FakeRun(launch, self)
        self.runs[run_key(launch.job_id, launch.attempt)] = run
        run.task = asyncio.ensure_future(self._life(run, behaviour))
        return run

    @staticmethod
    async def _life(run: FakeRun, behaviour: Behaviour) -> None:
        try:
            code = await behaviour(run)
            run.exit_code = 0 if code is None else code
        except asyncio.CancelledError:  # SIGKILL
            run.exit_code = -9
        except Exception as e:  # noqa: BLE001 - a bug in a fake: the test sees it in machine.errors()
            run.error, run.exit_code = e, 1

    def run(self, job_id: str, attempt: int | None = None) -> FakeRun:
        """The runner of a job's attempt (default its latest)."""
        mine = [r for r in self.runs.values() if r.job_id == job_id and (attempt is None or r.attempt == attempt)]
        assert mine, f"job {job_id} never ran (attempt {attempt or 'any'})"
        return max(mine, key=lambda r: r.attempt)

    def alive(self, job_id: str | None = None) -> list[FakeRun]:
        return [r for r in self.runs.values() if not r.task.done() and job_id in (None, r.job_id)]

    async def running(self, job_id: str, attempt: int = 1) -> FakeRun:
        """Wait until that attempt's runner has fetched its spec."""
        key = run_key(job_id, attempt)
        await until(
            lambda: key in self.runs and (self.runs[key].running.is_set() or self.runs[key].task.done()),
            f"job {job_id} attempt {attempt} to be launched and running",
        )
        run = self.runs[key]
        assert run.running.is_set(), f"job {job_id} attempt {attempt} ended without its spec: {run.answers}"
        return run

    def errors(self) -> list[str]:
        return [f"{key}: {run.error!r}" for key, run in self.runs.items() if run.error is not None]

    async def kill_all(self) -> None:
        for run in self.alive():
            run.task.cancel()
        await asyncio.gather(*(r.task for r in self.runs.values()), return_exceptions=True)


def run_key(job_id: str, attempt: int) -> str:
    return f"{job_id}/{attempt}"


# the backends ----------------------------------------------------------------------------------------------
class FakeBackend(Backend):
    """What every fake shares: attempts are runs on a FakeMachine; cancel is SIGTERM, then SIGKILL after the
    grace; the folder is served as it is. Subclasses say what their runner does (:meth:`runner`)."""

    name = "fake"

    def __init__(self, machine: FakeMachine | None = None, **kwargs):
        super().__init__(**kwargs)
        self.machine = machine if machine is not None else FakeMachine()
        self.launches: list[Launch] = []
        self.cancels: list[tuple[str, str]] = []  # (job id, reason) of every cancel
        self.cleanups: list[str] = []
        self.loaded: dict[str, dict] = {}  # job id -> the state load_state got after a restart

    async def runner(self, run: FakeRun) -> int | None:
        raise NotImplementedError

    async def start(self, launch: Launch, record: Record) -> dict:
        state = {"run": run_key(launch.job_id, launch.attempt)}
        await record(state)
        self.launches.append(launch)
        self.machine.spawn(launch, self.runner)
        return state

    def _run(self, state: dict) -> FakeRun | None:
        return self.machine.runs.get(str(state.get("run")))

    async def poll(self, job_id: str, state: dict) -> Outcome | None:
        run = self._run(state)
        if run is None:
            return Outcome("failed", "the job runner is gone: this machine never ran it", infrastructure=True)
        if not run.task.done():
            return None
        how = f"exit code {run.exit_code}" if run.exit_code >= 0 else f"killed by signal {-run.exit_code}"
        return Outcome(
            "failed", f"the job runner ended without reporting ({how})", exit_code=run.exit_code, infrastructure=True
        )

    async def wait(self, job_id: str, state: dict) -> None:
        run = self._run(state)
        if run is not None:
            await asyncio.wait({run.task})

    async def cancel(self, job_id: str, state: dict, grace: float, reason: str = "cancelled") -> None:
        self.cancels.append((job_id, reason))
        run = self._run(state)
        if run is None or run.task.done():
            return
        run.signalled.set()
        done, _ = await asyncio.wait({run.task}, timeout=grace)
        if not done:
            run.task.cancel()
            await asyncio.wait({run.task})

    async def cleanup(self, job_id: str, state: dict) -> None:
        self.cleanups.append(job_id)

    async def read_log(self, job_id: str, state: dict, offset: int, limit: int) -> tuple[bytes, int]:
        data = self.machine.folders.get(job_id, {}).get("job.log", b"")
        return data[offset : offset + max(0, limit)], len(data)

    async def read_output(
        self, job_id: str, state: dict, rank: int, offset: int, limit: int
    ) -> tuple[bytes, int] | None:
        data = self.machine.folders.get(job_id, {}).get("output.ipynb" if rank == 0 else f"ranks/rank-{rank}.ipynb")
        return None if data is None else (data[offset : offset + max(0, limit)], len(data))

    def load_state(self, job_id: str, state: dict) -> None:
        self.loaded[job_id] = dict(state)


def executed(spec: dict, text: str) -> str:
    """The job's notebook as the runner got it, with ``text`` as the first cell's output."""
    nb = json.loads(json.dumps(spec["notebook"]))
    nb["cells"][0]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": text}]
    return json.dumps(nb)


class InstantBackend(FakeBackend):
    """The runner fetches its spec, writes a log line and an output notebook, and reports success."""

    async def runner(self, run: FakeRun) -> int:
        spec = await run.fetch_spec()
        if spec is None:
            return 3
        run.write("job.log", f"danlu: job {spec['job_id']} attempt {spec['attempt']}: profile {spec['profile']}\n")
        run.folder["output.ipynb"] = executed(spec, f"ran {spec['name']}\n").encode()
        await run.report("succeeded")
        return 0


class UserErrorBackend(FakeBackend):
    """The runner reports ``failed``: the user's cell raised (not the infrastructure's doing)."""

    async def runner(self, run: FakeRun) -> int:
        if await run.fetch_spec() is None:
            return 3
        run.write("job.log", "ZeroDivisionError: division by zero\n")
        await run.report("failed", "cell 1 raised ZeroDivisionError: division by zero", exit_code=1)
        return 0


class CrashingBackend(InstantBackend):
    """The runner dies without reporting (SIGKILL, out of memory) in its first ``crashes`` attempts (None:
    in every one); later attempts succeed."""

    def __init__(self, crashes: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.crashes = crashes

    async def runner(self, run: FakeRun) -> int:
        if self.crashes is not None and run.attempt > self.crashes:
            return await super().runner(run)
        if await run.fetch_spec() is None:
            return 3
        run.write("job.log", "Killed\n")
        return -9


class FailingBackend(FakeBackend):
    """``start`` raises before anything runs (a cluster that refuses the pod)."""

    async def start(self, launch: Launch, record: Record) -> dict:
        self.launches.append(launch)
        raise RuntimeError("the fake cluster refuses to run anything")


class NeverStartsBackend(FakeBackend):
    """``start`` records where the attempt will be, then blocks until the job is cancelled (then raises)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.starting: asyncio.Queue[Launch] = asyncio.Queue()
        self._cancelled: dict[str, asyncio.Event] = {}

    async def start(self, launch: Launch, record: Record) -> dict:
        await record({"run": run_key(launch.job_id, launch.attempt)})
        self.launches.append(launch)
        cancelled = self._cancelled.setdefault(launch.job_id, asyncio.Event())
        self.starting.put_nowait(launch)
        await cancelled.wait()
        raise RuntimeError("cancelled while it was starting")

    async def cancel(self, job_id: str, state: dict, grace: float, reason: str = "cancelled") -> None:
        self.cancels.append((job_id, reason))
        self._cancelled.setdefault(job_id, asyncio.Event()).set()


class SlowBackend(FakeBackend):
    """The runner runs until told (:meth:`finish`) or signalled. On SIGTERM it asks the service why and
    reports that stop reason as its end (``interrupted``, infrastructure, when the service does not say)."""

    def finish(self, job_id: str) -> None:
        """Let the job's latest attempt end successfully."""
        self.machine.run(job_id).released.set()

    async def runner(self, run: FakeRun) -> int:
        if await run.fetch_spec() is None:
            return 3
        return await self.work(run)

    async def work(self, run: FakeRun) -> int:
        run.write("job.log", "working\n")
        waits = [asyncio.ensure_future(e.wait()) for e in (run.signalled, run.released)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if not run.signalled.is_set():
            await run.report("succeeded")
            return 0
        stop = await run.ask_stop()
        if stop and stop.get("reason"):
            await run.report(stop["reason"], stop["reason"], exit_code=None)
        else:
            await run.report("failed", "interrupted (SIGTERM)", infrastructure=True, exit_code=None)
        return 0


class FailsAfterLaunchBackend(SlowBackend):
    """``start`` launches the runner and, once it runs, raises (the pod runs; a later API call timed out)."""

    async def start(self, launch: Launch, record: Record) -> dict:
        await super().start(launch, record)
        await self.machine.running(launch.job_id, launch.attempt)
        raise RuntimeError("the cluster's API timed out")


class GatedBackend(SlowBackend):
    """SlowBackend whose first job's first ``start`` waits, before it records anything, for
    :attr:`start_gate` (a slow image pull), and whose ``cancel`` waits, before it looks for the runner, for
    :attr:`cancel_gate` (a slow scan of the machine's processes): the moments a race needs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.start_gate = asyncio.Event()
        self.cancel_gate = asyncio.Event()
        self._gated: str | None = None

    async def start(self, launch: Launch, record: Record) -> dict:
        if launch.attempt == 1 and self._gated in (None, launch.job_id):
            self._gated = launch.job_id
            await self.start_gate.wait()
        return await super().start(launch, record)

    async def cancel(self, job_id: str, state: dict, grace: float, reason: str = "cancelled") -> None:
        await self.cancel_gate.wait()
        await super().cancel(job_id, state, grace, reason)


class HostileBackend(SlowBackend):
    """A runner that runs hostile code. With its own token it fetches its own spec, then:

    * tampers with its folder (``job.json``, ``input.ipynb``) and keeps its token in ``checkpoints/``, which
      later attempts find;
    * forges reports: for the job named by its parameter ``victim``, for its own next attempt, with a
      forged token, a malformed one, and an earlier attempt's (if one was kept);
    * ends as its parameter ``then`` says: ``wait`` (as SlowBackend's, the default), ``exit`` without a
      report, ``invalid`` (an invalid report, then exit), ``invalid-then-succeed``.
    """

    async def runner(self, run: FakeRun) -> int:
        spec = await run.fetch_spec()
        if spec is None:
            return 3
        me, n, token = run.job_id, run.attempt, run.launch.token
        params = spec["parameters"]
        good = {"event": "finished", "state": "succeeded", "exit_code": 0}
        forged = {**spec, "owner": "root", "profile": "root-shell", "parameters": {"pwned": True}}
        run.folder["job.json"] = json.dumps(forged).encode()
        run.folder["input.ipynb"] = json.dumps(notebook("import os; os.system('id')")).encode()
        earlier = run.folder.get("checkpoints/token")
        run.folder["checkpoints/token"] = token.encode()
        if params.get("victim"):
            victim = str(params["victim"])
            await run.call("another job's report", lambda api: api.event(victim, 1, token, good))
            await run.call("another job's spec", lambda api: api.spec(victim, 1, token))
            await run.call("another job's stop", lambda api: api.stop(victim, 1, token))
        await run.call("its next attempt's report", lambda api: api.event(me, n + 1, token, good))
        await run.call("a forged token", lambda api: api.event(me, n, secrets.token_urlsafe(32), good))
        await run.call("a malformed token", lambda api: api.event(me, n, "../../etc/passwd", good))
        if earlier is not None:
            old = earlier.decode()
            await run.call("an earlier attempt's token", lambda api: api.event(me, n, old, good))
            await run.call("an earlier attempt's token for that attempt", lambda api: api.event(me, n - 1, old, good))
        then = params.get("then", "wait")
        if then in ("invalid", "invalid-then-succeed"):
            bad = {"event": "finished", "state": "succeeded-honestly", "exit_code": 0}
            await run.call("an invalid report", lambda api: api.event(me, n, token, bad))
        if then == "invalid-then-succeed":
            await run.report("succeeded")
        if then == "wait":
            return await self.work(run)
        return 0


# the hub's user directory ---------------------------------------------------------------------------------
class FakeGroups:
    """The hub's users and their groups (what GroupDirectory answers), from a dict."""

    def __init__(self, groups: dict[str, list[str]] | None = None):
        self.groups = {"alice": ["research"], "bob": [], "carol": ["vision"], "admin": []} if groups is None else groups

    async def user(self, username: str) -> dict | None:
        if username not in self.groups:
            return None
        return {"name": username, "groups": list(self.groups[username]), "servers": {}}

    async def exists(self, username: str) -> bool:
        return username in self.groups

    async def groups_of(self, username: str, fallback=()) -> tuple[str, ...]:
        return tuple(sorted(self.groups.get(username, fallback)))


# a JobManager on the fakes --------------------------------------------------------------------------------
JOBS = {"grace_period_seconds": 2, "preemption_grace_seconds": 2, "retry_backoff_seconds": 0.01, "warm_runners": 0}


def make_settings(state_dir: Path, **changes) -> Settings:
    """Settings as ``danlu.yaml`` would give them: no Unix accounts, two declared GPUs, two priority classes.

    ``changes`` replace top-level keys; ``jobs`` is merged into :data:`JOBS`.
    """
    data = {
        "state_dir": str(state_dir),
        "users": {"unix_accounts": "off"},
        "gpus": {"declared": [{"count": 2, "flavor": "sim"}]},
        "resources": {"cpu": 16},
        "priority_classes": {"normal": {"value": 0, "default": True}, "urgent": {"value": 100}},
    }
    data.update({k: v for k, v in changes.items() if k != "jobs"})
    data["jobs"] = {**JOBS, **changes.get("jobs", {})}
    return Settings.from_data(data)


def gpu_profiles() -> ProfileSet:
    """The builtin profile (the workbench's own Python, kernel ``danlu-python``), open to the two GPUs."""
    builtin = builtin_profiles()
    return ProfileSet((dataclasses.replace(builtin.default, gpu_choices=(0, 1, 2)),), source=builtin.source)


def make_manager(
    backend: Backend,
    state_dir: Path,
    *,
    settings: Settings | None = None,
    profiles: ProfileSet | None = None,
    service_api: str = UNUSED_API,
    groups: FakeGroups | None = None,
    mlflow=None,
) -> JobManager:
    """A JobManager as hub/service/app.py wires one, on the database in ``state_dir`` (created if new)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    settings = settings or make_settings(state_dir)
    database = Database(schema.prepare(settings.jobs_database_url))
    manager = JobManager(
        settings=settings,
        profiles=profiles or gpu_profiles(),
        inventory=gpus.inventory(settings.gpus),
        database=database,
        backend=backend,
        groups=groups or FakeGroups(),
        scheduler_class=scheduler_class_for(type(backend)),
        service_api=service_api,
        mlflow=mlflow,
    )
    if isinstance(backend, FakeBackend):
        backend.machine.attach(manager.runner_api)
    return manager


@contextlib.asynccontextmanager
async def serving(manager: JobManager, interval: float = 0.02):
    """The manager as the service runs it: recovered, with its admission loop; stopped as a SIGKILL would
    leave things (running jobs go on): the fake machine's runners no longer reach it, and their calls in flight
    are made again to the next service."""
    await manager.recover()
    loop = asyncio.ensure_future(manager.run_forever(interval))
    try:
        yield manager
    finally:
        backend = manager.backend
        if isinstance(backend, FakeBackend) and backend.machine.api is manager.runner_api:
            backend.machine.detach()  # first, as a SIGKILL would: no runner reaches the service from now on
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await manager.stop()


async def until(check: Callable[[], Any], what: str, patience: float = 30.0, every: float = 0.01) -> Any:
    """Wait until ``check()`` (sync or async) is truthy and return it; fail naming ``what`` if it never is.

    ``patience`` only bounds a hang; nothing here measures how long anything took.
    """
    deadline = time.monotonic() + patience
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(every)


async def final(manager: JobManager, job_id: str, patience: float = 30.0, every: float = 0.01) -> dict:
    """The job's API model once it reached a final state."""

    async def done():
        job = await manager.get(admin(), job_id)
        return job.state in {s.value for s in FINAL}

    await until(done, f"job {job_id} to end", patience, every)
    return await manager.job_dict(job_id)


async def state_of(manager: JobManager, job_id: str) -> str:
    return (await manager.get(admin(), job_id)).state
