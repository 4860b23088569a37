"""Service tier: teams sharing four GPUs -- quotas, borrowing, reclaim, priorities, retries, audit, usage.

One workbench with the example's shape (examples/config/shared-workstation.yaml):
four declared `sim` GPUs, teams vision (alice, carol) and nlp (bob) in one
cohort with nominal 2 and borrowing limit 2, priority classes low/normal/high.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from danlu.hub.service.validation import check_schema
from danlu.hub.testing import Workbench

from .conftest import PROFILES, job_processes

pytestmark = pytest.mark.service

CONFIG = {
    "admin_users": ["admin"],
    "users": {"unix_accounts": "off"},
    "groups": {"vision": ["alice", "carol"], "nlp": ["bob"]},
    "gpus": {"declared": [{"count": 4, "flavor": "sim"}]},
    "resources": {"cpu": 64},
    "teams": {
        "vision": {"cohort": "shared", "quota": {"gpus": {"sim": 2}}, "borrowing_limit": {"gpus": {"sim": 2}}},
        "nlp": {"cohort": "shared", "quota": {"gpus": {"sim": 2}}, "borrowing_limit": {"gpus": {"sim": 2}}},
    },
    "priority_classes": {"low": {"value": 100}, "normal": {"value": 1000, "default": True}, "high": {"value": 10000}},
    "jobs": {"grace_period_seconds": 6, "preemption_grace_seconds": 5, "retry_backoff_seconds": 1, "warm_runners": 1},
    "usage": {"gpu_hour_cost": {"sim": 2.5}, "currency": "USD"},
}
QPROFILES = {"profiles": [{**PROFILES["profiles"][0], "resources": {"gpus": [0, 1, 2, 4]}}]}

# a training loop that checkpoints every step and resumes from its checkpoint
RESUMABLE = """import json, os, time
ckpt = os.path.join(os.environ["DANLU_CHECKPOINT_DIR"], "state.json")
step = json.load(open(ckpt))["step"] + 1 if os.path.exists(ckpt) else 0
if step:
    print("resumed at step", step, flush=True)
