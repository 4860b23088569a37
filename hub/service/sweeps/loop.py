"""One step of a running sweep (:func:`advance`): follow its trials, then submit the next ones.

For each trial whose job has not been followed to its end: its MLflow run becomes a child of the sweep's
parent run; the objective's new points (``step -> value``, from the history the job's auto-logging
recorded) are reported to Optuna; a trial Optuna prunes is told so and its job cancelled at once. A trial
whose job ended is told its end: ``complete`` with the objective's last value, or ``failed`` -- its job
failed in the user's code, timed out, was cancelled, or never logged the objective (a job the
infrastructure failed or preempted is retried by the job machinery first, with the same parameters, and
stays one trial). Then the best trial goes on the parent run; a sweep whose first trials all failed ends,
saying why; new trials are asked of Optuna and submitted while fewer than ``parallel`` are under way (the
team's quota queues them beyond); a sweep with every trial ended has succeeded.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

from danlu.errors import DanluError
from danlu.hub.service.sweeps import records, tracking
from danlu.hub.service.sweeps.records import ACTIVE, FINAL_JOBS

if TYPE_CHECKING:
    from danlu.hub.service.sweeps.sweeps import Sweeps

#: a sweep whose first this-many ended trials all failed is stopped: the cell, not the search, is wrong
FIRST_FAILURES = 3


async def advance(sweeps: Sweeps, sweep_id: str) -> None:
    db = sweeps.database
    snap = await db.read(records.snapshot, sweep_id)
    if snap is None or snap["state"] != ACTIVE:
        return
    for trial in snap["trials"]:
        if trial["state"] == ACTIVE:
            await _follow(sweeps, snap, trial)
    snap = await db.read(records.snapshot, sweep_id)
    await _best(sweeps, snap)
    hopeless = _hopeless(snap)
    if hopeless:
        await sweeps.end(snap, "failed", hopeless)
        return
    await _submit(sweeps, snap)


async def _follow(sweeps: Sweeps, snap: dict, trial: dict) -> None:
    db, engine, spec = sweeps.database, sweeps.engine, snap["model"]
    sweep_id, number, job_state = snap["id"], trial["number"], trial["job_state"]
    if job_state is None:
        await engine.call(engine.tell, snap["study"], spec, number, "failed")
        await db.write(records.update_trial, sweep_id, number, {"state": "failed", "reason": "its job is gone"})
        return
    if sweeps.mlflow is not None and trial["run_id"] and not trial["tagged"] and snap["parent_run_id"]:
        try:
            await tracking.adopt(sweeps.mlflow, trial["run_id"], snap["parent_run_id"], sweep_id, number)
            await db.write(records.update_trial, sweep_id, number, {"tagged": True})
        except DanluError as e:
            sweeps.log.warning("sweep %s: trial %d's run is not a child yet: %s", sweep_id, number, e)
    if sweeps.source is None:  # no MLflow: refused when the sweep was made (no_mlflow)
        return
    try:
        points = await sweeps.source.history(trial, spec.metric)
    except DanluError as e:
        sweeps.log.warning("sweep %s: the objective of trial %d was not read: %s", sweep_id, number, e)
        return  # the next tick reads it again, before the trial's end is told
    final = job_state in FINAL_JOBS
    new = [(s, v) for s, v in points if trial["step"] is None or s > trial["step"]]
    if new:
        prune, rungs = await engine.call(engine.report, snap["study"], spec, number, new)
        step, value = new[-1]
        changes = {"step": step, "value": value if math.isfinite(value) else None, "rungs": rungs}
        if prune and not final:
            await engine.call(engine.tell, snap["study"], spec, number, "pruned")
            reason = f"pruned at step {step}: {spec.metric} {value:.6g} is not in the best 1/{spec.reduction_factor}"
            await db.write(records.update_trial, sweep_id, number, {"state": "pruned", "reason": reason, **changes})
            await sweeps.cancel_job(_sweep_principal(snap), trial["job_id"])
            return
        await db.write(records.update_trial, sweep_id, number, changes)
    if not final:
        return
    if job_state == "succeeded" and points:
        value = points[-1][1]
        if math.isfinite(value):
            rungs = await engine.call(engine.tell, snap["study"], spec, number, "complete", value)
            changes = {"state": "complete", "value": value, "rungs": rungs}
            await db.write(records.update_trial, sweep_id, number, changes)
            return
        reason = f"its objective {spec.metric} ended {value}"
    elif job_state == "succeeded":
        reason = f"its job succeeded but never logged the objective {spec.metric}"
    else:
        reason = f"its job {job_state}: {trial['job_reason'] or 'see its log'}"
    await engine.call(engine.tell, snap["study"], spec, number, "failed")
    await db.write(records.update_trial, sweep_id, number, {"state": "failed", "reason": reason})


def _sweep_principal(snap: dict):
    from danlu.hub.service.sweeps.sweeps import sweep_principal  # cycle: sweeps.py imports this module

    return sweep_principal(snap["id"], snap["owner"])


async def _best(sweeps: Sweeps, snap: dict) -> None:
    spec = snap["model"]
    done = [t for t in snap["trials"] if t["state"] == "complete" and t["value"] is not None]
    if not done:
        return
    if spec.direction == "minimize":
        best = min(done, key=lambda t: (t["value"], t["number"]))
    else:
        best = max(done, key=lambda t: (t["value"], -t["number"]))
    if snap["best"].get("number") == best["number"]:
        return
    found = {"number": best["number"], "job_id": best["job_id"], "value": best["value"], "params": best["params"]}
    await sweeps.database.write(records.update_sweep, snap["id"], {"best": found})
    snap["best"] = found
    if sweeps.mlflow is not None and snap["parent_run_id"]:
        ended = sum(1 for t in snap["trials"] if t["state"] != ACTIVE)
        try:
            await tracking.log_best(sweeps.mlflow, snap["parent_run_id"], spec.metric, found, ended)
        except DanluError as e:
            sweeps.log.warning("sweep %s: the best trial was not logged on its parent run: %s", snap["id"], e)
            await sweeps.database.write(records.update_sweep, snap["id"], {"best": {**found, "logged": False}})


def _hopeless(snap: dict) -> str | None:
    """Why the sweep should stop now that its first trials ended, or None."""
    ended = sorted(
        (t for t in snap["trials"] if t["state"] in ("complete", "pruned", "failed")),
        key=lambda t: (t["finished_at"] or "", t["number"]),
    )[:FIRST_FAILURES]
    if len(ended) < FIRST_FAILURES or any(t["state"] != "failed" for t in ended):
        return None
    metric = snap["model"].metric
    if all("never logged the objective" in t["reason"] for t in ended):
        return (
            f"the first {FIRST_FAILURES} trials succeeded but never logged the objective {metric}: "
            f"log it from the cell (e.g. SummaryWriter.add_scalar('{metric}', value, step)) or fix --objective"
        )
    reasons = "; ".join(f"trial {t['number']}: {t['reason'][:200]}" for t in ended)
    return f"the first {FIRST_FAILURES} trials all failed, so the sweep stopped ({reasons})"


async def _submit(sweeps: Sweeps, snap: dict) -> None:
    from danlu.hub.service.sweeps.sweeps import owner_principal  # cycle: sweeps.py imports this module

    db, engine, spec = sweeps.database, sweeps.engine, snap["model"]
    template = json.loads(snap["template"])
    active = sum(1 for t in snap["trials"] if t["state"] == ACTIVE)
    asked = len(snap["trials"])
    while active < spec.parallel and asked < spec.trials:
        number, params = await engine.call(engine.ask, snap["study"], spec)
        body = {
            **template,
            "parameters": {**template.get("parameters", {}), **params},
            "name": f"{snap['name'][:90]}-t{number}",
        }
        try:
            _status, answer = await sweeps.submission.submit(owner_principal(snap["owner"]), body)
        except DanluError as e:
            await engine.call(engine.tell, snap["study"], spec, number, "failed")
            await db.write(records.add_trial, snap["id"], number, params, None, "failed", f"not submitted: {e}")
            again = await db.read(records.snapshot, snap["id"])
            await sweeps.end(again, "failed", f"trial {number} could not be submitted: {e}")
            return
        await db.write(records.add_trial, snap["id"], number, params, answer["id"], ACTIVE)
        active, asked = active + 1, asked + 1
    if asked >= spec.trials and active == 0:
        counts = {s: sum(1 for t in snap["trials"] if t["state"] == s) for s in ("complete", "pruned", "failed")}
        best = snap["best"]
        summary = ", ".join(f"{n} {s}" for s, n in counts.items())
        if best:
            summary += f"; best trial {best['number']}: {spec.metric} {best['value']:.6g}"
        await sweeps.end(snap, "succeeded" if best else "failed", f"{asked} trials: {summary}")
