"""Writing TensorBoard event files in a job's kernel, for a fraction of TensorBoard's cost per scalar.

Behind ``torch.utils.tensorboard.SummaryWriter``, TensorBoard's own
``EventFileWriter`` costs about 80 us of the training thread per
``add_scalar`` on a 2-core machine: a protobuf built and serialized, a
10-slot queue handed to a writer thread, a CRC-32C computed in pure Python
(about 10 us a record, holding the GIL) and the file opened and closed for
every record. At 100 scalars a step that is 8 ms a step. :func:`activate`
swaps in :class:`EventFileWriter` (its drop-in, for local log dirs) and a
``SummaryWriter.add_scalar`` that takes the common call itself (a tag it
has seen, a ``float``, an ``int`` step, no wall time): it packs the tag's
index, the value, the step and ``time.time()`` into 32 bytes and appends
them to the writer's queue, a few hundred nanoseconds in one Python frame.
Every other call goes through :meth:`EventFileWriter.add_scalar`, which
converts what torch converts (numpy numbers, one-element tensors, numpy
steps, ``None``) the way torch does, and hands the rest to torch. The queue
is encoded with numpy by column (:mod:`danlu.tensorboard.encoder`), 4096
records at a time, in the thread that fills it, or every ``flush_secs`` by the
writer's own thread, and written with one ``write`` call.

The files are the same: each ``add_scalar`` is one record holding the
bytes TensorBoard would write for it (the same Event: wall time, step, one
``simple_value`` of the tag, with the same protobuf encoding and checksums),
in the order of the calls; every other event (histograms, images, text,
graphs, ``new_style`` scalars) is serialized by protobuf as before and keeps
its place. What differs is when bytes reach the file: within ``flush_secs``
(2 s in a job) or 4096 records, and at ``flush()``/``close()``, instead of
one record at a time; a process killed outright (SIGKILL) loses what was
queued, at most ``flush_secs`` of it.

Errors are torch's, raised by the call that passed the bad value: whatever
could fail (a tensor of several elements, a string, a non-``str`` tag, a
step outside int64, a wall time that is not a number) is decided before
anything is queued, and goes through torch's own ``add_scalar``; nothing
left for the batch can fail (a value beyond float32's range is written as
infinity, as protobuf writes it). A call after the writer was closed under
the ``SummaryWriter``, or after a write failed in the writer's thread, raises
that, as TensorBoard's writer does.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import sys
import threading
import time

import numpy as np
from tensorboard.compat.proto import event_pb2
from tensorboard.summary.writer import event_file_writer as tensorboard_writer

from danlu.tensorboard.encoder import ScalarEncoder
from danlu.tensorboard.format import frame

BATCH = 4096  # records encoded together
_I64 = 1 << 63
_FILE_VERSION_WRITER = "tensorboard.summary.writer.event_file_writer"  # as TensorBoard's first event names it

#: a queued item, packed: a scalar's tag index, value, step and wall time; another event has tag -1 - its number
ITEM = struct.Struct("<qdqd")
_ITEMS = np.dtype([("tag", "<i8"), ("value", "<f8"), ("step", "<i8"), ("wall", "<f8")])
_pack = ITEM.pack


class _Counter:
    def __init__(self):
        self._next = 0
        self._lock = threading.Lock()

    def get(self) -> int:
        with self._lock:
            self._next += 1
            return self._next - 1


def _uid_counter():
    """TensorBoard's own counter of writers, so file names never collide with its writers' in this process."""
    try:
        return tensorboard_writer._global_uid
    except AttributeError:
        return _Counter()


class EventFileWriter:
    """TensorBoard's ``EventFileWriter``, for a local log dir: the same file, name and records, written in batches.

    ``max_queue_size`` is accepted and not a limit: records wait for
    ``flush_secs`` or :data:`BATCH` records, whichever comes first.
    """

    def __init__(self, logdir, max_queue_size=10, flush_secs=120, filename_suffix=""):
        self._logdir = str(logdir)
        os.makedirs(self._logdir, exist_ok=True)
        self._file_name = (
            os.path.join(
                self._logdir,
                "events.out.tfevents.%010d.%s.%s.%s"
                % (time.time(), socket.gethostname(), os.getpid(), _uid_counter().get()),
            )
            + filename_suffix
        )
        self._fd: int | None = os.open(self._file_name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        # Filled by any thread (list.append is atomic); emptied under _io by taking a prefix (a slice, then del
        # of that slice: appends in between stay), so no lock is taken per scalar. An item is ITEM packed: one
        # small object kept per scalar, and the batch is one bytes.join away from numpy.
        self._queue: list[bytes] = []
        self._limit = BATCH  # items that make a batch
        self._payloads: dict[int, bytes] = {}  # other events' bytes, by number
        self._numbers = itertools.count()
        self._io = threading.Lock()  # one encoder and writer at a time
        self._encoder = ScalarEncoder()
        # the tags that the patched SummaryWriter.add_scalar queues without a call here; {} once closed or
        # failed, so that every call comes here and fails as it should
        self._tags = self._encoder.tag_ids
        self._error: BaseException | None = None
        self._closed = False
        self._flush_secs = float(flush_secs)
        self._stop = threading.Event()
        self.add_event(
            event_pb2.Event(
                wall_time=time.time(),
                file_version="brain.Event:2",
                source_metadata=event_pb2.SourceMetadata(writer=_FILE_VERSION_WRITER),
            )
        )
        self.flush()
        self._thread = threading.Thread(target=self._run, name="danlu-event-writer", daemon=True)
        self._thread.start()

    def get_logdir(self) -> str:
        return self._logdir

    def add_event(self, event) -> None:
        """Queue any ``Event`` proto, serialized now (as TensorBoard does)."""
        if not isinstance(event, event_pb2.Event):
            raise TypeError(f"Expected an event_pb2.Event proto,  but got {type(event)}")
        self._check_open()
        number = next(self._numbers)
        self._payloads[number] = event.SerializeToString()  # before its item: whoever takes the item finds it
        queue = self._queue
        queue.append(_pack(-1 - number, 0.0, 0, 0.0))
        if len(queue) >= self._limit:
            self._write()

    def add_scalar(self, tag, value, step, wall_time) -> bool:
        """Queue a scalar as ``SummaryWriter.add_scalar`` would write it; False (nothing queued) when it cannot.

        The patched ``SummaryWriter.add_scalar`` queues the common call (a
        known tag, a ``float``, an ``int`` step, no wall time) itself; this
        takes the others: new tags, numpy and one-element tensor values,
        ``None`` or numpy steps, given wall times.
        """
        if type(tag) is not str or self._closed or self._error is not None:
            return False
        tid = self._encoder.tag_id(tag)
        if tid < 0:
            return False
        if type(value) is not float:
            value = _number(value)
            if value is None:
                return False
        if step is None:
            step = 0
        elif type(step) is not int:
            step = int(step)  # as torch's FileWriter does
        if not -_I64 <= step < _I64:
            return False
        if wall_time is None:
            wall_time = time.time()
        elif type(wall_time) is not float:
            if not isinstance(wall_time, (int, float)):
                return False
            wall_time = float(wall_time)
        queue = self._queue
        queue.append(_pack(tid, value, step, wall_time))
        if len(queue) >= self._limit:
            self._write()
        return True

    def flush(self) -> None:
        """Write everything queued so far."""
        self._check_open()
        self._write()

    def close(self) -> None:
        """Write what is queued, stop the thread and close the file."""
        if self._closed:
            return
        self._closed = True
        self._tags = {}
        self._stop.set()
        try:
            self._write()
        finally:
            with self._io:
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._error is not None:
            raise self._error

    # inside ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise OSError("Writer is closed")

    def _run(self) -> None:
        while not self._stop.wait(self._flush_secs):
            try:
                self._write()
            except BaseException as e:  # surfaces in the training thread's next call
                self._error = e
                self._tags = {}
                return

    def _write(self) -> None:
        with self._io:
            if self._fd is None:
                return
            queue = self._queue
            n = len(queue)
            if not n:
                return
            items = queue[:n]
            del queue[:n]
            data = encode(self._encoder, items, self._payloads)
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]


def encode(encoder: ScalarEncoder, items: list[bytes], payloads: dict[int, bytes]) -> bytes:
    """The records of queued items (:data:`ITEM` packed), in order: scalars a batch at a time, other events (in
    ``payloads``) one by one."""
    batch = np.frombuffer(b"".join(items), dtype=_ITEMS)
    tids, values, steps, walls = batch["tag"], batch["value"], batch["step"], batch["wall"]
    if int(tids.min()) >= 0:
        return encoder.encode(tids, values, steps, walls)
    others = np.flatnonzero(tids < 0).tolist()
    pieces, start = [], 0
    for i in others + [len(tids)]:
        if i > start:
            pieces.append(encoder.encode(tids[start:i], values[start:i], steps[start:i], walls[start:i]))
        if i < len(tids):
            pieces.append(frame(payloads.pop(-1 - int(tids[i]))))
        start = i + 1
    return b"".join(pieces)


_FAST_DTYPES: frozenset | None = None


def _number(value) -> float | None:
    """The float torch's ``scalar()`` would record for a one-element value, or None to let torch decide."""
    if isinstance(value, (int, float, np.integer, np.floating, np.bool_)):
        try:
            return float(value)
        except OverflowError:
            return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        global _FAST_DTYPES
        if _FAST_DTYPES is None:  # bfloat16 goes through float16 in torch's make_np: left to torch
            _FAST_DTYPES = frozenset(
                {
                    torch.float32,
                    torch.float64,
                    torch.float16,
                    torch.int64,
                    torch.int32,
                    torch.int16,
                    torch.int8,
                    torch.uint8,
                    torch.bool,
                }
            )
        if value.dtype in _FAST_DTYPES and value.numel() == 1 and value.device.type != "meta":
            return float(value)
    return None


