"""HTTP handlers of the runner API: what a running attempt may ask and tell, with its job token.

These are not for hub users: they authenticate with ``Authorization: Bearer
<job token>`` only (see :mod:`~danlu.hub.service.jobs.runner_api`), and accept small bodies (1 MiB); a
notebook handed over (``outputs``) may be larger, once the token is known to be the attempt's, before its
body is read. Each attempt's calls are bounded in rate (:class:`RateBounds`: a token bucket per attempt and
token, a spec read costing :data:`SPEC_COST`): the job's own code holds the token too, and a loop of spec
reads would otherwise keep the database busy. Beyond the bound: 429 with ``Retry-After``.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict

from danlu.errors import DanluError
from danlu.hub.service.api.web import ANONYMOUS_BODY, BaseHandler
from danlu.hub.service.formats import ATTEMPT, RANK
from danlu.hub.service.validation import MAX_OUTPUT

#: what a spec read costs in a bucket (it reads and encodes the whole notebook); any other call costs 1
SPEC_COST = 10
#: buckets kept (least recently used dropped first): a bound on memory, whatever tokens are sent
MAX_BUCKETS = 10_000


class RateBounds:
    """A token bucket per key: ``burst`` at most, refilled at ``rate`` per second."""

    def __init__(self, rate: float = 5.0, burst: int = 60, clock=time.monotonic):
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, key: str, cost: float = 1.0) -> float:
        """0 if ``cost`` may be spent now (and spends it), else the seconds until it may."""
        now = self.clock()
        level, then = self._buckets.pop(key, (float(self.burst), now))
        level = min(float(self.burst), level + (now - then) * self.rate)
        wait = 0.0 if level >= cost else (cost - level) / self.rate
        self._buckets[key] = (level - cost if wait == 0.0 else level, now)
        while len(self._buckets) > MAX_BUCKETS:
            self._buckets.popitem(last=False)
        return wait


class RunnerHandler(BaseHandler):
    max_body = 1024 * 1024
    cost = 1

    def check_xsrf_cookie(self):
        return  # bearer tokens only, never cookies

    async def admit(self) -> None:
        await super().admit()
        bounds: RateBounds | None = self.settings.get("danlu_runner_rate")
        if bounds is None:
            return
        args = self.path_kwargs
        key = f"{args.get('job_id', '')[:12]}/{args.get('attempt', '')[:8]}/"
        key += hashlib.sha256(self.token().encode()).hexdigest()[:16]
        wait = bounds.take(key, self.cost)
        if wait:
            error = DanluError(
                f"this attempt calls the runner API too often (at most {bounds.rate:g} a second on average, "
                f"a spec read counting as {SPEC_COST})",
                status=429,
                reason="too_many_requests",
                fix=f"call again in {math.ceil(wait)} s; a job's code needs the runner API only for danlu.dataset",
            )
            error.retry_after = math.ceil(wait)
            raise error

    async def authenticate(self) -> bool:
        """The attempt's token is checked before a body larger than an anonymous caller's is read."""
        if self.max_body <= self.settings.get("danlu_anonymous_max_body", ANONYMOUS_BODY):
            return False
        await self.manager.runner_api.owner(
            *self.ids(self.path_kwargs["job_id"], self.path_kwargs["attempt"]), self.token()
        )
        return True

    def token(self) -> str:
        scheme, _, token = self.request.headers.get("Authorization", "").partition(" ")
        return token.strip() if scheme.lower() == "bearer" else ""

    def ids(self, job_id: str, attempt: str) -> tuple[str, int]:
        return self.job_arg(job_id), int(self.path_arg(attempt, "attempt", ATTEMPT, "an attempt number"))


class RunnerSpecHandler(RunnerHandler):
    cost = SPEC_COST

    async def get(self, job_id, attempt):
        job_id, number = self.ids(job_id, attempt)
        self.write_json(await self.manager.runner_api.spec(job_id, number, self.token()))


class RunnerStopHandler(RunnerHandler):
    async def get(self, job_id, attempt):
        job_id, number = self.ids(job_id, attempt)
        self.write_json(await self.manager.runner_api.stop(job_id, number, self.token()))


class RunnerOutputHandler(RunnerHandler):
    max_body = MAX_OUTPUT

    async def put(self, job_id, attempt, rank):
        job_id, number = self.ids(job_id, attempt)
        rank = int(self.path_arg(rank, "rank", RANK, "a rank number"))
        self.write_json(await self.manager.runner_api.output(job_id, number, self.token(), rank, self.body))


class RunnerEventsHandler(RunnerHandler):
    async def post(self, job_id, attempt):
        job_id, number = self.ids(job_id, attempt)
        # any JSON: an invalid report from the attempt's runner fails the attempt, saying why (see reports)
        body = self.json_body(anything=True)
        self.write_json(await self.manager.runner_api.event(job_id, number, self.token(), body))


class RunnerDatasetHandler(RunnerHandler):
    max_body = 64 * 1024

    async def post(self, job_id, attempt):
        job_id, number = self.ids(job_id, attempt)
        token = self.token()
        owner = await self.manager.runner_api.owner(job_id, number, token)  # before the body is parsed
        self.write_json(await self.manager.runner_api.dataset(job_id, number, token, owner, self.json_body()))
