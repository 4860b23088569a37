"""The schema of Danlu 0.1.0, the last release that created its tables without migrations.

A database that 0.1.0 made has these tables and no ``alembic_version``;
:func:`danlu.hub.service.store.schema.upgrade` stamps it with this revision before
upgrading it. Types, nullability, indexes and constraints are exactly what
0.1.0's ``create_all`` made (no server defaults: 0.1.0 set defaults in Python).

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# table -> its indexed columns (0.1.0 named each index ix_<table>_<column>)
INDEXES = {
    "jobs": ["owner", "state", "queue", "created_at"],
    "attempts": ["job_id"],
    "allocations": ["holder_id"],
    "audit": ["at", "action"],
    "server_usage": ["holder"],
    "gpu_samples": ["device", "at"],
}


def column(name: str, *args, nullable: bool = False, **kwargs) -> sa.Column:
    """A column, NOT NULL unless it says otherwise (as 0.1.0's models were)."""
    return sa.Column(name, *args, nullable=nullable, **kwargs)


def upgrade() -> None:
    op.create_table(
        "jobs",
        column("id", sa.String(32), primary_key=True),
        column("owner", sa.String(255)),
        column("name", sa.String(100)),
        column("state", sa.String(20)),
        column("reason", sa.Text()),
        column("profile", sa.String(64)),
        column("queue", sa.String(64)),
        column("priority", sa.Integer()),
        column("priority_class", sa.String(64)),
        column("nproc", sa.Integer()),
        column("gpus", sa.Integer()),
        column("gpu_type", sa.String(64), nullable=True),
        column("cpu", sa.Float()),
        column("memory", sa.Float()),
        column("retries", sa.Integer()),
        column("timeout_seconds", sa.Integer(), nullable=True),
        column("not_before", sa.DateTime(), nullable=True),
        column("queued_at", sa.DateTime(), nullable=True),
        column("failure", sa.String(20)),
        column("parameters", sa.JSON()),
        column("experiment", sa.String(255)),
        column("datasets", sa.JSON()),
        column("source", sa.JSON()),
        column("cwd", sa.Text()),
        column("groups", sa.JSON()),
        column("created_at", sa.DateTime()),
        column("started_at", sa.DateTime(), nullable=True),
        column("finished_at", sa.DateTime(), nullable=True),
        column("mlflow_run_id", sa.String(64), nullable=True),
        column("max_attempts", sa.Integer()),
        column("backend_state", sa.JSON()),
    )
    op.create_table(
        "attempts",
        column("id", sa.Integer(), primary_key=True, autoincrement=True),
        column("job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE")),
        column("number", sa.Integer()),
        column("state", sa.String(20)),
        column("reason", sa.Text()),
        column("devices", sa.JSON()),
        column("flavor", sa.String(64), nullable=True),
        column("failure", sa.String(20)),
        column("exit_code", sa.Integer(), nullable=True),
        column("started_at", sa.DateTime()),
        column("finished_at", sa.DateTime(), nullable=True),
        sa.UniqueConstraint("job_id", "number"),
    )
    op.create_table(
        "allocations",
        column("device", sa.Integer(), primary_key=True, autoincrement=False),
        column("holder_kind", sa.String(16)),
        column("holder_id", sa.String(255)),
        column("owner", sa.String(255)),
        column("flavor", sa.String(64)),
        column("since", sa.DateTime()),
    )
    op.create_table(
        "queue_settings",
        column("name", sa.String(64), primary_key=True),
        column("changes", sa.JSON()),
        column("held", sa.Boolean()),
    )
    op.create_table(
        "flags",
        column("key", sa.String(64), primary_key=True),
        column("value", sa.JSON()),
    )
    op.create_table(
        "audit",
        column("seq", sa.Integer(), primary_key=True, autoincrement=True),
        column("at", sa.DateTime()),
        column("actor", sa.String(255)),
        column("action", sa.String(64)),
        column("target", sa.String(255)),
        column("before", sa.JSON()),
        column("after", sa.JSON()),
        column("prev_hash", sa.String(64)),
        column("hash", sa.String(64)),
    )
    op.create_table(
        "server_usage",
        column("id", sa.Integer(), primary_key=True, autoincrement=True),
        column("holder", sa.String(255)),
        column("owner", sa.String(255)),
        column("team", sa.String(64)),
        column("profile", sa.String(64)),
        column("flavor", sa.String(64), nullable=True),
        column("devices", sa.JSON()),
        column("started_at", sa.DateTime()),
        column("ended_at", sa.DateTime(), nullable=True),
    )
    op.create_table(
        "gpu_samples",
        column("id", sa.Integer(), primary_key=True, autoincrement=True),
        column("device", sa.Integer()),
        column("at", sa.DateTime()),
        column("utilization", sa.Float()),
    )
    for table, columns in INDEXES.items():
        for name in columns:
            op.create_index(f"ix_{table}_{name}", table, [name])


def downgrade() -> None:
    for table in ("gpu_samples", "server_usage", "audit", "flags", "queue_settings", "allocations", "attempts", "jobs"):
        op.drop_table(table)  # its indexes go with it
