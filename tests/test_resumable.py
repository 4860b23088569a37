"""danlu.resumable: atomic checkpoints, intervals, stops, the runner API, metric continuity, ranks."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import danlu  # noqa: E402
from danlu import env, resumable_metrics, resumable_store  # noqa: E402
from danlu.resumable import Resumable, Stopped, _sig, _stopping, parse_every  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for var in (env.RUNNER_API, env.JOB_TOKEN, env.JOB_ID, env.ATTEMPT, env.JOB_DIR, "MLFLOW_RUN_ID", "RANK"):
        monkeypatch.delenv(var, raising=False)
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)
    _sig.update(installed=False, loops=0)
    _stopping.clear()
    resumable_metrics.clear()


def make(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt


def train_step(model, opt):
    x = torch.randn(4, 8)  # from torch's RNG, which the state saves and restores
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_every_parses_steps_and_durations():
    assert parse_every(500) == (500, None)
    assert parse_every("30s") == (None, 30.0)
    assert parse_every("2m") == (None, 120.0)
    assert parse_every("1h") == (None, 3600.0)
    for bad in ("2 weeks", 0, -1, True, "m"):
        with pytest.raises(danlu.errors.UsageError, match="every="):
            parse_every(bad)


def test_interrupted_twice_gives_the_same_weights_as_uninterrupted(tmp_path):
    model, opt = make()
    state = Resumable(every=5, directory=tmp_path / "a", model=model, optimizer=opt)
    for _ in state.steps(23):
        train_step(model, opt)
    expected = weights(model)

    done = []
    for stop_after in (8, 17, None):  # killed twice (steps after the last save are lost and done again)
        torch.manual_seed(1234)  # a new attempt's RNG is not the old one's: the checkpoint's must win
        model, opt = make()
        state = Resumable(every=5, directory=tmp_path / "b", model=model, optimizer=opt)
        for step in state.steps(23):
            train_step(model, opt)
            done.append(step)
            if stop_after is not None and step == stop_after:
                break
    assert torch.equal(weights(model), expected)
    assert done[9:13] == [5, 6, 7, 8]  # steps 5..8 were done again after the first kill
    assert state.resumed and state.resumed_from.step == 15


def test_a_save_killed_half_way_is_ignored(tmp_path):
    model, opt = make()
    state = Resumable(every=2, directory=tmp_path, model=model, optimizer=opt)
    for _ in state.steps(4):
        train_step(model, opt)
    root = resumable_store.root(tmp_path)
    shutil.copytree(root / "step-4", root / ".tmp-step-6-1-1")  # killed before its commit
    shutil.copytree(root / "step-4", root / "step-8")  # a folder without its marker
    (root / "step-8" / "COMMITTED").unlink()
    shutil.copytree(root / "step-4", root / "step-10")  # a file cut short after the marker
    with open(root / "step-10" / "state.pt", "r+b") as f:
        f.truncate(100)
    model2, opt2 = make(seed=5)
    state2 = Resumable(every=2, directory=tmp_path, model=model2, optimizer=opt2)
    assert state2.step == 4 and torch.equal(weights(model2), weights(model))
    assert not (root / ".tmp-step-6-1-1").exists() and not (root / "step-8").exists()  # cleaned at the start


def test_keep_k_newest(tmp_path):
    model, opt = make()
    state = Resumable(every=1, keep=3, directory=tmp_path, model=model, optimizer=opt)
    for _ in state.steps(7):
        train_step(model, opt)
    assert resumable_store.committed_steps(tmp_path) == [7, 6, 5]
    marker = json.loads((resumable_store.root(tmp_path) / "step-7" / "COMMITTED").read_text())
    assert marker["step"] == 7 and all("sha256" in f and "size" in f for f in marker["files"].values())


def test_every_duration_follows_the_clock(tmp_path):
    now = [0.0]
    model, opt = make()
    state = Resumable(every="2m", directory=tmp_path, model=model, optimizer=opt, clock=lambda: now[0])
    for step in state.steps(10):
        now[0] += 50.0  # a step of 50 s: a save every third step (150 s >= 120 s)
        if step == 8:
            assert resumable_store.committed_steps(tmp_path) == [6, 3]
    assert resumable_store.committed_steps(tmp_path)[0] == 10  # and at the end


def test_sigterm_saves_at_the_next_step_and_stops(tmp_path, capsys):
    heard = []
    signal.signal(signal.SIGTERM, lambda *_: heard.append(1))  # the user's own handler is chained
    model, opt = make()
    state = Resumable(every=1000, directory=tmp_path, model=model, optimizer=opt)
    with pytest.raises(Stopped) as stopped:
        for step in state.steps(100):
            train_step(model, opt)
            if step == 6:
                os.kill(os.getpid(), signal.SIGTERM)
    assert stopped.value.step == 7 and not isinstance(stopped.value, Exception) and heard == [1]
    assert resumable_store.committed_steps(tmp_path) == [7]
    assert "asked to stop: saved step 7" in capsys.readouterr().err
    assert stopped.value._render_traceback_() == [str(stopped.value)]


def test_extra_state_round_trip(tmp_path):
    model, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    state = Resumable(
        every=3, directory=tmp_path, model=model, optimizer=opt, scheduler=sched, scaler=scaler, best=None, seen=[]
    )
    for step in state.steps(6):
        train_step(model, opt)
        sched.step()
        state.best, state.seen = 1.0 / (step + 1), state.seen + [step]
    model2, opt2 = make(seed=3)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0)
    state2 = Resumable(
        every=3, directory=tmp_path, model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2, best=None, seen=[]
    )
    assert state2.resumed and state2.step == 6 and state2.best == 1.0 / 6 and state2.seen == list(range(6))
    assert sched2.last_epoch == 6 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert scaler2.get_scale() == 256.0


def test_plain_values_without_torch_objects(tmp_path):
    state = Resumable(every=2, directory=tmp_path, total=0)
    for step in state.steps(4):
        state.total += step
    again = Resumable(every=2, directory=tmp_path, total=0)
    assert again.total == 6 and again.step == 4


class FakeRunnerAPI(BaseHTTPRequestHandler):
    """The runner API's two routes a kernel uses: /stop (with the save counter) and /events."""

    answer: dict = {}
    events: list = []

    def do_GET(self):
        self._reply(self.answer if self.path.endswith("/stop") else None)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.headers.get("Authorization") == "Bearer tok":
            self.events.append((self.path, body))
        self._reply({})

    def _reply(self, data):
        raw = json.dumps(data).encode()
        self.send_response(200 if data is not None else 404)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


