"""Model copies: a version's ``digest`` (of the manifest of the files Danlu copied at registration) and the
digest an approval decision approved.

Both nullable: a version registered before copies has none ("not copied"), and so do decisions on it.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("model_versions") as batch:
        batch.add_column(sa.Column("digest", sa.String(80), nullable=True))
    with op.batch_alter_table("model_decisions") as batch:
        batch.add_column(sa.Column("digest", sa.String(80), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("model_decisions") as batch:
        batch.drop_column("digest")
    with op.batch_alter_table("model_versions") as batch:
        batch.drop_column("digest")
