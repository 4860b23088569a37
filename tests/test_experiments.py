"""The caller's experiments from the jobs database (GET /experiments), on the manager with a fake backend."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from danlu.errors import Forbidden
from danlu.hub.service.store.orm import Job

from .fakes import FakeBackend, admin, make_manager, user

ALICE, BOB = user("alice"), user("bob")


def job(n: int, owner: str, experiment: str, run: bool = True, experiment_id="7", minutes: int = 0) -> Job:
    return Job(
        id=f"{n:012x}",
        owner=owner,
        name=f"job{n}",
        state="succeeded",
        profile="python",
        experiment=experiment,
        mlflow_run_id=f"{n:032x}" if run else None,
        tracking={"run_id": f"{n:032x}", "experiment_id": experiment_id} if run else {},
        created_at=dt.datetime(2026, 11, 30, 10, minutes),
    )


@pytest.fixture
def manager(tmp_path):
    m = make_manager(FakeBackend(), tmp_path / "state")
    with m.database.sessions() as s:
        s.add_all(
            [
                job(1, "alice", "alice/mnist", minutes=1),
                job(2, "alice", "alice/mnist", minutes=5),
                job(3, "alice", "shared", experiment_id="9", minutes=2),
                job(4, "alice", "alice/queued", run=False),  # no MLflow run yet: not an experiment of hers yet
                job(5, "alice", "odd", experiment_id="../1"),  # what a hostile runner reported is not passed on
                job(6, "bob", "shared", experiment_id="9"),
            ]
        )
        s.commit()
    return m


def test_a_users_experiments_hold_their_job_runs_counted_by_name(manager):
    found = asyncio.run(manager.experiments(ALICE))
    assert found == [
        {"experiment_id": "7", "name": "alice/mnist", "runs": 2, "latest": "2026-11-30T10:05:00Z"},
        {"experiment_id": None, "name": "odd", "runs": 1, "latest": "2026-11-30T10:00:00Z"},
        {"experiment_id": "9", "name": "shared", "runs": 1, "latest": "2026-11-30T10:02:00Z"},
    ]
    assert asyncio.run(manager.experiments(BOB)) == [
        {"experiment_id": "9", "name": "shared", "runs": 1, "latest": "2026-11-30T10:00:00Z"}
    ]


def test_only_admins_ask_for_someone_elses(manager):
    with pytest.raises(Forbidden) as refused:
        asyncio.run(manager.experiments(BOB, owner="alice"))
    assert refused.value.field == "owner"
    assert [e["name"] for e in asyncio.run(manager.experiments(admin(), owner="bob"))] == ["shared"]


def test_an_experiment_found_writable_is_not_checked_again_for_a_minute(monkeypatch):
    from danlu.hub.service import mlflow_client as mlflow_access

    calls = []

    class Users:
        async def ensure_user(self, name, admin=None):
            calls.append(("user", name))

        async def check_experiment(self, name, owner, admin, user_exists):
            calls.append(("check", owner, name))

    access = mlflow_access.MlflowAccess("http://127.0.0.1:1", "secret")
    access.users = Users()
    now = [1000.0]
    monkeypatch.setattr(mlflow_access.time, "monotonic", lambda: now[0])

    async def exists(name):
        return True

    for _ in range(3):
        asyncio.run(access.check_experiment("alice/sweep", "alice", False, exists))
    asyncio.run(access.check_experiment("alice/other", "alice", False, exists))
    checks = [c for c in calls if c[0] == "check"]
    assert checks == [("check", "alice", "alice/sweep"), ("check", "alice", "alice/other")]
    now[0] += mlflow_access.CHECKED_FOR + 1
    asyncio.run(access.check_experiment("alice/sweep", "alice", False, exists))
    assert calls[-1] == ("check", "alice", "alice/sweep")


class Store:
    """MLflow's user store and experiments as MlflowAccess sees them (``MlflowUsers``): ``shared`` exists and its
    default permission lets any MLflow user write it; someone not yet an MLflow user has no permission at all."""

    def __init__(self, unreachable: int = 0):
        self.users: set[str] = set()
        self.calls: list[tuple] = []
        self.unreachable = unreachable  # how many of the next ensure_user calls find MLflow down

    async def ensure_user(self, name, admin=None):
        from danlu.errors import Unreachable

        self.calls.append(("user", name))
        await asyncio.sleep(0)
        if self.unreachable:
            self.unreachable -= 1
            raise Unreachable("MLflow is not answering", reason="mlflow_unreachable")
        self.users.add(name)

    async def check_experiment(self, name, owner, admin, user_exists):
        from danlu.errors import PolicyError

        self.calls.append(("check", owner, name))
        if name == "shared" and owner not in self.users:
            raise PolicyError(
                f"you may not log to experiment '{name}' (your permission: none)", reason="experiment_not_yours"
            )


def access_to(store):
    from danlu.hub.service import mlflow_client as mlflow_access

    access = mlflow_access.MlflowAccess("http://127.0.0.1:1", "secret")
    access.users = store
    return access


async def exists(name):
    return True


def test_a_new_experiment_needs_no_mlflow_user_and_an_existing_one_is_asked_for_one():
    store = Store()
    access = access_to(store)
    asyncio.run(access.check_experiment("alice/first", "alice", False, exists))
    new = list(store.calls)
    asyncio.run(access.check_experiment("shared", "bob", False, exists))  # MLflow's default lets its users write

    assert new == [("check", "alice", "alice/first")]  # nobody was made an MLflow user for it
    assert store.calls[1:] == [("check", "bob", "shared"), ("user", "bob"), ("check", "bob", "shared")]


def test_an_mlflow_user_begun_in_the_background_is_made_once_and_a_start_joins_it():
    store = Store()
    access = access_to(store)

    async def server_started_then_job_started():
        access.prepare_user("alice")  # her server started (POST /runners/warm) or her job was accepted
        access.prepare_user("alice")
        await access.ensure_user("alice")  # her job's start
        await access.ensure_user("alice")  # and her next one's

    asyncio.run(server_started_then_job_started())
    assert store.calls == [("user", "alice")] and store.users == {"alice"}


def test_an_mlflow_user_is_asked_for_again_after_mlflow_did_not_answer():
    store = Store(unreachable=1)
    access = access_to(store)

    async def twice():
        await access.ensure_user("alice")  # a job's start while MLflow is down: the job reports that itself
        await access.ensure_user("alice")  # the next start asks again, and MLflow answers

    asyncio.run(twice())
    assert store.calls == [("user", "alice"), ("user", "alice")] and store.users == {"alice"}
