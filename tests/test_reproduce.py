"""A job's provenance, ``danlu reproduce`` and ``danlu jobs diff``.

In process, on fake backends (tests/fakes.py): two jobs whose setup cells differ show that cell, with a
diff, in ``jobs diff``; reproducing is refused with the reason when an input can no longer be had (the
notebook, the profile, a catalog version); another user's job is a 404; a catalog version is asked for by
its number and a plain path is pinned to the digest its job reported; a runner's ``provenance`` report can
set the seed, an unknown dirty state and a plain path's digest, and nothing else.

Service tier (real runners, kernels and papermill on the local backend, a real MLflow server, one service
for the module as in test_kubernetes_backend.py): a deterministic CPU job (fixed seed, one metric)
reproduced with ``danlu reproduce --wait`` has identical metrics and records its seed in the job and on its
MLflow run; when the data it read changes, the reproduction fails naming the file.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
from pathlib import Path

import nbformat
import pytest
from sqlalchemy import delete

from danlu import cli, cliclient, tags
from danlu.errors import Conflict, Forbidden, NotFound, ValidationError
from danlu.hub.backends.local import LocalBackend
from danlu.hub.profiles import ProfileSet
from danlu.hub.service.mlflow_client import MlflowAccess
from danlu.hub.service.store.orm import DatasetVersion, Job, JobInput
from danlu.hub.service.validation import check_schema
from danlu.submit import build_job_notebook

from .fakes import (
    InstantBackend,
    SlowBackend,
    admin,
    final,
    gpu_profiles,
    make_manager,
    make_settings,
    notebook,
    serving,
    user,
)
from .mlflowkit import running_mlflow
from .servicekit import RunnerAPIService, jupyter_path_of

ALICE = user("alice", "research")
BOB = user("bob")
ADMIN = admin()
PATIENCE = 300.0  # bounds a hang on a busy machine; nothing here measures time


def in_loop(test):
    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


def home(state: Path, name: str = "alice") -> Path:
    folder = state / "users" / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.asynccontextmanager
async def service(tmp_path: Path, backend=None):
    state = tmp_path / "state"
    for name in ("alice", "bob"):
        home(state, name)
    manager = make_manager(backend or InstantBackend(), state, settings=make_settings(state))
    async with serving(manager):
        yield manager


def train_notebook(cell: str, setup: dict[str, str], params: dict | None = None) -> dict:
    """The notebook %%train builds: a parameters cell, the setup cells, the cell."""
    nb = build_job_notebook(cell, params or {}, setup, kernel_name="danlu-python", cell_id="train-cell")
    return json.loads(nbformat.writes(nb))


async def submit(manager, who=ALICE, **body) -> dict:
    status, job = await manager.submit(who, body)
    assert status == 201, job
    return job


async def row(manager, job_id: str) -> Job:
    return await manager.database.read(lambda s: s.get(Job, job_id))


class ManagerClient:
    """What DanluClient answers, from the manager itself (as ``who``): the CLI end to end without HTTP."""

    def __init__(self, call, manager, who):
        self.call, self.manager, self.who = call, manager, who

    def reproduce(self, job_id):
        return self.call(self.manager.reproduce(self.who, job_id))

    def job(self, job_id):
        async def get():
            return await self.manager.job_view(self.who, job_id)

        return self.call(get())

    def compare(self, a, b):
        return self.call(self.manager.compare(self.who, a, b))


# in process ------------------------------------------------------------------------------------------------
def test_a_changed_setup_cell_shows_in_jobs_diff(tmp_path, monkeypatch, capsys):
    cell = "print(x * lr)"

    async def scenario():
        async with service(tmp_path) as manager:
            a = await submit(
                manager,
                notebook=train_notebook(cell, {"s1": "import math\nx = 1\n"}, {"lr": 0.1}),
                parameters={"lr": 0.1},
            )
            b = await submit(
                manager,
                notebook=train_notebook(cell, {"s1": "import math\nx = 2\n"}, {"lr": 0.1}),
                parameters={"lr": 0.1},
            )
            c = await submit(
                manager,
                notebook=train_notebook(cell, {"s1": "import math\nx = 1\n"}, {"lr": 0.2}),
                parameters={"lr": 0.2},
            )
            for job in (a, b, c):
                await final(manager, job["id"])
            return (
                a,
                b,
                c,
                await manager.compare(ALICE, a["id"], b["id"]),
                await manager.compare(ALICE, a["id"], c["id"]),
                manager,
            )

    a, b, c, setup_changed, lr_changed, manager = asyncio.run(scenario())

    check_schema("Comparison", setup_changed)  # the API answers what its OpenAPI document says
    assert [s["what"] for s in setup_changed["source"]] == ["setup cell 1"]
    diff = setup_changed["source"][0]["diff"]
    assert "-x = 1" in diff and "+x = 2" in diff
    assert setup_changed["identical"] == {
        "parameters": True,
        "environment": True,
        "source": False,
        "datasets": True,
        "metrics": None,
    }
    assert setup_changed["metrics"] == "unknown"  # no MLflow run here: unknown, not an error
    assert lr_changed["parameters"] == [{"name": "lr", "a": 0.1, "b": 0.2}]
    assert lr_changed["identical"]["source"] and not lr_changed["identical"]["parameters"]

    answers = {(a["id"], b["id"]): setup_changed}
    client = type("C", (), {"compare": lambda self, x, y: answers[(x, y)]})()
    monkeypatch.setattr(cliclient, "client", lambda args: client)
    assert cli.main(["jobs", "diff", a["id"], b["id"]]) == 0
    table = capsys.readouterr().out
    assert "setup cell 1" in table and "+x = 2" in table and "-x = 1" in table
    assert "source differ" in table and "parameters identical" in table and "metrics unknown" in table
    assert cli.main(["jobs", "diff", a["id"], b["id"], "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == setup_changed


@in_loop
async def test_reproducing_is_refused_when_an_input_can_no_longer_be_had(tmp_path):
    async with service(tmp_path) as manager:
        data = home(tmp_path / "state") / "digits"
        data.mkdir()
        (data / "a.csv").write_text("x,y\n1,2\n")
        await manager.datasets.register(ALICE, {"name": "digits", "path": "digits"})
        job = await submit(manager, notebook=notebook("print(1)"), datasets=["digits@latest"])
        await final(manager, job["id"])
        (data / "a.csv").write_text("x,y\n3,4\n")
        await manager.datasets.register(ALICE, {"name": "digits", "path": "digits"})  # version 2

        again = await manager.reproduce(ALICE, job["id"])  # the version the job read, not the latest
        profiles = manager.reproduction.profiles
        manager.reproduction.profiles = ProfileSet((dataclasses.replace(profiles.default, slug="other"),))
        with pytest.raises(Conflict) as profile_gone:
            await manager.reproduce(ALICE, job["id"])
        manager.reproduction.profiles = ProfileSet((dataclasses.replace(profiles.default, groups=("vision",)),))
        with pytest.raises(Conflict) as not_allowed:
            await manager.reproduce(ALICE, job["id"])
        manager.reproduction.profiles = profiles
        await manager.database.write(lambda s: s.execute(delete(DatasetVersion).where(DatasetVersion.version == 1)))
        with pytest.raises(Conflict) as version_gone:
            await manager.reproduce(ALICE, job["id"])
        await manager.database.write(lambda s: s.execute(delete(JobInput).where(JobInput.job_id == job["id"])))
        with pytest.raises(Conflict) as no_source:
            await manager.reproduce(ALICE, job["id"])
        jobs = await manager.list(ADMIN)
        again_row = await row(manager, again["id"])

    assert again["reproduces"] == job["id"] and again["datasets"] == ["digits@1"] and again["owner"] == "alice"
    assert again_row.provenance["reproduces"] == job["id"]
    assert profile_gone.value.reason == "profile_gone" and "'python'" in profile_gone.value.message
    assert "other" in profile_gone.value.fix
    assert not_allowed.value.reason == "profile_not_allowed" and "vision" in not_allowed.value.message
    assert version_gone.value.reason == "dataset_version_gone" and "digits@1" in version_gone.value.message
    assert version_gone.value.field == "datasets[0]" and "danlu datasets show digits" in version_gone.value.fix
    assert no_source.value.reason == "no_source" and no_source.value.status == 409
    assert len(jobs) == 2  # the refusals submitted nothing


@in_loop
async def test_another_users_job_is_not_found(tmp_path):
    async with service(tmp_path) as manager:
        alices = await submit(manager, notebook=notebook("print(1)"))
        bobs = await submit(manager, BOB, notebook=notebook("print(2)"))
        with pytest.raises(NotFound) as reproduce:
            await manager.reproduce(BOB, alices["id"])
        with pytest.raises(NotFound) as compare:
            await manager.compare(BOB, bobs["id"], alices["id"])
        with pytest.raises(NotFound):
            await manager.compare(BOB, alices["id"], bobs["id"])
        as_admin = await manager.compare(ADMIN, alices["id"], bobs["id"])
        # an admin sees alice's job, but running it again would run alice's code as the admin: refused
        with pytest.raises(Forbidden) as by_admin:
            await manager.reproduce(ADMIN, alices["id"])
        count = len(await manager.list(ADMIN))

    assert reproduce.value.reason == compare.value.reason == "no_such_job" and reproduce.value.status == 404
    assert [s["what"] for s in as_admin["source"]] == ["cell"]  # admins see both
    assert by_admin.value.reason == "not_the_owner" and "alice" in by_admin.value.fix
    assert count == 2  # the refusal submitted nothing


@in_loop
async def test_a_runner_may_add_only_the_seed_an_unknown_dirty_state_and_plain_digests(tmp_path):
    backend = SlowBackend()
    async with service(tmp_path, backend) as manager:
        (home(tmp_path / "state") / "data.csv").write_text("a,b\n1,2\n")
        job = await submit(
            manager,
            notebook=train_notebook("print(lr)", {"s": "import os"}, {"lr": 0.5}),
            parameters={"lr": 0.5},
            datasets=["data.csv"],
            source={"git_commit": "0123abc", "git_dirty": False, "notebook_path": "work/t.ipynb"},
        )
        before = (await row(manager, job["id"])).provenance
        run = await backend.machine.running(job["id"])
        refused = []
        for hostile in (
            {"event": "provenance", "profile": "evil"},
            {"event": "provenance", "parameters": {"lr": 9}},
            {"event": "provenance", "reproduces": "0123456789ab"},
            {"event": "provenance", "seed": "7"},
            {"event": "provenance", "seed": 2**60},
            {"event": "provenance", "seed": True},
            {"event": "provenance", "git_dirty": "yes"},
            {"event": "provenance", "datasets": [{"name": "data.csv", "digest": "not-a-digest"}]},
            {"event": "provenance", "datasets": [{"name": "x", "digest": "a" * 64}] * 101},
        ):
            with pytest.raises(ValidationError) as e:
                await manager.runner_api.event(job["id"], 1, run.launch.token, hostile)
            refused.append(e.value.status)
        await manager.runner_api.event(
            job["id"],
            1,
            run.launch.token,
            {
                "event": "provenance",
                "seed": 7,
                "git_dirty": True,
                "datasets": [
                    {"name": "data.csv", "digest": "d" * 64, "manifest": [["data.csv", 8, "d" * 64]]},
                    {"name": "other.csv", "digest": "e" * 64},
                ],
            },
        )
        await manager.runner_api.event(
            job["id"],
            1,
            run.launch.token,
            {"event": "provenance", "seed": 8, "datasets": [{"name": "data.csv", "digest": "f" * 64}]},
        )
        backend.finish(job["id"])
        done = await final(manager, job["id"])
        after = (await row(manager, job["id"])).provenance
        again = await manager.reproduce(ALICE, job["id"])
        pinned = (await row(manager, again["id"])).datasets

    assert refused == [422] * 9
    assert done["state"] == "succeeded"  # a valid report followed the invalid ones
    assert after["seed"] == 8  # the last seed reported (a later attempt's code sets its own)
    assert after["git"] == {"commit": "0123abc", "dirty": False}  # known at submission: the job cannot change it
    assert after["datasets"] == [
        {"ref": "data.csv", "digest": "d" * 64, "context": "training", "manifest": [["data.csv", 8, "d" * 64]]}
    ]  # once known, kept
    assert {k: after[k] for k in after if k not in ("seed", "datasets")} == {
        k: before[k] for k in before if k not in ("seed", "datasets")
    }
    assert before["setup_cells"][0]["source"] == "import os" and before["parameters"] == {"lr": 0.5}
    assert before["environment"]["kind"] == "python" and len(before["environment"]["digest"]) == 64
    assert pinned[0]["digest"] == "d" * 64 and pinned[0]["pinned_from"] == job["id"]
    assert pinned[0]["manifest"] == [["data.csv", 8, "d" * 64]]


# service tier: real runners and MLflow -----------------------------------------------------------------
DETERMINISTIC = """import random
random.seed(7)
rows = open("data.csv").read().splitlines()
score = sum(random.random() for _ in range(steps)) * len(rows)
import mlflow
mlflow.log_metric("score", score)
print("score", score)
"""


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server on loopback (no permissions: the comparison reads with admin rights)."""
    with running_mlflow(tmp_path_factory.mktemp("mlflow"), PATIENCE) as url:
        yield url


