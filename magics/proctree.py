"""Find and end every process that belongs to a job (or to a whole workbench).

A job's processes are not one process group: Jupyter kernels start in their
own session, torchrun starts workers, user code may start anything. A process
belongs to a job if it descends from the job's runner or if its environment
carries one of the job's markers (``DANLU_JOB_ID=<id>``, or the runner's own
``DANLU_RUNNER_ID``, which its kernels carry from their start), which every
descendant inherits even after being re-parented. In unix-accounts mode only
processes of the job's own account are considered. :func:`kill_matching` sends SIGTERM,
waits the grace period, sends SIGKILL, and scans again until nothing matches,
so processes forked during the shutdown are caught too.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time

import psutil

log = logging.getLogger(__name__)


def _environ(proc: psutil.Process) -> dict:
    try:
        return proc.environ()
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
        return {}


def _protected() -> set[int]:
    """This process and its ancestors: never ours to kill."""
    pids = {os.getpid()}
    try:
        for parent in psutil.Process().parents():
            pids.add(parent.pid)
    except psutil.Error:
        pass
    return pids


def alive(pid: int | None, create_time: float | None = None) -> bool:
    """Whether ``pid`` runs and (if given) is the process started at ``create_time``."""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return create_time is None or abs(proc.create_time() - create_time) < 1.0
    except psutil.Error:
        return False


def _markers(env) -> list[dict]:
    if not env:
        return []
    return [env] if isinstance(env, dict) else [m for m in env if m]


def matching(
    root_pid: int | None = None,
    root_create_time: float | None = None,
    env: dict[str, str] | list[dict[str, str]] | None = None,
    uid: int | None = None,
) -> list[psutil.Process]:
    """Processes descending from ``root_pid`` or carrying every item of one of the ``env`` markers.

    With ``uid``, only processes whose real user id is ``uid``: a marker is an environment
    variable, which anyone can set, so a job's marker never reaches another account's processes.
    """
    found: dict[int, psutil.Process] = {}
    protected = _protected()
    if root_pid and alive(root_pid, root_create_time):
        try:
            root = psutil.Process(root_pid)
            for proc in [root, *root.children(recursive=True)]:
                found[proc.pid] = proc
        except psutil.Error:
            pass
    markers = _markers(env)
    if markers:
        for proc in psutil.process_iter():
            if proc.pid in found or proc.pid in protected:
                continue
            environ = _environ(proc)
            if environ and any(all(environ.get(k) == v for k, v in m.items()) for m in markers):
                found[proc.pid] = proc
    return [p for pid, p in found.items() if pid not in protected and _owned_by(p, uid)]


def _owned_by(proc: psutil.Process, uid: int | None) -> bool:
    if uid is None:
        return True
    try:
        return proc.uids().real == uid
    except psutil.Error:
        return False


def _signal_all(procs, sig) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
        except psutil.AccessDenied:
            log.warning("not allowed to signal pid %s", proc.pid)


def kill_matching(
    root_pid: int | None = None,
    root_create_time: float | None = None,
    env: dict[str, str] | list[dict[str, str]] | None = None,
    grace: float = 10.0,
    rounds: int = 5,
    uid: int | None = None,
) -> int:
    """SIGTERM, wait ``grace`` seconds, SIGKILL; repeat until no process matches. Returns how many ended."""
    ended: set[int] = set()
    for round_ in range(rounds):
        procs = matching(root_pid, root_create_time, env, uid)
        if not procs:
            break
        ended.update(p.pid for p in procs)
        if round_ == 0 and grace > 0:
            _signal_all(procs, signal.SIGTERM)
            _, procs = psutil.wait_procs(procs, timeout=grace)
        _signal_all(procs, signal.SIGKILL)
        psutil.wait_procs(procs, timeout=5)
        root_pid = None  # the root is gone; later rounds go by the marker
        time.sleep(0.05)
    return len(ended)


def set_child_subreaper() -> None:
    """Make orphaned descendants re-parent to this process (Linux), so they stay in our tree."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_CHILD_SUBREAPER = 36
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass
