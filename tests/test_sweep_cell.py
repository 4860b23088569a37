"""Service tier: a sweep from one ``%%train`` cell, run by real kernels, under a quota of 2 GPUs.

The acceptance test of sweeps end to end: the magic in an IPython shell submits the cell to a real
workbench (``danlu up``: JupyterHub, the jobs service, MLflow, local runners and papermill kernels). The
cell has no Optuna or MLflow code: it resumes with ``danlu.resumable`` and logs ``val_loss`` with
``SummaryWriter``, a deterministic curve of its parameters; a learning rate above 0.5 diverges (the cell
raises). ASHA prunes trials at their rungs and promotes others; a 2-GPU job of a higher priority preempts
the running trials, which resume from their checkpoints as the same trials; the one diverging trial
fails; the sweep runs to completion, its parent run names the best trial, and the team never held more
than its 2 GPUs. :mod:`tests.test_sweeps` tests the same loop on a fake backend, faster and in more
cases.
"""

from __future__ import annotations

import re
from datetime import datetime

import pytest

from danlu.hub.testing import Workbench

from .test_queues import notebook, wait_for
from .test_train_magic import magics, shell  # noqa: F401 - the magic in a real shell

pytestmark = pytest.mark.service

CONFIG = {
    "admin_users": ["admin"],
    "users": {"unix_accounts": "off"},
    "groups": {"research": ["alice"]},
    "teams": {"research": {"quota": {"gpus": {"sim": 2}}}},
    "gpus": {"declared": [{"count": 2, "flavor": "sim"}]},
    "resources": {"cpu": 64},
    "priority_classes": {"low": {"value": 100}, "normal": {"value": 1000, "default": True}, "high": {"value": 10000}},
    "jobs": {"grace_period_seconds": 6, "preemption_grace_seconds": 10, "retry_backoff_seconds": 1},
}

PROFILES = {
    "profiles": [
        {
            "slug": "python",
            "display_name": "Python",
            "description": "Everyone's profile.",
            "default": True,
            "environment": {"current": True},
            "resources": {"gpus": [0, 1, 2]},
        }
    ]
}

# seed 9 samples these learning rates, in trial order: 0.0011 0.0025 0.018 0.0109 0.7127 0.0523 0.044 0.1211;
# trial 4's diverges
SWEEP = (
    '--gpus 1 --sweep "lr=loguniform(1e-3,1)" --sweep "batch=choice(32,64)" --trials 8 --objective val_loss:min '
    "--scheduler asha --sampler random --seed 9 --name cell-sweep"
)
CELL = """
import math, time
import danlu
from torch.utils.tensorboard import SummaryWriter

state = danlu.resumable(every=1, best=math.inf)
writer = SummaryWriter()
for step in state.steps(6):
    if lr > 0.5:
        raise FloatingPointError(f"loss is nan at lr {lr}")
    big = batch > 32
    floor = 0.1 + 0.15 * (math.log10(lr) + 2.2) ** 2 + (0.06 if big else 0.0)
    val_loss = floor + 1.5 / (1 + (0.6 if big else 0.35) * (step + 1))
    state.best = min(state.best, val_loss)
    writer.add_scalar("val_loss", val_loss, step + 1)
    writer.flush()
    print("step", step + 1, flush=True)
    time.sleep(1.0)
writer.close()
"""


