"""The runner's side of the boundary: its launch message, and the runner API it reports to.

A runner learns which attempt it runs from one launch message on its stdin
(:func:`read_launch`): the job, the attempt, where the runner API is, the
attempt's token, and where its working folder is. With that token
(:class:`ServiceLink`, over the one jobs-API client) it fetches the job's spec
from the service, asks why it is being stopped when it gets SIGTERM, and
reports how the attempt went. The service believes nothing else a job writes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

from danlu import env
from danlu.client import DanluClient
from danlu.errors import DanluError, Unreachable

MAX_LAUNCH = 64 * 1024


@dataclass(frozen=True)
class LaunchMessage:
    job_id: str
    attempt: int
    api: str
    token: str
    job_dir: str

    @classmethod
    def parse(cls, line: str) -> "LaunchMessage":
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("the launch message is not an object")
        return cls(
            str(data["job_id"]), int(data["attempt"]), str(data["api"]), str(data["token"]), str(data["job_dir"])
        )


def launch_from_env(environ=None) -> LaunchMessage:
    """A job pod's launch: its attempt and the runner API from the pod's environment, the token from the
    attempt's Secret (mounted as an environment variable by the TrainJob)."""
    environ = os.environ if environ is None else environ
    missing = [v for v in (env.JOB_ID, env.ATTEMPT, env.RUNNER_API, env.JOB_TOKEN, env.JOB_DIR) if not environ.get(v)]
    if missing:
        raise ValueError(f"the pod's environment lacks {', '.join(missing)}")
    return LaunchMessage(
        environ[env.JOB_ID],
        int(environ[env.ATTEMPT]),
        environ[env.RUNNER_API],
        environ[env.JOB_TOKEN],
        environ[env.JOB_DIR],
    )


def read_launch(stream=None) -> LaunchMessage | None:
    """The launch message from ``stream`` (stdin); None at end-of-file (the service went away)."""
    line = (stream or sys.stdin).readline(MAX_LAUNCH)
    if not line.strip():
        return None
    return LaunchMessage.parse(line)


class ServiceLink:
    """This attempt's calls to the runner API, authenticated with the attempt's token."""

    def __init__(self, launch: LaunchMessage, timeout: float = 30.0):
        self.launch = launch
        self.client = DanluClient(api=launch.api, token=launch.token, timeout=timeout, scheme="Bearer", url=launch.api)
        self.base = f"/runner/jobs/{launch.job_id}/attempts/{launch.attempt}"

    def _retrying(self, method: str, path: str, *, patience: float, **kwargs):
        """Call, retrying while the service is unreachable or failing (it may be restarting)."""
        deadline = time.monotonic() + patience
        delay = 0.5
        while True:
            try:
                return self.client.request(method, f"{self.base}{path}", **kwargs)
            except (Unreachable, DanluError) as e:
                # a 429: the job's own code used up the attempt's runner API rate (danlu.dataset in a loop, say);
                # the runner's reports wait their turn rather than being lost
                busy = isinstance(e, DanluError) and e.status == 429
                if busy and e.retry_after:
                    delay = max(delay, min(float(e.retry_after), 30.0))
                if not (isinstance(e, Unreachable) or e.status >= 500 or busy) or time.monotonic() + delay > deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 10.0)

    def kernel_env(self) -> dict:
        """What a kernel of this attempt needs to ask the runner API itself (``danlu.dataset``)."""
        launch = self.launch
        return {env.RUNNER_API: launch.api, env.ATTEMPT: str(launch.attempt), env.JOB_TOKEN: launch.token}

    def spec(self, patience: float = 120.0) -> dict:
        return self._retrying("GET", "/spec", patience=patience).json()

    def stop(self) -> tuple[str, float] | None:
        """Why the service is stopping this attempt and the grace it gives; None if it is not (or is gone)."""
        try:
            data = self.client.request("GET", f"{self.base}/stop", timeout=5).json()
        except DanluError:
            return None
        if not isinstance(data, dict) or not data.get("reason"):
            return None
        return str(data["reason"]), float(data.get("grace") or 0.0)

    def upload_output(self, rank: int, data: bytes, patience: float = 120.0) -> bool:
        """Hand rank ``rank``'s executed notebook to the service (a job pod keeps no folder it could read)."""
        try:
            self._retrying("PUT", f"/outputs/{rank}", data=data, patience=patience, timeout=120)
            return True
        except DanluError as e:
            print(f"danlu: could not hand rank {rank}'s notebook to the jobs service: {e}", file=sys.stderr, flush=True)
            return False

    def report(self, event: dict, patience: float = 600.0) -> bool:
        """Send a report; True once the service has it. A 4xx (the attempt is over) gives up at once."""
        try:
            self._retrying("POST", "/events", json=event, patience=patience)
            return True
        except DanluError as e:
            print(f"danlu: could not report {event.get('event')} to the jobs service: {e}", file=sys.stderr, flush=True)
            return False
