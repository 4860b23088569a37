"""The dataset catalog: named datasets, their numbered versions, and who may read them or add to them.

A dataset is registered from ``PATH`` (relative to the caller's home) or ``ROOT:PATH`` (under a dataset
root of danlu.yaml), confined to that root on its real path by :func:`~danlu.hub.service.paths.resolve_dataset`. A
version is the content digest of :func:`danlu.digests.scan` -- sha256 over the sorted manifest of
``[relative path, size, sha256]`` of every file -- with the manifest, file count, size, and the columns
and row count of its CSV (and, with pyarrow, Parquet) files. Registering content the dataset already
has a version of answers that version (200); new content is version n+1 (201). A version never
changes: the catalog does not copy the data (datasets can be far larger than the state folder is
sized for); instead a job that uses a version re-verifies its digest when it starts and fails, naming
the changed files, on a mismatch (:meth:`Catalog.resolve` for submission, ``danlu.digests.verify`` in
the runner). Hashing runs in a child process (:func:`.scan.hash_as`: as the user with Unix accounts),
killed past the scan's time bound, whose answer is read bounded and checked; there is no global lock:
registrations of one dataset wait for each other (a lock per dataset, with its own digest cache file),
and a user has one registration reading at a time (a second is a 429). A folder of more than
:data:`~.scan.MAX_FILES` files, or of more bytes than the bound (apparent sizes: a sparse file counts in
full), is refused before any is read; a file that is a symbolic link out of the dataset's folder is
refused the same way (:mod:`.scan`).

Groups: ``read_groups`` (empty: everyone) and ``register_groups`` are set by the first registration;
admins may do anything. Someone outside ``read_groups`` gets a 404 for the dataset, never a 403, as
for another user's job. New versions, and so what ``@latest`` names, come from the dataset's owner (who
registered it first) and members of ``register_groups`` only (empty: the owner alone); another reader gets
a 403 that says whom to ask.

Uses: every catalog version a job names at submission, and every one its code asks for through the
runner API (``danlu.dataset``), is a ``dataset_uses`` row (:func:`record_uses`, one per job, version and
context), so a version lists the jobs that used it (``used_by``, :meth:`Catalog.version`) and a job the
versions it used (``inputs``, :func:`uses_of_job`).
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy import func, select
from sqlalchemy.orm import defer

from danlu.digests import TRAINING
from danlu.errors import Conflict, DanluError, Forbidden, NotFound, ValidationError
from danlu.hub.service import paths, validation
from danlu.hub.service.datasets import scan
from danlu.hub.service.formats import DATASET_REF
from danlu.hub.service.store import audit
from danlu.hub.service.store.database import Database
from danlu.hub.service.store.orm import Dataset, DatasetUse, DatasetVersion, Job, isoformat, utcnow

FIND_FIX = "see the datasets you may read with 'danlu datasets list' or GET /datasets"
#: the most jobs a version's ``used_by`` lists (the newest uses first)
MAX_USED_BY = 100


# API models -----------------------------------------------------------------------------------------------
def version_to_dict(v: DatasetVersion, *, manifest: bool = False) -> dict:
    body = {
        "dataset": v.dataset,
        "version": v.version,
        "ref": f"{v.dataset}@{v.version}",
        "digest": v.digest,
        "files": v.files,
        "bytes": v.bytes,
        "source": v.source,
        "path": v.path,
        "tables": list(v.tables or []),
        "created_by": v.created_by,
        "created_at": isoformat(v.created_at),
    }
    if manifest:
        body["manifest"] = list(v.manifest or [])
    return body


def dataset_to_dict(ds: Dataset, versions: list[DatasetVersion], *, every: bool = False) -> dict:
    body = {
        "name": ds.name,
        "description": ds.description,
        "read_groups": list(ds.read_groups or []),
        "register_groups": list(ds.register_groups or []),
        "created_by": ds.created_by,
        "created_at": isoformat(ds.created_at),
        "latest": version_to_dict(versions[-1]) if versions else None,
    }
    if every:
        body["versions"] = [version_to_dict(v) for v in versions]
    return body


def _versions(s, names) -> list[DatasetVersion]:
    q = (
        select(DatasetVersion)
        .options(defer(DatasetVersion.manifest))
        .where(DatasetVersion.dataset.in_(names))
        .order_by(DatasetVersion.dataset, DatasetVersion.version)
    )
    return list(s.scalars(q))


def member(principal, groups: set[str], allowed) -> bool:
    """Whether the caller is in one of ``allowed`` (empty: everyone); admins are in every group."""
    return principal.admin or not allowed or bool(groups & set(allowed))


def may_register(principal, groups: set[str], ds: Dataset) -> bool:
    """Whether the caller may add a version: the owner, a member of ``register_groups``, or an admin."""
    return principal.admin or principal.name == ds.created_by or bool(groups & set(ds.register_groups or []))


def check_registrant(principal, groups: set[str], ds: Dataset) -> None:
    """Refuse someone who may not add a version to ``ds``: 409 if they may not see it, else 403."""
    if not member(principal, groups, ds.read_groups):
        raise Conflict(
            f"a dataset named {ds.name} already exists", reason="name_taken", field="name", fix="choose another name"
        )
    if not may_register(principal, groups, ds):
        who = ", ".join([ds.created_by, *(f"members of {g}" for g in ds.register_groups or [])])
        raise Forbidden(
            f"only {who} may add versions to {ds.name}",
            reason="not_a_registrant",
            field="name",
            fix=f"ask {who} or an admin to register it, or register the data under a new name",
        )


def check_groups(body: dict, ds: Dataset) -> None:
    """Refuse groups that differ from the dataset's: only its first registration sets them."""
    for key in ("read_groups", "register_groups"):
        if key in body and sorted(set(body[key])) != sorted(set(getattr(ds, key) or [])):
            raise ValidationError(
                f"{key}: the groups of {ds.name} were set when it was created",
                field=key,
                reason="groups_fixed",
                fix=f"leave {key} out when adding a version",
            )