@pytest.fixture(scope="module")
def wb(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep-cell")
    # pruning decided every half second rather than every 5 s: the trials are short
    (tmp / "danlu_service_config.py").write_text("c.JobsServiceApp.sweep_interval = 0.5\n")
    bench = Workbench(tmp, config=CONFIG, profiles=PROFILES).start()
    bench.tokens = {name: bench.create_user(name, groups) for name, groups in (("alice", ["research"]), ("admin", []))}
    yield bench
    code = bench.stop()
    assert code == 0, bench.log_tail()


def most_gpus_at_once(jobs: list[dict]) -> int:
    """The most GPUs the jobs' attempts held at one time (an end before a start at the same instant)."""
    events = []
    for job in jobs:
        gpus = job["resources"]["gpus"]
        for a in job["attempts"]:
            if a["started_at"]:
                end = a["finished_at"] or "9999-12-31T00:00:00+00:00"
                events += [(datetime.fromisoformat(a["started_at"]), 1, gpus), (datetime.fromisoformat(end), 0, -gpus)]
    held = most = 0
    for _at, _order, change in sorted(events):
        held += change
        most = max(most, held)
    return most


def test_a_sweep_from_one_cell_prunes_promotes_survives_preemption_and_a_failure_and_names_its_best(
    wb,
    shell,  # noqa: F811
    magics,  # noqa: F811
    monkeypatch,
    capsys,
):
    alice = wb.tokens["alice"]
    monkeypatch.setenv("DANLU_URL", wb.url)
    monkeypatch.setenv("DANLU_TOKEN", alice)
    shell.run_cell_magic("train", SWEEP, CELL)
    said = capsys.readouterr().out
    found = re.search(r"Sweep (\w+) \(cell-sweep\) started: 8 trials of val_loss:min, 4 at once, asha/random", said)
    assert found, said
    sweep_id = found.group(1)

    def sweep() -> dict:
        return wb.api("GET", f"/sweeps/{sweep_id}", token=alice).json()

    def until(predicate, timeout: float, what: str) -> None:
        try:
            wait_for(predicate, timeout=timeout, what=what)
        except AssertionError:
            view = sweep()
            jobs = [wb.api("GET", f"/jobs/{t['job_id']}/logs", token=alice).text[-1500:] for t in view["trials"][:3]]
            raise AssertionError(f"{what}: {view}\nlogs of the first trials: {jobs}") from None

    # trial 1 past its fourth step, on one of the team's 2 GPUs (promoted at the rungs of steps 1 and 3, with its
    # next at step 9 it runs to its end): alice's urgent 2-GPU job preempts it and the trial on the other GPU
    def second_trial_at_step_4() -> bool:
        trials = sweep()["trials"]
        if len(trials) < 2 or trials[1]["job_state"] != "running":
            return False
        return "step 4\n" in wb.api("GET", f"/jobs/{trials[1]['job_id']}/logs", token=alice).text

    until(second_trial_at_step_4, 120, "trial 1 past step 4")
    r = wb.api(
        "POST",
        "/jobs",
        token=alice,
        json={"notebook": notebook("print('urgent')"), "name": "urgent", "resources": {"gpus": 2}, "priority": "high"},
    )
    assert r.status_code == 201, r.text
    urgent = r.json()
    assert wb.wait_job(urgent["id"], alice)["state"] == "succeeded"

    until(lambda: sweep()["state"] != "running", 600, "the sweep to end")
    done = sweep()
    trials = done["trials"]
    jobs = {t["job_id"]: wb.api("GET", f"/jobs/{t['job_id']}", token=alice).json() for t in trials}
    logs = {t["number"]: wb.api("GET", f"/jobs/{t['job_id']}/logs", token=alice).text for t in trials}
    states = {t["number"]: t["state"] for t in trials}
    assert done["state"] == "succeeded", (done, states)
    assert len(trials) == 8 and "pruned" in states.values() and "complete" in states.values(), states
    assert states[4] == "failed" and "loss is nan at lr 0.71" in trials[4]["reason"], trials[4]
    assert any(t["rungs"] >= 2 for t in trials), f"no trial was promoted past a rung: {trials}"
    # trial 1 resumed from its checkpoint as the same trial, without using a retry, and ended complete; another
    # trial preempted may have been pruned while it waited for its GPU
    second = trials[1]
    assert second["preemptions"] == 1 and second["state"] == "complete", second
    assert [a["state"] for a in jobs[second["job_id"]]["attempts"]] == ["preempted", "succeeded"]
    assert re.search(r"danlu: asked to stop \(preempted\): saved step [45]", logs[1]), logs[1][-2000:]
    assert re.search(r"danlu: resumed from step [45]", logs[1]), logs[1][-2000:]
    # a stopped trial's log says why in one line, with no traceback of its kernel's shutdown
    assert not [n for n, text in logs.items() if n != 4 and "Traceback" in text], logs
    # the trials are alice's jobs at the sweep's (lowest) priority; the team never held more than its quota
    assert all(j["owner"] == "alice" and j["priority"] == "low" for j in jobs.values())
    assert most_gpus_at_once([*jobs.values(), wb.api("GET", f"/jobs/{urgent['id']}", token=alice).json()]) <= 2
    # the best trial is a complete one, and the parent run names it
    complete = [t for t in trials if t["state"] == "complete"]
    best = min(complete, key=lambda t: t["value"])
    assert done["best"]["number"] == best["number"] and done["best"]["params"] == best["params"]
    parent = wb.mlflow("GET", f"/api/2.0/mlflow/runs/get?run_id={done['mlflow_run_id']}", token=alice).json()["run"]
    tags = {tag["key"]: tag["value"] for tag in parent["data"]["tags"]}
    assert tags["danlu.sweep.best.trial"] == str(best["number"]) and parent["info"]["status"] == "FINISHED"
    assert float(tags["danlu.sweep.best.val_loss"]) == pytest.approx(best["value"])
    # each trial's curve has one point per step it ran, none twice, the preempted ones' included
    for t in complete:
        history = wb.mlflow(
            "GET", f"/api/2.0/mlflow/metrics/get-history?run_id={t['run_id']}&metric_key=val_loss", token=alice
        ).json()["metrics"]
        assert sorted(m["step"] for m in history) == [1, 2, 3, 4, 5, 6], (t["number"], history)
        child = wb.mlflow("GET", f"/api/2.0/mlflow/runs/get?run_id={t['run_id']}", token=alice).json()["run"]
        assert {tag["key"]: tag["value"] for tag in child["data"]["tags"]}["mlflow.parentRunId"] == done[
            "mlflow_run_id"
        ]
