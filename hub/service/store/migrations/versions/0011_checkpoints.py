"""Checkpoints: a job's last committed checkpoint (``checkpoint``: step, saved_at, attempt, as its runner reported
it) and how many times its owner asked it to save now (``save_requests``).

Both on the job, not the attempt: a checkpoint is kept across attempts and restarts of the service, and a job
resumes from it. Null and 0 for every job that existed before.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("checkpoint", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("save_requests", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("save_requests")
        batch.drop_column("checkpoint")
