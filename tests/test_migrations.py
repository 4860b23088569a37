"""The jobs database's migrations: a database Danlu 0.1.0 left is upgraded without losing a row.

``fixtures/danlu-0.1.0.sql`` is that database (made once by
``fixtures/make_previous_db.py`` from the 0.1.0 models): jobs in every state,
attempts, GPU allocations, queue settings, a hash-chained audit log. The
migrated schema must equal the models (Alembic's autogenerate finds nothing to
do), on SQLite and, where ``DANLU_TEST_POSTGRES_URL`` is set, PostgreSQL.
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
from pathlib import Path

import nbformat
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import MetaData, create_engine, inspect, make_url, select, text

from danlu import env
from danlu.errors import ConfigError
from danlu.hub.service.store import audit
from danlu.hub.service.store import schema as db_schema
from danlu.hub.service.store.database import make_sessionmaker
from danlu.hub.service.store.orm import Allocation, Attempt, AuditRecord, Base, Job, JobInput
from danlu.hub.service.store.rows import cell_sha256

from .conftest import NO_POSTGRES, cannot_run

FIXTURE = Path(__file__).parent / "fixtures" / "danlu-0.1.0.sql"
POSTGRES_URL = env.TEST_POSTGRES_URL.get()
PG_SCHEMA = "danlu_test_migrations"
LOG = logging.getLogger("danlu.test_migrations")
UNFINISHED = {"b00000000001", "b00000000002", "b00000000003"} | {f"c0000000000{i}" for i in range(1, 9)}
# the unfinished jobs whose folder holds no usable notebook, and what their reason must say
BROKEN = {
    "symlink": "input.ipynb in its folder is a symbolic link (not followed)",
    "fifo": "not a regular file",
    "directory": "not a regular file",
    "oversize": "larger than 64 MiB",
    "bad-json": "input.ipynb is not valid JSON at line 1",
    "missing": "input.ipynb in its folder is missing",
    "folder-symlink": "c00000000007 is a symbolic link (not followed) or not a folder",
    "not-a-notebook": "not a notebook Danlu can run",
}


@pytest.fixture(autouse=True)
def audit_key():
    """The key danlu up loads before it upgrades (0009 keys the audit chain with it)."""
    audit.use_key(b"k" * 32)


def load_previous(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(path)
    connection.executescript(FIXTURE.read_text(encoding="utf-8"))
    connection.close()
    return f"sqlite:///{path}"


def dump(url: str) -> dict[str, list[dict]]:
    """Every row of every table (but alembic_version), as the driver returns it, in key order."""
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            found, out = inspect(c), {}
            for table in sorted(set(found.get_table_names()) - {"alembic_version"}):
                key = ", ".join(f'"{n}"' for n in found.get_pk_constraint(table)["constrained_columns"])
                out[table] = [dict(r._mapping) for r in c.execute(text(f'SELECT * FROM "{table}" ORDER BY {key}'))]
            return out
    finally:
        engine.dispose()


def schema(url: str) -> dict:
    """Tables, columns (type, nullability, server default), keys, indexes, unique and foreign keys."""
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            found = inspect(c)
            return {
                table: {
                    "columns": [
                        (col["name"], str(col["type"]), col["nullable"], col["default"])
                        for col in found.get_columns(table)
                    ],
                    "pk": found.get_pk_constraint(table)["constrained_columns"],
                    "indexes": sorted(
                        (i["name"], tuple(i["column_names"]), bool(i["unique"])) for i in found.get_indexes(table)
                    ),
                    "unique": sorted(tuple(u["column_names"]) for u in found.get_unique_constraints(table)),
                    "fks": sorted(
                        (
                            tuple(f["constrained_columns"]),
                            f["referred_table"],
                            tuple(f["referred_columns"]),
                            f["options"].get("ondelete"),
                        )
                        for f in found.get_foreign_keys(table)
                    ),
                }
                for table in sorted(set(found.get_table_names()) - {"alembic_version"})
            }
    finally:
        engine.dispose()


def differences(url: str) -> list:
    """What Alembic's autogenerate would change to make the database match the models."""
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            return compare_metadata(MigrationContext.configure(c), Base.metadata)
    finally:
        engine.dispose()


def set_revision(url: str, revision: str) -> None:
    engine = create_engine(url)
    with engine.begin() as c:
        c.execute(text("UPDATE alembic_version SET version_num = :r"), {"r": revision})
    engine.dispose()


