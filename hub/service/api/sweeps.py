"""HTTP handlers of sweeps (``/sweeps``): each one call of the manager's facade ``manager.sweeps``."""

from __future__ import annotations

from danlu.hub.service.api.web import APIHandler
from danlu.hub.service.formats import JOB_ID

SWEEP = "a sweep id (12 hex digits)"


class SweepsHandler(APIHandler):
    async def get(self):
        who = self.principal()
        self.write_json(
            await self.manager.sweeps.page(
                who,
                owner=self.str_arg("owner"),
                state=self.str_arg("state"),
                limit=self.int_arg("limit", 100, minimum=1, maximum=1000),
            )
        )

    async def post(self):
        who = self.principal()
        status, body = await self.manager.sweeps.create(who, self.json_body())
        self.write_json(body, status)


class SweepHandler(APIHandler):
    async def get(self, sweep_id):
        who = self.principal()
        self.write_json(await self.manager.sweeps.view(who, self.path_arg(sweep_id, "id", JOB_ID, SWEEP)))


class SweepStopHandler(APIHandler):
    async def post(self, sweep_id):
        who = self.principal()
        self.write_json(await self.manager.sweeps.stop(who, self.path_arg(sweep_id, "id", JOB_ID, SWEEP)))
