"""HTTP handlers of the jobs service (tornado, behind JupyterHub's proxy).

Every handler derives from :class:`APIHandler`, which authenticates the caller
through JupyterHub (token header or the browser's hub login, via
``HubOAuthenticated``), turns the hub's user model into a
:class:`~danlu.hub.service.auth.Principal`, and maps every error to a JSON
body in one place (``write_error``): a :class:`~danlu.errors.DanluError`
keeps its status, reason and field; anything unexpected is a logged 500 with
no traceback in the response. Handlers only translate HTTP to
:class:`~danlu.hub.service.jobs.JobManager` calls.
"""

from __future__ import annotations

import asyncio
import json

from jupyterhub.services.auth import HubOAuthenticated
from tornado import web
from tornado.iostream import StreamClosedError
from tornado.log import app_log

from danlu import __version__
from danlu.errors import DanluError, Forbidden, NotFound, UsageError
from danlu.hub.service import validation
from danlu.hub.service.auth import Principal
from danlu.hub.service.states import FINAL, JobState

MAX_BODY = 64 * 1024 * 1024


class APIHandler(HubOAuthenticated, web.RequestHandler):
    @property
    def jobs(self):
        return self.settings["danlu_jobs"]

    def check_xsrf_cookie(self):
        # token-authenticated API calls are exempt; cookie-authenticated writes are checked by HubOAuth
        if self.request.headers.get("Authorization"):
            return
        return super().check_xsrf_cookie()

    def set_default_headers(self):
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Content-Type-Options", "nosniff")

    def wants_html(self) -> bool:
        return self.request.method == "GET" and "text/html" in self.request.headers.get("Accept", "")

    def principal(self) -> Principal:
        model = self.current_user
        if not model and self.wants_html() and not self.request.headers.get("Authorization"):
            # a browser following a link (job card, Services menu): through the hub's login and back
            self.redirect(self.get_login_url())
            raise web.Finish()
        if not model:
            if self.request.headers.get("Authorization"):
                raise Forbidden("this token may not use the Danlu service", reason="token_rejected",
                                fix="use a JupyterHub token of yours (JUPYTERHUB_API_TOKEN in your server)")
            raise DanluError("authentication required", status=401, reason="unauthenticated",
                             fix="send 'Authorization: token <JupyterHub token>' or log in at /hub/login")
        return Principal(name=model["name"], kind=model.get("kind", "user"),
                         scopes=frozenset(model.get("scopes", [])), groups=tuple(model.get("groups") or ()))

    def json_body(self):
        if len(self.request.body) > MAX_BODY:
            raise DanluError(f"the request body is larger than {MAX_BODY // 2**20} MiB", status=413,
                             reason="too_large", field="body")
        return validation.parse_json(self.request.body)

    def write_json(self, data, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(data))

    def write_error(self, status_code: int, **kwargs) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, DanluError):
            body = exc.to_dict()
            self.set_status(exc.status)
        elif isinstance(exc, web.HTTPError):
            body = {"status": status_code, "reason": (exc.reason or "error").lower().replace(" ", "_"),
                    "message": exc.log_message or exc.reason or self._reason}
        else:
            body = {"status": status_code, "reason": "internal_error" if status_code >= 500 else "error",
                    "message": "internal error: see the service log" if status_code >= 500 else self._reason}
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.finish(json.dumps(body))

    def log_exception(self, typ, value, tb):
        if isinstance(value, DanluError) and value.status < 500:
            app_log.info("%s %s -> %s %s: %s", self.request.method, self.request.uri, value.status, value.reason,
                          value.log_message)
        else:
            super().log_exception(typ, value, tb)

    def int_arg(self, name: str, default=None, minimum: int = 0):
        raw = self.get_argument(name, None)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise UsageError(f"query parameter {name} must be a whole number, got {raw!r}", field=name) from None
        if value < minimum:
            raise UsageError(f"query parameter {name} must be at least {minimum}", field=name)
        return value

    def bool_arg(self, name: str) -> bool:
        return self.get_argument(name, "false").lower() in ("1", "true", "yes", "on")


class HealthHandler(APIHandler):
    def get(self):
        self.write_json({"status": "ok", "version": __version__})


class OpenAPIHandler(APIHandler):
    def get(self):
        self.write_json(validation.openapi())


class ProfilesHandler(APIHandler):
    async def get(self):
        who = self.principal()
        groups = await self.jobs.groups.groups_of(who.name, fallback=who.groups) if who.is_user else ()
        allowed = self.jobs.profiles.for_user(groups, admin=who.admin)
        default = self.jobs.profiles.default_for(groups, admin=who.admin)
        self.write_json({"profiles": [p.to_dict() for p in allowed], "default": default.slug if default else None})


