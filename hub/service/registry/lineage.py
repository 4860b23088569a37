"""Lineage: what made a model version, as a graph the API, the CLI and the sidebar share.

``GET /api/v1/lineage/models/{name}/{version}`` answers the chain a reviewer walks: the version, the MLflow
run that produced it, the Danlu job that ran it, the notebook and cell it executed, the dataset versions it
read (with their digests and contexts), the environment it ran in, its evaluation and every approval
decision. Everything comes from the service's own records -- the model registry's rows, the job's
provenance (written by the service at submission), the dataset uses of the catalog and the audit-backed
decisions -- never from the job's folder or the run's own tags, which the job could have written.

The answer is ``{"model", "nodes", "edges"}``. A node is ``{"id", "kind", "label", "detail", "url"}``; an
edge ``{"from", "to", "relation"}`` points from the derived thing to what it came from (a model version to
its run, a job to a dataset version). A caller sees the chain only as far as they may read it: the job of a
version whose run belongs to someone else is a node that says so, and nothing behind it is shown.
"""

from __future__ import annotations

from sqlalchemy import select

from danlu.hub.service.datasets.catalog import uses_of_job
from danlu.hub.service.jobs.provenance import provenance_of
from danlu.hub.service.registry.versions import ModelRegistry
from danlu.hub.service.store.database import Database
from danlu.hub.service.store.orm import Job

#: the order the sidebar lays the kinds out in, inputs first (the TypeScript reads the same list)
KINDS = ("dataset_version", "environment", "notebook", "cell", "job", "run", "evaluation", "model_version", "approval")


class Graph:
    def __init__(self):
        self.nodes: dict[str, dict] = {}
        self.edges: list[dict] = []

    def node(self, kind: str, key: str, label: str, detail: dict | None = None, url: str | None = None) -> str:
        node_id = f"{kind}:{key}"
        if node_id not in self.nodes:
            self.nodes[node_id] = {
                "id": node_id,
                "kind": kind,
                "label": label,
                "detail": {k: v for k, v in (detail or {}).items() if v is not None},
                "url": url,
            }
        return node_id

    def edge(self, source: str, target: str, relation: str) -> None:
        edge = {"from": source, "to": target, "relation": relation}
        if edge not in self.edges:
            self.edges.append(edge)

    def to_dict(self, model: dict) -> dict:
        order = {kind: i for i, kind in enumerate(KINDS)}
        nodes = sorted(self.nodes.values(), key=lambda n: (order.get(n["kind"], len(KINDS)), n["id"]))
        return {"model": model, "nodes": nodes, "edges": self.edges}


def _short(digest: str | None) -> str:
    return (digest or "")[:12]


