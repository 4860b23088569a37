"""The jobs database's schema: creating it, upgrading it, and refusing to run on one it does not know.

The schema's history is the Alembic revisions in ``migrations/`` (the way
JupyterHub and MLflow keep theirs). :func:`upgrade` is what ``danlu up`` runs
before anything opens the database: it creates an empty database, recognises
one that Danlu 0.1.0 made (tables, no revision: stamped ``0001``), backs up a
SQLite file before changing it (a PostgreSQL admin is told to ``pg_dump``), and
refuses a database a newer Danlu wrote. :func:`check` is the jobs service's
guard: it never changes the schema. After an upgrade from ``0001``,
:func:`import_legacy_inputs` moves the notebooks of unfinished jobs from their
folders into the ``job_inputs`` table, reading each file as untrusted.
:func:`prepare` gives tests and benchmarks a ready database in one call.
"""

from __future__ import annotations

import datetime as dt
import errno
import logging
import os
import sqlite3
import stat
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, event, inspect, pool, select
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.orm import sessionmaker

from danlu.errors import ConfigError, DanluError
from danlu.hub.service.jsonbody import parse_json
from danlu.hub.service.states import JobState
from danlu.hub.service.store.database import make_sessionmaker
from danlu.hub.service.store.ledger import Ledger
from danlu.hub.service.store.orm import Base, Job, JobInput, utcnow
from danlu.hub.service.store.rows import cell_sha256
from danlu.hub.service.validation import check_notebook

MIGRATIONS = Path(__file__).with_name("migrations")
#: the schema of Danlu 0.1.0, which created its tables without recording a revision
BASE_REVISION = "0001"
#: the largest input notebook carried over from a job's folder (the API's own limit on a submitted notebook)
MAX_NOTEBOOK = 64 * 2**20
UNFINISHED = (JobState.queued.value, JobState.running.value, JobState.preempted.value)

logger = logging.getLogger(__name__)


def alembic_config(url: str, connection: Connection | None = None) -> Config:
    """An Alembic configuration for the jobs database (for ``alembic.command``; no .ini file)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("path_separator", "os")
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head() -> str:
    """The revision this Danlu's models are at."""
    return ScriptDirectory(str(MIGRATIONS)).get_current_head()


