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
is encoded with numpy by column, 4096 records at a time, in the thread that
fills it, or every ``flush_secs`` by the writer's own thread, and written
with one ``write`` call.

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

from danlu.eventfiles import header_crc, mask, masked_crc32c, tables

BATCH = 4096  # records encoded together
MAX_TAG_BYTES = 900  # longer tags go through torch (a record must stay within the CRC tables)
MAX_TAGS = 100_000  # tags beyond these (a tag per step?) go through torch: memory stays bounded
_I64 = 1 << 63
_FILE_VERSION_WRITER = "tensorboard.summary.writer.event_file_writer"  # as TensorBoard's first event names it


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _register(data: bytes) -> int:
    """The CRC-32C register after ``data`` from the initial value, before the final xor (pure Python: rare)."""
    from danlu.eventfiles import _CRC_TABLE

    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc


class ScalarEncoder:
    """Encodes scalar records many at a time: the bytes ``Event(wall_time, step, summary(value(tag, simple_value)))``.

    A record's bytes that depend only on its *layout* (tag, step length, whether
    the wall time is written) come from a row prepared once per layout, with
    the checksum of those bytes; the wall time, step and value are then filled
    in, and their share of the checksum added, by column.
    """

    def __init__(self):
        self.tag_ids: dict[str, int] = {}  # the tags it encodes; read without the lock
        self._refused: set[str] = set()  # tags left to protobuf: not UTF-8, too long, too many
        self._lock = threading.Lock()  # new tags may come from several threads
        self._templates: list[bytes] = []
        self._layout_of = np.full((0, 11, 2), -1, dtype=np.int64)  # [tag, step bytes (0: none), wall time written]
        self._rows = np.zeros((0, 64), dtype=np.uint8)
        self._layouts = 0  # layouts made; the arrays below have room for len(self._rows)
        self._length_arr = np.zeros(0, dtype=np.int64)  # record length per layout
        self._register_arr = np.zeros(0, dtype=np.uint32)  # CRC register of the layout's fixed bytes

    def tag_id(self, tag: str) -> int:
        """The tag's index, or -1 when it goes through protobuf (not UTF-8, too long, past :data:`MAX_TAGS`)."""
        tid = self.tag_ids.get(tag)
        if tid is not None:
            return tid
        with self._lock:
            tid = self.tag_ids.get(tag)
            if tid is None:
                tid = -1 if tag in self._refused else self._new_tag(tag)
            return tid

    def _new_tag(self, tag: str) -> int:
        try:
            raw = tag.encode("utf-8")
        except UnicodeEncodeError:
            raw = None
        if raw is None or len(raw) > MAX_TAG_BYTES or len(self.tag_ids) >= MAX_TAGS:
            if len(self._refused) < MAX_TAGS:
                self._refused.add(tag)
            return -1
        # Summary.Value: the tag (left out when empty, as proto3 leaves out defaults), then simple_value's key
        value = (b"\x0a" + _varint(len(raw)) + raw if raw else b"") + b"\x15"
        summary = b"\x0a" + _varint(len(value) + 4) + value
        self._templates.append(b"\x2a" + _varint(len(summary) + 4) + summary)
        tid = len(self._templates) - 1
        if tid >= len(self._layout_of):
            grown = np.full((max(16, 2 * len(self._layout_of)), 11, 2), -1, dtype=np.int64)
            grown[:len(self._layout_of)] = self._layout_of
            self._layout_of = grown
        self.tag_ids[tag] = tid  # last: the fast path may use it from now on
        return tid

    def _add_layout(self, tid: int, steps: int, wall: int) -> None:
        payload = ((b"\x09" + bytes(8)) if wall else b"") + ((b"\x10" + bytes(steps)) if steps else b"")
        payload += self._templates[tid] + bytes(4)
        head = struct.pack("<QI", len(payload), header_crc(len(payload)))
        row = head + payload + bytes(4)
        layout = self._layouts
        if len(row) > self._rows.shape[1] or layout == len(self._rows):  # grown by doubling: a tag per step
            count = max(16, 2 * len(self._rows)) if layout == len(self._rows) else len(self._rows)  # stays cheap
            grown = np.zeros((count, max(len(row), self._rows.shape[1])), dtype=np.uint8)
            grown[:len(self._rows), :self._rows.shape[1]] = self._rows
            self._rows = grown
            more = count - len(self._length_arr)
            self._length_arr = np.concatenate([self._length_arr, np.zeros(more, dtype=np.int64)])
            self._register_arr = np.concatenate([self._register_arr, np.zeros(more, dtype=np.uint32)])
        self._rows[layout, :len(row)] = np.frombuffer(row, dtype=np.uint8)
        self._rows[layout, len(row):] = 0
        self._length_arr[layout] = len(row)
        self._register_arr[layout] = _register(payload)
        self._layouts = layout + 1
        self._layout_of[tid, steps, wall] = layout

    def encode(self, tids: np.ndarray, values: np.ndarray, steps: np.ndarray, walls: np.ndarray) -> bytes:
        """The records, in order, of scalars given by column: tag index, value, step (int64), wall time."""
        n = len(tids)
        if n == 0:
            return b""
        # the step as protobuf writes an int64: a varint of its 64-bit two's complement, left out when 0
        unsigned = steps.view(np.uint64)
        low, high = _varint_length(int(unsigned.min())), _varint_length(int(unsigned.max()))
        if low == high and low <= 8 and walls.view(np.uint64).all():
            return self._encode_common(tids, values, unsigned, walls, low)
        if low == high:  # varint lengths grow with the unsigned value
            nbytes = np.full(n, low, dtype=np.int64)
        else:
            nbytes = (unsigned != 0).astype(np.int64)
            for j in range(1, 10):
                nbytes += unsigned >= np.uint64(1 << (7 * j))
        has_wall = (walls.view(np.uint64) != 0).astype(np.int64)  # -0.0 is written, 0.0 is not
        all_walls = bool(has_wall.all())
        layouts = self._layout_of[tids, nbytes, has_wall]
        missing = layouts < 0
        if missing.any():
            for code in np.unique((tids[missing] * 11 + nbytes[missing]) * 2 + has_wall[missing]).tolist():
                self._add_layout(code // 22, (code // 2) % 11, code % 2)
            layouts = self._layout_of[tids, nbytes, has_wall]
        lengths = self._length_arr[layouts]
        width = int(lengths.max())
        rows = self._rows[layouts, :width]  # a copy
        share = tables().share

        # The bytes that vary: the wall time and the step (a prefix of the payload), the value (its last 4).
        wall_bytes = np.ascontiguousarray(walls).view(np.uint8).reshape(n, 8)
        k = int(nbytes.max())
        column = np.arange(max(k, 1))
        step_bytes = ((unsigned[:, None] >> (7 * column).astype(np.uint64)) & np.uint64(0x7F)).astype(np.uint8)
        step_bytes[column < (nbytes[:, None] - 1)] |= 0x80
        step_bytes[column >= nbytes[:, None]] = 0
        with np.errstate(over="ignore", invalid="ignore"):  # out of float32's range: infinity, as protobuf
            value_bytes = values.astype("<f4").view(np.uint8).reshape(n, 4)
        # Their share of the checksum: first as if the prefix ended the payload (distances below 20, a
        # small corner of the table), then moved past the rest of the payload at once (4 lookups).
        prefix = 9 * has_wall + np.where(nbytes > 0, nbytes + 1, 0)
        local = np.zeros(n, dtype=np.uint32)
        if all_walls and low == high:  # one prefix length: each byte's distance is the same in every record
            for j in range(8):  # wall time byte j is at payload offset 1 + j
                d = int(prefix[0]) - 2 - j
                local ^= share[d * 256:(d + 1) * 256][wall_bytes[:, j]]
        else:  # a record without a wall time has zeros there, whose share is 0 at any distance
            wall_bytes_in = wall_bytes * has_wall[:, None].astype(np.uint8)
            for j in range(8):
                local ^= share[(prefix - 2 - j).clip(0) * 256 + wall_bytes_in[:, j]]
        for j in range(k):  # step byte j is at payload offset 9w + 1 + j
            local ^= share[(nbytes - 1 - j).clip(0) * 256 + step_bytes[:, j]]
        rest = (lengths - 16 - prefix) * 256
        register = self._register_arr[layouts]
        for j in range(4):
            register ^= share[rest - (j + 1) * 256 + ((local >> np.uint32(8 * j)) & np.uint32(0xFF))]
        for j in range(4):  # value byte j is at distance 3 - j from the end
            register ^= share[(3 - j) * 256:(4 - j) * 256][value_bytes[:, j]]
        crc = mask(register ^ np.uint32(0xFFFFFFFF)).astype("<u4").view(np.uint8).reshape(n, 4)

        # The bytes into the rows, then the rows cut to their lengths.
        if all_walls:
            rows[:, 13:21] = wall_bytes
            if low == high and k:
                rows[:, 22:22 + k] = step_bytes
            elif k:
                self._put_steps(rows, np.full(n, 22), step_bytes, nbytes)
        else:
            walled = has_wall.astype(bool)
            rows[walled, 13:21] = wall_bytes[walled]
            if k:
                self._put_steps(rows, 13 + 9 * has_wall, step_bytes, nbytes)
        tail = np.concatenate([value_bytes, crc], axis=1)
        if int(lengths.min()) == width:
            rows[:, width - 8:] = tail
            return rows.tobytes()
        rows[np.arange(n)[:, None], (lengths - 8)[:, None] + np.arange(8)] = tail
        return rows[np.arange(width) < lengths[:, None]].tobytes()

    def _encode_common(self, tids: np.ndarray, values: np.ndarray, unsigned: np.ndarray, walls: np.ndarray,
                       k: int) -> bytes:
        """:meth:`encode` for the usual batch: every record with a wall time, every step k <= 8 bytes long.

        Each record is its layout's row with the wall time, step, value and
        checksum stored into it, a field of every row at once. The checksum
        adds the share of each byte that varies, looked up by column; a column
        that holds the same byte in every record (the high bytes of the wall
        times and steps of a batch, usually) is one lookup.
        """
        n = len(tids)
        layouts = self._layout_of[:, k, 1].take(tids)
        missing = layouts < 0
        if missing.any():
            for tid in np.unique(tids[missing]).tolist():
                self._add_layout(tid, k, 1)
            layouts = self._layout_of[:, k, 1].take(tids)
        lengths = self._length_arr.take(layouts)
        width = int(lengths.max())
        uniform = int(lengths.min()) == width
        rows = self._rows[:, :width].take(layouts, axis=0)  # a contiguous copy

        # The wall time at 13 (after the 12-byte header and its field's key), the step's varint at 22 (after its
        # key), the value and the checksum in the last 8 bytes.
        _column(rows, 13, "<f8")[:] = walls
        wall_bytes = rows[:, 13:21]
        step_words = step_bytes = None
        if k:
            step_words = unsigned & np.uint64(0x7F)  # the varint's bytes, little-endian in a uint64
            for j in range(1, k):
                step_words |= (unsigned & np.uint64(0x7F << (7 * j))) << np.uint64(j)
            step_words |= np.uint64(_CONTINUED[k])
            step_words = step_words.astype("<u8", copy=False)
            step_bytes = step_words.view(np.uint8).reshape(n, 8)[:, :k]
            rows[:, 22:22 + k] = step_bytes
        with np.errstate(over="ignore", invalid="ignore"):  # out of float32's range: infinity, as protobuf
            value = values.astype("<f4")
        value_words = value.view("<u4")

        register = self._register_arr.take(layouts)
        wall_words = walls.view("<u8")
        if uniform:  # a byte's distance from the end of the payload (width - 5 - its column) is the same in every row
            register ^= _shares(wall_words, wall_bytes, width - 18)
            if k:
                register ^= _shares(step_words, step_bytes, width - 27)
        else:  # the share of the bytes up to the step's end, as if they ended the payload, then moved past the rest
            prefix = 10 + k
            local = _shares(wall_words, wall_bytes, prefix - 2)
            if k:
                local = local ^ _shares(step_words, step_bytes, k - 1)
            local = np.broadcast_to(local, (n,))
            share = tables().share
            rest = (lengths - 16 - prefix) * 256
            for j in range(4):
                register ^= share[rest - (j + 1) * 256 + ((local >> np.uint32(8 * j)) & np.uint32(0xFF))]
        register ^= _shares(value_words, value.view(np.uint8).reshape(n, 4), 3)
        crc = mask(register ^ np.uint32(0xFFFFFFFF))
        tail = value_words.astype(np.uint64) | (crc.astype(np.uint64) << np.uint64(32))
        if uniform:
            _column(rows, width - 8, "<u8")[:] = tail
            return rows.tobytes()
        # each record's last 8 bytes, through a view of the 8-byte words that start at every byte
        words = np.ndarray((rows.size - 7,), "<u8", rows, 0, (1,))
        words[np.arange(0, n * width, width) + lengths - 8] = tail
        return rows[np.arange(width) < lengths[:, None]].tobytes()

    @staticmethod
    def _put_steps(rows: np.ndarray, first: np.ndarray, step_bytes: np.ndarray, nbytes: np.ndarray) -> None:
        column = np.arange(step_bytes.shape[1])
        inside = column < nbytes[:, None]
        record = np.broadcast_to(np.arange(len(rows))[:, None], inside.shape)
        rows[record[inside], (first[:, None] + column)[inside]] = step_bytes[inside]


def _varint_length(unsigned: int) -> int:
    """Bytes of the varint of an unsigned 64-bit value; 0 for 0, which protobuf leaves out."""
    return (unsigned.bit_length() + 6) // 7


#: the continuation bits of a varint of k bytes, as a little-endian uint64: 0x80 in every byte but the last
_CONTINUED = [sum(0x80 << (8 * j) for j in range(k - 1)) for k in range(9)]


def _shares(words: np.ndarray, data: np.ndarray, first: int):
    """The checksum's share of each row of ``data`` (the bytes of ``words``, little-endian): byte j at distance
    ``first - j`` from the end of the message. A byte the same in every row is looked up once."""
    share = tables().share
    varies = int(np.bitwise_or.reduce(words ^ words[0]))  # the bits that are not the same in every word
    same = int(words[0])
    out = np.uint32(0)
    for j in range(data.shape[1]):
        d = first - j
        if (varies >> (8 * j)) & 0xFF:
            out = out ^ share[d * 256:(d + 1) * 256].take(data[:, j])
        else:
            out = out ^ share[d * 256 + ((same >> (8 * j)) & 0xFF)]
    return out


def _column(rows: np.ndarray, offset: int, dtype: str) -> np.ndarray:
    """A field of every row of a C-contiguous uint8 matrix, as one value per row (unaligned: numpy copes)."""
    return np.ndarray((len(rows),), dtype, rows, offset, (rows.shape[1],))


#: a queued item, packed: a scalar's tag index, value, step and wall time; another event has tag -1 - its number
ITEM = struct.Struct("<qdqd")
_ITEMS = np.dtype([("tag", "<i8"), ("value", "<f8"), ("step", "<i8"), ("wall", "<f8")])
_pack = ITEM.pack


def frame(payload: bytes) -> bytes:
    """One TFRecord: length, its checksum, the payload, its checksum."""
    return struct.pack("<QI", len(payload), header_crc(len(payload))) + payload + struct.pack(
        "<I", masked_crc32c(payload))


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
        from tensorboard.summary.writer import event_file_writer

        return event_file_writer._global_uid
    except (ImportError, AttributeError):
        return _Counter()


class EventFileWriter:
    """TensorBoard's ``EventFileWriter``, for a local log dir: the same file, name and records, written in batches.

    ``max_queue_size`` is accepted and not a limit: records wait for
    ``flush_secs`` or :data:`BATCH` records, whichever comes first.
    """

    def __init__(self, logdir, max_queue_size=10, flush_secs=120, filename_suffix=""):
        from tensorboard.compat.proto import event_pb2

        self._logdir = str(logdir)
        os.makedirs(self._logdir, exist_ok=True)
        self._file_name = os.path.join(self._logdir, "events.out.tfevents.%010d.%s.%s.%s" % (
            time.time(), socket.gethostname(), os.getpid(), _uid_counter().get())) + filename_suffix
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
        self.add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2",
                                       source_metadata=event_pb2.SourceMetadata(writer=_FILE_VERSION_WRITER)))
        self.flush()
        self._thread = threading.Thread(target=self._run, name="danlu-event-writer", daemon=True)
        self._thread.start()

    def get_logdir(self) -> str:
        return self._logdir

    def add_event(self, event) -> None:
        """Queue any ``Event`` proto, serialized now (as TensorBoard does)."""
        from tensorboard.compat.proto import event_pb2

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
                view = view[os.write(self._fd, view):]


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
            _FAST_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.int64, torch.int32,
                                      torch.int16, torch.int8, torch.uint8, torch.bool})
        if value.dtype in _FAST_DTYPES and value.numel() == 1 and value.device.type != "meta":
            return float(value)
    return None


