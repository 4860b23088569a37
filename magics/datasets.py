"""Dataset digests and their record as MLflow run inputs.

A dataset is a file or a folder. Its digest is the sha256 of the sorted list of
``(relative path, size, sha256 of the content)`` of every file in it, so the
same bytes give the same digest wherever they are and any change to any file
changes it. Content hashes are cached by ``(path, size, mtime, inode)`` in a
small JSON file so a large dataset is hashed once, not once per job. A version
of the catalog is checked with :func:`verify`, which names the files that
changed since it was registered. :func:`use` is ``danlu.dataset``: code in a
cell asks for a catalog version (through the runner API inside a job, with the
user's hub token outside one), gets its path, verifies it and records it as an
input of the run with its context.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 20
#: why a run used a dataset, as MLflow's ``mlflow.data.context`` input tag says it
TRAINING = "training"
EVALUATION = "evaluation"
CONTEXTS = (TRAINING, EVALUATION)
#: what :func:`use` takes: ``NAME@VERSION``, ``NAME@latest`` or ``NAME`` (the latest)
REF = re.compile(r"^([a-z0-9](?:[-a-z0-9_.]{0,62}[a-z0-9])?)(?:@([1-9][0-9]{0,8}|latest))?$")


@dataclass(frozen=True)
class DatasetDigest:
    name: str
    path: str
    digest: str
    files: int
    bytes: int

    def to_dict(self) -> dict:
        return {"name": self.name, "path": self.path, "digest": self.digest, "files": self.files, "bytes": self.bytes}


def open_regular(path: Path):
    """A file opened for reading only if it is a regular file when opened (never blocking on a FIFO or a
    device swapped in after the walk saw a file); OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


class _Cache:
    def __init__(self, path: Path | None):
        self.path = path
        self.data: dict = {}
        self.dirty = False
        if path and path.exists():
            try:
                self.data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                self.data = {}

    def sha(self, file: Path, st: os.stat_result) -> str:
        key = f"{file}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
        value = self.data.get(key)
        if value is None:
            value = self.data[key] = _file_sha256(file)
            self.dirty = True
        return value

    def save(self) -> None:
        if self.path and self.dirty:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data))
            os.replace(tmp, self.path)


def default_cache() -> Path:
    """Per-user cache of content hashes (``~/.cache/danlu/dataset-digests.json``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "danlu" / "dataset-digests.json"


class TooManyFiles(ValueError):
    """A folder holds more files than a caller's bound (the catalog's ``max_files``)."""


class LinkOut(ValueError):
    """A file of a confined folder is a symbolic link to somewhere outside it (``args[0]``: its relative path)."""


def scan(path: str | os.PathLike, name: str | None = None, cache_file: Path | None = None,
         max_files: int | None = None, confine: bool = False) -> tuple[DatasetDigest, list[list]]:
    """The digest of a file or folder and its manifest, ``[relative path, size, sha256]`` per file.

    With ``max_files``, a folder of more files raises :class:`TooManyFiles` as soon as the walk finds
    one file too many, before anything is hashed. With ``confine``, a file whose real path (every
    symbolic link followed) is outside the folder's raises :class:`LinkOut`, before anything is read.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"dataset {path} does not exist")
    cache = _Cache(cache_file)
    if root.is_file():
        files = [root]
    else:
        found = []
        for p in root.rglob("*"):
            if p.is_file():
                found.append(p)
                if max_files is not None and len(found) > max_files:
                    raise TooManyFiles(f"{path} holds more than {max_files} files")
        files = sorted(found)
        if confine:
            top = os.path.realpath(root).rstrip(os.sep) + os.sep
            for file in files:
                if not os.path.realpath(file).startswith(top):
                    raise LinkOut(file.relative_to(root).as_posix())
    manifest, entries = [], []
    total = 0
    for file in files:
        st = file.stat()
        rel = file.name if file == root else file.relative_to(root).as_posix()
        sha = cache.sha(file, st)
        manifest.append([rel, st.st_size, sha])
        entries.append(f"{rel}\0{st.st_size}\0{sha}")
        total += st.st_size
    cache.save()
    h = hashlib.sha256("\n".join(entries).encode()).hexdigest()
    return DatasetDigest(name or root.name, str(root.resolve()), h, len(files), total), manifest


def digest(path: str | os.PathLike, name: str | None = None, cache_file: Path | None = None) -> DatasetDigest:
    """The content digest of a file or folder (raises FileNotFoundError if missing)."""
    return scan(path, name, cache_file)[0]


class DatasetChanged(ValueError):
    """A catalog version's files are no longer what was registered; the message names them."""


def changes(registered: list[list], found: list[list], limit: int = 10) -> list[str]:
    """What differs between two manifests, as ``"a.csv changed"``, ``"b.csv removed"``, ``"c.csv added"``."""
    before = {rel: (size, sha) for rel, size, sha in registered}
    after = {rel: (size, sha) for rel, size, sha in found}
    out = [f"{rel} changed" for rel in sorted(before.keys() & after.keys()) if before[rel] != after[rel]]
    out += [f"{rel} removed" for rel in sorted(before.keys() - after.keys())]
    out += [f"{rel} added" for rel in sorted(after.keys() - before.keys())]
    return out[:limit] + ([f"and {len(out) - limit} more"] if len(out) > limit else [])


