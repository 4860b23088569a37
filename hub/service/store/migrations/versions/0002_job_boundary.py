"""The job's boundary: its notebook kept by the service, its reports and stop requests in rows.

Adds ``jobs.cell_sha256`` and ``jobs.tracking``, the attempt's ``token_hash``,
``stop_reason``, ``stop_grace`` and ``report``, and the ``job_inputs`` table.
The new NOT NULL columns get server defaults, so the rows an older Danlu wrote
get values (the models set the same defaults in Python). A job that was
waiting or running during the upgrade has no ``job_inputs`` row yet:
:func:`danlu.hub.service.store.schema.import_legacy_inputs` carries its notebook over.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain-string server defaults: SQLite adds such a column in place, without recreating the table
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("cell_sha256", sa.String(64), nullable=False, server_default=""))
        batch.add_column(sa.Column("tracking", sa.JSON(), nullable=False, server_default="{}"))
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("token_hash", sa.String(64), nullable=False, server_default=""))
        batch.add_column(sa.Column("stop_reason", sa.String(20), nullable=False, server_default=""))
        batch.add_column(sa.Column("stop_grace", sa.Float(), nullable=True))
        batch.add_column(sa.Column("report", sa.JSON(), nullable=False, server_default="{}"))
    op.create_table(
        "job_inputs",
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("notebook", sa.Text(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("job_inputs")
    with op.batch_alter_table("attempts") as batch:
        for name in ("report", "stop_grace", "stop_reason", "token_hash"):
            batch.drop_column(name)
    with op.batch_alter_table("jobs") as batch:
        for name in ("tracking", "cell_sha256"):
            batch.drop_column(name)