print("devices", os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
while step < STEPS:
    time.sleep(0.5)
    json.dump({"step": step}, open(ckpt + ".tmp", "w")); os.replace(ckpt + ".tmp", ckpt)
    print("checkpointed step", step, flush=True)
    step += 1
print("done", step, flush=True)
"""


def notebook(source: str) -> dict:
    return {
        "cells": [
            {"cell_type": "code", "id": "c1", "metadata": {}, "outputs": [], "execution_count": None, "source": source}
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


@pytest.fixture(scope="module")
def wb(tmp_path_factory):
    bench = Workbench(tmp_path_factory.mktemp("queues"), config=CONFIG, profiles=QPROFILES).start()
    bench.tokens = {
        name: bench.create_user(name, groups)
        for name, groups in (("alice", ["vision"]), ("carol", ["vision"]), ("bob", ["nlp"]), ("admin", []), ("eve", []))
    }
    yield bench
    code = bench.stop()
    assert code == 0, bench.log_tail()
    assert bench.processes() == []


def submit(wb, user: str, source: str, **body) -> dict:
    r = wb.api("POST", "/jobs", token=wb.tokens[user], json={"notebook": notebook(source), **body})
    assert r.status_code == 201, r.text
    return r.json()


def job(wb, user: str, job_id: str) -> dict:
    return wb.api("GET", f"/jobs/{job_id}", token=wb.tokens[user]).json()


def wait_for(predicate, timeout=120, every=0.3, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


class DeviceWatch:
    """Samples the GPU ledger while a scenario runs: never more than the machine, never a device twice."""

    def __init__(self, wb):
        self.wb, self.samples, self.problems = wb, 0, []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                ledger = self.wb.api("GET", "/allocations", timeout=10).json()["allocations"]
                running = self.wb.api("GET", "/jobs?state=running,preempted", timeout=10).json()["jobs"]
            except (requests.RequestException, ValueError, KeyError):
                continue
            devices = [a["device"] for a in ledger]
            held = [d for j in running for d in j["devices"]]
            self.samples += 1
            if len(devices) > 4 or len(set(devices)) != len(devices):
                self.problems.append(f"ledger {devices}")
            if len(set(held)) != len(held):
                self.problems.append(f"jobs share devices {held}")
            time.sleep(0.2)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join(10)


def test_borrowing_then_reclaim_preempts_the_borrowed_job_which_resumes(wb):
    with DeviceWatch(wb) as watch:
        vision = [
            submit(wb, "alice", f"STEPS = {n}\n" + RESUMABLE, name=f"v{i}", resources={"gpus": 1})
            for i, n in enumerate((44, 48, 16))
        ]
        wait_for(lambda: all(job(wb, "alice", v["id"])["state"] == "running" for v in vision), what="3 vision jobs")
        queues = {q["name"]: q for q in wb.api("GET", "/queues", token=wb.tokens["alice"]).json()["queues"]}
        assert queues["vision"]["usage"]["gpus"] == {"sim": 3} and queues["vision"]["borrowing"] == {"sim": 1}
        newest = vision[-1]
        wait_for(
            lambda: "checkpointed step 2" in wb.api("GET", f"/jobs/{newest['id']}/logs", token=wb.tokens["alice"]).text,
            what="the newest vision job to checkpoint",
        )
        high = [
            submit(
                wb,
                "bob",
                "import time; time.sleep(3); print('nlp done')",
                name=f"h{i}",
                resources={"gpus": 1},
                priority="high",
            )
            for i in range(2)
        ]
        # the newest (borrowed) vision job is preempted for nlp's second job
        preempted = wait_for(
            lambda: (
                job(wb, "alice", newest["id"])["state"] in ("preempted", "queued") and job(wb, "alice", newest["id"])
            ),
            what="the preemption",
        )
        assert "preempted by job" in preempted["reason"]
        assert [job(wb, "alice", v["id"])["state"] for v in vision[:2]] == ["running", "running"]
        for h in high:
            assert wb.wait_job(h["id"], wb.tokens["bob"])["state"] == "succeeded"
        done = wb.wait_job(newest["id"], wb.tokens["alice"], timeout=240)
        assert done["state"] == "succeeded"
        assert [a["state"] for a in done["attempts"]] == ["preempted", "succeeded"]
        log = wb.api("GET", f"/jobs/{newest['id']}/logs", token=wb.tokens["alice"]).text
        assert "resumed at step" in log  # from its checkpoint, not from scratch
        for v in vision[:2]:
            assert wb.wait_job(v["id"], wb.tokens["alice"])["state"] == "succeeded"
    assert watch.samples > 20 and watch.problems == []
    preempt = wb.api("GET", "/audit?action=preempt").json()["records"]
    assert any(r["target"] == newest["id"] for r in preempt)


def test_fifty_concurrent_submissions_never_overshoot_the_quota(wb):
    def one(i):
        return wb.api(
            "POST",
            "/jobs",
            token=wb.tokens["carol"],
            json={
                "notebook": notebook("import time; time.sleep(1)"),
                "name": f"burst-{i}",
                "resources": {"gpus": 1},
                "priority": "low",
            },
        ).status_code

    with DeviceWatch(wb) as watch:
        with ThreadPoolExecutor(50) as pool:
            codes = list(pool.map(one, range(50)))
        assert codes == [201] * 50
        peak = 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            queues = {q["name"]: q for q in wb.api("GET", "/queues").json()["queues"]}
            used = queues["vision"]["usage"].get("gpus", {}).get("sim", 0)
            peak = max(peak, used)
            assert used <= 4, queues["vision"]
            time.sleep(0.2)
        burst = [
            j
            for j in wb.api("GET", "/jobs?owner=carol&state=queued,running").json()["jobs"]
            if j["name"].startswith("burst-")
        ]
        for j in burst:
            wb.api("POST", f"/jobs/{j['id']}/cancel", token=wb.tokens["carol"])
    assert peak >= 1 and watch.problems == []


def test_waiting_jobs_say_why_where_and_when(wb):
    full = [
        submit(wb, user, "import time; time.sleep(12)", name=f"full-{user}", resources={"gpus": 2}, timeout_seconds=60)
        for user in ("bob", "alice")
    ]
    wait_for(lambda: all(job(wb, j["owner"], j["id"])["state"] == "running" for j in full), what="4 GPUs in use")
    waiting = submit(wb, "carol", "print('finally')", name="waiter", resources={"gpus": 1})
    info = wait_for(lambda: (j := job(wb, "carol", waiting["id"]))["queue_position"] and j, what="a position")
    check_schema("Job", info)
    assert info["state"] == "queued" and info["queue_position"] == 1
    assert info["reason"] == "waiting for 1 `sim` GPU: vision uses 2/2, cohort has 0 to lend, 0 free on the machine"
    assert info["estimated_start"] is not None  # from the running jobs' limits
    dry = wb.api(
        "POST",
        "/jobs",
        token=wb.tokens["carol"],
        json={"notebook": notebook("1"), "dry_run": True, "resources": {"gpus": 1}},
    ).json()
    assert dry["admitted"] is False and dry["reason"].startswith("waiting for 1 `sim` GPU")
    assert wb.wait_job(waiting["id"], wb.tokens["carol"])["state"] == "succeeded"


def test_priority_orders_the_queue_and_preempts_within_the_team(wb):
    low = submit(wb, "alice", "import time; time.sleep(30)", name="low", resources={"gpus": 4}, priority="low")
    wait_for(lambda: job(wb, "alice", low["id"])["state"] == "running", what="the low job")
    urgent = submit(wb, "carol", "print('urgent')", name="urgent", resources={"gpus": 1}, priority="high")
    assert wb.wait_job(urgent["id"], wb.tokens["carol"])["state"] == "succeeded"
    after = job(wb, "alice", low["id"])
    assert after["attempts"][0]["state"] == "preempted"
    wb.api("POST", f"/jobs/{low['id']}/cancel", token=wb.tokens["alice"])


def test_stopped_code_gets_the_grace_period_to_save(wb):
    source = """import os, pathlib, signal, time
stop = []
signal.signal(signal.SIGTERM, lambda *args: stop.append(1))
print("ready", flush=True)
while not stop:
    time.sleep(0.1)
time.sleep(1.5)  # a slow checkpoint
pathlib.Path(os.environ["DANLU_CHECKPOINT_DIR"], "saved").write_text("ok")
print("saved on SIGTERM", flush=True)
"""
    graceful = submit(wb, "alice", source, name="graceful")
    wait_for(
        lambda: "ready" in wb.api("GET", f"/jobs/{graceful['id']}/logs", token=wb.tokens["alice"]).text,
        what="the job to run its cell",
    )
    cancelled = wb.api("POST", f"/jobs/{graceful['id']}/cancel", token=wb.tokens["alice"]).json()
    assert cancelled["state"] == "cancelled"
    assert (wb.state / "jobs" / graceful["id"] / "checkpoints" / "saved").read_text() == "ok"
    assert job_processes(graceful["id"]) == []


def test_infrastructure_failures_retry_with_backoff_user_errors_do_not(wb):
    crash = (
        "import os, pathlib\nmark = pathlib.Path(os.environ['DANLU_CHECKPOINT_DIR'], 'crashed')\n"
        "if not mark.exists():\n    mark.touch()\n    os.kill(os.getpid(), 9)\nprint('second time lucky')"
    )
    flaky = submit(wb, "alice", crash, name="flaky", retries=2)
    done = wb.wait_job(flaky["id"], wb.tokens["alice"])
    assert done["state"] == "succeeded"
    assert [(a["state"], a["failure"]) for a in done["attempts"]] == [("failed", "infrastructure"), ("succeeded", None)]
    assert "kernel died" in done["attempts"][0]["reason"]
    assert any(r["target"] == flaky["id"] for r in wb.api("GET", "/audit?action=retry").json()["records"])
    broken = submit(wb, "alice", "1 / 0", name="broken", retries=2)
    failed = wb.wait_job(broken["id"], wb.tokens["alice"])
    assert failed["state"] == "failed" and failed["failure"] == "user" and len(failed["attempts"]) == 1
    assert failed["reason"].startswith("error in your code: cell") and "ZeroDivisionError" in failed["reason"]


def test_timeout_ends_the_job_and_its_processes(wb):
    slow = submit(wb, "alice", "import time; time.sleep(120)", name="slow", timeout_seconds=4)
    done = wb.wait_job(slow["id"], wb.tokens["alice"], timeout=90)
    assert done["state"] == "timed_out" and "limit of 4 s" in done["reason"]
    assert job_processes(slow["id"]) == []


def test_hold_release_cancel_a_queued_job_and_drain(wb):
    admin, alice = wb.admin_token, wb.tokens["alice"]
    assert wb.api("POST", "/queues/vision/hold", token=admin).json()["held"] is True
    held = submit(wb, "alice", "print('released')", name="held")
    other = submit(wb, "alice", "print('never')", name="dropped")
    info = wait_for(
        lambda: (j := job(wb, "alice", held["id"]))["reason"].startswith("queue vision is held") and j,
        what="the held reason",
    )
    assert info["state"] == "queued"
    cancelled = wb.api("POST", f"/jobs/{other['id']}/cancel", token=alice).json()
    assert cancelled["state"] == "cancelled" and "while queued" in cancelled["reason"]
    wb.api("POST", "/queues/vision/release", token=admin)
    assert wb.wait_job(held["id"], alice)["state"] == "succeeded"
    assert wb.api("POST", "/drain", token=admin, json={"on": True}).json() == {"draining": True}
    drained = submit(wb, "alice", "print('after the drain')", name="drained")
    info = wait_for(
        lambda: (j := job(wb, "alice", drained["id"]))["reason"].startswith("the workbench is draining") and j,
        what="the drain reason",
    )
    assert info["state"] == "queued"
    wb.api("POST", "/drain", token=admin, json={"on": False})
    assert wb.wait_job(drained["id"], alice)["state"] == "succeeded"


def test_live_quota_change_and_reprioritize_are_audited(wb):
    admin = wb.admin_token
    r = wb.api(
        "PATCH",
        "/queues/vision",
        token=admin,
        json={"quota": {"gpus": {"sim": 1}}, "borrowing_limit": {"gpus": {"sim": 0}}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["quota"]["gpus"] == {"sim": 1}
    first = submit(wb, "alice", "import time; time.sleep(8)", name="q1", resources={"gpus": 1})
    second = submit(wb, "alice", "print('second')", name="q2", resources={"gpus": 1})
    wait_for(lambda: job(wb, "alice", first["id"])["state"] == "running", what="the first job")
    info = wait_for(lambda: (j := job(wb, "alice", second["id"]))["queue_position"] and j, what="a position")
    assert info["reason"].startswith("waiting for 1 `sim` GPU: vision uses 1/1, cohort has 0 to lend")
    bad = wb.api("PATCH", "/queues/vision", token=admin, json={"quota": {"gpus": {"a100": 1}}})
    assert bad.status_code == 422 and bad.json()["field"] == "quota.gpus.a100"
    r = wb.api("PATCH", f"/jobs/{second['id']}", token=admin, json={"priority": "high"})
    assert r.json()["priority"] == "high"
    wb.api(
        "PATCH",
        "/queues/vision",
        token=admin,
        json={"quota": {"gpus": {"sim": 2}}, "borrowing_limit": {"gpus": {"sim": 2}}},
    )
    assert wb.wait_job(second["id"], wb.tokens["alice"])["state"] == "succeeded"
    # the first job's GPU counts against vision until it ends: later tests read vision's usage
    assert wb.wait_job(first["id"], wb.tokens["alice"])["state"] == "succeeded"
    changes = wb.api("GET", "/audit?action=change_quota").json()["records"]
    assert changes[-1]["before"]["quota"] == {"gpus": {"sim": 2}} and changes[-1]["after"]["quota"] == {
        "gpus": {"sim": 1}
    }
    assert wb.api("GET", "/audit?action=reprioritize").json()["records"][0]["after"]["priority"] == "high"


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("GET", "/audit", None),
        ("GET", "/audit/verify", None),
        ("GET", "/usage?user=alice", None),
        ("GET", "/usage?by=team", None),
        ("PATCH", "/queues/vision", {"quota": {"gpus": {"sim": 4}}}),
        ("POST", "/queues/vision/hold", None),
        ("POST", "/drain", {"on": True}),
        ("GET", "/allocations", None),
    ],
)
def test_non_admins_get_403(wb, method, path, body):
    r = wb.api(method, path, token=wb.tokens["bob"], json=body)
    assert r.status_code == 403, r.text
    assert (
        requests.get(
            f"{wb.url}/services/danlu/metrics", timeout=30, headers={"Authorization": f"token {wb.tokens['bob']}"}
        ).status_code
        == 403
    )


def test_non_admin_cannot_reprioritize(wb):
    mine = submit(wb, "bob", "print(1)", name="mine")
    r = wb.api("PATCH", f"/jobs/{mine['id']}", token=wb.tokens["bob"], json={"priority": "high"})
    assert r.status_code == 403


def test_usage_per_team_with_costs_and_own_usage_for_users(wb):
    report = wb.api("GET", "/usage?by=team").json()
    check_schema("Usage", report)
    rows = {r["team"]: r for r in report["rows"]}
    assert rows["vision"]["gpu_hours"] > 0 and rows["nlp"]["gpu_hours"] > 0
    assert rows["vision"]["cost"] == pytest.approx(rows["vision"]["gpu_hours"] * 2.5, rel=1e-3)
    assert rows["vision"]["measured_utilization"] is None  # no NVML on declared GPUs
    mine = wb.api("GET", "/usage", token=wb.tokens["bob"]).json()
    assert [r["user"] for r in mine["rows"]] == ["bob"]


def test_metrics_are_exported(wb):
    text = requests.get(
        f"{wb.url}/services/danlu/metrics", headers={"Authorization": f"token {wb.admin_token}"}, timeout=30
    ).text
    for name in (
        "danlu_queue_pending",
        "danlu_jobs_admitted_total",
        "danlu_jobs_preempted_total",
        "danlu_queue_wait_seconds_bucket",
        "danlu_gpus_allocated",
        "danlu_gpu_quota",
    ):
        assert name in text, name
    assert 'danlu_jobs_preempted_total{queue="vision"}' in text


def test_a_servers_gpus_count_against_its_team(wb):
    r = wb.start_server("carol", {"profile": "python", "gpus": 2})
    assert r.status_code in (201, 202), r.text
    try:
        vision = next(q for q in wb.api("GET", "/queues").json()["queues"] if q["name"] == "vision")
        assert vision["servers"] == 1 and vision["usage"]["gpus"] == {"sim": 2}
        big = wb.api(
            "POST",
            "/jobs",
            token=wb.tokens["alice"],
            json={"notebook": notebook("1"), "resources": {"gpus": 3}, "dry_run": True},
        ).json()
        assert big["admitted"] is False and "vision uses 2/2" in big["reason"]
    finally:
        wb.hub("DELETE", "/users/carol/server")
    wait_for(
        lambda: next(q for q in wb.api("GET", "/queues").json()["queues"] if q["name"] == "vision")["servers"] == 0,
        what="the server's GPUs back",
    )


def test_logins_and_profile_changes_are_audited(wb):
    browser = requests.Session()
    browser.get(f"{wb.url}/hub/login", timeout=30)
    r = browser.post(
        f"{wb.url}/hub/login",
        data={"username": "carol", "password": "any", "_xsrf": browser.cookies.get("_xsrf")},
        timeout=30,
    )
    assert r.status_code == 200
    logins = wb.api("GET", "/audit?action=login").json()["records"]
    assert any(rec["actor"] == "carol" for rec in logins)
    profiles = wb.api("GET", "/audit?action=change_profiles").json()["records"]
    assert profiles and "python" in profiles[-1]["after"]


def forge_unkeyed_chain(db: sqlite3.Connection, seq: int, actor: str) -> None:
    """Set record ``seq``'s actor and recompute its hash and every later one as SHA-256 of the previous hash and
    the record's canonical JSON: what the chain was before it was keyed, all a database writer can compute."""
    db.execute("UPDATE audit SET actor = ? WHERE seq = ?", (actor, seq))
    prev = db.execute("SELECT hash FROM audit WHERE seq = ?", (seq - 1,)).fetchone()[0]
    rows = db.execute(
        "SELECT seq, at, actor, action, target, before, after FROM audit WHERE seq >= ? ORDER BY seq", (seq,)
    ).fetchall()
    for number, at, who, action, target, before, after in rows:
        body = {
            "seq": number,
            "at": at.replace(" ", "T") + "Z",
            "actor": who,
            "action": action,
            "target": target,
            "before": json.loads(before),
            "after": json.loads(after),
        }
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
        digest = hashlib.sha256(f"{prev}\n{text}".encode()).hexdigest()
        db.execute("UPDATE audit SET prev_hash = ?, hash = ? WHERE seq = ?", (prev, digest, number))
        prev = digest


def test_audit_chain_verifies_and_detects_tampering(wb):
    assert wb.api("GET", "/audit/verify").json()["ok"] is True
    db = sqlite3.connect(wb.state / "danlu.sqlite")
    try:
        original = db.execute("SELECT actor FROM audit WHERE seq = 2").fetchone()[0]
        with db:
            db.execute("UPDATE audit SET actor = 'mallory' WHERE seq = 2")
        result = wb.api("GET", "/audit/verify").json()
        assert result == {"ok": False, "records": 2, "problem": "record 2 was altered", "seq": 2}
        with db:
            db.execute("UPDATE audit SET actor = ? WHERE seq = 2", (original,))
        assert wb.api("GET", "/audit/verify").json()["ok"] is True
        kept = db.execute("SELECT seq, actor, prev_hash, hash FROM audit WHERE seq >= 2").fetchall()
        with db:  # Mallory holds the database only: she rewrites record 2 and recomputes the chain after it
            forge_unkeyed_chain(db, 2, actor="mallory")
        result = wb.api("GET", "/audit/verify").json()
        assert result == {"ok": False, "records": 2, "problem": "record 2 was altered", "seq": 2}
        with db:
            db.executemany(
                "UPDATE audit SET actor = ?, prev_hash = ?, hash = ? WHERE seq = ?", [r[1:] + r[:1] for r in kept]
            )
        assert wb.api("GET", "/audit/verify").json()["ok"] is True
        with db:
            db.execute("DELETE FROM audit WHERE seq = 3")
        assert wb.api("GET", "/audit/verify").json()["problem"] == "record 3 is missing (next is 4)"
    finally:
        db.close()
