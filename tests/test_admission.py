"""Pure tests of the admission model: :class:`danlu.hub.service.admission.model.Model`.

Example by example, the Kueue semantics the model promises: nominal quotas,
cohorts with borrowing and lending limits, priorities, all-or-nothing admission,
best-effort FIFO with a starvation reservation, preemption within a team and
reclaim within a cohort, notebook servers, and exclusive device indices. The
service's part is played by hand: it passes the pending workloads to ``cycle``,
calls ``release`` when a job ends or a victim has stopped, and resubmits a victim
as a new workload with the same id. The tests at the end pin bugs found in the
model and fixed (each says what went wrong).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from danlu.hub.config import load_settings
from danlu.hub.gpus import inventory
from danlu.hub.service.admission.model import Model
from danlu.hub.service.admission.quotas import build_model
from danlu.hub.service.admission.workloads import Request, Team, Workload

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "config" / "shared-workstation.yaml"
LOW, NORMAL, HIGH = 100, 1000, 10000
GIB = 2**30
SIM4 = {"sim": [0, 1, 2, 3]}


def job(wid, team, gpus=1, *, priority=NORMAL, created=0.0, cpu=1.0, memory=0.0, flavor=None, kind="job"):
    return Workload(
        wid, team, priority, created, Request(gpus=gpus, gpu_flavor=flavor, cpu=cpu, memory=memory), kind=kind
    )


def server(wid, team, gpus=1, **kw):
    return job(wid, team, gpus, kind="server", **kw)


def resubmitted(victim: Workload) -> Workload:
    """What the service queues again once a preempted job has stopped: a new workload, same id."""
    return Workload(victim.id, victim.team, victim.priority, victim.created, victim.request, owner=victim.owner)


def ids(workloads) -> list[str]:
    return [w.id for w in workloads]


def pairs(preempted) -> list[tuple[str, str]]:
    return [(victim.id, for_whom.id) for victim, for_whom in preempted]


def solo(
    nominal=None, *, within_team="lower_priority", devices=SIM4, cpu=16, memory=float("inf"), starvation_seconds=600.0
) -> Model:
    """One team, ``solo``, in no cohort."""
    team = Team("solo", nominal=dict(nominal or {"gpu/sim": 2}), within_team=within_team)
    return Model([team], devices, cpu=cpu, memory=memory, starvation_seconds=starvation_seconds)


def shared(*, vision=None, nlp=None, cpu=16) -> Model:
    """vision and nlp in cohort ``shared`` with 2 `sim` GPUs each, on a 4-GPU machine; keyword dicts change a team."""
    teams = []
    for name, change in (("vision", vision), ("nlp", nlp)):
        spec = {"nominal": {"gpu/sim": 2}, "cohort": "shared", **(change or {})}
        teams.append(Team(name, **spec))
    return Model(teams, SIM4, cpu=cpu)


def fill(model: Model, *workloads: Workload, now: float = 0.0) -> None:
    """Admit workloads that must all fit (the state a test starts from)."""
    decision = model.cycle(list(workloads), now)
    assert sorted(ids(decision.admitted)) == sorted(ids(workloads)), decision.waiting


# the issue's scenario, from the example configuration -----------------------------------------------------


@pytest.fixture
def workstation():
    settings = load_settings(EXAMPLE, environ={})
    return build_model(settings, inventory(settings.gpus)), settings.priority_classes


def test_example_configuration_is_the_issue_scenario(workstation):
    model, classes = workstation

    assert classes == {"low": 100, "normal": 1000, "high": 10000}
    assert model.devices == SIM4
    assert {name: (t.cohort, t.nominal, t.borrowing_limit) for name, t in model.teams.items()} == {
        "vision": ("shared", {"gpu/sim": 2.0}, {"gpu/sim": 2.0}),
        "nlp": ("shared", {"gpu/sim": 2.0}, {"gpu/sim": 2.0}),
    }


def test_issue_scenario_high_priority_job_reclaims_the_newest_borrowed_gpu(workstation):
    model, classes = workstation

    first = model.cycle([job("v1", "vision", created=1), job("v2", "vision", created=2)], now=10)
    third = model.cycle([job("v3", "vision", created=3)], now=20)
    assert ids(first.admitted) + ids(third.admitted) == ["v1", "v2", "v3"]
    assert [w.devices for w in first.admitted + third.admitted] == [(0,), (1,), (2,)]
    assert model.used["vision"]["gpu/sim"] == 3  # 2 nominal + 1 borrowed

    h1 = model.cycle([job("h1", "nlp", priority=classes["high"], created=30)], now=30)
    assert (ids(h1.admitted), h1.preempted, h1.admitted[0].devices) == (["h1"], [], (3,))

    h2 = job("h2", "nlp", priority=classes["high"], created=31)
    preempting = model.cycle([h2], now=31)
    assert preempting.admitted == []
    assert pairs(preempting.preempted) == [("v3", "h2")]  # exactly one, the most recently admitted
    assert preempting.waiting == {"h2": "preempting 1 job(s) to start"}
    v3 = preempting.preempted[0][0]
    assert v3.stopping and v3.stopping_for == "h2"
    assert model.used["vision"]["gpu/sim"] == 3  # the victim holds its GPU until it has stopped

    stopping = model.cycle([h2], now=32)
    assert (stopping.admitted, stopping.preempted) == ([], [])
    assert stopping.waiting == {"h2": "waiting for the jobs it preempted to stop"}

    assert model.release("v3") is v3
    after = model.cycle([h2, resubmitted(v3)], now=40)
    assert (ids(after.admitted), after.admitted[0].devices, after.preempted) == (["h2"], (2,), [])
    assert after.waiting == {
        "v3": "waiting for 1 `sim` GPU: vision uses 2/2, cohort has 0 to lend, 0 free on the machine"
    }
    assert after.positions == {"v3": 1}


# preemption within a team ---------------------------------------------------------------------------------


def test_higher_priority_job_preempts_the_newest_lower_priority_job_of_its_team():
    model = solo()
    fill(model, job("l1", "solo", priority=LOW), now=0)
    fill(model, job("l2", "solo", priority=LOW), now=1)
    high = job("h", "solo", priority=HIGH, created=2)

    decision = model.cycle([high], now=2)

    assert pairs(decision.preempted) == [("l2", "h")]
    model.release("l2")
    after = model.cycle([high, resubmitted(decision.preempted[0][0])], now=3)
    assert (ids(after.admitted), after.admitted[0].devices) == (["h"], (1,))
    assert after.waiting == {"l2": "waiting for 1 `sim` GPU: solo uses 2/2, 2 free on the machine"}


def test_victims_are_the_lowest_priority_before_the_newest():
    model = solo()
    fill(model, job("low", "solo", priority=LOW), now=0)
    fill(model, job("normal", "solo", priority=NORMAL), now=1)

    decision = model.cycle([job("h", "solo", priority=HIGH)], now=2)

    assert pairs(decision.preempted) == [("low", "h")]


def test_only_as_many_victims_as_needed():
    model = solo({"gpu/sim": 4})
    for t in range(4):
        fill(model, job(f"l{t}", "solo", priority=LOW, created=t), now=t)

    decision = model.cycle([job("h", "solo", 2, priority=HIGH)], now=5)

    assert sorted(pairs(decision.preempted)) == [("l2", "h"), ("l3", "h")]
    assert decision.waiting == {"h": "preempting 2 job(s) to start"}


def test_equal_priority_never_preempts():
    model = solo()
    fill(model, job("a", "solo"), job("b", "solo"))

    decision = model.cycle([job("c", "solo", created=1)], now=1)

    assert decision.preempted == []
    assert decision.waiting == {"c": "waiting for 1 `sim` GPU: solo uses 2/2, 2 free on the machine"}


def test_within_team_never_does_not_preempt():
    model = solo(within_team="never")
    fill(model, job("l1", "solo", priority=LOW), job("l2", "solo", priority=LOW))

    decision = model.cycle([job("h", "solo", priority=HIGH)], now=1)

    assert (decision.admitted, decision.preempted) == ([], [])
    assert decision.waiting == {"h": "waiting for 1 `sim` GPU: solo uses 2/2, 2 free on the machine"}


def test_a_waiting_job_with_stopping_victims_preempts_no_more():
    model = solo()
    fill(model, job("l1", "solo", priority=LOW), job("l2", "solo", priority=LOW, created=1))
    high = job("h", "solo", priority=HIGH, created=2)
    assert pairs(model.cycle([high], now=2).preempted) == [("l2", "h")]

    again = model.cycle([high], now=3)

    assert again.preempted == []
    assert not model.admitted["l1"].stopping


def test_a_cohort_preempts_for_one_workload_per_pass():
    """As Kueue: once a workload of a cohort has preempted in a pass, the cohort's others that do not fit wait
    for what they lack, and look for victims in the next pass."""
    model = shared()
    fill(
        model,
        job("v1", "vision", priority=LOW),
        job("v2", "vision", priority=LOW, created=1),
        job("n1", "nlp", priority=LOW),
        job("n2", "nlp", priority=LOW, created=1),
    )
    pending = [job("hv", "vision", priority=HIGH, created=2), job("hn", "nlp", priority=HIGH, created=3)]

    first = model.cycle(pending, now=4)
    assert pairs(first.preempted) == [("v2", "hv")]
    assert first.waiting["hn"] == "waiting for 1 `sim` GPU: nlp uses 2/2, cohort has 0 to lend, 0 free on the machine"

    second = model.cycle(pending, now=5)
    assert pairs(second.preempted) == [("n2", "hn")]


def test_teams_in_no_cohort_each_preempt_in_the_same_pass():
    model = Model([Team("a", nominal={"gpu/sim": 2}), Team("b", nominal={"gpu/sim": 2})], SIM4, cpu=16)
    fill(
        model,
        job("a1", "a", priority=LOW),
        job("a2", "a", priority=LOW, created=1),
        job("b1", "b", priority=LOW),
        job("b2", "b", priority=LOW, created=1),
    )

    decision = model.cycle([job("ha", "a", priority=HIGH, created=2), job("hb", "b", priority=HIGH, created=3)], now=4)

    assert pairs(decision.preempted) == [("a2", "ha"), ("b2", "hb")]


# reclaim within a cohort ----------------------------------------------------------------------------------


def vision_borrowing(model: Model) -> None:
    """vision runs three 1-GPU normal jobs (one borrowed), nlp one high one (not a within-team victim): the
    machine is full."""
    for t in range(3):
        fill(model, job(f"v{t + 1}", "vision", created=t), now=t)
    fill(model, job("n1", "nlp", priority=HIGH, created=5), now=5)


def test_reclaim_any_takes_back_lent_quota_regardless_of_priority():
    model = shared()
    vision_borrowing(model)

    decision = model.cycle([job("n2", "nlp", priority=LOW, created=6)], now=6)

    assert pairs(decision.preempted) == [("v3", "n2")]


def test_reclaim_lower_priority_needs_a_higher_priority():
    model = shared(nlp={"reclaim": "lower_priority"})
    vision_borrowing(model)

    same = model.cycle([job("n2", "nlp", created=6)], now=6)
    assert same.preempted == []
    assert same.waiting == {"n2": "waiting for 1 `sim` GPU: nlp uses 1/2, cohort has 0 to lend, 0 free on the machine"}

    higher = model.cycle([job("n3", "nlp", priority=HIGH, created=7)], now=7)
    assert pairs(higher.preempted) == [("v3", "n3")]


def test_reclaim_never_waits():
    model = shared(nlp={"reclaim": "never"})
    vision_borrowing(model)

    decision = model.cycle([job("n2", "nlp", priority=HIGH, created=6)], now=6)

    assert (decision.admitted, decision.preempted) == ([], [])


def test_reclaim_only_for_what_fits_in_the_nominal_quota():
    model = shared()
    vision_borrowing(model)

    decision = model.cycle([job("n2", "nlp", 2, priority=HIGH, created=6)], now=6)  # 1 + 2 > nominal 2

    assert decision.preempted == []
    assert decision.waiting == {
        "n2": "waiting for 2 `sim` GPUs: nlp uses 1/2, cohort has 0 to lend, 0 free on the machine"
    }


def test_a_team_within_its_quota_is_not_reclaimed_from():
    model = shared(nlp={"within_team": "never"})
    fill(model, job("v1", "vision"), job("v2", "vision"), job("n1", "nlp"), job("n2", "nlp"))

    decision = model.cycle([job("n3", "nlp", priority=HIGH, created=1)], now=1)

    assert decision.preempted == []


def test_reclaim_takes_only_from_teams_that_borrow():
    teams = [
        Team("a", nominal={"gpu/sim": 2}, cohort="c"),
        Team("b", nominal={"gpu/sim": 1}, cohort="c"),
        Team("c", nominal={"gpu/sim": 1}, cohort="c"),
    ]
    model = Model(teams, SIM4, cpu=16)
    fill(model, job("a1", "a"), job("b1", "b"), job("b2", "b"), now=0)  # b borrows one GPU
    fill(model, job("c1", "c"), now=1)  # c uses its nominal GPU (and CPU, with no CPU quota), admitted last

    decision = model.cycle([job("a2", "a", created=2)], now=2)

    assert [(victim.team, for_whom.id) for victim, for_whom in decision.preempted] == [("b", "a2")]


def cohort_of(**nominal: int) -> Model:
    """Teams in cohort ``c`` with the given `sim` GPU quotas, on a machine with as many GPUs as they sum to."""
    teams = [Team(name, nominal={"gpu/sim": float(n)}, cohort="c") for name, n in nominal.items()]
    return Model(teams, {"sim": list(range(sum(nominal.values())))}, cpu=64)


def test_reclaim_takes_what_other_teams_borrow_before_its_own_lower_priorities():
    # Kueue's classic preemption: candidates from borrowing teams come first, its own team's after them
    model = cohort_of(a=3, b=1)
    fill(model, job("b1", "b"), now=0)
    fill(model, job("a1", "a", priority=LOW), now=1)
    fill(model, job("b2", "b"), now=2)
    fill(model, job("b3", "b"), now=3)  # b borrows two of a's GPUs

    decision = model.cycle([job("h", "a", 2, priority=HIGH, created=4)], now=4)

    assert sorted(pairs(decision.preempted)) == [("b2", "h"), ("b3", "h")]


def test_reclaim_stops_when_the_borrower_is_back_within_its_quota():
    # b and c borrow one GPU each; b's are the newest, but once b is back at its quota the next is c's
    model = cohort_of(a=2, b=1, c=1)
    fill(model, job("c1", "c"), job("c2", "c"), now=0)
    fill(model, job("b1", "b"), now=1)
    fill(model, job("b2", "b"), now=2)

    decision = model.cycle([job("h", "a", 2, priority=HIGH, created=3)], now=3)

    assert sorted(pairs(decision.preempted)) == [("b2", "h"), ("c1", "h")]


def test_a_reclaiming_job_frees_a_flavor_it_may_use_within_its_quota():
    # a may borrow `f1` but its quota is on `f2`: reclaim frees an `f2` GPU (b borrows there), not b's own `f1`
    teams = [
        Team("a", nominal={"gpu/f1": 0.0, "gpu/f2": 2.0}, cohort="c", flavors=("f1", "f2")),
        Team("b", nominal={"gpu/f1": 1.0, "gpu/f2": 0.0}, cohort="c", flavors=("f2", "f1")),
    ]
    model = Model(teams, {"f1": [0], "f2": [1, 2]}, cpu=16)
    fill(model, job("b2", "b"), now=0)
    fill(model, job("b3", "b"), now=1)
    fill(model, job("b1", "b"), now=2)  # on `f1`, the newest

    decision = model.cycle([job("h", "a", priority=HIGH, created=3)], now=3)

    assert model.admitted["b1"].flavor == "f1" and pairs(decision.preempted) == [("b3", "h")]


# borrowing and lending limits -----------------------------------------------------------------------------


def test_borrowing_limit_caps_what_a_team_takes_from_an_idle_cohort():
    model = shared(vision={"borrowing_limit": {"gpu/sim": 1}})

    decision = model.cycle([job(f"v{t}", "vision", created=t) for t in range(4)], now=0)

    assert ids(decision.admitted) == ["v0", "v1", "v2"]
    assert decision.waiting == {
        "v3": "waiting for 1 `sim` GPU: vision uses 3/2, cohort has 0 to lend, 1 free on the machine"
    }


def test_borrowing_limit_zero_keeps_a_team_within_its_quota():
    model = shared(vision={"borrowing_limit": {"gpu/sim": 0}})

    decision = model.cycle([job(f"v{t}", "vision", created=t) for t in range(3)], now=0)

    assert ids(decision.admitted) == ["v0", "v1"]


def test_without_borrowing_limit_a_team_takes_the_whole_idle_cohort():
    model = shared()

    decision = model.cycle([job(f"v{t}", "vision", created=t) for t in range(5)], now=0)

    assert ids(decision.admitted) == ["v0", "v1", "v2", "v3"]
    assert decision.waiting == {
        "v4": "waiting for 1 `sim` GPU: vision uses 4/2, cohort has 0 to lend, 0 free on the machine"
    }


def test_lending_limit_caps_what_a_team_lends():
    model = shared(vision={"lending_limit": {"gpu/sim": 1}})

    nlp = model.cycle([job(f"n{t}", "nlp", created=t) for t in range(4)], now=0)
    assert ids(nlp.admitted) == ["n0", "n1", "n2"]
    assert nlp.waiting == {"n3": "waiting for 1 `sim` GPU: nlp uses 3/2, cohort has 0 to lend, 1 free on the machine"}

    vision = model.cycle([job("v0", "vision", created=5)], now=5)  # the GPU vision kept needs no preemption
    assert (ids(vision.admitted), vision.preempted) == (["v0"], [])


def test_lending_limit_zero_lends_nothing():
    model = shared(vision={"lending_limit": {"gpu/sim": 0}})

    decision = model.cycle([job(f"n{t}", "nlp", created=t) for t in range(3)], now=0)

    assert ids(decision.admitted) == ["n0", "n1"]


def test_a_team_in_no_cohort_never_exceeds_its_quota():
    model = solo({"gpu/sim": 1})

    decision = model.cycle([job("a", "solo"), job("b", "solo", created=1)], now=0)

    assert ids(decision.admitted) == ["a"]
    assert decision.waiting == {"b": "waiting for 1 `sim` GPU: solo uses 1/1, 3 free on the machine"}


def test_a_team_in_no_cohort_borrows_nothing_from_other_teams():
    teams = [Team("solo", nominal={"gpu/sim": 1}), Team("idle", nominal={"gpu/sim": 3})]
    model = Model(teams, SIM4, cpu=16)

    decision = model.cycle([job("a", "solo"), job("b", "solo", created=1)], now=0)

    assert ids(decision.admitted) == ["a"]


# held teams and impossible requests -----------------------------------------------------------------------


def test_a_held_team_admits_nothing_until_released():
    model = shared()
    model.teams["vision"].held = True

    held = model.cycle([job("v", "vision"), job("n", "nlp")], now=0)
    assert ids(held.admitted) == ["n"]
    assert held.waiting == {"v": "queue vision is held by an admin"}

    model.teams["vision"].held = False
    assert ids(model.cycle([job("v", "vision")], now=1).admitted) == ["v"]


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        (Request(gpus=5), "asks for 5 GPUs; at most 4 of one flavor exist: it can never start"),
        (Request(gpus=1, gpu_flavor="h100"), "no GPUs of flavor 'h100': it can never start"),
        (Request(gpus=0, cpu=32), "asks for 32 CPUs; jobs may use 16: it can never start"),
    ],
)
def test_impossible_requests_can_never_start_and_block_nothing(request_, reason):
    model = solo({"gpu/sim": 4})
    never = Workload("never", "solo", HIGH, 0.0, request_)

    decision = model.cycle([never, job("small", "solo", created=1)], now=0)

    assert ids(decision.admitted) == ["small"]
    assert decision.waiting == {"never": reason}
    assert decision.preempted == []


def test_a_job_for_an_unknown_team_waits_with_a_reason():
    decision = solo().cycle([job("x", "ghost")], now=0)

    assert decision.waiting == {"x": "no team ghost"}


# order: priority, age, best-effort FIFO, positions, starvation --------------------------------------------


def test_higher_priority_goes_first_then_the_oldest():
    model = solo({"gpu/sim": 1})

    decision = model.cycle(
        [
            job("old", "solo", created=0),
            job("young-high", "solo", priority=HIGH, created=5),
            job("young", "solo", created=1),
        ],
        now=10,
    )

    assert ids(decision.admitted) == ["young-high"]
    assert decision.positions == {"old": 1, "young": 2}


def test_a_big_job_that_does_not_fit_does_not_block_a_small_one():
    model = solo({"gpu/sim": 4})
    fill(model, job("r1", "solo"), job("r2", "solo"))

    decision = model.cycle(
        [job("big", "solo", 4, created=1), job("big2", "solo", 4, created=2), job("small", "solo", 1, created=3)],
        now=10,
    )

    assert ids(decision.admitted) == ["small"]
    assert decision.admitted[0].devices == (2,)
    reason = "waiting for 4 `sim` GPUs: solo uses 3/4, 1 free on the machine"  # worded after the pass
    assert decision.waiting == {"big": reason, "big2": reason}
    assert decision.positions == {"big": 1, "big2": 2}


def test_positions_are_counted_per_team():
    model = Model([Team("vision", nominal={"gpu/sim": 2}), Team("nlp", nominal={"gpu/sim": 2})], SIM4, cpu=16)
    fill(model, job("v0", "vision"), job("v1", "vision"), job("n0", "nlp"), job("n1", "nlp"))

    decision = model.cycle(
        [
            job("v-old", "vision", created=1),
            job("n-old", "nlp", created=2),
            job("v-high", "vision", priority=HIGH, created=3),
            job("v-new", "vision", created=4),
            job("n-new", "nlp", created=5),
        ],
        now=10,
    )

    assert decision.positions == {"v-high": 1, "v-old": 2, "v-new": 3, "n-old": 1, "n-new": 2}


def test_a_starving_job_holds_back_what_it_needs_from_younger_jobs_of_its_team():
    model = solo({"gpu/sim": 4}, starvation_seconds=600)
    fill(model, job("r1", "solo"), job("r2", "solo"))
    big = job("big", "solo", 4, created=0)

    early = model.cycle([big, job("s1", "solo", created=50)], now=100)  # big has waited 100 s: best effort
    assert ids(early.admitted) == ["s1"]

    late = model.cycle(
        [big, job("s2", "solo", created=650), job("urgent", "solo", priority=HIGH, created=690)], now=700
    )  # big has waited 700 s
    assert ids(late.admitted) == ["urgent"]  # a higher priority is considered before the starving job
    assert "s2" in late.waiting

    for done in ("r1", "r2", "s1", "urgent"):
        model.release(done)
    final = model.cycle([big, job("s2", "solo", created=650)], now=800)
    assert ids(final.admitted) == ["big"]
    assert final.admitted[0].devices == (0, 1, 2, 3)


def test_a_starving_job_holds_back_nothing_from_other_teams():
    teams = [Team("a", nominal={"gpu/sim": 4}), Team("b", nominal={"gpu/sim": 4})]
    model = Model(teams, {"sim": list(range(8))}, cpu=16, starvation_seconds=600)
    fill(model, job("r1", "a"), job("r2", "a"))

    decision = model.cycle([job("big", "a", 4, created=0), job("other", "b", created=650)], now=700)

    assert ids(decision.admitted) == ["other"]


# CPU and memory -------------------------------------------------------------------------------------------


def test_cpu_quota_limits_a_team():
    model = solo({"cpu": 4})

    decision = model.cycle([job(f"c{t}", "solo", 0, cpu=2, created=t) for t in range(3)], now=0)

    assert ids(decision.admitted) == ["c0", "c1"]
    assert decision.waiting == {"c2": "waiting for 2 CPUs: solo uses 4/4, 12 free on the machine"}


def test_a_gpu_job_waits_for_cpu_even_with_free_gpus():
    model = solo({"gpu/sim": 4, "cpu": 4})

    decision = model.cycle([job("a", "solo", 1, cpu=4), job("b", "solo", 1, cpu=1, created=1)], now=0)

    assert ids(decision.admitted) == ["a"]
    assert decision.waiting == {"b": "waiting for 1 CPU: solo uses 4/4, 12 free on the machine"}


def test_without_a_cpu_quota_the_machine_limits_cpu():
    model = solo({"gpu/sim": 4}, cpu=4)

    decision = model.cycle([job(f"c{t}", "solo", 0, created=t) for t in range(5)], now=0)

    assert ids(decision.admitted) == ["c0", "c1", "c2", "c3"]
    assert decision.waiting == {"c4": "waiting for 1 CPU: solo uses 4, 0 free on the machine"}


def test_memory_quota_limits_a_team():
    model = solo({"memory": 8 * GIB}, memory=64 * GIB)

    decision = model.cycle([job("a", "solo", 0, memory=6 * GIB), job("b", "solo", 0, memory=6 * GIB, created=1)], now=0)

    assert ids(decision.admitted) == ["a"]
    assert decision.waiting["b"].startswith("waiting for 6.0 GiB memory: solo uses ")


def test_without_a_memory_quota_the_machine_limits_memory():
    model = solo({"gpu/sim": 4}, memory=8 * GIB)

    decision = model.cycle([job("a", "solo", 0, memory=6 * GIB), job("b", "solo", 0, memory=6 * GIB, created=1)], now=0)

    assert ids(decision.admitted) == ["a"]


def test_cpu_quota_within_a_cohort_is_borrowed_like_gpus():
    teams = [Team(name, nominal={"cpu": 4}, cohort="shared", borrowing_limit={"cpu": 2}) for name in ("a", "b")]
    model = Model(teams, {}, cpu=16)

    decision = model.cycle([job(f"c{t}", "a", 0, cpu=1, created=t) for t in range(8)], now=0)

    assert ids(decision.admitted) == [f"c{t}" for t in range(6)]


def test_a_cohort_members_cpu_quota_is_not_eaten_by_a_member_without_one():
    teams = [Team("a", nominal={"gpu/sim": 2, "cpu": 4}, cohort="c"), Team("b", nominal={"gpu/sim": 2}, cohort="c")]
    model = Model(teams, SIM4, cpu=16)
    fill(model, job("b1", "b"), job("b2", "b"))

    decision = model.cycle([job("a1", "a", 0, cpu=4)], now=1)

    assert (ids(decision.admitted), decision.preempted) == (["a1"], [])


# notebook servers -----------------------------------------------------------------------------------------


def test_a_server_starts_at_once_and_counts_against_its_team():
    model = solo()

    assert model.try_server(server("s", "solo")) == (True, "")
    assert model.admitted["s"].devices == (0,)
    decision = model.cycle([job("a", "solo"), job("b", "solo", created=1)], now=0)
    assert ids(decision.admitted) == ["a"]
    assert decision.waiting == {"b": "waiting for 1 `sim` GPU: solo uses 2/2, 2 free on the machine"}


def test_a_server_that_does_not_fit_is_refused_not_queued():
    model = solo()
    fill(model, job("a", "solo"), job("b", "solo"))

    ok, reason = model.try_server(server("s", "solo"))

    assert (ok, reason) == (False, "waiting for 1 `sim` GPU: solo uses 2/2, 2 free on the machine")
    assert "s" not in model.admitted


def test_a_server_is_never_preempted_within_its_team():
    model = solo()
    assert model.try_server(server("s", "solo"))[0]
    fill(model, job("low", "solo", priority=LOW))

    first = model.cycle([job("h1", "solo", priority=HIGH, created=1)], now=1)
    assert pairs(first.preempted) == [("low", "h1")]
    model.release("low")
    assert ids(model.cycle([job("h1", "solo", priority=HIGH, created=1)], now=2).admitted) == ["h1"]

    second = model.cycle([job("h2", "solo", priority=HIGH + 1, created=3)], now=3)
    assert pairs(second.preempted) == [("h1", "h2")]  # the server stays


def test_a_borrowing_server_is_never_reclaimed():
    model = shared()
    for t in range(3):
        assert model.try_server(server(f"s{t}", "vision")) == (True, "")

    decision = model.cycle([job("n1", "nlp"), job("n2", "nlp", priority=HIGH, created=1)], now=0)

    assert ids(decision.admitted) == ["n2"]
    assert decision.preempted == []


# devices --------------------------------------------------------------------------------------------------


def test_devices_are_the_lowest_free_indices_and_never_shared():
    model = solo({"gpu/sim": 4})
    first = model.cycle([job("a", "solo", 1), job("b", "solo", 2, created=1), job("c", "solo", 1, created=2)], now=0)
    assert [w.devices for w in first.admitted] == [(0,), (1, 2), (3,)]

    model.release("a")
    model.release("c")
    second = model.cycle([job("d", "solo", 2, created=3)], now=1)
    assert second.admitted[0].devices == (0, 3)  # lowest free, not necessarily adjacent

    model.release("b")
    third = model.cycle([job("e", "solo", 1, created=4), job("f", "solo", 1, created=5)], now=2)
    assert [w.devices for w in third.admitted] == [(1,), (2,)]
    assert model.free_devices == {"sim": []}


def test_devices_come_from_the_flavor_the_job_runs_on():
    team = Team("solo", nominal={"gpu/a100": 2, "gpu/h100": 2}, flavors=("h100", "a100"))
    model = Model([team], {"a100": [0, 1], "h100": [2, 3]}, cpu=16)

    decision = model.cycle(
        [job("any1", "solo", 2), job("any2", "solo", 1, created=1), job("pinned", "solo", 1, flavor="h100", created=2)],
        now=0,
    )

    assert [(w.id, w.flavor, w.devices) for w in decision.admitted] == [
        ("any1", "h100", (2, 3)),
        ("any2", "a100", (0,)),
    ]  # the team's flavor order, then the next flavor
    assert decision.waiting == {"pinned": "waiting for 1 `h100` GPU: solo uses 2/2, 0 free on the machine"}


# bugs found in the model and fixed: each test says what went wrong -------------------------------


def run_service(model: Model, pending: list[Workload], cycles: range) -> dict[str, Workload]:
    """The jobs service for a few passes: victims stop (and are queued again) before the next pass."""
    queue = {wl.id: wl for wl in pending}
    for now in cycles:
        decision = model.cycle(list(queue.values()), now)
        for wl in decision.admitted:
            del queue[wl.id]
        for victim, _ in decision.preempted:
            model.release(victim.id)
            queue[victim.id] = resubmitted(victim)
    return queue


def test_a_preempting_job_starts_once_its_victims_stop():
    model = solo({"gpu/sim": 4})
    fill(model, *[job(f"l{t}", "solo", priority=LOW, created=t) for t in range(4)])
    p1, p2 = job("p1", "solo", 1, priority=HIGH, created=10), job("p2", "solo", 2, priority=HIGH, created=11)

    run_service(model, [p1, p2], range(10, 20))

    assert {"p1", "p2"} <= set(model.admitted)


def test_preemption_does_not_churn_for_a_job_held_back_by_a_starving_one():
    model = shared(cpu=16)
    model.starvation_seconds = 600
    fill(model, job("a0", "vision"), *[job(f"b{k}", "nlp", priority=LOW) for k in (1, 2, 3)])
    s, j = job("s", "vision", 3, created=1), job("j", "vision", 1, created=2)  # s: beyond vision's quota

    preempted = []
    queue = {wl.id: wl for wl in (s, j)}
    for now in range(700, 710):  # s has waited past starvation_seconds
        decision = model.cycle(list(queue.values()), now)
        for wl in decision.admitted:
            del queue[wl.id]
        for victim, _ in decision.preempted:
            preempted.append(victim.id)
            model.release(victim.id)
            queue[victim.id] = resubmitted(victim)

    assert len(preempted) <= 1, preempted


def test_a_job_is_not_admitted_and_preempted_in_the_same_cycle():
    model = Model(
        [Team("a", nominal={"gpu/sim": 1}, cohort="c"), Team("b", nominal={"gpu/sim": 1}, cohort="c")],
        {"sim": [0, 1]},
        cpu=16,
    )

    decision = model.cycle([job("b-big", "b", 2, priority=HIGH), job("a1", "a", 1, created=1)], now=0)

    assert not set(ids(decision.admitted)) & {victim.id for victim, _ in decision.preempted}
    assert (ids(decision.admitted), decision.preempted) == (["a1"], [])


def test_reclaim_does_not_admit_and_preempt_the_same_job_forever():
    model = Model(
        [Team("a", nominal={"gpu/sim": 1}, cohort="c"), Team("b", nominal={"gpu/sim": 1}, cohort="c")],
        {"sim": [0, 1]},
        cpu=16,
    )

    run_service(model, [job("b-big", "b", 2, priority=HIGH), job("a1", "a", 1, created=1)], range(5))

    assert "a1" in model.admitted


def test_more_memory_than_the_machine_can_never_start():
    model = solo(memory=64 * GIB)

    decision = model.cycle([job("x", "solo", 0, memory=128 * GIB)], now=0)

    assert decision.waiting["x"].endswith("it can never start")


def test_more_than_the_team_can_ever_have_can_never_start():
    model = solo({"gpu/sim": 1})

    decision = model.cycle([job("x", "solo", 2)], now=0)

    assert decision.waiting["x"].endswith("it can never start")


def test_a_job_the_team_can_never_fit_does_not_stall_the_team():
    model = solo({"gpu/sim": 1}, starvation_seconds=600)

    decision = model.cycle([job("x", "solo", 2, created=0), job("y", "solo", 1, created=700)], now=700)

    assert ids(decision.admitted) == ["y"]


def test_memory_reason_reads_in_gib():
    model = solo({"memory": 8 * GIB}, memory=64 * GIB)

    decision = model.cycle([job("a", "solo", 0, memory=6 * GIB), job("b", "solo", 0, memory=6 * GIB, created=1)], now=0)

    assert "e+" not in decision.waiting["b"]


def test_try_server_makes_the_workload_a_server():
    model = shared()
    for t in range(3):
        assert model.try_server(job(f"s{t}", "vision"))[0]

    decision = model.cycle([job("n1", "nlp"), job("n2", "nlp", created=1)], now=0)

    assert decision.preempted == []


def test_a_lower_priority_job_does_not_take_what_a_preemptor_counted_on():
    # p needs 1 CPU: 0.5 is free and its victim m frees 0.5. The free half must wait for p, or l takes it,
    # p preempts l next, m comes back into the freed half, and so on for ever.
    model = solo({"gpu/sim": 2}, cpu=1.5)
    fill(model, job("x", "solo", 0, priority=HIGH * 10, cpu=0.5), job("m", "solo", 0, cpu=0.5))
    p, low = (
        job("p", "solo", 0, priority=HIGH, cpu=1.0, created=1),
        job("l", "solo", 0, priority=LOW, cpu=0.5, created=2),
    )

    first = model.cycle([p, low], now=10)
    assert pairs(first.preempted) == [("m", "p")] and first.admitted == []

    assert "l" not in model.admitted  # held back for p
    victim = model.release("m")  # m has stopped
    run_service(model, [p, low, resubmitted(victim)], range(11, 15))

    assert "p" in model.admitted


def test_a_preemptor_that_finds_no_more_victims_holds_nothing_back_from_other_teams():
    # p preempted b1 for CPU, then a server took what b1 freed. p still does not fit and has nothing left to
    # preempt: it no longer holds back what it needs from team a's borrowers, or a2 never starts (and with a
    # job of a that preempts its own for that CPU, a's jobs take turns preempting each other for ever: the
    # settling property test found that).
    model = Model(
        [Team("a", nominal={"gpu/sim": 2}, cohort="c"), Team("b", nominal={"gpu/sim": 2}, cohort="c")], SIM4, cpu=4
    )
    fill(model, job("a1", "a"), job("b1", "b", priority=LOW))
    p = job("p", "b", priority=HIGH, cpu=3.0, created=1)
    assert pairs(model.cycle([p], now=1).preempted) == [("b1", "p")]
    model.release("b1")
    assert model.try_server(server("s", "a", 0), now=2)[0]

    decision = model.cycle([p, job("a2", "a", 2, created=2)], now=2)

    assert ids(decision.admitted) == ["a2"]
    assert decision.waiting == {"p": "waiting for 3 CPUs: b uses 0, cohort has 0 to lend, 1 free on the machine"}


# the backlog the model keeps between passes ---------------------------------------------------------------


def test_a_priority_changed_in_place_reorders_the_queue():
    model = solo({"gpu/sim": 1})
    fill(model, job("r", "solo"))
    first, second = job("first", "solo", created=1), job("second", "solo", created=2)
    assert model.cycle([first, second], now=3).positions == {"first": 1, "second": 2}

    second.reprioritize(HIGH)
    model.release("r")
    decision = model.cycle([first, second], now=4)

    assert ids(decision.admitted) == ["second"]


def test_a_workload_queued_again_as_a_new_object_replaces_the_old_one():
    model = solo({"gpu/sim": 1})
    fill(model, job("r", "solo"))
    old = job("x", "solo", created=1)
    model.cycle([old], now=2)
    model.release("r")

    decision = model.cycle([job("x", "solo", 0, created=1)], now=3)  # same id, another request

    assert ids(decision.admitted) == ["x"] and decision.admitted[0] is not old and not decision.admitted[0].devices


def test_a_copy_of_the_model_decides_as_the_model_does():
    import copy

    model = shared()
    fill(model, job("v1", "vision"), job("v2", "vision"), job("v3", "vision", created=1))
    pending = [job("n1", "nlp", priority=HIGH, created=2), job("v4", "vision", created=3)]
    model.cycle(pending, now=2)  # the backlog now holds them

    sim = copy.deepcopy(model)
    mine, theirs = model.cycle(pending, now=3), sim.cycle([copy.copy(w) for w in pending], now=3)

    assert (pairs(mine.preempted), dict(mine.waiting)) == (pairs(theirs.preempted), dict(theirs.waiting))


def test_waiting_reads_and_changes_like_a_dict():
    model = solo({"gpu/sim": 1})
    fill(model, job("r", "solo"))
    decision = model.cycle([job("a", "solo", created=1), job("b", "solo", created=2)], now=3)
    waiting = decision.waiting
    reason = "waiting for 1 `sim` GPU: solo uses 1/1, 3 free on the machine"

    assert waiting == {"a": reason, "b": reason} and len(waiting) == 2 and "a" in waiting
    waiting["c"] = "retrying later"
    del waiting["a"]
    assert dict(waiting) == {"b": reason, "c": "retrying later"} and waiting.get("a") is None


# victims among equals: the least work lost (checkpoints) ----------------------------------------------------


def test_among_equals_the_victim_is_the_job_with_the_freshest_checkpoint():
    model = solo()
    fill(model, job("l1", "solo", priority=LOW), now=0)
    fill(model, job("l2", "solo", priority=LOW), now=1)
    model.admitted["l1"].checkpointed_at = 5.0  # l1 would lose 1 s, l2 everything since it started (5 s)

    decision = model.cycle([job("h", "solo", priority=HIGH, created=6)], now=6)

    assert pairs(decision.preempted) == [("l1", "h")]


def test_a_checkpoint_older_than_the_attempt_counts_as_its_start():
    """A checkpoint of an earlier attempt is where this one began: only work since the later of the two is lost,
    so l1 (resumed from an old checkpoint, started at 0) loses more than l2 (started at 1)."""
    model = solo()
    fill(model, job("l1", "solo", priority=LOW), now=0)
    fill(model, job("l2", "solo", priority=LOW), now=1)
    model.admitted["l1"].checkpointed_at = -100.0

    decision = model.cycle([job("h", "solo", priority=HIGH, created=6)], now=6)

    assert pairs(decision.preempted) == [("l2", "h")]  # Kueue's order: most recently admitted


def test_priority_still_comes_before_a_fresh_checkpoint():
    model = solo()
    fill(model, job("low", "solo", priority=LOW), now=0)
    fill(model, job("normal", "solo", priority=NORMAL), now=1)
    model.admitted["normal"].checkpointed_at = 5.0

    decision = model.cycle([job("h", "solo", priority=HIGH, created=6)], now=6)

    assert pairs(decision.preempted) == [("low", "h")]
