"""Sweeps: ``sweeps`` (a sweep's options, its trials' job, its Optuna study and best trial) and
``sweep_trials`` (each trial's number, job, state and objective).

Optuna's own tables are not here: Optuna creates them in its storage (see ``sweeps/engine.py``).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("owner", sa.String(255), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("template", sa.Text(), nullable=False),
        sa.Column("study", sa.String(64), nullable=False),
        sa.Column("experiment", sa.String(255), nullable=False),
        sa.Column("parent_run_id", sa.String(64), nullable=True),
        sa.Column("best", sa.JSON(), nullable=False),
        sa.Column("notes", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
    )
    op.create_index("ix_sweeps_owner", "sweeps", ["owner"])
    op.create_index("ix_sweeps_state", "sweeps", ["state"])
    op.create_table(
        "sweep_trials",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("sweep_id", sa.String(32), sa.ForeignKey("sweeps.id", ondelete="CASCADE"), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(32), nullable=True),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("rungs", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("tagged", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.UniqueConstraint("sweep_id", "number"),
    )
    op.create_index("ix_sweep_trials_sweep_id", "sweep_trials", ["sweep_id"])
    op.create_index("ix_sweep_trials_job_id", "sweep_trials", ["job_id"])


def downgrade() -> None:
    op.drop_index("ix_sweep_trials_job_id", table_name="sweep_trials")
    op.drop_index("ix_sweep_trials_sweep_id", table_name="sweep_trials")
    op.drop_table("sweep_trials")
    op.drop_index("ix_sweeps_state", table_name="sweeps")
    op.drop_index("ix_sweeps_owner", table_name="sweeps")
    op.drop_table("sweeps")
