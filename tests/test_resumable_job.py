"""Service tier: a job written with danlu.resumable survives two preemptions and a SIGKILL.

A deterministic CPU training loop (seeded, its data from torch's RNG, which the state saves) runs as a
low-priority job holding the machine's GPU. A high-priority job preempts it twice; then its runner and
kernel are SIGKILLed (an infrastructure failure, retried; the steps since the last save are done
again). It ends with the weights of the same loop run without interruption, and its MLflow run holds
the loss of every step exactly once, with the values the uninterrupted loop logs.
"""

from __future__ import annotations

import re
import signal

import pytest

from danlu.hub.testing import Workbench

from .conftest import PROFILES, job_processes
from .test_queues import notebook, wait_for

pytestmark = pytest.mark.service
torch = pytest.importorskip("torch")

STEPS = 40
CONFIG = {
    "admin_users": ["admin"],
    "users": {"unix_accounts": "off"},
    "gpus": {"declared": [{"count": 1, "flavor": "sim"}]},
    "resources": {"cpu": 64},
    "priority_classes": {"low": {"value": 100}, "normal": {"value": 1000, "default": True}, "high": {"value": 10000}},
    "jobs": {"grace_period_seconds": 6, "preemption_grace_seconds": 10, "retry_backoff_seconds": 1, "warm_runners": 0},
}

LOOP = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)

def train_step(step):
    x = torch.randn(8, 4)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    return loss.item()
"""

JOB = (
    LOOP
    + f"""
import time, danlu
from torch.utils.tensorboard import SummaryWriter
state = danlu.resumable(model=model, optimizer=opt, every=5)
writer = SummaryWriter()
for step in state.steps({STEPS}):
    writer.add_scalar("loss", train_step(step), step)
    writer.flush()
    print("step", step, flush=True)
    time.sleep(0.25)
writer.close()
print("final", repr([round(v, 6) for v in torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()]))
"""
)


def uninterrupted() -> tuple[list[float], str]:
    scope: dict = {}
    exec(LOOP, scope)  # noqa: S102 - the test's own loop, the same text the job runs
    losses = [scope["train_step"](step) for step in range(STEPS)]
    weights = torch.cat([p.detach().flatten() for p in scope["model"].parameters()]).tolist()
    return losses, repr([round(v, 6) for v in weights])


@pytest.fixture(scope="module")
def wb(tmp_path_factory):
    bench = Workbench(tmp_path_factory.mktemp("resumable"), config=CONFIG, profiles=PROFILES).start()
    bench.tokens = {name: bench.create_user(name, []) for name in ("alice", "admin")}
    yield bench
    code = bench.stop()
    assert code == 0, bench.log_tail()


def log(wb, job_id: str) -> str:
    return wb.api("GET", f"/jobs/{job_id}/logs", token=wb.tokens["alice"]).text


def steps_logged(wb, job_id: str) -> int:
    return len(re.findall(r"^(?:\[rank 0\] )?step \d+$", log(wb, job_id), re.M))


def state(wb, job_id: str) -> dict:
    return wb.api("GET", f"/jobs/{job_id}", token=wb.tokens["alice"]).json()


def until(wb, job_id: str, predicate, what: str) -> None:
    try:
        wait_for(predicate, timeout=240, what=what)
    except AssertionError:
        raise AssertionError(f"{what}: job {state(wb, job_id)['state']}, log:\n{log(wb, job_id)[-3000:]}") from None


def preempt(wb, job_id: str, n: int) -> None:
    urgent = wb.api(
        "POST",
        "/jobs",
        token=wb.tokens["alice"],
        json={
            "notebook": notebook("print('urgent')"),
            "name": f"urgent{n}",
            "resources": {"gpus": 1},
            "priority": "high",
        },
    ).json()
    assert wb.wait_job(urgent["id"], wb.tokens["alice"])["state"] == "succeeded"


def test_two_preemptions_and_a_sigkill_end_like_an_uninterrupted_run(wb):
    losses, final = uninterrupted()
    r = wb.api(
        "POST",
        "/jobs",
        token=wb.tokens["alice"],
        json={
            "notebook": notebook(JOB),
            "name": "resumable",
            "resources": {"gpus": 1},
            "priority": "low",
            "retries": 1,
        },
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]

    for n, at in enumerate((6, 16), start=1):  # preempted twice, each time after some more steps
        until(wb, job_id, lambda at=at: steps_logged(wb, job_id) >= at, f"step {at}")
        preempt(wb, job_id, n)
        until(wb, job_id, lambda n=n: log(wb, job_id).count("danlu: resumed from step") >= n, "the resume")

    until(wb, job_id, lambda: steps_logged(wb, job_id) >= 28, "more steps")
    # the runner and its kernel SIGKILLed at once, as when a machine is lost: no SIGTERM, no save, the steps
    # since the last checkpoint are done again, and the points they logged are in the run already
    processes = job_processes(job_id)
    assert any("danlu.runner" in " ".join(p.cmdline()) for p in processes)
    for proc in processes:
        proc.send_signal(signal.SIGKILL)

    done = wb.wait_job(job_id, wb.tokens["alice"], timeout=300)
    text = log(wb, job_id)
    assert done["state"] == "succeeded", text[-3000:]
    assert [a["state"] for a in done["attempts"]] == ["preempted", "preempted", "failed", "succeeded"]
    assert text.count("danlu: resumed from step") == 3
    assert re.search(r"danlu: asked to stop \(preempted\): saved step \d+", text), text[-3000:]
    assert f"final {final}" in text  # the uninterrupted loop's weights

    history = wb.mlflow(
        "GET",
        f"/api/2.0/mlflow/metrics/get-history?run_id={done['mlflow_run_id']}&metric_key=loss",
        token=wb.tokens["alice"],
    ).json()["metrics"]
    steps = sorted(m["step"] for m in history)
    assert steps == list(range(STEPS)), steps  # one point per step: none twice, none missing
    by_step = {m["step"]: m["value"] for m in history}
    assert all(abs(by_step[s] - losses[s]) <= 1e-5 * max(1.0, abs(losses[s])) for s in range(STEPS))
