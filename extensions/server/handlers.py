"""The REST API of the server extension, under ``{base_url}danlu/api/``.

Each handler authenticates the browser with Jupyter's own login (cookie and
XSRF, or a token header), checks its input, and makes the upstream calls in
:mod:`danlu.lab.upstream` with this server's tokens, so no token reaches the
page. Errors are mapped to JSON (``{"message", "reason", "status", "field"}``)
in one place, :meth:`DanluHandler.write_error`; nothing answers a traceback.
The endpoints are listed in :data:`ROUTES` and documented in
docs/architecture.md ("The lab extension").
"""

from __future__ import annotations

import asyncio
import json
import re

from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.handler import ExtensionHandlerMixin
from jupyter_server.utils import ensure_async
from tornado import web
from tornado.iostream import StreamClosedError

from danlu import tags
from danlu.errors import Conflict, DanluError, NotFound, UsageError
from danlu.lab.upstream import Stream

JOB_ID = re.compile(r"^[0-9a-f]{12}$")
MLFLOW_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # run and experiment ids (uuid hex, or numbers)
MODEL_NAME = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.]{0,62}$")  # the jobs service's model names
SWEEP = "a sweep id (12 hex digits)"
MODEL_VERSION = re.compile(r"^[1-9][0-9]{0,8}$")
MAX_BODY = 4096  # bytes of a request body the extension forwards (a model registration is a few dozen)
MAX_IDS = 50
MAX_RUNS = 5000
USER_TAG, JOB_TAG = tags.USER, tags.JOB_ID


def check_id(value, field: str, pattern: re.Pattern = MLFLOW_ID, what: str = "an id") -> str:
    if not isinstance(value, str) or not pattern.match(value):
        raise UsageError(f"{field}: {str(value)[:80]!r} is not {what}", field=field, reason="bad_id")
    return value


def check_job_id(value, field: str = "job_id") -> str:
    return check_id(value, field, JOB_ID, "a job id (12 hex digits)")


def _int(value):
    return int(value) if isinstance(value, str) and value.isdigit() else value


def run_summary(run: dict, mlflow_ui: str) -> dict:
    """An MLflow run (REST JSON) as the sidebar shows it."""
    info, data = run["info"], run.get("data") or {}
    tags = {t["key"]: t["value"] for t in data.get("tags", [])}
    return {
        "run_id": info["run_id"],
        "run_name": info.get("run_name") or tags.get("mlflow.runName") or info["run_id"],
        "experiment_id": info.get("experiment_id"),
        "status": info.get("status"),
        "start_time": _int(info.get("start_time")),
        "end_time": _int(info.get("end_time")),
        "params": {p["key"]: p["value"] for p in data.get("params", [])},
        "metrics": {m["key"]: m["value"] for m in data.get("metrics", [])},
        "job_id": tags.get(JOB_TAG),
        "mlflow_url": f"{mlflow_ui}#/experiments/{info.get('experiment_id')}/runs/{info['run_id']}",
    }


def logdir_name(job: dict) -> str:
    """A TensorBoard run name for a job (no ',' or ':', which --logdir_spec uses)."""
    return f"{re.sub(r'[^A-Za-z0-9._-]+', '_', job.get('name') or 'job')}-{job['id'][:6]}"


