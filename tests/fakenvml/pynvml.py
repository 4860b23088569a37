"""A fake of nvidia-ml-py (``import pynvml``) for tests on machines without GPUs.

It follows the real library's interface for what Danlu calls: ``nvmlInit``/``nvmlShutdown``, device count,
handles by index, name, UUID, memory and utilization (objects with the real attribute names: ``.total``,
``.used``, ``.gpu``, ``.memory``), MIG mode and MIG device handles, and the real error classes
(``NVMLError`` and its ``NVMLError_*`` subclasses; a call before ``nvmlInit`` raises
``NVMLError_Uninitialized`` as the library does). What it does not model: processes, clocks, temperature,
power, events, vGPU, and the timing of utilization (the real figure is the busy fraction over the last
sample period of the driver, 1/6 s to 1 s; here it is whatever the state says now).

The state is a JSON file named by ``DANLU_FAKE_NVML``, read at every call so that a test changes it while
the workbench runs::

    {"devices": [{"name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-0a...", "memory_mib": 81920,
                  "used_mib": 0, "utilization": 0, "lost": false,
                  "mig": [{"uuid": "MIG-...", "name": "NVIDIA A100-SXM4-80GB MIG 1g.10gb", "memory_mib": 9728}]}],
     "driver_missing": false}

A device with ``"lost": true`` raises ``NVMLError_GpuIsLost`` for every call on it, as a GPU fallen off the
bus does. ``driver_missing`` makes ``nvmlInit`` raise ``NVMLError_DriverNotLoaded``.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_GPU_IS_LOST = 15
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1


class NVMLError(Exception):
    """As pynvml's: ``NVMLError(code)``, ``.value`` the code; subclasses per code."""

    def __new__(cls, value=None):
        return Exception.__new__(cls)

    def __init__(self, value=None):
        super().__init__(value)
        self.value = value

    def __str__(self):
        return _MESSAGES.get(self.value, f"NVML error {self.value}")


class NVMLError_Uninitialized(NVMLError):  # noqa: N801 - pynvml's names
    def __init__(self):
        super().__init__(NVML_ERROR_UNINITIALIZED)


class NVMLError_InvalidArgument(NVMLError):  # noqa: N801
    def __init__(self):
        super().__init__(NVML_ERROR_INVALID_ARGUMENT)


class NVMLError_NotSupported(NVMLError):  # noqa: N801
    def __init__(self):
        super().__init__(NVML_ERROR_NOT_SUPPORTED)


class NVMLError_DriverNotLoaded(NVMLError):  # noqa: N801
    def __init__(self):
        super().__init__(NVML_ERROR_DRIVER_NOT_LOADED)


class NVMLError_GpuIsLost(NVMLError):  # noqa: N801
    def __init__(self):
        super().__init__(NVML_ERROR_GPU_IS_LOST)


_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
}
_initialized = [0]  # nvmlInit calls not yet shut down (the real library counts them too)


def _state() -> dict:
    path = os.environ.get("DANLU_FAKE_NVML")
    if not path:
        return {"devices": []}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _device(handle) -> dict:
    if not _initialized[0]:
        raise NVMLError_Uninitialized()
    devices = _state()["devices"]
    index, mig = handle if isinstance(handle, tuple) else (handle, None)
    if not isinstance(index, int) or not 0 <= index < len(devices):
        raise NVMLError_InvalidArgument()
    device = devices[index]
    if device.get("lost"):
        raise NVMLError_GpuIsLost()
    if mig is not None:
        slices = device.get("mig") or []
        if not 0 <= mig < len(slices):
            raise NVMLError_InvalidArgument()
        return {**slices[mig], "utilization": slices[mig].get("utilization", device.get("utilization", 0))}
    return device


def nvmlInit():
    if _state().get("driver_missing"):
        raise NVMLError_DriverNotLoaded()
    _initialized[0] += 1


def nvmlShutdown():
    if not _initialized[0]:
        raise NVMLError_Uninitialized()
    _initialized[0] -= 1


def nvmlDeviceGetCount():  # noqa: N802 - pynvml's names
    if not _initialized[0]:
        raise NVMLError_Uninitialized()
    return len(_state()["devices"])


def nvmlDeviceGetHandleByIndex(index):  # noqa: N802
    _device(index)
    return index


def nvmlDeviceGetName(handle):  # noqa: N802
    return _device(handle)["name"]


def nvmlDeviceGetUUID(handle):  # noqa: N802
    return _device(handle)["uuid"]


def nvmlDeviceGetMemoryInfo(handle):  # noqa: N802
    d = _device(handle)
    total, used = d.get("memory_mib", 0) * 2**20, d.get("used_mib", 0) * 2**20
    return SimpleNamespace(total=total, used=used, free=total - used)


def nvmlDeviceGetUtilizationRates(handle):  # noqa: N802
    d = _device(handle)
    if isinstance(handle, tuple):  # as on real MIG slices: GPU utilization is not supported
        raise NVMLError_NotSupported()
    return SimpleNamespace(gpu=int(d.get("utilization", 0)), memory=int(d.get("memory_utilization", 0)))


def nvmlDeviceGetMigMode(handle):  # noqa: N802
    d = _device(handle)
    mode = NVML_DEVICE_MIG_ENABLE if d.get("mig") else NVML_DEVICE_MIG_DISABLE
    return [mode, mode]  # current, pending


def nvmlDeviceGetMaxMigDeviceCount(handle):  # noqa: N802
    return len(_device(handle).get("mig") or [])


def nvmlDeviceGetMigDeviceHandleByIndex(handle, index):  # noqa: N802
    _device((handle, index))
    return (handle, index)
