"""Noticing the seed a job's code sets, for its provenance.

:func:`activate` runs in rank 0's kernel of a job (from :func:`danlu.autolog.activate`) and wraps the
usual ways to seed: ``random.seed``, ``numpy.random.seed`` and ``numpy.random.default_rng(seed)``,
``torch.manual_seed``, and Lightning's ``seed_everything`` -- each wrapped once, when its module is
imported (:func:`danlu.importhooks.when_imported`), calling the original unchanged. The first whole-number
seed is written to the job folder's ``seed.json``; the runner reads it at the end, tags the MLflow run
and reports it to the service, which keeps only an int. A seed derived otherwise (a ``SeedSequence``,
an array, an environment variable read by a library) is not seen, and the record says none was set.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from danlu import env
from danlu.importhooks import when_imported
from danlu.jobdir import JobDir, write_json_atomic

#: module -> the functions of it that take a seed first
SEEDERS = {
    "random": ("seed",),
    "numpy.random": ("seed", "default_rng"),
    "torch": ("manual_seed",),
    "lightning.fabric.utilities.seed": ("seed_everything",),
    "lightning_fabric.utilities.seed": ("seed_everything",),
    "pytorch_lightning.utilities.seed": ("seed_everything",),
}
_state: dict = {"active": False, "seed": None, "pid": None}


def _record(seed) -> None:
    # the kernel itself only: a DataLoader's worker processes (forked) seed themselves with random seeds
    if _state["seed"] is not None or isinstance(seed, bool) or os.getpid() != _state["pid"]:
        return
    try:
        value = int(seed)  # numpy integers too
    except (TypeError, ValueError, OverflowError):
        return
    if value != seed:
        return
    _state["seed"] = value
    folder = env.JOB_DIR.get()
    if not folder:
        return
    try:
        write_json_atomic(JobDir(Path(folder)).seed_file, {"seed": value})
    except OSError:
        pass  # the record says no seed; the job goes on


def _wrap(module, name: str) -> None:
    original = getattr(module, name, None)
    if original is None or getattr(original, "_danlu_seed", False):
        return

    @functools.wraps(original)
    def seeded(*args, **kwargs):
        seed = args[0] if args else kwargs.get("seed")
        if seed is not None:
            _record(seed)
        return original(*args, **kwargs)

    seeded._danlu_seed = True
    try:
        setattr(module, name, seeded)
    except (AttributeError, TypeError):
        pass


def activate() -> None:
    """Watch for seeds in this kernel (rank 0 only; idempotent)."""
    if _state["active"] or int(os.environ.get("RANK", "0") or 0) != 0:
        return
    _state.update(active=True, pid=os.getpid())

    def wrap(module) -> None:
        for name in SEEDERS.get(module.__name__, ()):
            _wrap(module, name)

    when_imported(sorted(SEEDERS), wrap)
