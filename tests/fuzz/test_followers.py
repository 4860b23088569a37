"""Service tier: log followers hold bounded resources and let go of all of them when their clients leave.

Fifty clients follow one running job's log (plain text and server-sent events, two users); the service's
gauges (``danlu_log_followers``, ``danlu_event_loop_tasks``) rise while they are open, a follower over the
per-user cap gets a 429, and once the clients disconnect the gauges and the service process's open files
come back to where they were, and its threads to within what its bounded thread pools may add. A first,
identical round warms those pools and the proxy's connections, so the second is measured from a steady
baseline. The workbench is the fuzz tier's (no warm runner, drained but for this one job). Polls with a
deadline, no timings.
"""

from __future__ import annotations

import re
import socket
import time

import psutil
import pytest
import requests

from danlu.hub.service.api.jobs import MAX_FOLLOWERS_PER_USER

pytestmark = pytest.mark.service

NB = {
    "cells": [
        {
            "cell_type": "code",
            "id": "c1",
            "metadata": {},
            "outputs": [],
            "execution_count": None,
            "source": "import time\nprint('following me', flush=True)\ntime.sleep(900)",
        }
    ],
    "metadata": {},
    "nbformat": 4,
    "nbformat_minor": 5,
}
FOLLOWERS = 50
DEADLINE = 120
# The service's thread pools (database, job files, the resolver's) start threads on demand up to a few each
# and keep them, so a round may leave a few more than the warm-up did; a thread per follower would be 50.
POOL_GROWTH = 8
# The proxy keeps a few idle keep-alive connections to the service open between requests and may reuse them.
KEEPALIVE_REUSE = 10


def eventually(what: str, probe, ok, deadline: float = DEADLINE):
    """``probe()`` until ``ok(value)``; the value, or an AssertionError that names ``what`` and the last value."""
    end = time.monotonic() + deadline
    while True:
        value = probe()
        if ok(value):
            return value
        if time.monotonic() > end:
            raise AssertionError(f"{what}: still {value} after {deadline}s")
        time.sleep(0.5)


class Follower:
    """One client following the log over its own connection, until :meth:`close`."""

    def __init__(self, wb, job_id: str, token: str, sse: bool = False):
        self.sock = socket.create_connection(("127.0.0.1", wb.port), timeout=60)
        accept = "text/event-stream" if sse else "text/plain"
        self.sock.sendall(
            f"GET /services/danlu/api/v1/jobs/{job_id}/logs?follow=true HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{wb.port}\r\nAuthorization: token {token}\r\nAccept: {accept}\r\n"
            "\r\n".encode()
        )
        self.head = b""
        while b"\r\n\r\n" not in self.head:  # the status line and headers: the follower is in
            chunk = self.sock.recv(65536)
            assert chunk, f"the connection closed after {self.head!r}"
            self.head += chunk
        self.status = int(self.head.split(b" ", 2)[1])

    def close(self) -> None:
        self.sock.close()


def open_followers(wb, job_id: str) -> list[Follower]:
    """Alice up to her cap and the admin user for the rest; one more of alice's is refused."""
    alice, admin = wb.tokens["alice"], wb.tokens["admin"]
    followers = [Follower(wb, job_id, alice, sse=i % 2 == 0) for i in range(MAX_FOLLOWERS_PER_USER)]
    followers += [Follower(wb, job_id, admin, sse=i % 2 == 1) for i in range(FOLLOWERS - MAX_FOLLOWERS_PER_USER)]
    assert [f.status for f in followers] == [200] * FOLLOWERS, [f.head[:200] for f in followers if f.status != 200]
    over = Follower(wb, job_id, alice)
    over.close()
    assert over.status == 429 and b"application/json" in over.head, over.head
    return followers


def gauges(wb) -> dict[str, float]:
    r = requests.get(
        f"{wb.url}/services/danlu/metrics", headers={"Authorization": f"token {wb.admin_token}"}, timeout=60
    )
    assert r.status_code == 200, r.text
    found = dict(re.findall(r"^(danlu_log_followers|danlu_event_loop_tasks) (\S+)$", r.text, re.M))
    return {name: float(value) for name, value in found.items()}


def service_process(wb) -> psutil.Process:
    found = [p for p in wb.processes() if "danlu.hub.service" in " ".join(p.cmdline())]
    assert len(found) == 1, found
    return found[0]


def measure(wb, proc: psutil.Process) -> dict[str, float]:
    return {**gauges(wb), "fds": proc.num_fds(), "threads": proc.num_threads()}


def steady(wb, proc: psutil.Process) -> dict[str, float]:
    """The measures once two looks in a row agree (connections that were closed have finished closing)."""
    end = time.monotonic() + DEADLINE
    last = measure(wb, proc)
    while True:
        time.sleep(0.5)
        now = measure(wb, proc)
        if now == last:
            return now
        assert time.monotonic() < end, f"the service did not settle: {last}, then {now}"
        last = now


def test_followers_are_bounded_and_released_on_disconnect(fuzz_workbench, run_one_job):
    wb = fuzz_workbench
    job_id = run_one_job("alice", {"notebook": NB, "name": "followed"})
    try:
        assert wb.api("GET", f"/jobs/{job_id}", token=wb.tokens["alice"]).json()["state"] == "running"
        proc = service_process(wb)
        for follower in open_followers(wb, job_id):  # the warm-up round
            follower.close()
        eventually("followers after the warm-up round", lambda: gauges(wb)["danlu_log_followers"], lambda v: v == 0)
        before = steady(wb, proc)

        followers = open_followers(wb, job_id)
        try:
            held = eventually(
                "followers while they are open",
                lambda: measure(wb, proc),
                lambda now: now["danlu_log_followers"] == FOLLOWERS,
            )
            assert held["danlu_event_loop_tasks"] >= before["danlu_event_loop_tasks"] + FOLLOWERS, (before, held)
            # each follower holds a connection from the proxy, but the proxy may hand a follower one of the
            # keep-alive connections already open in ``before``: most, not all, are new files
            assert held["fds"] >= before["fds"] + FOLLOWERS - KEEPALIVE_REUSE, (before, held)
        finally:
            for follower in followers:
                follower.close()

        eventually("followers after the clients left", lambda: gauges(wb)["danlu_log_followers"], lambda v: v == 0)
        eventually(
            f"the service's tasks, open files and threads (before the round: {before})",
            lambda: measure(wb, proc),
            lambda now: (
                now["danlu_event_loop_tasks"] <= before["danlu_event_loop_tasks"]
                and now["fds"] <= before["fds"]
                and now["threads"] <= before["threads"] + POOL_GROWTH
            ),
        )
        assert wb.api("GET", f"/jobs/{job_id}", token=wb.tokens["alice"]).json()["state"] == "running"
    finally:
        wb.api("POST", f"/jobs/{job_id}/cancel", token=wb.tokens["alice"])
        wb.wait_job(job_id, wb.tokens["alice"])