@pytest.fixture
def runner_api(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeRunnerAPI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FakeRunnerAPI.answer, FakeRunnerAPI.events = {"reason": None, "grace": 30, "save": 0}, []
    monkeypatch.setenv(env.RUNNER_API, f"http://127.0.0.1:{server.server_port}/api/v1")
    monkeypatch.setenv(env.JOB_TOKEN, "tok")
    monkeypatch.setenv(env.JOB_ID, "job1")
    monkeypatch.setenv(env.ATTEMPT, "2")
    yield FakeRunnerAPI
    server.shutdown()


def test_save_now_and_checkpoint_reports(tmp_path, runner_api):
    model, opt = make()
    state = Resumable(every=1000, directory=tmp_path, model=model, optimizer=opt)
    for step in state.steps(5):
        if step == 1:
            state.service.poll()  # the baseline (the thread's first poll, made here so the test needs no wait)
            runner_api.answer = {"reason": None, "grace": 30, "save": 1}  # danlu jobs checkpoint JOB
            state.service.poll()
    assert resumable_store.committed_steps(tmp_path) == [5, 2]  # saved at the next step, and at the end
    deadline = __import__("time").monotonic() + 5
    while len(runner_api.events) < 2 and __import__("time").monotonic() < deadline:
        threading.Event().wait(0.05)
    path, body = runner_api.events[0]
    assert path == "/api/v1/runner/jobs/job1/attempts/2/events"
    assert sorted(b["step"] for _, b in runner_api.events) == [2, 5] and body["event"] == "checkpoint"


def test_an_older_service_is_ignored(tmp_path, runner_api, capsys):
    runner_api.answer = None  # 404 on /stop
    state = Resumable(every=2, directory=tmp_path, n=0)
    assert state.service.poll() is None
    list(state.steps(2))
    assert "did not answer" not in capsys.readouterr().err


def steps_in(folder: Path) -> dict:
    from danlu.tensorboard.reader import EventFile

    out: dict = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        events, _ = EventFile(str(path)).read(1 << 20)
        for _wall, step, values in events:
            for tag, _value in values:
                out.setdefault(tag, []).append(step)
    return out


def test_metrics_already_logged_are_skipped_after_a_resume(tmp_path, monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    jobdir = tmp_path / "job"
    first = SummaryWriter(str(jobdir / "tensorboard" / "rank-0"))
    for step in range(8):  # the killed attempt logged up to step 7; its checkpoint is of step 5
        first.add_scalar("loss", float(step), step)
    first.add_scalar("val/acc", 0.5, 4)
    first.close()
    monkeypatch.setenv(env.JOB_DIR, str(jobdir))
    floors = resumable_metrics.high_steps(None, jobdir)
    assert floors == {"loss": 7, "val/acc": 4}
    resumable_metrics.install(floors)

    second = SummaryWriter(str(tmp_path / "again"))
    for step in range(5, 10):
        second.add_scalar("loss", float(step), step)
        second.add_scalar("val/acc", 0.6, step)
    second.close()
    steps = steps_in(tmp_path / "again")
    assert steps == {"loss": [8, 9], "val/acc": [5, 6, 7, 8, 9]}

    class FakeMlflow:
        logged = []

        @staticmethod
        def log_metric(key, value, step=None, **kw):
            FakeMlflow.logged.append((key, step))

        @staticmethod
        def log_metrics(metrics, step=None, **kw):
            FakeMlflow.logged.extend((k, step) for k in metrics)

    resumable_metrics._wrap_mlflow(FakeMlflow)
    FakeMlflow.log_metric("loss", 1.0, step=7)
    FakeMlflow.log_metric("loss", 1.0, step=8)
    FakeMlflow.log_metric("loss", 1.0)  # no step: cannot be placed, logged
    FakeMlflow.log_metrics({"loss": 1.0, "val/acc": 1.0}, step=6)
    assert FakeMlflow.logged == [("loss", 8), ("loss", None), ("val/acc", 6)]


AUTOLOGGED = """
import sys
import torch.utils.tensorboard.writer as writer_module
from danlu import resumable_metrics
from danlu.tensorboard import writer
writer.activate(writer_module)  # what auto-logging does in a job's kernel: the fast add_scalar, itself a wrapper
resumable_metrics.install({"loss": 7})
w = writer_module.SummaryWriter(sys.argv[1])
for step in range(5, 10):
    w.add_scalar("loss", float(step), step)
w.close()
"""


def test_metrics_already_logged_are_skipped_behind_auto_loggings_writer(tmp_path):
    # auto-logging's add_scalar carries __wrapped__ too: resumable's own mark, not that, says it wrapped already
    out = subprocess.run([sys.executable, "-c", AUTOLOGGED, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert steps_in(tmp_path) == {"loss": [8, 9]}


RANKS_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from danlu.resumable import Resumable
dist.init_process_group("gloo")
base, sharded = sys.argv[1], sys.argv[2] == "1"

def attempt(folder, stop_after=-1, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = Resumable(every=3, directory=folder, sharded=sharded, model=model, optimizer=opt)
    start = state.step
    for step in state.steps(9):
        x = torch.randn(4, 6)
        opt.zero_grad(); model(x).pow(2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        if step == stop_after:
            break  # killed: the steps after the checkpoint of step 3 are lost
    return start, torch.cat([p.detach().flatten() for p in model.parameters()])

_, whole = attempt(f"{base}/whole")
attempt(f"{base}/cut", stop_after=4)
start, resumed = attempt(f"{base}/cut", seed=dist.get_rank() + 7)
print(f"rank {dist.get_rank()} start {start} same {torch.equal(whole, resumed)}")
dist.destroy_process_group()
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sharded", [False, True])
def test_torchrun_ranks_resume_together(tmp_path, sharded):
    """Two gloo ranks: rank 0 saves and both load (or both write with torch.distributed.checkpoint); a run
    killed after step 4 and resumed from step 3 ends with the uninterrupted run's weights on every rank."""
    script = tmp_path / "train.py"
    script.write_text(RANKS_SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
        + [str(script), str(tmp_path), "1" if sharded else "0"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # the two ranks share one stdout: their lines may come out run together
    lines = sorted(re.findall(r"rank \d start \d+ same (?:True|False)", out.stdout))
    assert lines == ["rank 0 start 3 same True", "rank 1 start 3 same True"], out.stdout
    marker = json.loads((resumable_store.root(tmp_path / "cut") / "step-9" / "COMMITTED").read_text())
    assert marker["format"] == ("dcp" if sharded else "torch")


def test_an_earlier_attempts_stop_file_is_passed_over_and_a_new_one_stops(tmp_path, monkeypatch):
    jobdir = tmp_path / "job"
    jobdir.mkdir()
    (jobdir / "stop").write_text(json.dumps({"reason": "preempted", "grace": 30}))  # attempt 1's
    monkeypatch.setenv(env.JOB_DIR, str(jobdir))
    now = [0.0]
    state = Resumable(every=1000, directory=tmp_path / "ckpt", n=0, clock=lambda: now[0])
    with pytest.raises(Stopped) as stopped:
        for step in state.steps(50):
            now[0] += 0.5
            if step == 10:  # this attempt's runner got SIGTERM and tells its ranks
                os.unlink(jobdir / "stop")
                (jobdir / "stop").write_text(json.dumps({"reason": "cancelled", "grace": 30}))
    assert 11 <= stopped.value.step <= 13 and stopped.value.reason == "cancelled"


def test_the_runs_highest_steps_come_from_mlflow(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("x")).info.run_id
    for step in range(12):
        client.log_metric(run_id, "loss", 1.0 / (step + 1), step=step)
    client.log_metric(run_id, "val/acc", 0.5, step=10)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert resumable_metrics.high_steps(run_id, None) == {"loss": 11, "val/acc": 10}
