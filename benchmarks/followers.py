"""What log followers cost the jobs service, and whether it all comes back when they leave.

One real workbench, one long job; then ``--followers`` clients follow its log
(``GET /jobs/{id}/logs?follow=true``, half plain text, half server-sent
events) for ``--hold`` seconds and disconnect. Printed: the service process's
resident memory, open files, threads and event-loop tasks (its own gauge)
before, while the followers are connected, and after they left, and the
difference after - before (the baseline is measured in the same run).

Run: ``.venv/bin/python benchmarks/followers.py [--followers 200] [--hold 10]``.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from danlu.hub.testing import Workbench
from tests.conftest import CONFIG, PROFILES
from tests.test_resilience import notebook


def service(wb: Workbench) -> psutil.Process:
    return next(p for p in wb.processes() if "danlu.hub.service" in " ".join(p.cmdline()))


def sample(wb: Workbench) -> dict:
    proc = service(wb)
    text = requests.get(
        f"{wb.url}/services/danlu/metrics", headers={"Authorization": f"token {wb.admin_token}"}, timeout=30
    ).text
    tasks = float(re.search(r"^danlu_event_loop_tasks (\S+)$", text, re.M).group(1))
    followers = float(re.search(r"^danlu_log_followers (\S+)$", text, re.M).group(1))
    return {
        "rss_mib": proc.memory_info().rss / 2**20,
        "open_files": proc.num_fds(),
        "threads": proc.num_threads(),
        "loop_tasks": tasks,
        "followers": followers,
    }


def follow(wb: Workbench, token: str, job_id: str, sse: bool, stop: threading.Event, opened: list) -> None:
    headers = {"Authorization": f"token {token}", **({"Accept": "text/event-stream"} if sse else {})}
    with requests.get(
        f"{wb.url}/services/danlu/api/v1/jobs/{job_id}/logs",
        params={"follow": "true"},
        headers=headers,
        stream=True,
        timeout=(30, None),
    ) as r:
        opened.append(r.status_code)
        for _ in r.iter_content(chunk_size=None):
            if stop.is_set():
                break


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--followers", type=int, default=200, help="concurrent followers (default 200)")
    parser.add_argument("--hold", type=float, default=10.0, help="seconds they stay connected (default 10)")
    args = parser.parse_args(argv)
    users = max(1, -(-args.followers // 30))  # at most 30 per user, under the per-user cap of 32
    with tempfile.TemporaryDirectory(prefix="danlu-followers-") as tmp:
        print("starting a workbench (danlu up) ...", flush=True)
        wb = Workbench(
            Path(tmp), config={**CONFIG, "jobs": {**CONFIG["jobs"], "warm_runners": 0}}, profiles=PROFILES
        ).start()
        try:
            tokens = [wb.create_user(f"user{i}", ["research"]) for i in range(users)]
            jobs = []
            for token in tokens:
                r = wb.api(
                    "POST",
                    "/jobs",
                    token=token,
                    json={
                        "notebook": notebook(
                            "import time\nfor i in range(600):\n    print('step', i, flush=True)\n    time.sleep(1)"
                        )
                    },
                )
                jobs.append(r.json()["id"])
            for job_id, token in zip(jobs, tokens, strict=True):
                while wb.api("GET", f"/jobs/{job_id}", token=token).json()["state"] != "running":
                    time.sleep(0.5)
            time.sleep(3)
            before = sample(wb)
            stop, opened, threads = threading.Event(), [], []
            for i in range(args.followers):
                k = i % users
                t = threading.Thread(
                    target=follow, args=(wb, tokens[k], jobs[k], i % 2 == 1, stop, opened), daemon=True
                )
                t.start()
                threads.append(t)
            deadline = time.monotonic() + 60
            while len(opened) < args.followers and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(args.hold)
            during = sample(wb)
            stop.set()
            for t in threads:
                t.join(30)
            time.sleep(5)
            after = sample(wb)
        finally:
            wb.stop()
    print(f"\n{args.followers} followers ({sum(1 for c in opened if c == 200)} answered 200), held {args.hold:g} s")
    print(f"{'':<12} {'before':>10} {'during':>10} {'after':>10} {'after-before':>14}")
    for key in before:
        print(
            f"{key:<12} {before[key]:>10.1f} {during[key]:>10.1f} {after[key]:>10.1f} {after[key] - before[key]:>14.1f}"
        )
    per = (during["rss_mib"] - before["rss_mib"]) * 1024 / max(1, args.followers)
    print(
        f"\nmemory per connected follower: {per:.1f} KiB; the service returns to its baseline when they leave "
        "if after-before is about 0 (threads: pools that grew stay)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