def _engine(url: str) -> Engine:
    """An engine for changing the schema: on SQLite, one transaction per change, foreign keys off.

    Python's sqlite3 would commit before each DDL statement; here every
    transaction starts with an explicit BEGIN, so an upgrade is all or nothing.
    Foreign keys are off so that a table SQLite recreates to alter it does not
    cascade its deletion to the rows that refer to it.
    """
    if not url.startswith("sqlite"):
        return create_engine(url, poolclass=pool.NullPool)
    engine = create_engine(url, poolclass=pool.NullPool, connect_args={"isolation_level": None, "timeout": 30})

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection, _record):
        dbapi_connection.execute("PRAGMA foreign_keys=OFF")
        dbapi_connection.execute("PRAGMA journal_mode=WAL")

    @event.listens_for(engine, "begin")
    def _begin(connection):
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def _where(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def _found(engine: Engine) -> tuple[str | None, bool]:
    """(the recorded revision, whether any of the jobs service's tables exist)."""
    with engine.connect() as connection:
        revision = MigrationContext.configure(connection).get_current_revision()
        tables = set(inspect(connection).get_table_names())
    return revision, bool(tables & set(Base.metadata.tables))


def _refuse_unknown(revision: str, url: str) -> None:
    if revision not in {script.revision for script in ScriptDirectory(str(MIGRATIONS)).walk_revisions()}:
        raise ConfigError(
            f"the jobs database {_where(url)} is at schema revision {revision}, which this Danlu does not know "
            f"(it knows {BASE_REVISION} to {head()}): a newer Danlu upgraded it",
            reason="db_schema",
            fix="upgrade Danlu to the release that wrote it, or restore the backup taken before that upgrade",
        )


def upgrade(url: str, *, backup_dir: Path | None, log: logging.Logger = logger) -> dict:
    """Bring the jobs database to :func:`head`; return ``{"from", "to", "backup"}`` (backup: a path or None).

    ``from`` is None for a database that had no tables. A SQLite file is copied
    to ``backup_dir`` before its first change (None: no copy, for tests).
    """
    expected = head()
    engine = _engine(url)
    try:
        current, has_tables = _found(engine)
        if current is None and not has_tables:
            log.info("creating the jobs database %s (schema %s)", _where(url), expected)
            with engine.begin() as connection:
                command.upgrade(alembic_config(url, connection), "head")
            return {"from": None, "to": expected, "backup": None}
        stamp = current is None
        if stamp:
            if inspect(engine).has_table("job_inputs"):
                raise ConfigError(
                    f"the jobs database {_where(url)} was made by a development build of Danlu (it has job_inputs "
                    "but no schema revision), so it cannot be upgraded safely",
                    reason="db_schema",
                    fix="restore the backup that Danlu 0.1.0 left, or move the database away to start empty",
                )
            log.warning(
                "the jobs database %s has no schema revision: Danlu 0.1.0 made it (%s)", _where(url), BASE_REVISION
            )
            current = BASE_REVISION
        _refuse_unknown(current, url)
        if current == expected:
            return {"from": current, "to": expected, "backup": None}
        backup = _backup(url, backup_dir, current, log)
        log.info("upgrading the jobs database %s from schema %s to %s", _where(url), current, expected)
        with engine.begin() as connection:
            config = alembic_config(url, connection)
            if stamp:
                command.stamp(config, BASE_REVISION)
            command.upgrade(config, "head")
        return {"from": current, "to": expected, "backup": backup}
    finally:
        engine.dispose()


def _backup(url: str, backup_dir: Path | None, revision: str, log: logging.Logger) -> Path | None:
    """Copy a SQLite database with sqlite3's backup API (consistent while in WAL mode); never overwrite one."""
    database = make_url(url).database
    if not url.startswith("sqlite"):
        log.warning(
            "back up the jobs database %s now (pg_dump) if you have not: the upgrade from schema %s "
            "changes it, and Danlu cannot copy a PostgreSQL database for you",
            _where(url),
            revision,
        )
        return None
    if backup_dir is None or not database or database == ":memory:":
        return None
    backup_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    for n in range(100):
        target = backup_dir / f"{Path(database).name}.{revision}.{stamp}{f'.{n}' if n else ''}.bak"
        try:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"{target}: too many backups taken in the same second")
    source, copy = sqlite3.connect(database), sqlite3.connect(target)
    try:
        source.backup(copy)
    finally:
        copy.close()
        source.close()
    log.info(
        "backed up the jobs database %s to %s (schema %s: copy it back to undo the upgrade)", database, target, revision
    )
    return target


def make_private(url: str) -> list[Path]:
    """Mode 0600 for a SQLite database and its WAL files (no-op for other databases); the paths changed."""
    parsed = make_url(url)
    if not parsed.get_backend_name().startswith("sqlite") or not parsed.database or parsed.database == ":memory:":
        return []
    changed = []
    for suffix in ("", "-wal", "-shm", "-journal"):
        path = Path(parsed.database + suffix)
        try:
            if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o077:
                os.chmod(path, 0o600)
                changed.append(path)
        except OSError:
            continue
    return changed


def check(url: str) -> None:
    """Raise ConfigError unless the jobs database is at :func:`head` (the jobs service's start-up guard)."""
    expected = head()
    engine = _engine(url)
    try:
        current, _ = _found(engine)
    finally:
        engine.dispose()
    if current == expected:
        return
    if current is not None:
        _refuse_unknown(current, url)
    raise ConfigError(
        f"the jobs database {_where(url)} is at schema revision {current or 'none'}, and this Danlu needs {expected}",
        reason="db_schema",
        fix="start it with danlu up, which upgrades it",
    )


def downgrade(url: str, revision: str) -> None:
    """Take the schema back to ``revision`` (``0001``: what Danlu 0.1.0 runs on), in one transaction.

    What the later revisions added goes, with its data (job notebooks kept in
    ``job_inputs`` among them); restoring the backup :func:`upgrade` took keeps more.
    """
    engine = _engine(url)
    try:
        with engine.begin() as connection:
            command.downgrade(alembic_config(url, connection), revision)
    finally:
        engine.dispose()


def prepare(url: str) -> sessionmaker:
    """A database at head and sessions on it, in one call (tests, benchmarks; no backup)."""
    upgrade(url, backup_dir=None, log=logger)
    return make_sessionmaker(url)


class NotCarried(Exception):
    """Why a job's notebook cannot be carried over from its folder."""


