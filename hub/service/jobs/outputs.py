"""Executed notebooks that runners hand over through the runner API (job pods keep no folder to read).

They live in the service's own folder, ``<state>/outputs/<job id>/rank-<n>.ipynb`` (0600, written
atomically, opened without following links), never in a place a job can write; the newest attempt's
copy replaces an earlier one. :func:`read` serves them as a backend serves a job's file: a bounded chunk
and the size, or None when there is none -- or a 410 once they were pruned.

The job's code holds its attempt's token too, so without a bound one user could fill the service's disk,
64 MiB an upload. :class:`OutputStore` keeps them bounded: each user's outputs together take at most
``per_user_bytes`` (a running total per user, in memory, rebuilt from the files at start: no scan per
upload). An upload that would go beyond prunes that user's ended jobs' outputs, oldest first, and never
another user's; if the outputs of their running jobs alone are too many, the upload is refused (413, which a
runner reports in the job's log and does not retry). Ended jobs' outputs older than ``max_age_days`` are
pruned periodically (:meth:`OutputStore.prune_forever`). A pruned job keeps a ``PRUNED`` note in its folder
(why and when, so a read answers 410 with words), ``outputs_pruned`` in its backend state (its view says so)
and an audit record (``prune_outputs``) written in the same transaction.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import tempfile
from collections import defaultdict
from pathlib import Path

from sqlalchemy import select

from danlu.errors import DanluError
from danlu.hub.backends.files import read_chunk
from danlu.hub.service.states import FINAL
from danlu.hub.service.store import audit
from danlu.hub.service.store.orm import Job, isoformat, utcnow

#: the note a pruned job's folder keeps
PRUNED = "PRUNED"
#: job ids per query (SQLite's bound on parameters is far above)
CHUNK = 500
#: the longest pause between two age prunings
PRUNE_EVERY = 3600.0

PER_USER_DEFAULT = 4 * 2**30
MAX_AGE_DEFAULT = 30.0


def _folder(state_dir: Path, job_id: str) -> Path:
    return Path(state_dir) / "outputs" / job_id


def _path(state_dir: Path, job_id: str, rank: int) -> Path:
    return _folder(state_dir, job_id) / f"rank-{int(rank)}.ipynb"


def keep(state_dir: Path, job_id: str, rank: int, data: bytes) -> None:
    path = _path(state_dir, job_id, rank)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    (path.parent / PRUNED).unlink(missing_ok=True)  # a new attempt's output: the job has one again
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".rank-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read(state_dir: Path, job_id: str, rank: int, offset: int, limit: int) -> tuple[bytes, int] | None:
    try:
        fd = os.open(_path(state_dir, job_id, rank), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        note = pruned(state_dir, job_id)
        if note is not None:
            raise DanluError(
                f"job {job_id}'s executed notebook was pruned on {note.get('at', '?')} ({note.get('why', '')})",
                status=410,
                reason="output_pruned",
                fix="the jobs service keeps ended jobs' outputs within its bounds (outputs_per_user_bytes, "
                "outputs_max_age_days); run the job again to have one",
            ) from None
        return None
    return read_chunk(fd, offset, limit)


def pruned(state_dir: Path, job_id: str) -> dict | None:
    """The note of a job whose outputs were pruned (``at``, ``why``), or None."""
    try:
        fd = os.open(_folder(state_dir, job_id) / PRUNED, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            note = json.loads(f.read(4096))
        except ValueError:
            note = {}
    return note if isinstance(note, dict) else {}


def size_text(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def _scan(state_dir: Path) -> dict[str, dict[int, int]]:
    """Every kept output's size, by job and rank (once, at start)."""
    found: dict[str, dict[int, int]] = {}
    root = Path(state_dir) / "outputs"
    if not root.is_dir():
        return found
    for folder in root.iterdir():
        if folder.is_symlink() or not folder.is_dir():
            continue
        for path in folder.glob("rank-*.ipynb"):
            rank = path.stem.rpartition("-")[2]
            try:
                st = path.lstat()
            except OSError:
                continue
            if rank.isdigit():
                found.setdefault(folder.name, {})[int(rank)] = st.st_size
    return found


def _remove(state_dir: Path, job_id: str, note: dict) -> None:
    """Remove a job's kept outputs (and what a crash left of a write), leaving the ``PRUNED`` note."""
    folder = _folder(state_dir, job_id)
    for path in list(folder.iterdir()) if folder.is_dir() and not folder.is_symlink() else []:
        if path.name != PRUNED and not path.is_dir():
            path.unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    (folder / PRUNED).write_text(json.dumps(note))


def _owners(s, ids: list[str]) -> dict[str, str]:
    found = {}
    for i in range(0, len(ids), CHUNK):
        found.update(s.execute(select(Job.id, Job.owner).where(Job.id.in_(ids[i : i + CHUNK]))).all())
    return found


def _ended(s, ids: list[str], before: dt.datetime | None = None) -> list[str]:
    """Those of ``ids`` that have ended (before ``before``, if given), the earliest ended first."""
    found = []
    for i in range(0, len(ids), CHUNK):
        query = select(Job.finished_at, Job.id).where(
            Job.id.in_(ids[i : i + CHUNK]), Job.state.in_([s_.value for s_ in FINAL])
        )
        if before is not None:
            query = query.where(Job.finished_at < before)
        found += s.execute(query).all()
    return [job_id for _at, job_id in sorted(found, key=lambda row: (row[0] or dt.datetime.min, row[1]))]


