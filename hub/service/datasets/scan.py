"""Reading a dataset's files for the catalog: its digest and manifest, and the columns of its tables.

:func:`digest_of` resolves a registration's path (confined to its root on the real path), hashes every file
(:func:`danlu.digests.scan`, at most :data:`MAX_FILES`, no link out of the folder) and reads the columns and
row counts of its CSV and Parquet files (:func:`tables_of`, at most :data:`MAX_TABLES`). With Unix accounts
:func:`hash_as` does the same in a child process running as the user (``python -m
danlu.hub.service.datasets.scan``), so the service never reads for someone what they could not read
themselves; of the child's answer it keeps only what concerns the user's own data, the path being its own
resolution. Every refusal is a :class:`~danlu.errors.ValidationError` naming ``path`` and the fix.
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from danlu.digests import DatasetDigest, LinkOut, TooManyFiles, open_regular, scan
from danlu.errors import ValidationError
from danlu.hub.service import paths

#: the most files a dataset version may hold (each is hashed and listed in the manifest)
MAX_FILES = 100_000
#: the most tabular files whose schema a version records
MAX_TABLES = 100
#: a CSV file's header is read from its first bytes
HEAD_BYTES = 64 * 1024
#: CSV files larger than this get columns but no row count
MAX_COUNT_BYTES = 256 * 1024 * 1024


# tabular files ------------------------------------------------------------------------------------------
def csv_table(path: Path) -> dict:
    """Columns (from the header in the first 64 KiB) and row count (records after the header) of a CSV file."""
    with open_regular(path) as f:
        head = f.read(HEAD_BYTES)
    lines = head.decode("utf-8-sig", "replace").splitlines()
    columns = next(csv.reader(lines[:1]), []) if lines else []
    size = path.stat().st_size
    if size > MAX_COUNT_BYTES:
        return {
            "columns": columns,
            "rows": None,
            "note": f"rows not counted: the file is over {MAX_COUNT_BYTES // 2**20} MiB",
        }
    with open_regular(path) as raw, io.TextIOWrapper(raw, encoding="utf-8-sig", errors="replace", newline="") as f:
        records = sum(1 for row in csv.reader(f) if row)
    return {"columns": columns, "rows": max(0, records - 1)}


def parquet_table(path: Path) -> dict:
    try:
        import pyarrow.parquet as pq  # deferred: optional (pyarrow), and slow to import; only Parquet files need it
    except ImportError:
        return {"columns": None, "rows": None, "note": "schema not read: pyarrow is not installed"}
    with open_regular(path) as f:  # only the footer is read (pyarrow parses it: see docs/security.md)
        meta = pq.ParquetFile(f).metadata
    return {"columns": list(meta.schema.to_arrow_schema().names), "rows": meta.num_rows}


READERS = {".csv": ("csv", csv_table), ".parquet": ("parquet", parquet_table)}


def tables_of(root: Path, manifest: list[list]) -> list[dict]:
    """The schema of the first :data:`MAX_TABLES` tabular files of a version; a file that cannot be read says why."""
    out: list[dict] = []
    for rel, _size, _sha in manifest:
        kind = READERS.get(os.path.splitext(rel)[1].lower())
        if kind is None:
            continue
        if len(out) == MAX_TABLES:
            break
        path = root if root.is_file() else root / rel
        try:
            table = kind[1](path)
        except Exception as e:  # a malformed file is the data's problem, not the registration's
            table = {"columns": None, "rows": None, "note": f"schema not read: {str(e)[:200]}"}
        out.append({"path": rel, "format": kind[0], **table})
    return out


SCAN_TIMEOUT = 3600.0  # seconds a registration's scan may take as the user (a large dataset hashes for long)


def hash_as(account, value: str, home: Path, roots: dict):
    """:func:`_hash` in a child process running as ``account`` (no digest cache: it is the service's)."""
    request = json.dumps({"value": value, "home": str(home), "roots": {k: str(v) for k, v in roots.items()}})
    try:
        done = subprocess.run(
            [sys.executable, "-m", "danlu.hub.service.datasets.scan"],
            input=request.encode(),
            capture_output=True,
            timeout=SCAN_TIMEOUT,
            user=account.uid,
            group=account.gid,
            extra_groups=os.getgrouplist(account.name, account.gid),
            cwd="/",
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)},
        )
    except subprocess.TimeoutExpired:
        raise ValidationError(
            f"path: reading {value[:200]} took over {SCAN_TIMEOUT:g} s",
            field="path",
            reason="too_slow",
            fix="register a smaller dataset, or parts of it",
        ) from None
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        raise RuntimeError(f"reading the dataset as {account.name} failed: {done.stderr[-500:]!r}") from None
    if "error" in answer:
        raise ValidationError(**answer["error"])
    # the child runs as the user, who could tamper with it: what it says is only about the user's own data,
    # and where that data is comes from the service's own resolution, not from the child
    _, real = paths.resolve_dataset(value, workdir=home, home=home, roots=roots, field="path")
    found = DatasetDigest(**{**answer["found"], "path": str(real)})
    return real, found, answer["manifest"], answer["tables"]


def child_main() -> int:
    """``python -m danlu.hub.service.datasets.scan``: :func:`_hash` of the request on stdin, as JSON on stdout."""
    request = json.loads(sys.stdin.read(1 << 20))
    try:
        real, found, manifest, tables = digest_of(
            request["value"], Path(request["home"]), {k: Path(v) for k, v in request["roots"].items()}, None
        )
    except ValidationError as e:
        json.dump({"error": {"message": e.message, "field": e.field, "reason": e.reason, "fix": e.fix}}, sys.stdout)
        return 0
    json.dump({"real": str(real), "found": found.to_dict(), "manifest": manifest, "tables": tables}, sys.stdout)
    return 0


def digest_of(value: str, home: Path, roots: dict, cache: Path | None):
    """On a thread: the real path (confined to its root), its digest and manifest, its tables."""
    _, real = paths.resolve_dataset(value, workdir=home, home=home, roots=roots, field="path")
    try:
        found, manifest = scan(real, cache_file=cache, max_files=MAX_FILES, confine=True)
    except TooManyFiles:
        raise ValidationError(
            f"path: {value[:200]} holds more than {MAX_FILES} files, the most a dataset may have",
            field="path",
            reason="too_many_files",
            fix="pack small files into archives or shards, or register parts of it as separate datasets",
        ) from None
    except LinkOut as e:
        raise ValidationError(
            f"path: {e.args[0][:200]} in {value[:200]} is a symbolic link out of the dataset's folder",
            field="path",
            reason="escapes_root",
            fix="copy the data into the folder instead of linking to it",
        ) from None
    except OSError as e:  # changed or unreadable while it was read
        raise ValidationError(
            f"path: {value[:200]} cannot be read ({e.strerror or e})",
            field="path",
            reason="no_dataset",
            fix="check the permissions of the files, and register it again",
        ) from None
    return real, found, manifest, tables_of(real, manifest)


if __name__ == "__main__":
    raise SystemExit(child_main())
