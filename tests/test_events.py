"""Pure tests of metric forwarding and of the SummaryWriter patch in jobs.

:class:`danlu.events.MetricForwarder` reads real TensorBoard event files (written
here with ``torch.utils.tensorboard.SummaryWriter``) and sends their scalars to
a recording fake of the MLflow client. :mod:`danlu.autolog` is checked for
where an unconfigured ``SummaryWriter()`` writes inside a job and which log
dirs it registers for the forwarder.
"""

from __future__ import annotations

import atexit

import pytest
from IPython import get_ipython
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard import writer as tensorboard_writer

from danlu import autolog
from danlu.events import MAX_BATCH, MetricForwarder, metric_key


class RecordingClient:
    """Records every log_batch call, like MLflow accepting each batch."""

    def __init__(self):
        self.batches: list[list] = []

    def log_batch(self, run_id, metrics, synchronous):
        assert run_id == "run-1" and synchronous is True
        self.batches.append(list(metrics))

    @property
    def points(self) -> list[tuple]:
        return [(m.key, m.step, m.value) for batch in self.batches for m in batch]


class UnreachableOnceClient(RecordingClient):
    """Accepts ``after`` calls, fails the next ``failures`` (MLflow briefly unreachable), then accepts again."""

    def __init__(self, failures: int = 1, after: int = 0):
        super().__init__()
        self.failures = failures
        self.after = after
        self.calls = 0

    def log_batch(self, run_id, metrics, synchronous):
        self.calls += 1
        if self.after < self.calls <= self.after + self.failures:
            raise ConnectionError("MLflow is unreachable")
        super().log_batch(run_id, metrics, synchronous)


def write_scalars(log_dir, tag: str, steps) -> None:
    with SummaryWriter(log_dir=str(log_dir)) as writer:
        for step in steps:
            writer.add_scalar(tag, step / 2, step)


def forwarder(client, tmp_path, *dirs) -> MetricForwarder:
    return MetricForwarder(client, "run-1", tmp_path / "logdirs", list(dirs))


# MetricForwarder --------------------------------------------------------------------

def test_every_point_is_forwarded_once(tmp_path):
    log_dir = tmp_path / "tb"
    write_scalars(log_dir, "loss", range(5))
    write_scalars(log_dir / "eval", "accuracy", range(3))
    client = RecordingClient()
    fwd = forwarder(client, tmp_path, log_dir, log_dir / "eval")

    assert fwd.flush() == 8
    assert fwd.flush() == 0

    assert sorted(client.points) == sorted([("loss", s, s / 2) for s in range(5)]
                                           + [("accuracy", s, s / 2) for s in range(3)])
    assert fwd.sent == 8


def test_points_written_later_are_sent_by_the_next_flush(tmp_path):
    log_dir = tmp_path / "tb"
    client = RecordingClient()
    fwd = forwarder(client, tmp_path, log_dir)
    writer = SummaryWriter(log_dir=str(log_dir))
    writer.add_scalar("loss", 1.0, 0)
    writer.flush()
    fwd.flush()

    writer.add_scalar("loss", 0.5, 1)
    writer.add_scalar("loss", 0.25, 2)
    writer.close()
    fwd.flush()

    assert [[(m.step, m.value) for m in batch] for batch in client.batches] == [[(0, 1.0)], [(1, 0.5), (2, 0.25)]]


def test_log_dirs_registered_in_the_logdirs_file_are_read(tmp_path):
    log_dir = tmp_path / "elsewhere"
    write_scalars(log_dir, "loss", range(2))
    (tmp_path / "logdirs").write_text(f"{log_dir}\n\n{log_dir}\n")
    client = RecordingClient()

    assert forwarder(client, tmp_path).flush() == 2


def test_batches_hold_at_most_1000_metrics(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(2 * MAX_BATCH + 500))
    client = RecordingClient()

    forwarder(client, tmp_path, tmp_path / "tb").flush()

    assert [len(batch) for batch in client.batches] == [MAX_BATCH, MAX_BATCH, 500]
    assert [m.step for batch in client.batches for m in batch] == list(range(2 * MAX_BATCH + 500))


