"""Property tests of the admission model: random machines, teams and event streams.

A hypothesis state machine builds a random configuration (1-4 GPU flavors of
1-8 devices, 1-6 teams with random nominal quotas, optional cohorts, borrowing
and lending limits, preemption policies, a starvation threshold), then plays the
service's part at random: submit workloads, run admission cycles, complete
admitted jobs, release preempted victims a cycle or more later and resubmit
them, open and close notebook servers. After every step it checks what must
always hold:

(a) no team uses more of a quoted resource than nominal + borrowing limit, and a
    team in no cohort never more than its nominal quota;
(b) in every cohort, what members use beyond their nominal quota never exceeds
    what the others could lend (their unused quota, capped by lending limits);
(c) total use never exceeds the machine, per GPU flavor, CPU and memory;
(d) no device is held twice, and every admitted GPU workload holds exactly its
    number of devices, of its flavor;

(g) a pass decides exactly what a copy of the model decides from scratch (the
    backlog the model keeps between passes and its caches change no decision);
(h) in one pass, a cohort preempts for one workload at most (a team in no cohort
    for its own), as Kueue does;

and at the end (e): once submissions stop, servers close and jobs keep
completing (victims released and resubmitted), every workload that fits on the
idle machine is admitted within a bounded number of cycles. CPU and memory are
quoted only for teams that set them (the model's rule: otherwise only the
machine limits them). Along the way: a workload is called impossible exactly
when it fits nowhere on the idle machine, and no pass admits and preempts the
same workload. ``SettlingMachine`` adds (f): with no job ending, preemption
settles (it only moves capacity to more entitled jobs).
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from danlu.hub.service.admission.model import Model
from danlu.hub.service.admission.workloads import Request, Team, Workload, gpu_key

GIB = 2**30
EPS = 1e-6
FLAVORS = ("f0", "f1", "f2", "f3")
PRIORITIES = (100, 1000, 10000, 100000)


@st.composite
def configs(draw):
    devices, index = {}, 0
    for flavor in FLAVORS[: draw(st.integers(1, 4))]:
        count = draw(st.integers(1, 8))
        devices[flavor] = list(range(index, index + count))
        index += count
    cpu = draw(st.sampled_from([4.0, 8.0, 16.0, 32.0]))
    memory = draw(st.sampled_from([math.inf, 16.0 * GIB, 64.0 * GIB]))
    cohorts = [None] + [f"c{k}" for k in range(draw(st.integers(0, 2)))]
    teams = []
    for i in range(draw(st.integers(1, 6))):
        nominal = {gpu_key(f): float(draw(st.integers(0, len(ids)))) for f, ids in devices.items()}
        if draw(st.booleans()):
            nominal["cpu"] = float(draw(st.sampled_from([1, 2, 4, 8])))
        if draw(st.integers(0, 3)) == 0:
            nominal["memory"] = float(draw(st.sampled_from([4, 8, 16]))) * GIB
        cohort = draw(st.sampled_from(cohorts))
        borrowing, lending = {}, {}
        if cohort:
            for resource, amount in nominal.items():
                unit = GIB if resource == "memory" else 1
                if draw(st.integers(0, 2)) == 0:
                    borrowing[resource] = float(draw(st.integers(0, 4)) * unit)
                if draw(st.integers(0, 2)) == 0:
                    lending[resource] = float(draw(st.integers(0, int(amount / unit))) * unit)
        teams.append(
            Team(
                f"t{i}",
                nominal=nominal,
                borrowing_limit=borrowing,
                lending_limit=lending,
                cohort=cohort,
                flavors=tuple(draw(st.permutations(list(devices)))),
                within_team=draw(st.sampled_from(["lower_priority", "never"])),
                reclaim=draw(st.sampled_from(["any", "lower_priority", "never"])),
            )
        )
    starvation = draw(st.sampled_from([5.0, 30.0, 600.0]))
    return teams, devices, cpu, memory, starvation


def requests(devices: dict[str, list[int]]):
    gpus = st.sampled_from([0, 0, 1, 1, 1, 2, 2, 4, 8, 9])
    flavor = st.one_of(st.none(), st.none(), st.sampled_from(sorted(devices) + ["nope"]))
    return st.builds(
        lambda g, f, c, m: Request(gpus=g, gpu_flavor=f if g else None, cpu=c, memory=m * GIB),
        gpus,
        flavor,
        st.sampled_from([0.5, 1.0, 1.0, 2.0, 4.0, 64.0]),
        st.sampled_from([0, 0, 1, 4, 8]),
    )


class AdmissionMachine(RuleBasedStateMachine):
    """The service around a :class:`Model`: a pending list, victims that stop later, servers."""

    @initialize(config=configs())
    def setup(self, config):
        self.teams, self.devices, cpu, memory, starvation = config
        make = lambda: Model(self.teams, self.devices, cpu=cpu, memory=memory, starvation_seconds=starvation)
        self.model = make()
        self.idle = make()  # the oracle: what a workload needs fits here, or it can never start
        self.pending: dict[str, Workload] = {}
        self.stopping: dict[str, int] = {}  # victim id -> cycles since it was preempted
        self.servers: set[str] = set()
        self.now = 0.0
        self.serial = 0

    # what the oracle says ---------------------------------------------------------------------------------
    def fits_idle(self, wl: Workload) -> bool:
        return self.idle.fit(wl)[0] is not False

    # events -----------------------------------------------------------------------------------------------
    def new_workload(self, data, kind: str) -> Workload:
        self.serial += 1
        team = data.draw(st.sampled_from(sorted(self.model.teams)))
        return Workload(
            f"w{self.serial}",
            team,
            data.draw(st.sampled_from(PRIORITIES)),
            self.now,
            data.draw(requests(self.devices)),
            kind=kind,
        )

    @rule(data=st.data(), count=st.integers(1, 4))
    def submit(self, data, count):
        for _ in range(count):
            wl = self.new_workload(data, "job")
            self.pending[wl.id] = wl

    @rule(advance=st.sampled_from([0.0, 1.0, 4.0, 20.0]))
    def cycle(self, advance):
        self.now += advance
        self.run_cycle()

    @precondition(lambda self: any(not w.stopping and w.kind == "job" for w in self.model.admitted.values()))
    @rule(data=st.data())
    def complete(self, data):
        running = sorted(w.id for w in self.model.admitted.values() if not w.stopping and w.kind == "job")
        assert self.model.release(data.draw(st.sampled_from(running))) is not None

    @precondition(lambda self: any(cycles >= 1 for cycles in self.stopping.values()))
    @rule(data=st.data())
    def victim_stopped(self, data):
        ready = sorted(wid for wid, cycles in self.stopping.items() if cycles >= 1)
        self.release_victim(data.draw(st.sampled_from(ready)))

    @rule(data=st.data())
    def open_server(self, data):
        wl = self.new_workload(data, "server")
        ok, reason = self.model.try_server(wl, self.now)
        assert ok == (wl.id in self.model.admitted)
        assert ok or reason
        if ok:
            self.servers.add(wl.id)

    @precondition(lambda self: self.servers)
    @rule(data=st.data())
    def close_server(self, data):
        sid = data.draw(st.sampled_from(sorted(self.servers)))
        self.servers.discard(sid)
        assert self.model.release(sid) is not None

    # the service's part -----------------------------------------------------------------------------------
    def close_servers(self) -> None:
        for sid in sorted(self.servers):
            self.model.release(sid)
        self.servers.clear()

    def release_victim(self, wid: str) -> None:
        victim = self.model.release(wid)
        del self.stopping[wid]
        assert victim is not None and victim.stopping
        self.pending[wid] = Workload(
            wid, victim.team, victim.priority, victim.created, victim.request, kind=victim.kind
        )

    def run_cycle(self):
        before = dict(self.model.admitted)
        was_stopping = {wid for wid, wl in before.items() if wl.stopping}
        pending = dict(self.pending)
        fresh = copy.deepcopy(self.model)  # (g): no backlog, no caches
        again = fresh.cycle([copy.copy(w) for w in pending.values()], self.now)
        decision = self.model.cycle(list(pending.values()), self.now)
        admitted = [w.id for w in decision.admitted]
        assert [(w.id, w.flavor, w.devices) for w in decision.admitted] == [
            (w.id, w.flavor, w.devices) for w in again.admitted
        ]
        assert [(v.id, p.id) for v, p in decision.preempted] == [(v.id, p.id) for v, p in again.preempted]
        assert dict(decision.waiting) == dict(again.waiting)

        assert len(set(admitted)) == len(admitted) and set(admitted) <= set(pending)
        assert set(admitted).isdisjoint(decision.waiting)
        assert set(admitted) | set(decision.waiting) == set(pending)
        assert set(decision.positions) == set(decision.waiting)
        by_team = defaultdict(list)
        for wid in decision.waiting:
            by_team[pending[wid].team].append(decision.positions[wid])
        for places in by_team.values():
            assert sorted(places) == list(range(1, len(places) + 1))

        for wl in decision.admitted:
            assert self.model.admitted[wl.id] is wl and wl.admitted_at == self.now
            assert (wl.flavor is not None) == bool(wl.request.gpus)
            if wl.request.gpu_flavor:
                assert wl.flavor == wl.request.gpu_flavor
        for wid, reason in decision.waiting.items():
            wl = pending[wid]
            never = reason.endswith("it can never start")
            assert never == (self.model.impossible(wl) is not None)
            assert never == (not self.fits_idle(wl)), f"{wid} {wl.request} on the idle machine: {reason}"

        victims = [v.id for v, _ in decision.preempted]
        assert len(set(victims)) == len(victims)
        for victim, for_whom in decision.preempted:
            assert victim.id in before or victim.id in admitted
            assert victim.id not in was_stopping and victim.stopping and victim.stopping_for == for_whom.id
            assert victim.kind == "job", "a server was preempted"
            assert for_whom.id in decision.waiting
            mine, theirs = self.model.teams[for_whom.team], self.model.teams[victim.team]
            if victim.team == for_whom.team:
                assert mine.within_team == "lower_priority" and victim.priority < for_whom.priority
            else:
                assert mine.cohort and mine.cohort == theirs.cohort and mine.reclaim != "never"
                if mine.reclaim == "lower_priority":
                    assert victim.priority < for_whom.priority

        assert not set(admitted) & set(victims), "admitted and preempted in the same pass"
        # (h) as Kueue: in one pass, a cohort preempts for one workload at most (a team in no cohort for its own)
        preemptors = {for_whom.id: for_whom for _, for_whom in decision.preempted}.values()
        circles = [
            ("cohort", self.model.teams[p.team].cohort) if self.model.teams[p.team].cohort else ("team", p.team)
            for p in preemptors
        ]
        assert len(circles) == len(set(circles)), f"one cohort preempted for several workloads in a pass: {circles}"
        for wid in self.stopping:
            self.stopping[wid] += 1
        for victim in victims:
            self.stopping[victim] = 0
        for wid in admitted:
            del self.pending[wid]
        return decision

    # invariants -------------------------------------------------------------------------------------------
    @invariant()
    def safe(self):
        model = self.model
        use: dict[str, dict[str, float]] = {name: defaultdict(float) for name in model.teams}
        total: dict[str, float] = defaultdict(float)
        held: dict[int, str] = {}
        for wid, wl in model.admitted.items():
            for resource, amount in wl.usage().items():
                use[wl.team][resource] += amount
                total[resource] += amount
            if wl.request.gpus:  # (d)
                assert wl.flavor in self.devices and len(wl.devices) == wl.request.gpus
                assert set(wl.devices) <= set(self.devices[wl.flavor])
            else:
                assert wl.devices == ()
            for device in wl.devices:
                assert device not in held, f"device {device} held by {held[device]} and {wid}"
                held[device] = wid
        for flavor, ids in self.devices.items():  # the model's own books agree
            assert sorted(model.free_devices[flavor] + [d for d in held if d in ids]) == ids
        for name in model.teams:
            for resource in set(use[name]) | set(model.used[name]):
                assert math.isclose(use[name][resource], model.used[name][resource], abs_tol=EPS)

        for name, team in model.teams.items():  # (a)
            for resource in quoted(team, self.devices):
                limit = team.nominal.get(resource, 0.0)
                if team.cohort:
                    limit += team.borrowing_limit.get(resource, math.inf)
                assert use[name][resource] <= limit + EPS, f"{name} uses {use[name][resource]} {resource} > {limit}"

        for cohort, names in model.cohorts.items():  # (b)
            resources = {r for name in names for r in quoted(model.teams[name], self.devices)}
            for resource in resources:
                borrowed = lendable = 0.0
                for name in names:
                    team = model.teams[name]
                    if resource not in quoted(team, self.devices):
                        continue
                    nominal, used = team.nominal.get(resource, 0.0), use[name][resource]
                    borrowed += max(0.0, used - nominal)
                    lendable += min(max(0.0, nominal - used), team.lending_limit.get(resource, math.inf))
                assert borrowed <= lendable + EPS, f"cohort {cohort} borrows {borrowed} {resource} of {lendable}"

        for resource, capacity in model.capacity.items():  # (c)
            assert total[resource] <= capacity + EPS, f"{total[resource]} {resource} used of {capacity}"

    # (e) -----------------------------------------------------------------------------------------------------
    def teardown(self):
        if not hasattr(self, "model"):
            return
        self.close_servers()
        jobs = len(self.pending) + len(self.model.admitted)
        for _ in range(2 * jobs + 5):
            for wid in sorted(self.stopping):
                self.release_victim(wid)
            self.now += 1.0
            self.run_cycle()
            self.safe()
            waiting = sorted(wid for wid, wl in self.pending.items() if self.fits_idle(wl))
            assert self.model.admitted or not waiting, f"nothing runs, yet {waiting} could: a stall"
            running = sorted((w.admitted_at, w.id) for w in self.model.admitted.values() if not w.stopping)
            if running:
                self.model.release(running[0][1])
            elif not waiting and not self.model.admitted:
                break
        left = sorted(wid for wid, wl in self.pending.items() if self.fits_idle(wl))
        assert not left, f"still waiting after {2 * jobs + 5} cycles of draining: {left}"


def quoted(team: Team, devices: dict[str, list[int]]) -> list[str]:
    """The resources a team's quota limits: every GPU flavor, CPU and memory when it sets them."""
    return [gpu_key(f) for f in devices] + [r for r in ("cpu", "memory") if r in team.nominal]


