"""What a job's view reads of its rows, for many jobs at once, as plain values.

A listing reads what the views of its jobs show with one select per table: :data:`STORED_COLUMNS` read with
the page (the JSON ones as the text the database holds, decoded only when a view is built), then
:func:`stored` reads their attempts and their dataset uses, never the ORM's objects. A :class:`Stored` is
those values; equal values mean an equal view, which is what lets :class:`~danlu.hub.service.jobs.views.ViewCache`
keep the encoded views of ended jobs. :func:`cell_sha256` is the digest of a job's cell that its row keeps.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from sqlalchemy import Text, bindparam, cast, select

from danlu.hub.service.store.orm import Attempt, DatasetUse, Job

#: what a job's view shows of its row (:func:`job_to_dict`), and the JSON columns among it, read as text
VIEW_COLUMNS = (
    "id",
    "name",
    "owner",
    "state",
    "reason",
    "failure",
    "profile",
    "queue",
    "priority_class",
    "priority",
    "nproc",
    "nnodes",
    "gpus",
    "gpu_type",
    "cpu",
    "memory",
    "retries",
    "timeout_seconds",
    "experiment",
    "created_at",
    "started_at",
    "finished_at",
    "not_before",
    "mlflow_run_id",
    "reproduces",
)
JSON_COLUMNS = ("parameters", "datasets", "source", "tracking", "backend_state", "checkpoint")
ATTEMPT_COLUMNS = (
    "number",
    "state",
    "reason",
    "failure",
    "devices",
    "flavor",
    "exit_code",
    "started_at",
    "finished_at",
)
USE_COLUMNS = ("dataset", "version", "digest", "context")


def cell_sha256(nb: dict) -> tuple[str, str]:
    """(cell id, sha256 of its source) of the job's cell: tagged ``danlu-cell``, else the last code cell."""
    code = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    tagged = [c for c in code if "danlu-cell" in c.get("metadata", {}).get("tags", [])]
    cell = (tagged or code)[-1]
    source = cell.get("source", "")
    source = "".join(source) if isinstance(source, list) else source
    return cell.get("id", ""), hashlib.sha256(source.encode()).hexdigest()


class Stored(NamedTuple):
    """What the database holds of one job's view: its :data:`VIEW_COLUMNS` then its :data:`JSON_COLUMNS` (as
    stored text), its attempts' :data:`ATTEMPT_COLUMNS` (devices as text) by number, and its dataset uses'
    :data:`USE_COLUMNS` in the order they were recorded. Equal values, equal view."""

    job: tuple
    attempts: tuple
    uses: tuple

    @property
    def id(self) -> str:
        return self.job[0]

    @property
    def state(self) -> str:
        return self.job[3]


#: what to select of a job for :func:`stored`: its :data:`VIEW_COLUMNS`, then its :data:`JSON_COLUMNS` as the text
#: the database holds (decoded only when a view is built; never provenance or groups, tens of KiB no view shows)
STORED_COLUMNS = (*(getattr(Job, c) for c in VIEW_COLUMNS), *(cast(getattr(Job, c), Text) for c in JSON_COLUMNS))
# built once: SQLAlchemy then finds their compiled forms by the statements themselves
_ATTEMPTS = (
    select(
        Attempt.job_id,
        *(cast(Attempt.devices, Text) if c == "devices" else getattr(Attempt, c) for c in ATTEMPT_COLUMNS),
    )
    .where(Attempt.job_id.in_(bindparam("ids", expanding=True)))
    .order_by(Attempt.job_id, Attempt.number)
)
_USES = (
    select(DatasetUse.job_id, *(getattr(DatasetUse, c) for c in USE_COLUMNS))
    .where(DatasetUse.job_id.in_(bindparam("ids", expanding=True)))
    .order_by(DatasetUse.id)
)


def stored(s, rows: list[tuple]) -> list[Stored]:
    """:class:`Stored` of jobs read as :data:`STORED_COLUMNS`, in order: their attempts in one select, their
    dataset uses in another."""
    if not rows:
        return []
    conn = s.connection()  # Core rows: none of the ORM's per-row work
    ids = {"ids": [row[0] for row in rows]}
    attempts: dict[str, list[tuple]] = {}
    for row in conn.execute(_ATTEMPTS, ids).all():
        attempts.setdefault(row[0], []).append(tuple(row[1:]))
    uses: dict[str, list[tuple]] = {}
    for row in conn.execute(_USES, ids).all():
        uses.setdefault(row[0], []).append(tuple(row[1:]))
    return [Stored(tuple(row), tuple(attempts.get(row[0], ())), tuple(uses.get(row[0], ()))) for row in rows]
