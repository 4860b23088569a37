"""Danlu's NVML paths against tests/fakenvml, a fake of nvidia-ml-py that keeps the library's interface:
detecting devices (names to flavors, UUIDs, memory), sampling utilization (a lost GPU is down, not idle),
and the fake itself behaving as the library does where Danlu could trip (calls before nvmlInit, MIG
slices without utilization). A check of the real paths on a GPU machine is not written yet.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from danlu.hub import gpus
from danlu.hub.service.usage.reports import sample_gpus

FAKE = Path(__file__).resolve().parent / "fakenvml"
A100 = {"name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-a100-0", "memory_mib": 81920, "utilization": 40}


@pytest.fixture
def nvml(tmp_path, monkeypatch):
    """The fake pynvml, its state in a file the test rewrites."""
    state = tmp_path / "nvml.json"
    monkeypatch.setenv("DANLU_FAKE_NVML", str(state))
    monkeypatch.syspath_prepend(str(FAKE))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    module = importlib.import_module("pynvml")
    assert module.__file__.startswith(str(FAKE))

    def set_state(**state_data):
        state.write_text(json.dumps(state_data))

    module.set_state = set_state
    yield module
    sys.modules.pop("pynvml", None)


def test_devices_are_detected_with_their_flavor_uuid_and_memory(nvml):
    h200 = {"name": "NVIDIA H200", "uuid": "GPU-h200-1", "memory_mib": 143771, "utilization": 0}
    nvml.set_state(devices=[A100, h200])
    found = gpus.detect()
    assert [(g.index, g.flavor, g.uuid, g.memory_gib) for g in found] == [
        (0, "a100-sxm4-80gb", "GPU-a100-0", 80.0),
        (1, "h200", "GPU-h200-1", 140.4),
    ]
    nvml.set_state(devices=[], driver_missing=True)
    assert gpus._detect_nvml() is None  # no driver: NVML is not there, nvidia-smi is asked next


def test_sampling_reads_each_devices_utilization_and_a_lost_gpu_is_down(nvml):
    nvml.set_state(devices=[A100, {**A100, "uuid": "GPU-a100-1", "lost": True}])
    session = SimpleNamespace(rows=[], add=lambda row: session.rows.append(row))
    inventory = [SimpleNamespace(index=i, flavor="a100", declared=False) for i in range(2)]
    assert sample_gpus(session, inventory) == {0: 40.0, 1: None}
    assert [(r.device, r.utilization) for r in session.rows] == [(0, 40.0)]


def test_the_fake_fails_where_the_library_fails(nvml):
    nvml.set_state(
        devices=[{**A100, "mig": [{"uuid": "MIG-1", "name": "NVIDIA A100-SXM4-80GB MIG 1g.10gb", "memory_mib": 9728}]}]
    )
    with pytest.raises(nvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        assert nvml.nvmlDeviceGetMigMode(handle) == [nvml.NVML_DEVICE_MIG_ENABLE] * 2
        mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
        assert nvml.nvmlDeviceGetUUID(mig) == "MIG-1" and nvml.nvmlDeviceGetMemoryInfo(mig).total == 9728 * 2**20
        with pytest.raises(nvml.NVMLError_NotSupported):  # GPU utilization reads nothing under MIG
            nvml.nvmlDeviceGetUtilizationRates(mig)
        with pytest.raises(nvml.NVMLError_InvalidArgument):
            nvml.nvmlDeviceGetHandleByIndex(5)
        assert isinstance(nvml.NVMLError_GpuIsLost(), nvml.NVMLError)
    finally:
        nvml.nvmlShutdown()
