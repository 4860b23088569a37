"""Reading the event files a job's own code writes: which files, and their scalars, trusting nothing in them.

The files are the user's, so the reader trusts nothing in them: a file is
opened without following links and without blocking (a FIFO cannot hang the
runner), must be a regular file, and is read in bounded chunks. Records are
TFRecord-framed ``Event`` protos (:mod:`danlu.tensorboard.format`); their
CRC32C checksums are verified for the records that hold scalars, corrupt or
oversized records are skipped, and a record cut short at the end of a file
being written is read again later. The common scalar record (one
``simple_value``, as ``SummaryWriter.add_scalar`` writes it) is decoded
without protobuf; any other record goes through protobuf. :class:`LogDirs`
says which files there are: those of the job's default log dir and of every
log dir rank 0 listed in the logdirs file, which is read up to 1 MiB and 100
directories. Used by :class:`danlu.tensorboard.forwarder.MetricForwarder`.
"""

from __future__ import annotations

import collections
import errno
import os
import stat
import struct
from pathlib import Path

import numpy as np
from google.protobuf.message import DecodeError

from danlu.tensorboard.format import DEPTH, header_crc, masked_crc32c, span_crcs

READ_CHUNK = 8 << 20  # bytes read from one event file at a time
MAX_RECORD = 64 << 20  # a larger record holds no scalar worth its memory: skipped unread
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CHECK_BYTES = 1 << 20  # bytes checked per pass
_HEADER = struct.Struct("<QI")  # a record's length and its checksum
_FOOTER = struct.Struct("<I")  # the payload's checksum
LOGDIRS_MAX_BYTES = 1 << 20
LOGDIRS_MAX_DIRS = 100


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
                event = self._decode(data[start : start + length])
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
        # deferred: TensorBoard's protos take ~30 ms to import; a job that writes no event file needs none
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
        bounds = np.searchsorted(
            np.cumsum(lengths[short]), np.arange(CHECK_BYTES, int(lengths[short].sum()), CHECK_BYTES)
        )
        for group in np.split(short, bounds):
            if len(group):
                crcs[group] = span_crcs(buf, starts[group], lengths[group])
        for i in np.flatnonzero(lengths > DEPTH).tolist():
            crcs[i] = masked_crc32c(data[starts[i] : starts[i] + lengths[i]])
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


class LogDirs:
    """The event files of a job: those in its default log dirs and in the dirs its logdirs file lists.

    ``logdirs_file`` (None: there is none) lists more log dirs, one a line (rank 0 appends to it); it
    must be a regular file and is read up to 1 MiB and 100 distinct dirs. What of it was ignored, and
    why, waits in :attr:`problems` (a key and a sentence, for the forwarder's notes) until the caller
    clears it.
    """

    def __init__(self, logdirs_file: Path | None = None, default_dirs=()):
        self.file = Path(logdirs_file) if logdirs_file is not None else None
        self.default_dirs = [Path(d) for d in default_dirs]
        self.problems: dict[tuple, str] = {}
        self._registered: tuple[tuple, list[str]] | None = None  # (logdirs file identity, its dirs)

    def event_files(self) -> list[str]:
        """Every ``events.out.tfevents.*`` file of every dir, a dir's in name order."""
        files = []
        for d in self.dirs():
            try:
                names = sorted(entry.name for entry in os.scandir(d) if entry.name.startswith("events.out.tfevents."))
            except OSError:  # not there (yet), not a directory, not readable
                continue
            files += [os.path.join(d, name) for name in names]
        return files

    def dirs(self) -> list[str]:
        """The default dirs, then the listed ones, each once (by its real path)."""
        seen, out = set(), []
        for d in [str(d) for d in self.default_dirs] + self._registered_dirs():
            d = os.path.realpath(d)
            if d not in seen:
                seen.add(d)
                out.append(d)
        return out

    def _registered_dirs(self) -> list[str]:
        """The dirs listed in the logdirs file: a regular file, read up to 1 MiB and 100 distinct dirs."""
        if self.file is None:
            return []
        ident, data, why = read_regular(self.file, LOGDIRS_MAX_BYTES)
        if why:
            self.problems[("logdirs", why)] = f"{self.file.name} ignored: {why}"
            return []
        if data is None:
            return []
        if self._registered is not None and self._registered[0] == ident:
            return self._registered[1]
        if len(data) > LOGDIRS_MAX_BYTES:
            data = data[: data.rfind(b"\n", 0, LOGDIRS_MAX_BYTES + 1) + 1]
            self.problems[("logdirs", "size")] = f"{self.file.name}: only its first 1 MiB is read"
        dirs, seen = [], set()
        for line in data.splitlines():
            if not line.strip() or b"\0" in line:
                continue
            path = os.fsdecode(line)
            if path in seen:
                continue
            if len(dirs) == LOGDIRS_MAX_DIRS:
                self.problems[("logdirs", "count")] = (
                    f"{self.file.name}: only its first {LOGDIRS_MAX_DIRS} directories are read"
                )
                break
            seen.add(path)
            dirs.append(path)
        self._registered = (ident, dirs)
        return dirs
