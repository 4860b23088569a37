"""Encoding scalar records by the thousand: the bytes TensorBoard writes for ``add_scalar``, built by column.

:class:`ScalarEncoder` turns columns of (tag index, value, step, wall time)
into the records ``Event(wall_time, step, summary(value(tag, simple_value)))``
with their checksums, byte for byte what protobuf and TensorBoard write. A
record's bytes that depend only on its *layout* (tag, step length, whether
the wall time is written) come from a row prepared once per layout; the rest,
and their share of the checksum, are filled in with numpy for a whole batch
at once. Used by :mod:`danlu.tensorboard.writer`, which queues the scalars.
"""

from __future__ import annotations

import struct
import threading

import numpy as np

from danlu.tensorboard.format import crc_register, header_crc, mask, tables

MAX_TAG_BYTES = 900  # longer tags go through torch (a record must stay within the CRC tables)
MAX_TAGS = 100_000  # tags beyond these (a tag per step?) go through torch: memory stays bounded


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
            grown[: len(self._layout_of)] = self._layout_of
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
            grown[: len(self._rows), : self._rows.shape[1]] = self._rows
            self._rows = grown
            more = count - len(self._length_arr)
            self._length_arr = np.concatenate([self._length_arr, np.zeros(more, dtype=np.int64)])
            self._register_arr = np.concatenate([self._register_arr, np.zeros(more, dtype=np.uint32)])
        self._rows[layout, : len(row)] = np.frombuffer(row, dtype=np.uint8)
        self._rows[layout, len(row) :] = 0
        self._length_arr[layout] = len(row)
        self._register_arr[layout] = crc_register(payload)
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
                local ^= share[d * 256 : (d + 1) * 256][wall_bytes[:, j]]
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
            register ^= share[(3 - j) * 256 : (4 - j) * 256][value_bytes[:, j]]
        crc = mask(register ^ np.uint32(0xFFFFFFFF)).astype("<u4").view(np.uint8).reshape(n, 4)

        # The bytes into the rows, then the rows cut to their lengths.
        if all_walls:
            rows[:, 13:21] = wall_bytes
            if low == high and k:
                rows[:, 22 : 22 + k] = step_bytes
            elif k:
                self._put_steps(rows, np.full(n, 22), step_bytes, nbytes)
        else:
            walled = has_wall.astype(bool)
            rows[walled, 13:21] = wall_bytes[walled]
            if k:
                self._put_steps(rows, 13 + 9 * has_wall, step_bytes, nbytes)
        tail = np.concatenate([value_bytes, crc], axis=1)
        if int(lengths.min()) == width:
            rows[:, width - 8 :] = tail
            return rows.tobytes()
        rows[np.arange(n)[:, None], (lengths - 8)[:, None] + np.arange(8)] = tail
        return rows[np.arange(width) < lengths[:, None]].tobytes()

    def _encode_common(
        self, tids: np.ndarray, values: np.ndarray, unsigned: np.ndarray, walls: np.ndarray, k: int
    ) -> bytes:
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
            rows[:, 22 : 22 + k] = step_bytes
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
            out = out ^ share[d * 256 : (d + 1) * 256].take(data[:, j])
        else:
            out = out ^ share[d * 256 + ((same >> (8 * j)) & 0xFF)]
    return out


def _column(rows: np.ndarray, offset: int, dtype: str) -> np.ndarray:
    """A field of every row of a C-contiguous uint8 matrix, as one value per row (unaligned: numpy copes)."""
    return np.ndarray((len(rows),), dtype, rows, offset, (rows.shape[1],))
