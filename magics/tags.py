"""The MLflow tag names Danlu writes, named once.

The job runner tags every run with these; the lab extension's server part
finds a user's runs (``USER``) and a run's job (``JOB_ID``) by them; the
docs list them (docs/user-guide.md, "What lands in MLflow"). The jobs service tags the
model versions it registers (``danlu.hub.service.registry.versions``).
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
ENV_DIGEST = "danlu.env_digest"  # sha256 of the profile's environment lock, or the image digest
SEED = "danlu.seed"  # the seed the job's code set (random, numpy, torch, Lightning), if it set one
# on experiments
OWNER = "danlu.owner"
# on model versions (only the jobs service writes them: users have READ on the models it registers)
REGISTERED_BY = "danlu.registered_by"
APPROVAL = "danlu.approval"
APPROVED_BY = "danlu.approved_by"
EVALUATION = "danlu.evaluation"
EVALUATION_JOB = "danlu.evaluation_job"
EVALUATION_METRICS = "danlu.evaluation_metrics"

# MLflow's own tags that Danlu sets
RUN_NAME = "mlflow.runName"
MLFLOW_USER = "mlflow.user"
SOURCE_TYPE = "mlflow.source.type"
SOURCE_NAME = "mlflow.source.name"
SOURCE_GIT_COMMIT = "mlflow.source.git.commit"
# on a run's dataset inputs: why the run used it (danlu.digests.CONTEXTS)
DATA_CONTEXT = "mlflow.data.context"
