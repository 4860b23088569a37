"""The audit chain keyed: every record's hash becomes an HMAC-SHA-256 with the audit key.

Before, the chain was plain SHA-256: whoever could write the database could
edit a record and recompute every hash after it. The key lives outside the
database (:func:`danlu.hub.service.store.audit.load_key`), loaded by ``danlu
up`` and the jobs service before they upgrade. The existing chain is checked
as it was (unkeyed) and then re-chained with the key, and a last record,
``key_audit_chain``, says how many records were re-chained and whether the
unkeyed chain was whole: a rewrite made before the upgrade stays on record.
A downgrade re-chains without the key, as Danlu 0008 verifies it.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-20
"""

import datetime as dt

import sqlalchemy as sa
from alembic import op

from danlu.hub.service.store import audit

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

AUDIT = sa.table(
    "audit",
    sa.column("seq", sa.Integer),
    sa.column("at", sa.DateTime),
    sa.column("actor", sa.String),
    sa.column("action", sa.String),
    sa.column("target", sa.String),
    sa.column("before", sa.JSON),
    sa.column("after", sa.JSON),
    sa.column("prev_hash", sa.String),
    sa.column("hash", sa.String),
)
FIELDS = ("seq", "at", "actor", "action", "target", "before", "after")


def _rechain(connection, old_key: bytes, new_key: bytes) -> tuple[int, str]:
    """Re-hash every record with ``new_key``; return (records, what was wrong with the ``old_key`` chain, or "")."""
    problem, prev_old, prev_new, count = "", audit.GENESIS, audit.GENESIS, 0
    rows = connection.execute(
        sa.select(*(AUDIT.c[f] for f in FIELDS), AUDIT.c.prev_hash, AUDIT.c.hash).order_by(AUDIT.c.seq)
    )
    for row in rows.all():
        count += 1
        fields = [row.seq, row.at, row.actor, row.action, row.target, row.before, row.after]
        if not problem:
            if row.seq != count:
                problem = f"record {count} is missing (next is {row.seq})"
            elif row.prev_hash != prev_old:
                problem = f"record {row.seq} does not follow record {row.seq - 1}"
            elif audit._digest(prev_old, *fields, key=old_key) != row.hash:
                problem = f"record {row.seq} was altered"
        prev_old = row.hash
        digest = audit._digest(prev_new, *fields, key=new_key)
        connection.execute(AUDIT.update().where(AUDIT.c.seq == row.seq).values(prev_hash=prev_new, hash=digest))
        prev_new = digest
    return count, problem


def upgrade() -> None:
    connection = op.get_bind()
    if connection.execute(sa.select(sa.func.count()).select_from(AUDIT)).scalar() == 0:
        return
    key = audit.current_key()
    count, problem = _rechain(connection, b"", key)
    last = connection.execute(sa.select(AUDIT.c.seq, AUDIT.c.hash).order_by(AUDIT.c.seq.desc()).limit(1)).first()
    now = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
    at = now.replace(microsecond=now.microsecond // 1000 * 1000)
    record = {
        "seq": last.seq + 1,
        "at": at,
        "actor": "danlu",
        "action": "key_audit_chain",
        "target": "audit",
        "before": {"unkeyed_chain": problem or "whole"},
        "after": {"records": count},
    }
    record["hash"] = audit._digest(last.hash, *(record[f] for f in FIELDS), key=key)
    connection.execute(AUDIT.insert().values(**record, prev_hash=last.hash))


def downgrade() -> None:
    connection = op.get_bind()
    if connection.execute(sa.select(sa.func.count()).select_from(AUDIT)).scalar():
        _rechain(connection, audit.current_key(), b"")
