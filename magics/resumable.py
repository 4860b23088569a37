"""``danlu.resumable``: training that survives preemption in one line, inside a job's kernel.

::

    state = danlu.resumable(model=model, optimizer=opt, every="5m", keep=2, scheduler=sched, epoch=0)
    for step in state.steps(10_000):
        ...  # one training step

At the start of an attempt the newest whole checkpoint of the job is restored (the job's log says
``danlu: resumed from step 1500 (checkpoint of attempt 2, 40 s old)``) and :meth:`Resumable.steps`
yields only the steps not done yet. A checkpoint is saved every ``every`` steps (an int) or every
``every`` of time (``"30s"``, ``"2m"``, ``"1h"``), when the jobs service asks for one
(``danlu jobs checkpoint JOB``), at the end of the loop, and when the job is asked to stop: SIGTERM
(preemption, cancel, timeout) only sets a flag; at the next step boundary the state is saved and
:class:`Stopped` ends the cell, so the runner records the stop the service asked for, not an error.

What is saved: each keyword whose value has ``state_dict()``/``load_state_dict()`` (modules,
optimizers, schedulers, ``GradScaler``), loaded back into the same object; any other keyword is a
plain picklable value, restored as the attribute ``state.<name>`` (assign to it to change what is
saved); and the random number generators of Python, NumPy and torch of every rank (``rng=False``: not).
Checkpoints live in ``danlu.checkpoint_dir()/resumable/step-<N>`` (:mod:`danlu.resumable_store`:
atomic, with a commit marker; the last ``keep`` are kept).

torchrun: call it on every rank after ``init_process_group``. Rank 0 saves and every rank loads
(through CPU memory; ``map_location``), or, for state over :data:`SHARDED_BYTES` or with
``sharded=True``, every rank writes its part with ``torch.distributed.checkpoint``. Ranks agree on
when to save and stop with one small all-reduce at most about once a second (:data:`SYNC_SECONDS`).

A resumed attempt continues the job's MLflow run; the steps it does again are not logged twice
(:mod:`danlu.resumable_metrics`). Outside a job it works the same in ``./checkpoints``.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import signal
import sys
import threading
import time
import types
from pathlib import Path

from danlu import checkpoint_dir, env
from danlu import resumable_store as store
from danlu.errors import UsageError
from danlu.resumable_ranks import Ranks, ServiceLink

#: the default interval: a 100 MB state saves in about a second on a local disk, under 1% of 5 minutes
DEFAULT_EVERY = "5m"
#: above this the state is saved by every rank with torch.distributed.checkpoint (rank 0 alone below)
SHARDED_BYTES = 2**30
#: ranks agree on saving and stopping about this often (one all-reduce of 3 numbers)
SYNC_SECONDS = 1.0
#: the jobs service is asked whether to save now at most this often (seconds)
POLL_SECONDS = 10.0
#: a stop seen through the service or the stop file waits this long for the SIGTERM before ending the cell
#: (a cell that ended first would be an error in the user's code to a runner that is not stopping yet)
SIGTERM_WAIT = 10.0
#: the stop file the runner writes for a torchrun job's ranks is looked at this often (seconds)
STOP_FILE_SECONDS = 1.0

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)\s*$")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


class Stopped(BaseException):
    """The job was asked to stop; its state was saved at :attr:`step` and the next attempt resumes there.

    A ``BaseException``, like ``KeyboardInterrupt``: an ``except Exception`` in the training code does not
    swallow it, and the cell ends with one line, not a traceback.
    """

    def __init__(self, step: int, reason: str | None):
        self.step, self.reason = step, reason
        why = f" ({reason})" if reason else ""
        super().__init__(f"danlu: stopped at step {step}{why}; the checkpoint is saved and the job resumes from it")

    def _render_traceback_(self):  # IPython shows this instead of a traceback
        return [str(self)]


def parse_every(every) -> tuple[int | None, float | None]:
    """``every`` as (steps, seconds): an int is steps, ``"30s"``/``"2m"``/``"1h"`` (or a number of seconds
    as a float) is time."""
    if isinstance(every, bool):
        every = str(every)
    if isinstance(every, int) and every > 0:
        return every, None
    if isinstance(every, float) and every > 0:
        return None, every
    match = _DURATION.match(every) if isinstance(every, str) else None
    if match and float(match.group(1)) > 0:
        return None, float(match.group(1)) * _UNITS[match.group(2)]
    raise UsageError(
        f"danlu.resumable: every={every!r} is neither a number of steps nor a duration",
        reason="bad_every",
        fix='write every=500 (steps) or every="30s", "2m", "1h" (time)',
    )


# SIGTERM -----------------------------------------------------------------------------------------
_sig: dict = {"installed": False, "previous": signal.SIG_DFL, "loops": 0}
#: set by the SIGTERM handler; the loop saves and stops at its next step boundary
_stopping = threading.Event()


def _on_sigterm(signum, frame):
    previous = _sig["previous"]
    if _sig["loops"] > 0:  # a loop will save and stop at its next step boundary
        _stopping.set()
        if callable(previous):
            previous(signum, frame)  # the user's own handler (the guide's flag) still hears it
        return
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # no loop running: do what was done before, die
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm() -> None:
    if _sig["installed"] or threading.current_thread() is not threading.main_thread():
        return
    _sig["previous"] = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _sig["installed"] = True


# the state ----------------------------------------------------------------------------------------
class Resumable:
    """What :func:`danlu.resumable` returns; see the module docstring."""

    def __init__(
        self,
        every=DEFAULT_EVERY,
        keep: int = 2,
        *,
        sharded: bool | None = None,
        map_location="cpu",
        rng: bool = True,
        directory=None,
        clock=time.monotonic,
        **state,
    ):
        self.every_steps, self.every_seconds = parse_every(every)
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise UsageError(
                f"danlu.resumable: keep={keep!r} is not a positive number",
                reason="bad_keep",
                fix="keep=2 keeps the last two checkpoints",
            )
        if not state:
            raise UsageError(
                "danlu.resumable: nothing to save", reason="no_state", fix="pass model=..., optimizer=... or values"
            )
        self.keep, self.map_location, self.rng, self.clock = keep, map_location, rng, clock
        self.objects = {k: v for k, v in state.items() if _stateful(v)}
        self.values = [k for k in state if k not in self.objects]
        for name, value in state.items():
            if name in self.__dict__ or hasattr(type(self), name):
                raise UsageError(
                    f"danlu.resumable: {name!r} is a name of the state itself",
                    reason="bad_name",
                    fix="give that value another keyword",
                )
            setattr(self, name, value)
        self.base = Path(directory) if directory is not None else checkpoint_dir()
        self.ranks = Ranks()
        self.sharded = self.ranks.want_sharded(self.objects, sharded, SHARDED_BYTES)
        self.service = ServiceLink(poll_seconds=POLL_SECONDS) if self.ranks.rank == 0 else None
        self.attempt = _int(env.ATTEMPT.get())
        self.step = 0
        self.resumed = False
        self.resumed_from = None  # the Checkpoint restored
        self.last_save_seconds: float | None = None
        self.stop_reason: str | None = None
        self._saved_step: int | None = None
        self._last_save_at = clock()
        self._grace_warned = False
        self._restore()

    # restore ---------------------------------------------------------------------------------
    def _restore(self) -> None:
        found = None
        if self.ranks.rank == 0:
            store.prune(self.base, self.keep, leftovers=True)  # what a killed save left, before anyone writes
            found = store.newest(self.base)
        found = self.ranks.broadcast(found)
        if found is None:
            return
        self._load(found.path, found.format)
        self.ranks.barrier()
        self.step = self._saved_step = found.step
        self.resumed, self.resumed_from = True, found
        if self.ranks.rank == 0:
            of = f"checkpoint of attempt {found.attempt}, " if found.attempt else "checkpoint "
            print(f"danlu: resumed from step {found.step} ({of}{found.age:.0f} s old)", file=sys.stderr, flush=True)
            # deferred: it reads the job's event files and asks MLflow; only a resumed attempt needs it
            from danlu import resumable_metrics

            resumable_metrics.install(
                resumable_metrics.high_steps(resumable_metrics.run_id(), resumable_metrics.jobdir())
            )

    def _load(self, folder: Path, fmt: str) -> None:
        if fmt == "dcp":
            self.ranks.load_sharded(folder, self.objects)
            values = _read_pickle(folder / "values.pkl")
        else:
            payload = _read_payload(folder, fmt, self.map_location)
            for name, obj in self.objects.items():
                if name in payload["objects"]:
                    obj.load_state_dict(payload["objects"][name])
            values = payload["values"]
        for name in self.values:
            if name in values:
                setattr(self, name, values[name])
        if self.rng:
            rng = _read_pickle(folder / f"rng-{self.ranks.rank}.pkl")
            if rng:
                _set_rng(rng)

    # save ----------------------------------------------------------------------------------------
    def save(self) -> Path | None:
        """Save now (every rank calls it at the same step); returns the checkpoint's folder on rank 0."""
        started = time.monotonic()
        ranks, step = self.ranks, self.step
        tmp = store.tmp_folder(self.base, step, f"{self.attempt or 0}-{ranks.tag()}")
        if ranks.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        ranks.barrier()
        values = {name: getattr(self, name) for name in self.values}
        if self.sharded:
            ranks.save_sharded(tmp, self.objects)
            fmt = "dcp"
            if ranks.rank == 0:
                _write_pickle(tmp / "values.pkl", values)
        else:
            fmt = "torch" if self.objects or "torch" in sys.modules else "pickle"
            if ranks.rank == 0:
                payload = {"objects": {k: v.state_dict() for k, v in self.objects.items()}, "values": values}
                _write_payload(tmp, fmt, payload)
        if self.rng:
            _write_pickle(tmp / f"rng-{ranks.rank}.pkl", _get_rng())
        ranks.barrier()
        final = None
        if ranks.rank == 0:
            final = store.commit(tmp, step, self.attempt, fmt)
            store.prune(self.base, self.keep)
        ranks.barrier()
        self._saved_step, self._last_save_at = step, self.clock()
        self.last_save_seconds = time.monotonic() - started
        if self.service is not None:
            self.service.checkpoint(step)
        self._check_grace()
        return final

    def _check_grace(self) -> None:
        grace = self.service.grace if self.service is not None else None
        if grace is None or self._grace_warned or self.last_save_seconds is None:
            return
        share = max(0.0, grace * 0.8 - 1.0)  # what the runner gives the kernel of the grace (runner/base.py)
        if self.last_save_seconds > share:
            self._grace_warned = True
            print(
                f"danlu: warning: a checkpoint took {self.last_save_seconds:.1f} s, more than the {share:.0f} s a "
                f"stopping job gets to save (grace {grace:.0f} s); save less state or ask an admin for a longer "
                "grace period",
                file=sys.stderr,
                flush=True,
            )

    # the loop ---------------------------------------------------------------------------------------
    def steps(self, total: int):
        """Yield the steps ``self.step .. total - 1`` not done yet, saving and stopping between them."""
        if not isinstance(total, int) or isinstance(total, bool) or total < 0:
            raise UsageError(f"state.steps({total!r}): not a number of steps", reason="bad_total", fix="steps(10000)")
        _install_sigterm()
        _sig["loops"] += 1
        if self.service is not None:
            self.service.start()
        sync = self.ranks.syncer(self.clock, SYNC_SECONDS)
        stop_file = StopFile(self.clock)
        try:
            while self.step < total:
                yield self.step
                self.step += 1
                stop = _stopping.is_set() or stop_file.seen() or (self.service is not None and self.service.stopping)
                wish = (self.service is not None and self.service.take_save_request()) or (
                    self.every_seconds is not None and self.clock() - self._last_save_at >= self.every_seconds
                )
                if sync is not None:  # a rank's own wishes wait for the next sync step, where all agree
                    stop, wish = sync.step(stop, wish) or (False, False)
                save = wish or (self.every_steps is not None and self.step % self.every_steps == 0)
                if stop:
                    self._stop(stop_file.hit)
                if save:
                    self.save()
            if self._saved_step != self.step:
                self.save()  # the end: a later attempt (a stop in a later cell) skips the loop
        finally:
            _sig["loops"] -= 1
            if self.service is not None:
                self.service.pause()

    def _stop(self, runner_stopping: bool = False) -> None:
        started = time.monotonic()
        if self._saved_step != self.step:
            self.save()
        reason, grace = self.service.stop_reason() if self.service is not None else (None, None)
        reason = reason or StopFile.reason()
        self.stop_reason = reason
        if self.ranks.rank == 0:
            print(
                f"danlu: asked to stop{f' ({reason})' if reason else ''}: saved step {self.step} "
                f"in {time.monotonic() - started:.1f} s",
                file=sys.stderr,
                flush=True,
            )
            if grace and self.service is not None:
                self.service.grace = grace
                self._check_grace()
        deadline = time.monotonic() + SIGTERM_WAIT
        while not (runner_stopping or _stopping.is_set()) and time.monotonic() < deadline:
            time.sleep(0.05)  # seen before the signal: the runner must be stopping when the cell ends
        _stopping.clear()  # heard: a later loop in this kernel starts afresh (the stop file still says it)
        raise Stopped(self.step, reason)