async def model_lineage(
    models: ModelRegistry, database: Database, public_url: str, principal, name: str, version: int
) -> dict:
    """The lineage graph of a model version the caller may read (404 as the registry answers otherwise)."""
    mlflow_ui = f"{public_url}/services/mlflow/#"
    mv = await models.version_view(principal, name, version)
    graph = Graph()
    model = graph.node(
        "model_version",
        f"{name}/{version}",
        f"{name} v{version}",
        {
            "approval": mv.get("approval"),
            "aliases": ", ".join(mv.get("aliases") or []) or None,
            "source": mv.get("source"),
            "files": mv.get("digest") or "not copied (registered before Danlu copied models)",
            "registered_by": mv.get("registered_by"),
            "registered_at": mv.get("registered_at"),
        },
        url=f"{mlflow_ui}/models/{name}/versions/{version}",
    )
    for decision in mv.get("decisions") or []:
        seq = decision.get("audit_seq")
        approval = graph.node(
            "approval",
            str(seq if seq is not None else len(graph.nodes)),
            f"{decision['decision']} by {decision['actor']}",
            {
                "comment": decision.get("comment"),
                "at": decision.get("at"),
                "audit_seq": seq,
                "files": decision.get("digest"),
            },
        )
        graph.edge(approval, model, "decided")
    evaluation = mv.get("evaluation") or {}
    if evaluation.get("job_id"):
        metrics = evaluation.get("metrics") or {}
        node = graph.node(
            "evaluation",
            evaluation["job_id"],
            f"evaluation {evaluation.get('state')}",
            {
                "job_id": evaluation["job_id"],
                "state": evaluation.get("state"),
                **{f"metric {k}": v for k, v in list(metrics.items())[:20]},
                "failures": "; ".join(evaluation.get("failures") or []) or None,
            },
        )
        graph.edge(model, node, "evaluated_by")

    run_id = mv.get("run_id")
    job_id = mv.get("job_id")

    def find(s):
        job = s.get(Job, job_id) if job_id else None
        if job is None and run_id:
            job = s.scalars(select(Job).where(Job.mlflow_run_id == run_id).limit(1)).first()
        if job is None:
            return None, []
        return job, (uses_of_job(s, job.id) if principal.can_read(job.owner) else [])

    job, inputs = await database.read(find)
    run = None
    if run_id:
        experiment = (
            (job.tracking or {}).get("experiment_id") if job is not None and isinstance(job.tracking, dict) else None
        )
        run = graph.node(
            "run",
            run_id,
            f"run {run_id[:8]}",
            {"run_id": run_id, "experiment_id": experiment},
            url=f"{mlflow_ui}/experiments/{experiment}/runs/{run_id}" if experiment else None,
        )
        graph.edge(model, run, "produced_by")
    if job is None:
        return graph.to_dict(_model(name, version, mv))
    if not principal.can_read(job.owner):
        hidden = graph.node(
            "job",
            job.id,
            f"job {job.id} of {job.owner}",
            {"note": "not yours to see: ask its owner or an admin for the rest of the chain"},
        )
        graph.edge(run or model, hidden, "ran_as")
        return graph.to_dict(_model(name, version, mv))

    node = graph.node(
        "job",
        job.id,
        job.name or f"job {job.id}",
        {
            "state": job.state,
            "owner": job.owner,
            "profile": job.profile,
            "queue": job.queue,
            "created_at": job.created_at.isoformat() if job.created_at else None,
        },
        url=f"{public_url}/services/danlu/api/v1/jobs/{job.id}",
    )
    graph.edge(run or model, node, "ran_as")
    prov = provenance_of(job)
    source = job.source if isinstance(job.source, dict) else {}
    notebook_path = prov.get("notebook_path") or source.get("notebook_path")
    if notebook_path:
        notebook = graph.node(
            "notebook",
            f"{job.id}",
            str(notebook_path),
            {
                "git_commit": (prov.get("git") or {}).get("commit"),
                "git_dirty": (prov.get("git") or {}).get("dirty"),
                "setup_cells": len(prov.get("setup_cells") or []) or None,
            },
        )
        graph.edge(node, notebook, "executed")
    cell_sha = prov.get("cell_sha256") or source.get("cell_sha256")
    if cell_sha:
        cell = graph.node(
            "cell",
            cell_sha,
            f"cell {_short(cell_sha)}",
            {
                "cell_id": source.get("cell_id"),
                "sha256": cell_sha,
                "seed": prov.get("seed"),
                "parameters": ", ".join(
                    f"{k}={v}" for k, v in list((prov.get("parameters") or job.parameters or {}).items())[:20]
                )
                or None,
            },
        )
        graph.edge(node, cell, "ran_cell")
    for use in inputs:
        ref = use.get("ref") or f"{use.get('dataset')}@{use.get('version')}"
        ds = graph.node("dataset_version", ref, ref, {"digest": use.get("digest"), "context": use.get("context")})
        graph.edge(node, ds, f"used ({use.get('context') or 'training'})")
    for ds in prov.get("datasets") or []:  # plain paths: pinned by digest, not in the catalog
        ref = ds.get("ref") or ds.get("name")
        if ref and not any(n["id"] == f"dataset_version:{ref}" for n in graph.nodes.values()):
            node_ds = graph.node(
                "dataset_version", ref, ref, {"digest": ds.get("digest"), "context": ds.get("context")}
            )
            graph.edge(node, node_ds, f"used ({ds.get('context') or 'training'})")
    environment = prov.get("environment") or {}
    if environment.get("digest") or prov.get("profile"):
        envnode = graph.node(
            "environment",
            environment.get("digest") or prov.get("profile"),
            f"{prov.get('profile') or job.profile} ({environment.get('kind') or 'environment'})",
            {
                "profile": prov.get("profile") or job.profile,
                "kind": environment.get("kind"),
                "digest": environment.get("digest"),
                "ref": environment.get("ref"),
            },
        )
        graph.edge(node, envnode, "ran_in")
    return graph.to_dict(_model(name, version, mv))


def _model(name: str, version: int, mv: dict) -> dict:
    return {
        "name": name,
        "version": version,
        "approval": mv.get("approval"),
        "aliases": list(mv.get("aliases") or []),
        "run_id": mv.get("run_id"),
        "job_id": mv.get("job_id"),
    }
