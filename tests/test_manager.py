"""The jobs service's manager, in process, on fake backends (tests/fakes.py): no processes, no HTTP.

Through its public methods -- submit, get, list, cancel, reprioritize, queues, the runner API
(``reports``), recover -- what a job's record says after each way an attempt can go: success, an
error in the user's code, infrastructure failures and their retries, a start that raises, cancels,
preemption, hostile and invalid reports, a restart of the service. Then :func:`next_state` alone, as
a table.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import functools
import json
import os
import time
from pathlib import Path

import pytest

from danlu.errors import Conflict, Forbidden, NotFound, UsageError, ValidationError
from danlu.hub.service.jobs import supervisor
from danlu.hub.service.states import Ending, JobState, next_state
from danlu.hub.service.store import listing
from danlu.hub.service.store.orm import Job, utcnow

from .fakes import (
    UNUSED_API,
    CrashingBackend,
    FailingBackend,
    FailsAfterLaunchBackend,
    FakeBackend,
    FakeGroups,
    GatedBackend,
    HostileBackend,
    InstantBackend,
    NeverStartsBackend,
    SlowBackend,
    UserErrorBackend,
    admin,
    final,
    make_manager,
    make_settings,
    notebook,
    serving,
    state_of,
    until,
    user,
)

ALICE = user("alice", "research")
BOB = user("bob")
ADMIN = admin()


def in_loop(test):
    """Run an ``async def`` test in a fresh event loop (pytest-asyncio is not a dependency)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


async def bounded(awaitable, patience: float = 30.0):
    """``await awaitable``, failing instead of hanging (a bound, not a measurement)."""
    return await asyncio.wait_for(awaitable, patience)


def job(*sources: str, **fields) -> dict:
    return {"notebook": notebook(*(sources or ("print('hello')",))), **fields}


@contextlib.asynccontextmanager
async def service(backend: FakeBackend, tmp_path: Path, **settings):
    """A manager on ``backend`` serving, for one test; afterwards no fake runner may have crashed."""
    state = tmp_path / "state"
    manager = make_manager(backend, state, settings=make_settings(state, **settings))
    async with serving(manager):
        yield manager
    await backend.machine.kill_all()
    assert backend.machine.errors() == []


async def submit(manager, who=ALICE, **fields) -> str:
    status, body = await manager.submit(who, job(**fields))
    assert status == 201, body
    return body["id"]


async def attempt_rows(manager, job_id: str) -> list[dict]:
    """What the database holds about the job's attempts (reports and token hashes included)."""

    def query(s):
        return [
            {
                "number": a.number,
                "state": a.state,
                "report": dict(a.report or {}),
                "token_hash": a.token_hash,
                "stop_reason": a.stop_reason,
            }
            for a in s.get(Job, job_id).attempts
        ]

    return await manager.database.write(query)


async def allocations(manager) -> list[dict]:
    return (await manager.allocations(ADMIN))["allocations"]


# how attempts end ----------------------------------------------------------------------------------------
@in_loop
async def test_a_job_that_succeeds_is_recorded_and_its_log_and_output_are_served(tmp_path):
    backend = InstantBackend()
    async with service(backend, tmp_path) as manager:
        job_id = await submit(manager, name="greeting", resources={"gpus": 1})
        done = await final(manager, job_id)
        row = await manager.get(ALICE, job_id)
        log, size = await manager.read_log(row, 0, 1 << 20)
        output, _ = await manager.read_output(row, 0, 0, 1 << 20)
        assert await allocations(manager) == []
        [launch] = backend.launches
        with pytest.raises(Forbidden):  # an ended attempt's token no longer works
            await manager.runner_api.spec(job_id, 1, launch.token)

    assert done["state"] == "succeeded" and done["failure"] is None and done["reason"] == ""
    assert [(a["state"], a["exit_code"], a["devices"]) for a in done["attempts"]] == [("succeeded", 0, [0])]
    assert log == f"danlu: job {job_id} attempt 1: profile python\n".encode() and size == len(log)
    assert json.loads(output)["cells"][0]["outputs"][0]["text"] == "ran greeting\n"
    assert (launch.job_id, launch.attempt, launch.owner, launch.kernel_name, launch.devices, launch.api_url) == (
        job_id,
        1,
        "alice",
        "danlu-python",
        (0,),
        UNUSED_API,
    )
    assert launch.token and launch.token not in repr(launch)


@in_loop
async def test_an_error_in_the_users_code_fails_the_job_without_a_retry(tmp_path):
    backend = UserErrorBackend()
    async with service(backend, tmp_path) as manager:
        done = await final(manager, await submit(manager, retries=3))

    assert (done["state"], done["failure"]) == ("failed", "user")
    assert done["reason"] == "error in your code: cell 1 raised ZeroDivisionError: division by zero"
    assert [(a["state"], a["failure"], a["exit_code"]) for a in done["attempts"]] == [("failed", "user", 1)]
    assert len(backend.launches) == 1


@in_loop
async def test_infrastructure_failures_retry_with_doubling_backoff_then_fail_the_job(tmp_path):
    backend = CrashingBackend()
    async with service(backend, tmp_path, jobs={"retry_backoff_seconds": 0.01}) as manager:
        job_id = await submit(manager, retries=2)
        done = await final(manager, job_id)
        retries = await manager.audit.records(ADMIN, limit=10, action="retry", target=job_id)

    assert (done["state"], done["failure"]) == ("failed", "infrastructure")
    assert done["reason"] == "infrastructure failure: the job runner ended without reporting (killed by signal 9)"
    assert [(a["number"], a["state"], a["failure"]) for a in done["attempts"]] == [
        (1, "failed", "infrastructure"),
        (2, "failed", "infrastructure"),
        (3, "failed", "infrastructure"),
    ]
    assert sorted((r["after"]["retry"], r["after"]["after_seconds"]) for r in retries) == [(1, 0.01), (2, 0.02)]


@in_loop
async def test_a_retry_after_an_infrastructure_failure_can_succeed(tmp_path):
    async with service(CrashingBackend(crashes=1), tmp_path) as manager:
        done = await final(manager, await submit(manager, retries=1))

    assert done["state"] == "succeeded" and done["failure"] is None
    assert [(a["state"], a["failure"]) for a in done["attempts"]] == [("failed", "infrastructure"), ("succeeded", None)]


@in_loop
async def test_a_start_that_raises_fails_the_job_could_not_start_and_frees_its_gpus(tmp_path):
    backend = FailingBackend()
    async with service(backend, tmp_path) as manager:
        first = await final(manager, await submit(manager, resources={"gpus": 2}))
        second = await final(manager, await submit(manager, resources={"gpus": 2}))
        assert await allocations(manager) == []
        [queue] = await manager.queues.list()

    for done in (first, second):  # the second could start only because the first gave its GPUs back
        assert (done["state"], done["failure"]) == ("failed", "infrastructure")
        assert done["reason"] == "infrastructure failure: could not start: the fake cluster refuses to run anything"
    assert len(backend.launches) == 2
    assert queue["usage"] == {} and queue["running"] == 0


