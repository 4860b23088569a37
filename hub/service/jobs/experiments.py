"""A user's experiments, as Danlu's own records know them: which MLflow experiments hold their jobs' runs.

The sidebar's Experiments view lists the experiments that hold the caller's runs, with a count.
Asking MLflow for that (search every experiment, then every run by the ``danlu.user`` tag) costs
MLflow a permission check per experiment and per run on each request, which does not survive 200
users polling (benchmarks/load.py). Every run with that tag is a job's run, and each job's row
says its experiment and, from its runner's report, the experiment's MLflow id, so the jobs
database answers the same question with one indexed query. The runs themselves (parameters,
metrics) still come from MLflow when the user opens an experiment.
"""

from __future__ import annotations

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from danlu.hub.service.formats import EXPERIMENT_ID
from danlu.hub.service.store.orm import Job


def _ranked():
    """Each experiment's runs counted, its latest start, and its latest job's tracking (whose report names the
    experiment's id), ranked within the experiment."""
    by_experiment = {"partition_by": Job.experiment}
    ranked = (
        select(
            Job.experiment,
            Job.tracking,
            func.count().over(**by_experiment).label("runs"),
            func.max(Job.created_at).over(**by_experiment).label("latest"),
            func.row_number().over(**by_experiment, order_by=(Job.created_at.desc(), Job.id.desc())).label("rank"),
        )
        .where(Job.owner == bindparam("owner", type_=Job.owner.type), Job.mlflow_run_id.is_not(None))
        .subquery()
    )
    return select(ranked.c.experiment, ranked.c.tracking, ranked.c.runs, ranked.c.latest).where(ranked.c.rank == 1)


# built once: SQLAlchemy then finds its compiled form by the statement itself
_LATEST = _ranked()


def experiments_of(session: Session, owner: str) -> list[dict]:
    """The MLflow experiments holding ``owner``'s job runs: id, name, runs and the latest run's start, by name.

    One select (Core rows, no ORM objects) for what took one per experiment.
    """
    out = []
    for name, tracking, runs, latest in session.connection().execute(_LATEST, {"owner": owner}).all():
        experiment_id = tracking.get("experiment_id") if isinstance(tracking, dict) else None
        out.append(
            {
                "experiment_id": experiment_id
                if isinstance(experiment_id, str) and EXPERIMENT_ID.match(experiment_id)
                else None,
                "name": name,
                "runs": runs,
                "latest": latest.isoformat() + "Z" if latest else None,
            }
        )
    return sorted(out, key=lambda e: e["name"])