class DanluHandler(ExtensionHandlerMixin, APIHandler):
    """Base of every endpoint: the extension's state, input checks, and errors as JSON."""

    @property
    def lab(self):
        return self.settings["danlu_lab"]

    @property
    def user(self) -> str:
        return self.lab.user_name or self.current_user.username

    def write_error(self, status_code: int, **kwargs) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, DanluError):
            self.set_status(exc.status)
            body = exc.to_dict()
        elif isinstance(exc, web.HTTPError):
            body = {
                "status": status_code,
                "reason": (exc.reason or self._reason).lower().replace(" ", "_"),
                "message": exc.log_message or exc.reason or self._reason,
            }
        else:
            body = {
                "status": status_code,
                "reason": "internal_error",
                "message": "internal error in the Danlu server extension: see the Jupyter server's log",
            }
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.finish(json.dumps(body))

    def log_exception(self, typ, value, tb):
        if isinstance(value, DanluError) and value.status < 500:
            return  # the caller's mistake: Jupyter's access log has the line, the caller has the message
        if isinstance(value, DanluError):
            self.log.warning("%s %s -> %s: %s", self.request.method, self.request.path, value.status, value.log_message)
        else:
            super().log_exception(typ, value, tb)

    def json_body(self) -> dict:
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError:
            raise UsageError("the request body is not JSON", field="body") from None
        if not isinstance(body, dict):
            raise UsageError("the request body must be a JSON object", field="body")
        return body

    def write_json(self, data) -> None:
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.finish(json.dumps(data))

    async def own_run(self, run_id: str, field: str = "run_id") -> dict:
        """An MLflow run of this user; 404 for anyone else's."""
        check_id(run_id, field, what="an MLflow run id")
        try:
            run = (await self.lab.mlflow.fetch("GET", "/runs/get", params={"run_id": run_id}))["run"]
        except DanluError as e:
            if e.status in (400, 404):
                raise NotFound(f"run {run_id} not found", reason="no_such_run", field=field) from None
            raise
        tags = {t["key"]: t["value"] for t in (run.get("data") or {}).get("tags", [])}
        if tags.get(USER_TAG) != self.user:
            raise NotFound(f"run {run_id} not found", reason="no_such_run", field=field)
        return run

    async def user_runs(self, experiment_ids: list[str]) -> list[dict]:
        """This user's runs (tag danlu.user) in some experiments, newest first."""
        user = self.user.replace("\\", "\\\\").replace("'", "\\'")
        body = {
            "experiment_ids": experiment_ids,
            "filter": f"tags.`{USER_TAG}` = '{user}'",
            "max_results": 1000,
            "order_by": ["attributes.start_time DESC"],
        }
        runs: list[dict] = []
        while experiment_ids and len(runs) < MAX_RUNS:
            page = await self.lab.mlflow.fetch("POST", "/runs/search", body=body) or {}
            runs += page.get("runs", [])
            if not page.get("next_page_token"):
                break
            body["page_token"] = page["next_page_token"]
        return runs


class WhoAmIHandler(DanluHandler):
    @web.authenticated
    async def get(self):
        self.write_json(
            {
                "user": self.user,
                "admin": await self.lab.is_admin(),
                "hub_url": self.lab.hub_url,
                "mlflow_url": self.lab.mlflow_ui_url,
            }
        )


class PassThroughHandler(DanluHandler):
    """``profiles`` and ``queues``: the jobs service's answer as it is."""

    @web.authenticated
    async def get(self, what):
        self.write_json(await self.lab.jobs.fetch("GET", f"/{what}"))


class CullWarningsHandler(DanluHandler):
    """``servers/warnings``: this user's servers that GPU-aware culling will stop soon (theirs only, whatever
    the token the service saw; an older service's 404 reaches the lab as a 404, which it reads as none)."""

    @web.authenticated
    async def get(self):
        data = await self.lab.jobs.fetch("GET", "/servers/warnings")
        warnings = data.get("warnings") if isinstance(data, dict) else None
        self.write_json({"warnings": [w for w in warnings or [] if isinstance(w, dict) and w.get("user") == self.user]})


class JobsHandler(DanluHandler):
    @web.authenticated
    async def get(self):
        jobs = (await self.lab.jobs.fetch("GET", "/jobs", params={"owner": self.user}))["jobs"]
        self.write_json({"jobs": [j for j in jobs if j.get("owner") == self.user]})


class JobHandler(DanluHandler):
    @web.authenticated
    async def get(self, job_id):
        self.write_json(await self.lab.jobs.fetch("GET", f"/jobs/{check_job_id(job_id)}"))


class CancelHandler(DanluHandler):
    @web.authenticated
    async def post(self, job_id):
        self.write_json(await self.lab.jobs.fetch("POST", f"/jobs/{check_job_id(job_id)}/cancel", timeout=120))