@pytest.fixture
def postgres_url():
    """An empty schema of the test PostgreSQL database, first on the search path.

    Not the database's own tables: the service tests' workbench may be running on them.
    """
    if not POSTGRES_URL:
        cannot_run("postgres", NO_POSTGRES)
    engine = create_engine(POSTGRES_URL)
    for statement in (f"DROP SCHEMA IF EXISTS {PG_SCHEMA} CASCADE", f"CREATE SCHEMA {PG_SCHEMA}"):
        with engine.begin() as c:
            c.execute(text(statement))
    yield (
        make_url(POSTGRES_URL)
        .update_query_dict({"options": f"-csearch_path={PG_SCHEMA}"})
        .render_as_string(hide_password=False)
    )
    with engine.begin() as c:
        c.execute(text(f"DROP SCHEMA {PG_SCHEMA} CASCADE"))
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request, tmp_path):
    """An empty database."""
    if request.param == "postgres":
        return request.getfixturevalue("postgres_url")
    return f"sqlite:///{tmp_path / 'danlu.sqlite'}"


def test_revision_0001_is_the_schema_of_danlu_0_1_0(tmp_path):
    previous = load_previous(tmp_path / "previous.sqlite")
    migrated = f"sqlite:///{tmp_path / 'migrated.sqlite'}"
    command.upgrade(db_schema.alembic_config(migrated), "0001")  # env.py on a URL, as the alembic command line runs it
    assert schema(migrated) == schema(previous)
    assert set(schema(migrated)) == set(Base.metadata.tables) - {
        "job_inputs",
        "datasets",
        "dataset_versions",
        "dataset_uses",
        "models",
        "model_versions",
        "model_decisions",
        "usage_rollups",
        "sweeps",
        "sweep_trials",
    }


def test_upgrade_of_a_danlu_0_1_0_database_keeps_every_row(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    path = tmp_path / "state" / "danlu.sqlite"
    url = load_previous(path)
    writer = sqlite3.connect(path)  # a change still in the write-ahead log, as a running service leaves one
    writer.execute("PRAGMA journal_mode=WAL")
    with writer:
        writer.execute("""INSERT INTO flags VALUES ('note', '{"in": "the WAL"}')""")
    assert path.with_name("danlu.sqlite-wal").stat().st_size > 0
    before = dump(url)
    previous_sql = list(writer.iterdump())
    assert len(before["jobs"]) == 15 and len(before["audit"]) == 19 and len(before["flags"]) == 2
    with pytest.raises(ConfigError, match="revision none, and this Danlu needs 0013"):
        db_schema.check(url)

    result = db_schema.upgrade(url, backup_dir=tmp_path / "backups", log=LOG)

    assert result["from"] == "0001" and result["to"] == db_schema.head() == "0013"
    assert "no schema revision: Danlu 0.1.0 made it" in caplog.text
    backup = Path(result["backup"])
    assert backup.parent == tmp_path / "backups"
    assert re.fullmatch(r"danlu\.sqlite\.0001\.\d{8}T\d{6}Z\.bak", backup.name), backup.name
    assert os.stat(backup).st_mode & 0o777 == 0o600
    copy = sqlite3.connect(backup)
    assert list(copy.iterdump()) == previous_sql
    copy.close()
    after = dump(url)
    for table, rows in before.items():
        assert [{k: row[k] for k in rows[0]} for row in after[table]][: len(rows)] == rows or table == "audit", table
    assert unchained(after["audit"][:19]) == unchained(before["audit"])
    assert after["audit"][19]["action"] == "key_audit_chain" and '"whole"' in after["audit"][19]["before"]
    assert after["job_inputs"] == []
    with make_sessionmaker(url)() as s:
        for job in s.scalars(select(Job)):
            assert (job.cell_sha256, job.tracking, job.checkpoint, job.save_requests) == ("", {}, None, 0)
        for attempt in s.scalars(select(Attempt)):
            assert (attempt.token_hash, attempt.stop_reason, attempt.stop_grace, attempt.report) == ("", "", None, {})
        verified = audit.verify(s)
        assert verified.ok and verified.records == 20, verified.problem
        assert not audit.verify(s, key=b"").ok  # the chain is keyed now
    assert differences(url) == []
    db_schema.check(url)
    writer.close()


def test_a_database_without_revision_but_with_the_new_tables_is_refused(tmp_path):
    url = f"sqlite:///{tmp_path / 'danlu.sqlite'}"
    engine = create_engine(url)
    Base.metadata.create_all(engine)  # as a development build between 0.1.0 and migrations left it
    engine.dispose()
    with pytest.raises(ConfigError, match="development build of Danlu"):
        db_schema.upgrade(url, backup_dir=tmp_path, log=LOG)


def make_job_folders(jobs: Path, outside: Path) -> dict[str, str]:
    """A folder for each unfinished job of the fixture, as its name says; the good notebooks' text."""
    good = {}
    for name, job_id in (
        ("good-queued", "b00000000001"),
        ("good-running", "b00000000002"),
        ("good-preempted", "b00000000003"),
    ):
        nb = nbformat.v4.new_notebook(
            cells=[
                nbformat.v4.new_code_cell("x = 1"),
                nbformat.v4.new_code_cell(f"print('{name}')", metadata={"tags": ["danlu-cell"]}),
                nbformat.v4.new_code_cell("y = 2"),
            ]
        )
        (jobs / job_id).mkdir(parents=True)
        good[job_id] = nbformat.writes(nb)
        (jobs / job_id / "input.ipynb").write_text(good[job_id], encoding="utf-8")
    outside.mkdir()
    (outside / "input.ipynb").write_text(good["b00000000001"], encoding="utf-8")
    folders = {name: jobs / f"c0000000000{i}" for i, name in enumerate(BROKEN, 1)}
    for name, folder in folders.items():
        if name != "folder-symlink":
            folder.mkdir()
    (folders["symlink"] / "input.ipynb").symlink_to(outside / "input.ipynb")
    os.mkfifo(folders["fifo"] / "input.ipynb")
    (folders["directory"] / "input.ipynb").mkdir()
    with open(folders["oversize"] / "input.ipynb", "wb") as f:
        f.truncate(db_schema.MAX_NOTEBOOK + 1)
    (folders["bad-json"] / "input.ipynb").write_text('{"cells": [', encoding="utf-8")
    folders["folder-symlink"].symlink_to(outside, target_is_directory=True)
    (folders["not-a-notebook"] / "input.ipynb").write_text('{"cells": []}', encoding="utf-8")
    return good


def unchained(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in ("hash", "prev_hash")} for row in rows]


