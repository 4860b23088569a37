"""HTTP handlers of the jobs service's user API (tornado, behind JupyterHub's proxy).

Each handler translates one request into one :class:`~danlu.hub.service.manager.JobManager`
call (authentication, errors and bounded input live in :mod:`.web`). The
admin endpoints are in :mod:`.admin`, the runner API in
:mod:`.runner`, the HTML pages in :mod:`.pages`; :func:`routes` puts
them together. A job's log and notebooks are streamed in chunks read through
the backend, never loaded whole; a log follower holds one small task, is
bounded in number, and lets go of everything when its client leaves.
"""

from __future__ import annotations

import asyncio
import json

from tornado.iostream import StreamClosedError

from danlu import __version__
from danlu.errors import DanluError, NotFound
from danlu.hub.service import validation
from danlu.hub.service.api import pages
from danlu.hub.service.api.web import APIHandler
from danlu.hub.service.formats import JOB_ID
from danlu.hub.service.states import FINAL, JobState

CHUNK = 256 * 1024
MAX_FOLLOWERS = 512
MAX_FOLLOWERS_PER_USER = 32
FOLLOW_POLL = 0.5
RECHECK = 10.0  # seconds between database looks of a follower (the end event is the fast path)


class HealthHandler(APIHandler):
    def get(self):
        self.write_json({"status": "ok", "version": __version__})


class OpenAPIHandler(APIHandler):
    def get(self):
        self.write_json(validation.openapi())


class ProfilesHandler(APIHandler):
    async def get(self):
        self.write_json(await self.manager.profiles_for(self.principal()))


class JobsHandler(APIHandler):
    def compute_etag(self):
        # no ETag: a page is up to 1.5 MB, and tornado hashes the whole of it on the event loop (2 ms of
        # every other request's time) for a header that no client sends back, as answers are no-store
        return None

    async def get(self):
        who = self.principal()
        states = [s for s in (self.str_arg("state", "") or "").split(",") if s]
        self.finish(
            await self.manager.page_json(
                who,
                states=states,
                owner=self.str_arg("owner"),
                queue=self.str_arg("queue"),
                limit=self.int_arg("limit", 200, minimum=1, maximum=1000),
                cursor=self.str_arg("cursor"),
            )
        )

    async def post(self):
        who = self.principal()
        status, body = await self.manager.submit(who, self.json_body())
        self.write_json(body, status)


class ExperimentsHandler(APIHandler):
    async def get(self):
        who = self.principal()
        self.write_json({"experiments": await self.manager.experiments(who, owner=self.str_arg("owner"))})


class JobHandler(APIHandler):
    async def get(self, job_id):
        who = self.principal()
        self.write_json(await self.manager.job_view(who, self.job_arg(job_id)))

    async def patch(self, job_id):
        who = self.principal()
        body = self.json_body()
        validation.check_schema("JobChange", body)
        self.write_json(await self.manager.reprioritize(who, self.job_arg(job_id), body["priority"]))


class CancelHandler(APIHandler):
    async def post(self, job_id):
        who = self.principal()
        self.write_json(await self.manager.cancel(who, self.job_arg(job_id)))


class CheckpointHandler(APIHandler):
    async def post(self, job_id):
        who = self.principal()  # 202: asked; the job's code saves at its next look (at most every 10 s)
        self.write_json(await self.manager.checkpoint(who, self.job_arg(job_id)), status=202)


class NotebookHandler(APIHandler):
    """The executed notebook (``/output``, any rank) or the submitted one (``/input``), streamed."""

    login_redirect = True  # the job card's and the jobs page's links

    async def get(self, job_id, which):
        who = self.principal()
        job_id = self.job_arg(job_id)
        html = self.str_arg("format", "ipynb", choices=("ipynb", "html")) == "html"
        if which == "input":
            job, data = await self.manager.input_notebook(who, job_id)
            if html:
                return await pages.render_notebook(self, data)
            self._headers_for(job, which)
            self.finish(data)
            return
        job = await self.manager.get(who, job_id)
        rank = self.int_arg("rank", 0, maximum=4096)
        first = await self._read(job, rank, 0)
        if first is None:
            raise NotFound(f"no output yet: job {job.id} is {job.state}", reason="no_output")
        data, size = first
        if html:
            return await pages.render_notebook(self, await self._whole(job, rank, data, size))
        self._headers_for(job, which)
        offset = len(data)
        while True:
            self.write(data)
            try:
                await self.flush()
            except StreamClosedError:
                return
            if offset >= size or not data:
                break
            got = await self._read(job, rank, offset)
            data = got[0][: max(0, size - offset)] if got else b""
            offset += len(data)
        self.finish()

    async def _read(self, job, rank: int, offset: int):
        return await self.manager.read_output(job, rank, offset, CHUNK)

    async def _whole(self, job, rank: int, data: bytes, size: int) -> bytes:
        if size > pages.MAX_HTML:
            raise DanluError(
                f"the notebook is {size // 2**20} MiB, too large to show as HTML",
                status=413,
                reason="too_large",
                fix="download it as ipynb (leave out format=html)",
            )
        parts = [data]
        offset = len(data)
        while offset < size:
            got = await self._read(job, rank, offset)
            if not got or not got[0]:
                break
            parts.append(got[0])
            offset += len(got[0])
        return b"".join(parts)[:size]

    def _headers_for(self, job, which: str) -> None:
        self.set_header("Content-Type", "application/x-ipynb+json")
        self.set_header("Content-Disposition", f'attachment; filename="{job.id}-{which}.ipynb"')


