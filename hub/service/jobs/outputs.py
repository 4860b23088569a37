"""Executed notebooks that runners hand over through the runner API (job pods keep no folder to read).

They live in the service's own folder, ``<state>/outputs/<job id>/rank-<n>.ipynb`` (0600, written
atomically, opened without following links), never in a place a job can write; the newest attempt's
copy replaces an earlier one. :func:`read` serves them as a backend serves a job's file: a bounded chunk
and the size, or None when there is none.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from danlu.hub.backends.files import read_chunk


def _path(state_dir: Path, job_id: str, rank: int) -> Path:
    return Path(state_dir) / "outputs" / job_id / f"rank-{int(rank)}.ipynb"


def keep(state_dir: Path, job_id: str, rank: int, data: bytes) -> None:
    path = _path(state_dir, job_id, rank)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".rank-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read(state_dir: Path, job_id: str, rank: int, offset: int, limit: int) -> tuple[bytes, int] | None:
    try:
        fd = os.open(_path(state_dir, job_id, rank), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return read_chunk(fd, offset, limit)
