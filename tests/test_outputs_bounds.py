"""Stored outputs within bounds: a user's handed-over notebooks are bounded in total, ended jobs' go first (and
only that user's), running jobs' are never pruned (the upload is refused instead), old ones are pruned by age,
a pruned output answers 410 and the job's view says so, and the totals survive a restart.

Unit tier on the manager with a fake backend (jobs as rows); then the hostile user through the HTTP runner
API of a running workbench: a job's own code uploads with its attempt's token. Last, the runner's side: a
refused upload is reported in the job's log at once, not retried, not a crash.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import http.server
import json
import re
import threading
import time

import pytest

from danlu.errors import DanluError
from danlu.hub.service.jobs.outputs import OutputStore
from danlu.hub.service.store.orm import AuditRecord, Job, utcnow
from danlu.hub.testing import Workbench
from danlu.runner.link import LaunchMessage, ServiceLink

from .conftest import CONFIG, PROFILES
from .fakes import FakeBackend, admin, make_manager
from .test_api_input import NB, body

NOW = utcnow()
KIB = 1024


def row(n: int, owner: str, state: str = "succeeded", ended_days_ago: float | None = 1.0) -> Job:
    ended = NOW - dt.timedelta(days=ended_days_ago) if ended_days_ago is not None else None
    return Job(id=f"{n:012x}", owner=owner, name=f"job{n}", state=state, profile="python", finished_at=ended)


def jid(n: int) -> str:
    return f"{n:012x}"


def notebook(size: int) -> bytes:
    head = b'{"cells": [], "metadata": {"pad": "'
    return head + b"x" * (size - len(head) - 3) + b'"}}'


@pytest.fixture
def manager(tmp_path):
    m = make_manager(FakeBackend(), tmp_path / "state")
    with m.database.sessions() as s:
        s.add_all(
            [
                row(1, "alice", ended_days_ago=3),  # alice's oldest ended job
                row(2, "alice", "failed", ended_days_ago=2),
                row(3, "alice", "running", ended_days_ago=None),
                row(4, "bob", ended_days_ago=10),  # older than all of alice's: never hers to prune
                row(5, "alice", "running", ended_days_ago=None),
            ]
        )
        s.commit()
    m.runner_api.outputs.bound(per_user_bytes=100 * KIB, max_age_days=30)
    return m


def audit_of(manager, action: str) -> list[AuditRecord]:
    with manager.database.sessions() as s:
        return [(r.target, r.actor, r.after) for r in s.query(AuditRecord).filter_by(action=action).order_by("seq")]


def test_uploads_beyond_the_bound_prune_the_users_oldest_ended_jobs_only(manager):
    store = manager.runner_api.outputs

    async def go():
        await store.keep(jid(1), "alice", 0, notebook(40 * KIB))
        await store.keep(jid(2), "alice", 0, notebook(40 * KIB))
        await store.keep(jid(4), "bob", 0, notebook(90 * KIB))
        assert store.used("alice") == 80 * KIB and store.used("bob") == 90 * KIB
        await store.keep(jid(3), "alice", 0, notebook(30 * KIB))  # 110 KiB: job 1 (ended first) goes
        assert store.used("alice") == 70 * KIB and store.used("bob") == 90 * KIB
        job1, job2, job4 = [await manager.get(admin(), jid(n)) for n in (1, 2, 4)]
        with pytest.raises(DanluError) as gone:
            await manager.read_output(job1, 0, 0, 100)
        assert (await manager.read_output(job2, 0, 0, 10))[1] == 40 * KIB
        assert (await manager.read_output(job4, 0, 0, 10))[1] == 90 * KIB  # bob's, though older, stays
        return gone.value, await manager.job_dict(jid(1)), await manager.job_dict(jid(2))

    gone, view1, view2 = asyncio.run(go())
    assert gone.status == 410 and gone.reason == "output_pruned", gone
    assert "pruned" in gone.message and "bound" in gone.message and "outputs_per_user_bytes" in gone.fix
    assert view1["outputs_pruned"]["bytes"] == 40 * KIB and "alice's bound" in view1["outputs_pruned"]["why"]
    assert view2["outputs_pruned"] is None
    assert [(t, a) for t, a, _ in audit_of(manager, "prune_outputs")] == [(jid(1), "danlu")]


def test_a_running_jobs_upload_beyond_the_bound_is_refused_and_prunes_nothing(manager):
    store = manager.runner_api.outputs

    async def go():
        await store.keep(jid(1), "alice", 0, notebook(20 * KIB))
        await store.keep(jid(3), "alice", 0, notebook(60 * KIB))  # running
        with pytest.raises(DanluError) as refused:
            await store.keep(jid(5), "alice", 0, notebook(50 * KIB))  # even without job 1's: 110 KiB
        await store.keep(jid(3), "alice", 0, notebook(70 * KIB))  # a rank replaced counts once
        return refused.value

    refused = asyncio.run(go())
    assert refused.status == 413 and refused.reason == "outputs_bound", refused
    assert "100.0 KiB" in refused.message and "outputs_per_user_bytes" in refused.message
    assert "outputs_per_user_bytes" in refused.fix and "home" in refused.fix
    assert store.used("alice") == 90 * KIB and not audit_of(manager, "prune_outputs")
    assert not (store.state_dir / "outputs" / jid(5)).exists()


def test_old_ended_outputs_are_pruned_by_age_and_answer_410(manager):
    store = manager.runner_api.outputs
    store.bound(per_user_bytes=100 * KIB, max_age_days=2.5)

    async def go():
        for n, owner in ((1, "alice"), (2, "alice"), (3, "alice"), (4, "bob")):
            await store.keep(jid(n), owner, 0, notebook(10 * KIB))
        pruned = await store.prune_old()
        job = await manager.get(admin(), jid(4))
        with pytest.raises(DanluError) as gone:
            await manager.read_output(job, 0, 0, 100)
        return pruned, gone.value

    pruned, gone = asyncio.run(go())
    assert sorted(pruned) == [jid(1), jid(4)]  # ended 3 and 10 days ago; job 2 ended 2 days ago, job 3 runs
    assert gone.status == 410 and "ended more than 2.5 days ago" in gone.message
    assert store.used("alice") == 20 * KIB and store.used("bob") == 0
    assert {t for t, _, _ in audit_of(manager, "prune_outputs")} == {jid(1), jid(4)}


def test_a_restart_rebuilds_the_totals_from_the_files(manager):
    store = manager.runner_api.outputs

    async def before():
        await store.keep(jid(2), "alice", 0, notebook(30 * KIB))
        await store.keep(jid(3), "alice", 0, notebook(30 * KIB))
        await store.keep(jid(4), "bob", 0, notebook(5 * KIB))

    asyncio.run(before())
    again = OutputStore(store.state_dir, manager.database)
    again.bound(per_user_bytes=100 * KIB, max_age_days=30)

    async def after():
        await again.rebuild()
        used = again.used("alice"), again.used("bob")
        await again.keep(jid(5), "alice", 0, notebook(50 * KIB))  # 110 KiB: job 2 (ended) goes
        return used

    assert asyncio.run(after()) == (60 * KIB, 5 * KIB)
    assert again.used("alice") == 80 * KIB and [t for t, _, _ in audit_of(manager, "prune_outputs")] == [jid(2)]


# the hostile user, through the runner API of a running workbench ----------------------------------------------

UPLOAD = """
import json, os, urllib.request, urllib.error
names = ("DANLU_RUNNER_API", "DANLU_JOB_ID", "DANLU_ATTEMPT", "DANLU_JOB_TOKEN")
api, job, attempt, token = (os.environ[k] for k in names)
for size in SIZES:
    nb = json.dumps({"cells": [], "metadata": {"pad": "x" * size}}).encode()
    url = f"{api}/runner/jobs/{job}/attempts/{attempt}/outputs/0"
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    try:
        urllib.request.urlopen(urllib.request.Request(url, data=nb, method="PUT", headers=headers), timeout=60)
        print("S" "EEN 200 END")  # split: the cell's source is in the output too
    except urllib.error.HTTPError as e:
        error = json.loads(e.read())
        named = "outputs_per_user_bytes" in error["message"] and bool(error.get("fix"))
        print("S" f"EEN {e.code} {error['reason']} {'named' if named else 'unnamed'} END")