class OutputHandler(DanluHandler):
    """Saves the executed notebook into ``danlu-outputs/<id>.ipynb`` under the server's root."""

    @web.authenticated
    async def get(self, job_id):
        job_id = check_job_id(job_id)
        raw = await self.lab.jobs.fetch_raw("GET", f"/jobs/{job_id}/output", timeout=120)
        try:
            nb = json.loads(raw)
        except ValueError:
            raise DanluError(f"the output of job {job_id} is not a notebook", status=502) from None
        cm = self.contents_manager
        folder = self.lab.output_dir.strip("/")
        if not await ensure_async(cm.dir_exists(folder)):
            await ensure_async(cm.save({"type": "directory"}, folder))
        path = f"{folder}/{job_id}.ipynb"
        await ensure_async(cm.save({"type": "notebook", "format": "json", "content": nb}, path))
        self.write_json({"path": path})


class LogStreamHandler(DanluHandler):
    """The job's log as server-sent events: the log so far, each new line, then ``event: end``."""

    _closed = False
    _stream = None

    def on_connection_close(self):
        self._closed = True
        if self._stream is not None:
            self._stream.close()  # hang up on the jobs service too

    def _send(self, text: str) -> None:
        if self._closed:
            raise StreamClosedError()
        self.write(text)
        self.flush().add_done_callback(lambda f: f.exception())

    @web.authenticated
    async def get(self, job_id):
        job_id = check_job_id(job_id)
        await self.lab.jobs.fetch("GET", f"/jobs/{job_id}")  # a missing job is a plain JSON 404
        self.set_header("Content-Type", "text/event-stream; charset=utf-8")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")
        pending = b""

        def on_chunk(chunk: bytes) -> None:
            nonlocal pending
            *lines, pending = (pending + chunk).split(b"\n")
            if lines:
                self._send(
                    "".join(f"data: {json.dumps({'line': line.decode('utf-8', 'replace')})}\n\n" for line in lines)
                )

        self._stream = Stream()
        try:
            await self.lab.jobs.stream(
                self._stream, f"/jobs/{job_id}/logs", on_chunk, params={"follow": "true"}, timeout=7 * 24 * 3600.0
            )
            if pending:
                on_chunk(b"\n")
            state = (await self.lab.jobs.fetch("GET", f"/jobs/{job_id}"))["state"]
            self._send(f"event: end\ndata: {json.dumps({'state': state})}\n\n")
        except (StreamClosedError, asyncio.CancelledError):
            return
        except DanluError as e:
            if self._closed:
                return
            self._send(f"event: error\ndata: {json.dumps({'message': str(e)})}\n\n")
        finally:
            self._stream.close()
        if not self._closed:
            self.finish()


class ExperimentsHandler(DanluHandler):
    """The experiments holding this user's runs, from the jobs service's records (not an MLflow search)."""

    @web.authenticated
    async def get(self):
        found = (await self.lab.jobs.fetch("GET", "/experiments"))["experiments"]
        self.write_json(
            {
                "experiments": [
                    {"experiment_id": e["experiment_id"], "name": e["name"], "runs": e["runs"]}
                    for e in found
                    if e.get("experiment_id")
                ]
            }
        )


class RunsHandler(DanluHandler):
    @web.authenticated
    async def get(self):
        raw = self.get_argument("experiment_id", None)
        if not raw:
            raise UsageError("query parameter experiment_id is required", field="experiment_id")
        experiment_id = check_id(raw, "experiment_id", what="an MLflow experiment id")
        runs = await self.user_runs([experiment_id])
        self.write_json({"runs": [run_summary(r, self.lab.mlflow_ui_url) for r in runs]})


