"""The backend contract: the only way the jobs service touches a running job.

A backend runs admitted attempts somewhere (local processes, Kubernetes pods)
and answers for them. The service hands it a typed :class:`Launch` -- who,
what kernel, how many processes, which devices, and how the runner reaches the
service -- and never a host path: the runner fetches the rest of the job's
spec (notebook, parameters, datasets, environment) from the service's runner
API with the attempt's token, and reports there how the attempt went. So
nothing a job can write changes what runs or as whom, and a pod that shares no
folder with the service runs under the same contract.

``start(launch, record)``  start an attempt; calls ``record(state)`` with what it
                           needs to find the attempt again *before* the attempt can
                           run, then returns the final state to persist
``wait(job_id, state)``    return when the attempt may have ended
``poll(job_id, state)``    None while it runs, else an :class:`Outcome` of how its
                           processes ended (the runner's own report, if any, is the
                           service's business and wins)
``cancel(job_id, state, grace, reason)``  end it (SIGTERM, then SIGKILL after
                           ``grace`` seconds); ``reason`` is cancelled, preempted or
                           timed_out, which the runner learns from the service
``cleanup(job_id, state)`` after an attempt ended: end whatever of it is left
                           (kernels and ranks of a runner that died)
``read_log(job_id, state, offset, limit)``  a bounded chunk of the log, and its size
``read_output(job_id, state, rank, offset, limit)``  likewise for rank N's notebook

A backend with its own queue (``queues = True``: Kubernetes, where Kueue admits)
gets every queued job at once: the service runs no admission model of its own,
``start`` only submits, and ``admission(job_id, state)`` reports the queue's
answer (admitted or not, why, and the position) until the attempt runs. An
eviction by that queue ends the attempt with an authoritative ``preempted``
:class:`Outcome`, and the job is handed over again.

plus ``user_home`` (the owner's home as the runner sees it, if the backend
decides that), ``load_state`` (persisted state after a restart) and
``shutdown`` (idle resources; running jobs are left alone). A subclass that
misses a required method, or defines a lifecycle method that is not a
coroutine, is refused when it is defined, as JupyterHub's
``Spawner.__init_subclass__`` does. Backends are configurables: the jobs
service builds its ``backend_class`` (an entry point name of the
``danlu.backends`` group, as JupyterHub's ``spawner_class``) with ``parent=``
itself and the workbench's settings and profiles, from which each backend
takes its own defaults.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from traitlets.config import LoggingConfigurable

REQUIRED = ("start", "poll", "cancel", "read_log", "read_output")
ASYNC = ("start", "poll", "wait", "cancel", "cleanup", "read_log", "read_output", "shutdown", "admission", "draining")


@dataclass(frozen=True)
class Launch:
    """What a backend needs to start one attempt of a job (the rest comes from the runner API)."""

    job_id: str
    attempt: int
    owner: str
    kernel_name: str
    nproc: int = 1  # per node
    nnodes: int = 1
    devices: tuple[int, ...] = ()
    #: the Unix account the attempt runs as (danlu.hub.accounts.Account), or None: the service's own
    run_as: Any = None
    #: the runner API (``.../api/v1``) and the attempt's token for it
    api_url: str = ""
    token: str = field(default="", repr=False)
    #: what a backend with its own queue needs to submit the attempt there
    queue: str = ""
    priority_class: str = ""
    profile: str = ""
    gpus: int = 0
    gpu_type: str | None = None
    cpu: float = 0.0
    memory: float = 0.0  # bytes; 0: unlimited
    timeout_seconds: float | None = None

    def message(self) -> dict:
        """The launch message a runner reads: where to fetch its spec and report, and with which token."""
        return {"job_id": self.job_id, "attempt": self.attempt, "api": self.api_url, "token": self.token}


@dataclass
class Outcome:
    """How an attempt ended."""

    state: str  # succeeded | failed | cancelled | preempted | timed_out
    reason: str = ""
    exit_code: int | None = None
    infrastructure: bool = False  # killed or lost, as opposed to an error in the user's code
    #: not counted against the job's retries (the workbench or the service stopped under it)
    interrupted: bool = False
    #: the service's own account of the attempt, which wins over what its runner reported (a failed start)
    authoritative: bool = False


@dataclass(frozen=True)
class Admission:
    """A queueing backend's answer for an attempt it holds: admitted yet, and if not, why and where."""

    admitted: bool
    reason: str = ""
    position: int | None = None  # 1-based, in the attempt's queue


