"""Shared fixtures: the service tier runs a real ``danlu up`` (JupyterHub, CHP, MLflow).

``workbench`` is parametrized over the jobs database: SQLite always, PostgreSQL
when ``DANLU_TEST_POSTGRES_URL`` is set (``.ci/run`` starts one). Users:
``alice`` (group research), ``bob`` (no group), ``carol`` (group vision),
``admin`` (an admin). Two GPUs of flavor ``sim`` are declared.
"""

from __future__ import annotations

import psutil
import pytest

from danlu import env
from danlu.hub.testing import Workbench

PROFILES = {
    "profiles": [
        {
            "slug": "python",
            "display_name": "Python",
            "description": "Everyone's profile.",
            "default": True,
            "environment": {"current": True},
            "resources": {"gpus": [0, 1]},
        },
        {
            "slug": "gpu-vision",
            "display_name": "Vision GPUs",
            "description": "For the vision team.",
            "environment": {"current": True},
            "resources": {"gpus": [1, 2]},
            "groups": ["vision"],
        },
    ]
}

CONFIG = {
    "admin_users": ["admin"],
    "users": {"unix_accounts": "off"},  # test users have no Unix accounts (see test_accounts.py)
    "groups": {"research": ["alice"], "vision": ["carol"]},
    "gpus": {"declared": [{"count": 2, "flavor": "sim"}]},
    "resources": {"cpu": 16},  # declared: several small jobs run at once on a 2-core machine
    "jobs": {"grace_period_seconds": 3, "warm_runners": 1},
}

POSTGRES_URL = env.TEST_POSTGRES_URL.get()
NO_POSTGRES = f"{env.TEST_POSTGRES_URL} is not set (.ci/run starts a PostgreSQL server)"


def cannot_run(tier: str, why: str) -> None:
    """Skip a tier that cannot run here, saying why; fail instead where it must run (``DANLU_TEST_REQUIRE``
    names it, as ``.ci/run`` does for every tier it installs what they need for)."""
    required = {t.strip() for t in (env.TEST_REQUIRE.get() or "").split(",") if t.strip()}
    if tier in required:
        pytest.fail(f"the {tier} tier cannot run, and {env.TEST_REQUIRE} requires it: {why}")
    pytest.skip(why)


def reset_postgres(url: str) -> None:
    """Drop every table, Alembic's revision table included, so danlu up creates the schema afresh."""
    from sqlalchemy import MetaData

    from danlu.hub.service.store.database import make_engine

    engine = make_engine(url)
    found = MetaData()
    found.reflect(engine)
    found.drop_all(engine)
    engine.dispose()


@pytest.fixture(scope="session", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def workbench(request, tmp_path_factory):
    config = {**CONFIG, "jobs": dict(CONFIG["jobs"])}
    if request.param == "postgres":
        if not POSTGRES_URL:
            cannot_run("postgres", NO_POSTGRES)
        reset_postgres(POSTGRES_URL)
        config["jobs"]["database_url"] = POSTGRES_URL
    wb = Workbench(tmp_path_factory.mktemp(f"wb-{request.param}"), config=config, profiles=PROFILES)
    wb.start()
    wb.tokens = {
        name: wb.create_user(name, groups)
        for name, groups in (("alice", ["research"]), ("bob", []), ("carol", ["vision"]), ("admin", []))
    }
    yield wb
    code = wb.stop()
    leftovers = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in wb.processes()]
    assert not leftovers, f"processes left after danlu up stopped: {leftovers}"
    assert code == 0, wb.log_tail()


def job_processes(job_id: str) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("DANLU_JOB_ID") == job_id and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (psutil.Error, OSError):
            continue
    return out