def verify(path: str | os.PathLike, name: str, expected: str, manifest: list[list],
           cache_file: Path | None = None) -> DatasetDigest:
    """The digest of a registered version's files, or :class:`DatasetChanged` naming what changed."""
    found, now = scan(path, name, cache_file)
    if found.digest != expected:
        what = changes(manifest, now) or ["its digest differs"]
        raise DatasetChanged(f"dataset {name} changed since it was registered: {', '.join(what)}; register the "
                             "data again for a new version, or restore it")
    return found


def log_to_mlflow(client, run_id: str, ds: DatasetDigest, context: str = TRAINING) -> None:
    """Record a dataset as an input of an MLflow run, with its context (``mlflow.data.context``)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    from danlu import tags

    dataset = Dataset(
        name=ds.name,
        digest=ds.digest[:36],
        source_type="local",
        source=json.dumps({"uri": Path(ds.path).as_uri()}),
        profile=json.dumps({"files": ds.files, "bytes": ds.bytes, "sha256": ds.digest}),
    )
    client.log_inputs(run_id, datasets=[DatasetInput(dataset, tags=[InputTag(tags.DATA_CONTEXT, context)])])


# danlu.dataset ----------------------------------------------------------------------------------------------
def use(ref: str, context: str = TRAINING) -> Path:
    """``danlu.dataset``: the path of a catalog version, verified, and recorded as an input of the run.

    Inside a job the jobs service resolves ``ref`` as the job's owner (runner API, with the attempt's
    token) and records the use; outside one, the catalog is asked with the user's hub token. The files
    are verified against the version's digest here (:class:`DatasetChanged` names what changed), then
    logged on the job's MLflow run (rank 0) or, outside a job, on the active MLflow run if there is one.
    """
    from danlu.errors import UsageError

    match = REF.match(ref) if isinstance(ref, str) else None
    if match is None:
        raise UsageError(f"danlu.dataset({str(ref)[:80]!r}): not a catalog version; write NAME@VERSION (e.g. "
                         "mnist@3), NAME@latest or NAME", reason="bad_ref",
                         fix="see the datasets you may read with 'danlu datasets list'")
    if context not in CONTEXTS:
        raise UsageError(f"danlu.dataset: context {str(context)[:40]!r} is not one of {', '.join(CONTEXTS)}",
                         reason="bad_context", fix=f"use context={TRAINING!r} or context={EVALUATION!r}")
    name, version = match.group(1), match.group(2) or "latest"
    answer = _resolve_in_job(f"{name}@{version}", context) if _in_job() else _resolve_outside(name, version)
    found = verify(answer["path"], answer["ref"], answer["digest"], answer.get("manifest") or [],
                   cache_file=default_cache())
    _log_input(found, context)
    return Path(answer["path"])


def _in_job() -> bool:
    from danlu import env

    return bool(env.JOB_ID.get())


def _resolve_in_job(ref: str, context: str) -> dict:
    from danlu import env
    from danlu.client import DanluClient
    from danlu.errors import Unreachable

    api, token, attempt, job = env.RUNNER_API.get(), env.JOB_TOKEN.get(), env.ATTEMPT.get(), env.JOB_ID.get()
    if not (api and token and attempt):
        raise Unreachable("danlu.dataset: this job's kernel was not told where the jobs service's runner API is",
                          fix="name the version with --dataset NAME@VERSION when submitting instead")
    client = DanluClient(api=api, token=token, scheme="Bearer", url=api)
    return client.request("POST", f"/runner/jobs/{job}/attempts/{attempt}/datasets",
                          json={"ref": ref, "context": context}).json()


def _resolve_outside(name: str, version: str) -> dict:
    from danlu.client import DanluClient

    client = DanluClient()
    number = client.dataset(name)["latest"]["version"] if version == "latest" else int(version)
    return client.dataset_version(name, number)


def _log_input(found: DatasetDigest, context: str) -> None:
    """On the job's run (rank 0), or outside a job on the active MLflow run; a failure is a warning."""
    try:
        if _in_job():
            from danlu import autolog

            run = autolog.mlflow_run()
        else:  # no mlflow imported: no active run
            mlflow = sys.modules.get("mlflow")
            run = mlflow.active_run() if mlflow is not None and hasattr(mlflow, "active_run") else None
        if run is None:
            return
        from mlflow import MlflowClient

        log_to_mlflow(MlflowClient(), run.info.run_id, found, context=context)
    except Exception as e:  # noqa: BLE001 - the data is verified; only its record in MLflow is missing
        print(f"danlu: dataset {found.name} not recorded in MLflow: {str(e)[:300]}", file=sys.stderr, flush=True)
