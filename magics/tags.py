"""The MLflow tag names Danlu writes, named once.

The job runner tags every run with these; the lab extension's server part
finds a user's runs (``USER``) and a run's job (``JOB_ID``) by them; the
docs list them (docs/user-guide.md, "What lands in MLflow").
"""

from __future__ import annotations

# on runs
JOB_ID = "danlu.job_id"
USER = "danlu.user"
PROFILE = "danlu.profile"
QUEUE = "danlu.queue"
NOTEBOOK_PATH = "danlu.notebook_path"
CELL_ID = "danlu.cell_id"
CELL_SHA256 = "danlu.cell_sha256"
INCLUDED_CELLS = "danlu.included_cells"
GIT_COMMIT = "danlu.git_commit"
ATTEMPT = "danlu.attempt"
# on experiments
OWNER = "danlu.owner"

# MLflow's own tags that Danlu sets
RUN_NAME = "mlflow.runName"
MLFLOW_USER = "mlflow.user"
SOURCE_TYPE = "mlflow.source.type"
SOURCE_NAME = "mlflow.source.name"
SOURCE_GIT_COMMIT = "mlflow.source.git.commit"
