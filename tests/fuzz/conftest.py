"""The fuzz tier's workbench: a real ``danlu up`` in which no job runs unless a test lets one, and a count.

``fuzz_workbench`` (one for the package) starts like the session ``workbench``
of ``tests/conftest.py`` but keeps no warm runner (so the service's processes,
files and threads change only with what a test does) and is drained through
the API right after start, so whatever the fuzzer submits stays queued. Its
principals: ``alice`` (team research), ``admin`` (an admin user) and the admin
token. The follower test starts its one job with ``run_one_job``. Every
request the fuzzing sends goes through :func:`fuzz_session`, whose count the
terminal summary reports, so the cost of the tier is visible in every run.
"""

from __future__ import annotations

import time

import pytest
import requests

from danlu.hub.testing import Workbench
from tests.conftest import CONFIG, PROFILES

FUZZ_CONFIG = {
    **CONFIG,
    "teams": {"research": {"quota": {"gpus": {"sim": 1}}}, "vision": {"quota": {"gpus": {"sim": 1}}}},
    "jobs": {"grace_period_seconds": 1, "warm_runners": 0},
}

_SENT = pytest.StashKey[dict]()


def _stats(config) -> dict:
    return config.stash.setdefault(_SENT, {"requests": 0, "seconds": 0.0})


@pytest.fixture(scope="session")
def fuzz_session(pytestconfig):
    """A requests session that counts every request the fuzz tier sends."""
    stats = _stats(pytestconfig)
    session = requests.Session()

    def count(response, *args, **kwargs):
        stats["requests"] += 1

    session.hooks["response"].append(count)
    yield session
    session.close()


@pytest.fixture(scope="package")
def fuzz_workbench(tmp_path_factory, pytestconfig):
    started = time.monotonic()
    wb = Workbench(tmp_path_factory.mktemp("wb-fuzz"), config=FUZZ_CONFIG, profiles=PROFILES)
    wb.start()
    try:
        wb.tokens = {"alice": wb.create_user("alice", ["research"]), "admin": wb.create_user("admin")}
        drain(wb, True)
    except BaseException:
        wb.stop()
        raise
    yield wb
    code = wb.stop()
    _stats(pytestconfig)["seconds"] += time.monotonic() - started
    leftovers = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in wb.processes()]
    assert not leftovers, f"processes left after danlu up stopped: {leftovers}"
    assert code == 0, wb.log_tail()
    # every answer the tier got was a decision, not a crash that tornado caught and logged
    log = (wb.state / "logs" / "jupyterhub.log").read_text(errors="replace")
    crashes = [line for line in log.splitlines() if "Uncaught exception" in line]
    assert not crashes, "\n".join(crashes[:20])


def drain(wb, on: bool) -> None:
    r = wb.api("POST", "/drain", json={"on": on})
    assert r.status_code == 200 and r.json() == {"draining": on}, r.text


@pytest.fixture
def run_one_job(fuzz_workbench):
    """Start one job in the drained workbench and drain it again: whatever else waits stays queued.

    What the fuzzing left is undone first: queued jobs are cancelled, the teams' queues are released and
    back to danlu.yaml's quotas, so the job starts (and runs on in the drained workbench)."""
    wb = fuzz_workbench

    def run(user: str, body: dict) -> str:
        for job in wb.api("GET", "/jobs?state=queued&limit=1000").json()["jobs"]:
            assert wb.api("POST", f"/jobs/{job['id']}/cancel").status_code == 200
        for queue in FUZZ_CONFIG["teams"]:
            assert wb.api("POST", f"/queues/{queue}/release").status_code == 200
            assert wb.api("DELETE", f"/queues/{queue}").status_code == 200
        r = wb.api("POST", "/jobs", token=wb.tokens[user], json=body)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        drain(wb, False)
        try:
            wb.wait_job(job_id, wb.tokens[user], states=("running", "succeeded", "failed", "cancelled", "timed_out"))
        finally:
            drain(wb, True)
        return job_id

    return run


def pytest_terminal_summary(terminalreporter, config):
    stats = config.stash.get(_SENT, None)
    if stats and stats["requests"]:
        terminalreporter.write_line(
            f"fuzz tier: {stats['requests']} requests to the jobs service, "
            f"{stats['seconds']:.0f}s with its workbench up"
        )
