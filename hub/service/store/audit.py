"""The audit log: append-only, hash-chained records of who did what, when, before and after.

Every record's ``hash`` is an HMAC-SHA-256, keyed with the audit key, of the
previous record's hash and the record's own canonical JSON, so :func:`verify`
finds a record that was edited (its hash no longer matches), deleted or
inserted (the chain or the sequence breaks). The key lives outside the
database (:func:`load_key`: ``$DANLU_AUDIT_KEY``, on Kubernetes from the
``danlu-secrets`` Secret, or ``<state>/audit.key``, mode 0600), so whoever can
write the database alone cannot recompute the chain after a rewrite. Records
are appended by the jobs service only, inside the transaction of the change
they describe, so a change and its record land together.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from danlu import env
from danlu.errors import ConfigError, Forbidden
from danlu.hub.service.auth import require_admin
from danlu.hub.service.store.database import Database
from danlu.hub.service.store.orm import AuditRecord, Flag, isoformat, utcnow

GENESIS = "0" * 64
#: the audit key's file in the state folder, when $DANLU_AUDIT_KEY does not give it
KEY_FILE = "audit.key"
#: the shortest key accepted (characters of $DANLU_AUDIT_KEY, bytes of the file)
MIN_KEY = 32

_key: bytes | None = None


def load_key(state_dir: Path) -> bytes:
    """The audit key: ``$DANLU_AUDIT_KEY``, else ``<state_dir>/audit.key`` (created, 0600, on first use).

    A key file that others may read, or that is a link, is refused: a key the database's other
    readers hold proves nothing.
    """
    given = env.AUDIT_KEY.get()
    if given is not None:
        if len(given) < MIN_KEY:
            raise ConfigError(
                f"${env.AUDIT_KEY} is {len(given)} characters; the audit key needs at least {MIN_KEY}",
                reason="audit_key",
                fix="set it to a random secret, e.g. the output of: openssl rand -hex 32",
            )
        return given.encode()
    path = Path(state_dir) / KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ConfigError(
            f"cannot read the audit key {path}: {e}",
            reason="audit_key",
            fix=f"make {path} a regular file of the workbench's account (mode 0600), or set ${env.AUDIT_KEY}",
        ) from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        key = f.read(4096).strip()
    if not stat.S_ISREG(info.st_mode) or info.st_mode & 0o077 or info.st_uid != os.geteuid():
        raise ConfigError(
            f"the audit key {path} may be read or changed by other accounts (mode {oct(info.st_mode & 0o777)})",
            reason="audit_key",
            fix=f"chmod 600 {path} (and chown it to the workbench's account)",
        )
    if len(key) < MIN_KEY:
        raise ConfigError(
            f"the audit key {path} is {len(key)} bytes; it needs at least {MIN_KEY}",
            reason="audit_key",
            fix=f"remove {path} only if the audit log is empty (a new key is made), or restore it from a backup",
        )
    return key


def use_key(key: bytes) -> None:
    """Key every record appended and verified from now on in this process."""
    global _key
    _key = key


def current_key() -> bytes:
    if _key is None:
        raise ConfigError(
            "the audit key is not loaded",
            reason="audit_key",
            fix="load it first: audit.use_key(audit.load_key(settings.state_dir))",
        )
    return _key


def _digest(prev_hash: str, seq: int, at, actor: str, action: str, target: str, before, after, key=None) -> str:
    """The record's keyed hash (``key``: the current audit key); ``key=b""``: the unkeyed SHA-256 of 0.1.0."""
    key = current_key() if key is None else key
    body = json.dumps(
        {
            "seq": seq,
            "at": isoformat(at),
            "actor": actor,
            "action": action,
            "target": target,
            "before": before,
            "after": after,
        },
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    )
    message = f"{prev_hash}\n{body}".encode()
    if not key:
        return hashlib.sha256(message).hexdigest()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def append(session: Session, actor: str, action: str, target: str = "", before=None, after=None) -> AuditRecord:
    """Add a record to the chain (the caller's transaction commits it)."""
    last = session.scalars(select(AuditRecord).order_by(AuditRecord.seq.desc()).limit(1)).first()
    prev_hash, seq = (last.hash, last.seq + 1) if last else (GENESIS, 1)
    now = utcnow()
    at = now.replace(microsecond=now.microsecond // 1000 * 1000)  # what every database stores exactly
    record = AuditRecord(
        seq=seq,
        at=at,
        actor=actor,
        action=action,
        target=target,
        before=before or {},
        after=after or {},
        prev_hash=prev_hash,
    )
    record.hash = _digest(prev_hash, seq, at, actor, action, target, record.before, record.after)
    session.add(record)
    session.flush()
    return record


@dataclass
class Verification:
    ok: bool
    records: int
    problem: str = ""
    seq: int | None = None

    def to_dict(self) -> dict:
        return {"ok": self.ok, "records": self.records, "problem": self.problem, "seq": self.seq}


#: records read at a time by :func:`verify`
BATCH = 2000
_FIELDS = (
    AuditRecord.seq,
    AuditRecord.at,
    AuditRecord.actor,
    AuditRecord.action,
    AuditRecord.target,
    AuditRecord.before,
    AuditRecord.after,
    AuditRecord.prev_hash,
    AuditRecord.hash,
)


def verify(session: Session, batch: int = BATCH, key: bytes | None = None) -> Verification:
    """Walk the chain from the first record to the newest one there was when it started.

    ``key``: the audit key (default the loaded one); ``b""`` checks the unkeyed chain of Danlu 0.1.

    Records are read by ranges of ``batch`` seq numbers (plain rows, nothing kept between batches), so
    memory stays the same whatever the length of the log. A range, not a LIMIT: PostgreSQL's generic
    plan for "from seq on, first N" reads every later record and sorts them, on every batch.
    """
    newest = session.scalar(select(func.max(AuditRecord.seq))) or 0
    prev_hash, expected, count = GENESIS, 1, 0
    while expected <= newest:
        rows = session.execute(
            select(*_FIELDS)
            .where(AuditRecord.seq >= expected, AuditRecord.seq < expected + batch, AuditRecord.seq <= newest)
            .order_by(AuditRecord.seq)
        ).all()
        if not rows:  # a whole range is gone: say where the log goes on, if it does
            resumes = session.scalar(
                select(func.min(AuditRecord.seq)).where(AuditRecord.seq >= expected, AuditRecord.seq <= newest)
            )
            if resumes is None:
                return Verification(
                    False, count, f"record {expected} is missing (the log ends at {expected - 1})", expected
                )
            return Verification(False, count + 1, f"record {expected} is missing (next is {resumes})", expected)
        for seq, at, actor, action, target, before, after, record_prev, record_hash in rows:
            count += 1
            if seq != expected:
                return Verification(False, count, f"record {expected} is missing (next is {seq})", expected)
            if record_prev != prev_hash:
                return Verification(False, count, f"record {seq} does not follow record {seq - 1}", seq)
            if not hmac.compare_digest(
                _digest(prev_hash, seq, at, actor, action, target, before, after, key), record_hash
            ):
                return Verification(False, count, f"record {seq} was altered", seq)
            prev_hash, expected = record_hash, expected + 1
    return Verification(True, count)


def to_dict(record: AuditRecord) -> dict:
    return {
        "seq": record.seq,
        "at": isoformat(record.at),
        "actor": record.actor,
        "action": record.action,
        "target": record.target,
        "before": record.before,
        "after": record.after,
        "hash": record.hash,
    }


class AuditLog:
    """The audit log as the API offers it: admins read and verify it, the hub records logins, and the service
    records what it does (:meth:`event`) and the governed profiles' changes at start-up."""

    def __init__(self, database: Database, state_dir: Path | None = None):
        self.database = database
        if state_dir is not None:
            use_key(load_key(state_dir))

    async def event(self, actor: str, action: str, target: str, before=None, after=None) -> dict:
        """Append to the audit log (the database's one writer keeps the chain whole)."""
        return await self.database.write(
            lambda s: to_dict(append(s, actor, action, target, before=before, after=after))
        )

    async def record_login(self, principal, body: dict) -> dict:
        if not (principal.kind == "service" and principal.name == "danlu-admin"):
            raise Forbidden(
                "only the hub records logins",
                reason="not_the_hub",
                fix="logins are recorded by the hub itself; read them with GET /audit?action=login",
            )
        return await self.event(body["actor"], body["action"], "workbench", after=body.get("details", {}))

    async def records(self, principal, *, limit: int, action: str | None, target: str | None) -> list[dict]:
        require_admin(principal, "the audit log is for admins")

        def query(s):
            q = select(AuditRecord).order_by(AuditRecord.seq.desc()).limit(limit)
            if action:
                q = q.where(AuditRecord.action == action)
            if target:
                q = q.where(AuditRecord.target == target)
            return [to_dict(r) for r in s.scalars(q)]

        return await self.database.read(query)

    async def verify(self, principal) -> dict:
        require_admin(principal, "the audit log is for admins")
        return await self.database.read(lambda s: verify(s).to_dict())

    def record_profiles(self, profiles) -> None:
        """Audit a change of the governed profiles since the service last started (at start-up)."""
        now = {
            p.slug: {
                "display_name": p.display_name,
                "environment": p.environment,
                "groups": list(p.groups),
                "gpus": list(p.gpu_choices),
                "requirements": p.requirements_digest(),
            }
            for p in profiles
        }

        def record(s) -> None:
            flag = s.get(Flag, "profiles")
            before = flag.value.get("profiles", {}) if flag and isinstance(flag.value, dict) else None
            if before == now:
                return
            changed = {slug for slug in set(now) | set(before or {}) if (before or {}).get(slug) != now.get(slug)}
            append(
                s,
                "danlu",
                "change_profiles",
                profiles.source,
                before={slug: (before or {}).get(slug) for slug in sorted(changed)},
                after={slug: now.get(slug) for slug in sorted(changed)},
            )
            s.merge(Flag(key="profiles", value={"profiles": now}))

        self.database.write_now(record)