class StopFile:
    """The runner's word to a torchrun job's ranks that the job is stopping (``<job>/stop``), looked at
    once a second: a rank's kernel may not get SIGTERM itself. A file already there when the loop starts
    is an earlier attempt's and is passed over."""

    def __init__(self, clock):
        value = env.JOB_DIR.get()
        self.path = Path(value) / "stop" if value else None
        self.clock, self.next = clock, 0.0
        self.stale = self._identity()
        self.hit = False  # the runner wrote it: it got its SIGTERM and is stopping

    def _identity(self):
        try:
            st = self.path.stat() if self.path is not None else None
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns) if st is not None else None

    def seen(self) -> bool:
        if self.path is None:
            return False
        now = self.clock()
        if now < self.next:
            return False
        self.next = now + STOP_FILE_SECONDS
        found = self._identity()
        self.hit = self.hit or (found is not None and found != self.stale)
        return self.hit

    @staticmethod
    def reason() -> str | None:
        from danlu.jobdir import JobDir  # deferred: only a stopping job reads it

        value = env.JOB_DIR.get()
        found = JobDir(Path(value)).stop_reason() if value else None
        return found[0] if found else None


def resumable(model=None, optimizer=None, every=DEFAULT_EVERY, keep: int = 2, **state) -> Resumable:
    """Make a training loop resumable; see :mod:`danlu.resumable` (``help(danlu.resumable)``)."""
    if model is not None:
        state = {"model": model, **state}
    if optimizer is not None:
        state = {"optimizer": optimizer, **state} if model is None else {**state, "optimizer": optimizer}
    return Resumable(every=every, keep=keep, **state)


