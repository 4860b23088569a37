"""Pure tests of admission: :meth:`danlu.hub.service.scheduler.Scheduler.plan`.

Best-effort FIFO: jobs are considered oldest first, a job that fits starts, a
job that does not fit waits with a reason and a queue position, and it does
not block smaller jobs behind it.
"""

from __future__ import annotations

from danlu.hub.service.scheduler import Candidate, Scheduler, Snapshot


def plan(queued, *, free_gpus=0, total_gpus=0, running_cpu_jobs=0, max_cpu_jobs=4):
    snapshot = Snapshot(free_gpus=free_gpus, total_gpus=total_gpus, running_cpu_jobs=running_cpu_jobs,
                        max_cpu_jobs=max_cpu_jobs)
    return Scheduler().plan(snapshot, queued)


def test_empty_queue_admits_nothing():
    result = plan([], free_gpus=2, total_gpus=2)

    assert (result.admit, result.waiting, result.positions) == ([], {}, {})


def test_jobs_that_fit_start_in_queue_order():
    result = plan([Candidate("a", gpus=1), Candidate("b", gpus=0), Candidate("c", gpus=1)],
                  free_gpus=2, total_gpus=2)

    assert result.admit == ["a", "b", "c"]
    assert result.waiting == {}


def test_gpus_are_given_to_the_oldest_job_first():
    result = plan([Candidate("old", gpus=2), Candidate("new", gpus=2)], free_gpus=2, total_gpus=4)

    assert result.admit == ["old"]
    assert result.waiting == {"new": "waiting for 2 GPUs: 0 of 4 free"}
    assert result.positions == {"new": 1}


def test_job_that_does_not_fit_does_not_block_smaller_ones():
    result = plan([Candidate("big", gpus=4), Candidate("small", gpus=1), Candidate("cpu", gpus=0)],
                  free_gpus=2, total_gpus=4)

    assert result.admit == ["small", "cpu"]
    assert result.waiting == {"big": "waiting for 4 GPUs: 2 of 4 free"}
    assert result.positions == {"big": 1}


def test_cpu_jobs_wait_for_a_slot():
    result = plan([Candidate("a", gpus=0), Candidate("b", gpus=0), Candidate("c", gpus=0)],
                  running_cpu_jobs=1, max_cpu_jobs=2)

    assert result.admit == ["a"]
    assert result.waiting["b"] == ("waiting for a CPU job slot: 2 CPU-only jobs may run at once "
                                   "and 1 are running")
    assert result.positions == {"b": 1, "c": 2}


def test_gpu_jobs_do_not_use_cpu_slots():
    result = plan([Candidate("cpu", gpus=0), Candidate("gpu", gpus=1)],
                  free_gpus=1, total_gpus=1, running_cpu_jobs=2, max_cpu_jobs=2)

    assert result.admit == ["gpu"]
    assert list(result.waiting) == ["cpu"]


def test_positions_count_only_waiting_jobs_in_queue_order():
    queued = [Candidate("w1", gpus=3), Candidate("run", gpus=1), Candidate("w2", gpus=2), Candidate("w3", gpus=0)]

    result = plan(queued, free_gpus=2, total_gpus=4, max_cpu_jobs=1, running_cpu_jobs=1)

    assert result.admit == ["run"]
    assert result.positions == {"w1": 1, "w2": 2, "w3": 3}
    assert result.waiting["w2"] == "waiting for 2 GPUs: 1 of 4 free"


def test_job_asking_more_gpus_than_exist_can_never_start():
    result = plan([Candidate("huge", gpus=8), Candidate("fits", gpus=2)], free_gpus=4, total_gpus=4)

    assert result.admit == ["fits"]
    assert result.waiting["huge"] == "asks for 8 GPUs but the workbench has 4; it can never start"


def test_gpu_job_on_a_machine_without_gpus_can_never_start():
    result = plan([Candidate("a", gpus=1)])

    assert result.admit == []
    assert "it can never start" in result.waiting["a"]


def test_plan_does_not_change_the_snapshot():
    snapshot = Snapshot(free_gpus=2, total_gpus=2, running_cpu_jobs=0, max_cpu_jobs=1)

    Scheduler().plan(snapshot, [Candidate("a", gpus=2), Candidate("b", gpus=0)])

    assert snapshot == Snapshot(free_gpus=2, total_gpus=2, running_cpu_jobs=0, max_cpu_jobs=1)
