"""Reading a dataset's files for the catalog: its digest and manifest, and the columns of its tables.

:func:`digest_of` resolves a registration's path (confined to its root on the real path), hashes every file
(:func:`danlu.digests.scan`, at most :data:`MAX_FILES` and ``max_bytes`` of apparent size, a sparse file
counting in full, no link out of the folder) and reads the columns and row counts of its CSV and Parquet
files (:func:`tables_of`, at most :data:`MAX_TABLES`). :func:`hash_as` does this in a child process
(``python -m danlu.hub.service.datasets.scan``), running as the user with Unix accounts, so the service never
reads for someone what they could not read themselves, and killed past its time bound, so no registration
holds anything for longer. Its answer is read bounded (:data:`MAX_ANSWER` bytes) and checked
(:func:`checked_answer`): the digest is recomputed from the manifest, the path is the service's own
resolution. Every refusal is a :class:`~danlu.errors.ValidationError` naming ``path`` and the fix.
"""

from __future__ import annotations

import asyncio
import csv
import hashlib
import io
import json
import os
import re
import sys
from pathlib import Path

from danlu.digests import DatasetDigest, LinkOut, TooManyFiles, open_regular, scan
from danlu.errors import ValidationError
from danlu.hub.service import paths

#: the most files a dataset version may hold (each is hashed and listed in the manifest)
MAX_FILES = 100_000
#: the most bytes a dataset version may hold (JobsServiceApp.dataset_max_bytes)
MAX_BYTES = 16 * 2**40
#: the most bytes of answer read from the scanning child (a manifest of MAX_FILES long paths fits)
MAX_ANSWER = 128 * 2**20
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


SCAN_TIMEOUT = 3600.0  # seconds a registration's scan may take (a large dataset hashes for long)
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")


async def _bounded(stream, limit: int) -> bytes:
    """What ``stream`` gives until its end, or ``limit + 1`` bytes if it gives more (then it is left unread)."""
    out = bytearray()
    while len(out) <= limit and (chunk := await stream.read(min(1 << 20, limit + 1 - len(out)))):
        out += chunk
    return bytes(out)


def _refused(message: str, reason: str, fix: str) -> ValidationError:
    return ValidationError(f"path: {message}", field="path", reason=reason, fix=fix)


async def hash_as(
    account, value: str, home: Path, roots: dict, *, cache=None, timeout=SCAN_TIMEOUT, max_bytes=MAX_BYTES
):
    """:func:`digest_of` in a child process, as ``account`` (None: as this process, with ``cache``), killed
    after ``timeout`` seconds; its answer read at most :data:`MAX_ANSWER` bytes and checked."""
    request = json.dumps(
        {
            "value": value,
            "home": str(home),
            "roots": {k: str(v) for k, v in roots.items()},
            "cache": str(cache) if cache else None,
            "max_bytes": max_bytes,
            "max_files": MAX_FILES,
        }
    )
    as_user = {}
    if account is not None:
        as_user = {
            "user": account.uid,
            "group": account.gid,
            "extra_groups": os.getgrouplist(account.name, account.gid),
        }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "danlu.hub.service.datasets.scan",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd="/",
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), **_import_path()},
        **as_user,
    )
    assert proc.stdin is not None  # stdin=PIPE
    try:
        proc.stdin.write(request.encode())
        proc.stdin.close()
        out, err = await asyncio.wait_for(
            asyncio.gather(_bounded(proc.stdout, MAX_ANSWER), _bounded(proc.stderr, 64 * 1024)), timeout
        )
    except asyncio.TimeoutError:
        raise _refused(
            f"reading {value[:200]} took over {timeout:g} s, the most a registration may take",
            "too_slow",
            "register a smaller dataset, or parts of it",
        ) from None
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
    if len(out) > MAX_ANSWER:
        raise _refused(
            f"the manifest of {value[:200]} is over {MAX_ANSWER // 2**20} MiB",
            "too_many_files",
            "register parts of it as separate datasets, or pack small files into archives",
        )
    try:
        answer = json.loads(out)
    except ValueError:
        raise RuntimeError(f"reading the dataset {value[:200]!r} failed: {err[-500:]!r}") from None
    return checked_answer(answer, value, home, roots)