def test_metrics_stay_pending_when_log_batch_fails(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(4))
    client = UnreachableOnceClient()
    fwd = forwarder(client, tmp_path, tmp_path / "tb")

    with pytest.raises(ConnectionError):
        fwd.flush()
    assert client.points == []

    assert fwd.flush() == 4
    assert client.points == [("loss", s, s / 2) for s in range(4)]


def test_partly_sent_flush_resumes_where_it_stopped(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(MAX_BATCH + 200))
    client = UnreachableOnceClient(after=1)  # first batch goes through, the second fails
    fwd = forwarder(client, tmp_path, tmp_path / "tb")

    with pytest.raises(ConnectionError):
        fwd.flush()
    fwd.flush()

    assert [m.step for batch in client.batches for m in batch] == list(range(MAX_BATCH + 200))


def test_sent_counts_batches_sent_before_a_failure(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(MAX_BATCH + 200))
    fwd = forwarder(UnreachableOnceClient(after=1), tmp_path, tmp_path / "tb")

    with pytest.raises(ConnectionError):
        fwd.flush()
    fwd.flush()

    assert fwd.sent == MAX_BATCH + 200


def test_tags_become_legal_metric_names():
    assert metric_key("loss/train") == "loss/train"
    assert metric_key("acc@top-1 (val)") == "acc_top-1 _val_"
    assert metric_key("") == "metric"
    assert len(metric_key("x" * 300)) == 250


# autolog: SummaryWriter() inside a job ----------------------------------------------

@pytest.fixture
def job(tmp_path, monkeypatch):
    """A job's folder and environment, with autolog state reset before and undone after."""
    jobdir = tmp_path / "job"
    jobdir.mkdir()
    monkeypatch.setenv("DANLU_JOB_DIR", str(jobdir))
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(autolog, "_state", {"active": False, "mlflow": False})
    cls = tensorboard_writer.SummaryWriter
    original_init = cls.__init__
    yield jobdir
    cls.__init__ = original_init
    if "_danlu_patched" in cls.__dict__:
        del cls._danlu_patched
    atexit.unregister(autolog.flush_writers)
    shell = get_ipython()
    if shell is not None and autolog.flush_writers in shell.events.callbacks["post_run_cell"]:
        shell.events.unregister("post_run_cell", autolog.flush_writers)
    for writer in list(autolog._writers):
        writer.close()


def test_default_writer_goes_to_the_job_folder_and_is_registered(job):
    autolog.activate()

    with SummaryWriter() as writer:
        writer.add_scalar("loss", 1.0, 0)

    rank_dir = job / "tensorboard" / "rank-0"
    assert writer.log_dir == str(rank_dir)
    assert list(rank_dir.glob("events.out.tfevents.*"))
    assert (job / "tensorboard" / "logdirs").read_text() == f"{rank_dir.resolve()}\n"


def test_explicit_log_dirs_are_registered_once(job, tmp_path):
    autolog.activate()
    autolog.activate()  # idempotent: the class is patched once

    for _ in range(2):
        SummaryWriter(log_dir=str(tmp_path / "mine")).close()

    assert (job / "tensorboard" / "logdirs").read_text().splitlines() == [str((tmp_path / "mine").resolve())]


def test_other_ranks_write_their_own_folder_without_registering(job, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    autolog.activate()

    SummaryWriter().close()

    assert list((job / "tensorboard" / "rank-1").glob("events.out.tfevents.*"))
    assert not (job / "tensorboard" / "logdirs").exists()


def test_forwarder_finds_what_an_unconfigured_writer_wrote(job):
    autolog.activate()
    with SummaryWriter() as writer:
        for step in range(3):
            writer.add_scalar("loss", 1.0 / (step + 1), step)
    client = RecordingClient()

    MetricForwarder(client, "run-1", job / "tensorboard" / "logdirs", []).flush()

    assert [(key, step) for key, step, _ in client.points] == [("loss", 0), ("loss", 1), ("loss", 2)]