Record = Callable[[dict], Awaitable[None]]


class FileRefused(Exception):
    """A file of a job's folder that the service will not read (a link, a FIFO, someone else's, too big)."""


class Backend(LoggingConfigurable):
    """Base class of job backends; subclasses implement every REQUIRED method, as coroutines."""

    name = "base"
    #: True when the backend's own queue admits attempts (see the module's docs); the jobs service then chooses
    #: a scheduler that hands jobs over (asked once, at start-up)
    queues = False
    #: True when an attempt runs in its profile's container image (a job's provenance records the image)
    runs_in_images = False

    def __init__(self, settings=None, profiles=None, **kwargs):
        super().__init__(**kwargs)
        #: the workbench's settings (danlu.yaml) and governed profiles, where a backend takes its defaults
        self.settings = settings
        self.profiles = profiles

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        missing = [m for m in REQUIRED if getattr(cls, m) is getattr(Backend, m)]
        if missing:
            raise TypeError(f"{cls.__name__} must implement {', '.join(missing)} to be a Danlu backend")
        if cls.queues and cls.admission is Backend.admission:
            raise TypeError(f"{cls.__name__} queues attempts itself, so it must implement admission")
        for m in ASYNC:
            if getattr(cls, m) is not getattr(Backend, m, None) and not inspect.iscoroutinefunction(getattr(cls, m)):
                raise TypeError(f"{cls.__name__}.{m} must be async")

    async def start(self, launch: Launch, record: Record) -> dict:
        raise NotImplementedError

    async def poll(self, job_id: str, state: dict) -> Outcome | None:
        raise NotImplementedError

    async def wait(self, job_id: str, state: dict) -> None:
        """Return when the attempt may have ended; the default polls every second."""
        while await self.poll(job_id, state) is None:
            await asyncio.sleep(1.0)

    async def cancel(self, job_id: str, state: dict, grace: float, reason: str = "cancelled") -> None:
        raise NotImplementedError

    async def cleanup(self, job_id: str, state: dict) -> None:
        """End whatever of a finished attempt is left; the default has nothing to do."""

    async def draining(self, job_id: str, state: dict) -> bool:
        """Whether an attempt that ``poll`` says ended by someone else's hand (a Kueue eviction) still has
        processes in their grace period, saving a checkpoint; the default: none."""
        return False

    async def read_log(self, job_id: str, state: dict, offset: int, limit: int) -> tuple[bytes, int]:
        """Up to ``limit`` bytes of the job's log from ``offset``, and the log's size now (0: none yet)."""
        raise NotImplementedError

    async def read_output(
        self, job_id: str, state: dict, rank: int, offset: int, limit: int
    ) -> tuple[bytes, int] | None:
        """Up to ``limit`` bytes of rank ``rank``'s executed notebook from ``offset``, and its size;
        None while there is none. Raises :class:`FileRefused` for a file it will not serve."""
        raise NotImplementedError

    async def admission(self, job_id: str, state: dict) -> Admission:
        """A queueing backend's answer for a submitted attempt; others admit nothing themselves."""
        return Admission(True)

    def user_home(self, owner: str) -> str | None:
        """The owner's home as the runner sees it; None: the service's own idea of it (one machine)."""
        return None

    def tensorboard_dir(self, job_id: str) -> str | None:
        """Where a user's own server finds the job's TensorBoard files, if this backend has such a place."""
        return None

    def load_state(self, job_id: str, state: dict) -> None:
        """Called after a restart with the state persisted for a job that was running."""

    async def shutdown(self) -> None:
        """Stop idle resources (warm runners); running jobs are left alone."""