def _record(s, job_id: str, note: dict) -> None:
    job = s.get(Job, job_id)
    if job is not None:
        job.backend_state = {**(job.backend_state or {}), "outputs_pruned": note}
    audit.append(s, "danlu", "prune_outputs", job_id, before={"bytes": note["bytes"]}, after=note)


class OutputStore:
    """The kept outputs with their sizes: a running total per user, bounded (see the module's docs)."""

    def __init__(self, state_dir: Path, database, *, log: logging.Logger | None = None):
        self.state_dir = Path(state_dir)
        self.database = database
        self.log = log or logging.getLogger("danlu.jobs")
        self.per_user_bytes = PER_USER_DEFAULT
        self.max_age_days = MAX_AGE_DEFAULT
        self.sizes: dict[str, dict[int, int]] = {}  # job -> rank -> bytes
        self.owner_of: dict[str, str] = {}
        self.totals: dict[str, int] = defaultdict(int)
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._built: asyncio.Task | None = None

    def bound(self, *, per_user_bytes: int, max_age_days: float) -> None:
        self.per_user_bytes, self.max_age_days = int(per_user_bytes), float(max_age_days)

    async def rebuild(self) -> None:
        """The totals from the files (at start; every later change is counted as it is made)."""
        if self._built is None or (self._built.done() and self._built.exception() is not None):
            self._built = asyncio.ensure_future(self._rebuild())
        if not self._built.done():
            await asyncio.shield(self._built)

    async def _rebuild(self) -> None:
        sizes = await asyncio.to_thread(_scan, self.state_dir)
        owners = await self.database.read(_owners, list(sizes))
        self.sizes = {job_id: ranks for job_id, ranks in sizes.items() if job_id in owners}
        self.owner_of = {job_id: owners[job_id] for job_id in self.sizes}
        self.totals = defaultdict(int)
        for job_id, ranks in self.sizes.items():
            self.totals[self.owner_of[job_id]] += sum(ranks.values())

    def used(self, owner: str) -> int:
        return self.totals.get(owner, 0)

    async def keep(self, job_id: str, owner: str, rank: int, data: bytes) -> None:
        """Keep rank ``rank``'s notebook of ``owner``'s job, within ``owner``'s bound (see the module's docs)."""
        await self.rebuild()
        async with self._locks[owner]:
            over = self.used(owner) - self.sizes.get(job_id, {}).get(rank, 0) + len(data) - self.per_user_bytes
            if over > 0:
                mine = [j for j, o in self.owner_of.items() if o == owner and j != job_id]
                ended = await self.database.read(_ended, mine)
                if sum(sum(self.sizes[j].values()) for j in ended) < over:
                    self._refuse(owner, job_id, len(data))
                for old in ended:
                    if over <= 0:
                        break
                    freed = await self._prune(old, f"over {owner}'s bound on stored outputs")
                    over -= freed
            await asyncio.to_thread(keep, self.state_dir, job_id, rank, data)
            old_size = self.sizes.setdefault(job_id, {}).get(rank, 0)
            self.sizes[job_id][rank] = len(data)
            self.owner_of[job_id] = owner
            self.totals[owner] += len(data) - old_size

    def _refuse(self, owner: str, job_id: str, size: int) -> None:
        bound = size_text(self.per_user_bytes)
        raise DanluError(
            f"job {job_id}'s output ({size_text(size)}) would take {owner}'s stored job outputs beyond the "
            f"jobs service's bound of {bound} (outputs_per_user_bytes), and the rest are running jobs' outputs",
            status=413,
            reason="outputs_bound",
            fix="write large results to your home or to MLflow artifacts rather than into the notebook's outputs, "
            "or ask an admin to raise c.JobsServiceApp.outputs_per_user_bytes",
        )

    async def _prune(self, job_id: str, why: str) -> int:
        """Remove a job's kept outputs, note and audit it; the bytes freed."""
        ranks = self.sizes.pop(job_id, {})
        owner = self.owner_of.pop(job_id, "")
        freed = sum(ranks.values())
        self.totals[owner] -= freed
        note = {"at": isoformat(utcnow()), "why": why, "bytes": freed, "ranks": sorted(ranks)}
        await asyncio.to_thread(_remove, self.state_dir, job_id, note)
        await self.database.write(_record, job_id, note)
        self.log.info("job %s: its kept outputs (%s) were pruned: %s", job_id, size_text(freed), why)
        return freed

    async def prune_old(self, now: dt.datetime | None = None) -> list[str]:
        """Prune ended jobs' outputs older than ``max_age_days`` (0: none); the jobs pruned."""
        await self.rebuild()
        if self.max_age_days <= 0:
            return []
        before = (now or utcnow()) - dt.timedelta(days=self.max_age_days)
        old = await self.database.read(_ended, list(self.sizes), before)
        why = f"ended more than {self.max_age_days:g} days ago (outputs_max_age_days)"
        for job_id in old:
            owner = self.owner_of.get(job_id)
            if owner is None:
                continue
            async with self._locks[owner]:
                if job_id in self.sizes:
                    await self._prune(job_id, why)
        return old

    async def prune_forever(self) -> None:
        """:meth:`prune_old` now and then: hourly, or more often for a shorter age bound."""
        while True:
            try:
                await self.prune_old()
            except Exception:
                self.log.exception("pruning old job outputs failed (the next try is within an hour)")
            await asyncio.sleep(min(PRUNE_EVERY, max(1.0, self.max_age_days * 86400 / 4)))
