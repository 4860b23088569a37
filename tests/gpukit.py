"""Workbenches on GPUs of tests/fakenvml (the fake nvidia-ml-py): its state, and a profile that offers GPUs.

The service tiers that need measured GPUs (GPU-aware culling, in the browser too) start ``danlu up`` with
``extra_env=fake_nvml_env(state)`` after :func:`write_gpus`; rewriting the state changes what NVML reports
while the workbench runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from danlu import env

FAKE_NVML = Path(__file__).resolve().parent / "fakenvml"
A100 = {"name": "NVIDIA A100-SXM4-80GB", "memory_mib": 81920}
FLAVOR = "a100-sxm4-80gb"  # what danlu.hub.gpus.flavor_of makes of its name
GPU_PROFILES = {
    "profiles": [
        {
            "slug": "python",
            "display_name": "Python (workbench environment)",
            "default": True,
            "environment": {"current": True},
            "resources": {"gpus": [0, 1]},
        }
    ]
}


def write_gpus(state: Path, count: int, utilization: int) -> None:
    """``count`` A100s of the fake NVML, all at ``utilization`` percent."""
    devices = [{**A100, "uuid": f"GPU-{i}", "utilization": utilization} for i in range(count)]
    state.write_text(json.dumps({"devices": devices}))


def fake_nvml_env(state: Path) -> dict:
    """What ``danlu up`` needs to find the fake instead of NVML (the hub passes the state to its services)."""
    return {"PYTHONPATH": str(FAKE_NVML), env.FAKE_NVML: str(state)}
