"""HTTP handlers of the runner API: what a running attempt may ask and tell, with its job token.

These are not for hub users: they authenticate with ``Authorization: Bearer
<job token>`` only (see :mod:`~danlu.hub.service.jobs.runner_api`), and accept small bodies (1 MiB).
"""

from __future__ import annotations

from danlu.hub.service.api.web import BaseHandler
from danlu.hub.service.formats import ATTEMPT, RANK
from danlu.hub.service.validation import MAX_OUTPUT


class RunnerHandler(BaseHandler):
    max_body = 1024 * 1024

    def check_xsrf_cookie(self):
        return  # bearer tokens only, never cookies

    def token(self) -> str:
        scheme, _, token = self.request.headers.get("Authorization", "").partition(" ")
        return token.strip() if scheme.lower() == "bearer" else ""

    def ids(self, job_id: str, attempt: str) -> tuple[str, int]:
        return self.job_arg(job_id), int(self.path_arg(attempt, "attempt", ATTEMPT, "an attempt number"))


class RunnerSpecHandler(RunnerHandler):
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
        self.write_json(await self.manager.runner_api.output(job_id, number, self.token(), rank, self.request.body))


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