@in_loop
async def test_a_job_whose_start_never_returns_can_be_cancelled(tmp_path):
    backend = NeverStartsBackend()
    async with service(backend, tmp_path) as manager:
        submitting = asyncio.ensure_future(manager.submit(ALICE, job(resources={"gpus": 2})))
        launch = await bounded(backend.starting.get())
        cancelled = await manager.cancel(ALICE, launch.job_id)
        status, _ = await bounded(submitting)
        assert await allocations(manager) == []

    assert status == 201
    assert (cancelled["state"], cancelled["reason"]) == ("cancelled", "cancelled by alice")
    assert set(backend.cancels) == {(launch.job_id, "cancelled")}


@in_loop
async def test_a_start_that_never_returns_does_not_hold_up_submit(tmp_path):
    backend = NeverStartsBackend()
    manager = make_manager(backend, tmp_path / "state")
    await manager.recover()  # no admission loop: submit's own pass admits the job
    submitting = asyncio.ensure_future(manager.submit(ALICE, job()))
    launch = await bounded(backend.starting.get())
    # a bound on a hang, not a measurement: the submission is recorded and only the start is pending
    await asyncio.wait({submitting}, timeout=10)
    answered = submitting.done()
    await manager.cancel(ALICE, launch.job_id)
    await bounded(submitting)
    await manager.stop()
    assert answered, "submit did not answer while the backend was still starting the job"


@in_loop
async def test_a_start_that_raises_after_launching_leaves_nothing_running(tmp_path):
    backend = FailsAfterLaunchBackend()
    async with service(backend, tmp_path) as manager:
        job_id = await submit(manager, resources={"gpus": 2})
        done = await final(manager, job_id)
        left = backend.machine.alive(job_id)
        assert await allocations(manager) == []

    assert (done["state"], done["failure"]) == ("failed", "infrastructure")
    assert left == [], "the job is failed and its GPUs are given to others, but its runner still runs on them"
    assert (job_id, "cancelled") in backend.cancels and job_id in backend.cleanups


@in_loop
async def test_a_start_that_raises_after_launching_says_it_could_not_start(tmp_path):
    async with service(FailsAfterLaunchBackend(), tmp_path) as manager:
        done = await final(manager, await submit(manager))

    assert done["reason"] == "infrastructure failure: could not start: the cluster's API timed out"


# what a submission waits for --------------------------------------------------------------------------------
class GatedUsers:
    """MLflow's user store as MlflowAccess sees it (``MlflowUsers``): making a user waits for :attr:`gate`;
    no experiment exists yet, so every one is writable."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.made: list[str] = []
        self.checked: list[tuple[str, str]] = []

    async def ensure_user(self, name, admin=None):
        await self.gate.wait()
        self.made.append(name)

    async def check_experiment(self, name, owner, admin, user_exists):
        self.checked.append((owner, name))


def gated_mlflow() -> tuple:
    from danlu.hub.service.mlflow_client import MlflowAccess

    access = MlflowAccess("http://127.0.0.1:1", "secret")
    access.users = GatedUsers()
    return access, access.users


@in_loop
async def test_a_first_submission_does_not_wait_for_mlflow_to_make_its_owner_a_user(tmp_path):
    backend = InstantBackend()
    mlflow, users = gated_mlflow()
    manager = make_manager(backend, tmp_path / "state", mlflow=mlflow)
    async with serving(manager):
        status, answer = await bounded(manager.submit(ALICE, job(source={"notebook_path": "work/mnist.ipynb"})))
        started_before = list(backend.launches)
        await manager.warm(user("carol", "vision"), {})  # carol's server started: hers is begun now
        users.gate.set()  # MLflow answers: the job's start, which waited for alice to be its user, goes on
        done = await final(manager, answer["id"])
        await until(lambda: "carol" in users.made, "carol to be made an MLflow user")

    assert status == 201 and started_before == [] and done["state"] == "succeeded"
    assert users.checked == [("alice", "alice/mnist")] and sorted(users.made) == ["alice", "carol"]


class GatedGroups(FakeGroups):
    """The hub's directory, answering only once :attr:`gate` is set."""

    def __init__(self):
        super().__init__()
        self.gate = asyncio.Event()

    async def groups_of(self, username, fallback=()):
        await self.gate.wait()
        return await super().groups_of(username, fallback)


@in_loop
async def test_a_submission_asks_the_hub_and_mlflow_at_once_and_refuses_in_the_usual_order(tmp_path):
    mlflow, users = gated_mlflow()
    users.gate.set()
    groups = GatedGroups()
    manager = make_manager(InstantBackend(), tmp_path / "state", mlflow=mlflow, groups=groups)
    async with serving(manager):
        submitting = asyncio.ensure_future(manager.submit(ALICE, job()))
        await until(lambda: users.checked, "MLflow to be asked about the experiment")
        asked_before_groups = not submitting.done()
        groups.gate.set()
        status, _ = await bounded(submitting)
        with pytest.raises(ValidationError) as bad_notebook:  # the notebook first, whatever else is wrong
            await manager.submit(ALICE, {"notebook": {"nbformat": 3}, "profile": "nope"})
        with pytest.raises(NotFound) as bad_profile:  # then the profile, although MLflow was asked meanwhile
            await manager.submit(ALICE, job(profile="nope", experiment="alice/refused"))

    assert asked_before_groups and status == 201
    assert bad_notebook.value.field == "notebook" and bad_profile.value.field == "profile"


@in_loop
async def test_notebooks_are_checked_off_the_event_loop_two_at_a_time(tmp_path, monkeypatch):
    import threading

    from danlu.hub.service import validation
    from danlu.hub.service.jobs import submission

    check, gate, lock = validation.check_notebook, threading.Event(), threading.Lock()
    seen = {"threads": set(), "now": 0, "most": 0}

    def slow_check(nb):  # a large notebook's check, as long as the test wants
        with lock:
            seen["threads"].add(threading.current_thread().name)
            seen["now"] += 1
            seen["most"] = max(seen["most"], seen["now"])
        gate.wait(30)
        with lock:
            seen["now"] -= 1
        return check(nb)

    monkeypatch.setattr(validation, "check_notebook", slow_check)
    async with service(InstantBackend(), tmp_path) as manager:
        submitting = [asyncio.ensure_future(manager.submit(ALICE, job())) for _ in range(3)]
        await until(lambda: seen["now"] == submission.NOTEBOOK_CHECKS, "two checks to be under way")
        listed = json.loads(await bounded(manager.page_json(ALICE)))  # the loop answers meanwhile
        gate.set()
        answers = await bounded(asyncio.gather(*submitting))

    assert listed == {"jobs": [], "next_cursor": None} and [status for status, _ in answers] == [201] * 3
    assert seen["most"] == submission.NOTEBOOK_CHECKS and threading.current_thread().name not in seen["threads"]
    assert all(name.startswith("danlu-notebook") for name in seen["threads"])