def event_file_writer(logdir, max_queue_size=10, flush_secs=120, filename_suffix=""):
    """An :class:`EventFileWriter` for a local log dir; TensorBoard's own for a remote one (``s3://``, ``gs://``)."""
    if "://" in str(logdir):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter as TensorBoardWriter

        return TensorBoardWriter(logdir, max_queue_size, flush_secs, filename_suffix)
    return EventFileWriter(logdir, max_queue_size, flush_secs, filename_suffix)


def activate(writer_module) -> None:
    """Make ``torch.utils.tensorboard.writer`` write through this module (its FileWriters and add_scalar)."""
    writer_module.EventFileWriter = event_file_writer
    cls = writer_module.SummaryWriter
    original = cls.add_scalar
    now, pack = time.time, _pack

    def add_scalar(self, tag, scalar_value, global_step=None, walltime=None, new_style=False,
                   double_precision=False):
        # The common call, queued here in the fewest steps: a tag already seen, a float, an int step, no wall time,
        # an open writer (torch sets file_writer and all_writers together: the file_writer is the one
        # _get_file_writer() returns). Every other call, and one that fails here, goes through writer.add_scalar
        # or torch.
        if (type(tag) is str and type(scalar_value) is float and type(global_step) is int and walltime is None
                and not (new_style or double_precision)):
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