def event_file_writer(logdir, max_queue_size=10, flush_secs=120, filename_suffix=""):
    """An :class:`EventFileWriter` for a local log dir; TensorBoard's own for a remote one (``s3://``, ``gs://``)."""
    if "://" in str(logdir):
        return tensorboard_writer.EventFileWriter(logdir, max_queue_size, flush_secs, filename_suffix)
    return EventFileWriter(logdir, max_queue_size, flush_secs, filename_suffix)


def activate(writer_module) -> None:
    """Make ``torch.utils.tensorboard.writer`` write through this module (its FileWriters and add_scalar)."""
    writer_module.EventFileWriter = event_file_writer
    cls = writer_module.SummaryWriter
    original = cls.add_scalar
    now, pack = time.time, _pack

    def add_scalar(self, tag, scalar_value, global_step=None, walltime=None, new_style=False, double_precision=False):
        # The common call, queued here in the fewest steps: a tag already seen, a float, an int step, no wall time,
        # an open writer (torch sets file_writer and all_writers together: the file_writer is the one
        # _get_file_writer() returns). Every other call, and one that fails here, goes through writer.add_scalar
        # or torch.
        if (
            type(tag) is str
            and type(scalar_value) is float
            and type(global_step) is int
            and walltime is None
            and not (new_style or double_precision)
        ):
            try:
                writer = self.file_writer.event_writer
                item = pack(writer._tags[tag], scalar_value, global_step, now())
            except (AttributeError, KeyError, struct.error):  # closed (no file_writer) or another event writer;
                pass  # a new tag, or a writer closed under the SummaryWriter; a step outside int64
            else:
                queue = writer._queue
                queue.append(item)
                if len(queue) >= writer._limit:
                    writer._write()
                return
        file_writer = self.file_writer  # what _get_file_writer() returns while the writer is open
        if file_writer is not None and self.all_writers is not None and not (new_style or double_precision):
            writer = file_writer.event_writer
            if type(writer) is EventFileWriter and writer.add_scalar(tag, scalar_value, global_step, walltime):
                return
        original(self, tag, scalar_value, global_step, walltime, new_style, double_precision)

    add_scalar.__wrapped__ = original
    add_scalar.__doc__ = original.__doc__
    cls.add_scalar = add_scalar