class JobsHandler(APIHandler):
    def get(self):
        who = self.principal()
        states = [s for s in self.get_argument("state", "").split(",") if s]
        jobs = self.jobs.list(who, states=states, owner=self.get_argument("owner", None),
                              queue=self.get_argument("queue", None),
                              limit=min(self.int_arg("limit", 200, minimum=1), 1000))
        self.write_json({"jobs": [self.jobs.to_dict(j) for j in jobs]})

    async def post(self):
        who = self.principal()
        status, body = await self.jobs.submit(who, self.json_body())
        self.write_json(body, status)


class JobHandler(APIHandler):
    def get(self, job_id):
        self.write_json(self.jobs.to_dict(self.jobs.get(self.principal(), job_id)))

    async def patch(self, job_id):
        who = self.principal()
        body = self.json_body()
        validation.check_schema("JobChange", body)
        self.write_json(await self.jobs.reprioritize(who, job_id, body["priority"]))


class CancelHandler(APIHandler):
    async def post(self, job_id):
        self.write_json(await self.jobs.cancel(self.principal(), job_id))


class NotebookHandler(APIHandler):
    """The executed notebook (``/output``, any rank) or the submitted one (``/input``)."""

    def get(self, job_id, which):
        job = self.jobs.get(self.principal(), job_id)
        jd = self.jobs.jobdir(job.id)
        if which == "input":
            path = jd.input_notebook
        else:
            rank = self.int_arg("rank", 0)
            if rank >= job.nproc:
                raise NotFound(f"job {job.id} has ranks 0-{job.nproc - 1}", field="rank")
            path = jd.rank_notebook(rank)
        if not path.exists():
            raise NotFound(f"no output yet: job {job.id} is {job.state}", reason="no_output")
        if self.get_argument("format", "ipynb") == "html":
            self.set_header("Content-Type", "text/html; charset=utf-8")
            self.finish(render_html(path))
            return
        self.set_header("Content-Type", "application/x-ipynb+json")
        self.set_header("Content-Disposition", f'inline; filename="{job.name}-{which}.ipynb"')
        self.finish(path.read_bytes())


def render_html(path) -> str:
    """A notebook as a standalone HTML page (nbconvert's lab template), for browsers."""
    import nbformat
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nbformat.read(str(path), as_version=4))
    return body


def _tail(data: bytes, lines: int) -> bytes:
    if lines <= 0:
        return b""
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:])


class LogsHandler(APIHandler):
    """The job log; ``follow`` streams until the job ends, as text or server-sent events."""

    _closed = False

    def on_connection_close(self):
        self._closed = True

    def _emit(self, chunk: bytes, sse: bool) -> None:
        if not chunk:
            return
        if sse:
            text = chunk.decode("utf-8", "replace")
            self.write("".join(f"data: {line}\n\n" for line in text.splitlines()))
        else:
            self.write(chunk)

    async def get(self, job_id):
        who = self.principal()
        job = self.jobs.get(who, job_id)
        follow = self.bool_arg("follow")
        tail = self.int_arg("tail")
        if tail is not None and tail > 100_000:
            raise UsageError("query parameter tail must be at most 100000", field="tail")
        offset = self.int_arg("offset", 0)
        sse = "text/event-stream" in self.request.headers.get("Accept", "")
        self.set_header("Content-Type", "text/event-stream" if sse else "text/plain; charset=utf-8")
        path = self.jobs.backend.log_path(job.id)
        size = path.stat().st_size if path.exists() else 0
        if tail is not None and path.exists():
            with open(path, "rb") as f:
                f.seek(max(0, size - 256 * 1024))
                data = f.read()
            self._emit(_tail(data, tail), sse)
            offset = size
        ended = self.jobs.ended(job.id)
        checked = 0.0
        while True:
            final = ended.is_set()
            if not final and follow and asyncio.get_running_loop().time() - checked > 2:
                # a fallback for a job that ended before this follower subscribed
                checked = asyncio.get_running_loop().time()
                final = JobState(self.jobs.get(who, job_id).state) in FINAL
            if path.exists():
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read(1 << 20)
                offset += len(chunk)
                self._emit(chunk, sse)
                if len(chunk) == 1 << 20:
                    continue
            # the runner writes its last log line before its status, so once final the log is complete
            if not follow or final or self._closed:
                break
            try:
                await self.flush()
            except StreamClosedError:
                return
            try:
                await asyncio.wait_for(asyncio.shield(ended.wait()), 0.1)
            except asyncio.TimeoutError:
                pass
        if sse:
            self.write(f"event: end\ndata: {json.dumps({'state': self.jobs.get(who, job_id).state})}\n\n")
        self.finish()


