"""The model registry's governance: ``models``, ``model_versions`` (evaluation, approval) and ``model_decisions``.

Revision ID: 0007
Revises: 0004
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("aliases", sa.JSON(), nullable=False),
        sa.Column("created_by", sa.String(255), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
    )
    op.create_table(
        "model_versions",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(128), sa.ForeignKey("models.name", ondelete="CASCADE"), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(32), nullable=True),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("model_id", sa.String(64), nullable=True),
        sa.Column("registered_by", sa.String(255), nullable=False),
        sa.Column("registered_at", sa.DateTime(), nullable=False),
        sa.Column("approval", sa.String(20), nullable=False),
        sa.Column("evaluation", sa.String(20), nullable=False),
        sa.Column("evaluation_job", sa.String(32), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("thresholds", sa.JSON(), nullable=False),
        sa.Column("failures", sa.JSON(), nullable=False),
        sa.Column("synced", sa.Boolean(), nullable=False),
        sa.UniqueConstraint("name", "version"),
    )
    op.create_index("ix_model_versions_name", "model_versions", ["name"])
    op.create_index("ix_model_versions_run_id", "model_versions", ["run_id"])
    op.create_index("ix_model_versions_job_id", "model_versions", ["job_id"])
    op.create_table(
        "model_decisions",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("decision", sa.String(20), nullable=False),
        sa.Column("comment", sa.Text(), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("audit_seq", sa.Integer(), nullable=False),
    )
    op.create_index("ix_model_decisions_name", "model_decisions", ["name"])


def downgrade() -> None:
    op.drop_index("ix_model_decisions_name", table_name="model_decisions")
    op.drop_table("model_decisions")
    op.drop_index("ix_model_versions_job_id", table_name="model_versions")
    op.drop_index("ix_model_versions_run_id", table_name="model_versions")
    op.drop_index("ix_model_versions_name", table_name="model_versions")
    op.drop_table("model_versions")
    op.drop_table("models")
