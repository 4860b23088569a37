"""``danlu.model``: a registered model version's files, from the copy the jobs service made at registration,
each checked against the version's digest.

The service copies a version's files when it is registered (the registrant can still change the run's artifacts
in MLflow afterwards), and the version names the digest of that copy's manifest. :func:`load` downloads the copy
through the jobs service (who may read the version may load it), checks the manifest against the version's
digest and every file against the manifest, and refuses any mismatch (:class:`ModelChanged`, naming the file).
A version registered before Danlu copied models has no digest ("not copied"): its files come from MLflow, with
a warning that nothing checked them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from danlu.client import DanluClient
from danlu.errors import Conflict, NotFound, UsageError


class ModelChanged(Conflict):
    """A model file (or the manifest) does not match the digest the version was registered, and approved, with."""


def manifest_digest(files: list[dict]) -> str:
    """``sha256:...`` of a manifest's files, as the jobs service computes it (hub/service/registry/copies.py)."""
    rows = sorted(({"path": f["path"], "size": int(f["size"]), "sha256": f["sha256"]} for f in files), key=_path)
    text = json.dumps(rows, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _path(f: dict) -> str:
    return f["path"]


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "danlu" / "models"


def resolve(client: DanluClient, name: str, version: int | str | None) -> dict:
    """The version a number, a digit string, an alias or None (the newest you may read) names."""
    if isinstance(version, int) or (isinstance(version, str) and version.isdigit()):
        return client.model_version(name, int(version))
    model = client.model(name)
    if version is None:
        if not model.get("latest"):
            raise NotFound(f"model {name} has no version you may read", reason="no_such_version")
        return model["latest"]
    if version not in (model.get("aliases") or {}):
        raise NotFound(
            f"model {name} has no alias {version}",
            reason="no_such_alias",
            fix=f"see its aliases with 'danlu models show {name}'",
        )
    return client.model_version(name, int(model["aliases"][version]))


def _changed(name: str, version: int, path: str, how: str) -> ModelChanged:
    return ModelChanged(
        f"{name} version {version}: {path} {how}; it is not the model that was registered",
        reason="copy_changed",
        fix="do not use it; tell an admin (the stored copy or the download was altered)",
    )


def load(name: str, version: int | str | None = None, dest=None, client: DanluClient | None = None) -> Path:
    """The folder of a model version's files (``dest``, else under ``~/.cache/danlu/models``), checked."""
    client = client or DanluClient()
    v = resolve(client, name, version)
    number = int(v["version"])
    if not v.get("digest"):
        return _uncopied(v, name, number, dest)
    manifest = client.model_files(name, number)
    files = manifest.get("files") or []
    if manifest_digest(files) != v["digest"]:
        raise _changed(name, number, "its manifest", "does not match the version's digest")
    target = Path(dest) if dest is not None else default_cache() / name / f"{number}-{v['digest'][7:19]}"
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        for f in files:
            _fetch(client, name, number, f, staging)
        if target.exists():
            shutil.rmtree(target)
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _fetch(client: DanluClient, name: str, number: int, f: dict, root: Path) -> None:
    parts = f["path"].split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise _changed(name, number, f["path"][:200], "is not a path inside the model")
    path = root.joinpath(*parts)
    path.parent.mkdir(parents=True, exist_ok=True)
    hasher, size = hashlib.sha256(), 0
    with client.model_file(name, number, f["path"]) as response, open(path, "xb") as out:
        for block in response.iter_content(1 << 20):
            size += len(block)
            if size > int(f["size"]):
                raise _changed(name, number, f["path"], "is larger than registered")
            hasher.update(block)
            out.write(block)
    if size != int(f["size"]) or hasher.hexdigest() != f["sha256"]:
        raise _changed(name, number, f["path"], "does not match its digest")


def _uncopied(v: dict, name: str, number: int, dest) -> Path:
    warnings.warn(
        f"{name} version {number} is not copied (registered before Danlu copied models): its files come from "
        "MLflow, unchecked, and its registrant could have changed them",
        stacklevel=3,
    )
    try:
        import mlflow.artifacts  # deferred: mlflow takes ~2 s to import; only versions registered before copies
    except ImportError:
        raise UsageError(
            f"{name} version {number} is not copied, and loading it from MLflow needs the mlflow package",
            fix="pip install mlflow, or register its run again to have a copy",
        ) from None
    where = None
    if dest is not None:
        Path(dest).mkdir(parents=True, exist_ok=True)
        where = str(dest)
    return Path(mlflow.artifacts.download_artifacts(artifact_uri=v["source"], dst_path=where))
