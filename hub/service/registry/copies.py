"""A registered version's model files, copied at registration into storage that only Danlu writes.

A version points at its run's artifacts (or its MLflow 3 logged model), which the registrant may still
overwrite or delete in MLflow. So when it is registered the service downloads those files from MLflow as
its own MLflow account (the artifact proxy, ``/api/2.0/mlflow-artifacts/artifacts``) into
``<state>/models/<name>/<version>/files/`` (folders 0700, files 0600, written into a fresh staging folder
that is renamed into place whole, opened without following links), with ``manifest.json``: each file's
relative path, size and SHA-256. One digest over that list (:func:`manifest_digest`) is stored on the
version's row -- the database, not the folder, is the trust anchor. Approving re-verifies the copy against
it (:func:`verify`); serving hands out only what the manifest lists; ``danlu.model`` checks every file it
downloads against the manifest, whose digest it checks against the version's. A model larger than
``max_bytes`` (``c.JobsServiceApp.model_max_bytes``) or with more than :data:`MAX_FILES` files is refused
at registration, before the version is made.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import stat
from pathlib import Path
from urllib.parse import quote

from danlu.errors import Conflict, DanluError, NotFound
from danlu.hub.service.formats import MODEL_FILE_PATH
from danlu.hub.service.jobs.outputs import size_text

MANIFEST = "manifest.json"
FILES = "files"
STAGING = ".incoming"
#: the most files one model version may hold
MAX_FILES = 10_000
#: the deepest folder nesting of a model's files
MAX_DEPTH = 32
MAX_BYTES_DEFAULT = 20 * 2**30
CHUNK = 1 << 20
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
ARTIFACTS = "/api/2.0/mlflow-artifacts/artifacts"
SCHEME = "mlflow-artifacts:"


def manifest_digest(files: list[dict]) -> str:
    """``sha256:...`` of the manifest's files (``path``, ``size``, ``sha256``), canonical JSON, sorted by path
    (``danlu.model`` computes the same, in magics/models.py)."""
    rows = sorted(({"path": f["path"], "size": int(f["size"]), "sha256": f["sha256"]} for f in files), key=_path)
    text = json.dumps(rows, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _path(f: dict) -> str:
    return f["path"]


def root_of(state_dir: Path, name: str, version: int) -> Path:
    return Path(state_dir) / "models" / name / str(int(version))


def check_part(part: str) -> str:
    """One segment of a file's path as MLflow listed it: refused if it could leave its folder."""
    if part in ("", ".", "..") or "/" in part or "\\" in part or "\x00" in part or len(part) > 255:
        raise DanluError(
            f"MLflow listed a model file named {part[:80]!r}, which cannot be copied",
            status=502,
            reason="bad_model_file",
            fix="rename the file in the run's artifacts and register again",
        )
    return part


# copying from MLflow ---------------------------------------------------------------------------------------
def artifact_root(uri: str) -> str:
    """The artifact proxy's path of an ``mlflow-artifacts:`` URI (what ``danlu up``'s MLflow gives)."""
    if not uri.startswith(SCHEME):
        raise DanluError(
            f"the model's files are at {uri[:200]}, which the jobs service cannot copy (it copies only what "
            "MLflow's artifact proxy serves)",
            status=409,
            reason="model_not_copyable",
            fix="run MLflow with --serve-artifacts (danlu up does)",
        )
    return uri[len(SCHEME) :].lstrip("/").rstrip("/")