class LogsHandler(APIHandler):
    """The job log; ``follow`` streams until the job ends, as text or server-sent events."""

    login_redirect = True
    followers: dict[str, int] = {}
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

    async def _read(self, job, offset: int) -> tuple[bytes, int]:
        return await self.manager.read_log(job, offset, CHUNK)

    async def get(self, job_id):
        who = self.principal()
        job = await self.manager.get(who, self.job_arg(job_id))
        follow = self.bool_arg("follow")
        tail = self.int_arg("tail", None, maximum=100_000)
        offset = self.int_arg("offset", 0)
        sse = "text/event-stream" in self.request.headers.get("Accept", "")
        if follow:
            self._join(who.name)
        try:
            await self._stream(who, job, follow, tail, offset, sse)
        finally:
            if follow:
                self._leave(who.name)

    def _join(self, user: str) -> None:
        counts = LogsHandler.followers
        if sum(counts.values()) >= MAX_FOLLOWERS or counts.get(user, 0) >= MAX_FOLLOWERS_PER_USER:
            raise DanluError(
                "too many logs are being followed",
                status=429,
                reason="too_many_followers",
                fix="close other log views, or read the log without follow",
            )
        counts[user] = counts.get(user, 0) + 1
        self.manager.metrics.followers.inc()

    def _leave(self, user: str) -> None:
        counts = LogsHandler.followers
        counts[user] -= 1
        if counts[user] <= 0:
            del counts[user]
        self.manager.metrics.followers.dec()

    async def _stream(self, who, job, follow: bool, tail: int | None, offset: int, sse: bool) -> None:
        self.set_header("Content-Type", "text/event-stream" if sse else "text/plain; charset=utf-8")
        if tail is not None:
            _, size = await self._read(job, 0)
            data, _ = await self._read(job, max(0, size - CHUNK))
            self._emit(b"".join(data.splitlines(keepends=True)[-tail:]) if tail else b"", sse)
            offset = size
        ended = self.manager.ended(job.id)
        if follow and JobState(job.state) not in FINAL:
            job = await self.manager.get(who, job.id)  # it may have ended before the event existed
        final = JobState(job.state) in FINAL
        waiter = asyncio.ensure_future(ended.wait()) if follow and not final else None
        checked = asyncio.get_running_loop().time()
        try:
            while True:
                data, size = await self._read(job, offset)
                offset += len(data)
                self._emit(data, sse)
                if len(data) == CHUNK:
                    continue
                # the runner writes its last log line before it reports, so once final the log is complete
                if not follow or final or self._closed:
                    break
                try:
                    await self.flush()
                except StreamClosedError:
                    return
                if waiter is not None:
                    await asyncio.wait({waiter}, timeout=FOLLOW_POLL)
                if waiter is None or waiter.done() or self._closed:
                    final = True  # one more read picks up the last lines
                elif asyncio.get_running_loop().time() - checked > RECHECK:
                    checked = asyncio.get_running_loop().time()
                    job = await self.manager.get(who, job.id)
                    final = JobState(job.state) in FINAL
        finally:
            if waiter is not None:
                waiter.cancel()
        if self._closed:
            return
        if sse:
            state = (await self.manager.get(who, job.id)).state
            self.write(f"event: end\ndata: {json.dumps({'state': state})}\n\n")
        self.finish()


class QueuesHandler(APIHandler):
    async def get(self):
        self.principal()
        self.write_json(await self.manager.queues_view())


class ReproduceHandler(APIHandler):
    async def post(self, job_id):
        who = self.principal()
        self.write_json(await self.manager.reproduce(who, self.job_arg(job_id)), 201)


class CompareHandler(APIHandler):
    async def get(self, job_id, other):
        who = self.principal()
        other = self.path_arg(other, "other", JOB_ID, "a job id (12 hex digits)")
        self.write_json(await self.manager.compare(who, self.job_arg(job_id), other))


class ServerWarningsHandler(APIHandler):
    async def get(self):
        """The caller's servers that idle GPU culling will stop soon: when, why, and how to keep them."""
        culler = self.manager.gpu_culler
        self.write_json({"warnings": culler.warnings(self.principal().name) if culler is not None else []})


class UsageHandler(APIHandler):
    async def get(self):
        who = self.principal()
        by = self.str_arg("by", "user", choices=validation.USAGE_GROUPINGS)
        start, end = validation.time_range(self.query_arg("from"), self.query_arg("to"))
        self.write_json(await self.manager.usage(who, user=self.str_arg("user"), by=by, start=start, end=end))