class Catalog:
    def __init__(self, database: Database, *, settings, groups, log: logging.Logger):
        self.database = database
        self.settings = settings
        self.groups = groups
        self.log = log
        self.scan_timeout = scan.SCAN_TIMEOUT
        self.max_bytes = scan.MAX_BYTES
        # one registration of a dataset at a time (its digest cache has one writer): name -> [lock, users]
        self._datasets: dict[str, list] = {}
        self._scanning: set[str] = set()  # users with a registration reading now

    def bound(self, *, timeout: float, max_bytes: int) -> None:
        """A registration's time bound (seconds) and the most bytes a version may hold."""
        self.scan_timeout, self.max_bytes = timeout, max_bytes

    # who may do what ----------------------------------------------------------------------------
    async def _groups(self, principal) -> set[str]:
        if not principal.is_user:
            return set(principal.groups)
        return set(await self.groups.groups_of(principal.name, fallback=principal.groups))

    async def _readable(self, principal, name: str) -> Dataset:
        """A dataset the caller may read; 404 otherwise, never 403."""
        ds = await self.database.read(lambda s: s.get(Dataset, name))
        if ds is None or not member(principal, await self._groups(principal), ds.read_groups):
            raise NotFound(f"dataset {name} not found", reason="no_such_dataset", field="name", fix=FIND_FIX)
        return ds

    # registering --------------------------------------------------------------------------------
    async def register(self, principal, body) -> tuple[int, dict]:
        """Add a version (201), or answer the version that has this content already (200)."""
        settings = self.settings
        validation.check_schema("DatasetRegistration", body)
        if not principal.is_user:
            raise Forbidden(
                "only users register datasets; this token belongs to a service",
                reason="not_a_user",
                fix="register with a user's token (JUPYTERHUB_API_TOKEN in their server)",
            )
        name = body["name"]
        source = paths.check_dataset(body["path"], "path", settings.dataset_roots)
        groups = await self._groups(principal)
        ds = await self.database.read(lambda s: s.get(Dataset, name))
        if ds is not None:
            check_registrant(principal, groups, ds)
            check_groups(body, ds)
        home = settings.user_home(principal.name)
        account = settings.account(principal.name)
        if principal.name in self._scanning:
            busy = DanluError(
                "you have a dataset registration reading its data already",
                status=429,
                reason="registration_in_progress",
                field="path",
                fix="wait for it to finish, then register this one",
            )
            busy.retry_after = 10
            raise busy
        self._scanning.add(principal.name)
        held = self._datasets.setdefault(name, [asyncio.Lock(), 0])
        held[1] += 1
        try:
            async with held[0]:
                # with one account for everything the child reads as the service, with the dataset's digest cache;
                # as the user otherwise: the service never reads for them what they could not read themselves
                cache = settings.state_dir / "dataset-digests" / f"{name}.json" if account is None else None
                real, found, manifest, tables = await scan.hash_as(
                    account,
                    body["path"],
                    home,
                    settings.dataset_roots,
                    cache=cache,
                    timeout=self.scan_timeout,
                    max_bytes=self.max_bytes,
                )
        finally:
            self._scanning.discard(principal.name)
            held[1] -= 1
            if not held[1]:
                del self._datasets[name]
        status, row = await self.database.write(
            _record, principal, groups, body, source, str(real), found, manifest, tables
        )
        self.log.info(
            "dataset %s@%s %s by %s (%s files, %s bytes)",
            name,
            row["version"],
            "registered" if status == 201 else "unchanged",
            principal.name,
            found.files,
            found.bytes,
        )
        return status, row

    # reading ------------------------------------------------------------------------------------
    async def list(self, principal) -> list[dict]:
        groups = await self._groups(principal)

        def query(s):
            rows = [
                ds
                for ds in s.scalars(select(Dataset).order_by(Dataset.name))
                if member(principal, groups, ds.read_groups)
            ]
            latest = {}
            if rows:
                top = dict(
                    s.execute(
                        select(DatasetVersion.dataset, func.max(DatasetVersion.version)).group_by(
                            DatasetVersion.dataset
                        )
                    ).all()
                )
                q = (
                    select(DatasetVersion)
                    .options(defer(DatasetVersion.manifest))
                    .where(DatasetVersion.dataset.in_([ds.name for ds in rows]))
                )
                latest = {v.dataset: v for v in s.scalars(q) if top.get(v.dataset) == v.version}
            return [dataset_to_dict(ds, [latest[ds.name]] if ds.name in latest else []) for ds in rows]

        return await self.database.read(query)

    async def show(self, principal, name: str) -> dict:
        ds = await self._readable(principal, name)
        versions = await self.database.read(_versions, [name])
        return dataset_to_dict(ds, versions, every=True)

    async def version(self, principal, name: str, version: int) -> dict:
        """One version with its manifest, and ``used_by``: the jobs that used it that the caller may see."""
        await self._readable(principal, name)
        row = await self.database.read(
            lambda s: s.scalars(
                select(DatasetVersion).where(DatasetVersion.dataset == name, DatasetVersion.version == version)
            ).first()
        )
        if row is None:
            raise NotFound(
                f"dataset {name} has no version {version}",
                reason="no_such_version",
                field="version",
                fix=f"see its versions with 'danlu datasets show {name}'",
            )
        return {
            **version_to_dict(row, manifest=True),
            "used_by": await self.database.read(users_of_version, principal, name, version),
        }

    async def readable_latest(self, principal, name: str, field: str) -> dict | None:
        """:meth:`resolve` of ``NAME@latest`` if the caller may read a dataset ``name``, else None."""
        try:
            return await self.resolve(principal, f"{name}@latest", field)
        except NotFound as e:
            if e.reason == "no_such_dataset":
                return None
            raise

    async def resolve(self, principal, ref: str, field: str) -> dict:
        """A job's dataset entry for ``NAME@VERSION`` (or ``NAME@latest``): the version's real path and digest."""
        name, version = DATASET_REF.match(ref).groups()
        groups = await self._groups(principal)

        def query(s):
            ds = s.get(Dataset, name)
            if ds is None or not member(principal, groups, ds.read_groups):
                return None, None
            q = select(DatasetVersion).options(defer(DatasetVersion.manifest)).where(DatasetVersion.dataset == name)
            q = (
                q.order_by(DatasetVersion.version.desc())
                if version == "latest"
                else q.where(DatasetVersion.version == int(version))
            )
            return ds, s.scalars(q.limit(1)).first()

        ds, row = await self.database.read(query)
        if ds is None:
            raise NotFound(f"{field}: dataset {name} not found", reason="no_such_dataset", field=field, fix=FIND_FIX)
        if row is None:
            raise NotFound(
                f"{field}: dataset {name} has no version {version}",
                reason="no_such_version",
                field=field,
                fix=f"see its versions with 'danlu datasets show {name}'",
            )
        return {
            "name": f"{name}@{row.version}",
            "path": row.path,
            "dataset": name,
            "version": row.version,
            "digest": row.digest,
        }