"""


@pytest.mark.service
def test_a_jobs_uploads_are_bounded_through_the_runner_api(tmp_path):
    (tmp_path / "danlu_service_config.py").write_text("c.JobsServiceApp.outputs_per_user_bytes = 300000\n")
    wb = Workbench(tmp_path, config={**CONFIG, "jobs": dict(CONFIG["jobs"])}, profiles=PROFILES)
    wb.start()
    try:
        alice = wb.create_user("alice", [])

        def run(*sizes: int) -> tuple[dict, list[list[str]]]:
            nb = copy.deepcopy(NB)
            nb["cells"][0]["source"] = UPLOAD.replace("SIZES", repr(sizes))
            r = wb.api("POST", "/jobs", token=alice, json=body(notebook=nb, name="upload", parameters={}))
            assert r.status_code == 201, r.text
            job = wb.wait_job(r.json()["id"], alice, timeout=240)
            text = wb.api("GET", f"/jobs/{job['id']}/output", token=alice).text
            return job, [found.split() for found in re.findall(r"SEEN (.*?) END", text)]

        first, seen = run(200_000)
        assert seen == [["200"]] and first["outputs_pruned"] is None, seen
        # beyond 300000 with the first's: the first (ended) is pruned; then, with its own 200000 replaced, beyond
        # by itself: refused (its own outputs are a running job's), and the job goes on
        second, seen = run(200_000, 400_000)
        assert seen == [["200"], ["413", "outputs_bound", "named"]], seen
        assert second["state"] == "succeeded" and second["outputs_pruned"] is None
        view = wb.api("GET", f"/jobs/{first['id']}", token=alice).json()
        assert view["outputs_pruned"] and "bound" in view["outputs_pruned"]["why"], view
    finally:
        assert wb.stop() == 0, wb.log_tail()


def test_the_runner_reports_a_refused_upload_in_the_jobs_log_at_once(capsys):
    """A 413 is the runner's to report, not to retry (a 5xx such as 507 would be retried for two minutes)."""
    answer = json.dumps({"message": "over the bound (outputs_per_user_bytes)", "reason": "outputs_bound"})
    calls = []

    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):
            calls.append(self.path)
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(413)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(answer.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api = f"http://127.0.0.1:{server.server_port}/api"
        link = ServiceLink(LaunchMessage("0123456789ab", 1, api, "t" * 43, "/tmp"))
        started = time.monotonic()
        assert link.upload_output(0, b'{"cells": []}') is False
    finally:
        server.shutdown()
    assert len(calls) == 1 and time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert "could not hand rank 0's notebook" in err and "outputs_per_user_bytes" in err, err


def test_a_runner_report_refused_for_its_rate_waits_and_arrives():
    """The attempt's runner API rate is shared with the job's code: a report refused with 429 (the code used
    the rate up) is sent again after Retry-After, not dropped as a 4xx that ends the attempt would be."""
    calls = []

    class Busy(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            calls.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            busy = len(calls) == 1
            answer = {"reason": "too_many_requests", "message": "too often"} if busy else {"recorded": "finished"}
            self.send_response(429 if busy else 200)
            self.send_header("Content-Type", "application/json")
            if busy:
                self.send_header("Retry-After", "1")
            self.end_headers()
            self.wfile.write(json.dumps(answer).encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        link = ServiceLink(
            LaunchMessage("0123456789ab", 1, f"http://127.0.0.1:{server.server_port}/api", "t" * 43, "/tmp")
        )
        assert link.report({"event": "finished", "state": "succeeded"}, patience=30) is True
    finally:
        server.shutdown()
    assert [c["event"] for c in calls] == ["finished", "finished"]
