"""Pure tests of the TensorBoard event-file format as Danlu writes and reads it.

:mod:`danlu.tensorboard.writer` must write the bytes TensorBoard writes: each
property below builds the expected record with torch's own ``scalar()``,
protobuf and TensorBoard's ``RecordWriter`` (its pure-Python CRC), and
compares bytes. :mod:`danlu.tensorboard.reader` must read what protobuf reads, and
check the same CRC-32C as TensorBoard's reader.
"""

from __future__ import annotations

import io
import math
import os
import struct
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboard_crc
from tensorboard.summary.writer.record_writer import RecordWriter
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard import writer as tensorboard_writer
from torch.utils.tensorboard.summary import histogram, scalar

from danlu.tensorboard import reader
from danlu.tensorboard import writer as eventwriter
from danlu.tensorboard.encoder import ScalarEncoder
from danlu.tensorboard.format import DEPTH, header_crc, masked_crc32c, span_crcs
from danlu.tensorboard.reader import EventFile, simple_scalar
from danlu.tensorboard.writer import encode

PROPERTIES = settings(max_examples=200, deadline=None)
TAGS = st.one_of(
    st.sampled_from(["loss", "", "a/b", "é/ü", "x" * 127, "y" * 128, "z" * 900]),
    st.text(max_size=40).filter(lambda t: not any(0xD800 <= ord(c) < 0xE000 for c in t)),
)
VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([-0.0, 1e-45, 3.5e38, -1e300]))
STEPS = st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.integers(0, 20_000))
WALLS = st.one_of(st.sampled_from([0.0, -0.0, 1.7e9]), st.floats(allow_nan=True, allow_infinity=True))
SCALARS = st.lists(st.tuples(TAGS, VALUES, STEPS, WALLS), min_size=1, max_size=60)
# the usual batch, encoded by column: every record with a wall time (any but 0.0) and steps of one varint length
# (k bytes, 0 to 8), tags of one length or of many
SET_WALLS = st.one_of(st.sampled_from([-0.0, 5e-324, 1.7e9]), st.floats(allow_nan=True, allow_infinity=True)).filter(
    lambda w: struct.pack("<d", w) != bytes(8)
)
USUAL = st.integers(0, 8).flatmap(
    lambda k: st.lists(
        st.tuples(
            st.one_of(TAGS, st.sampled_from(["loss/class_00", "loss/class_01", "acc/top1_top5"])),
            VALUES,
            st.integers(1 << 7 * (k - 1), (1 << 7 * k) - 1) if k else st.just(0),
            SET_WALLS,
        ),
        min_size=1,
        max_size=60,
    )
)


def tensorboard_record(payload: bytes) -> bytes:
    out = io.BytesIO()
    RecordWriter(out).write(payload)
    return out.getvalue()


def tensorboard_scalar(tag, value, step, wall) -> bytes:
    """The record torch's SummaryWriter.add_scalar has TensorBoard write."""
    event = event_pb2.Event(summary=scalar(tag, value))
    event.wall_time = wall
    if step is not None:
        event.step = int(step)
    return tensorboard_record(event.SerializeToString())


def packed(items: list[tuple]) -> list[bytes]:
    """Items as the writer queues them."""
    return [eventwriter.ITEM.pack(*item) for item in items]


def records(path) -> list[bytes]:
    """The payloads of a file, read by TensorBoard (which checks every CRC)."""
    return list(RawEventFileLoader(str(path)).Load())


# CRC-32C ---------------------------------------------------------------------------------------


@PROPERTIES
@given(st.binary(max_size=3000))
@example(b"")
@example(bytes(DEPTH))
@example(os.urandom(DEPTH + 1))
def test_the_crc_is_tensorboards(data):
    assert masked_crc32c(data) == tensorboard_crc(data)


