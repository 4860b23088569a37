"""The jobs service's database: jobs, attempts, the GPU ledger, queue changes, audit, usage and datasets.

SQLAlchemy 2 declarative models that run on SQLite (the default, a file in the
state dir) and PostgreSQL. Notebooks, logs and outputs are files in the job's
directory, not rows; a row holds what the API reports and what the scheduler
needs. :func:`make_engine` applies the pragmas SQLite needs to be shared by
the service and its recovery code (WAL, a busy timeout); :func:`make_sessionmaker`
opens sessions. Creating and upgrading the schema is :mod:`danlu.hub.service.db`'s
job (Alembic revisions in ``migrations/``): a change here comes with a revision.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
)
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
    queue: Mapped[str] = mapped_column(String(64), default="default", index=True)  # its team
    priority: Mapped[int] = mapped_column(Integer, default=0)
    priority_class: Mapped[str] = mapped_column(String(64), default="")
    nproc: Mapped[int] = mapped_column(Integer, default=1)  # processes per node
    nnodes: Mapped[int] = mapped_column(Integer, default=1)  # nodes (more than one: a backend that has them)
    gpus: Mapped[int] = mapped_column(Integer, default=0)
    gpu_type: Mapped[str | None] = mapped_column(String(64), nullable=True)
    cpu: Mapped[float] = mapped_column(Float, default=1.0)
    memory: Mapped[float] = mapped_column(Float, default=0.0)
    retries: Mapped[int] = mapped_column(Integer, default=0)
    timeout_seconds: Mapped[int | None] = mapped_column(Integer, nullable=True)
    not_before: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    queued_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)  # last (re)entry to the queue
    failure: Mapped[str] = mapped_column(String(20), default="")  # "" | "user" | "infrastructure"
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
    cell_sha256: Mapped[str] = mapped_column(String(64), default="")
    # what the runner reported about the job's MLflow run: run and experiment ids, points sent and dropped, notes
    tracking: Mapped[dict[str, Any]] = mapped_column(default=dict)

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
    flavor: Mapped[str | None] = mapped_column(String(64), nullable=True)
    failure: Mapped[str] = mapped_column(String(20), default="")
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    started_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    # sha256 of the attempt's job token: the runner authenticates its reports with the token itself
    token_hash: Mapped[str] = mapped_column(String(64), default="")
    # why the service is stopping the attempt (cancelled, preempted, timed_out) and the grace it gives
    stop_reason: Mapped[str] = mapped_column(String(20), default="")
    stop_grace: Mapped[float | None] = mapped_column(Float, nullable=True)
    # the runner's own account of how the attempt ended (state, reason, exit code, infrastructure?)
    report: Mapped[dict[str, Any]] = mapped_column(default=dict)

    job: Mapped[Job] = relationship(back_populates="attempts")


class JobInput(Base):
    """The notebook a job runs, as submitted: kept by the service, never read back from the job's folder."""

    __tablename__ = "job_inputs"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    notebook: Mapped[str] = mapped_column(Text)


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


class QueueSetting(Base):
    """An admin's live change to a team's queue (quota, limits, hold), over danlu.yaml."""

    __tablename__ = "queue_settings"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    changes: Mapped[dict[str, Any]] = mapped_column(default=dict)
    held: Mapped[bool] = mapped_column(Boolean, default=False)


class Flag(Base):
    """Workbench-wide switches (``drain``)."""

    __tablename__ = "flags"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[dict[str, Any]] = mapped_column(default=dict)


class AuditRecord(Base):
    """One audited action; ``hash`` chains every record to the one before it."""

    __tablename__ = "audit"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(255))
    action: Mapped[str] = mapped_column(String(64), index=True)
    target: Mapped[str] = mapped_column(String(255), default="")
    before: Mapped[dict[str, Any]] = mapped_column(default=dict)
    after: Mapped[dict[str, Any]] = mapped_column(default=dict)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))


class ServerUsage(Base):
    """GPUs a notebook server held, from start to stop (for usage reports)."""

    __tablename__ = "server_usage"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    holder: Mapped[str] = mapped_column(String(255), index=True)
    owner: Mapped[str] = mapped_column(String(255))
    team: Mapped[str] = mapped_column(String(64))
    profile: Mapped[str] = mapped_column(String(64), default="")
    flavor: Mapped[str | None] = mapped_column(String(64), nullable=True)
    devices: Mapped[list[Any]] = mapped_column(default=list)
    started_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    ended_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)


class GpuSample(Base):
    """Measured utilization of a device (NVML), sampled while the service runs."""

    __tablename__ = "gpu_samples"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    device: Mapped[int] = mapped_column(Integer, index=True)
    at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow, index=True)
    utilization: Mapped[float] = mapped_column(Float)


class Dataset(Base):
    """A named dataset of the catalog and who may read it and add versions to it (empty: everyone)."""

    __tablename__ = "datasets"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    description: Mapped[str] = mapped_column(Text, default="")
    read_groups: Mapped[list[Any]] = mapped_column(default=list)
    register_groups: Mapped[list[Any]] = mapped_column(default=list)
    created_by: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class DatasetVersion(Base):
    """One content of a dataset, numbered 1..n; never changed once written.

    ``manifest`` is ``[relative path, size, sha256]`` of every file, ``digest`` the sha256 over it
    (:func:`danlu.datasets.digest`); ``tables`` the columns and row counts of its tabular files.
    """

    __tablename__ = "dataset_versions"
    __table_args__ = (UniqueConstraint("dataset", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    dataset: Mapped[str] = mapped_column(ForeignKey("datasets.name", ondelete="CASCADE"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    digest: Mapped[str] = mapped_column(String(64), index=True)
    manifest: Mapped[list[Any]] = mapped_column(default=list)
    files: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int] = mapped_column(BigInteger)  # more than 2 GiB on PostgreSQL
    source: Mapped[str] = mapped_column(Text)  # PATH or ROOT:PATH, as given (normalized)
    path: Mapped[str] = mapped_column(Text)  # the real path it resolved to
    tables: Mapped[list[Any]] = mapped_column(default=list)
    created_by: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


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
    """Sessions on the jobs database; it creates and alters nothing (:mod:`danlu.hub.service.db` owns the schema)."""
    return sessionmaker(make_engine(url), expire_on_commit=False)