# uses ---------------------------------------------------------------------------------------------------
def use_to_dict(use: DatasetUse) -> dict:
    return {
        "ref": f"{use.dataset}@{use.version}",
        "dataset": use.dataset,
        "version": use.version,
        "digest": use.digest,
        "context": use.context,
    }


def record_uses(s, job_id: str, attempt: int | None, entries: list[dict]) -> None:
    """Record the catalog versions among a job's ``entries`` (those naming a dataset and a version), once per
    version and context."""
    for entry in entries:
        if not entry.get("dataset") or not entry.get("version"):
            continue  # a path (a reproduction pins its digest too), not a catalog version
        context = entry.get("context") or TRAINING
        known = s.scalars(
            select(DatasetUse.id).where(
                DatasetUse.job_id == job_id,
                DatasetUse.dataset == entry["dataset"],
                DatasetUse.version == entry["version"],
                DatasetUse.context == context,
            )
        ).first()
        if known is None:
            s.add(
                DatasetUse(
                    job_id=job_id,
                    attempt=attempt,
                    dataset=entry["dataset"],
                    version=entry["version"],
                    digest=entry["digest"],
                    context=context,
                    created_at=utcnow(),
                )
            )
            s.flush()


def uses_of_job(s, job_id: str) -> list[dict]:
    """The catalog versions a job used (``{ref, dataset, version, digest, context}``), first use first."""
    return uses_of_jobs(s, [job_id]).get(job_id, [])