# print_blob: Hypothesis draws from the constants of every loaded module, so what CI (the whole suite collected)
# generates differs from a run of this file alone; `pytest tests -k settles` sees what CI sees, the blob replays it
SETTINGS = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
AdmissionMachine.TestCase.settings = SETTINGS
TestAdmission = AdmissionMachine.TestCase


class SettlingMachine(AdmissionMachine):
    """The same events, then no job completes: victims stop and are queued again, and passes keep running.
    Preemption only moves capacity to more entitled jobs, so the passes must reach a quiet one (nothing
    admitted, nothing preempted, nothing stopping), after which nothing changes."""

    def teardown(self):
        if not hasattr(self, "model"):
            return
        self.close_servers()
        bound = 4 * (len(self.pending) + len(self.model.admitted)) + 10
        for _ in range(bound):
            for wid in sorted(self.stopping):
                self.release_victim(wid)
            self.now += 1.0
            decision = self.run_cycle()
            self.safe()
            if not decision.admitted and not decision.preempted and not self.stopping:
                return
        raise AssertionError(f"still admitting and preempting after {bound} passes without a job ending")


def test_preemption_settles_when_no_job_ends():
    run_state_machine_as_test(SettlingMachine, settings=settings(SETTINGS, phases=[Phase.generate]))