# cancels and preemption -----------------------------------------------------------------------------------
def track(manager, *names: str) -> list[tuple[str, str]]:
    """(method, job id) each time one of the supervisor's ``names`` (start, stop, cancel) returns."""
    finished: list[tuple[str, str]] = []
    for name in names:
        original = getattr(manager.supervisor, name)

        async def tracked(first, *args, _name=name, _original=original, **kwargs):
            try:
                return await _original(first, *args, **kwargs)
            finally:
                finished.append((_name, first["id"] if isinstance(first, dict) else first))

        setattr(manager.supervisor, name, tracked)
    return finished


@in_loop
async def test_a_job_cancelled_while_it_is_starting_leaves_no_runner(tmp_path):
    backend = GatedBackend()
    async with service(backend, tmp_path) as manager:
        finished = track(manager, "start")
        job_id = await submit(manager, resources={"gpus": 2})
        cancelling = asyncio.ensure_future(manager.cancel(ALICE, job_id))  # "oops": at once
        await until(
            lambda: manager.audit.records(ADMIN, limit=1, action="cancel", target=job_id), "the cancel to be under way"
        )
        backend.start_gate.set()
        run = await backend.machine.running(job_id)
        await until(lambda: ("start", job_id) in finished, "the start to end")
        backend.cancel_gate.set()
        cancelled = await bounded(cancelling)
        left = backend.machine.alive(job_id)
        await backend.machine.kill_all()

    assert cancelled["state"] == "cancelled"
    assert run.signalled.is_set() and left == [], "a cancelled job's runner runs on, on GPUs given back"


@in_loop
async def test_a_job_preempted_while_it_is_starting_is_stopped_once_started(tmp_path):
    backend = GatedBackend()
    async with service(backend, tmp_path) as manager:
        finished = track(manager, "start", "stop")
        victim = await submit(manager, resources={"gpus": 2})
        await submit(manager, priority="urgent", resources={"gpus": 2})  # its pass preempts the victim
        backend.start_gate.set()
        run = await backend.machine.running(victim)
        await until(lambda: ("start", victim) in finished, "the victim's start to end")
        backend.cancel_gate.set()
        await until(lambda: ("stop", victim) in finished, "the preemption to be carried out")
        signalled = run.signalled.is_set()
        await backend.machine.kill_all()

    assert signalled, "the preempted job's runner was never told to stop"


@in_loop
async def test_cancel_while_queued_ends_the_job_before_it_ever_runs(tmp_path):
    backend = SlowBackend()
    async with service(backend, tmp_path) as manager:
        holder = await submit(manager, resources={"gpus": 2})
        await backend.machine.running(holder)
        waiting = await submit(manager, resources={"gpus": 2})
        assert (await manager.job_dict(waiting))["state"] == "queued"
        cancelled = await manager.cancel(ALICE, waiting)
        backend.finish(holder)
        assert (await final(manager, holder))["state"] == "succeeded"
        with pytest.raises(Conflict):
            await manager.cancel(ALICE, waiting)
        assert (await manager.audit.records(ADMIN, limit=5, action="cancel", target=waiting))[0]["actor"] == "alice"

    assert (cancelled["state"], cancelled["reason"]) == ("cancelled", "cancelled by alice while queued")
    assert cancelled["attempts"] == []
    assert [launch.job_id for launch in backend.launches] == [holder]


@in_loop
async def test_cancel_while_running_stops_the_runner_with_the_reason_cancelled(tmp_path):
    backend = SlowBackend()
    async with service(backend, tmp_path) as manager:
        job_id = await submit(manager, resources={"gpus": 1})
        run = await backend.machine.running(job_id)
        with pytest.raises(NotFound):  # someone else's job does not exist for them
            await manager.cancel(BOB, job_id)
        cancelled = await manager.cancel(ALICE, job_id)
        assert await allocations(manager) == []
        rows = await attempt_rows(manager, job_id)

    assert (cancelled["state"], cancelled["reason"]) == ("cancelled", "cancelled by alice")
    assert [(a["state"], a["reason"]) for a in cancelled["attempts"]] == [("cancelled", "cancelled by alice")]
    assert backend.cancels == [(job_id, "cancelled")] and set(backend.cleanups) == {job_id}
    assert run.stop == {"reason": "cancelled", "grace": 2.0, "save": 0}
    assert ("finished cancelled", 200) in run.answers
    assert rows[0]["stop_reason"] == "cancelled" and rows[0]["report"]["state"] == "cancelled"
    assert backend.machine.alive() == []


@in_loop
async def test_preemption_stops_the_victim_which_goes_back_to_the_queue_and_runs_again(tmp_path):
    backend = SlowBackend()
    async with service(backend, tmp_path) as manager:
        victim = await submit(manager, resources={"gpus": 2})
        first = await backend.machine.running(victim)
        urgent = await submit(manager, priority="urgent", resources={"gpus": 2})
        await backend.machine.running(urgent)
        requeued = await manager.job_dict(victim)
        backend.finish(urgent)
        second = await backend.machine.running(victim, attempt=2)
        backend.finish(victim)
        done = await final(manager, victim)
        preempts = await manager.audit.records(ADMIN, limit=5, action="preempt", target=victim)

    assert (victim, "preempted") in backend.cancels
    assert (
        first.stop == {"reason": "preempted", "grace": 2.0, "save": 0} and ("finished preempted", 200) in first.answers
    )
    assert requeued["state"] == "queued"
    [attempt] = requeued["attempts"]
    assert (attempt["state"], attempt["failure"]) == ("preempted", None)
    assert attempt["reason"].startswith(f"preempted by job {urgent} of alice (default, priority urgent); back in")
    assert preempts[0]["after"]["by"] == urgent
    assert second.spec["attempt"] == 2
    assert done["state"] == "succeeded" and done["retries"] == 0
    assert [a["state"] for a in done["attempts"]] == ["preempted", "succeeded"]


@in_loop
async def test_reprioritize_is_for_admins_and_a_raised_job_starts_first(tmp_path):
    backend = SlowBackend()
    async with service(backend, tmp_path) as manager:
        holder = await submit(manager, resources={"gpus": 2})
        await backend.machine.running(holder)
        older = await submit(manager, resources={"gpus": 2})
        newer = await submit(manager, resources={"gpus": 2})
        with pytest.raises(Forbidden):
            await manager.reprioritize(ALICE, newer, "urgent")
        with pytest.raises(ValidationError):
            await manager.reprioritize(ADMIN, newer, "whenever")
        raised = await manager.reprioritize(ADMIN, newer, "urgent")
        await backend.machine.running(newer)  # ahead of the older job, and it preempted the holder
        waiting = {j: await state_of(manager, j) for j in (older, holder)}
        backend.finish(newer)
        await backend.machine.running(holder, attempt=2)
        backend.finish(holder)
        await backend.machine.running(older)
        backend.finish(older)
        states = {j: (await final(manager, j))["state"] for j in (holder, older, newer)}

    assert (raised["priority"], raised["priority_value"]) == ("urgent", 100)
    assert waiting == {older: "queued", holder: "queued"}
    assert states == {holder: "succeeded", older: "succeeded", newer: "succeeded"}
    assert [launch.job_id for launch in backend.launches] == [holder, newer, holder, older]


