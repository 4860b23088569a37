"""TensorBoard event files: their CRC-32C framing, and reading the ones a job's own code writes.

The files are the user's, so the reader trusts nothing in them: a file is
opened without following links and without blocking (a FIFO cannot hang the
runner), must be a regular file, and is read in bounded chunks. Records are
TFRecord-framed ``Event`` protos; their CRC32C checksums are verified for the
records that hold scalars, corrupt or oversized records are skipped, and a
record cut short at the end of a file being written is read again later.
Used by :class:`danlu.events.MetricForwarder`.

Checksums are computed many records at a time with numpy (TensorBoard's own
pure-Python CRC costs about 10 us for one scalar record, numpy a fraction of
a microsecond), and the common scalar record (one ``simple_value``, as
``SummaryWriter.add_scalar`` writes it) is decoded without protobuf; any
other record goes through protobuf. :mod:`danlu.eventwriter` writes with the
same checksums.
"""

from __future__ import annotations

import collections
import errno
import os
import stat
import struct
from pathlib import Path

import numpy as np

READ_CHUNK = 8 << 20  # bytes read from one event file at a time
MAX_RECORD = 64 << 20  # a larger record holds no scalar worth its memory: skipped unread
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

# CRC-32C ---------------------------------------------------------------------------------------
#
# The CRC register after a message is linear in its bytes: with A the step of
# one zero byte, the register after bytes b_0..b_{L-1} from the initial value
# is A^L(init) ^ XOR_i A^(L-1-i)(T[b_i]). So a byte's share depends only on its
# value and its distance from the end of the message, and one table lookup per
# byte, done for many bytes at once, gives every checksum.

DEPTH = 1024  # messages up to this many bytes are checked in one vectorized pass
CHECK_BYTES = 1 << 20  # bytes checked per pass
_MASK_DELTA = 0xA282EAD8


def _crc_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_CRC_TABLE = _crc_table()
_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")


class _Tables:
    """``share[d * 256 + b]``: the share of byte b at distance d from the end; ``init[n]``: the initial value's."""

    share: np.ndarray
    init: np.ndarray

    def __init__(self):
        table = np.array(_CRC_TABLE, dtype=np.uint32)
        share = np.empty((DEPTH, 256), dtype=np.uint32)
        share[0] = table
        for d in range(1, DEPTH):
            share[d] = table[share[d - 1] & 0xFF] ^ (share[d - 1] >> 8)
        init = [0xFFFFFFFF]
        for _ in range(DEPTH):
            init.append(_CRC_TABLE[init[-1] & 0xFF] ^ (init[-1] >> 8))
        self.share = share.reshape(-1)
        self.init = np.array(init, dtype=np.uint32)


_tables: _Tables | None = None


def tables() -> _Tables:
    global _tables
    if _tables is None:
        _tables = _Tables()
    return _tables


def mask(crc):
    """TFRecord's masking of a CRC (an int or a uint32 array)."""
    if isinstance(crc, np.ndarray):
        return ((crc >> 15) | (crc << 17)) + np.uint32(_MASK_DELTA)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The masked CRC-32C of TFRecord framing, of a message of any length."""
    n = len(data)
    if n <= DEPTH:
        buf = np.frombuffer(data, dtype=np.uint8)
        return int(span_crcs(buf, np.zeros(1, np.int64), np.array([n], np.int64))[0])
    t = tables()
    buf = np.frombuffer(data, dtype=np.uint8)
    head = n % DEPTH
    state = 0xFFFFFFFF
    if head:
        state = int(t.init[head]) ^ int(np.bitwise_xor.reduce(t.share[_distances(head) + buf[:head]]))
    # each full chunk's share from a zero register, then chained: a register r before a chunk
    # adds what r's four bytes add as the chunk's first four bytes
    chunks = buf[head:].reshape(-1, DEPTH)
    shares = np.bitwise_xor.reduce(t.share[_distances(DEPTH) + chunks], axis=1)
    first = [(DEPTH - 1 - j) * 256 for j in range(4)]
    share = t.share
    for chunk_share in shares.tolist():
        state = (int(share[first[0] + (state & 0xFF)]) ^ int(share[first[1] + ((state >> 8) & 0xFF)])
                 ^ int(share[first[2] + ((state >> 16) & 0xFF)]) ^ int(share[first[3] + (state >> 24)])
                 ^ chunk_share)
    return mask(state ^ 0xFFFFFFFF)


_distance_cache: dict[int, np.ndarray] = {}


def _distances(n: int) -> np.ndarray:
    """``(n - 1 - i) * 256`` for i < n: the table offsets of a message's bytes."""
    d = _distance_cache.get(n)
    if d is None:
        d = _distance_cache[n] = (np.arange(n - 1, -1, -1, dtype=np.int64) * 256)
    return d


