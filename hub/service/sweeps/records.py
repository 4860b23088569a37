"""A sweep's rows: what the loop and the API read and write of ``sweeps`` and ``sweep_trials``, and a sweep
as the API shows it (:func:`view`). Plain functions of a session, run on the database's threads."""

from __future__ import annotations

import json

from sqlalchemy import select

from danlu.hub.service.states import FINAL, JobState
from danlu.hub.service.store import audit
from danlu.hub.service.store.orm import Attempt, Job, Sweep, SweepTrial, isoformat, utcnow
from danlu.hub.service.sweeps.space import Dimension, SweepSpec

ACTIVE = "running"
ENDED = ("complete", "pruned", "failed", "stopped")
FINAL_JOBS = {s.value for s in FINAL}


def spec_of(sweep: Sweep) -> SweepSpec:
    """The checked options a sweep row keeps, as a :class:`SweepSpec` (its job template read apart)."""
    data = sweep.spec
    space = tuple(
        Dimension(d["name"], d["distribution"], d.get("low"), d.get("high"), tuple(d.get("choices") or ()))
        for d in data["space"]
    )
    return SweepSpec(
        space=space,
        metric=data["metric"],
        direction=data["direction"],
        trials=data["trials"],
        parallel=data["parallel"],
        scheduler=data["scheduler"],
        sampler=data["sampler"],
        seed=data.get("seed"),
        min_resource=data.get("min_resource", 1),
        reduction_factor=data.get("reduction_factor", 3),
        name=sweep.name,
    )


def spec_data(spec: SweepSpec, priority: str | None) -> dict:
    return {
        "space": [{"name": d.name, **d.to_dict(), "text": d.text()} for d in spec.space],
        "metric": spec.metric,
        "direction": spec.direction,
        "objective": spec.objective,
        "trials": spec.trials,
        "parallel": spec.parallel,
        "scheduler": spec.scheduler,
        "sampler": spec.sampler,
        "seed": spec.seed,
        "min_resource": spec.min_resource,
        "reduction_factor": spec.reduction_factor,
        "priority": priority,
    }


def insert(s, sweep: Sweep) -> None:
    s.add(sweep)
    s.flush()
    audit.append(s, sweep.owner, "sweep", sweep.id, after={"name": sweep.name, **sweep.spec})


def running_ids(s) -> list[str]:
    return list(s.scalars(select(Sweep.id).where(Sweep.state == ACTIVE).order_by(Sweep.created_at)))


def snapshot(s, sweep_id: str) -> dict | None:
    """A sweep with its trials and their jobs' state, run and attempts, as plain data for the loop."""
    sweep = s.get(Sweep, sweep_id)
    if sweep is None:
        return None
    trials = list(s.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep_id).order_by(SweepTrial.number)))
    jobs = _jobs(s, [t.job_id for t in trials if t.job_id])
    return {
        "id": sweep.id,
        "owner": sweep.owner,
        "name": sweep.name,
        "state": sweep.state,
        "spec": dict(sweep.spec),
        "model": spec_of(sweep),
        "template": sweep.template,
        "study": sweep.study,
        "experiment": sweep.experiment,
        "parent_run_id": sweep.parent_run_id,
        "best": dict(sweep.best or {}),
        "notes": list(sweep.notes or []),
        "trials": [_trial(t, jobs.get(t.job_id)) for t in trials],
    }


def _jobs(s, ids: list[str]) -> dict[str, dict]:
    if not ids:
        return {}
    out = {}
    for job in s.scalars(select(Job).where(Job.id.in_(ids))):
        out[job.id] = {"state": job.state, "reason": job.reason, "run_id": job.mlflow_run_id, "failure": job.failure}
    for job_id, state in s.execute(select(Attempt.job_id, Attempt.state).where(Attempt.job_id.in_(ids))):
        entry = out.get(job_id)
        if entry is not None:
            entry["attempts"] = entry.get("attempts", 0) + 1
            entry["preemptions"] = entry.get("preemptions", 0) + (state == JobState.preempted.value)
    return out


def _trial(t: SweepTrial, job: dict | None) -> dict:
    job = job or {}
    return {
        "number": t.number,
        "job_id": t.job_id,
        "job_state": job.get("state"),
        "job_reason": job.get("reason") or "",
        "run_id": job.get("run_id"),
        "attempts": job.get("attempts", 0),
        "preemptions": job.get("preemptions", 0),
        "state": t.state,
        "params": dict(t.params or {}),
        "value": t.value,
        "step": t.step,
        "rungs": t.rungs,
        "reason": t.reason,
        "tagged": t.tagged,
        "created_at": isoformat(t.created_at),
        "finished_at": isoformat(t.finished_at),
    }