class AllocationsHandler(APIHandler):
    def _admin(self) -> Principal:
        who = self.principal()
        if not who.admin:
            raise Forbidden("GPU allocations are managed by admins and the hub", reason="not_admin")
        return who

    def get(self):
        self._admin()
        with self.jobs.sessions() as s:
            rows = self.jobs.ledger.allocations(s)
            self.write_json({
                "gpus": [g.to_dict() for g in self.jobs.ledger.inventory],
                "allocations": [{"device": a.device, "holder_kind": a.holder_kind, "holder_id": a.holder_id,
                                 "owner": a.owner, "flavor": a.flavor, "since": a.since.isoformat() + "Z"}
                                for a in rows]})

    async def post(self):
        self._admin()
        body = self.json_body()
        validation.check_schema("AllocationRequest", body)
        devices = await self.jobs.allocate_server(body["holder"], body["owner"], body["gpus"],
                                                  profile=body.get("profile", ""), groups=body.get("groups", []))
        self.write_json({"devices": devices}, 201)

    async def delete(self, holder):
        self._admin()
        await self.jobs.release_server(holder)
        self.set_status(204)
        self.finish()


class JobsPageHandler(APIHandler):
    """``/services/danlu/``: the caller's jobs as a plain HTML page (the hub's Services menu links here)."""

    def get(self):
        import html

        who = self.principal()
        jobs = self.jobs.list(who, limit=200)
        rows = []
        for job in jobs:
            info = self.jobs.to_dict(job)
            links = [f'<a href="{html.escape(info["logs_url"])}">log</a>']
            if job.state in ("running", "succeeded", "failed"):
                links.append(f'<a href="{html.escape(info["output_url"])}?format=html">output</a>')
            if info["mlflow_run_url"]:
                links.append(f'<a href="{html.escape(info["mlflow_run_url"])}">MLflow run</a>')
            rows.append(f"<tr><td><code>{job.id}</code></td><td>{html.escape(job.name)}</td>"
                        f"<td>{html.escape(job.owner)}</td><td>{job.state}</td>"
                        f"<td>{html.escape(info['reason'] or '')}</td><td>{info['created_at']}</td>"
                        f"<td>{' · '.join(links)}</td></tr>")
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(
            "<!doctype html><html><head><meta charset='utf-8'><title>Danlu jobs</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:.3em .8em;text-align:left}"
            "tr:nth-child(even){background:#f4f4f4}</style></head><body>"
            f"<h1>Danlu jobs</h1><p>{html.escape(who.name)}{' (admin: every job)' if who.admin else ''} · "
            "<a href='/hub/home'>hub</a> · <a href='/services/mlflow/'>MLflow</a> · "
            "<a href='api/v1/openapi.json'>API</a></p>"
            "<table><tr><th>id</th><th>name</th><th>owner</th><th>state</th><th>reason</th><th>submitted</th>"
            f"<th></th></tr>{''.join(rows) or '<tr><td colspan=7>no jobs yet</td></tr>'}</table></body></html>")


class QueuesHandler(APIHandler):
    def get(self):
        who = self.principal()
        self.write_json({"queues": self.jobs.queues(who), "draining": self.jobs.draining,
                         "priority_classes": self.jobs.settings.priority_classes,
                         "default_priority_class": self.jobs.settings.default_priority_class})


class QueueHandler(APIHandler):
    async def patch(self, name):
        who = self.principal()
        self.write_json(await self.jobs.change_queue(who, name, self.json_body()))

    async def delete(self, name):
        self.write_json(await self.jobs.reset_queue(self.principal(), name))


class QueueHoldHandler(APIHandler):
    async def post(self, name, action):
        self.write_json(await self.jobs.hold(self.principal(), name, action == "hold"))


class DrainHandler(APIHandler):
    async def post(self):
        who = self.principal()
        body = self.json_body()
        validation.check_schema("Drain", body)
        self.write_json(await self.jobs.drain(who, body["on"]))