def uses_of_jobs(s, job_ids: list[str]) -> dict[str, list[dict]]:
    """:func:`uses_of_job` for many jobs in one query: job id -> its inputs (jobs without any left out)."""
    out: dict[str, list[dict]] = {}
    if job_ids:
        q = select(DatasetUse).where(DatasetUse.job_id.in_(list(job_ids))).order_by(DatasetUse.id)
        for use in s.scalars(q):
            out.setdefault(use.job_id, []).append(use_to_dict(use))
    return out


def users_of_version(s, principal, dataset: str, version: int) -> list[dict]:
    """The newest :data:`MAX_USED_BY` uses of a version by jobs the caller may see (their own; admins: all)."""
    here = (DatasetUse.dataset == dataset, DatasetUse.version == version)
    owners = s.scalars(select(Job.owner).join(DatasetUse, DatasetUse.job_id == Job.id).where(*here).distinct())
    visible = [o for o in owners if principal.can_read(o)]
    if not visible:
        return []
    q = (
        select(DatasetUse, Job)
        .join(Job, DatasetUse.job_id == Job.id)
        .where(*here, Job.owner.in_(visible))
        .order_by(DatasetUse.created_at.desc(), DatasetUse.id.desc())
        .limit(MAX_USED_BY)
    )
    return [
        {
            "job_id": job.id,
            "owner": job.owner,
            "state": job.state,
            "mlflow_run_id": _run_of(job),
            "context": use.context,
            "attempt": use.attempt,
            "at": isoformat(use.created_at),
        }
        for use, job in s.execute(q)
    ]


def _run_of(job: Job) -> str | None:
    tracking = job.tracking if isinstance(job.tracking, dict) else {}
    return tracking.get("run_id") or job.mlflow_run_id


def manifest_of(s, dataset: str, version: int) -> list:
    """The manifest of a version (for a job's spec: the runner names the files that changed)."""
    row = s.scalars(
        select(DatasetVersion).where(DatasetVersion.dataset == dataset, DatasetVersion.version == version)
    ).first()
    return list(row.manifest or []) if row is not None else []


def _record(
    s, principal, groups: set[str], body: dict, source: str, real: str, found, manifest: list, tables: list
) -> tuple[int, dict]:
    """In one transaction: the dataset (created by the first registration) and its version, if new."""
    name = body["name"]
    ds = s.get(Dataset, name)
    if ds is None:
        ds = Dataset(
            name=name,
            description=body.get("description", ""),
            read_groups=sorted(set(body.get("read_groups", []))),
            register_groups=sorted(set(body.get("register_groups", []))),
            created_by=principal.name,
            created_at=utcnow(),
        )
        s.add(ds)
        s.flush()
    else:  # it may have been created while this registration hashed
        check_registrant(principal, groups, ds)
        check_groups(body, ds)
        if "description" in body:
            ds.description = body["description"]
    same = s.scalars(
        select(DatasetVersion)
        .options(defer(DatasetVersion.manifest))
        .where(DatasetVersion.dataset == name, DatasetVersion.digest == found.digest)
    ).first()
    if same is not None:
        return 200, version_to_dict(same)
    last = s.scalar(select(func.max(DatasetVersion.version)).where(DatasetVersion.dataset == name)) or 0
    row = DatasetVersion(
        dataset=name,
        version=last + 1,
        digest=found.digest,
        manifest=manifest,
        files=found.files,
        bytes=found.bytes,
        source=source,
        path=real,
        tables=tables,
        created_by=principal.name,
        created_at=utcnow(),
    )
    s.add(row)
    s.flush()
    audit.append(
        s,
        principal.name,
        "register_dataset",
        f"{name}@{row.version}",
        after={"digest": found.digest, "files": found.files, "bytes": found.bytes, "source": source},
    )
    return 201, version_to_dict(row)
