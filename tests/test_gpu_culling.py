"""GPU-aware culling (danlu.hub.service.jobs.gpuculling): who is stopped, who is warned first, who is kept.

Pure: the verdict for a server from its devices' NVML samples, the hub's last activity and its user's
running jobs -- no false culls (a kernel computing on the CPU, a job attached, a device not measured).
Service tier, on the manager's real database: a pass warns an idle GPU server (the API's warnings), a
later pass stops it through the hub and writes the audit entry; a server whose GPU turns busy is kept.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

import pytest

from danlu.hub.service.jobs.gpuculling import GpuCuller, Policy, verdict
from danlu.hub.service.store.orm import AuditRecord, GpuSample, ServerUsage

from .fakes import InstantBackend, make_manager
from .gpukit import FLAVOR, GPU_PROFILES, fake_nvml_env, write_gpus

NOW = 1_800_000_000.0
POLICY = Policy(timeout=900, warning=300, threshold=5)


def samples(*devices: int, busy_until: float | None = None, until: float = NOW) -> dict:
    """A sample every 30 s for the last hour; busy (80%) up to ``busy_until``, then 1%."""
    out = {}
    for d in devices:
        out[d] = [
            (t, 80.0 if busy_until is not None and t <= busy_until else 1.0)
            for t in range(int(NOW - 3600), int(until) + 1, 30)
        ]
    return out


def decide(**changes):
    args = {
        "now": NOW,
        "started": NOW - 7200,
        "devices": [0],
        "samples": samples(0),
        "last_activity": NOW - 3600,
        "jobs_running": 0,
        "policy": POLICY,
    }
    return verdict(**{**args, **changes})


@pytest.mark.parametrize(
    ("changes", "action", "words"),
    [
        ({}, "cull", "GPU 0 idle for 60 minutes"),
        ({"samples": samples(0, busy_until=NOW - 700)}, "warn", "idle for 12 minutes"),  # 200 s left
        ({"samples": samples(0, busy_until=NOW - 300)}, "keep", "idle for 5 minutes"),
        ({"last_activity": NOW - 60}, "keep", "idle for 60 seconds"),  # a kernel busy on the CPU
        ({"jobs_running": 1}, "keep", "a job of its user is running"),
        ({"samples": {}}, "keep", "GPU 0 is not measured"),  # a declared device, or no NVML
        ({"samples": samples(0, until=NOW - 600)}, "keep", "GPU 0 is not measured"),  # NVML stopped answering
        (
            {"devices": [0, 1], "samples": {**samples(0), **samples(1, busy_until=NOW - 30)}},
            "keep",
            "idle for 30 seconds",
        ),
        ({"devices": []}, "keep", "holds no GPU"),
        ({"policy": Policy(timeout=0)}, "keep", "GPU culling is off"),
        ({"started": NOW - 600}, "warn", "idle for 10 minutes"),  # started 10 minutes ago: counted from its start
    ],
)
def test_a_server_is_culled_only_when_its_gpus_and_kernels_are_idle_and_no_job_runs(changes, action, words):
    found = decide(**changes)
    assert found.action == action and words in found.why, found
    if action == "warn":
        assert 0 < found.seconds_left <= POLICY.warning


def test_a_pass_warns_first_then_stops_the_server_through_the_hub_and_audits_it(tmp_path):
    manager = make_manager(InstantBackend(), tmp_path / "state")
    stopped: list[tuple[str, str]] = []
    activity = {"alice": (NOW - 3600), "bob": (NOW - 3600)}

    async def user(name):
        seen = dt.datetime.fromtimestamp(activity[name], dt.timezone.utc).isoformat()
        return {"name": name, "servers": {"": {"last_activity": seen}}}

    async def stop(name, server):
        stopped.append((name, server))

    culler = GpuCuller(manager.database, lambda slug: POLICY, user, stop, lambda owner: 0, logging.getLogger("t"))
    naive = lambda t: dt.datetime.fromtimestamp(t, dt.timezone.utc).replace(tzinfo=None)  # noqa: E731

    def fill(s):
        for holder, device in (("alice", 0), ("bob", 1)):
            s.add(
                ServerUsage(
                    holder=holder,
                    owner=holder,
                    team="",
                    profile="python",
                    flavor="sim",
                    devices=[device],
                    started_at=naive(NOW - 7200),
                )
            )
        for t in range(int(NOW - 3600), int(NOW + 1200), 30):
            s.add(GpuSample(device=0, at=naive(t), utilization=1.0))  # alice's: idle
            s.add(GpuSample(device=1, at=naive(t), utilization=1.0 if t < NOW - 800 else 90.0))  # bob's: busy again

    async def scenario():
        await manager.database.write(fill)
        activity["alice"] = NOW - 700  # her kernel last busy 11.7 minutes ago: 200 s left
        first = dict(await culler.pass_once(NOW))
        warned = culler.warnings("alice")
        before = list(stopped)
        later = dict(await culler.pass_once(NOW + 300))
        records = await manager.database.read(
            lambda s: [(r.action, r.target, r.after) for r in s.query(AuditRecord).filter_by(action="cull_gpu_server")]
        )
        return first, warned, before, later, records

    first, warned, before, later, records = asyncio.run(scenario())
    assert first["alice"].action == "warn" and first["bob"].action == "keep", first
    assert before == [] and [w["server"] for w in warned] == ["alice"] and culler.warnings("bob") == []
    w = warned[0]
    assert w["devices"] == [0] and w["reason"].startswith("GPU 0 idle for 12 minutes") and "CPU profile" in w["keep"]
    assert later["alice"].action == "cull" and stopped == [("alice", "")]
    assert records == [
        ("cull_gpu_server", "alice", {"devices": [0], "idle_minutes": 16.7, "reason": later["alice"].why})
    ]
    assert culler.warnings() == []  # the stopped server is warned no more


def culler_on(manager, user) -> tuple[GpuCuller, list[str]]:
    """A culler on the manager's database with ``user`` as the hub's answer; the users it stopped."""
    stopped: list[str] = []

    async def stop(name, server):
        stopped.append(name)

    culler = GpuCuller(manager.database, lambda slug: POLICY, user, stop, lambda owner: 0, logging.getLogger("t"))
    return culler, stopped


def idle_server(at: dt.datetime, seconds: int):
    """alice's server on device 0 since ``at``, which NVML saw idle every 30 s for ``seconds``."""

    def fill(s):
        s.add(
            ServerUsage(
                holder="alice", owner="alice", team="", profile="python", flavor="sim", devices=[0], started_at=at
            )
        )
        for t in range(0, seconds, 30):
            s.add(GpuSample(device=0, at=at + dt.timedelta(seconds=t), utilization=0.0))

    return fill