@pytest.fixture(scope="module")
def workbench(mlflow_server, tmp_path_factory):
    state = tmp_path_factory.mktemp("reproduce")

    def backend(settings):
        return LocalBackend(settings=settings, runner_env={"JUPYTER_PATH": str(jupyter_path_of(settings))})

    svc = RunnerAPIService(state, backend, profiles=gpu_profiles(), mlflow=MlflowAccess(mlflow_server)).open()
    try:
        yield svc
    finally:
        svc.close()


def run_final(svc, job_id: str) -> dict:
    return svc.run(final(svc.manager, job_id, patience=PATIENCE, every=0.2))


@pytest.mark.service
def test_a_deterministic_job_reproduced_has_identical_metrics_and_its_seed(
    workbench, mlflow_server, monkeypatch, capsys
):
    svc = workbench
    data = svc.settings.user_home("alice")
    data.mkdir(parents=True, exist_ok=True)
    (data / "data.csv").write_text("x\n1\n2\n")
    nb = train_notebook(DETERMINISTIC, {"setup-1": "import math"}, {"steps": 50})
    status, job = svc.run(
        svc.manager.submit(
            ALICE, {"notebook": nb, "parameters": {"steps": 50}, "datasets": ["data.csv"], "experiment": "alice/repro"}
        )
    )
    assert status == 201, job
    first = run_final(svc, job["id"])
    assert first["state"] == "succeeded", first

    monkeypatch.setattr(cliclient, "client", lambda args: ManagerClient(svc.run, svc.manager, ALICE))
    code = cli.main(["reproduce", job["id"], "--wait", "--json"])
    answer = json.loads(capsys.readouterr().out)
    second, comparison = answer["job"], answer["compare"]
    assert code == 0 and second["state"] == "succeeded", second
    assert second["reproduces"] == job["id"] and second["id"] != job["id"]
    check_schema("Comparison", comparison)
    assert comparison["identical"] == {
        "parameters": True,
        "environment": True,
        "source": True,
        "datasets": True,
        "metrics": True,
    }, comparison
    assert comparison["metrics"] == [] and comparison["parameters"] == []

    records = [
        svc.run(svc.manager.database.read(lambda s, i=i: s.get(Job, i).provenance)) for i in (job["id"], second["id"])
    ]
    assert [r["seed"] for r in records] == [7, 7]
    assert records[0]["datasets"][0]["digest"] and records[0]["datasets"] == records[1]["datasets"]
    from mlflow import MlflowClient

    runs = [MlflowClient(mlflow_server).get_run(j["mlflow_run_id"]) for j in (first, second)]
    assert [r.data.tags[tags.SEED] for r in runs] == ["7", "7"]
    assert runs[0].data.tags[tags.ENV_DIGEST] == records[0]["environment"]["digest"]
    assert runs[0].data.metrics["score"] == runs[1].data.metrics["score"]

    (data / "data.csv").write_text("x\n1\n2\n3\n")  # the data the job read changed
    third = svc.run(svc.manager.reproduce(ALICE, job["id"]))
    ended = run_final(svc, third["id"])
    assert ended["state"] == "failed" and ended["failure"] == "user", ended
    assert f"dataset data.csv changed since job {job['id']} read it: data.csv changed" in ended["reason"]
