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

from sqlalchemy import select
from sqlalchemy.orm import Session

from danlu.hub.service.models import AuditRecord, isoformat, utcnow

GENESIS = "0" * 64


def _digest(prev_hash: str, seq: int, at, actor: str, action: str, target: str, before, after) -> str:
    body = json.dumps({"seq": seq, "at": isoformat(at), "actor": actor, "action": action, "target": target,
                       "before": before, "after": after}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(f"{prev_hash}\n{body}".encode()).hexdigest()


def append(session: Session, actor: str, action: str, target: str = "", before=None, after=None) -> AuditRecord:
    """Add a record to the chain (the caller's transaction commits it)."""
    last = session.scalars(select(AuditRecord).order_by(AuditRecord.seq.desc()).limit(1)).first()
    prev_hash, seq = (last.hash, last.seq + 1) if last else (GENESIS, 1)
    now = utcnow()
    at = now.replace(microsecond=now.microsecond // 1000 * 1000)  # what every database stores exactly
    record = AuditRecord(seq=seq, at=at, actor=actor, action=action, target=target, before=before or {},
                         after=after or {}, prev_hash=prev_hash)
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


def verify(session: Session) -> Verification:
    prev_hash, expected, count = GENESIS, 1, 0
    for record in session.scalars(select(AuditRecord).order_by(AuditRecord.seq)):
        count += 1
        if record.seq != expected:
            return Verification(False, count, f"record {expected} is missing (next is {record.seq})", expected)
        if record.prev_hash != prev_hash:
            return Verification(False, count, f"record {record.seq} does not follow record {record.seq - 1}",
                                record.seq)
        if _digest(prev_hash, record.seq, record.at, record.actor, record.action, record.target, record.before,
                   record.after) != record.hash:
            return Verification(False, count, f"record {record.seq} was altered", record.seq)
        prev_hash, expected = record.hash, expected + 1
    return Verification(True, count)


def to_dict(record: AuditRecord) -> dict:
    return {"seq": record.seq, "at": isoformat(record.at), "actor": record.actor, "action": record.action,
            "target": record.target, "before": record.before, "after": record.after, "hash": record.hash}