def span_crcs(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The masked CRC-32C (uint32) of each message ``buf[start:start + length]``, each at most DEPTH bytes."""
    t = tables()
    lengths = lengths.astype(np.int64, copy=False)
    raw = t.init[lengths]  # a copy: fancy indexing
    total = int(lengths.sum())
    if total:
        nonempty = lengths > 0
        ends = np.cumsum(lengths)
        begins = ends - lengths
        last = starts + lengths - 1
        pos = np.arange(total, dtype=np.int64) + np.repeat(starts - begins, lengths)
        dist = np.repeat(last, lengths) - pos
        shares = t.share[dist * 256 + buf[pos]]
        raw[nonempty] ^= np.bitwise_xor.reduceat(shares, begins[nonempty])
    return mask(raw ^ np.uint32(0xFFFFFFFF))


_header_crcs: dict[int, int] = {}


def header_crc(length: int) -> int:
    """The masked CRC of a record header: it depends only on the length, so it is computed once per length."""
    crc = _header_crcs.get(length)
    if crc is None:
        if len(_header_crcs) > 4096:
            _header_crcs.clear()
        crc = _header_crcs[length] = masked_crc32c(struct.pack("<Q", length))
    return crc


# reading ---------------------------------------------------------------------------------------

def _scalars(event) -> list[tuple[str, float]]:
    """(tag, value) of every scalar in a TensorBoard event: simple values, and tensors of one float or double.

    A tensor with a shape (a PR curve, say) is not a scalar, even when its values are floats.
    """
    out = []
    for value in event.summary.value:
        if value.HasField("simple_value"):
            out.append((value.tag, float(value.simple_value)))
        elif value.HasField("tensor") and not value.tensor.tensor_shape.dim:
            numbers = value.tensor.float_val or value.tensor.double_val
            if len(numbers) == 1:
                out.append((value.tag, float(numbers[0])))
    return out


_DOUBLE = struct.Struct("<d")
_FLOAT = struct.Struct("<f")


def _varint(data: bytes, i: int, end: int) -> tuple[int, int]:
    """(value, next index) of the varint at i; (-1, end) when it runs past end or past 10 bytes."""
    value = shift = 0
    for j in range(i, min(end, i + 10)):
        byte = data[j]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, j + 1
        shift += 7
    return -1, end


def simple_scalar(data: bytes, start: int, end: int) -> tuple[float, int, list] | None:
    """(wall_time, step, [(tag, value)]) of an Event holding exactly one simple_value, laid out as protobuf writes it.

    The bytes are ``[wall_time] [step] summary{value{tag, simple_value}}`` in
    field order; anything else (other fields, another order, a tag that is not
    UTF-8) returns None, for protobuf to decode. The result equals protobuf's.
    """
    i, wall_time, step = start, 0.0, 0
    if i < end and data[i] == 0x09:  # field 1, double
        if end - i < 9:
            return None
        wall_time = _DOUBLE.unpack_from(data, i + 1)[0]
        i += 9
    if i < end and data[i] == 0x10:  # field 2, varint
        step, i = _varint(data, i + 1, end)
        if step < 0 or step >= 1 << 64:
            return None
        if step >= 1 << 63:
            step -= 1 << 64
    if i >= end or data[i] != 0x2A:  # field 5, the summary
        return None
    size, i = _varint(data, i + 1, end)
    if i + size != end or i >= end or data[i] != 0x0A:  # its one value
        return None
    size, i = _varint(data, i + 1, end)
    if i + size != end or i >= end:
        return None
    if data[i] == 0x15 and i + 5 == end:  # no tag: proto3 leaves out an empty string
        return wall_time, step, [("", _FLOAT.unpack_from(data, i + 1)[0])]
    if data[i] != 0x0A:  # the tag
        return None
    size, i = _varint(data, i + 1, end)
    tag_end = i + size
    if size < 0 or tag_end + 5 != end or data[tag_end] != 0x15:  # then simple_value, and nothing else
        return None
    try:
        tag = data[i:tag_end].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return wall_time, step, [(tag, _FLOAT.unpack_from(data, tag_end + 1)[0])]


class EventFile:
    """One event file, read from ``offset`` on, through a descriptor that follows no link and never blocks."""

    __slots__ = ("path", "offset", "skipped", "problems")

    def __init__(self, path: str):
        self.path = path
        self.offset = 0  # the start of the first record not read yet
        self.skipped: str | None = None  # why the file is no longer read
        self.problems: collections.Counter = collections.Counter()  # what was skipped inside it

    def read(self, limit: int) -> tuple[list[tuple[float, int, list]], bool]:
        """(events with scalars as (wall_time, step, [(tag, value)]), whether more is left to read)."""
        try:
            fd = os.open(self.path, _OPEN_FLAGS)
        except FileNotFoundError:
            return [], False
        except OSError as e:  # a link (ELOOP), a socket (ENXIO), no permission
            self.skipped = _why_not(e)
            return [], False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self.skipped = "not a regular file"
                return [], False
            left = st.st_size - self.offset
            if left <= 0:
                return [], False
            data = os.pread(fd, min(left, limit), self.offset)
            used, events, need = self._parse(data)
            if used == 0 and need > len(data):  # the first record is larger than one read
                if need > MAX_RECORD:
                    used = need  # skipped unread, even if not fully written yet
                    self.problems["larger than 64 MiB"] += 1
                elif need <= left:
                    used, events, _ = self._parse(os.pread(fd, need, self.offset))
            self.offset += used
            # more only after progress: a record still being written ends the reading
            return events, used > 0 and self.skipped is None and self.offset < st.st_size
        finally:
            os.close(fd)

    def _parse(self, data: bytes) -> tuple[int, list, int]:
        """(bytes of complete records, their events with scalars, size of the incomplete record after them)."""
        pos, events, end, need = 0, [], len(data), 0
        checks: list[tuple[int, int, int, int]] = []  # (event index, payload start, length, stored crc)
        unpack_header, footer = _HEADER.unpack_from, _FOOTER.unpack_from
        while end - pos >= _HEADER.size:
            length, stored_header_crc = unpack_header(data, pos)
            if header_crc(length) != stored_header_crc:  # the length cannot be trusted: stop here
                self.skipped = f"corrupt record at byte {self.offset + pos}"
                break
            size = _HEADER.size + length + _FOOTER.size
            if pos + size > end:
                need = size
                break
            start = pos + _HEADER.size
            pos += size
            event = simple_scalar(data, start, start + length)
            if event is None:
                event = self._decode(data[start:start + length])
                if event is None:
                    continue
            checks.append((len(events), start, length, footer(data, pos - _FOOTER.size)[0]))
            events.append(event)
        if checks:
            bad = self._corrupt(data, checks)
            if bad:
                self.problems["corrupt"] += len(bad)
                events = [event for i, event in enumerate(events) if i not in bad]
        return pos, events, need

    def _decode(self, payload: bytes) -> tuple[float, int, list] | None:
        from google.protobuf.message import DecodeError
        from tensorboard.compat.proto.event_pb2 import Event

        try:
            event = Event.FromString(payload)
        except DecodeError:
            self.problems["corrupt"] += 1
            return None
        if not event.HasField("summary"):
            return None
        values = _scalars(event)
        return (event.wall_time, event.step, values) if values else None

    @staticmethod
    def _corrupt(data: bytes, checks: list) -> set[int]:
        """The event indexes whose payload does not match its stored CRC."""
        index, starts, lengths, stored = (np.array(column, dtype=np.int64) for column in zip(*checks, strict=True))
        crcs = np.zeros(len(checks), dtype=np.int64)
        buf = np.frombuffer(data, dtype=np.uint8)
        short = np.flatnonzero(lengths <= DEPTH)
        # groups of about CHECK_BYTES payload bytes: the pass holds a few int64 per byte
        bounds = np.searchsorted(np.cumsum(lengths[short]), np.arange(CHECK_BYTES, int(lengths[short].sum()),
                                                                         CHECK_BYTES))
        for group in np.split(short, bounds):
            if len(group):
                crcs[group] = span_crcs(buf, starts[group], lengths[group])
        for i in np.flatnonzero(lengths > DEPTH).tolist():
            crcs[i] = masked_crc32c(data[starts[i]:starts[i] + lengths[i]])
        return set(index[crcs != stored].tolist())


def _why_not(error: OSError) -> str:
    if error.errno in (errno.ELOOP, errno.ENXIO):  # a symbolic link, a socket
        return "not a regular file"
    return error.strerror or str(error)


def read_regular(path: Path, limit: int) -> tuple[tuple | None, bytes | None, str | None]:
    """(identity, up to limit + 1 bytes, why not) of a file that must be a regular file, without blocking."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None, None, None
    except OSError as e:
        return None, None, _why_not(e)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, None, "not a regular file"
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.pread(fd, limit + 1 - size, size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return ident, b"".join(chunks), None
    finally:
        os.close(fd)
