"""A job's provenance: ``jobs.provenance`` (what reproducing it needs) and ``jobs.reproduces``.

``provenance`` is a JSON object the service writes at submission (profile, environment digest,
parameters, setup cells, the cell's sha256, git, datasets; see
:mod:`danlu.hub.service.jobs.provenance`); rows an older Danlu wrote get ``{}``, which reads as "nothing
recorded". ``reproduces`` names the job a reproduction re-runs.

Revision ID: 0006
Revises: 0004
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("provenance", sa.JSON(), nullable=False, server_default="{}"))
        batch.add_column(sa.Column("reproduces", sa.String(32), nullable=True))
    op.create_index("ix_jobs_reproduces", "jobs", ["reproduces"])


def downgrade() -> None:
    op.drop_index("ix_jobs_reproduces", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("reproduces")
        batch.drop_column("provenance")
