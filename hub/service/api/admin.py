"""HTTP handlers of the admin endpoints: GPU allocations, warm runners, queue operations, the audit log, metrics.

One handler class per route, so a method a route does not have is a 405 that
says which it has; the manager decides who may call what (admins, or the
hub's own token for logins). An admin-only route refuses anyone else (403)
before it reads the body or the path: authorization before validation, so a
refusal never depends on, or tells anything about, what was sent.
"""

from __future__ import annotations

from danlu.hub.service import validation
from danlu.hub.service.api.web import APIHandler
from danlu.hub.service.formats import HOLDER, QUEUE


class AllocationsHandler(APIHandler):
    async def get(self):
        self.write_json(await self.manager.allocations(self.admin()))

    async def post(self):
        who = self.admin()
        body = self.json_body()
        validation.check_schema("AllocationRequest", body)
        self.write_json({"devices": await self.manager.allocate_server(who, body)}, 201)


class ServerAllocationHandler(APIHandler):
    async def delete(self, holder):
        who = self.admin()
        await self.manager.release_server(who, self.path_arg(holder, "holder", HOLDER, "a server (user or user:name)"))
        self.set_status(204)
        self.finish()


class WarmHandler(APIHandler):
    async def post(self):
        who = self.principal()
        body = self.json_body()
        validation.check_schema("WarmRequest", body)
        self.write_json(await self.manager.warm(who, body), 202)


class QueueHandler(APIHandler):
    async def patch(self, name):
        who = self.admin()
        name = self.path_arg(name, "name", QUEUE, "a queue name")
        body = self.json_body()
        validation.check_schema("QueueChange", body)
        self.write_json(await self.manager.queues.change(who, name, body))

    async def delete(self, name):
        who = self.admin()
        self.write_json(await self.manager.queues.reset(who, self.path_arg(name, "name", QUEUE, "a queue name")))


class QueueHoldHandler(APIHandler):
    async def post(self, name, action):
        who = self.admin()
        name = self.path_arg(name, "name", QUEUE, "a queue name")
        self.write_json(await self.manager.queues.hold(who, name, action == "hold"))


class DrainHandler(APIHandler):
    async def post(self):
        who = self.admin()
        body = self.json_body()
        validation.check_schema("Drain", body)
        self.write_json(await self.manager.queues.drain(who, body["on"]))


class AuditHandler(APIHandler):
    async def get(self):
        who = self.admin()
        self.write_json(
            {
                "records": await self.manager.audit.records(
                    who,
                    limit=self.int_arg("limit", 200, minimum=1, maximum=10_000),
                    action=self.str_arg("action"),
                    target=self.str_arg("target"),
                )
            }
        )

    async def post(self):
        """The hub records logins here (its own token); no other action may be written from outside."""
        who = self.principal()
        body = self.json_body()
        validation.check_schema("AuditEvent", body)
        self.write_json(await self.manager.audit.record_login(who, body), 201)


class AuditVerifyHandler(APIHandler):
    async def get(self):
        self.write_json(await self.manager.audit.verify(self.admin()))


class MetricsHandler(APIHandler):
    def get(self):
        text = self.manager.metrics_text(self.principal())
        self.set_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.finish(text)
