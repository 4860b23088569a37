"""Pages of jobs: newest first, filtered, each page read where the previous one ended (keyset pagination).

Jobs are listed by ``(created_at, id)`` descending; a page's ``next_cursor`` is
the key of its last job, and the next page is the jobs strictly below that key.
So a page costs one range read of an index in that order
(``ix_jobs_*_listing``), however deep it is, and jobs accepted while a client
walks the pages sort above every cursor it holds: no job is listed twice or
skipped. A cursor is opaque to clients (URL-safe base64 of the key, versioned);
one that does not decode to a key is a 400 that names ``cursor``. Several
states are read as one index range per state, merged here, because a database
planner may otherwise read one state's rows whole and sort them. What the API
shows of a page's jobs is read and encoded by :mod:`~danlu.hub.service.jobs.views`; :func:`encode_page`
puts their encoded views together.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import heapq
import json

from sqlalchemy import Integer, Select, bindparam, select, tuple_
from sqlalchemy.orm import Session, defer

from danlu.errors import UsageError
from danlu.hub.service.formats import JOB_ID
from danlu.hub.service.store.orm import Job

VERSION = "1"
MAX_CURSOR = 200
_FIX = "pass the next_cursor of the previous page as it was given, or leave cursor out for the first page"

Key = tuple[dt.datetime, str]


def encode_cursor(key: Key) -> str:
    created_at, job_id = key
    raw = json.dumps([VERSION, created_at.isoformat(timespec="microseconds"), job_id], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def encode_page(views: list[str], cursor: str | None) -> str:
    """The body of ``GET /jobs`` from its jobs' encoded views: what ``json.dumps({"jobs": [...], "next_cursor":
    cursor})`` gives, byte for byte, without decoding and encoding the views again."""
    return '{"jobs": [' + ", ".join(views) + '], "next_cursor": ' + json.dumps(cursor) + "}"


def decode_cursor(cursor: str) -> Key:
    """The key a cursor stands for; UsageError (400, field ``cursor``) for anything this service did not make."""

    def bad(why: str) -> UsageError:
        return UsageError(
            f"cursor {cursor[:40]!r} is not a cursor of GET /jobs ({why})",
            field="cursor",
            reason="bad_cursor",
            fix=_FIX,
        )

    if len(cursor) > MAX_CURSOR:
        raise bad(f"longer than {MAX_CURSOR} characters")
    try:
        data = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode())
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise bad("not base64 of JSON") from None
    if not (isinstance(data, list) and len(data) == 3 and all(isinstance(part, str) for part in data)):
        raise bad("not a key")
    version, created_at, job_id = data
    if version != VERSION:
        raise bad(f"version {version[:8]!r}, this service reads {VERSION}")
    if not JOB_ID.match(job_id):
        raise bad("no job id in it")
    try:
        when = dt.datetime.fromisoformat(created_at)
    except ValueError:
        raise bad("no time in it") from None
    if when.tzinfo is not None:
        raise bad("a time with a zone")
    return when, job_id


def rows(
    session: Session,
    columns: tuple = (),
    *,
    owner: str | None,
    states: list[str],
    queue: str | None,
    limit: int,
    after: Key | None,
) -> tuple[list[tuple[Key, tuple]], Key | None]:
    """Up to ``limit`` jobs below ``after`` (None: from the newest), each as its key and its ``columns`` (a
    tuple kept by the caller, such as :data:`~.rows.STORED_COLUMNS`), and the key the next
    page starts below (None: this was the last page)."""
    conn = session.connection()  # Core rows: none of the ORM's per-row work
    q = _range(columns, owner is not None, bool(states), bool(queue), after is not None)
    params = {"limit": limit + 1, "owner": owner, "queue": queue}
    if after is not None:
        params["after_at"], params["after_id"] = after

    def range_of(state: str | None) -> list[tuple[Key, tuple]]:
        found = conn.execute(q, {**params, "state": state}).all()
        return [((row[0], row[1]), tuple(row[2:])) for row in found]

    if len(states) > 1:  # one index range per state, merged newest first
        ranges = (range_of(s) for s in sorted(set(states)))
        found = list(heapq.merge(*ranges, key=lambda found: found[0], reverse=True))[: limit + 1]
    else:
        found = range_of(states[0] if states else None)
    more = len(found) > limit
    found = found[:limit]
    return found, (found[-1][0] if more and found else None)


#: the statement of a range, per tuple of columns and filters given: built once, SQLAlchemy finds its compiled
#: form by the statement itself (building one per request cost more than running it, under 200 users)
_ranges: dict[tuple, tuple[tuple, Select]] = {}


def _range(columns: tuple, owner: bool, state: bool, queue: bool, after: bool) -> Select:
    key = (id(columns), owner, state, queue, after)
    hit = _ranges.get(key)
    if hit is not None and hit[0] is columns:
        return hit[1]
    q = (
        select(Job.created_at, Job.id, *columns)
        .order_by(Job.created_at.desc(), Job.id.desc())
        .limit(bindparam("limit", type_=Integer()))
    )
    if owner:
        q = q.where(Job.owner == bindparam("owner", type_=Job.owner.type))
    if state:
        q = q.where(Job.state == bindparam("state", type_=Job.state.type))
    if queue:
        q = q.where(Job.queue == bindparam("queue", type_=Job.queue.type))
    if after:
        q = q.where(
            tuple_(Job.created_at, Job.id)
            < tuple_(bindparam("after_at", type_=Job.created_at.type), bindparam("after_id", type_=Job.id.type))
        )
    _ranges[key] = (columns, q)  # the columns kept, so their id stays theirs
    return q


def keys(
    session: Session, *, owner: str | None, states: list[str], queue: str | None, limit: int, after: Key | None
) -> tuple[list[Key], Key | None]:
    """:func:`rows` with no columns: the keys of a page, and the key the next page starts below."""
    found, last = rows(session, (), owner=owner, states=states, queue=queue, limit=limit, after=after)
    return [key for key, _ in found], last


def page(
    session: Session, *, owner: str | None, states: list[str], queue: str | None, limit: int, after: Key | None
) -> tuple[list[Job], Key | None]:
    """:func:`keys`' jobs as ``Job`` objects, and the key the next page starts below."""
    found, last = keys(session, owner=owner, states=states, queue=queue, limit=limit, after=after)
    if not found:
        return [], None
    # a job's provenance (cell sources, installed distributions, manifests) can be tens of KiB that no listing
    # shows: left in the database, and an error to touch, for pages of up to 1000 jobs
    q = select(Job).options(defer(Job.provenance, raiseload=True), defer(Job.groups, raiseload=True))
    rows = {job.id: job for job in session.scalars(q.where(Job.id.in_([k[1] for k in found])))}
    return [rows[k[1]] for k in found if k[1] in rows], last