def test_a_server_due_between_two_passes_is_warned_for_the_whole_warning_before_it_is_stopped(tmp_path):
    manager = make_manager(InstantBackend(), tmp_path / "state")

    async def user(name):
        return {"servers": {"": {"last_activity": None}}}

    culler, stopped = culler_on(manager, user)
    fill = idle_server(dt.datetime.fromtimestamp(NOW - 3600, dt.timezone.utc).replace(tzinfo=None), 3600 + 400)

    async def scenario():
        await manager.database.write(fill)
        first = dict(await culler.pass_once(NOW))  # an hour idle: due, but never warned
        warned = culler.warnings("alice")
        second = dict(await culler.pass_once(NOW + 200))  # the warning's 300 s have not passed
        before = list(stopped)
        third = dict(await culler.pass_once(NOW + 301))
        return first, warned, second, before, third

    first, warned, second, before, third = asyncio.run(scenario())
    assert first["alice"].action == "warn" and first["alice"].seconds_left == POLICY.warning and warned
    assert second["alice"].action == "warn" and second["alice"].seconds_left == 100 and before == []
    assert third["alice"].action == "cull" and stopped == ["alice"]


def test_a_server_whose_activity_the_hub_does_not_give_is_kept(tmp_path):
    manager = make_manager(InstantBackend(), tmp_path / "state")

    async def nobody(name):
        return None  # the hub is restarting

    culler, stopped = culler_on(manager, nobody)
    fill = idle_server(dt.datetime.fromtimestamp(NOW - 3600, dt.timezone.utc).replace(tzinfo=None), 3600)

    async def scenario():
        await manager.database.write(fill)
        return dict(await culler.pass_once(NOW))

    found = asyncio.run(scenario())
    assert found["alice"].action == "keep" and "did not answer" in found["alice"].why and stopped == []