def _import_path() -> dict:
    """The child imports this Danlu (a source checkout's path included)."""
    return {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}


def checked_answer(answer, value: str, home: Path, roots: dict):
    """The child's answer as :func:`digest_of` returns it, if it is well formed and its digest is its manifest's.

    The child may run as the user, who could tamper with it: what it says is only about the user's own data,
    where that data is comes from the service's own resolution, and the digest from the manifest."""
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        error = answer["error"]
        raise ValidationError(
            str(error.get("message"))[:500],
            field="path",
            reason=str(error.get("reason") or "no_dataset")[:40],
            fix=str(error.get("fix") or "")[:300] or None,
        )
    bad = RuntimeError(f"the scan of {value[:200]!r} answered something malformed")
    if not isinstance(answer, dict) or not isinstance(answer.get("manifest"), list):
        raise bad
    manifest, tables = answer["manifest"], answer.get("tables")
    entries, total = [], 0
    for entry in manifest:
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and type(entry[1]) is int
            and entry[1] >= 0
            and isinstance(entry[2], str)
            and _SHA256.match(entry[2])
        ):
            raise bad
        entries.append(f"{entry[0]}\0{entry[1]}\0{entry[2]}")
        total += entry[1]
    if len(manifest) > max(MAX_FILES, 1) or not isinstance(tables, list) or len(tables) > MAX_TABLES:
        raise bad
    if not all(isinstance(t, dict) for t in tables):
        raise bad
    _, real = paths.resolve_dataset(value, workdir=home, home=home, roots=roots, field="path")
    digest = hashlib.sha256("\n".join(entries).encode()).hexdigest()
    found = DatasetDigest(real.name, str(real), digest, len(manifest), total)
    return real, found, manifest, tables


def child_main() -> int:
    """``python -m danlu.hub.service.datasets.scan``: :func:`digest_of` of the request on stdin, JSON on stdout."""
    request = json.loads(sys.stdin.read(1 << 20))
    cache = Path(request["cache"]) if request.get("cache") else None
    try:
        real, found, manifest, tables = digest_of(
            request["value"],
            Path(request["home"]),
            {k: Path(v) for k, v in request["roots"].items()},
            cache,
            max_bytes=request.get("max_bytes", MAX_BYTES),
            max_files=request.get("max_files", MAX_FILES),
        )
    except ValidationError as e:
        json.dump({"error": {"message": e.message, "field": e.field, "reason": e.reason, "fix": e.fix}}, sys.stdout)
        return 0
    json.dump({"real": str(real), "found": found.to_dict(), "manifest": manifest, "tables": tables}, sys.stdout)
    return 0


def _size_of(real: Path, max_bytes: int, max_files: int) -> int:
    """The apparent size of a file or folder (what hashing it reads), counted up to just past ``max_bytes``."""
    if real.is_file():
        return real.stat().st_size
    total = 0
    for count, p in enumerate(real.rglob("*")):
        if count > max_files:
            break  # the scan refuses it, naming the count
        if p.is_file():
            total += p.stat().st_size
            if total > max_bytes:
                break
    return total


def digest_of(
    value: str, home: Path, roots: dict, cache: Path | None, *, max_bytes: int = MAX_BYTES, max_files: int = 0
):
    """The real path (confined to its root), its digest and manifest, its tables."""
    _, real = paths.resolve_dataset(value, workdir=home, home=home, roots=roots, field="path")
    max_files = max_files or MAX_FILES
    try:
        if _size_of(real, max_bytes, max_files) > max_bytes:
            raise _refused(
                f"{value[:200]} holds more than {max_bytes} bytes (sparse files count in full), "
                "the most a dataset may hold",
                "too_large",
                "register parts of it as separate datasets",
            )
        found, manifest = scan(real, cache_file=cache, max_files=max_files, confine=True)
    except TooManyFiles:
        raise ValidationError(
            f"path: {value[:200]} holds more than {max_files} files, the most a dataset may have",
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