# reading and listing ------------------------------------------------------------------------------------
@in_loop
async def test_jobs_are_seen_only_by_their_owner_and_admins(tmp_path):
    async with service(InstantBackend(), tmp_path) as manager:
        mine = await submit(manager)
        theirs = await submit(manager, who=user("carol", "vision"))
        await final(manager, mine)
        await final(manager, theirs)
        listed = {j.id for j in await manager.list(ALICE)}
        everyone = {j.id for j in await manager.list(ADMIN)}
        with pytest.raises(NotFound):
            await manager.get(ALICE, theirs)
        with pytest.raises(Forbidden):
            await manager.list(ALICE, owner="carol")
        with pytest.raises(ValidationError):
            await manager.get(ALICE, "../../etc")
        succeeded = {j.id for j in await manager.list(ADMIN, states=["succeeded"], owner="carol")}

    assert listed == {mine} and everyone == {mine, theirs} and succeeded == {theirs}


def add_history(manager, count: int, *, start=dt.datetime(2026, 11, 1), ties: int = 3) -> list[Job]:
    """``count`` finished jobs written straight into the database, ``ties`` at a time sharing one
    ``created_at`` (the id must break ties), over owners alice/carol/dave, queues a/b, and four states;
    returned newest first, as listings order them."""
    states = ("succeeded", "failed", "cancelled", "timed_out")
    jobs = [
        Job(
            id=f"{0xE00000000000 + (i * 7919) % 0xFFFFF:012x}",
            owner=("alice", "carol", "dave")[i % 3],
            name=f"h{i}",
            state=states[i % 4],
            profile="python",
            queue=("a", "b")[i % 2],
            created_at=start + dt.timedelta(seconds=i // ties),
        )
        for i in range(count)
    ]
    with manager.database.sessions() as s, s.begin():
        s.add_all(jobs)
    return sorted(jobs, key=lambda j: (j.created_at, j.id), reverse=True)


async def walk(manager, who, limit: int, between=None, **filters) -> list[str]:
    """Every page, following next_cursor; ``between()`` runs after each page (concurrent changes)."""
    ids, cursor = [], None
    while True:
        jobs, cursor = await manager.page(who, limit=limit, cursor=cursor, **filters)
        assert len(jobs) <= limit and (cursor is None or len(jobs) == limit)
        ids += [j.id for j in jobs]
        if between is not None:
            await between()
        if cursor is None:
            return ids


@in_loop
async def test_pages_follow_each_other_newest_first_with_every_filter(tmp_path):
    async with service(InstantBackend(), tmp_path) as manager:
        history = add_history(manager, 95)
        cases = [
            (ADMIN, {}, lambda j: True),
            (ALICE, {}, lambda j: j.owner == "alice"),
            (ADMIN, {"owner": "carol"}, lambda j: j.owner == "carol"),
            (ADMIN, {"queue": "b"}, lambda j: j.queue == "b"),
            (ADMIN, {"states": ["failed"]}, lambda j: j.state == "failed"),
            (ADMIN, {"states": ["timed_out", "succeeded"]}, lambda j: j.state in ("timed_out", "succeeded")),
            (
                ALICE,
                {"states": ["failed", "cancelled"], "queue": "a"},
                lambda j: j.owner == "alice" and j.state in ("failed", "cancelled") and j.queue == "a",
            ),
            (
                ADMIN,
                {"owner": "dave", "states": ["succeeded"], "queue": "a"},
                lambda j: j.owner == "dave" and j.state == "succeeded" and j.queue == "a",
            ),
        ]
        for who, filters, keep in cases:
            expected = [j.id for j in history if keep(j)]
            for limit in (1, 4, 7, 200):
                assert await walk(manager, who, limit, **filters) == expected, (who.name, filters, limit)
        first, cursor = await manager.page(ADMIN, limit=10)
        assert [j.id for j in first] == [j.id for j in history[:10]] and cursor
        assert [j.id for j in await manager.list(ADMIN, limit=5, cursor=cursor)] == [j.id for j in history[10:15]]
        assert await manager.page(ADMIN, states=["queued"]) == ([], None)


@in_loop
async def test_jobs_accepted_while_pages_are_read_neither_repeat_nor_hide_a_job(tmp_path):
    async with service(InstantBackend(), tmp_path) as manager:
        history = add_history(manager, 40, start=utcnow() - dt.timedelta(hours=1))
        added = []

        async def submit_more():  # through the real submission, as other users do meanwhile
            added.append(await submit(manager))
            added.append(await submit(manager, who=user("carol", "vision")))

        seen = await walk(manager, ADMIN, 6, between=submit_more)
        before = [j.id for j in await manager.list(ALICE, limit=1000)]  # hers now: history and what she added
        alices = await walk(manager, ALICE, 4, between=submit_more)

    assert len(seen) == len(set(seen)) and seen == [j.id for j in history]  # newer jobs sort above every cursor
    assert alices == before and len(before) > len([j for j in history if j.owner == "alice"]) and len(added) > 20


def cursor_of(*parts) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(parts)).encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    "cursor, words",
    [
        ("%%%", "not base64 of JSON"),
        ("bm90IGpzb24", "not base64 of JSON"),  # "not json"
        (cursor_of("1", "2026-11-01T00:00:00"), "not a key"),
        (cursor_of(["1"], "2026-11-01T00:00:00", "e00000000001"), "not a key"),
        (cursor_of("2", "2026-11-01T00:00:00", "e00000000001"), "version '2'"),
        (cursor_of("1", "2026-11-01T00:00:00", "../../etc"), "no job id"),
        (cursor_of("1", "yesterday", "e00000000001"), "no time"),
        (cursor_of("1", "2026-11-01T00:00:00+02:00", "e00000000001"), "a time with a zone"),
        ("A" * 201, "longer than 200"),
    ],
)
def test_a_cursor_the_service_did_not_make_is_a_400_naming_cursor(cursor, words):
    with pytest.raises(UsageError) as e:
        listing.decode_cursor(cursor)
    assert (e.value.status, e.value.field, e.value.reason) == (400, "cursor", "bad_cursor")
    assert words in e.value.message and "next_cursor" in e.value.fix


def test_a_cursor_decodes_to_the_key_it_was_made_from():
    key = (dt.datetime(2026, 11, 1, 8, 30, 0, 123456), "0123456789ab")
    assert listing.decode_cursor(listing.encode_cursor(key)) == key
    assert listing.decode_cursor(listing.encode_cursor((key[0].replace(microsecond=0), key[1])))[0].microsecond == 0


@in_loop
async def test_the_manager_refuses_a_bad_cursor_before_reading(tmp_path):
    async with service(InstantBackend(), tmp_path) as manager:
        with pytest.raises(UsageError, match="not a cursor of GET /jobs"):
            await manager.page(ALICE, cursor="nope")