class Copier:
    """Downloads one version's files from MLflow into a staging folder, bounded; then moves it into place."""

    def __init__(self, registry, state_dir: Path, max_bytes: int):
        self.registry = registry  # MlflowRegistry: the service's MLflow account
        self.state_dir = Path(state_dir)
        self.max_bytes = int(max_bytes)

    async def listing(self, root: str) -> list[tuple[str, int]]:
        """Every file under ``root`` (``(relative path, size)``), refused beyond the bounds before any download."""
        found: list[tuple[str, int]] = []
        total = 0
        pending = [("", 0)]
        while pending:
            folder, depth = pending.pop()
            code, data = await self.registry.call("GET", ARTIFACTS, params={"path": f"{root}/{folder}".rstrip("/")})
            if code != 200:
                raise self.registry.refused(f"list the model's files at {root}/{folder}", code, data)
            for entry in data.get("files") or []:
                if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
                    continue
                rel = f"{folder}/{check_part(entry['path'].rpartition('/')[2])}".lstrip("/")
                if entry.get("is_dir"):
                    if depth + 1 > MAX_DEPTH:
                        raise self._too_large(f"folders nested deeper than {MAX_DEPTH}")
                    pending.append((rel, depth + 1))
                    continue
                if len(rel) > MODEL_FILE_PATH:
                    raise DanluError(
                        f"the model holds a file whose path is over {MODEL_FILE_PATH} characters: {rel[:80]!r}...",
                        status=413,
                        reason="too_large",
                        fix=f"shorten the file's path in the run's artifacts to at most {MODEL_FILE_PATH} "
                        "characters and register again",
                    )
                size = int(entry.get("file_size") or 0)
                total += size
                found.append((rel, size))
                if len(found) > MAX_FILES:
                    raise self._too_large(f"more than {MAX_FILES} files")
                if total > self.max_bytes:
                    raise self._too_large(f"more than {size_text(self.max_bytes)}")
        return sorted(found)

    def _too_large(self, what: str) -> DanluError:
        return DanluError(
            f"the model's files are too large to register: {what} (the jobs service copies each registered "
            f"version, and holds one to at most {size_text(self.max_bytes)} and {MAX_FILES} files)",
            status=413,
            reason="model_too_large",
            fix="register a smaller model (leave checkpoints and data out of the logged model), or ask an admin "
            "to raise c.JobsServiceApp.model_max_bytes",
        )

    async def copy(self, uri: str) -> tuple[Path, list[dict]]:
        """The files of ``uri`` in a new staging folder: ``(folder, manifest files)``."""
        root = artifact_root(uri)
        listing = await self.listing(root)
        staging = self.state_dir / "models" / STAGING / secrets.token_hex(8)
        staging.mkdir(parents=True, mode=0o700)
        os.chmod(staging.parent, 0o700)
        os.chmod(staging.parent.parent, 0o700)
        try:
            files, budget = [], self.max_bytes
            for rel, _size in listing:
                size, digest = await self._download(f"{root}/{rel}", staging / FILES, rel, budget)
                budget -= size
                files.append({"path": rel, "size": size, "sha256": digest})
            write_new(staging / MANIFEST, json.dumps({"digest": manifest_digest(files), "files": files}).encode())
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return staging, files

    async def _download(self, remote: str, folder: Path, rel: str, budget: int) -> tuple[int, str]:
        # deferred: the MLflow server's process imports this package's neighbours, and runs no tornado
        from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

        parent = folder.joinpath(*rel.split("/")[:-1])
        parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(parent / rel.rpartition("/")[2], _WRITE, 0o600)
        hasher, seen = hashlib.sha256(), [0]

        def chunk(data: bytes) -> None:
            seen[0] += len(data)
            if seen[0] > budget:
                raise self._too_large(f"more than {size_text(self.max_bytes)}")
            hasher.update(data)
            os.write(fd, data)

        headers = {k: v for k, v in self.registry.headers.items() if k != "Content-Type"}
        request = HTTPRequest(
            f"{self.registry.url}{ARTIFACTS}/{quote(remote)}",
            headers=headers,
            connect_timeout=30,
            request_timeout=3600,
            streaming_callback=chunk,
        )
        client = AsyncHTTPClient(force_instance=True, max_body_size=max(budget, 1))
        try:
            response = await client.fetch(request, raise_error=False)
        except DanluError:
            raise
        except (HTTPClientError, OSError) as e:
            what = f"MLflow stopped sending model file {rel}: {e}"
            raise DanluError(what, status=502, reason="mlflow_refused") from None
        finally:
            client.close()
            os.close(fd)
        if seen[0] > budget:
            raise self._too_large(f"more than {size_text(self.max_bytes)}")
        if response.code != 200:
            raise DanluError(
                f"MLflow answered {response.code} for model file {rel}", status=502, reason="mlflow_refused"
            )
        return seen[0], hasher.hexdigest()

    def place(self, staging: Path, name: str, version: int) -> None:
        """Move a staging folder into place as ``<name>/<version>`` (a leftover of a failed registration of
        the same number, which MLflow never hands out twice, is removed first)."""
        target = root_of(self.state_dir, name, version)
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if target.exists() or target.is_symlink():
            if target.is_symlink() or not target.is_dir():
                target.unlink()
            else:
                shutil.rmtree(target)
        os.rename(staging, target)