def test_long_messages_and_many_spans_get_tensorboards_crc():
    data = os.urandom(100_000)
    assert masked_crc32c(data) == tensorboard_crc(data)
    starts = np.arange(0, 90_000, 997)
    lengths = (starts * 7) % (DEPTH + 1)  # 0 to DEPTH bytes
    crcs = span_crcs(np.frombuffer(data, np.uint8), starts, lengths)
    assert crcs.tolist() == [tensorboard_crc(data[s : s + n]) for s, n in zip(starts, lengths, strict=True)]
    assert [header_crc(n) for n in (0, 40, 2**40)] == [tensorboard_crc(struct.pack("<Q", n)) for n in (0, 40, 2**40)]


# writing ----------------------------------------------------------------------------------------


@PROPERTIES
@given(SCALARS)
@example([("loss", 0.5, s, 1.7e9) for s in range(120, 140)])  # one layout, steps of 1 and 2 bytes
@example([("", math.nan, None, 0.0), ("a", 1.0, 0, -0.0)])  # no tag, step or wall time written
def test_scalars_are_encoded_as_tensorboard_writes_them(scalars):
    encoder = ScalarEncoder()
    items = [(encoder.tag_id(tag), value, step or 0, wall) for tag, value, step, wall in scalars]

    assert encode(encoder, packed(items), {}) == b"".join(tensorboard_scalar(*s) for s in scalars)


