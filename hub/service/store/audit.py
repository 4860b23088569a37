"""The audit log: append-only, hash-chained records of who did what, when, before and after.

Every record's ``hash`` is the SHA-256 of the previous record's hash and the
record's own canonical JSON, so :func:`verify` finds a record that was edited
(its hash no longer matches), deleted or inserted (the chain or the sequence
breaks). Records are appended by the jobs service only, inside the transaction
of the change they describe, so a change and its record land together.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from danlu.errors import Forbidden
from danlu.hub.service.auth import require_admin
from danlu.hub.service.store.database import Database
from danlu.hub.service.store.orm import AuditRecord, Flag, isoformat, utcnow

GENESIS = "0" * 64


def _digest(prev_hash: str, seq: int, at, actor: str, action: str, target: str, before, after) -> str:
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
    return hashlib.sha256(f"{prev_hash}\n{body}".encode()).hexdigest()


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


def verify(session: Session, batch: int = BATCH) -> Verification:
    """Walk the chain from the first record to the newest one there was when it started.

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
            if _digest(prev_hash, seq, at, actor, action, target, before, after) != record_hash:
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

    def __init__(self, database: Database):
        self.database = database

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
