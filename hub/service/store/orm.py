"""The jobs service's database: jobs, attempts, the GPU ledger, queue changes, audit, usage and its rollups,
datasets and their uses, models.

SQLAlchemy 2 declarative models that run on SQLite (the default, a file in the
state dir) and PostgreSQL. Notebooks, logs and outputs are files in the job's
directory, not rows; a row holds what the API reports and what the scheduler
needs. Sessions are :mod:`.database`'s; creating and upgrading the schema is
:mod:`.schema`'s job (Alembic revisions in ``migrations/``): a change here comes
with a revision.
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
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


def isoformat(value: dt.datetime | None) -> str | None:
    return value.replace(tzinfo=dt.timezone.utc).isoformat().replace("+00:00", "Z") if value else None


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Job(Base):
    """A submitted job. Listings go newest first, ``(created_at, id)`` descending (the id breaks ties), and a
    page ends where the next begins (keyset pagination): each filter has an index in that order, and so
    has a user's own jobs in a state (every user's listing is filtered by owner)."""

    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_listing", "created_at", "id"),
        Index("ix_jobs_owner_listing", "owner", "created_at", "id"),
        Index("ix_jobs_owner_state_listing", "owner", "state", "created_at", "id"),
        Index("ix_jobs_state_listing", "state", "created_at", "id"),
        Index("ix_jobs_queue_listing", "queue", "created_at", "id"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner: Mapped[str] = mapped_column(String(255))
    name: Mapped[str] = mapped_column(String(100))
    state: Mapped[str] = mapped_column(String(20))
    reason: Mapped[str] = mapped_column(Text, default="")
    profile: Mapped[str] = mapped_column(String(64))
    queue: Mapped[str] = mapped_column(String(64), default="default")  # its team
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
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    max_attempts: Mapped[int] = mapped_column(Integer, default=1)
    backend_state: Mapped[dict[str, Any]] = mapped_column(default=dict)
    cell_sha256: Mapped[str] = mapped_column(String(64), default="")
    # what the runner reported about the job's MLflow run: run and experiment ids, points sent and dropped, notes
    tracking: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # what reproducing the job needs, written at submission (danlu.hub.service.jobs.provenance); the runner may add
    # only the seed, the git dirty state and a plain dataset's digest
    provenance: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # the job this one re-runs (POST /jobs/{id}/reproduce), if any
    reproduces: Mapped[str | None] = mapped_column(String(32), nullable=True, index=True)
    # the last checkpoint its runner reported (step, saved_at on the service's clock, attempt); kept across attempts
    checkpoint: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # how many times its owner (or an admin) asked it to save now (POST /jobs/{id}/checkpoint)
    save_requests: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    attempts: Mapped[list["Attempt"]] = relationship(
        back_populates="job", order_by="Attempt.number", cascade="all, delete-orphan", lazy="selectin"
    )


class Attempt(Base):
    """One try at running a job; a requeued job keeps its earlier attempts.

    Usage rollups find the attempts of a time window by their start, their end (or none: running), and
    the retries (``number`` > 1) by their start: an index for each, the last one partial (retries are
    few, and a planner that sees an index of them only uses it).
    """

    __tablename__ = "attempts"
    __table_args__ = (
        UniqueConstraint("job_id", "number"),
        Index("ix_attempts_started_at", "started_at"),
        Index("ix_attempts_finished_at", "finished_at", "started_at"),
        Index(
            "ix_attempts_retries", "started_at", sqlite_where=text("number > 1"), postgresql_where=text("number > 1")
        ),
    )

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
    __table_args__ = (
        Index("ix_server_usage_started_at", "started_at"),
        Index("ix_server_usage_ended_at", "ended_at", "started_at"),
    )

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


class UsageRollup(Base):
    """Usage summed over one hour or one day (``span``) for one kind of holder, owner, team, profile, flavor.

    Written by :mod:`danlu.hub.service.usage.rollups` once the period is over, never changed afterwards:
    ``gpu_seconds`` (devices x seconds held), ``util_sum`` and ``util_n`` (the NVML samples of the held
    devices), ``busy_seconds`` (each sampled device's seconds held times its mean utilization then),
    ``active`` (on hour rows: jobs or servers active in the hour, a job on one flavor's row; null on day
    rows) and ``started`` (first attempts of jobs, or servers, that began in the period). ``flavor`` is
    ``""`` for what held no GPU. ``bucket`` is the period's start (UTC).
    """

    __tablename__ = "usage_rollups"
    __table_args__ = (
        UniqueConstraint("span", "bucket", "kind", "owner", "team", "profile", "flavor"),
        Index("ix_usage_rollups_owner", "owner", "span", "bucket"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    span: Mapped[str] = mapped_column(String(8))  # "hour" | "day"
    bucket: Mapped[dt.datetime] = mapped_column(DateTime)
    kind: Mapped[str] = mapped_column(String(16))  # "job" | "server"
    owner: Mapped[str] = mapped_column(String(255))
    team: Mapped[str] = mapped_column(String(64))
    profile: Mapped[str] = mapped_column(String(64))
    flavor: Mapped[str] = mapped_column(String(64))
    gpu_seconds: Mapped[float] = mapped_column(Float)
    util_sum: Mapped[float] = mapped_column(Float)
    util_n: Mapped[int] = mapped_column(Integer)
    active: Mapped[int | None] = mapped_column(Integer, nullable=True)
    started: Mapped[int] = mapped_column(Integer)
    busy_seconds: Mapped[float] = mapped_column(Float, server_default="0")


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
    (:func:`danlu.digests.digest`); ``tables`` the columns and row counts of its tabular files.
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


class DatasetUse(Base):
    """A job used a catalog version, in a context (training, evaluation): runs <-> versions, both ways.

    Written when the job is accepted (its ``--dataset NAME@VERSION``; ``attempt`` is null) and when its
    code resolves a version through the runner API (``danlu.dataset``; the attempt that asked). One row
    per job, dataset, version and context.
    """

    __tablename__ = "dataset_uses"
    __table_args__ = (
        UniqueConstraint("job_id", "dataset", "version", "context"),
        Index("ix_dataset_uses_version", "dataset", "version"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int | None] = mapped_column(Integer, nullable=True)
    dataset: Mapped[str] = mapped_column(ForeignKey("datasets.name", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    digest: Mapped[str] = mapped_column(String(64))
    context: Mapped[str] = mapped_column(String(20))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class ModelRecord(Base):
    """A registered model that the jobs service created in MLflow's registry, and its aliases.

    Only a name with a row here takes versions: a same-named MLflow model that someone else
    created is never written to. ``aliases`` is ``{alias: version}``, as the service last set it.
    """

    __tablename__ = "models"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    description: Mapped[str] = mapped_column(Text, default="")
    aliases: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_by: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class ModelVersionRecord(Base):
    """One MLflow model version as Danlu governs it: where it came from, its evaluation gate, its approval.

    ``evaluation`` is ``not_required`` | ``queued`` | ``running`` | ``passed`` | ``failed`` | ``error``;
    ``approval`` is ``pending`` | ``approved`` | ``rejected``. ``synced`` says whether the version's
    MLflow tags already show this row (they are written after the row, and again until they do).
    """

    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("name", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(ForeignKey("models.name", ondelete="CASCADE"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    run_id: Mapped[str] = mapped_column(String(64), index=True)
    job_id: Mapped[str | None] = mapped_column(String(32), nullable=True, index=True)
    source: Mapped[str] = mapped_column(Text)
    model_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    registered_by: Mapped[str] = mapped_column(String(255))
    registered_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    approval: Mapped[str] = mapped_column(String(20), default="pending")
    evaluation: Mapped[str] = mapped_column(String(20), default="not_required")
    evaluation_job: Mapped[str | None] = mapped_column(String(32), nullable=True)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    thresholds: Mapped[dict[str, Any]] = mapped_column(default=dict)
    failures: Mapped[list[Any]] = mapped_column(default=list)
    synced: Mapped[bool] = mapped_column(Boolean, default=False)
    #: ``sha256:...`` of the manifest of the files copied at registration (:mod:`..registry.copies`);
    #: None: registered before Danlu copied models ("not copied")
    digest: Mapped[str | None] = mapped_column(String(80), nullable=True)


class ModelDecision(Base):
    """An approver's decision on a model version; ``audit_seq`` is its record in the audit chain."""

    __tablename__ = "model_decisions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), index=True)
    version: Mapped[int] = mapped_column(Integer)
    actor: Mapped[str] = mapped_column(String(255))
    decision: Mapped[str] = mapped_column(String(20))  # "approve" | "reject"
    comment: Mapped[str] = mapped_column(Text)
    at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    audit_seq: Mapped[int] = mapped_column(Integer)
    digest: Mapped[str | None] = mapped_column(String(80), nullable=True)  # the copy it decided on


class Sweep(Base):
    """A hyperparameter sweep: ordinary jobs of its owner, searched by an Optuna study (``study``).

    ``spec`` is the sweep's checked options (space, objective, trials, parallel, scheduler, sampler, seed,
    priority); ``template`` the trials' job body (JSON text: it holds the notebook). ``state`` is
    ``running`` | ``succeeded`` | ``stopped`` | ``failed``; ``best`` the best trial so far
    (``{"number", "job_id", "value", "params"}``); ``notes`` what the sweep wants its owner to know.
    """

    __tablename__ = "sweeps"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner: Mapped[str] = mapped_column(String(255), index=True)
    name: Mapped[str] = mapped_column(String(100))
    state: Mapped[str] = mapped_column(String(20), index=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    spec: Mapped[dict[str, Any]] = mapped_column(default=dict)
    template: Mapped[str] = mapped_column(Text)
    study: Mapped[str] = mapped_column(String(64))
    experiment: Mapped[str] = mapped_column(String(255), default="")
    parent_run_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    best: Mapped[dict[str, Any]] = mapped_column(default=dict)
    notes: Mapped[list[Any]] = mapped_column(default=list)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)


class SweepTrial(Base):
    """One trial of a sweep: its Optuna trial number, its job and how it ended.

    ``state`` is ``running`` (its job is queued, running or preempted) | ``complete`` | ``pruned`` |
    ``failed`` | ``stopped``; ``step`` the last step of the objective reported to Optuna, ``value`` its
    objective (the final one when complete, the last reported when pruned); ``rungs`` the ASHA rungs it
    completed; ``tagged`` whether its MLflow run names the sweep's parent run yet.
    """

    __tablename__ = "sweep_trials"
    __table_args__ = (UniqueConstraint("sweep_id", "number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    sweep_id: Mapped[str] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    job_id: Mapped[str | None] = mapped_column(String(32), nullable=True, index=True)
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    state: Mapped[str] = mapped_column(String(20))
    value: Mapped[float | None] = mapped_column(Float, nullable=True)
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    rungs: Mapped[int] = mapped_column(Integer, default=0)
    reason: Mapped[str] = mapped_column(Text, default="")
    tagged: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