def test_a_rewrite_before_the_upgrade_is_on_record_after_it(tmp_path):
    url = load_previous(tmp_path / "danlu.sqlite")
    db = sqlite3.connect(tmp_path / "danlu.sqlite")
    with db:
        db.execute("UPDATE audit SET actor = 'mallory' WHERE seq = 4")
    db.close()

    db_schema.upgrade(url, backup_dir=None, log=LOG)

    with make_sessionmaker(url)() as s:
        assert audit.verify(s).ok  # the chain goes on, keyed ...
        last = audit.to_dict(s.get(AuditRecord, 20))
    assert last["action"] == "key_audit_chain"  # ... and says what it found when it was keyed
    assert last["before"] == {"unkeyed_chain": "record 4 was altered"} and last["after"] == {"records": 19}


@pytest.mark.timeout(60)  # a FIFO must not block the upgrade
def test_import_legacy_inputs_carries_notebooks_over_and_fails_what_it_cannot(tmp_path):
    url = load_previous(tmp_path / "danlu.sqlite")
    db_schema.upgrade(url, backup_dir=None, log=LOG)
    good = make_job_folders(tmp_path / "jobs", tmp_path / "elsewhere")
    finished_before = [row for row in dump(url)["jobs"] if row["id"] not in UNFINISHED]
    sessions = make_sessionmaker(url)

    handled = db_schema.import_legacy_inputs(sessions, tmp_path / "jobs", LOG)

    assert set(handled) == UNFINISHED
    with sessions() as s:
        for job_id, notebook in good.items():
            job = s.get(Job, job_id)
            assert s.get(JobInput, job_id).notebook == notebook
            assert job.cell_sha256 == cell_sha256(nbformat.reads(notebook, as_version=4))[1] != ""
            assert job.state in ("queued", "running", "preempted") and job.reason == ""
        for job in s.scalars(select(Job).where(Job.name.in_(BROKEN))):
            assert s.get(JobInput, job.id) is None
            assert (job.state, job.failure) == ("failed", "infrastructure") and job.finished_at is not None
            assert BROKEN[job.name] in job.reason and job.reason.endswith("submit the job again"), job.reason
            assert all(a.finished_at is not None and a.state == "failed" for a in job.attempts)
        held = {a.device: a.holder_id for a in s.scalars(select(Allocation))}
        assert held == {0: "b00000000002", 1: "b00000000003", 3: "dave"}  # the failed job's GPU was released
    assert [row for row in dump(url)["jobs"] if row["id"] not in UNFINISHED] == finished_before
    assert db_schema.import_legacy_inputs(sessions, tmp_path / "jobs", LOG) == []


def test_migrated_schema_equals_the_models(url):
    assert db_schema.upgrade(url, backup_dir=None, log=LOG) == {"from": None, "to": db_schema.head(), "backup": None}
    assert differences(url) == []


