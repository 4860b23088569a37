"""Usage rollups keep the GPU-seconds the held devices were busy (``busy_seconds``): each held device's seconds
times its NVML utilization while held, where it was sampled, for ``danlu usage``'s ``gpu_hours_busy``.

Rows rolled up before have the sums it is made from only for the whole row: they get ``gpu_seconds`` times the
row's mean utilization (0 where nothing was sampled), close to what the new rows hold.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("usage_rollups") as batch:
        batch.add_column(sa.Column("busy_seconds", sa.Float(), nullable=False, server_default="0"))
    op.execute(
        "UPDATE usage_rollups SET busy_seconds = ROUND(gpu_seconds * util_sum / util_n / 100.0) WHERE util_n > 0"
    )


def downgrade() -> None:
    with op.batch_alter_table("usage_rollups") as batch:
        batch.drop_column("busy_seconds")