def test_the_services_culler_takes_each_profiles_timeout_and_reads_samples_beyond_the_longest():
    from types import SimpleNamespace

    from danlu.hub.service.jobs.gpuculling import for_service

    hub = SimpleNamespace(gpu_idle_timeout_seconds=900, gpu_idle_warning_seconds=300, gpu_idle_threshold_percent=5.0)
    profiles = [
        SimpleNamespace(slug="big", gpu_idle_timeout_seconds=7200),
        SimpleNamespace(slug="python", gpu_idle_timeout_seconds=None),
    ]
    manager = SimpleNamespace(
        settings=SimpleNamespace(hub=hub),
        profiles=profiles,
        scheduler=SimpleNamespace(sample_interval=60.0),
        database=None,
        groups=SimpleNamespace(user=None),
        core=SimpleNamespace(model=SimpleNamespace(admitted={})),
    )
    culler = for_service(manager, "http://hub/api", "token", logging.getLogger("t"))
    assert culler.policy_for("big").timeout == 7200 and culler.policy_for("python").timeout == 900
    assert culler.policy_for("gone").timeout == 900 and culler.policy_for("python").stale == 240
    assert culler.window == 7200 + 240  # a busy sample two hours ago still counts for "big"
    hub.gpu_idle_timeout_seconds = 0
    assert for_service(manager, "http://hub/api", "token", logging.getLogger("t")) is None  # off everywhere


# the service tier: a real workbench on GPUs of tests/fakenvml ---------------------------------------------
@pytest.mark.service
def test_an_idle_gpu_server_is_warned_then_stopped_and_audited(tmp_path):
    import time

    import requests

    from danlu.hub.testing import Workbench

    nvml = tmp_path / "nvml.json"
    write_gpus(nvml, 2, 0)
    (tmp_path / "danlu_service_config.py").write_text("c.JobsServiceApp.gpu_sample_interval = 1\n")
    config = {
        "admin_users": ["admin"],
        "groups": {"research": ["bob"]},
        "teams": {"research": {"quota": {"gpus": {FLAVOR: 2}}}},
        "hub": {"idle_timeout_seconds": 0, "gpu_idle_timeout_seconds": 25, "gpu_idle_warning_seconds": 20},
    }
    wb = Workbench(tmp_path, config=config, profiles=GPU_PROFILES, extra_env=fake_nvml_env(nvml))
    wb.start()
    try:
        token = wb.create_user("bob", ["research"])
        gpus = wb.api("GET", "/allocations").json()["gpus"]
        assert [g["flavor"] for g in gpus] == [FLAVOR] * 2, gpus  # detected through the fake NVML
        r = wb.start_server("bob", {"profile": "python", "gpus": 1})
        assert r.status_code in (201, 202), r.text

        def warnings():
            return wb.api("GET", "/servers/warnings", token=token).json()["warnings"]

        deadline = time.monotonic() + 120
        while not warnings() and time.monotonic() < deadline:
            time.sleep(1)
        warned = warnings()
        assert warned and warned[0]["user"] == "bob" and 0 < warned[0]["seconds_left"] <= 20, warned
        assert "CPU profile" in warned[0]["keep"] and warned[0]["reason"].startswith("GPU ")

        def running() -> bool:
            model = requests.get(
                f"{wb.url}/hub/api/users/bob", headers={"Authorization": f"token {wb.admin_token}"}, timeout=30
            ).json()
            return bool((model.get("servers") or {}).get(""))

        deadline = time.monotonic() + 120
        while running() and time.monotonic() < deadline:
            time.sleep(1)
        assert not running(), "the idle GPU server was not stopped"
        audit = wb.api("GET", "/audit?action=cull_gpu_server").json()
        records = audit.get("records", audit) if isinstance(audit, dict) else audit
        assert [r["target"] for r in records] == ["bob"], records
        assert wb.api("GET", "/servers/warnings", token=token).json() == {"warnings": []}
        assert not [a for a in wb.api("GET", "/allocations").json()["allocations"] if a.get("kind") == "server"]
    finally:
        code = wb.stop()
    assert code == 0, wb.log_tail()