def test_upgrade_is_idempotent_and_downgrades_to_0001_and_back(url, tmp_path):
    sessions = db_schema.prepare(url)
    unchanged = {"from": "0013", "to": "0013", "backup": None}
    assert db_schema.upgrade(url, backup_dir=tmp_path / "backups", log=LOG) == unchanged
    assert not (tmp_path / "backups").exists()
    with sessions() as s, s.begin():
        job = Job(
            id="d00000000001",
            owner="alice",
            name="kept",
            state="queued",
            profile="python",
            cell_sha256="ab" * 32,
            tracking={"run_id": "r1"},
        )
        job.attempts.append(Attempt(number=1, state="failed", token_hash="cd" * 32, report={"state": "failed"}))
        s.add_all([job, JobInput(job_id=job.id, notebook="{}")])
    sessions.kw["bind"].dispose()
    before = dump(url)

    db_schema.downgrade(url, "0001")

    at_0001 = dump(url)
    assert "job_inputs" not in at_0001 and "tracking" not in at_0001["jobs"][0]
    for table in ("jobs", "attempts"):  # recreating a table on SQLite cascaded no deletion
        assert [{k: row[k] for k in at_0001[table][0]} for row in before[table]] == at_0001[table]
    if url.startswith("sqlite"):
        assert schema(url) == schema(load_previous(tmp_path / "previous.sqlite"))
    with pytest.raises(ConfigError, match="revision 0001, and this Danlu needs 0013"):
        db_schema.check(url)

    assert db_schema.upgrade(url, backup_dir=None, log=LOG)["from"] == "0001"
    assert differences(url) == []
    after = dump(url)
    assert after["attempts"][0]["token_hash"] == "" and after["job_inputs"] == []
    assert [{k: row[k] for k in at_0001["jobs"][0]} for row in after["jobs"]] == at_0001["jobs"]


def test_check_refuses_an_old_and_an_unknown_revision(url):
    with pytest.raises(ConfigError, match="revision none") as e:
        db_schema.check(url)
    assert "start it with danlu up, which upgrades it" in str(e.value)
    db_schema.upgrade(url, backup_dir=None, log=LOG)
    db_schema.check(url)
    set_revision(url, "0001")
    with pytest.raises(ConfigError) as e:
        db_schema.check(url)
    assert "revision 0001, and this Danlu needs 0013 (start it with danlu up, which upgrades it)" in str(e.value)
    assert e.value.reason == "db_schema"
    set_revision(url, "0999")
    for refuse in (lambda: db_schema.check(url), lambda: db_schema.upgrade(url, backup_dir=None, log=LOG)):
        with pytest.raises(ConfigError) as e:
            refuse()
        assert "schema revision 0999, which this Danlu does not know" in str(e.value)
        assert "upgrade Danlu to the release that wrote it" in str(e.value)


@pytest.mark.postgres
def test_upgrade_of_danlu_0_1_0_rows_on_postgres(postgres_url, tmp_path, caplog):
    url = postgres_url
    caplog.set_level(logging.INFO)
    db_schema.upgrade(url, backup_dir=None, log=LOG)
    db_schema.downgrade(url, "0001")
    previous = create_engine(load_previous(tmp_path / "previous.sqlite"))
    source, target = MetaData(), MetaData()
    source.reflect(previous)
    engine = create_engine(url)
    target.reflect(engine)
    with previous.connect() as read, engine.begin() as write:
        for table in target.sorted_tables:
            if table.name != "alembic_version":
                rows = [dict(r._mapping) for r in read.execute(source.tables[table.name].select())]
                write.execute(table.insert(), rows)
        write.execute(text("DROP TABLE alembic_version"))  # as 0.1.0 left it: no revision
    previous.dispose()
    engine.dispose()
    before = dump(url)

    result = db_schema.upgrade(url, backup_dir=tmp_path / "backups", log=LOG)

    assert result == {"from": "0001", "to": db_schema.head(), "backup": None}
    assert "pg_dump" in caplog.text and not (tmp_path / "backups").exists()
    after = dump(url)
    for table, rows in before.items():
        assert [{k: row[k] for k in rows[0]} for row in after[table]][: len(rows)] == rows or table == "audit", table
    # 0009 keys the audit chain: the records are the same, their hashes are the keyed chain's, and one more says so
    assert unchained(after["audit"][: len(before["audit"])]) == unchained(before["audit"])
    assert after["audit"][len(before["audit"])]["action"] == "key_audit_chain"
    with make_sessionmaker(url)() as s:
        assert all(j.cell_sha256 == "" and j.tracking == {} for j in s.scalars(select(Job)))
        assert audit.verify(s).ok
    assert differences(url) == []