def write_new(path: Path, data: bytes) -> None:
    fd = os.open(path, _WRITE, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


# reading the stored copy ------------------------------------------------------------------------------------
def _open_under(root: Path, rel: str, flags: int = _READ) -> int:
    """An fd of ``root/rel``, no component of which (from ``<state>/models`` down) may be a link."""
    parts = [root.parent.name, root.name, *rel.split("/")]
    fd = os.open(root.parent.parent, _DIR)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags, dir_fd=fd)
    finally:
        os.close(fd)


def manifest(state_dir: Path, name: str, version: int, digest: str) -> list[dict]:
    """The stored copy's manifest files, once its digest is the version's; Conflict if it is not."""
    root = root_of(state_dir, name, version)
    try:
        fd = _open_under(root, MANIFEST)
    except OSError:
        raise changed(name, version, MANIFEST, "is missing") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(64 * 2**20)
    try:
        files = json.loads(data)["files"]
        ok = manifest_digest(files) == digest
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise changed(name, version, MANIFEST, "does not match the digest recorded at registration")
    return files


def verify(state_dir: Path, name: str, version: int, digest: str) -> list[dict]:
    """Re-hash every file of the stored copy against its manifest (and it against ``digest``); Conflict naming
    the first file that changed."""
    files = manifest(state_dir, name, version, digest)
    root = root_of(state_dir, name, version)
    for f in files:
        try:
            fd = _open_under(root, f"{FILES}/{f['path']}")
        except OSError:
            raise changed(name, version, f["path"], "is missing") from None
        hasher = hashlib.sha256()
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise changed(name, version, f["path"], "is not a file")
            while block := handle.read(CHUNK):
                hasher.update(block)
        if hasher.hexdigest() != f["sha256"]:
            raise changed(name, version, f["path"], "was altered")
    return files


def open_file(state_dir: Path, name: str, version: int, digest: str, path: str) -> int:
    """An fd of one file the manifest lists (NotFound for any other path)."""
    files = manifest(state_dir, name, version, digest)
    if path not in {f["path"] for f in files}:
        raise NotFound(
            f"{name} version {version} has no file {path[:200]}",
            reason="no_such_file",
            field="path",
            fix=f"see its files at GET /models/{name}/versions/{version}/files",
        )
    try:
        return _open_under(root_of(state_dir, name, version), f"{FILES}/{path}")
    except OSError:
        raise changed(name, version, path, "is missing") from None


def changed(name: str, version: int, path: str, how: str) -> Conflict:
    return Conflict(
        f"the stored copy of {name} version {version} changed since it was registered: {path} {how}",
        reason="copy_changed",
        fix="do not use this version; an admin restores <state>/models from a backup, or the version is "
        "rejected and registered again",
    )


def not_copied(name: str, version: int) -> NotFound:
    return NotFound(
        f"{name} version {version} was registered before Danlu copied models: it has no stored copy",
        reason="not_copied",
        fix=f"load it from MLflow (mlflow.pyfunc.load_model('models:/{name}/{version}')), unchecked, or register "
        "its run again to have a copy",
    )
