"""Re-running a job exactly, and saying how two jobs differ.

:meth:`Reproduction.reproduce` resubmits a job's recorded notebook -- the same source, setup cells and
parameters, on the same profile, with the same dataset versions -- as a new job of its owner's (nobody
else may reproduce it, admins included: that would run the owner's code as someone else), through
the ordinary :meth:`.submission.Submission.submit` (every check a submission gets). A catalog version is
asked for by its number (``NAME@VERSION``, never ``latest``); a plain path is pinned to the digest its job
reported, so the runner fails the new job, naming the files, if the data changed. When an input can no
longer be had -- the job has no notebook on record, its profile is gone or closed to the caller, a
catalog version is gone or hidden, a plain path vanished -- it refuses with a 409 that says which and what
to do. :func:`compare` lists only what differs between two jobs' provenance, notebooks and final MLflow
metrics, and sums it up in ``identical``.
"""

from __future__ import annotations

import difflib
import json

from danlu.errors import Conflict, DanluError, Forbidden, NotFound, PolicyError
from danlu.hub.service.datasets.catalog import Catalog
from danlu.hub.service.jobs.provenance import cells_of, finite, provenance_of
from danlu.hub.service.jobs.submission import Submission
from danlu.hub.service.mlflow_client import EVALUATIONS
from danlu.hub.service.store.database import Database
from danlu.hub.service.store.orm import Job, JobInput

#: the lines of a unified diff a comparison shows per cell
DIFF_LINES = 40
DIFF_WIDTH = 200
#: body fields of a submission a job's source may carry back
SOURCE_KEYS = ("notebook_path", "cell_id", "git_commit", "git_dirty", "included_cells")


def _gone(message: str, reason: str, fix: str, field: str | None = None) -> Conflict:
    return Conflict(message, reason=reason, fix=fix, field=field)


