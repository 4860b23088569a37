"""A job's working folder, as the job's own processes use it.

The runner and its ranks write here: ``input.ipynb`` (the notebook the
service sent), ``job.json`` (the spec, for the ranks of a torchrun job),
``job.log``, ``output.ipynb``, ``ranks/rank-N.ipynb`` and their status files, ``seed.json``,
TensorBoard event files under ``tensorboard/``, checkpoints, and ``stop``
(the runner telling its ranks why they got SIGTERM). All of it belongs to
the job: the jobs service never reads any of it as truth. It learns what it
needs from the runner's reports to its runner API, and reads only the log and
the output notebooks, through a backend that refuses links and FIFOs
(:mod:`danlu.hub.backends.files`). Every JSON file here is written atomically
(temp file + rename).
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_JSON = 16 * 1024 * 1024


def write_json_atomic(path: Path, data: Any, mode: int = 0o600) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_json(path: Path) -> Any | None:
    """A JSON file of the job's own (a plain file, at most 16 MiB), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return json.loads(f.read(MAX_JSON + 1)[:MAX_JSON])
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class JobDir:
    path: Path
    #: where checkpoints go, when not in the job's folder (a pod: a folder in the owner's home claim)
    checkpoints: Path | None = None

    # files -----------------------------------------------------------------
    @property
    def spec_file(self) -> Path:
        return self.path / "job.json"

    @property
    def input_notebook(self) -> Path:
        return self.path / "input.ipynb"

    @property
    def output_notebook(self) -> Path:
        return self.path / "output.ipynb"

    def rank_notebook(self, rank: int) -> Path:
        return self.output_notebook if rank == 0 else self.path / "ranks" / f"rank-{rank}.ipynb"

    def rank_status(self, rank: int) -> Path:
        return self.path / "ranks" / f"rank-{rank}.status.json"

    @property
    def log_file(self) -> Path:
        return self.path / "job.log"

    @property
    def stop_file(self) -> Path:
        return self.path / "stop"

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / "tensorboard"

    @property
    def logdirs_file(self) -> Path:
        """TensorBoard log dirs rank 0 wrote to (one absolute path a line)."""
        return self.tensorboard_dir / "logdirs"

    @property
    def checkpoint_dir(self) -> Path:
        return self.checkpoints if self.checkpoints is not None else self.path / "checkpoints"

    @property
    def seed_file(self) -> Path:
        """The seed rank 0's code set, as :mod:`danlu.seeds` saw it (the runner reports it)."""
        return self.path / "seed.json"

    # the stop marker (runner -> ranks) -----------------------------------------------
    def write_stop(self, reason: str, grace: float) -> None:
        write_json_atomic(self.stop_file, {"reason": reason, "grace": grace})

    def stop_reason(self, wait: float = 0.0) -> tuple[str, float] | None:
        """Why the runner says the job is being stopped, waiting up to ``wait`` seconds for it to say."""
        deadline = time.monotonic() + wait
        while True:
            data = read_json(self.stop_file)
            if isinstance(data, dict) and isinstance(data.get("reason"), str):
                try:
                    return data["reason"], float(data.get("grace") or 0.0)
                except (TypeError, ValueError):
                    return data["reason"], 0.0
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
