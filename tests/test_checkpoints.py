"""Checkpoints in the jobs service, in process on fake backends (tests/fakes.py): no processes, no HTTP.

What the runner API keeps of a ``checkpoint`` event (and what it refuses without failing the attempt), the
job's view, ``POST /jobs/{id}/checkpoint`` (the manager's :meth:`checkpoint`) and the ``save`` count the
runner API's ``stop`` answers, the reason of a preemption that knows where the job resumes, a job preempted
twice that keeps its retries, and the admission model seeing a fresh checkpoint when it picks a victim.
"""

from __future__ import annotations

import pytest

from danlu.errors import Conflict, NotFound, UsageError
from danlu.hub.service.validation import check_schema

from .fakes import SlowBackend, admin, final, until
from .test_manager import ALICE, BOB, in_loop, service, submit

ADMIN = admin()


async def checkpoint(run, step) -> dict | None:
    """What a job's rank 0 sends after it committed a checkpoint, as ``danlu.resumable`` does."""
    launch = run.launch
    body = {"event": "checkpoint", "step": step}
    return await run.call("checkpoint", lambda api: api.event(launch.job_id, launch.attempt, launch.token, body))


@in_loop
async def test_a_reported_checkpoint_is_in_the_view_and_a_bad_one_is_refused_without_failing_the_job(tmp_path):
    backend = SlowBackend()
    async with service(backend, tmp_path) as manager:
        job_id = await submit(manager)
        run = await backend.machine.running(job_id)
        before = await manager.job_dict(job_id)
        assert await checkpoint(run, 1500) == {"recorded": "checkpoint"}
        seen = await manager.job_dict(job_id)
        launch = run.launch
        refused = {}
        for body in (
            {"event": "checkpoint", "step": -1},
            {"event": "checkpoint", "step": 2**53 + 1},
            {"event": "checkpoint", "step": 1.5},
            {"event": "checkpoint", "step": True},
            {"event": "checkpoint"},
            {"event": "checkpoint", "step": 3, "path": "/etc"},
        ):
            with pytest.raises(UsageError) as e:
                await manager.runner_api.event(launch.job_id, launch.attempt, launch.token, body)
            refused[str(body)] = (e.value.status, e.value.field)
        still = await manager.job_dict(job_id)
        backend.finish(job_id)
        done = await final(manager, job_id)

    assert before["checkpoint"] is None
    assert seen["checkpoint"]["step"] == 1500 and seen["checkpoint"]["attempt"] == 1
    assert 0 <= seen["checkpoint"]["age_seconds"] < 60
    check_schema("Job", seen)
    assert set(refused.values()) == {(400, "step"), (400, "path")}, refused
    assert still["checkpoint"]["step"] == 1500  # the refused ones changed nothing
    assert done["state"] == "succeeded" and done["checkpoint"]["step"] == 1500  # and failed nothing


@in_loop
async def test_asking_a_running_job_to_save_counts_in_its_stop_answer_and_is_audited(tmp_path):
    backend = SlowBackend()
    async with service(backend, tmp_path) as manager:
        job_id = await submit(manager, resources={"gpus": 2})
        run = await backend.machine.running(job_id)
        queued = await submit(manager, resources={"gpus": 2})  # waits for the first one's GPUs
        asked0 = await run.ask_stop()
        with pytest.raises(NotFound):  # someone else's job does not exist for them
            await manager.checkpoint(BOB, job_id)
        first = await manager.checkpoint(ALICE, job_id)
        second = await manager.checkpoint(ADMIN, job_id)
        asked = await run.ask_stop()
        with pytest.raises(Conflict) as not_running:
            await manager.checkpoint(ALICE, queued)
        records = await manager.audit.records(ADMIN, limit=5, action="checkpoint", target=job_id)
        backend.finish(job_id)
        await final(manager, job_id)
        with pytest.raises(Conflict):
            await manager.checkpoint(ALICE, job_id)
        await manager.cancel(ALICE, queued)

    assert asked0 == {"reason": None, "grace": 0.0, "save": 0}
    assert (first, second) == ({"id": job_id, "save": 1}, {"id": job_id, "save": 2})
    assert asked == {"reason": None, "grace": 0.0, "save": 2}
    assert not_running.value.reason == "not_running" and "queued" in str(not_running.value)
    assert [(r["actor"], r["after"]) for r in records] == [(ADMIN.name, {"save": 2}), ("alice", {"save": 1})]


