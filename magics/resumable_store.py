"""The folders :func:`danlu.resumable` keeps its checkpoints in: written atomically, found whole, pruned.

A checkpoint is a folder ``step-<N>`` under ``$DANLU_CHECKPOINT_DIR/resumable``. It is written as a
hidden ``.tmp-...`` folder, each file fsynced, then a ``COMMITTED`` marker (JSON: the step, the attempt,
the time, the format, and every file's size and SHA-256) fsynced last, and only then renamed into place
(and the parent folder fsynced). :func:`newest` takes the highest step whose marker is there and whose
files match it, so a save killed at any point (a half-written folder, a missing marker, a truncated
file) is ignored and the previous checkpoint is used. :func:`prune` keeps the newest ``keep``
committed folders and removes what killed saves left behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

MARKER = "COMMITTED"
PREFIX = "step-"
TMP = ".tmp-"
OLD = ".old-"


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint folder and what its marker says."""

    path: Path
    step: int
    attempt: int | None
    time: float  # wall clock (time.time()) of the commit
    format: str

    @property
    def age(self) -> float:
        return max(0.0, time.time() - self.time)


def root(base: Path) -> Path:
    return Path(base) / "resumable"


def tmp_folder(base: Path, step: int, tag: str) -> Path:
    """Where a save of ``step`` writes before its commit (``tag``: the same on every rank of one save)."""
    return root(base) / f"{TMP}{PREFIX}{step}-{tag}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * 2**20):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER)


def commit(tmp: Path, step: int, attempt: int | None, fmt: str, digest: bool = True) -> Path:
    """Seal the folder ``tmp`` (its files written) as the checkpoint of ``step`` and move it into place.

    Files are fsynced, the marker lists their sizes (and SHA-256 with ``digest``), and the rename is
    the commit: before it nothing named ``step-<N>`` exists. An older checkpoint of the same step
    (a step done again after a resume) is replaced.
    """
    files: dict[str, dict] = {}
    for path in _files(tmp):
        _fsync(path)
        entry: dict[str, int | str] = {"size": path.stat().st_size}
        if digest:
            entry["sha256"] = _sha256(path)
        files[path.relative_to(tmp).as_posix()] = entry
    marker = {"step": step, "attempt": attempt, "time": time.time(), "format": fmt, "files": files}
    with open(tmp / MARKER, "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync(tmp)
    final = tmp.parent / f"{PREFIX}{step}"
    if final.exists():  # replaced: moved aside first, so a kill in between leaves the older steps
        aside = final.parent / f"{OLD}{final.name}-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync(final.parent)
    return final


def read_marker(folder: Path, verify: bool = True) -> Checkpoint | None:
    """The checkpoint in ``folder`` if its marker is there and its files match it (sizes, and digests with
    ``verify``); None for anything else."""
    try:
        data = json.loads((folder / MARKER).read_text(encoding="utf-8"))
        step = int(data["step"])
        files = data["files"]
        for name, entry in files.items():
            path = folder / name
            if not path.is_file() or path.stat().st_size != int(entry["size"]):
                return None
            if verify and entry.get("sha256") and _sha256(path) != entry["sha256"]:
                return None
        attempt = data.get("attempt")
        return Checkpoint(
            folder, step, int(attempt) if attempt is not None else None, float(data["time"]), data["format"]
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def committed_steps(base: Path) -> list[int]:
    """Steps with a ``step-<N>`` folder holding a marker (not verified), highest first."""
    out: list[int] = []
    folder = root(base)
    if not folder.is_dir():
        return out
    for p in folder.iterdir():
        if p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit() and (p / MARKER).is_file():
            out.append(int(p.name[len(PREFIX) :]))
    return sorted(out, reverse=True)


def newest(base: Path, verify: bool = True) -> Checkpoint | None:
    """The newest checkpoint that is whole; half-written, unmarked or damaged ones are passed over."""
    for step in committed_steps(base):
        found = read_marker(root(base) / f"{PREFIX}{step}", verify)
        if found is not None and found.step == step:
            return found
    return None


def prune(base: Path, keep: int, leftovers: bool = False) -> None:
    """Keep the ``keep`` newest committed checkpoints; with ``leftovers``, also remove what killed saves left
    (only when no save can be under way: at the start of an attempt)."""
    folder = root(base)
    for step in committed_steps(base)[keep:]:
        shutil.rmtree(folder / f"{PREFIX}{step}", ignore_errors=True)
    if leftovers and folder.is_dir():
        for p in folder.iterdir():
            if p.name.startswith((TMP, OLD)) or (p.name.startswith(PREFIX) and not (p / MARKER).is_file()):
                shutil.rmtree(p, ignore_errors=True)
