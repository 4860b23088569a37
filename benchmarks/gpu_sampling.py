"""What sampling the GPUs costs the jobs service: the share of one CPU core at the default interval.

Every ``gpu_sample_interval`` (30 s) the service reads each detected GPU's utilization through NVML and
stores one ``gpu_samples`` row per device on its database writer thread (:func:`sample_gpus`), and the
GPU-aware culler reads the held devices' samples back (:class:`GpuCuller`). This measures both on the
service's own database (SQLite in a temporary state folder), for 8 GPUs held by 8 servers, against
``tests/fakenvml`` (NVML itself is not counted: a real ``nvmlDeviceGetUtilizationRates`` costs some tens
of microseconds a device on the driver, which ``tests/gpu/`` measures on a GPU machine).

Printed: the CPU seconds of one sample pass and of one culling pass (medians over ``--passes``), each as a
share of a core at the default intervals (30 s both), beside a baseline measured in the same run: an
empty write on the same writer thread, the floor of anything the service stores. Target: under 1% of a
core in all.

Run: ``.venv/bin/python benchmarks/gpu_sampling.py [--passes 200] [--gpus 8]``; a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from danlu import env

HERE = Path(__file__).resolve().parent


def cpu() -> float:
    return time.process_time()


async def measure(passes: int, gpus: int, state: Path) -> dict:
    sys.path.insert(0, str(HERE.parent / "tests" / "fakenvml"))
    nvml_state = state / "nvml.json"
    device = {"name": "NVIDIA A100-SXM4-80GB", "memory_mib": 81920, "utilization": 3}
    devices = [{**device, "uuid": f"GPU-{i}"} for i in range(gpus)]
    nvml_state.write_text(json.dumps({"devices": devices}))
    os.environ[env.FAKE_NVML] = str(nvml_state)

    # deferred: after DANLU_FAKE_NVML and the fake's path are set, as the service would find them
    from danlu.hub.service.jobs.gpuculling import GpuCuller, Policy
    from danlu.hub.service.store.orm import ServerUsage
    from danlu.hub.service.usage.reports import sample_gpus
    from tests.fakes import InstantBackend, make_manager

    manager = make_manager(InstantBackend(), state / "state")
    inventory = [SimpleNamespace(index=i, flavor="a100", declared=False) for i in range(gpus)]

    def servers(s):
        for i in range(gpus):
            s.add(ServerUsage(holder=f"u{i}", owner=f"u{i}", team="", profile="python", flavor="a100", devices=[i]))

    await manager.database.write(servers)

    async def busy_user(name):
        return {"servers": {"": {"last_activity": None}}}

    async def stop(user, name):
        raise AssertionError("nothing is idle long enough to be stopped here")

    culler = GpuCuller(
        manager.database, lambda slug: Policy(900), busy_user, stop, lambda owner: 0, logging.getLogger()
    )

    async def timed(call) -> list[float]:
        out = []
        for _ in range(passes):
            start = cpu()
            await call()
            out.append(cpu() - start)
        return out

    baseline = await timed(lambda: manager.database.write(lambda s: None))
    sampling = await timed(lambda: manager.database.write(sample_gpus, inventory))
    culling = await timed(culler.pass_once)
    return {
        "baseline": statistics.median(baseline),
        "sample": statistics.median(sampling),
        "cull": statistics.median(culling),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=8)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent))
    with tempfile.TemporaryDirectory() as tmp:
        found = asyncio.run(measure(args.passes, args.gpus, Path(tmp)))
    interval = 30.0
    share = (found["sample"] + found["cull"]) / interval
    print(f"{args.gpus} GPUs held by {args.gpus} servers, {args.passes} passes each (CPU time, medians)")
    print(f"  baseline (an empty write):  {found['baseline'] * 1e3:8.3f} ms")
    print(
        f"  one sample pass:            {found['sample'] * 1e3:8.3f} ms "
        f"({found['sample'] / found['baseline']:.1f}x the baseline)"
    )
    print(
        f"  one culling pass:           {found['cull'] * 1e3:8.3f} ms "
        f"({found['cull'] / found['baseline']:.1f}x the baseline)"
    )
    print(f"  share of one core at {interval:.0f} s: {share:.4%} (target < 1%)")
    return 0 if share < 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
