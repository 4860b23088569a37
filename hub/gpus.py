"""The GPU inventory: which devices exist and what flavor each one is.

Devices are declared in danlu.yaml (``gpus.declared``: groups of ``count`` and
``flavor``) or detected through NVML (``pynvml``, when installed) and then
``nvidia-smi``. Declared devices win, which makes allocation testable on a
machine without GPUs. The inventory is a plain list; who holds which device is
the jobs service's ledger (:mod:`danlu.hub.service.store.ledger`).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPU:
    index: int
    flavor: str
    name: str = ""
    uuid: str = ""
    memory_gib: float | None = None
    declared: bool = False

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "flavor": self.flavor,
            "name": self.name,
            "uuid": self.uuid,
            "memory_gib": self.memory_gib,
            "declared": self.declared,
        }


def flavor_of(name: str) -> str:
    """A resource-flavor name from a marketing name: 'NVIDIA H200' -> 'h200'."""
    name = re.sub(r"^(nvidia|tesla)\s+", "", name.strip(), flags=re.I)
    word = re.split(r"[\s_]+", name)[0] if name else "gpu"
    return re.sub(r"[^a-z0-9-]", "", word.lower()) or "gpu"


def _detect_nvml() -> list[GPU] | None:
    try:
        # deferred: optional (nvidia-ml-py), and NVML is looked for only at start-up
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        log.debug("NVML unavailable: %s", e)
        return None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30
            gpus.append(GPU(i, flavor_of(name), name, uuid, round(mem, 1)))
        return gpus
    finally:
        pynvml.nvmlShutdown()


def _detect_nvidia_smi() -> list[GPU] | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,uuid,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError) as e:
        log.warning("nvidia-smi failed: %s", e)
        return None
    return parse_nvidia_smi(out)


def parse_nvidia_smi(out: str) -> list[GPU]:
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        try:
            mem = round(float(parts[3]) / 1024, 1)
        except ValueError:
            mem = None
        gpus.append(GPU(int(parts[0]), flavor_of(parts[1]), parts[1], parts[2], mem))
    return gpus


def detect() -> list[GPU]:
    """NVIDIA GPUs on this machine (empty when there are none)."""
    for probe in (_detect_nvml, _detect_nvidia_smi):
        found = probe()
        if found is not None:
            return found
    return []


def inventory(gpu_settings) -> list[GPU]:
    """The devices Danlu allocates, from ``Settings.gpus`` (:class:`~danlu.hub.config.GpusConfig`)."""
    declared = gpu_settings.declared
    if declared:
        gpus, index = [], 0
        for group in declared:
            for _ in range(group["count"]):
                gpus.append(
                    GPU(
                        index,
                        group.get("flavor", "gpu"),
                        name=f"declared {group.get('flavor', 'gpu')}",
                        memory_gib=group.get("memory_gib"),
                        declared=True,
                    )
                )
                index += 1
        return gpus
    if gpu_settings.detect:
        return detect()
    return []
