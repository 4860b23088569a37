"""The event-file format: TFRecord framing and its CRC-32C checksums, fast for many records at once.

An event file is a sequence of TFRecords, each ``length (8 bytes), masked
CRC-32C of the length, payload (an Event proto), masked CRC-32C of the
payload``. This module owns those bytes: :func:`frame` makes a record,
:func:`header_crc` and :func:`masked_crc32c` check or make the checksums, and
:func:`span_crcs` computes the checksums of many records at once with numpy
(TensorBoard's own pure-Python CRC costs about 10 us for one scalar record,
numpy a fraction of a microsecond). The writer (:mod:`danlu.tensorboard.encoder`,
:mod:`danlu.tensorboard.writer`) and the reader (:mod:`danlu.tensorboard.reader`)
both use it, so what one writes the other reads.
"""

from __future__ import annotations

import struct

import numpy as np

# CRC-32C ---------------------------------------------------------------------------------------
#
# The CRC register after a message is linear in its bytes: with A the step of
# one zero byte, the register after bytes b_0..b_{L-1} from the initial value
# is A^L(init) ^ XOR_i A^(L-1-i)(T[b_i]). So a byte's share depends only on its
# value and its distance from the end of the message, and one table lookup per
# byte, done for many bytes at once, gives every checksum.

DEPTH = 1024  # messages up to this many bytes are checked in one vectorized pass
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
        state = (
            int(share[first[0] + (state & 0xFF)])
            ^ int(share[first[1] + ((state >> 8) & 0xFF)])
            ^ int(share[first[2] + ((state >> 16) & 0xFF)])
            ^ int(share[first[3] + (state >> 24)])
            ^ chunk_share
        )
    return mask(state ^ 0xFFFFFFFF)


_distance_cache: dict[int, np.ndarray] = {}


def _distances(n: int) -> np.ndarray:
    """``(n - 1 - i) * 256`` for i < n: the table offsets of a message's bytes."""
    d = _distance_cache.get(n)
    if d is None:
        d = _distance_cache[n] = np.arange(n - 1, -1, -1, dtype=np.int64) * 256
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


def crc_register(data: bytes) -> int:
    """The CRC-32C register after ``data`` from the initial value, before the final xor (pure Python: rare)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc


def frame(payload: bytes) -> bytes:
    """One TFRecord: length, its checksum, the payload, its checksum."""
    return (
        struct.pack("<QI", len(payload), header_crc(len(payload))) + payload + struct.pack("<I", masked_crc32c(payload))
    )