async def body_and_views(manager, who, **filters) -> tuple[str, str]:
    """GET /jobs's body as the service sends it (:meth:`page_json`), and as :meth:`page` and :meth:`views`
    say it (the ORM's objects, the views built one by one, the whole encoded at once)."""
    sent = await manager.page_json(who, **filters)
    jobs, cursor = await manager.page(who, **filters)
    return sent, json.dumps({"jobs": await manager.views_of(jobs), "next_cursor": cursor})


def without_clock(body: str) -> dict:
    """A listing's body without what a running job's view takes from the clock."""
    page = json.loads(body)
    for view in page["jobs"]:
        if view["state"] == "running":
            view["elapsed_seconds"] = None
    return page


@in_loop
async def test_a_listing_is_the_views_of_its_page_byte_for_byte_and_only_ended_jobs_are_kept(tmp_path):
    backend = SlowBackend()
    async with service(backend, tmp_path) as manager:
        history = add_history(manager, 30)
        done = await submit(manager, name="done", parameters={"lr": 0.5}, resources={"gpus": 1})
        await until(lambda: len(backend.launches) == 1, "the first job to start")
        backend.finish(done)
        await final(manager, done)
        running = await submit(manager, name="running", resources={"gpus": 2})
        queued = await submit(manager, who=user("carol", "vision"), resources={"gpus": 2})
        await until(lambda: len(backend.launches) == 2, "the second job to start")
        cases = [
            (ADMIN, {}),
            (ALICE, {}),
            (ADMIN, {"owner": "carol"}),
            (ADMIN, {"states": ["queued", "running"]}),
            (ALICE, {"states": ["succeeded", "failed"]}),
            (ADMIN, {"queue": "b", "limit": 4}),
            (ADMIN, {"limit": 7, "cursor": listing.encode_cursor((history[9].created_at, history[9].id))}),
        ]
        compared = []
        for who, filters in cases * 2:  # the second time from the cache
            sent, expected = await body_and_views(manager, who, **filters)
            compared.append(without_clock(sent) == without_clock(expected))
        ended, ended_expected = await body_and_views(manager, ADMIN, states=["succeeded", "failed"], limit=200)
        cached = set(manager.views.cache._entries)
        hits = manager.views.cache.hits
        backend.finish(running)
        await final(manager, running)

    assert compared == [True] * len(cases) * 2
    assert ended == ended_expected and json.loads(ended)["jobs"]  # every byte, separators included
    assert cached == {j.id for j in history} | {done} and hits > 0  # never a queued or a running job's view
    assert queued not in cached and running not in cached


@in_loop
async def test_a_kept_view_changes_with_anything_its_job_was_built_from(tmp_path):
    from danlu.hub.service.store.orm import Attempt, Dataset, DatasetUse, DatasetVersion

    async with service(InstantBackend(), tmp_path) as manager:
        job_id = await submit(manager, name="kept")
        await final(manager, job_id)

        async def view() -> dict:
            [listed] = json.loads(await manager.page_json(ALICE))["jobs"]
            return listed

        async def change(fn) -> dict:
            await manager.database.write(fn)
            return await view()

        first = await view()
        again = await view()
        hits = manager.views.cache.hits

        def late_report(s):  # the runner's last tracking report, after the job ended
            s.get(Job, job_id).tracking = {"run_id": "r1", "experiment_id": "7", "points_sent": 12}

        def attempt_changed(s):
            attempt = s.get(Job, job_id).attempts[0]
            attempt.exit_code, attempt.reason = 3, "re-read"

        def used_a_dataset(s):
            s.add(Dataset(name="faces", created_by="alice"))
            s.add(
                DatasetVersion(
                    dataset="faces",
                    version=1,
                    digest="d" * 64,
                    files=1,
                    bytes=1,
                    source="faces",
                    path="/data/faces",
                    created_by="alice",
                )
            )
            s.flush()
            s.add(DatasetUse(job_id=job_id, dataset="faces", version=1, digest="d" * 64, context="training"))

        def renamed(s):
            s.get(Job, job_id).name = "renamed"

        tracked = await change(late_report)
        exited = await change(attempt_changed)
        used = await change(used_a_dataset)
        named = await change(renamed)
        with manager.database.sessions() as s:
            attempts = s.query(Attempt).filter_by(job_id=job_id).count()

    assert first == again and hits >= 1 and attempts == 1
    assert (tracked["mlflow_run_id"], tracked["tracking"]["points_sent"]) == ("r1", 12)
    assert tracked["mlflow_run_url"].endswith("/#/experiments/7/runs/r1")
    assert (exited["attempts"][0]["exit_code"], exited["attempts"][0]["reason"]) == (3, "re-read")
    assert [i["ref"] for i in used["inputs"]] == ["faces@1"] and named["name"] == "renamed"


@in_loop
async def test_a_kept_view_never_shows_a_job_to_a_caller_who_may_not_see_it(tmp_path):
    async with service(InstantBackend(), tmp_path) as manager:
        history = add_history(manager, 24)
        everyone = json.loads(await manager.page_json(ADMIN, limit=1000))["jobs"]  # every view kept
        for_alice = json.loads(await manager.page_json(ALICE, limit=1000))["jobs"]
        failed = json.loads(await manager.page_json(ALICE, states=["failed", "succeeded"]))["jobs"]
        for_bob = json.loads(await manager.page_json(BOB))["jobs"]
        with pytest.raises(Forbidden):
            await manager.page_json(ALICE, owner="carol")
        kept = len(manager.views.cache)

    assert [j["id"] for j in everyone] == [j.id for j in history] and kept == len(history)
    assert [j["id"] for j in for_alice] == [j.id for j in history if j.owner == "alice"]
    assert [j["id"] for j in failed] == [
        j.id for j in history if j.owner == "alice" and j.state in ("failed", "succeeded")
    ]
    assert for_bob == []


@in_loop
async def test_the_service_rolls_usage_up_and_expires_old_samples_on_its_own(tmp_path):
    from danlu.hub.service.store.orm import Attempt, GpuSample, UsageRollup, isoformat
    from danlu.hub.service.usage import rollups

    hour = rollups.floor_hour(utcnow()) - dt.timedelta(hours=3)
    backend = InstantBackend()
    manager = make_manager(backend, tmp_path / "state")
    with manager.database.sessions() as s, s.begin():  # before it starts, as an upgraded database holds them
        for i, who in enumerate(("alice", "carol")):  # two 1-GPU jobs of an hour each, samples old and new
            job = Job(
                id=f"f0000000000{i}",
                owner=who,
                name="old",
                state="succeeded",
                profile="python",
                queue="default",
                created_at=hour,
            )
            job.attempts.append(
                Attempt(
                    number=1,
                    state="succeeded",
                    devices=[i],
                    flavor="sim",
                    started_at=hour,
                    finished_at=hour + dt.timedelta(hours=1),
                )
            )
            s.add(job)
        s.add_all(
            [
                GpuSample(device=0, at=hour - dt.timedelta(days=20), utilization=5.0),
                GpuSample(device=0, at=hour + dt.timedelta(minutes=30), utilization=50.0),
            ]
        )
    async with serving(manager):
        caught_up = rollups.floor_hour(utcnow() - rollups.GRACE)
        await until(lambda: manager.database.read(lambda s: rollups.watermark(s) == caught_up), "usage to be rolled up")
        await until(lambda: manager.database.read(lambda s: s.query(GpuSample).count() == 1), "old samples to go")
        report = await manager.usage(ADMIN, user=None, by="user", start=hour - dt.timedelta(days=1), end=utcnow())
        rolled = await manager.database.read(lambda s: s.query(UsageRollup).count())
    await backend.machine.kill_all()

    assert {
        r["user"]: (r["gpu_hours"], r["jobs"], r["measured_utilization"], r["gpu_hours_busy"]) for r in report["rows"]
    } == {
        "alice": (1.0, 1, 50.0, 0.5),  # allocated beside busy: an hour held at 50%
        "carol": (1.0, 1, None, None),  # nothing sampled: unknown, not idle
    }
    assert report["total"]["gpu_hours_busy"] == 0.5
    assert report["from"] == isoformat(hour - dt.timedelta(days=1)) and rolled >= 2