class CheckpointsThenCrashes(SlowBackend):
    """Attempts 1 and 2 report a checkpoint at step 100 x attempt, then run until stopped (preempted);
    attempt 3 dies without a word (an infrastructure failure); attempt 4 succeeds."""

    async def runner(self, run):
        if await run.fetch_spec() is None:
            return 3
        if run.attempt == 3:
            return -9
        if run.attempt < 3:
            await checkpoint(run, 100 * run.attempt)
        return await self.work(run)


@in_loop
async def test_a_job_preempted_twice_resumes_from_its_checkpoint_and_keeps_its_retries(tmp_path):
    backend = CheckpointsThenCrashes()
    async with service(backend, tmp_path) as manager:
        job_id = await submit(manager, resources={"gpus": 2}, retries=1)
        for attempt in (1, 2):
            await backend.machine.running(job_id, attempt)
            step = 100 * attempt

            async def saved(step=step):
                return ((await manager.job_dict(job_id))["checkpoint"] or {}).get("step") == step

            await until(saved, f"attempt {attempt}'s checkpoint")
            urgent = await submit(manager, priority="urgent", resources={"gpus": 2})
            await backend.machine.running(urgent)
            backend.finish(urgent)
            await final(manager, urgent)
        await backend.machine.running(job_id, 4)
        backend.finish(job_id)
        done = await final(manager, job_id)

    assert done["state"] == "succeeded", done["reason"]
    assert [(a["state"], a["failure"]) for a in done["attempts"]] == [
        ("preempted", None),
        ("preempted", None),
        ("failed", "infrastructure"),
        ("succeeded", None),
    ]
    assert done["attempts"][0]["reason"].endswith("back in the queue; resumes from its checkpoint at step 100")
    assert done["attempts"][1]["reason"].endswith("back in the queue; resumes from its checkpoint at step 200")
    assert done["checkpoint"]["step"] == 200 and done["checkpoint"]["attempt"] == 2


@in_loop
async def test_the_admission_model_sees_a_running_jobs_checkpoint(tmp_path):
    backend = SlowBackend()
    async with service(backend, tmp_path) as manager:
        job_id = await submit(manager)
        run = await backend.machine.running(job_id)
        wl = manager.core.model.admitted[job_id]
        before = wl.checkpointed_at
        await checkpoint(run, 7)
        after = wl.checkpointed_at
        backend.finish(job_id)
        assert (await final(manager, job_id))["state"] == "succeeded"

    assert before == 0.0 and after >= wl.admitted_at > 0


def test_the_cli_and_the_job_card_say_the_step_and_age_of_the_last_checkpoint():
    from danlu.card import summary_html  # deferred: only these two lines need the client side
    from danlu.jobs_cli import checkpoint_line  # deferred: as above

    saved = {"step": 1500, "age_seconds": 40.2, "attempt": 2}
    running = {"id": "0a1b2c3d4e5f", "name": "n", "state": "running", "profile": "python", "checkpoint": saved}
    assert checkpoint_line(running) == "step 1500, 40 s ago (attempt 2)"
    assert checkpoint_line({**running, "state": "succeeded"}) == "step 1500, 40 s before it ended (attempt 2)"
    assert checkpoint_line({**running, "checkpoint": {**saved, "age_seconds": 600}}).startswith("step 1500, 10 min")
    assert "checkpoint step 1500, 40 s old" in summary_html(running)
    assert "checkpoint" not in summary_html({**running, "checkpoint": None})
