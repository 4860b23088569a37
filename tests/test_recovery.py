"""Pure tests: stopping the workbench requeues every running job, whatever one of them looks like."""

from __future__ import annotations

import pytest

from danlu.hub.config import Settings
from danlu.hub.service.jobs import recovery
from danlu.hub.service.store import schema
from danlu.hub.service.store.orm import Attempt, Job, utcnow


def _job(job_id: str, state: str, backend_state, report=None) -> Job:
    job = Job(
        id=job_id,
        owner="alice",
        name=job_id,
        state=state,
        profile="python",
        queue="default",
        created_at=utcnow(),
        backend_state=backend_state,
    )
    job.attempts.append(Attempt(number=1, state="running", report=report if report is not None else {}))
    return job


@pytest.fixture
def settings(tmp_path):
    url = f"sqlite:///{tmp_path / 'danlu.sqlite'}"
    sessions = schema.prepare(url)
    with sessions() as s, s.begin():
        s.add_all(
            [
                # what a hostile or older runner could have left behind: wrong types everywhere
                _job(
                    "a00000000001",
                    "running",
                    {"pid": "1", "create_time": "x", "runner_id": 7, "uid": True},
                    report={"state": ["succeeded"], "infrastructure": "no"},
                ),
                _job("a00000000002", "running", {}),
                _job("a00000000003", "preempted", {"pid": None}),
                _job("a00000000004", "running", {}, report={"state": "succeeded", "reason": ""}),
                _job(
                    "a00000000005",
                    "running",
                    {},
                    report={"state": "failed", "reason": "cell 1 raised", "infrastructure": False},
                ),
            ]
        )
    return Settings.from_data(
        {"state_dir": str(tmp_path), "jobs": {"database_url": url, "grace_period_seconds": 0}}
    ), sessions


def test_every_running_job_is_requeued_or_keeps_the_end_its_runner_reported(settings):
    settings, sessions = settings
    requeued = recovery.interrupt_running_jobs(settings, grace=0)
    assert sorted(requeued) == ["a00000000001", "a00000000002", "a00000000003"]
    with sessions() as s:
        states = {j.id: (j.state, j.reason, j.attempts[-1].state, j.attempts[-1].token_hash) for j in s.query(Job)}
    for job_id in requeued:
        assert states[job_id][0] == "queued" and "interrupted" in states[job_id][1]
        assert states[job_id][2] == "failed"
    assert states["a00000000004"][:3] == ("succeeded", "", "succeeded")
    assert states["a00000000005"][0] == "failed" and states["a00000000005"][1].startswith("error in your code")
    assert all(state[3] == "" for state in states.values())  # no runner can report for them any more


def test_one_job_that_cannot_be_recorded_does_not_keep_the_others_running(settings, monkeypatch):
    settings, sessions = settings
    real = recovery._interrupt

    def broken(s, job_id):
        if job_id == "a00000000002":
            raise RuntimeError("a row the database refuses")
        return real(s, job_id)

    monkeypatch.setattr(recovery, "_interrupt", broken)
    requeued = recovery.interrupt_running_jobs(settings, grace=0)
    assert sorted(requeued) == ["a00000000001", "a00000000003"]
    with sessions() as s:
        assert s.get(Job, "a00000000002").state == "running"  # untouched: its transaction was rolled back
        assert s.get(Job, "a00000000004").state == "succeeded"
