"""A job's provenance: what reproducing it needs, recorded by the service when the job is submitted.

:func:`build` makes the ``jobs.provenance`` object from what the service owns at submission: the
profile and its environment (:func:`environment_of`: the sha256 of the profile's pinned requirements,
the image digest on Kubernetes, or of the workbench's own Python and its installed distributions),
the parameters, the job's cell and its setup cells (sha256 and source, :func:`cells_of`), the notebook
path, git (commit, dirty) and the datasets (catalog ref or path, digest, context). What only the job
can know -- the seed its code set, whether its git tree was dirty when that was not known at
submission, the digest of a plain dataset path (the service does not read a user's files for a job)
-- the runner reports in a ``provenance`` event; :func:`merge_report` takes exactly those keys,
type-checked, and nothing else. :func:`provenance_of` is what the lineage and the comparison read:
the record, or for a job an older Danlu ran, what its row still says.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.metadata
import math
import platform
import sys

#: the longest cell source kept in the record (the whole notebook stays in ``job_inputs``)
MAX_SOURCE = 64 * 1024
#: the most files of a plain dataset's manifest kept (enough to name what changed in a small dataset)
MAX_MANIFEST = 1000
#: seeds a report may carry: what every JSON client reads exactly
MAX_SEED = 2**53 - 1


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def _tags(cell: dict) -> list:
    tags = (cell.get("metadata") or {}).get("tags") or []
    return tags if isinstance(tags, list) else []


def _cell(cell: dict) -> dict:
    source = _source(cell)
    danlu = (cell.get("metadata") or {}).get("danlu") or {}
    cell_id = (danlu.get("cell_id") if isinstance(danlu, dict) else None) or cell.get("id") or ""
    out = {
        "id": str(cell_id)[:255],
        "sha256": hashlib.sha256(source.encode()).hexdigest(),
        "source": source[:MAX_SOURCE],
    }
    if len(source) > MAX_SOURCE:
        out["truncated"] = True
    return out


def cells_of(nb: dict) -> tuple[dict, list[dict]]:
    """(the job's cell, its setup cells), each ``{"id", "sha256", "source"}``.

    The job's cell is the one :func:`~.views.cell_sha256` hashes (tagged ``danlu-cell``, else the last
    code cell); the setup cells are every other code cell but papermill's ``parameters`` cell (the
    parameters are recorded as such), in notebook order: ``%%train``'s ``%%train_setup`` cells, or the
    other cells of a notebook submitted whole.
    """
    code = [c for c in nb.get("cells", []) if isinstance(c, dict) and c.get("cell_type") == "code"]
    tagged = [c for c in code if "danlu-cell" in _tags(c)]
    cell = (tagged or code)[-1]
    setup = [_cell(c) for c in code if c is not cell and "parameters" not in _tags(c)]
    return _cell(cell), setup


# the environment ----------------------------------------------------------------------------------------
@functools.cache
def _current_python() -> dict:
    """The workbench's own Python: its version and every installed distribution, hashed (once a process)."""
    pins = set()
    for dist in importlib.metadata.distributions():
        name = dist.metadata.get("Name") if dist.metadata else None
        if name:
            pins.add(f"{name.lower().replace('_', '-')}=={dist.version}")
    version = platform.python_version()
    lock = "\n".join([f"python=={version}", *sorted(pins)])
    return {
        "kind": "python",
        "digest": hashlib.sha256(lock.encode()).hexdigest(),
        "ref": sys.prefix,
        "python": version,
        "packages": len(pins),
    }


def _requirements(path) -> dict:

    return {
        "kind": "requirements",
        "digest": hashlib.sha256(path.read_bytes()).hexdigest(),
        "ref": str(path),
        "python": platform.python_version(),
    }


def _image(image: str) -> dict:
    _, at, digest = image.partition("@sha256:")
    return {"kind": "image", "digest": digest if at and len(digest) == 64 else None, "ref": image}


async def environment_of(profile, *, in_image: bool) -> dict:
    """``{"kind", "digest", "ref", ...}`` of the environment a job of ``profile`` runs in (file reads on a thread).

    With a backend that runs jobs in images (``in_image``: Kubernetes) a job runs in its profile's image (the
    digest it is pinned by; None for a tag); otherwise in the virtual environment built from the profile's
    pinned requirements (the sha256 of that file), or in the workbench's own Python (the sha256 of its
    version and installed distributions).
    """
    image = profile.environment.get("image")
    if image and in_image:
        return _image(str(image))
    if profile.requirements_path:
        try:
            return await asyncio.to_thread(_requirements, profile.requirements_path)
        except OSError:  # the file went away since start-up: the environment built from it still runs
            return {"kind": "requirements", "digest": None, "ref": str(profile.requirements_path)}
    return dict(await asyncio.to_thread(_current_python))