def add_trial(s, sweep_id: str, number: int, params: dict, job_id: str | None, state: str, reason: str = "") -> None:
    s.add(
        SweepTrial(
            sweep_id=sweep_id,
            number=number,
            params=params,
            job_id=job_id,
            state=state,
            reason=reason,
            finished_at=None if state == ACTIVE else utcnow(),
        )
    )


def update_trial(s, sweep_id: str, number: int, changes: dict) -> None:
    trial = s.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep_id, SweepTrial.number == number)).one()
    for key, value in changes.items():
        setattr(trial, key, value)
    if changes.get("state") in ENDED and trial.finished_at is None:
        trial.finished_at = utcnow()


def update_sweep(s, sweep_id: str, changes: dict) -> None:
    sweep = s.get(Sweep, sweep_id)
    for key, value in changes.items():
        setattr(sweep, key, value)


def end_sweep(s, sweep_id: str, state: str, reason: str, actor: str = "danlu") -> bool:
    """The sweep ends (once); False if it had already ended."""
    sweep = s.get(Sweep, sweep_id)
    if sweep is None or sweep.state != ACTIVE:
        return False
    sweep.state, sweep.reason, sweep.finished_at = state, reason, utcnow()
    for trial in s.scalars(select(SweepTrial).where(SweepTrial.sweep_id == sweep_id, SweepTrial.state == ACTIVE)):
        trial.state, trial.reason, trial.finished_at = "stopped", reason, utcnow()
    after = {"state": state, "reason": reason}
    audit.append(s, actor, f"sweep_{state}", sweep_id, before={"state": ACTIVE}, after=after)
    return True


def row(s, sweep_id: str) -> Sweep | None:
    return s.get(Sweep, sweep_id)


def listing(s, owner: str | None, state: str | None, limit: int) -> list[dict]:
    query = select(Sweep).order_by(Sweep.created_at.desc(), Sweep.id.desc()).limit(limit)
    if owner is not None:
        query = query.where(Sweep.owner == owner)
    if state is not None:
        query = query.where(Sweep.state == state)
    sweeps = list(s.scalars(query))
    counts: dict[str, dict[str, int]] = {sw.id: {} for sw in sweeps}
    if sweeps:
        found = s.execute(select(SweepTrial.sweep_id, SweepTrial.state).where(SweepTrial.sweep_id.in_(list(counts))))
        for sweep_id, trial_state in found:
            counts[sweep_id][trial_state] = counts[sweep_id].get(trial_state, 0) + 1
    return [summary(sw, counts[sw.id]) for sw in sweeps]


def summary(sweep: Sweep, counts: dict[str, int]) -> dict:
    spec = sweep.spec
    return {
        "id": sweep.id,
        "name": sweep.name,
        "owner": sweep.owner,
        "state": sweep.state,
        "reason": sweep.reason,
        "created_at": isoformat(sweep.created_at),
        "finished_at": isoformat(sweep.finished_at),
        "objective": {"metric": spec["metric"], "direction": spec["direction"], "text": spec["objective"]},
        "space": [dict(d) for d in spec["space"]],
        "options": {
            k: spec.get(k)
            for k in (
                "trials",
                "parallel",
                "scheduler",
                "sampler",
                "seed",
                "min_resource",
                "reduction_factor",
                "priority",
            )
        },
        "experiment": sweep.experiment,
        "mlflow_run_id": sweep.parent_run_id,
        "counts": {state: counts.get(state, 0) for state in (ACTIVE, *ENDED)},
        "best": dict(sweep.best) if sweep.best else None,
        "notes": list(sweep.notes or []),
    }


def view(s, sweep_id: str) -> dict:
    """``GET /sweeps/{id}``: the summary, every trial, and the best-so-far curve (in the order trials ended)."""
    sweep = s.get(Sweep, sweep_id)
    snap = snapshot(s, sweep_id)
    assert sweep is not None and snap is not None  # the caller found the sweep first
    counts: dict[str, int] = {}
    for t in snap["trials"]:
        counts[t["state"]] = counts.get(t["state"], 0) + 1
    out = summary(sweep, counts)
    trials = [{k: v for k, v in t.items() if k != "tagged"} for t in snap["trials"]]
    out["trials"] = trials
    out["best_curve"] = best_curve(trials, sweep.spec["direction"])
    return out


def best_curve(trials: list[dict], direction: str) -> list[dict]:
    best = None
    curve = []
    done = sorted((t for t in trials if t["state"] == "complete"), key=lambda t: (t["finished_at"] or "", t["number"]))
    for t in done:
        better = best is None or (t["value"] < best if direction == "minimize" else t["value"] > best)
        best = t["value"] if better else best
        curve.append({"trial": t["number"], "finished_at": t["finished_at"], "value": t["value"], "best": best})
    return curve


def template_of(snap: dict) -> dict:
    return json.loads(snap["template"])
