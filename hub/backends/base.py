"""The backend contract: where admitted jobs run.

A backend is a small contract, checked when a subclass is defined (as
JupyterHub's ``Spawner.__init_subclass__`` does), not at the first call:

``start(job)``          start an admitted job; returns the state to persist
``poll(job_id, state)`` None while it runs, else an :class:`Outcome`
``wait(job_id, state)`` optional: return when it may have ended (push, not poll)
``cancel(job_id, state, grace, reason)``  end it and every process it started
                        (``reason``: cancelled, preempted or timed_out; the job sees SIGTERM,
                        then SIGKILL after ``grace`` seconds)
``log_path(job_id)``    where its log is

plus ``get_state``/``load_state`` hooks with which the service persists and
restores what a backend needs to find a job again after a restart. Backends are
chosen by name through the ``danlu.backends`` entry point group (see
``danlu.hub.backends.backends``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

from traitlets.config import LoggingConfigurable

REQUIRED = ("start", "poll", "cancel", "log_path")


@dataclass
class Outcome:
    """How an attempt ended."""

    state: str  # succeeded | failed | cancelled | lost
    reason: str = ""
    exit_code: int | None = None
    mlflow_run_id: str | None = None
    infrastructure: bool = False  # killed or lost, as opposed to an error in the user's code
    extra: dict = field(default_factory=dict)


class Backend(LoggingConfigurable):
    """Base class of job backends; subclasses must implement every REQUIRED method."""

    name = "base"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        missing = [m for m in REQUIRED if getattr(cls, m) is getattr(Backend, m)]
        if missing:
            raise TypeError(f"{cls.__name__} must implement {', '.join(missing)} to be a Danlu backend")
        for m in ("start", "poll", "cancel", "wait"):
            if getattr(cls, m) is not getattr(Backend, m, None) and not inspect.iscoroutinefunction(getattr(cls, m)):
                raise TypeError(f"{cls.__name__}.{m} must be async")

    async def start(self, job: dict) -> dict:
        raise NotImplementedError

    async def poll(self, job_id: str, state: dict) -> Outcome | None:
        raise NotImplementedError

    async def wait(self, job_id: str, state: dict) -> None:
        """Return when the job may have ended; the default polls every second."""
        import asyncio

        while await self.poll(job_id, state) is None:
            await asyncio.sleep(1.0)

    async def cancel(self, job_id: str, state: dict, grace: float, reason: str = "cancelled") -> None:
        raise NotImplementedError

    def log_path(self, job_id: str) -> Path:
        raise NotImplementedError

    def get_state(self, job_id: str) -> dict:
        """Extra state to persist for a job (merged into what ``start`` returned)."""
        return {}

    def load_state(self, job_id: str, state: dict) -> None:
        """Called after a restart with the state persisted for a job that was running."""

    async def shutdown(self) -> None:
        """Stop idle resources (warm runners); running jobs are left alone."""
