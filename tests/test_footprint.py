"""Service tier: an idle workbench runs one process per component, and what users start goes again when idle.

A real ``danlu up`` with short idle times: warm runners are reaped 30 s after their last demand
(longer than a server takes to start here, so the test sees the one a start asks for) and servers
are culled after 45 s without activity. What each process costs in memory is measured
by ``benchmarks/footprint.py``, not here; this module checks which processes exist, so the
savings cannot quietly come undone (MLflow's launcher and job-execution workers, a culler
process, runners nobody asked for).
"""

from __future__ import annotations

import time

import pytest

from danlu.hub.testing import Workbench
from tests.conftest import PROFILES

pytestmark = pytest.mark.service

CONFIG = {
    "admin_users": ["admin"],
    "users": {"unix_accounts": "off"},
    "hub": {"idle_timeout_seconds": 45},
    "jobs": {"warm_runners": 1, "warm_idle_seconds": 30},
}


@pytest.fixture(scope="module")
def wb(tmp_path_factory):
    bench = Workbench(tmp_path_factory.mktemp("footprint"), config=CONFIG, profiles=PROFILES)
    bench.start()
    bench.tokens = {"alice": bench.create_user("alice")}
    yield bench
    assert bench.stop() == 0, bench.log_tail()


def commands(wb) -> list[str]:
    return [" ".join(p.cmdline()) for p in wb.processes()]


def eventually(what: str, ok, deadline: float = 120):
    end = time.monotonic() + deadline
    while not ok():
        assert time.monotonic() < end, f"{what} after {deadline}s"
        time.sleep(0.5)


def test_an_idle_workbench_runs_one_process_per_component_and_no_runner(wb):
    running = commands(wb)
    mlflow = [c for c in running if "mlflow" in c and "gateway" not in c]
    assert len(mlflow) == 1 and "uvicorn" in mlflow[0], mlflow  # the server itself: no launcher waiting on it
    assert not [c for c in running if "huey" in c or "_job_runner" in c], running  # no MLflow job execution
    assert not [c for c in running if "danlu.runner" in c or "ipykernel" in c], running  # nobody asked for one
    assert not [c for c in running if "idle_culler" in c], running  # the jobs service culls
    for part in ("danlu.hub.hubmain", "configurable-http-proxy", "danlu.hub.service", "danlu.hub.mlflow_gateway"):
        assert sum(part in c for c in running) == 1, (part, running)


def test_a_server_start_warms_a_runner_that_goes_when_unused_and_the_idle_server_is_stopped(wb):
    def warm_runners():
        return [c for c in commands(wb) if "danlu.runner --warm" in c]

    r = wb.start_server("alice", {"profile": "python", "gpus": 0})
    assert r.status_code in (201, 202), r.text
    eventually("no warm runner after alice's server started", lambda: warm_runners())
    eventually("the unused warm runner was not reaped", lambda: not warm_runners())

    def stopped():
        return not wb.hub("GET", "/users/alice").json().get("servers")

    eventually("alice's idle server was not stopped", stopped)
