"""The jobs database as the running service uses it: sessions, one writer thread, a few reader threads.

:class:`Database` runs every piece of database work off the event loop, so a slow disk or a busy PostgreSQL
never freezes the service's other requests: writes one at a time, each in a transaction of its own, on one
thread (:meth:`Database.write`), reads beside them on a few others (:meth:`Database.read`). One writer
means no read-modify-write of a row can lose another's change, SQLite never waits on itself, and the audit
log's hash chain (:mod:`.audit`), which appends after its last record, always has exactly one writer: no
lock of the caller's is needed for it. :func:`make_engine` applies the pragmas SQLite needs to be shared by
the service and the recovery code of ``danlu up`` (WAL, a busy timeout, foreign keys).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

T = TypeVar("T")
READERS = 4


def make_engine(url: str) -> Engine:
    kwargs: dict[str, Any] = {"future": True}
    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
    else:
        kwargs["pool_pre_ping"] = True
    engine = create_engine(url, **kwargs)
    if url.startswith("sqlite"):

        @event.listens_for(engine, "connect")
        def _pragmas(conn, _record):  # pragma: no cover - exercised by every sqlite test
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

    return engine


def make_sessionmaker(url: str) -> sessionmaker:
    """Sessions on the jobs database; it creates and alters nothing (:mod:`.schema` owns the schema)."""
    return sessionmaker(make_engine(url), expire_on_commit=False)


class Database:
    """The service's sessions, with writes on one thread and reads on :data:`READERS` others."""

    def __init__(self, sessions: sessionmaker):
        self.sessions = sessions
        self._writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="danlu-db-write")
        self._reads = ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="danlu-db-read")

    @classmethod
    def at(cls, url: str) -> Database:
        return cls(make_sessionmaker(url))

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(session, *args)`` in one transaction on the writer thread."""

        def work():
            with self.sessions() as s, s.begin():
                return fn(s, *args)

        return await asyncio.get_running_loop().run_in_executor(self._writes, work)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(session, *args)``, which only reads, on a reader thread."""

        def work():
            with self.sessions() as s:
                return fn(s, *args)

        return await asyncio.get_running_loop().run_in_executor(self._reads, work)

    def write_now(self, fn: Callable[[Session], T]) -> T:
        """``fn(session)`` in one transaction on the caller's thread: only before the service serves anyone
        (its start-up), when no writer thread's work can be interleaved with it."""
        with self.sessions() as s, s.begin():
            return fn(s)

    def close(self) -> None:
        self._writes.shutdown(wait=False, cancel_futures=True)
        self._reads.shutdown(wait=False, cancel_futures=True)