class MetricHistoryHandler(DanluHandler):
    @web.authenticated
    async def get(self):
        key = self.get_argument("key", "")
        if not key or len(key) > 250:
            raise UsageError("query parameter key (a metric name) is required", field="key")
        run_ids = self.get_arguments("run_id")
        if not run_ids:
            raise UsageError("give at least one run_id", field="run_id")
        if len(run_ids) > MAX_IDS:
            raise UsageError(f"at most {MAX_IDS} run_id values", field="run_id")
        runs = await asyncio.gather(*(self.own_run(r) for r in dict.fromkeys(run_ids)))
        histories = await asyncio.gather(*(self._history(r["info"]["run_id"], key) for r in runs))
        self.write_json(
            {
                "key": key,
                "series": [
                    {"run_id": r["info"]["run_id"], "run_name": run_summary(r, "")["run_name"], "points": points}
                    for r, points in zip(runs, histories, strict=True)
                ],
            }
        )

    async def _history(self, run_id: str, key: str) -> list:
        params, by_step = {"run_id": run_id, "metric_key": key, "max_results": 25000}, {}
        while True:
            page = await self.lab.mlflow.fetch("GET", "/metrics/get-history", params=params) or {}
            for m in page.get("metrics", []):
                step, stamp = int(m.get("step", 0)), int(m.get("timestamp", 0))
                if step not in by_step or stamp >= by_step[step][0]:
                    by_step[step] = (stamp, m["value"])  # the latest value logged at each step
            if not page.get("next_page_token"):
                break
            params["page_token"] = page["next_page_token"]
        return [[step, value] for step, (_, value) in sorted(by_step.items())]


class TensorBoardHandler(DanluHandler):
    """``POST tensorboard`` with ``job_ids`` or ``run_ids``: a TensorBoard over their event files."""

    @web.authenticated
    async def post(self):
        body = self.json_body()
        given = [k for k in ("job_ids", "run_ids") if body.get(k) is not None]
        if len(given) != 1:
            raise UsageError("give either job_ids or run_ids (a list of ids)", field="job_ids")
        field = given[0]
        ids = body[field]
        if not isinstance(ids, list) or not ids or len(ids) > MAX_IDS:
            raise UsageError(f"{field} must be a list of 1 to {MAX_IDS} ids", field=field)
        if field == "run_ids":
            runs = await asyncio.gather(*(self.own_run(r, field) for r in ids))
            ids = []
            for run in runs:
                tags = {t["key"]: t["value"] for t in (run.get("data") or {}).get("tags", [])}
                if not tags.get(JOB_TAG):
                    raise Conflict(
                        f"run {run['info']['run_id']} was not made by a Danlu job, so it has no TensorBoard files here",
                        field=field,
                        reason="no_job",
                    )
                ids.append(tags[JOB_TAG])
        jobs = await asyncio.gather(
            *(self.lab.jobs.fetch("GET", f"/jobs/{check_job_id(j, field)}") for j in dict.fromkeys(ids))
        )
        logdirs = {}
        for job in jobs:
            if not job.get("tensorboard_dir"):
                raise Conflict(
                    f"the jobs service does not say where job {job['id']}'s TensorBoard files are",
                    field=field,
                    reason="no_tensorboard_dir",
                )
            if "," in job["tensorboard_dir"]:
                raise Conflict(
                    f"TensorBoard cannot read {job['tensorboard_dir']!r} (a ',' in the path)",
                    field=field,
                    reason="bad_logdir",
                )
            logdirs[logdir_name(job)] = job["tensorboard_dir"]
        manager = self.lab.tensorboards
        board = manager.register(logdirs)
        await manager.ensure(board.id)
        self.write_json({"id": board.id, "url": manager.url(board.id), "logdirs": board.logdirs})