# the runner API ---------------------------------------------------------------------------------------------
@in_loop
async def test_reports_for_another_job_attempt_or_token_are_refused_and_change_nothing(tmp_path):
    backend = HostileBackend()
    async with service(backend, tmp_path) as manager:
        victim = await submit(manager, name="victim")
        await backend.machine.running(victim)
        attacker = await submit(manager, name="attacker", parameters={"victim": victim})
        hostile = await backend.machine.running(attacker)
        await until(lambda: len(hostile.answers) >= 7, "the attacker's forged reports")
        victim_rows, attacker_rows = await attempt_rows(manager, victim), await attempt_rows(manager, attacker)
        states = await state_of(manager, victim), await state_of(manager, attacker)
        backend.finish(victim)
        backend.finish(attacker)
        ends = (await final(manager, victim))["state"], (await final(manager, attacker))["state"]

    assert hostile.answers[:7] == [
        ("spec", 200),
        ("another job's report", 403),
        ("another job's spec", 403),
        ("another job's stop", 403),
        ("its next attempt's report", 403),
        ("a forged token", 403),
        ("a malformed token", 401),
    ]
    assert states == ("running", "running")
    assert victim_rows[0]["report"] == {} and attacker_rows[0]["report"] == {}
    assert ends == ("succeeded", "succeeded")


@in_loop
async def test_an_earlier_attempts_token_is_refused_and_the_job_folder_changes_nothing(tmp_path):
    backend = HostileBackend()
    async with service(backend, tmp_path) as manager:
        job_id = await submit(manager, retries=1, parameters={"then": "exit", "lr": 0.5})
        done = await final(manager, job_id)
        first, second = backend.machine.run(job_id, 1), backend.machine.run(job_id, 2)

    assert ("an earlier attempt's token", 403) in second.answers
    assert ("an earlier attempt's token for that attempt", 403) in second.answers
    assert json.loads(second.folder["job.json"])["owner"] == "root"  # what the job wrote there...
    assert {**first.spec, "attempt": 2} == second.spec  # ...is not where the spec comes from
    assert (second.spec["owner"], second.spec["profile"], second.spec["parameters"]) == (
        "alice",
        "python",
        {"then": "exit", "lr": 0.5},
    )
    assert (done["state"], done["failure"]) == ("failed", "infrastructure")


@in_loop
async def test_an_invalid_report_is_a_422_and_fails_the_attempt_saying_so(tmp_path):
    backend = HostileBackend()
    async with service(backend, tmp_path) as manager:
        job_id = await submit(manager, retries=2, parameters={"then": "invalid"})
        done = await final(manager, job_id)

    assert ("an invalid report", 422) in backend.machine.run(job_id).answers
    assert (done["state"], done["failure"]) == ("failed", "user")
    assert done["reason"].startswith("error in your code: the job sent an invalid report (")
    assert "succeeded-honestly" in done["reason"]
    assert len(done["attempts"]) == 1


@in_loop
async def test_a_valid_report_after_an_invalid_one_is_the_one_that_counts(tmp_path):
    backend = HostileBackend()
    async with service(backend, tmp_path) as manager:
        job_id = await submit(manager, parameters={"then": "invalid-then-succeed"})
        done = await final(manager, job_id)

    assert ("an invalid report", 422) in backend.machine.run(job_id).answers
    assert ("finished succeeded", 200) in backend.machine.run(job_id).answers
    assert done["state"] == "succeeded"


@in_loop
async def test_a_job_cannot_requeue_itself_by_claiming_it_was_preempted(tmp_path):
    class ClaimsPreemptionBackend(SlowBackend):
        async def work(self, run):
            await run.released.wait()
            await run.report("preempted", "preempted", exit_code=None)
            return 0

    backend = ClaimsPreemptionBackend()
    async with service(backend, tmp_path) as manager:
        job_id = await submit(manager, retries=0)
        await backend.machine.running(job_id)
        await manager.queues.hold(ADMIN, "default", True)  # so a requeued job stays where we can see it
        backend.finish(job_id)
        await until(lambda: backend.machine.run(job_id).task.done(), "the runner to end")
        rows = await until(lambda: _finished(manager, job_id), "the attempt to be recorded")
        done = await manager.job_dict(job_id)

    assert rows[0]["state"] != "preempted", "the service never preempted it"
    assert (done["state"], done["failure"]) == ("failed", "user")
    assert done["reason"] == "error in your code: the job reported 'preempted' but nothing stopped it"


async def _finished(manager, job_id):
    rows = await attempt_rows(manager, job_id)
    return rows if rows[0]["token_hash"] == "" else None


class ReaperClock:
    """The supervisor's ``asyncio``, but its long sleeps (the reaper's 30 s) end only when the test says that
    long has passed (:meth:`pass_time`): those begun before, not those begun after."""

    def __init__(self):
        self._passing = asyncio.Event()
        self.sleeping = 0  # long sleeps begun so far

    def __getattr__(self, name):
        return getattr(asyncio, name)

    async def pass_time(self, sleepers: int) -> None:
        """Once ``sleepers`` long sleeps have begun, end them."""
        await until(lambda: self.sleeping >= sleepers, f"{sleepers} long sleeps to begin")
        passing, self._passing = self._passing, asyncio.Event()
        passing.set()

    async def sleep(self, seconds: float) -> None:
        if seconds >= 20:
            self.sleeping += 1
            await self._passing.wait()
        else:
            await asyncio.sleep(seconds)


def keep_reapers(manager) -> list[asyncio.Task]:
    """The reaper tasks that 'finished' reports arm from now on."""
    reapers: list[asyncio.Task] = []
    arm, spawn = manager.supervisor.reap_after_report, manager.core.spawn

    def arm_and_keep(*args, **kwargs):
        manager.core.spawn = lambda coro: reapers.append(spawn(coro)) or reapers[-1]
        try:
            arm(*args, **kwargs)
        finally:
            manager.core.spawn = spawn

    manager.supervisor.reap_after_report = arm_and_keep
    return reapers


