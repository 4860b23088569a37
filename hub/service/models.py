"""The jobs service's database: jobs, their attempts and the GPU ledger.

SQLAlchemy 2 declarative models that run on SQLite (the default, a file in the
state dir) and PostgreSQL. Notebooks, logs and outputs are files in the job's
directory, not rows; a row holds what the API reports and what the scheduler
needs. :func:`make_engine` applies the pragmas SQLite needs to be shared by
the service and its recovery code (WAL, a busy timeout).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import JSON, DateTime, ForeignKey, Integer, String, Text, UniqueConstraint, create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship, sessionmaker


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


def isoformat(value: dt.datetime | None) -> str | None:
    return value.replace(tzinfo=dt.timezone.utc).isoformat().replace("+00:00", "Z") if value else None


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner: Mapped[str] = mapped_column(String(255), index=True)
    name: Mapped[str] = mapped_column(String(100))
    state: Mapped[str] = mapped_column(String(20), index=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    profile: Mapped[str] = mapped_column(String(64))
    queue: Mapped[str] = mapped_column(String(64), default="default")
    nproc: Mapped[int] = mapped_column(Integer, default=1)
    gpus: Mapped[int] = mapped_column(Integer, default=0)
    parameters: Mapped[dict[str, Any]] = mapped_column(default=dict)
    experiment: Mapped[str] = mapped_column(String(255), default="")
    datasets: Mapped[list[Any]] = mapped_column(default=list)
    source: Mapped[dict[str, Any]] = mapped_column(default=dict)
    cwd: Mapped[str] = mapped_column(Text, default=".")
    groups: Mapped[list[Any]] = mapped_column(default=list)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow, index=True)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    max_attempts: Mapped[int] = mapped_column(Integer, default=1)
    backend_state: Mapped[dict[str, Any]] = mapped_column(default=dict)

    attempts: Mapped[list["Attempt"]] = relationship(
        back_populates="job", order_by="Attempt.number", cascade="all, delete-orphan", lazy="selectin")


class Attempt(Base):
    """One try at running a job; a requeued job keeps its earlier attempts."""

    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("job_id", "number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(20))
    reason: Mapped[str] = mapped_column(Text, default="")
    devices: Mapped[list[Any]] = mapped_column(default=list)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    started_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)

    job: Mapped[Job] = relationship(back_populates="attempts")


class Allocation(Base):
    """The GPU ledger: one row per device held by a job or a notebook server.

    The primary key on ``device`` makes double assignment impossible, whatever
    the number of processes writing.
    """

    __tablename__ = "allocations"

    device: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    holder_kind: Mapped[str] = mapped_column(String(16))  # "job" | "server"
    holder_id: Mapped[str] = mapped_column(String(255), index=True)
    owner: Mapped[str] = mapped_column(String(255))
    flavor: Mapped[str] = mapped_column(String(64), default="gpu")
    since: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


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
    engine = make_engine(url)
    Base.metadata.create_all(engine)
    return sessionmaker(engine, expire_on_commit=False)