class Reproduction:
    def __init__(self, submission: Submission, datasets: Catalog, *, database: Database, profiles, groups, mlflow):
        self.submission = submission
        self.datasets = datasets
        self.database = database
        self.profiles = profiles
        self.groups = groups
        self.mlflow = mlflow

    async def reproduce(self, principal, job: Job) -> tuple[int, dict]:
        """Submit ``job`` again as the caller's (they may see it: the manager checked); ``(201, {"id"})``.

        Only its owner may: anyone else -- an admin who may see every job included -- would run the owner's
        code under their own identity and rights (an admin's files, queues and data), so that is refused.
        """
        if principal.name != job.owner:
            raise Forbidden(
                f"job {job.id} is {job.owner}'s: only its owner may run it again",
                reason="not_the_owner",
                fix=f"ask {job.owner} to reproduce it ('danlu reproduce {job.id}'), or submit the notebook "
                "yourself after reading it",
            )
        row = await self.database.read(lambda s: s.get(JobInput, job.id))
        if row is None:
            raise _gone(
                f"job {job.id} has no notebook on record, so it cannot be run again",
                "no_source",
                "submit the notebook again yourself",
            )
        record = provenance_of(job)
        await self._check_profile(principal, job)
        body, pins = await self._body(principal, job, json.loads(row.notebook), record)
        try:
            return await self.submission.submit(principal, body, reproduces=job.id, pins=pins)
        except DanluError as e:
            field = e.field or ""
            if e.status < 500 and field.startswith("datasets["):  # a plain path that is gone or moved
                raise _gone(
                    f"job {job.id}'s input can no longer be had: {e.message}",
                    "dataset_gone",
                    "restore the data where the job read it, or submit the notebook with other data",
                    field=field,
                ) from None
            raise

    async def _check_profile(self, principal, job: Job) -> None:
        try:
            profile = self.profiles.get(job.profile)
        except NotFound:
            raise _gone(
                f"job {job.id} ran on profile '{job.profile}', which this workbench no longer has",
                "profile_gone",
                f"choose one of {', '.join(self.profiles.slugs)} and submit the notebook "
                "yourself, or ask an admin to restore the profile",
                field="profile",
            ) from None
        groups = await self.groups.groups_of(principal.name, fallback=principal.groups)
        try:
            self.profiles.authorize(profile.slug, groups, admin=principal.admin, gpus=job.gpus)
        except PolicyError as e:
            raise _gone(
                f"job {job.id} ran on profile '{job.profile}', which you may not use: {e.message}",
                "profile_not_allowed",
                e.fix or "ask an admin for access to the profile",
                field="profile",
            ) from None

    async def _body(self, principal, job: Job, nb: dict, record: dict) -> tuple[dict, dict]:
        datasets, pins = [], {}
        recorded = record.get("datasets") or []
        for i, d in enumerate(job.datasets or []):
            if d.get("dataset"):  # a catalog version: by its number, and it must still be there, unchanged
                ref = f"{d['dataset']}@{d['version']}"
                try:
                    found = await self.datasets.resolve(principal, ref, f"datasets[{i}]")
                except NotFound:
                    raise _gone(
                        f"job {job.id} read dataset version {ref}, which is gone or which you may not read",
                        "dataset_version_gone",
                        f"see the versions you may read with 'danlu datasets show "
                        f"{d['dataset']}', and submit the notebook with one of them",
                        field=f"datasets[{i}]",
                    ) from None
                if found.get("digest") != d.get("digest"):
                    raise _gone(
                        f"dataset version {ref} no longer has the content job {job.id} read",
                        "dataset_version_changed",
                        "submit the notebook with the version you want",
                        field=f"datasets[{i}]",
                    )
                datasets.append(ref)
                continue
            datasets.append(d["name"])
            entry = recorded[i] if i < len(recorded) and isinstance(recorded[i], dict) else {}
            if entry.get("ref") == d["name"] and entry.get("digest"):
                pins[i] = {
                    "digest": entry["digest"],
                    "manifest": list(entry.get("manifest") or []),
                    "pinned_from": job.id,
                }
        resources = {"nproc": job.nproc, "gpus": job.gpus, "nodes": job.nnodes or 1}
        if job.gpu_type:
            resources["gpu_type"] = job.gpu_type
        if job.cpu:
            resources["cpu"] = job.cpu
        if job.memory:
            resources["memory"] = int(job.memory)
        source = job.source if isinstance(job.source, dict) else {}
        body = {
            "notebook": nb,
            "parameters": dict(job.parameters or {}),
            "resources": resources,
            "profile": job.profile,
            "name": job.name,
            "retries": job.retries,
            "cwd": job.cwd or ".",
            "source": {k: source[k] for k in SOURCE_KEYS if source.get(k) is not None},
        }
        if datasets:
            body["datasets"] = datasets
        if job.timeout_seconds:
            body["timeout_seconds"] = job.timeout_seconds
        if job.priority_class:
            body["priority"] = job.priority_class
        body["queue"] = job.queue  # the caller is the owner (reproduce refuses anyone else)
        if job.experiment and not job.experiment.startswith(EVALUATIONS):
            body["experiment"] = job.experiment
        return body, pins

    # comparing ---------------------------------------------------------------------------------------------
    async def compare(self, a: Job, b: Job) -> dict:
        notebooks = await self.database.read(lambda s: [s.get(JobInput, a.id), s.get(JobInput, b.id)])
        nbs = [json.loads(n.notebook) if n is not None else None for n in notebooks]
        metrics = [await self._metrics(job) for job in (a, b)]
        return compare(a, b, nbs[0], nbs[1], metrics[0], metrics[1])

    async def _metrics(self, job: Job) -> dict | None:
        tracking = job.tracking if isinstance(job.tracking, dict) else {}
        run_id = tracking.get("run_id") or job.mlflow_run_id
        if not run_id or self.mlflow is None:
            return None
        return await self.mlflow.final_metrics(run_id)


def _rows(a: dict, b: dict, keys=None) -> list[dict]:
    keys = keys if keys is not None else sorted(set(a) | set(b))
    return [{"name": k, "a": a.get(k), "b": b.get(k)} for k in keys if a.get(k) != b.get(k)]


def _environment(record: dict) -> dict:
    env = record.get("environment") if isinstance(record.get("environment"), dict) else {}
    return {
        "profile": record.get("profile"),
        "kind": env.get("kind"),
        "digest": env.get("digest"),
        "ref": env.get("ref"),
        "python": env.get("python"),
    }