class LingersAfterReportBackend(SlowBackend):
    """When told, the runner reports success, then stays (a kernel that will not die) until signalled."""

    async def work(self, run):
        await run.released.wait()
        await run.report("succeeded")
        await run.signalled.wait()
        return 143


@in_loop
async def test_a_runner_still_there_after_its_report_is_ended_by_the_reaper(tmp_path, monkeypatch):
    clock = ReaperClock()
    monkeypatch.setattr(supervisor, "asyncio", clock)
    backend = LingersAfterReportBackend()
    async with service(backend, tmp_path) as manager:
        reapers = keep_reapers(manager)
        job_id = await submit(manager)
        run = await backend.machine.running(job_id)
        await until(lambda: job_id in manager.supervisor.watchers, "the service to watch the attempt")
        backend.finish(job_id)
        await until(lambda: reapers, "the report to arm a reaper")
        await clock.pass_time(len(reapers))  # 30 s later
        await asyncio.wait_for(asyncio.gather(*reapers), 30)  # bounds a hang
        done = await final(manager, job_id)

    assert backend.cancels == [(job_id, "finished")]
    assert run.task.done() and done["state"] == "succeeded"


@in_loop
async def test_a_runner_that_reports_before_it_is_watched_is_still_reaped(tmp_path, monkeypatch):
    class ReportsWhileStartingBackend(LingersAfterReportBackend):
        async def start(self, launch, record):
            state = await super().start(launch, record)
            run = await self.machine.running(launch.job_id, launch.attempt)
            run.released.set()
            await until(lambda: ("finished succeeded", 200) in run.answers, "the runner's report")
            return state  # the pod ran a short job before the cluster's API answered

    clock = ReaperClock()
    monkeypatch.setattr(supervisor, "asyncio", clock)
    backend = ReportsWhileStartingBackend()
    async with service(backend, tmp_path) as manager:
        reapers = keep_reapers(manager)
        job_id = await submit(manager)
        await until(lambda: job_id in manager.supervisor.watchers, "the service to watch the attempt")
        # (the report was recorded before start returned: a reaper is armed then, or never)
        await until(lambda: reapers, "a reaper for the runner that reported before it was watched", patience=3.0)
        await clock.pass_time(len(reapers))
        await asyncio.wait_for(asyncio.gather(*reapers), 30)
        done = await final(manager, job_id)

    assert done["state"] == "succeeded" and backend.machine.alive(job_id) == []


@in_loop
async def test_the_reaper_of_an_attempt_that_reported_spares_the_jobs_next_attempt(tmp_path, monkeypatch):
    clock = ReaperClock()
    monkeypatch.setattr(supervisor, "asyncio", clock)
    backend = SlowBackend()
    async with service(backend, tmp_path) as manager:
        reapers = keep_reapers(manager)
        victim = await submit(manager, resources={"gpus": 2})
        await backend.machine.running(victim)
        urgent = await submit(manager, priority="urgent", resources={"gpus": 2})
        await backend.machine.running(urgent)  # the victim's attempt 1 reported 'preempted' and ended
        backend.finish(urgent)
        await backend.machine.running(victim, attempt=2)
        await until(lambda: victim in manager.supervisor.watchers, "the service to watch attempt 2")
        armed = list(reapers)
        await clock.pass_time(len(armed))  # 30 s after attempt 1's report, while attempt 2 runs: reapers fire
        await asyncio.wait_for(asyncio.gather(*armed), 30)  # bounds a hang
        backend.finish(victim)
        done = await final(manager, victim)

    assert len(armed) == 2  # by the reports of the victim's attempt 1 and of the urgent job
    assert (victim, "finished") not in backend.cancels
    assert done["state"] == "succeeded", done["reason"]


@in_loop
async def test_the_runner_gets_its_spec_from_the_database_as_submitted(tmp_path):
    backend = InstantBackend()
    home = tmp_path / "state" / "users" / "alice"
    (home / "data").mkdir(parents=True)
    (home / "data" / "train.csv").write_text("x,y\n1,2\n")
    submitted = notebook("lr = 0.1", "print(lr)")
    submitted["cells"][0]["metadata"]["tags"] = ["parameters"]
    submitted["metadata"]["kernelspec"] = {"name": "some-other-kernel", "display_name": "x", "language": "python"}
    async with service(backend, tmp_path) as manager:
        status, body = await manager.submit(
            ALICE,
            {
                "notebook": submitted,
                "name": "spec-check",
                "parameters": {"lr": 0.5, "layers": [1, 2]},
                "datasets": ["data/train.csv"],
                "experiment": "alice/specs",
                "resources": {"gpus": 1},
            },
        )
        job_id = body["id"]
        await final(manager, job_id)
        _, recorded = await manager.input_notebook(ALICE, job_id)
        spec = backend.machine.run(job_id).spec

    assert status == 201
    assert {
        k: spec[k]
        for k in (
            "job_id",
            "attempt",
            "name",
            "owner",
            "profile",
            "kernel_name",
            "nproc",
            "gpus",
            "devices",
            "parameters",
            "experiment",
            "queue",
        )
    } == {
        "job_id": job_id,
        "attempt": 1,
        "name": "spec-check",
        "owner": "alice",
        "profile": "python",
        "kernel_name": "danlu-python",
        "nproc": 1,
        "gpus": 1,
        "devices": [0],
        "parameters": {"lr": 0.5, "layers": [1, 2]},
        "experiment": "alice/specs",
        "queue": "default",
    }
    assert spec["datasets"] == [
        {"name": "data/train.csv", "path": os.path.realpath(home / "data" / "train.csv"), "context": "training"}
    ]
    assert spec["cwd"] == str(home) and spec["env"] == {"HOME": str(home), "USER": "alice"}
    assert spec["mlflow_env"] == {}
    assert spec["notebook"]["cells"] == submitted["cells"]
    assert spec["notebook"]["metadata"]["kernelspec"]["name"] == "danlu-python"  # the profile's, not the file's
    assert spec["notebook"] == json.loads(recorded)


# restarts ---------------------------------------------------------------------------------------------------
@in_loop
async def test_a_restarted_service_reattaches_to_a_launched_attempt_which_then_succeeds(tmp_path):
    state = tmp_path / "state"
    before = SlowBackend()
    async with serving(make_manager(before, state)) as manager:
        job_id = await submit(manager, resources={"gpus": 1})
        run = await before.machine.running(job_id)
    assert not run.task.done(), "stopping the service must leave running jobs alone"

    after = SlowBackend(machine=before.machine)
    async with serving(make_manager(after, state)) as manager:
        assert await state_of(manager, job_id) == "running"
        assert [a["device"] for a in await allocations(manager)] == [0]
        after.finish(job_id)
        done = await final(manager, job_id)

    loaded = after.loaded[job_id]
    assert loaded["run"] == f"{job_id}/1" and (loaded.get("launched") or loaded.get("spec_fetched"))
    assert ("finished succeeded", 200) in run.answers
    assert done["state"] == "succeeded" and len(done["attempts"]) == 1
    assert before.machine.errors() == []