def _problem(error: OSError, kind: str) -> str:
    if error.errno == errno.ENOENT:
        return "is missing"
    if error.errno in (errno.ELOOP, errno.ENOTDIR):
        return f"is a symbolic link (not followed) or not a {kind}"
    return f"cannot be opened ({error.strerror})"


def read_legacy_input(jobs_dir: Path, job_id: str) -> tuple[str, dict]:
    """The text of ``<jobs_dir>/<job_id>/input.ipynb`` and its notebook, read as untrusted.

    No symbolic link is followed (folder or file), nothing but a regular file
    is read (a FIFO cannot block), at most :data:`MAX_NOTEBOOK` bytes, and the
    notebook must pass the API's checks of a submitted one.
    """
    if job_id in ("", ".", "..") or "/" in job_id or "\0" in job_id:
        raise NotCarried(f"its id {job_id!r} is not a folder name")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        folder = os.open(Path(jobs_dir) / job_id, flags | os.O_DIRECTORY)
    except OSError as e:
        raise NotCarried(f"its folder {Path(jobs_dir) / job_id} {_problem(e, 'folder')}") from None
    try:
        fd = os.open("input.ipynb", flags | os.O_NONBLOCK, dir_fd=folder)
    except OSError as e:
        raise NotCarried(f"input.ipynb in its folder {_problem(e, 'file')}") from None
    finally:
        os.close(folder)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotCarried("input.ipynb in its folder is not a regular file")
        if info.st_size > MAX_NOTEBOOK:
            raise NotCarried(f"input.ipynb is larger than {MAX_NOTEBOOK // 2**20} MiB")
        chunks, size = [], 0
        while size <= MAX_NOTEBOOK and (chunk := os.read(fd, MAX_NOTEBOOK + 1 - size)):  # it may grow meanwhile
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    try:  # the API's own rules for a submitted notebook: UTF-8 JSON, bounded nesting, nbformat 4, a code cell
        nb = parse_json(data, max_bytes=MAX_NOTEBOOK)
    except DanluError as e:
        raise NotCarried(e.message.replace("the request body", "input.ipynb", 1)) from None
    if not isinstance(nb, dict):
        raise NotCarried("input.ipynb is not a notebook (its JSON is not an object)")
    try:
        check_notebook(nb)
    except DanluError as e:
        raise NotCarried(f"input.ipynb is not a notebook Danlu can run: {e.message}") from None
    return data.decode("utf-8").removeprefix("\ufeff"), nb


def import_legacy_inputs(sessions: sessionmaker, jobs_dir: Path, log: logging.Logger = logger) -> list[str]:
    """Give each unfinished job without a ``job_inputs`` row the notebook in its folder; return their ids.

    A job whose notebook cannot be carried over ends ``failed`` (failure
    ``infrastructure``), with a reason that says why and that it must be
    submitted again, its open attempt closed and its GPUs released (its
    processes, if any still run, are not looked for). Run it before the jobs
    service starts; running it again handles nothing twice.
    """
    with sessions() as s:
        ids = list(
            s.scalars(
                select(Job.id)
                .outerjoin(JobInput, JobInput.job_id == Job.id)
                .where(Job.state.in_(UNFINISHED), JobInput.job_id.is_(None))
                .order_by(Job.created_at)
            )
        )
    for job_id in ids:
        try:
            (notebook, nb), problem = read_legacy_input(jobs_dir, job_id), ""
        except NotCarried as e:
            notebook, nb, problem = None, None, str(e)
        with sessions() as s, s.begin():
            job = s.get(Job, job_id)
            if notebook is not None:
                s.add(JobInput(job_id=job_id, notebook=notebook))
                job.cell_sha256 = cell_sha256(nb)[1]
                log.info("job %s: its notebook was carried over into the database", job_id)
                continue
            now = utcnow()
            job.state, job.failure, job.finished_at = JobState.failed.value, "infrastructure", now
            job.reason = f"the upgrade of Danlu could not carry its notebook over: {problem}; submit the job again"
            for attempt in job.attempts:
                if attempt.finished_at is None:
                    attempt.state, attempt.reason, attempt.failure, attempt.finished_at = (
                        job.state,
                        job.reason,
                        job.failure,
                        now,
                    )
            Ledger([]).release(s, "job", job_id)
            log.warning("job %s failed: %s", job_id, job.reason)
    return ids
