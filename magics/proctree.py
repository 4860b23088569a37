"""Find and end every process that belongs to a job (or to a whole workbench).

A job's processes are not one process group: Jupyter kernels start in their
own session, torchrun starts workers, user code may start anything. A process
belongs to a job if it descends from the job's runner or if its environment
carries one of the job's markers (``DANLU_JOB_ID=<id>``, or the runner's own
``DANLU_RUNNER_ID``, which its kernels carry from their start), which every
descendant inherits even after being re-parented. In unix-accounts mode only
processes of the job's own account are considered. :func:`kill_matching` sends SIGTERM,
waits the grace period, stops (SIGSTOP) the whole tree until no member forks a new
one, sends SIGKILL, and scans again until nothing matches, so processes forked
during the shutdown are caught too.

A marker is only an environment variable: a process that clears its environment
and detaches (``setsid``, a double fork) loses it. Two things catch it anyway.
Where cgroup v2 can be written (a root service, or a delegated subtree), each
attempt gets a cgroup of its own (:func:`new_cgroup`) that no process of the
job can leave, and :func:`kill_cgroup` ends everything in it. Everywhere, the
runner is a child subreaper (:func:`set_child_subreaper`): whatever detaches
under it re-parents to it, and it ends its descendants before it exits
(:func:`end_descendants`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from pathlib import Path

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
    """SIGTERM, wait ``grace`` seconds, SIGKILL; repeat until no process matches. Returns how many ended.

    Before SIGKILL every matching process is stopped, again and again until a scan finds no new one: a
    stopped process cannot fork, and while the root (a subreaper runner) lives, whatever its tree
    detaches re-parents to it, so nothing escapes between the scan and the kill.
    """
    if root_pid and root_create_time is None and alive(root_pid):
        try:  # later rounds must know the root is still the same process
            root_create_time = psutil.Process(root_pid).create_time()
        except psutil.Error:
            root_pid = None
    ended: set[int] = set()
    for round_ in range(rounds):
        procs = matching(root_pid, root_create_time, env, uid)
        if not procs:
            break
        ended.update(p.pid for p in procs)
        if round_ == 0 and grace > 0:
            _signal_all(procs, signal.SIGTERM)
            psutil.wait_procs(procs, timeout=grace)
        procs = _stop_all(root_pid, root_create_time, env, uid)
        ended.update(p.pid for p in procs)
        _signal_all(procs, signal.SIGKILL)
        psutil.wait_procs(procs, timeout=5)
        time.sleep(0.05)
    return len(ended)


def _stop_all(root_pid, root_create_time, env, uid, limit: int = 50) -> list[psutil.Process]:
    """SIGSTOP every matching process until a scan finds none that is not stopped yet; return them all."""
    stopped: dict[int, psutil.Process] = {}
    for _ in range(limit):
        new = [p for p in matching(root_pid, root_create_time, env, uid) if p.pid not in stopped]
        if not new:
            break
        _signal_all(new, signal.SIGSTOP)
        stopped.update((p.pid, p) for p in new)
    return list(stopped.values())


def end_descendants(grace: float = 1.0) -> int:
    """End every descendant of this process (SIGTERM, ``grace``, then stopped and killed); how many there were.

    The runner calls it last: as a subreaper it is the parent of everything its job detached
    (``setsid``, double forks, a cleared environment), so its descendants are all that is left.
    """
    return kill_matching(os.getpid(), None, None, grace=grace)


def set_child_subreaper() -> None:
    """Make orphaned descendants re-parent to this process (Linux), so they stay in our tree."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_CHILD_SUBREAPER = 36
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass


# cgroup v2 ----------------------------------------------------------------------------------
#: every attempt's cgroup is named so; nothing else is ever killed or removed by :func:`kill_cgroup`
CGROUP_PREFIX = "danlu-"


def _cgroup2_mount() -> Path | None:
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                if right.split(" ", 1)[0] == "cgroup2":
                    return Path(left.split(" ")[4])
    except OSError:
        pass
    return None


def own_cgroup() -> Path | None:
    """The cgroup v2 folder of this process, if cgroup v2 is mounted and this process may create cgroups in it."""
    mount = _cgroup2_mount()
    if mount is None:
        return None
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
    except OSError:
        return None
    if rel is None:
        return None
    path = mount / rel.lstrip("/")
    return path if (path / "cgroup.procs").is_file() and os.access(path, os.W_OK) else None


def new_cgroup(name: str) -> str | None:
    """Create the cgroup ``danlu-<name>`` beside this process's own; None where cgroup v2 is not writable."""
    parent = own_cgroup()
    if parent is None or not name.replace("-", "").isalnum():
        return None
    path = parent / f"{CGROUP_PREFIX}{name}"
    try:
        path.mkdir(mode=0o755)
    except OSError as e:
        log.info("no cgroup for the attempt (%s): its processes are tracked by the runner", e)
        return None
    return str(path)


def _is_attempt_cgroup(path) -> bool:
    if not isinstance(path, str) or not path:
        return False
    mount = _cgroup2_mount()
    p = Path(path)
    return (
        mount is not None
        and p.name.startswith(CGROUP_PREFIX)
        and ".." not in p.parts
        and p.is_relative_to(mount)
        and (p / "cgroup.procs").is_file()
    )


def cgroup_pids(path: str) -> list[int]:
    try:
        return [int(line) for line in Path(path, "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def enter_cgroup(path: str, pid: int) -> bool:
    """Move ``pid`` and every descendant it has now into the cgroup (before the job's code runs)."""
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
        with open(Path(path, "cgroup.procs"), "w") as f:
            for proc in procs:
                f.write(str(proc.pid))
                f.flush()
    except (OSError, psutil.Error) as e:
        log.warning("could not move runner %s into %s: %s", pid, path, e)
        return False
    return True


def kill_cgroup(path, timeout: float = 10.0) -> int:
    """SIGKILL every process in an attempt's cgroup and remove it; how many were in it (0 if none or gone).

    ``cgroup.kill`` (Linux 5.14) kills atomically; older kernels get the cgroup frozen, each process
    killed, and it thawed, until it is empty. A process cannot leave its cgroup without write access to
    the cgroups above it, which a job never has.
    """
    if not _is_attempt_cgroup(path):
        return 0
    pids = cgroup_pids(path)
    deadline = time.monotonic() + timeout
    while cgroup_pids(path) and time.monotonic() < deadline:
        try:
            Path(path, "cgroup.kill").write_text("1")
        except OSError:
            _freeze_and_kill(path)
        time.sleep(0.05)
    try:
        os.rmdir(path)
    except OSError as e:
        log.warning("could not remove the cgroup %s: %s", path, e)
    return len(pids)


def _freeze_and_kill(path: str) -> None:
    freeze = Path(path, "cgroup.freeze")
    try:
        freeze.write_text("1")
    except OSError:
        pass
    for pid in cgroup_pids(path):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        freeze.write_text("0")
    except OSError:
        pass
