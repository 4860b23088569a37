"""Dataset digests: what a file or folder holds, as one sha256, and what changed since.

A dataset is a file or a folder. Its digest is the sha256 of the sorted list of
``(relative path, size, sha256 of the content)`` of every file in it, so the
same bytes give the same digest wherever they are and any change to any file
changes it. Content hashes are cached by ``(path, size, mtime, inode)`` in a
small JSON file so a large dataset is hashed once, not once per job. A version
of the catalog is checked with :func:`verify`, which names the files that
changed since it was registered. This module is a leaf (it imports nothing of
Danlu's): the jobs service's catalog hashes and confines with it as the job
runner and ``danlu.dataset`` (:mod:`danlu.datasets`) verify with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 20
#: why a run used a dataset, as MLflow's ``mlflow.data.context`` input tag says it
TRAINING = "training"
EVALUATION = "evaluation"
CONTEXTS = (TRAINING, EVALUATION)


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


def scan(
    path: str | os.PathLike,
    name: str | None = None,
    cache_file: Path | None = None,
    max_files: int | None = None,
    confine: bool = False,
) -> tuple[DatasetDigest, list[list]]:
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


def verify(
    path: str | os.PathLike, name: str, expected: str, manifest: list[list], cache_file: Path | None = None
) -> DatasetDigest:
    """The digest of a registered version's files, or :class:`DatasetChanged` naming what changed."""
    found, now = scan(path, name, cache_file)
    if found.digest != expected:
        what = changes(manifest, now) or ["its digest differs"]
        raise DatasetChanged(
            f"dataset {name} changed since it was registered: {', '.join(what)}; register the "
            "data again for a new version, or restore it"
        )
    return found