# the record ----------------------------------------------------------------------------------------------
def dataset_entry(d: dict) -> dict:
    """A job's dataset spec entry as the record keeps it: ``{"ref", "digest", "context"}`` (+ catalog name, version)."""
    out = {"ref": d.get("name"), "digest": d.get("digest"), "context": d.get("context") or "training"}
    if d.get("dataset"):
        out.update(dataset=d["dataset"], version=d.get("version"))
    elif d.get("manifest"):  # a plain path pinned by a reproduction: what a reproduction of it pins again
        out["manifest"] = list(d["manifest"])
    return out


def build(
    *,
    profile: str,
    environment: dict,
    parameters: dict,
    nb: dict,
    source: dict,
    datasets: list[dict],
    cell_sha256: str,
    reproduces: str | None = None,
) -> dict:
    """The provenance of a job being submitted (see the module docstring)."""
    cell, setup = cells_of(nb)
    dirty = source.get("git_dirty")
    record = {
        "profile": profile,
        "environment": environment,
        "parameters": parameters,
        "cell_sha256": cell_sha256,
        "cell": cell,
        "setup_cells": setup,
        "notebook_path": source.get("notebook_path"),
        "git": {"commit": source.get("git_commit"), "dirty": dirty if isinstance(dirty, bool) else None},
        "seed": None,
        "datasets": [dataset_entry(d) for d in datasets],
    }
    if reproduces:
        record["reproduces"] = reproduces
    return record


def provenance_of(job) -> dict:
    """What reproducing ``job`` needs: its record, or what an older job's row still says (``recorded`` False)."""
    record = job.provenance if isinstance(job.provenance, dict) else {}
    if record:
        return {**record, "recorded": True}
    source = job.source if isinstance(job.source, dict) else {}
    return {
        "profile": job.profile,
        "environment": None,
        "parameters": job.parameters,
        "cell_sha256": job.cell_sha256,
        "cell": None,
        "setup_cells": None,
        "notebook_path": source.get("notebook_path"),
        "git": {"commit": source.get("git_commit"), "dirty": None},
        "seed": None,
        "datasets": [dataset_entry(d) for d in job.datasets or []],
        "recorded": False,
    }


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -MAX_SEED <= value <= MAX_SEED


def _manifest(rows) -> list | None:
    if not isinstance(rows, list) or len(rows) > MAX_MANIFEST:
        return None
    out = []
    for row in rows:
        if not (
            isinstance(row, list)
            and len(row) == 3
            and isinstance(row[0], str)
            and len(row[0]) <= 1024
            and _is_int(row[1])
            and row[1] >= 0
            and isinstance(row[2], str)
            and len(row[2]) == 64
        ):
            return None
        out.append([row[0], row[1], row[2]])
    return out


def merge_report(record: dict, report: dict) -> dict:
    """``record`` with what a runner's ``provenance`` report may say, and nothing more.

    The seed (an int within the JSON-exact range), git's dirty state only where submission did not know
    it (a bool), and the digest (a sha256) and small manifest of a *plain* dataset path whose digest is
    not known yet. A catalog version's digest, the profile, the environment, the parameters and the cells
    are the service's, whatever the report says.
    """
    if not isinstance(record, dict) or not record:
        return record
    out = {**record}
    seed = report.get("seed")
    if _is_int(seed):
        out["seed"] = seed
    dirty = report.get("git_dirty")
    git = out.get("git") if isinstance(out.get("git"), dict) else {}
    if isinstance(dirty, bool) and git.get("dirty") is None:
        out["git"] = {**git, "dirty": dirty}
    reported = report.get("datasets")
    if isinstance(reported, list):
        entries = [dict(d) for d in out.get("datasets") or []]
        for item in reported[:100]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                continue
            digest = item.get("digest")
            if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
                continue
            for entry in entries:
                if entry.get("ref") == item["name"] and not entry.get("dataset") and not entry.get("digest"):
                    entry["digest"] = digest
                    manifest = _manifest(item.get("manifest"))
                    if manifest is not None:
                        entry["manifest"] = manifest
                    break
        out["datasets"] = entries
    return out


def finite(value):
    """A metric value as JSON can carry it: a finite number, else its name (``nan``, ``inf``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
