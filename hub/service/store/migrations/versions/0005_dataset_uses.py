"""Which jobs used which dataset versions: ``dataset_uses`` (job, attempt, version, digest, context).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-08
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dataset_uses",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("dataset", sa.String(64), sa.ForeignKey("datasets.name", ondelete="CASCADE"), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("context", sa.String(20), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.UniqueConstraint("job_id", "dataset", "version", "context"),
    )
    op.create_index("ix_dataset_uses_job_id", "dataset_uses", ["job_id"])
    op.create_index("ix_dataset_uses_version", "dataset_uses", ["dataset", "version"])


def downgrade() -> None:
    op.drop_index("ix_dataset_uses_version", table_name="dataset_uses")
    op.drop_index("ix_dataset_uses_job_id", table_name="dataset_uses")
    op.drop_table("dataset_uses")
