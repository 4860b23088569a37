"""A registered model's records as the API shows them and as MLflow's tags mirror them.

The registry's rows (``models``, ``model_versions``, ``model_decisions``) are the record; these functions turn
them into the API's models (:func:`model_to_dict`, :func:`version_to_dict` with their decisions and aliases,
read for many versions at once by :func:`views_of`) and into the tags a version carries in MLflow
(:func:`mlflow_tags`), which :class:`~.versions.ModelRegistry` re-writes until they match.
"""

from __future__ import annotations

import json

from sqlalchemy import select

from danlu import tags
from danlu.hub.service.store.orm import ModelDecision, ModelRecord, ModelVersionRecord, isoformat


def decision_to_dict(d: ModelDecision) -> dict:
    return {"actor": d.actor, "decision": d.decision, "comment": d.comment, "at": isoformat(d.at),
            "audit_seq": d.audit_seq}


def version_to_dict(v: ModelVersionRecord, decisions: list[ModelDecision], aliases: dict) -> dict:
    return {"name": v.name, "version": v.version, "run_id": v.run_id, "job_id": v.job_id, "source": v.source,
            "registered_by": v.registered_by, "registered_at": isoformat(v.registered_at), "approval": v.approval,
            "evaluation": {"state": v.evaluation, "job_id": v.evaluation_job, "metrics": dict(v.metrics or {}),
                           "thresholds": dict(v.thresholds or {}), "failures": list(v.failures or [])},
            "decisions": [decision_to_dict(d) for d in decisions],
            "aliases": sorted(a for a, n in (aliases or {}).items() if n == v.version)}


def model_to_dict(m: ModelRecord, versions: list[dict], *, every: bool = False) -> dict:
    body = {"name": m.name, "description": m.description, "created_by": m.created_by,
            "created_at": isoformat(m.created_at), "aliases": dict(m.aliases or {}),
            "latest": versions[-1] if versions else None}
    if every:
        body["versions"] = versions
    return body


def mlflow_tags(v: ModelVersionRecord, decided_by: str | None) -> dict:
    """The version's MLflow tags as its row says (the metrics its thresholds name)."""
    metrics = {k: v.metrics[k] for k in sorted(v.thresholds or {}) if k in (v.metrics or {})}
    out = {tags.REGISTERED_BY: v.registered_by, tags.APPROVAL: v.approval, tags.EVALUATION: v.evaluation,
           tags.EVALUATION_JOB: v.evaluation_job or "", tags.EVALUATION_METRICS: json.dumps(metrics)[:5000]}
    if v.approval == "approved" and decided_by:
        out[tags.APPROVED_BY] = decided_by
    return {k: value for k, value in out.items() if value}


def views_of(s, rows: list[ModelVersionRecord]) -> list[dict]:
    """The API models of ``rows`` with their decisions and aliases (one query each)."""
    if not rows:
        return []
    names = {r.name for r in rows}
    aliases = {m.name: m.aliases for m in s.scalars(select(ModelRecord).where(ModelRecord.name.in_(names)))}
    decided: dict[tuple, list] = {}
    for d in s.scalars(select(ModelDecision).where(ModelDecision.name.in_(names)).order_by(ModelDecision.id)):
        decided.setdefault((d.name, d.version), []).append(d)
    return [version_to_dict(r, decided.get((r.name, r.version), []), aliases.get(r.name) or {}) for r in rows]