def _diff(a: str, b: str) -> str:
    lines = list(difflib.unified_diff(a.splitlines(), b.splitlines(), "a", "b", lineterm="", n=1))
    shown = [line[:DIFF_WIDTH] for line in lines[:DIFF_LINES]]
    if len(lines) > DIFF_LINES:
        shown.append(f"... {len(lines) - DIFF_LINES} more lines")
    return "\n".join(shown)


def _cells(nb: dict | None, record: dict) -> tuple[dict | None, list[dict]]:
    if nb is not None:
        try:
            return cells_of(nb)
        except (IndexError, AttributeError, TypeError):
            pass
    return record.get("cell"), list(record.get("setup_cells") or [])


def _source(record_a: dict, record_b: dict, nb_a, nb_b) -> list[dict]:
    cell_a, setup_a = _cells(nb_a, record_a)
    cell_b, setup_b = _cells(nb_b, record_b)
    pairs = [("cell", cell_a, cell_b)]
    pairs += [
        (f"setup cell {i + 1}", setup_a[i] if i < len(setup_a) else None, setup_b[i] if i < len(setup_b) else None)
        for i in range(max(len(setup_a), len(setup_b)))
    ]
    out = []
    for what, x, y in pairs:
        sha_x, sha_y = (x or {}).get("sha256"), (y or {}).get("sha256")
        if what == "cell" and not (x and y):
            sha_x, sha_y = record_a.get("cell_sha256") or sha_x, record_b.get("cell_sha256") or sha_y
        if sha_x != sha_y:
            out.append(
                {
                    "what": what,
                    "a": sha_x,
                    "b": sha_y,
                    "diff": _diff((x or {}).get("source") or "", (y or {}).get("source") or ""),
                }
            )
    git_a = record_a.get("git") if isinstance(record_a.get("git"), dict) else {}
    git_b = record_b.get("git") if isinstance(record_b.get("git"), dict) else {}
    for key in ("commit", "dirty"):
        if git_a.get(key) != git_b.get(key):
            out.append({"what": f"git {key}", "a": git_a.get(key), "b": git_b.get(key), "diff": ""})
    return out


def _datasets(record: dict) -> dict:
    out = {}
    for d in record.get("datasets") or []:
        key = d.get("dataset") or d.get("ref")
        while key in out:  # the same path twice
            key = f"{key} (again)"
        out[key] = {"ref": d.get("ref"), "digest": d.get("digest")}
    return out


def _metric_rows(a: dict, b: dict) -> list[dict]:
    rows = []
    for name in sorted(set(a) | set(b)):
        x, y = a.get(name), b.get(name)
        if x == y:
            continue
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y))
        rows.append({"name": name, "a": finite(x), "b": finite(y), "delta": finite(y - x) if numbers else None})
    return rows


def compare(
    a: Job, b: Job, nb_a: dict | None, nb_b: dict | None, metrics_a: dict | None, metrics_b: dict | None
) -> dict:
    """What differs between jobs ``a`` and ``b`` (only the differences), and whether each part is identical."""
    pa, pb = provenance_of(a), provenance_of(b)
    parameters = _rows(pa.get("parameters") or {}, pb.get("parameters") or {})
    if pa.get("seed") != pb.get("seed"):
        parameters.append({"name": "(seed)", "a": pa.get("seed"), "b": pb.get("seed")})
    environment = _rows(_environment(pa), _environment(pb), ["profile", "kind", "digest", "ref", "python"])
    source = _source(pa, pb, nb_a, nb_b)
    da, db = _datasets(pa), _datasets(pb)
    datasets = [
        {"name": k, "a": da.get(k), "b": db.get(k)} for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k)
    ]
    metrics = "unknown" if metrics_a is None or metrics_b is None else _metric_rows(metrics_a, metrics_b)
    return {
        "a": a.id,
        "b": b.id,
        "parameters": parameters,
        "environment": environment,
        "source": source,
        "datasets": datasets,
        "metrics": metrics,
        "identical": {
            "parameters": not parameters,
            "environment": not environment,
            "source": not source,
            "datasets": not datasets,
            "metrics": None if metrics == "unknown" else not metrics,
        },
    }
