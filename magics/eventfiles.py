"""Reading TensorBoard event files that the job's own code writes: incrementally, safely, scalars only.

The files are the user's, so nothing here trusts them: a file is opened
without following links and without blocking (a FIFO cannot hang the
runner), must be a regular file, and is read in bounded chunks. Records are
TFRecord-framed ``Event`` protos; their CRC32C checksums are verified for the
records that hold scalars, corrupt or oversized records are skipped, and a
record cut short at the end of a file being written is read again later.
Used by :class:`danlu.events.MetricForwarder`.
"""

from __future__ import annotations

import collections
import errno
import os
import stat
import struct
from pathlib import Path

READ_CHUNK = 8 << 20  # bytes read from one event file at a time
MAX_RECORD = 64 << 20  # a larger record holds no scalar worth its memory: skipped unread
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


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


def _masked_crc32c(data: bytes, table=_CRC_TABLE) -> int:
    """The CRC-32C of TFRecord framing, masked as TensorFlow masks it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


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
        from google.protobuf.message import DecodeError
        from tensorboard.compat.proto.event_pb2 import Event

        pos, events, end = 0, [], len(data)
        while end - pos >= _HEADER.size:
            length, header_crc = _HEADER.unpack_from(data, pos)
            if _masked_crc32c(data[pos:pos + 8]) != header_crc:  # the length cannot be trusted: stop here
                self.skipped = f"corrupt record at byte {self.offset + pos}"
                break
            size = _HEADER.size + length + _FOOTER.size
            if pos + size > end:
                return pos, events, size
            payload = data[pos + _HEADER.size:pos + size - _FOOTER.size]
            pos += size
            try:
                event = Event.FromString(payload)
            except DecodeError:
                self.problems["corrupt"] += 1
                continue
            if not event.HasField("summary"):
                continue
            values = _scalars(event)
            if not values:
                continue
            if _masked_crc32c(payload) != _FOOTER.unpack_from(data, pos - _FOOTER.size)[0]:
                self.problems["corrupt"] += 1
                continue
            events.append((event.wall_time, event.step, values))
        return pos, events, 0


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
