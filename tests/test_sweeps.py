"""Sweeps: a set of ordinary jobs from one cell, searched by Optuna and pruned by ASHA, through the service.

Pure: every malformed sweep is refused naming its field and the fix. Service tier, on
:class:`~tests.sweepkit.CurveBackend` (fake runners that log a deterministic learning curve) and the
service's own manager: the acceptance test -- a sweep under a quota of 2 GPUs, with a real MLflow, runs to
completion with pruned, promoted, preempted and failed trials, its trials' runs are children of its parent
run, which names the best trial -- then stopping, permissions and a restart, with the objective read from
the backend's points instead of MLflow. Then the magic and the CLI relay the service's refusal as it is.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import requests

from danlu.errors import Conflict, DanluError, NotFound, UsageError
from danlu.hub.service.mlflow_client import MlflowAccess
from danlu.hub.service.sweeps.space import parse_request

from .fakes import FakeGroups, admin, make_manager, make_settings, notebook, serving, until, user
from .mlflowkit import running_mlflow
from .sweepkit import CurveBackend, PointsObjective, most_at_once
from .test_train_magic import magics, shell  # noqa: F401 - the magic in a real shell

ALICE, BOB, ADMIN = user("alice", "research"), user("bob"), admin()
CELL = notebook("train(lr, batch)")


def body(*sweep: str, **options) -> dict:
    job = options.pop("job", {})
    return {
        "job": {"notebook": CELL, "resources": {"nproc": 1, "gpus": 1}, **job},
        "sweep": list(sweep) or ["lr=loguniform(1e-4,1e-1)", "batch=choice(32,64)"],
        "objective": "val_loss:min",
        **options,
    }


# parsing: pure ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("sweep", "options", "field", "words"),
    [
        (["lr=lognormal(1e-4,1e-1)"], {}, "sweep[0]", "unknown distribution 'lognormal'"),
        (["lr=uniform(a,1)"], {}, "sweep[0]", "bound 'a' is not a number"),
        (["lr=uniform(1,1)"], {}, "sweep[0]", "low 1.0 is not below high 1.0"),
        (["lr=loguniform(0,1)"], {}, "sweep[0]", "loguniform needs low > 0"),
        (["n=int(1.5,4)"], {}, "sweep[0]", "int() takes whole numbers"),
        (["lr"], {}, "sweep[0]", "is not NAME=DISTRIBUTION(ARGS)"),
        (["lr=uniform(0,1)", "lr=uniform(0,2)"], {}, "sweep[1]", "swept twice"),
        ([], {"objective": "val_loss"}, "objective", "is not METRIC:min or METRIC:max"),
        ([], {"objective": "val_loss:lowest"}, "objective", "is not METRIC:min or METRIC:max"),
        ([], {"trials": 0}, "trials", "from 1 to 1000"),
        ([], {"parallel": 65}, "parallel", "from 1 to 64"),
        ([], {"scheduler": "pbt"}, "scheduler", "use asha, hyperband, none"),
        ([], {"sampler": "cmaes"}, "sampler", "use tpe, random"),
    ],
)
def test_a_malformed_sweep_is_refused_naming_its_field_and_the_fix(sweep, options, field, words):
    with pytest.raises(UsageError) as e:
        parse_request(body(*sweep, **options), max_trials=1000, max_parallel=64)
    assert e.value.status == 400 and e.value.field == field and e.value.fix, e.value
    assert words in str(e.value)


def test_a_sweep_parses_into_its_space_and_objective():
    spec = parse_request(
        body("lr=loguniform(1e-4, 1e-1)", "batch=choice(32, 64)", "layers=int(1,4)", "act=choice(relu,'gelu')"),
        max_trials=1000,
        max_parallel=64,
    )
    assert [d.to_dict() for d in spec.space] == [
        {"distribution": "loguniform", "low": 1e-4, "high": 0.1},
        {"distribution": "choice", "choices": [32, 64]},
        {"distribution": "int", "low": 1, "high": 4},
        {"distribution": "choice", "choices": ["relu", "gelu"]},
    ]
    assert (spec.metric, spec.direction, spec.scheduler, spec.sampler, spec.trials) == (
        "val_loss",
        "minimize",
        "asha",
        "tpe",
        16,
    )


# the service ------------------------------------------------------------------------------------------------
def settings_for(state, **jobs):
    return make_settings(
        state,
        teams={"research": {"quota": {"gpus": {"sim": 2}}}},
        gpus={"declared": [{"count": 4, "flavor": "sim"}]},
        jobs={"preemption_grace_seconds": 1, **jobs},
    )


def manager_for(tmp_path, backend, mlflow=None):
    state = tmp_path / "state"
    for name in ("alice", "bob", "admin"):
        (state / "users" / name).mkdir(parents=True, exist_ok=True)
    manager = make_manager(backend, state, settings=settings_for(state), groups=FakeGroups(), mlflow=mlflow)
    manager.sweeps.interval = 0.02
    if mlflow is None:
        manager.sweeps.source = PointsObjective(backend)
    return manager


async def ended(manager, sweep_id: str, patience: float = 120.0) -> dict:
    async def check():
        view = await manager.sweeps.view(ADMIN, sweep_id)
        return view if view["state"] != "running" else None

    return await until(check, f"sweep {sweep_id} to end", patience, 0.05)


def test_a_sweep_from_one_cell_under_a_quota_of_2_prunes_promotes_survives_preemption_and_names_its_best(tmp_path):
    """The acceptance test, with a real MLflow: trials are alice's jobs at the sweep's (low) priority."""
    with running_mlflow(tmp_path, 120) as url:
        backend = CurveBackend(pace=0.05, mlflow=url)
        manager = manager_for(tmp_path, backend, MlflowAccess(url))

        async def scenario():
            async with serving(manager):
                sweep_body = body(
                    trials=10,
                    parallel=3,
                    scheduler="asha",
                    sampler="random",
                    seed=7,
                    reduction_factor=2,
                    job={"parameters": {"steps": 8}, "name": "cnn"},
                )
                backend.fail_names.add("cnn-t2")
                status, created = await manager.sweeps.create(ALICE, sweep_body)
                first = created["trials"][0]["job_id"]
                # a higher-priority job of alice's own team preempts a running trial
                await until(lambda: len([e for e in backend.events if e[1] == "start"]) >= 2, "two trials to start")
                _s, urgent = await manager.submit(
                    ALICE,
                    {
                        "notebook": CELL,
                        "resources": {"gpus": 2},
                        "priority": "urgent",
                        "name": "urgent",
                        "parameters": {"steps": 2},
                    },
                )
                done = await ended(manager, created["id"])
                jobs = {t["job_id"]: await manager.get(ADMIN, t["job_id"]) for t in done["trials"]}
                return status, created, first, urgent, done, jobs

        status, created, first, urgent, done, jobs = asyncio.run(scenario())
        parent = requests.get(f"{url}/api/2.0/mlflow/runs/get", params={"run_id": done["mlflow_run_id"]}).json()
        children = {}
        for t in done["trials"]:
            if t["run_id"]:
                run = requests.get(f"{url}/api/2.0/mlflow/runs/get", params={"run_id": t["run_id"]}).json()["run"]
                children[t["number"]] = {tag["key"]: tag["value"] for tag in run["data"]["tags"]}
    assert status == 201 and created["state"] == "running" and created["options"]["priority"] == "normal"
    assert done["state"] == "succeeded", done
    states = [t["state"] for t in done["trials"]]
    assert len(states) == 10 and "pruned" in states and "complete" in states, states
    failed = [t for t in done["trials"] if t["state"] == "failed"]
    assert [t["number"] for t in failed] == [2] and "loss is nan" in failed[0]["reason"]
    assert any(t["preemptions"] >= 1 and t["state"] in ("complete", "pruned") for t in done["trials"]), done["trials"]
    assert any(t["rungs"] >= 2 for t in done["trials"]), "no trial was promoted past a rung"
    assert all(job.owner == "alice" and job.priority_class == "normal" for job in jobs.values())
    # a pruned trial's job is cancelled at once (unless it finished its last step between the read and the cancel)
    pruned_jobs = [jobs[t["job_id"]].state for t in done["trials"] if t["state"] == "pruned"]
    assert "cancelled" in pruned_jobs and set(pruned_jobs) <= {"cancelled", "succeeded"}, pruned_jobs
    # never more trials at once than the team's quota (2 GPUs), the urgent job included
    assert most_at_once(backend.events) <= 2
    complete = [t for t in done["trials"] if t["state"] == "complete"]
    best = min(complete, key=lambda t: t["value"])
    assert done["best"]["number"] == best["number"] and done["best"]["params"] == best["params"]
    assert done["best_curve"][-1]["best"] == best["value"]
    tags = {tag["key"]: tag["value"] for tag in parent["run"]["data"]["tags"]}
    assert tags["danlu.sweep.best.trial"] == str(best["number"])
    assert float(tags["danlu.sweep.best.val_loss"]) == pytest.approx(best["value"])
    assert parent["run"]["info"]["status"] == "FINISHED"
    assert children and all(c["mlflow.parentRunId"] == done["mlflow_run_id"] for c in children.values())


def test_stopping_a_sweep_cancels_its_trials_and_only_its_owner_or_an_admin_sees_or_stops_it(tmp_path):
    backend = CurveBackend(pace=0.5)
    manager = manager_for(tmp_path, backend)

    async def scenario():
        async with serving(manager):
            _s, created = await manager.sweeps.create(
                ALICE, body(trials=6, parallel=3, scheduler="none", job={"parameters": {"steps": 50}})
            )
            sweep_id = created["id"]
            hidden = []
            for call in (manager.sweeps.view(BOB, sweep_id), manager.sweeps.stop(BOB, sweep_id)):
                with pytest.raises(NotFound) as e:
                    await call
                hidden.append(e.value.status)
            bobs = await manager.sweeps.page(BOB)
            admins = await manager.sweeps.page(ADMIN)
            await until(lambda: len(backend.machine.alive()) >= 2, "two trials to run")
            stopped = await manager.sweeps.stop(ALICE, sweep_id)
            with pytest.raises(Conflict):
                await manager.sweeps.stop(ALICE, sweep_id)
            jobs = [await manager.get(ADMIN, t["job_id"]) for t in stopped["trials"]]
            await until(lambda: not backend.machine.alive(), "the trials' runners to end")
            return hidden, bobs, admins, stopped, jobs

    hidden, bobs, admins, stopped, jobs = asyncio.run(scenario())
    assert hidden == [404, 404] and bobs == {"sweeps": []} and [s["id"] for s in admins["sweeps"]] == [stopped["id"]]
    assert stopped["state"] == "stopped" and stopped["reason"] == "stopped by alice"
    assert len(jobs) == 3 and all(j.state == "cancelled" for j in jobs)
    assert all(t["state"] == "stopped" for t in stopped["trials"])


def test_a_restarted_service_picks_a_running_sweep_up_where_it_was(tmp_path):
    backend = CurveBackend(pace=0.05)
    first = manager_for(tmp_path, backend)

    async def scenario():
        async with serving(first):
            _s, created = await first.sweeps.create(
                ALICE, body(trials=5, parallel=2, scheduler="none", job={"parameters": {"steps": 6}})
            )
            await until(lambda: backend.points, "a trial to log")
        second = manager_for(tmp_path, backend)
        async with serving(second):
            return await ended(second, created["id"])

    done = asyncio.run(scenario())
    assert done["state"] == "succeeded" and [t["state"] for t in done["trials"]] == ["complete"] * 5, [
        (t["number"], t["state"], t["job_state"], t["reason"]) for t in done["trials"]
    ]
    assert sorted(t["number"] for t in done["trials"]) == [0, 1, 2, 3, 4]


def test_a_sweep_whose_first_trials_never_log_the_objective_stops_saying_so(tmp_path):
    backend = CurveBackend(pace=0.01)
    manager = manager_for(tmp_path, backend)

    async def scenario():
        async with serving(manager):
            _s, created = await manager.sweeps.create(
                ALICE, body(trials=8, parallel=1, objective="accuracy:max", job={"parameters": {"steps": 2}})
            )
            return await ended(manager, created["id"])

    done = asyncio.run(scenario())
    assert done["state"] == "failed" and "never logged the objective accuracy" in done["reason"]
    assert len(done["trials"]) == 3 and all("never logged" in t["reason"] for t in done["trials"])


def test_a_sweep_the_service_refuses_queues_nothing(tmp_path):
    backend = CurveBackend()
    manager = manager_for(tmp_path, backend)

    async def scenario():
        async with serving(manager):
            errors = []
            for bad in (
                body("lr=normal(0,1)"),
                body(job={"profile": "no-such-profile"}),
                body(job={"resources": {"gpus": 99}}),
                body(job={"notebook": "not a notebook"}),
                body(job={"parameters": {"lr": 0.1}}),
            ):
                with pytest.raises(DanluError) as e:
                    await manager.sweeps.create(ALICE, bad)
                errors.append((e.value.status, e.value.field))
            return errors, await manager.list(ADMIN), await manager.sweeps.page(ADMIN)

    errors, jobs, sweeps = asyncio.run(scenario())
    assert [field for _status, field in errors] == [
        "sweep[0]",
        "job.profile",
        "job.resources.gpus",
        "job.notebook",
        "sweep[0]",
    ], errors
    assert all(400 <= status < 500 for status, _ in errors)
    assert jobs == [] and sweeps == {"sweeps": []}


# the magic and the CLI relay the service's words --------------------------------------------------------------
class ServiceWords:
    """A client whose ``POST /sweeps`` answers as the service does: the body checked by the service's own
    parser, a refusal sent as the HTTP handler writes it (status, reason, message, field, fix) and parsed back
    by the client's one error parser; an accepted sweep as its view's first fields."""

    def __init__(self):
        self.bodies: list[dict] = []

    def start_sweep(self, body: dict) -> dict:
        from danlu.client import error_from

        self.bodies.append(body)
        try:
            spec = parse_request(body, max_trials=1000, max_parallel=64)
        except UsageError as e:
            raise error_from(400, json.dumps({**e.to_dict(), "fix": e.fix})) from None
        return {
            "id": "0123456789ab",
            "name": "sweep-012345",
            "objective": {"text": spec.objective},
            "options": {"trials": spec.trials, "parallel": spec.parallel, "scheduler": "asha", "sampler": "tpe"},
        }


def service_message(sweep: str) -> str:
    with pytest.raises(UsageError) as e:
        parse_request(body(sweep), max_trials=1000, max_parallel=64)
    return str(e.value)


def test_the_magic_and_the_cli_show_the_services_refusal_in_one_line(shell, magics, tmp_path, monkeypatch, capsys):  # noqa: F811
    from IPython.core.error import UsageError as IPythonUsageError

    from danlu import cli, cliclient

    client = ServiceWords()
    magics.client_factory = lambda: client
    expected = service_message("lr=loguniform(0,1e-1)")
    with pytest.raises(IPythonUsageError) as magic:
        shell.run_cell_magic("train", '--sweep "lr=loguniform(0,1e-1)" --objective val_loss:min', "train(lr)")
    shell.run_cell_magic(
        "train",
        '--sweep "lr=loguniform(1e-4,1e-1)" --sweep "batch=choice(32,64)" --trials 64 '
        "--objective val_loss:min --scheduler asha --parallel 2 --seed 3",
        "train(lr, batch)",
    )
    started = capsys.readouterr().out
    path = tmp_path / "train.ipynb"
    path.write_text(json.dumps(CELL))
    monkeypatch.setattr(cliclient, "client", lambda args: client)
    code = cli.main(["jobs", "submit", str(path), "--sweep", "lr=loguniform(0,1e-1)", "--objective", "val_loss:min"])
    err = capsys.readouterr().err
    assert str(magic.value) == expected and "\n" not in expected
    assert code == 2 and err == f"danlu: {expected}\n"
    assert "Sweep 0123456789ab (sweep-012345) started: 64 trials of val_loss:min, 2 at once" in started
    sent = client.bodies[1]
    assert sent["sweep"] == ["lr=loguniform(1e-4,1e-1)", "batch=choice(32,64)"] and sent["seed"] == 3
    assert (sent["trials"], sent["parallel"], sent["scheduler"]) == (64, 2, "asha") and "notebook" in sent["job"]


@pytest.mark.postgres
def test_optuna_keeps_its_tables_in_a_schema_of_its_own_on_postgresql():
    """On PostgreSQL Optuna's tables go into schema danlu_optuna of the jobs database: its own alembic_version
    would otherwise clash with the jobs database's, whatever search_path the jobs database's URL sets."""
    import optuna
    from sqlalchemy import create_engine, text

    from danlu.hub.service.sweeps import engine

    from .conftest import NO_POSTGRES, POSTGRES_URL, cannot_run

    if not POSTGRES_URL:
        cannot_run("postgres", NO_POSTGRES)
    jobs_url = POSTGRES_URL + ("&" if "?" in POSTGRES_URL else "?") + "options=-csearch_path%3Ddanlu_jobs_elsewhere"
    study = optuna.create_study(
        study_name="schema-probe", storage=engine.make_storage(engine.storage_url_for(jobs_url)), load_if_exists=True
    )
    trial = study.ask()
    trial.report(1.0, 1)
    study.tell(trial, 0.5)
    found = create_engine(POSTGRES_URL)
    with found.connect() as c:
        schemas = {
            row[0]
            for row in c.execute(
                text("SELECT table_schema FROM information_schema.tables WHERE table_name IN ('studies', 'trials')")
            )
        }
    found.dispose()
    assert schemas == {engine.PG_SCHEMA}