@PROPERTIES
@given(USUAL)
@example([(f"loss/class_{i % 3:02d}", i / 7, 4000 + i // 3, 1.7e9 + i / 1000) for i in range(30)])  # one length
@example([("loss", 0.5, 2**56 - 1, 1.7e9), ("lr", -1e300, 2**49, -0.0)])  # 8-byte steps, two lengths
def test_usual_batches_are_encoded_as_tensorboard_writes_them(scalars):
    encoder = ScalarEncoder()
    items = [(encoder.tag_id(tag), value, step, wall) for tag, value, step, wall in scalars]

    assert encode(encoder, packed(items), {}) == b"".join(tensorboard_scalar(*s) for s in scalars)


def test_a_tag_per_step_is_encoded_as_tensorboard_writes_it():
    encoder = ScalarEncoder()  # layouts grow past their first room many times over, in one batch and across batches
    scalars = [(f"step_{step}/loss", step / 3, step, 1.7e9 + step) for step in range(3000)]
    items = [(encoder.tag_id(tag), value, step, wall) for tag, value, step, wall in scalars]

    data = b"".join(encode(encoder, packed(items[start : start + 700]), {}) for start in range(0, len(items), 700))

    assert data == b"".join(tensorboard_scalar(*s) for s in scalars)


def test_other_events_keep_their_place_between_scalars():
    encoder = ScalarEncoder()
    other = event_pb2.Event(wall_time=1.0, summary=histogram("w", np.arange(100.0), 10)).SerializeToString()
    scalars = [("loss", i / 3, i, 1.7e9 + i) for i in range(6)]
    items = [(encoder.tag_id(t), v, s, w) for t, v, s, w in scalars]
    items[2:2] = [(-1, 0.0, 0, 0.0)]
    items[5:5] = [(-2, 0.0, 0, 0.0), (-3, 0.0, 0, 0.0)]

    data = encode(encoder, packed(items), {0: other, 1: other, 2: other})

    expected = [tensorboard_scalar(*s) for s in scalars]
    expected[2:2] = [tensorboard_record(other)]
    expected[5:5] = [tensorboard_record(other)] * 2
    assert data == b"".join(expected)


@pytest.fixture
def fast_writer(monkeypatch):
    """torch's SummaryWriter writing through danlu.tensorboard.writer, undone afterwards."""
    cls = tensorboard_writer.SummaryWriter
    monkeypatch.setattr(cls, "add_scalar", cls.add_scalar)
    monkeypatch.setattr(tensorboard_writer, "EventFileWriter", tensorboard_writer.EventFileWriter)
    eventwriter.activate(tensorboard_writer)


def test_a_summary_writer_file_is_tensorboards_record_for_record(fast_writer, tmp_path):
    weights = torch.linspace(-1, 1, 1000)
    with SummaryWriter(log_dir=str(tmp_path)) as writer:
        assert isinstance(writer._get_file_writer().event_writer, eventwriter.EventFileWriter)
        for step in range(250):
            writer.add_scalar("loss", 1 / (step + 1), step, walltime=1.7e9 + step)
            writer.add_scalar("lr", torch.tensor(0.1), step, walltime=1.7e9 + step)  # a one-element tensor
            writer.add_scalar("acc/top1", np.float32(step / 250), np.int64(step), walltime=1.7e9 + step)
            if step % 100 == 0:
                writer.add_histogram("weights", weights, step, walltime=1.7e9 + step)
        writer.add_scalar("loss", 0.5, 250, walltime=1.7e9 + 250, new_style=True)  # through torch

    (path,) = tmp_path.glob("events.out.tfevents.*")
    expected = []
    for step in range(250):
        for tag, value in (("loss", 1 / (step + 1)), ("lr", torch.tensor(0.1)), ("acc/top1", np.float32(step / 250))):
            expected.append(tensorboard_scalar(tag, value, step, 1.7e9 + step))
        if step % 100 == 0:
            event = event_pb2.Event(
                summary=histogram("weights", weights, writer.default_bins), wall_time=1.7e9 + step, step=step
            )
            expected.append(tensorboard_record(event.SerializeToString()))
    event = event_pb2.Event(summary=scalar("loss", 0.5, new_style=True), wall_time=1.7e9 + 250, step=250)
    expected.append(tensorboard_record(event.SerializeToString()))
    data = path.read_bytes()
    first = event_pb2.Event.FromString(records(path)[0])
    assert first.file_version == "brain.Event:2"
    assert data[len(tensorboard_record(first.SerializeToString())) :] == b"".join(expected)


def test_what_torch_refuses_is_refused_the_same_way(fast_writer, tmp_path):
    with SummaryWriter(log_dir=str(tmp_path)) as writer:
        with pytest.raises(AssertionError, match="one element"):
            writer.add_scalar("loss", torch.ones(2), 0)
        with pytest.raises(ValueError, match="out of range"):
            writer.add_scalar("loss", 1.0, 2**63)
        writer.add_scalar(b"bytes tag", 1.0, 1, walltime=5.0)  # protobuf takes UTF-8 bytes for a string

    (path,) = tmp_path.glob("events.out.tfevents.*")
    assert path.read_bytes().endswith(tensorboard_scalar(b"bytes tag", 1.0, 1, 5.0))


# calls that torch refuses, each with what it raises; the tag "loss" is known to the fast path by then
BAD_CALLS = [
    ("loss", torch.ones(2), 1, None),  # several elements
    ("loss", "abc", 1, None),  # not a number
    ("loss", None, 1, None),
    ("loss", [1.0], 1, None),
    ("loss", 1.0, 2**63, None),  # steps outside int64
    ("loss", 1.0, -(2**63) - 1, None),
    ("loss", 1.0, "x", None),
    ("loss", 1.0, 1, "noon"),  # a wall time that is not a number
    (["loss"], 1.0, 1, None),  # tags that are not strings, one unhashable
    (5, 1.0, 1, None),
]


def errors_and_points(tmp_path, calls) -> tuple[list, list]:
    """What each call raises (type and message; None when it does not), and the (tag, step, value) written."""
    raised = []
    with SummaryWriter(log_dir=str(tmp_path)) as writer:
        for tag, value, step, wall in calls:
            try:
                writer.add_scalar(tag, value, step, walltime=wall)
                raised.append(None)
            except Exception as e:  # noqa: BLE001 - what torch raises is the point
                raised.append((type(e), str(e)))
    (path,) = tmp_path.glob("events.out.tfevents.*")
    events = [event_pb2.Event.FromString(r) for r in records(path)[1:]]
    return raised, [(e.summary.value[0].tag, e.step, e.summary.value[0].simple_value) for e in events]


def test_bad_calls_between_good_ones_fail_as_torchs_and_the_rest_keeps_its_order(tmp_path, monkeypatch):
    good = [("loss", i / 4, i, None) for i in range(4)]  # the fast path's calls, once the tag is known
    calls = [good[0]]
    for bad in BAD_CALLS:
        calls += [bad, good[1], good[2]]
    calls += [good[3]]
    torch_raised, torch_points = errors_and_points(tmp_path / "torch", calls)

    cls = tensorboard_writer.SummaryWriter
    monkeypatch.setattr(cls, "add_scalar", cls.add_scalar)
    monkeypatch.setattr(tensorboard_writer, "EventFileWriter", tensorboard_writer.EventFileWriter)
    eventwriter.activate(tensorboard_writer)
    checked = []  # the calls that reach the writer's checked path
    monkeypatch.setattr(
        eventwriter.EventFileWriter,
        "add_scalar",
        lambda self, *args, _f=eventwriter.EventFileWriter.add_scalar: checked.append(args) or _f(self, *args),
    )
    danlu_raised, danlu_points = errors_and_points(tmp_path / "danlu", calls)

    assert danlu_raised == torch_raised
    assert [r is None for r in danlu_raised].count(False) == len(BAD_CALLS)
    assert (
        danlu_points
        == torch_points
        == [(tag, step, value) for (tag, value, step, _), r in zip(calls, danlu_raised, strict=True) if r is None]
    )
    assert len(checked) == 1 + len(BAD_CALLS)  # the first call and the bad ones: the fast path took the rest


def test_a_writer_closed_under_the_summary_writer_refuses_as_tensorboards_does(fast_writer, tmp_path):
    writer = SummaryWriter(log_dir=str(tmp_path))
    writer.add_scalar("loss", 1.0, 0)  # known to the fast path
    writer.file_writer.close()  # the FileWriter, not the SummaryWriter

    with pytest.raises(OSError, match="closed"):
        writer.add_scalar("loss", 2.0, 1)


def test_an_error_in_the_writers_thread_fails_the_next_call(fast_writer, tmp_path, monkeypatch):
    writer = SummaryWriter(log_dir=str(tmp_path), flush_secs=0.01)
    writer.add_scalar("loss", 1.0, 0)
    event_writer = writer.file_writer.event_writer

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(eventwriter.os, "write", full)
    writer.add_scalar("loss", 2.0, 1)
    deadline = time.monotonic() + 30
    while event_writer._error is None and time.monotonic() < deadline:
        time.sleep(0.01)

    with pytest.raises(OSError, match="No space left"):
        writer.add_scalar("loss", 3.0, 2)
    monkeypatch.undo()
    with pytest.raises(OSError, match="No space left"):
        writer.close()


def test_another_event_writer_under_the_summary_writer_gets_every_call(fast_writer, tmp_path):
    class Recording:  # as TensorBoard's own writer, which a remote log dir keeps
        def __init__(self):
            self.events = []

        def add_event(self, event):
            self.events.append(event)

    writer = SummaryWriter(log_dir=str(tmp_path))
    writer.add_scalar("loss", 1.0, 0)
    recording = writer.file_writer.event_writer = Recording()
    writer.add_scalar("loss", 2.0, 1)
    writer.add_scalar("lr", 0.5, 1)

    assert [(e.step, e.summary.value[0].tag, e.summary.value[0].simple_value) for e in recording.events] == [
        (1, "loss", 2.0),
        (1, "lr", 0.5),
    ]


def test_records_reach_the_file_within_flush_secs_without_a_flush(fast_writer, tmp_path):
    writer = SummaryWriter(log_dir=str(tmp_path), flush_secs=0.05)
    try:
        writer.add_scalar("loss", 1.0, 7)
        (path,) = tmp_path.glob("events.out.tfevents.*")
        deadline = time.monotonic() + 30
        while len(records(path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(records(path)) == 2
    finally:
        writer.close()


def test_a_full_batch_is_written_at_once(fast_writer, tmp_path, monkeypatch):
    monkeypatch.setattr(eventwriter, "BATCH", 10)
    with SummaryWriter(log_dir=str(tmp_path), flush_secs=3600) as writer:
        (path,) = tmp_path.glob("events.out.tfevents.*")
        for step in range(25):
            writer.add_scalar("loss", 1.0, step)
        assert len(records(path)) == 1 + 20  # two batches of 10; 5 wait for the next flush
    assert len(records(path)) == 1 + 25


def test_scalars_from_several_threads_are_all_written_once(fast_writer, tmp_path, monkeypatch):
    monkeypatch.setattr(eventwriter, "BATCH", 64)
    writer = SummaryWriter(log_dir=str(tmp_path), flush_secs=0.001)  # its thread empties the queue all along

    def log(name):
        for step in range(3000):
            writer.add_scalar(name, 1.0, step)

    threads = [threading.Thread(target=log, args=(f"t{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()

    (path,) = tmp_path.glob("events.out.tfevents.*")
    events = [event_pb2.Event.FromString(r) for r in records(path)[1:]]
    seen = sorted((e.summary.value[0].tag, e.step) for e in events)
    assert seen == sorted((f"t{i}", step) for i in range(3) for step in range(3000))
    for i in range(3):  # each thread's points in its order
        assert [e.step for e in events if e.summary.value[0].tag == f"t{i}"] == list(range(3000))


def test_after_close_a_summary_writer_starts_a_new_file(fast_writer, tmp_path):
    writer = SummaryWriter(log_dir=str(tmp_path))
    writer.add_scalar("loss", 1.0, 0)
    writer.close()
    time.sleep(1.1)  # file names hold the second
    writer.add_scalar("loss", 2.0, 1)
    writer.close()

    files = sorted(tmp_path.glob("events.out.tfevents.*"))
    assert [len(records(f)) for f in files] == [2, 2]


def test_a_remote_log_dir_keeps_tensorboards_writer(monkeypatch):
    made = []
    monkeypatch.setattr(
        "tensorboard.summary.writer.event_file_writer.EventFileWriter",
        lambda *args: made.append(args) or "tensorboard's",
    )

    assert eventwriter.event_file_writer("s3://bucket/runs", 10, 2, "") == "tensorboard's"
    assert made == [("s3://bucket/runs", 10, 2, "")]


# reading ----------------------------------------------------------------------------------------


def protobuf_reading(payload: bytes):
    event = event_pb2.Event.FromString(payload)
    return event.wall_time, event.step, reader._scalars(event)


@PROPERTIES
@given(SCALARS)
def test_scalar_records_are_read_as_protobuf_reads_them(scalars):
    for tag, value, step, wall in scalars:
        payload = tensorboard_scalar(tag, value, step, wall)[12:-4]
        fast = simple_scalar(payload, 0, len(payload))
        assert fast is not None
        assert repr(fast) == repr(protobuf_reading(payload))  # repr: NaN equals NaN


@pytest.mark.parametrize(
    "event",
    [
        event_pb2.Event(wall_time=1.0, file_version="brain.Event:2"),
        event_pb2.Event(step=3, summary=scalar("loss", 1.0, new_style=True)),  # a tensor
        event_pb2.Event(step=3, summary=histogram("w", np.arange(10.0), 10)),
        event_pb2.Event(
            step=3,
            summary=summary_pb2.Summary(
                value=[
                    summary_pb2.Summary.Value(tag="a", simple_value=1),
                    summary_pb2.Summary.Value(tag="b", simple_value=2),
                ]
            ),
        ),
    ],
)
def test_other_records_are_left_to_protobuf(event):
    payload = event.SerializeToString()
    assert simple_scalar(payload, 0, len(payload)) is None


def test_a_scalar_record_with_a_wrong_crc_is_skipped(tmp_path):
    good, bad = tensorboard_scalar("loss", 1.0, 1, 5.0), bytearray(tensorboard_scalar("loss", 2.0, 2, 5.0))
    bad[-5] ^= 1  # the value's last byte: the payload no longer matches its CRC
    path = tmp_path / "events.out.tfevents.1"
    path.write_bytes(good + bytes(bad) + good)
    file = EventFile(str(path))

    events, more = file.read(1 << 20)

    assert [(step, values) for _, step, values in events] == [(1, [("loss", 1.0)]), (1, [("loss", 1.0)])]
    assert file.problems == {"corrupt": 1} and not more
