"""A small client of the jobs service's REST API, shared by ``%%train`` and the CLI.

It finds the workbench from ``$DANLU_URL`` (set in every Danlu server; the
hub's base URL) and authenticates with ``$DANLU_TOKEN`` if set, else
``$JUPYTERHUB_API_TOKEN`` (set in every server). API errors come back as the matching
:class:`~danlu.errors.DanluError` with the server's message (:func:`error_from`,
the one parser of the service's error bodies, which the lab extension's server
part and the spawner use too), and an unreachable service as
:class:`~danlu.errors.Unreachable` that says what to check. The job runner uses
the same client for the runner API, with its attempt's token.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from urllib.parse import quote

import requests

from danlu import env
from danlu.errors import (
    Conflict,
    DanluError,
    Forbidden,
    NotFound,
    PolicyError,
    Unreachable,
    UsageError,
    ValidationError,
)

_BY_STATUS = {400: UsageError, 403: Forbidden, 404: NotFound, 409: Conflict, 413: UsageError, 422: ValidationError}


def error_from(status: int, body: bytes | str | None, service: str = "Danlu jobs service") -> DanluError:
    """The :class:`~danlu.errors.DanluError` an error response of a Danlu service means, for any client.

    The one parser of the service's error bodies (``{"status", "reason", "message", "field"}``),
    used by this client (the magic and the CLI), the lab extension's server part and the spawner.
    A 4xx keeps its status, reason, message and field; a 5xx becomes a 502 that names the service.
    """
    message = reason = field = None
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    try:
        data = json.loads(body) if body else None
    except ValueError:
        data = None
    if isinstance(data, dict):
        message = data.get("message") if isinstance(data.get("message"), str) else None
        reason = data.get("reason") if isinstance(data.get("reason"), str) else None
        field = data.get("field") if isinstance(data.get("field"), str) else None
    if message is None:
        message = (body or "").strip()[:300] or f"HTTP {status}"
    if status >= 500:
        return DanluError(f"the {service} failed: {message}", status=502, reason="upstream_error")
    if status == 401:
        return DanluError(
            f"{message} (no valid token: set JUPYTERHUB_API_TOKEN or {env.TOKEN})",
            status=401,
            reason=reason or "unauthenticated",
        )
    cls = _BY_STATUS.get(status, DanluError)
    if status == 403 and reason and reason not in ("forbidden", "token_rejected", "not_admin"):
        cls = PolicyError
    return cls(message, reason=reason, field=field, status=status)


def default_url() -> str:
    return env.URL.get("http://127.0.0.1:8000").rstrip("/")


def default_token() -> str | None:
    return env.TOKEN.get() or os.environ.get("JUPYTERHUB_API_TOKEN")


class DanluClient:
    """The jobs API over HTTP: ``url`` is the workbench (the hub's base URL), or, with ``api``, the API itself."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        timeout: float = 30.0,
        *,
        api: str | None = None,
        scheme: str = "token",
    ):
        self.url = (url or default_url()).rstrip("/")
        self.api = (api or f"{self.url}/services/danlu/api/v1").rstrip("/")
        self.token = token or default_token()
        self.timeout = timeout
        self.session = requests.Session()
        if self.token:
            self.session.headers["Authorization"] = f"{scheme} {self.token}"

    def request(
        self,
        method: str,
        path: str,
        *,
        json=None,
        params=None,
        stream: bool = False,
        timeout: float | tuple | None = None,
        data: bytes | None = None,
    ) -> requests.Response:
        if not self.token:
            raise UsageError(f"no API token: set JUPYTERHUB_API_TOKEN (inside a Danlu server it is set) or {env.TOKEN}")
        try:
            response = self.session.request(
                method,
                f"{self.api}{path}",
                json=json,
                params=params,
                stream=stream,
                timeout=timeout or self.timeout,
                data=data,
                headers={"Content-Type": "application/json"} if data is not None else None,
            )
        except requests.ConnectionError:
            raise Unreachable(
                f"cannot reach the Danlu jobs service at {self.url}",
                fix=f"is 'danlu up' running there? set {env.URL} to the workbench's address",
            ) from None
        except requests.Timeout:
            raise Unreachable(f"the Danlu jobs service at {self.url} did not answer in time") from None
        if response.status_code >= 400:
            error = error_from(response.status_code, response.content)
            after = response.headers.get("Retry-After", "")
            if after.strip().isdigit():  # a 429 or 503 says when to come back
                error.retry_after = float(after)
            raise error
        return response

    # endpoints ------------------------------------------------------------------
    def submit(self, body: dict) -> dict:
        return self.request("POST", "/jobs", json=body, timeout=120).json()

    def jobs_page(
        self,
        state: str | None = None,
        owner: str | None = None,
        queue: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> dict:
        """One page of ``GET /jobs``: ``{"jobs": [...], "next_cursor": str | None}``, newest first."""
        params = {
            k: v
            for k, v in {"state": state, "owner": owner, "queue": queue, "limit": limit, "cursor": cursor}.items()
            if v
        }
        return self.request("GET", "/jobs", params=params).json()

    def jobs(self, state: str | None = None, owner: str | None = None, queue: str | None = None) -> list[dict]:
        """The first page of jobs (the service's default size)."""
        return self.jobs_page(state, owner, queue)["jobs"]

    def iter_jobs(
        self,
        state: str | None = None,
        owner: str | None = None,
        queue: str | None = None,
        *,
        limit: int | None = None,
        cursor: str | None = None,
        page_size: int = 1000,
        pages: list | None = None,
    ) -> Iterator[dict]:
        """Jobs newest first, following ``next_cursor`` page by page (one page in memory at a time), until
        ``limit`` jobs (None: all of them). ``pages``, if given, gets the cursor after each page read
        (None once the last page was read)."""
        left = limit
        while left is None or left > 0:
            size = page_size if left is None else min(page_size, left)
            data = self.jobs_page(state, owner, queue, limit=size, cursor=cursor)
            cursor = data.get("next_cursor")
            if pages is not None:
                pages.append(cursor)
            for job in data["jobs"][:size]:
                yield job
            left = None if left is None else left - len(data["jobs"][:size])
            if not cursor or not data["jobs"]:
                return

    def job(self, job_id: str) -> dict:
        return self.request("GET", f"/jobs/{job_id}").json()

    def cancel(self, job_id: str) -> dict:
        return self.request("POST", f"/jobs/{job_id}/cancel", timeout=120).json()

    def checkpoint(self, job_id: str) -> dict:
        """Ask a running job to save a checkpoint now: ``{"id", "save"}`` (the requests so far)."""
        return self.request("POST", f"/jobs/{job_id}/checkpoint").json()

    def logs(
        self, job_id: str, *, follow: bool = False, tail: int | None = None, offset: int | None = None
    ) -> Iterator[str]:
        params = {"follow": "true" if follow else "false"}
        if tail is not None:
            params["tail"] = str(tail)
        if offset is not None:
            params["offset"] = str(offset)
        # a followed log may be quiet for as long as the job computes: no read timeout then
        response = self.request(
            "GET",
            f"/jobs/{job_id}/logs",
            params=params,
            stream=True,
            timeout=(self.timeout, None) if follow else self.timeout,
        )
        response.encoding = "utf-8"
        try:
            yield from response.iter_content(chunk_size=None, decode_unicode=True)
        finally:
            response.close()

    def output(self, job_id: str, rank: int = 0) -> dict:
        return self.request("GET", f"/jobs/{job_id}/output", params={"rank": rank}).json()

    def profiles(self) -> dict:
        return self.request("GET", "/profiles").json()

    def queues(self) -> dict:
        return self.request("GET", "/queues").json()

    def change_queue(self, name: str, changes: dict) -> dict:
        return self.request("PATCH", f"/queues/{name}", json=changes).json()

    def reset_queue(self, name: str) -> dict:
        return self.request("DELETE", f"/queues/{name}").json()

    def hold(self, name: str, held: bool = True) -> dict:
        return self.request("POST", f"/queues/{name}/{'hold' if held else 'release'}").json()

    def drain(self, on: bool) -> dict:
        return self.request("POST", "/drain", json={"on": on}).json()

    def reprioritize(self, job_id: str, priority: str) -> dict:
        return self.request("PATCH", f"/jobs/{job_id}", json={"priority": priority}).json()

    def audit(self, limit: int = 50, action: str | None = None, target: str | None = None) -> list[dict]:
        params = {k: v for k, v in {"limit": limit, "action": action, "target": target}.items() if v}
        return self.request("GET", "/audit", params=params).json()["records"]

    def audit_verify(self) -> dict:
        # the service reads the whole chain before it answers (in batches: its memory stays flat), which takes a
        # while for millions of records
        return self.request("GET", "/audit/verify", timeout=(self.timeout, 3600)).json()

    def usage(
        self, start: str | None = None, end: str | None = None, by: str = "user", user: str | None = None
    ) -> dict:
        params = {k: v for k, v in {"from": start, "to": end, "by": by, "user": user}.items() if v}
        return self.request("GET", "/usage", params=params).json()

    def register_dataset(self, body: dict) -> tuple[bool, dict]:
        """``(created, version)``: created is False when the dataset had this content already."""
        # the service hashes every file before it answers: a large dataset takes a while
        response = self.request("POST", "/datasets", json=body, timeout=(self.timeout, 3600))
        return response.status_code == 201, response.json()

    def datasets(self) -> list[dict]:
        return self.request("GET", "/datasets").json()["datasets"]

    def dataset(self, name: str) -> dict:
        return self.request("GET", f"/datasets/{quote(name, safe='')}").json()

    def dataset_version(self, name: str, version: int) -> dict:
        return self.request("GET", f"/datasets/{quote(name, safe='')}/versions/{version}").json()

    def start_sweep(self, body: dict) -> dict:
        """``POST /sweeps``: the sweep, checked and stored, with its first trials submitted."""
        return self.request("POST", "/sweeps", json=body, timeout=300).json()

    def sweeps(self, owner: str | None = None, state: str | None = None) -> list[dict]:
        params = {k: v for k, v in {"owner": owner, "state": state}.items() if v}
        return self.request("GET", "/sweeps", params=params).json()["sweeps"]

    def sweep(self, sweep_id: str) -> dict:
        return self.request("GET", f"/sweeps/{quote(sweep_id, safe='')}").json()

    def stop_sweep(self, sweep_id: str) -> dict:
        return self.request("POST", f"/sweeps/{quote(sweep_id, safe='')}/stop", timeout=120).json()

    def reproduce(self, job_id: str) -> dict:
        """Run a job again exactly, as a new job of the caller's; the new job."""
        return self.request("POST", f"/jobs/{job_id}/reproduce", timeout=120).json()

    def compare(self, job_id: str, other: str) -> dict:
        """What differs between two jobs (parameters, environment, source, datasets, metrics)."""
        return self.request("GET", f"/jobs/{job_id}/compare/{other}", timeout=60).json()

    def register_model(self, body: dict) -> dict:
        # the service reads the run from MLflow and may submit the evaluation job before it answers
        return self.request("POST", "/models", json=body, timeout=(self.timeout, 300)).json()

    def models(self) -> list[dict]:
        return self.request("GET", "/models").json()["models"]

    def model(self, name: str) -> dict:
        return self.request("GET", f"/models/{quote(name, safe='')}").json()

    def model_version(self, name: str, version: int) -> dict:
        return self.request("GET", f"/models/{quote(name, safe='')}/versions/{version}").json()

    def decide_model(self, name: str, version: int, decision: str, comment: str) -> dict:
        return self.request(
            "POST",
            f"/models/{quote(name, safe='')}/versions/{version}/decisions",
            json={"decision": decision, "comment": comment},
        ).json()

    def set_model_alias(self, name: str, alias: str, version: int) -> dict:
        return self.request(
            "PUT", f"/models/{quote(name, safe='')}/aliases/{quote(alias, safe='')}", json={"version": version}
        ).json()

    def delete_model_alias(self, name: str, alias: str) -> dict:
        return self.request("DELETE", f"/models/{quote(name, safe='')}/aliases/{quote(alias, safe='')}").json()

    def lineage(self, name: str, version: int) -> dict:
        """What made a model version: ``{"model", "nodes", "edges"}``."""
        return self.request("GET", f"/lineage/models/{quote(name, safe='')}/{version}").json()

    def model_files(self, name: str, version: int) -> dict:
        """The manifest of a version's stored copy: ``{"name", "version", "digest", "files"}``."""
        return self.request("GET", f"/models/{quote(name, safe='')}/versions/{version}/files").json()

    def model_file(self, name: str, version: int, path: str) -> requests.Response:
        """One file of a version's stored copy, streamed (``iter_content``)."""
        return self.request(
            "GET",
            f"/models/{quote(name, safe='')}/versions/{version}/files",
            params={"path": path},
            stream=True,
            timeout=(self.timeout, 600),
        )