class ModelsHandler(DanluHandler):
    """``GET models``: the registered models; ``POST models`` ``{"run_id", "name"}``: register a run's model.

    The body is checked here (size, keys, the name's pattern) so a malformed one never leaves the server;
    whether this user may register that run is the jobs service's to say (its answer passes through).
    """

    @web.authenticated
    async def get(self):
        self.write_json(await self.lab.jobs.fetch("GET", "/models"))

    @web.authenticated
    async def post(self):
        if len(self.request.body or b"") > MAX_BODY:
            raise UsageError(f"the request body is over {MAX_BODY} bytes", field="body", reason="too_large")
        body = self.json_body()
        extra = sorted(set(body) - {"run_id", "name"})
        if extra:
            raise UsageError(f"unknown field {extra[0][:40]!r}: give only run_id and name", field=extra[0][:40])
        for field, what in (("run_id", "the MLflow run whose model to register"), ("name", "the model's name")):
            if body.get(field) in (None, ""):
                raise UsageError(f"{field} is required: {what}", field=field)
        run_id = check_id(body.get("run_id"), "run_id", what="an MLflow run id")
        name = check_id(
            body.get("name"),
            "name",
            MODEL_NAME,
            "a model name (a letter or digit, then up to 62 letters, digits, '-', '_' or '.')",
        )
        version = await self.lab.jobs.fetch("POST", "/models", body={"run_id": run_id, "name": name}, timeout=120)
        self.set_status(201)
        self.write_json(version)


class LineageHandler(DanluHandler):
    """``GET lineage/models/{name}/{version}``: the jobs service's lineage graph of one model version."""

    @web.authenticated
    async def get(self, name, version):
        name = check_id(name, "name", MODEL_NAME, "a model name")
        version = check_id(version, "version", MODEL_VERSION, "a model version (a number from 1)")
        self.write_json(await self.lab.jobs.fetch("GET", f"/lineage/models/{name}/{version}"))


class SweepsHandler(DanluHandler):
    """``GET sweeps``: this user's sweeps (an admin's server, too, lists only its user's)."""

    @web.authenticated
    async def get(self):
        sweeps = (await self.lab.jobs.fetch("GET", "/sweeps", params={"owner": self.user}))["sweeps"]
        self.write_json({"sweeps": [s for s in sweeps if s.get("owner") == self.user]})


class SweepHandler(DanluHandler):
    """``GET sweeps/{id}``: one sweep with its trials and best-so-far curve."""

    @web.authenticated
    async def get(self, sweep_id):
        self.write_json(await self.lab.jobs.fetch("GET", f"/sweeps/{check_id(sweep_id, 'id', JOB_ID, SWEEP)}"))


class SweepStopHandler(DanluHandler):
    """``POST sweeps/{id}/stop``: the jobs service cancels the sweep's queued and running trials."""

    @web.authenticated
    async def post(self, sweep_id):
        path = f"/sweeps/{check_id(sweep_id, 'id', JOB_ID, SWEEP)}/stop"
        self.write_json(await self.lab.jobs.fetch("POST", path, timeout=120))


class NotFoundHandler(DanluHandler):
    @web.authenticated
    def prepare_404(self):
        raise NotFound(f"no such endpoint: {self.request.method} {self.request.path}", reason="no_endpoint")

    get = post = put = delete = patch = prepare_404


_JOB = r"jobs/(?P<job_id>[^/]+)"
ROUTES = [
    (r"danlu/api/whoami", WhoAmIHandler),
    (r"danlu/api/(?P<what>profiles|queues)", PassThroughHandler),
    (r"danlu/api/servers/warnings", CullWarningsHandler),
    (r"danlu/api/jobs", JobsHandler),
    (rf"danlu/api/{_JOB}", JobHandler),
    (rf"danlu/api/{_JOB}/cancel", CancelHandler),
    (rf"danlu/api/{_JOB}/output", OutputHandler),
    (rf"danlu/api/{_JOB}/logs/stream", LogStreamHandler),
    (r"danlu/api/experiments", ExperimentsHandler),
    (r"danlu/api/runs", RunsHandler),
    (r"danlu/api/metric-history", MetricHistoryHandler),
    (r"danlu/api/tensorboard", TensorBoardHandler),
    (r"danlu/api/models", ModelsHandler),
    (r"danlu/api/lineage/models/(?P<name>[^/]+)/(?P<version>[^/]+)", LineageHandler),
    (r"danlu/api/sweeps", SweepsHandler),
    (r"danlu/api/sweeps/(?P<sweep_id>[^/]+)", SweepHandler),
    (r"danlu/api/sweeps/(?P<sweep_id>[^/]+)/stop", SweepStopHandler),
    (r"danlu/api/.*", NotFoundHandler),
]
