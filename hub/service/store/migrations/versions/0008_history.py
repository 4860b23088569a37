"""History at scale: listing indexes in keyset order, the indexes usage windows need, ``usage_rollups``.

The jobs' single-column indexes on ``owner``, ``state``, ``queue`` and
``created_at`` become ``(column, created_at, id)``, and a user's jobs in a
state get ``(owner, state, created_at, id)``: a page of ``GET /jobs``,
filtered or not, is one index range read newest first, whatever its depth,
and the old indexes' lookups are served by the new ones' first column.
Attempts get indexes on their start, their end and (partial) their retries'
start; ``server_usage`` on its start and end. ``usage_rollups`` holds the
hourly and daily sums that usage reports read (:mod:`danlu.hub.service.usage.rollups`
fills it from the existing rows after the upgrade, nothing is lost).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-14
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

LISTING = ("owner", "state", "queue")


def upgrade() -> None:
    for name in (*LISTING, "created_at"):
        op.drop_index(f"ix_jobs_{name}", table_name="jobs")
    op.create_index("ix_jobs_listing", "jobs", ["created_at", "id"])
    for name in LISTING:
        op.create_index(f"ix_jobs_{name}_listing", "jobs", [name, "created_at", "id"])
    op.create_index("ix_jobs_owner_state_listing", "jobs", ["owner", "state", "created_at", "id"])
    op.create_index("ix_attempts_started_at", "attempts", ["started_at"])
    op.create_index("ix_attempts_finished_at", "attempts", ["finished_at", "started_at"])
    op.create_index(
        "ix_attempts_retries",
        "attempts",
        ["started_at"],
        sqlite_where=sa.text("number > 1"),
        postgresql_where=sa.text("number > 1"),
    )
    op.create_index("ix_server_usage_started_at", "server_usage", ["started_at"])
    op.create_index("ix_server_usage_ended_at", "server_usage", ["ended_at", "started_at"])
    op.create_table(
        "usage_rollups",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("span", sa.String(8), nullable=False),
        sa.Column("bucket", sa.DateTime(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("owner", sa.String(255), nullable=False),
        sa.Column("team", sa.String(64), nullable=False),
        sa.Column("profile", sa.String(64), nullable=False),
        sa.Column("flavor", sa.String(64), nullable=False),
        sa.Column("gpu_seconds", sa.Float(), nullable=False),
        sa.Column("util_sum", sa.Float(), nullable=False),
        sa.Column("util_n", sa.Integer(), nullable=False),
        sa.Column("active", sa.Integer(), nullable=True),
        sa.Column("started", sa.Integer(), nullable=False),
        sa.UniqueConstraint("span", "bucket", "kind", "owner", "team", "profile", "flavor"),
    )
    op.create_index("ix_usage_rollups_owner", "usage_rollups", ["owner", "span", "bucket"])


def downgrade() -> None:
    op.drop_index("ix_usage_rollups_owner", table_name="usage_rollups")
    op.drop_table("usage_rollups")
    op.execute("DELETE FROM flags WHERE key = 'usage_rollup'")  # the rollups' watermark goes with them
    op.drop_index("ix_server_usage_ended_at", table_name="server_usage")
    op.drop_index("ix_server_usage_started_at", table_name="server_usage")
    op.drop_index("ix_attempts_retries", table_name="attempts")
    op.drop_index("ix_attempts_finished_at", table_name="attempts")
    op.drop_index("ix_attempts_started_at", table_name="attempts")
    op.drop_index("ix_jobs_owner_state_listing", table_name="jobs")
    for name in LISTING:
        op.drop_index(f"ix_jobs_{name}_listing", table_name="jobs")
    op.drop_index("ix_jobs_listing", table_name="jobs")
    for name in (*LISTING, "created_at"):
        op.create_index(f"ix_jobs_{name}", "jobs", [name])
