"""A registered model's records: read and written in the database's transactions, shown by the API, mirrored
in MLflow's tags.

The registry's rows (``models``, ``model_versions``, ``model_decisions``) are the record, changed only by the
functions at the end of this module, each with its audit record in the same transaction; these turn them
into the API's models (:func:`model_to_dict`, :func:`version_to_dict` with their decisions and aliases,
read for many versions at once by :func:`views_of`) and into the tags a version carries in MLflow
(:func:`mlflow_tags`), which :class:`~.versions.ModelRegistry` re-writes until they match.
"""

from __future__ import annotations

import json

from sqlalchemy import select

from danlu import tags
from danlu.errors import Conflict, NotFound
from danlu.hub.service.registry import evaluations
from danlu.hub.service.store import audit
from danlu.hub.service.store.orm import ModelDecision, ModelRecord, ModelVersionRecord, isoformat, utcnow

#: the evaluation states an approval waits for, and the reason of the refusal in each
GATE_REFUSAL = {
    "queued": "evaluation_pending",
    "running": "evaluation_pending",
    "failed": "evaluation_failed",
    "error": "evaluation_error",
}


def decision_to_dict(d: ModelDecision) -> dict:
    return {
        "actor": d.actor,
        "decision": d.decision,
        "comment": d.comment,
        "at": isoformat(d.at),
        "audit_seq": d.audit_seq,
        "digest": d.digest,
    }


def version_to_dict(v: ModelVersionRecord, decisions: list[ModelDecision], aliases: dict) -> dict:
    return {
        "name": v.name,
        "version": v.version,
        "run_id": v.run_id,
        "job_id": v.job_id,
        "source": v.source,
        "digest": v.digest,  # of the stored copy's manifest; None: registered before copies ("not copied")
        "registered_by": v.registered_by,
        "registered_at": isoformat(v.registered_at),
        "approval": v.approval,
        "evaluation": {
            "state": v.evaluation,
            "job_id": v.evaluation_job,
            "metrics": dict(v.metrics or {}),
            "thresholds": dict(v.thresholds or {}),
            "failures": list(v.failures or []),
        },
        "decisions": [decision_to_dict(d) for d in decisions],
        "aliases": sorted(a for a, n in (aliases or {}).items() if n == v.version),
    }


def model_to_dict(m: ModelRecord, versions: list[dict], *, every: bool = False) -> dict:
    body = {
        "name": m.name,
        "description": m.description,
        "created_by": m.created_by,
        "created_at": isoformat(m.created_at),
        "aliases": dict(m.aliases or {}),
        "latest": versions[-1] if versions else None,
    }
    if every:
        body["versions"] = versions
    return body


def mlflow_tags(v: ModelVersionRecord, decided_by: str | None) -> dict:
    """The version's MLflow tags as its row says (the metrics its thresholds name)."""
    metrics = {k: v.metrics[k] for k in sorted(v.thresholds or {}) if k in (v.metrics or {})}
    out = {
        tags.REGISTERED_BY: v.registered_by,
        tags.APPROVAL: v.approval,
        tags.EVALUATION: v.evaluation,
        tags.EVALUATION_JOB: v.evaluation_job or "",
        tags.EVALUATION_METRICS: json.dumps(metrics)[:5000],
    }
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


# in the database's transactions ------------------------------------------------------------------------
def version_row(s, name: str, version: int) -> ModelVersionRecord | None:
    return s.scalars(
        select(ModelVersionRecord).where(ModelVersionRecord.name == name, ModelVersionRecord.version == version)
    ).first()


def insert_model(s, name: str, description: str, who: str) -> None:
    if s.get(ModelRecord, name) is None:
        s.add(ModelRecord(name=name, description=description, aliases={}, created_by=who, created_at=utcnow()))
        audit.append(s, who, "create_model", name, after={"description": description[:1000]})


def insert_version(s, row: ModelVersionRecord) -> None:
    s.add(row)
    s.flush()
    audit.append(
        s,
        row.registered_by,
        "register_model",
        f"{row.name}@{row.version}",
        after={
            "run_id": row.run_id,
            "job_id": row.job_id,
            "source": row.source,
            "digest": row.digest,
            "evaluation": row.evaluation,
        },
    )


def set_evaluation_job(s, row_id: int, job_id: str) -> None:
    row = s.get(ModelVersionRecord, row_id)
    row.evaluation_job, row.synced = job_id, False


