"""Pure tests of the warm-runner pool: started on demand, reaped when unused, capped in all and per user.

The runners are fakes (no process); the clock is the test's, so idle times pass without waiting.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from danlu.hub.backends.warm import WarmPool


class FakeRunner:
    def __init__(self, kernel: str, account):
        self.kernel = kernel
        self.uid = account.uid if account is not None else None
        self.proc = SimpleNamespace(returncode=None)
        self.stopped = False

    @property
    def usable(self) -> bool:
        return not self.stopped

    async def stop(self) -> None:
        self.stopped = True
        self.proc.returncode = 0


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_pool(size=1, idle=600.0, max_total=4, per_account=2, slow=None):
    started: list[FakeRunner] = []
    clock = Clock()

    async def spawn(kernel, account):
        if slow is not None:
            await slow.wait()
        runner = FakeRunner(kernel, account)
        started.append(runner)
        return runner

    pool = WarmPool(spawn, size, idle_seconds=idle, max_total=max_total, max_per_account=per_account, clock=clock)
    return pool, started, clock


def user(uid: int):
    return SimpleNamespace(uid=uid, name=f"u{uid}")


def run(coro):
    return asyncio.run(coro)


def test_nothing_is_started_before_a_demand_and_a_demand_fills_the_pool():
    async def scenario():
        pool, started, _ = make_pool(size=2)
        assert pool.count() == 0 and started == []
        await pool.top_up("python3")
        assert pool.count() == 2 and len(started) == 2
        taken = pool.take("python3")
        assert taken in started and pool.count() == 1
        await pool.stop_all()

    run(scenario())


def test_unused_runners_are_reaped_after_the_idle_time_and_come_back_on_demand():
    async def scenario():
        pool, started, clock = make_pool(idle=600)
        await pool.top_up("python3")
        clock.now += 599
        assert await pool.reap() == 0 and pool.count() == 1
        clock.now += 1
        assert await pool.reap() == 1
        assert pool.count() == 0 and started[0].stopped
        await pool.top_up("python3")
        assert pool.count() == 1 and len(started) == 2
        await pool.stop_all()

    run(scenario())


def test_taking_a_runner_is_demand_that_keeps_the_pool():
    async def scenario():
        pool, _, clock = make_pool(idle=600)
        await pool.top_up("python3")
        clock.now += 500
        pool.take("python3")
        await pool.top_up("python3")  # the refill after a job
        clock.now += 500
        assert await pool.reap() == 0 and pool.count() == 1
        await pool.stop_all()

    run(scenario())


def test_at_most_max_total_wait_and_newer_demand_evicts_the_least_recently_used():
    async def scenario():
        pool, started, clock = make_pool(max_total=2)
        await pool.top_up("a")
        clock.now += 10
        await pool.top_up("b")
        clock.now += 10
        await pool.top_up("c")  # a's runner, the oldest demand, makes room
        assert pool.count() == 2
        assert [r.kernel for r in started if r.stopped] == ["a"]
        assert pool.count(("b", None)) == 1 and pool.count(("c", None)) == 1
        await pool.stop_all()

    run(scenario())


def test_one_user_holds_at_most_max_per_account():
    async def scenario():
        pool, started, _ = make_pool(size=2, per_account=2, max_total=10)
        alice, bob = user(1001), user(1002)
        await pool.top_up("a", alice)
        await pool.top_up("b", alice)  # alice already holds two
        assert pool.count(("a", 1001)) == 2 and pool.count(("b", 1001)) == 0
        await pool.top_up("a", bob)
        assert pool.count(("a", 1002)) == 2 and len(started) == 4
        await pool.stop_all()

    run(scenario())


def test_a_runner_that_finishes_starting_after_its_pool_was_reaped_is_stopped_not_leaked():
    async def scenario():
        gate = asyncio.Event()
        pool, started, clock = make_pool(idle=1, slow=gate)
        filling = asyncio.ensure_future(pool.top_up("python3"))
        await asyncio.sleep(0)
        clock.now += 5
        await pool.reap()  # the key goes while its runner is still starting
        gate.set()
        await filling
        assert len(started) == 1 and started[0].stopped and pool.count() == 0
        await pool.stop_all()

    run(scenario())


def test_stop_all_stops_every_waiting_runner_and_refuses_new_ones():
    async def scenario():
        pool, started, _ = make_pool(size=1)
        await pool.top_up("a")
        await pool.top_up("b")
        await pool.stop_all()
        assert all(r.stopped for r in started) and pool.count() == 0
        await pool.top_up("c")
        assert len(started) == 2

    run(scenario())
