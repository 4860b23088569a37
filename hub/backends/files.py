"""Reading and preparing a job's folder without trusting anything the job put in it.

A job's folder belongs to the job (in unix-accounts mode, to its user's
account) and the job may replace anything in it with a link, a FIFO, a
directory or a hard link to someone else's file. The service is root there.
So every file the local backend reads is opened by :func:`open_job_file`:
each path component is opened relative to the one before with ``O_NOFOLLOW``
(starting from the jobs root, which only the service can write), the file
itself with ``O_PATH`` (no side effects, not even on a FIFO or a device),
then checked -- a regular file, one link, owned by the job's account -- and
only then reopened for reading through ``/proc/self/fd``. Reads are bounded
``pread`` calls done off the event loop by the caller.

:func:`prepare_job_dir` creates the folder for an attempt (or checks the one
an earlier attempt left) and hands it to the account, also without following
links. The service writes nothing else there.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from danlu.hub.backends.base import FileRefused

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH = getattr(os, "O_PATH", 0)


def _open_dir(name: str, dir_fd: int | None) -> int:
    try:
        return os.open(name, _DIR, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP (a link), ENOTDIR (a file), EACCES
        raise FileRefused(f"'{name}' is not a folder of the job's (a link, or not a folder)") from e


def open_job_file(root: Path, job_id: str, relpath: str, *, uid: int | None) -> int | None:
    """A read-only fd of ``<root>/<job_id>/<relpath>`` if it is a plain file of the job's; None if missing.

    Raises :class:`FileRefused` for a link (anywhere on the path), a FIFO, a socket, a device, a
    directory, a file with more than one link, or one owned by another account than ``uid``.
    """
    parts = [p for p in relpath.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ValueError(f"bad job file path {relpath!r}")
    fds: list[int] = []
    try:
        try:
            fds.append(os.open(str(Path(root) / job_id), _DIR))
            for part in parts[:-1]:
                fds.append(_open_dir(part, fds[-1]))
            if _PATH:
                handle = os.open(parts[-1], _PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fds[-1])
            else:  # not Linux: non-blocking, so a FIFO cannot hang us
                handle = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fds[-1])
        except FileNotFoundError:
            return None
        except OSError as e:
            raise FileRefused(f"{relpath} is a link or cannot be opened ({e.strerror})") from None
        try:
            st = os.fstat(handle)
            if stat.S_ISLNK(st.st_mode):
                raise FileRefused(f"{relpath} is a link")
            if not stat.S_ISREG(st.st_mode):
                raise FileRefused(f"{relpath} is not a plain file")
            if st.st_nlink != 1:
                raise FileRefused(f"{relpath} has {st.st_nlink} links (a hard link to another file?)")
            if uid is not None and st.st_uid != uid:
                raise FileRefused(f"{relpath} belongs to another account")
            if not _PATH:
                return handle
            fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_CLOEXEC)
            os.close(handle)
            return fd
        except BaseException:
            os.close(handle)
            raise
    finally:
        for fd in fds:
            os.close(fd)


def read_job_file(
    root: Path, job_id: str, relpath: str, *, uid: int | None, offset: int, limit: int
) -> tuple[bytes, int] | None:
    """Up to ``limit`` bytes at ``offset`` and the file's size; None when it does not exist (yet)."""
    fd = open_job_file(root, job_id, relpath, uid=uid)
    return None if fd is None else read_chunk(fd, offset, limit)


def read_chunk(fd: int, offset: int, limit: int) -> tuple[bytes, int]:
    """Up to ``limit`` bytes at ``offset`` of an open file and its size; closes ``fd``."""
    try:
        size = os.fstat(fd).st_size
        if offset >= size or limit <= 0:
            return b"", size
        return os.pread(fd, min(limit, size - offset), offset), size
    finally:
        os.close(fd)


def prepare_job_dir(root: Path, job_id: str, account) -> Path:
    """Create (or check) ``<root>/<job_id>``, owned by ``account`` (None: this process's), mode 0700.

    ``root`` is the service's; the job may have changed what is inside its folder, never the
    folder's own entry. A folder an earlier attempt left is reused (its checkpoints stay).
    """
    path = Path(root) / job_id
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    fd = os.open(str(path), _DIR)  # refuses a link
    try:
        if account is not None:
            os.fchown(fd, account.uid, account.gid)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path