def settle(s, row_id: int, state: str, metrics: dict, failures: list, job_id: str | None) -> None:
    row = s.get(ModelVersionRecord, row_id)
    if row is None or row.evaluation not in evaluations.WAITING or row.evaluation == state:
        return  # another settle was first
    before = row.evaluation
    row.evaluation, row.metrics, row.failures, row.synced = state, metrics, failures, False
    if state not in evaluations.WAITING:
        audit.append(
            s,
            "danlu",
            "evaluate_model",
            f"{row.name}@{row.version}",
            before={"evaluation": before},
            after={
                "evaluation": state,
                "job_id": job_id or row.evaluation_job,
                "failures": failures[:20],
                "metrics": {k: metrics[k] for k in sorted(row.thresholds or {}) if k in metrics},
            },
        )


def orphaned(s) -> None:
    q = select(ModelVersionRecord).where(
        ModelVersionRecord.evaluation.in_(evaluations.WAITING), ModelVersionRecord.evaluation_job.is_(None)
    )
    for row in s.scalars(q):
        settle(s, row.id, "error", {}, ["the service stopped before it submitted the evaluation job"], None)


def decide(s, name: str, version: int, who: str, decision: str, comment: str, digest: str | None) -> None:
    """Record a decision on the version whose stored copy has ``digest`` (verified just before; the row's)."""
    row = version_row(s, name, version)
    if row is not None and row.digest != digest:
        raise Conflict(f"{name} version {version}'s copy changed while it was decided on", reason="copy_changed")
    if row is None:  # looked up before this transaction; versions are never deleted, so this is a bug's 404
        raise NotFound(f"model {name} has no version {version}", reason="no_such_version", field="version")
    if row.approval != "pending":
        raise Conflict(
            f"{name} version {version} was already {row.approval}",
            reason="already_decided",
            fix="register a new version to decide again",
        )
    if decision == "approve" and row.evaluation in GATE_REFUSAL:
        state = row.evaluation
        why = f": {'; '.join(row.failures[:5])}" if row.failures else ""
        raise Conflict(
            f"{name} version {version} cannot be approved: its evaluation is {state}{why}",
            reason=GATE_REFUSAL[state],
            fix="wait for the evaluation job to end"
            if state in evaluations.WAITING
            else "reject it, and register a version that passes the evaluation",
        )
    new = "approved" if decision == "approve" else "rejected"
    record = audit.append(
        s,
        who,
        f"{decision}_model",
        f"{name}@{version}",
        before={"approval": row.approval},
        after={"approval": new, "comment": comment, "digest": digest},
    )
    row.approval, row.synced = new, False
    s.add(
        ModelDecision(
            name=name,
            version=version,
            actor=who,
            decision=decision,
            comment=comment,
            at=record.at,
            audit_seq=record.seq,
            digest=digest,
        )
    )


def alias(s, name: str, alias: str, version: int | None, who: str) -> int | None:
    """Record an alias moved to ``version`` (None: deleted); answer the version it named before."""
    model = s.get(ModelRecord, name)
    aliases = dict(model.aliases or {})
    before = aliases.get(alias)
    if version is None:
        aliases.pop(alias, None)
        audit.append(
            s, who, "delete_model_alias", f"{name}@{before}", before={"alias": alias, "version": before}, after={}
        )
    else:
        aliases[alias] = version
        audit.append(
            s,
            who,
            "set_model_alias",
            f"{name}@{version}",
            before={"alias": alias, "version": before},
            after={"alias": alias, "version": version},
        )
    model.aliases = aliases
    return before


def unsynced(s) -> list[tuple[ModelVersionRecord, str | None]]:
    rows = list(s.scalars(select(ModelVersionRecord).where(ModelVersionRecord.synced.is_(False)).limit(100)))
    out = []
    for row in rows:
        approved = s.scalars(
            select(ModelDecision.actor).where(
                ModelDecision.name == row.name,
                ModelDecision.version == row.version,
                ModelDecision.decision == "approve",
            )
        ).first()
        out.append((row, approved))
    return out


def mark_synced(s, row_id: int, approval: str, evaluation: str) -> None:
    row = s.get(ModelVersionRecord, row_id)
    if row is not None and (row.approval, row.evaluation) == (approval, evaluation):
        row.synced = True