class AuditHandler(APIHandler):
    async def post(self, verify=None):
        """The hub records logins here (its own token); no other action may be written from outside."""
        who = self.principal()
        if not (who.kind == "service" and who.name == "danlu-admin"):
            raise Forbidden("only the hub records logins", reason="not_the_hub")
        body = self.json_body()
        validation.check_schema("AuditEvent", body)
        self.write_json(await self.jobs.audit_event(body["actor"], body["action"], "workbench",
                                                    after=body.get("details", {})), 201)

    def get(self, verify=None):
        from sqlalchemy import select

        from danlu.hub.service import audit
        from danlu.hub.service.models import AuditRecord

        who = self.principal()
        if not who.admin:
            raise Forbidden("the audit log is for admins", reason="not_admin")
        with self.jobs.sessions() as s:
            if verify:
                self.write_json(audit.verify(s).to_dict())
                return
            query = select(AuditRecord).order_by(AuditRecord.seq.desc()).limit(
                min(self.int_arg("limit", 200, minimum=1), 10000))
            if self.get_argument("action", None):
                query = query.where(AuditRecord.action == self.get_argument("action"))
            if self.get_argument("target", None):
                query = query.where(AuditRecord.target == self.get_argument("target"))
            self.write_json({"records": [audit.to_dict(r) for r in s.scalars(query)]})


def _when(handler, name: str, default):
    import datetime as dt

    raw = handler.get_argument(name, None)
    if raw is None:
        return default
    try:
        value = dt.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(f"query parameter {name} must be an ISO 8601 time, got {raw!r}", field=name,
                         fix="e.g. 2026-11-01 or 2026-11-01T08:00:00Z") from None
    if value.tzinfo is not None:
        value = value.astimezone(dt.timezone.utc).replace(tzinfo=None)
    return value


class UsageHandler(APIHandler):
    async def get(self):
        import datetime as dt

        from danlu.hub.service import usage
        from danlu.hub.service.models import utcnow

        who = self.principal()
        user = self.get_argument("user", None)
        by = self.get_argument("by", "user")
        if by not in usage.GROUPINGS:
            raise UsageError(f"query parameter by must be one of {', '.join(usage.GROUPINGS)}", field="by")
        if not who.admin:
            if user not in (None, who.name) or by != "user":
                raise Forbidden("you may see only your own usage", reason="not_admin", field="user",
                                fix=f"ask for user={who.name}, grouped by user")
            user = who.name
        end = _when(self, "to", utcnow())
        start = _when(self, "from", end - dt.timedelta(days=30))
        if start >= end:
            raise UsageError("from must be before to", field="from")
        with self.jobs.sessions() as s:
            body = usage.report(s, self.jobs.settings, start, end, by=by, owner=user)
        if who.admin:
            body["idle_gpu_servers"] = await self.jobs.idle_gpu_servers()
        self.write_json(body)


class MetricsHandler(APIHandler):
    def get(self):
        who = self.principal()
        if not who.admin:
            raise Forbidden("metrics are for admins (and Prometheus with an admin token)", reason="not_admin")
        self.set_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.finish(self.jobs.metrics.exposition())


class NotFoundHandler(APIHandler):
    def prepare(self):
        raise NotFound(f"no such endpoint: {self.request.method} {self.request.path}", reason="no_endpoint")


def routes(prefix: str) -> list:
    api = f"{prefix.rstrip('/')}/api/v1"
    job = r"/jobs/(?P<job_id>[^/]+)"
    return [
        (f"{prefix.rstrip('/')}/?", JobsPageHandler),
        (f"{api}/health", HealthHandler),
        (f"{api}/openapi.json", OpenAPIHandler),
        (f"{api}/profiles", ProfilesHandler),
        (f"{api}/jobs", JobsHandler),
        (f"{api}{job}", JobHandler),
        (f"{api}{job}/cancel", CancelHandler),
        (f"{api}{job}/logs", LogsHandler),
        (f"{api}{job}/(?P<which>output|input)", NotebookHandler),
        (f"{api}/allocations", AllocationsHandler),
        (f"{api}/allocations/server/(?P<holder>[^/]+)", AllocationsHandler),
        (f"{api}/queues", QueuesHandler),
        (f"{api}/queues/(?P<name>[^/]+)", QueueHandler),
        (f"{api}/queues/(?P<name>[^/]+)/(?P<action>hold|release)", QueueHoldHandler),
        (f"{api}/drain", DrainHandler),
        (f"{api}/audit", AuditHandler),
        (f"{api}/audit/(?P<verify>verify)", AuditHandler),
        (f"{api}/usage", UsageHandler),
        (f"{prefix.rstrip('/')}/metrics", MetricsHandler),
    ]