class _CallableModule(types.ModuleType):
    """``danlu.resumable`` is this module (``danlu.resumable.Stopped``) and the function (``danlu.resumable(...)``)."""

    def __call__(self, *args, **kwargs) -> Resumable:
        return resumable(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule


# helpers -------------------------------------------------------------------------------------------------
def _stateful(value) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _int(value) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None


def _write_payload(tmp: Path, fmt: str, payload: dict) -> None:
    if fmt == "torch":
        import torch  # deferred: torch is imported by the code whose model this is

        torch.save(payload, tmp / "state.pt")
    else:
        _write_pickle(tmp / "state.pkl", payload)


def _read_payload(folder: Path, fmt: str, map_location) -> dict:
    if fmt == "torch":
        import torch  # deferred: torch is imported by the code whose model this is

        # the job's own file, written by this code: plain values need pickle, not weights_only
        return torch.load(folder / "state.pt", map_location=map_location, weights_only=False)
    return _read_pickle(folder / "state.pkl") or {"objects": {}, "values": {}}


def _write_pickle(path: Path, value) -> None:
    with open(path, "wb") as f:
        pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)


def _read_pickle(path: Path):
    try:
        with open(path, "rb") as f:
            return pickle.load(f)  # noqa: S301 - the job's own checkpoint, verified against its marker
    except FileNotFoundError:
        return None


def _get_rng() -> dict:
    out = {"random": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        out["numpy"] = numpy.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng(rng: dict) -> None:
    random.setstate(rng["random"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in rng:
        numpy.random.set_state(rng["numpy"])
    torch = sys.modules.get("torch")
    if torch is not None and "torch" in rng:
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
