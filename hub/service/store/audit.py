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

from danlu.hub.service.store.orm import AuditRecord, isoformat, utcnow

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


#: records read at a time by :func:`verify`
BATCH = 2000
_FIELDS = (AuditRecord.seq, AuditRecord.at, AuditRecord.actor, AuditRecord.action, AuditRecord.target,
           AuditRecord.before, AuditRecord.after, AuditRecord.prev_hash, AuditRecord.hash)


def verify(session: Session, batch: int = BATCH) -> Verification:
    """Walk the chain from the first record to the newest one there was when it started.

    Records are read by ranges of ``batch`` seq numbers (plain rows, nothing kept between batches), so
    memory stays the same whatever the length of the log. A range, not a LIMIT: PostgreSQL's generic
    plan for "from seq on, first N" reads every later record and sorts them, on every batch.
    """
    newest = session.scalar(select(func.max(AuditRecord.seq))) or 0
    prev_hash, expected, count = GENESIS, 1, 0
    while expected <= newest:
        rows = session.execute(select(*_FIELDS).where(AuditRecord.seq >= expected, AuditRecord.seq < expected + batch,
                                                      AuditRecord.seq <= newest).order_by(AuditRecord.seq)).all()
        if not rows:  # a whole range is gone: say where the log goes on, if it does
            resumes = session.scalar(select(func.min(AuditRecord.seq)).where(AuditRecord.seq >= expected,
                                                                            AuditRecord.seq <= newest))
            if resumes is None:
                return Verification(False, count, f"record {expected} is missing (the log ends at {expected - 1})",
                                    expected)
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
    return {"seq": record.seq, "at": isoformat(record.at), "actor": record.actor, "action": record.action,
            "target": record.target, "before": record.before, "after": record.after, "hash": record.hash}