@in_loop
async def test_an_attempt_recorded_but_never_launched_is_requeued_without_counting_and_its_token_dies(tmp_path):
    state = tmp_path / "state"
    starting = NeverStartsBackend()
    async with serving(make_manager(starting, state)) as manager:
        submitting = asyncio.ensure_future(manager.submit(ALICE, job(retries=0)))
        launch = await bounded(starting.starting.get())
    submitting.cancel()  # the request died with the service
    await asyncio.gather(submitting, return_exceptions=True)

    backend = InstantBackend()
    manager = make_manager(backend, state)
    await manager.queues.drain(ADMIN, True)  # hold the requeued job where we can look at it
    async with serving(manager):
        requeued = await manager.job_dict(launch.job_id)
        with pytest.raises(Forbidden):
            await manager.runner_api.spec(launch.job_id, 1, launch.token)
        await manager.queues.drain(ADMIN, False)
        done = await final(manager, launch.job_id)

    assert requeued["state"] == "queued"
    assert [(a["state"], a["failure"], a["reason"]) for a in requeued["attempts"]] == [
        ("failed", None, "the service stopped while starting it")
    ]
    assert backend.cancels == [(launch.job_id, "interrupted")]
    assert done["state"] == "succeeded" and done["retries"] == 0, "the interruption used no retry"
    assert [a["state"] for a in done["attempts"]] == ["failed", "succeeded"]


@in_loop
async def test_a_retry_backoff_is_the_same_in_any_time_zone(tmp_path, monkeypatch):
    monkeypatch.setenv("TZ", "EST+05")  # five hours west of UTC, no tz database needed
    time.tzset()
    try:
        backend = CrashingBackend(crashes=1)
        async with service(backend, tmp_path, jobs={"retry_backoff_seconds": 0.05}) as manager:
            job_id = await submit(manager, retries=1)
            await until(lambda: _requeued(manager, job_id), "the retry to be scheduled")
            row = await manager.get(ADMIN, job_id)
            while utcnow() <= row.not_before:  # the backoff is over, by the clock it was set with
                await asyncio.sleep(0.01)
            await manager.scheduler.schedule()
            state = await state_of(manager, job_id)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert state in ("running", "succeeded"), f"still {state} after its 0.05 s backoff"


async def _requeued(manager, job_id) -> bool:
    row = await manager.get(ADMIN, job_id)
    return row.state == "queued" and row.not_before is not None


# next_state, a pure function ------------------------------------------------------------------------------
DEFAULTS = {
    "stopping": None,
    "preempt_reason": "",
    "retries": 0,
    "failures_before": 0,
    "limit_seconds": 3600.0,
    "backoff_seconds": 10.0,
}
KILLED = Ending("failed", "the job runner ended without reporting (killed by signal 9)", infrastructure=True)
CASES = {
    # name: (job state, ending, arguments, (state, failure, attempt state, retry_in, reason))
    "success": ("running", Ending("succeeded"), {}, ("succeeded", "", "succeeded", None, "")),
    "success wins over a cancel": (
        "running",
        Ending("succeeded"),
        {"stopping": "cancelled"},
        ("succeeded", "", "succeeded", None, ""),
    ),
    "success wins over a preemption": (
        "preempted",
        Ending("succeeded"),
        {"stopping": "preempted"},
        ("succeeded", "", "succeeded", None, ""),
    ),
    "cancel, whatever the processes did": (
        "running",
        KILLED,
        {"stopping": "cancelled"},
        ("cancelled", "", "cancelled", None, KILLED.reason),
    ),
    "cancel with no word from anyone": (
        "running",
        Ending("failed"),
        {"stopping": "cancelled"},
        ("cancelled", "", "cancelled", None, "cancelled"),
    ),
    "cancel keeps who cancelled": (
        "running",
        Ending("cancelled", "cancelled by alice"),
        {"stopping": "cancelled"},
        ("cancelled", "", "cancelled", None, "cancelled by alice"),
    ),
    "cancel wins over a user error": (
        "running",
        Ending("failed", "cell 1 raised"),
        {"stopping": "cancelled"},
        ("cancelled", "", "cancelled", None, "cell 1 raised"),
    ),
    "time limit": (
        "running",
        KILLED,
        {"stopping": "timed_out", "limit_seconds": 90.0},
        ("timed_out", "", "timed_out", None, "ran longer than its limit of 90 s and was stopped"),
    ),
    "preemption": (
        "preempted",
        Ending("preempted", "preempted"),
        {"preempt_reason": "preempted by job b"},
        (
            "queued",
            "",
            "preempted",
            None,
            "preempted by job b; back in the queue (checkpoint in $DANLU_CHECKPOINT_DIR)",
        ),
    ),
    "preemption whose runner died": (
        "preempted",
        KILLED,
        {"stopping": "preempted", "preempt_reason": "by b"},
        ("queued", "", "preempted", None, "by b; back in the queue (checkpoint in $DANLU_CHECKPOINT_DIR)"),
    ),
    "interruption is not counted": (
        "running",
        Ending("failed", "the service stopped", interrupted=True),
        {},
        ("queued", "", "failed", None, "the service stopped; runs again"),
    ),
    "user error, retries left": (
        "running",
        Ending("failed", "cell 2 raised KeyError"),
        {"retries": 5},
        ("failed", "user", "failed", None, "error in your code: cell 2 raised KeyError"),
    ),
    "first retry": (
        "running",
        KILLED,
        {"retries": 2},
        ("queued", "infrastructure", "failed", 10.0, f"retry 1 of 2 after an infrastructure failure: {KILLED.reason}"),
    ),
    "backoff doubles": (
        "running",
        KILLED,
        {"retries": 3, "failures_before": 2},
        ("queued", "infrastructure", "failed", 40.0, f"retry 3 of 3 after an infrastructure failure: {KILLED.reason}"),
    ),
    "backoff is capped at an hour": (
        "running",
        KILLED,
        {"retries": 20, "failures_before": 12},
        (
            "queued",
            "infrastructure",
            "failed",
            3600.0,
            f"retry 13 of 20 after an infrastructure failure: {KILLED.reason}",
        ),
    ),
    "allowance spent": (
        "running",
        KILLED,
        {"retries": 2, "failures_before": 2},
        ("failed", "infrastructure", "failed", None, f"infrastructure failure: {KILLED.reason}"),
    ),
    "no allowance": (
        "running",
        KILLED,
        {},
        ("failed", "infrastructure", "failed", None, f"infrastructure failure: {KILLED.reason}"),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_next_state(name):
    job_state, ending, arguments, (state, failure, attempt_state, retry_in, reason) = CASES[name]

    nxt = next_state(job_state, ending, **{**DEFAULTS, **arguments})

    assert (nxt.state, nxt.failure, nxt.attempt_state, nxt.retry_in, nxt.reason) == (
        JobState(state),
        failure,
        attempt_state,
        retry_in,
        reason,
    )


def test_a_retry_is_numbered_and_records_the_attempts_own_reason():
    nxt = next_state("running", KILLED, **{**DEFAULTS, "retries": 3, "failures_before": 1})

    assert (nxt.retry_number, nxt.attempt_reason) == (2, KILLED.reason)
