"""A job's directory: the only thing the jobs service and a job runner share.

The service writes ``job.json`` (the spec) and ``input.ipynb``; the runner
writes ``runner.json`` (its pid), ``run.json`` (the MLflow run id), ``job.log``,
``output.ipynb``, ``ranks/rank-N.ipynb``, TensorBoard event files under
``tensorboard/`` and, as its very last act, ``status.json``. Every JSON file is
written atomically (temp file + rename), so a reader never sees half a file and
a job's outcome survives the service being killed at any moment.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return None


@dataclass(frozen=True)
class JobDir:
    path: Path

    @classmethod
    def create(cls, root: Path, job_id: str) -> "JobDir":
        path = Path(root) / job_id
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        return cls(path)

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

    @property
    def log_file(self) -> Path:
        return self.path / "job.log"

    @property
    def status_file(self) -> Path:
        return self.path / "status.json"

    @property
    def runner_file(self) -> Path:
        return self.path / "runner.json"

    @property
    def run_file(self) -> Path:
        return self.path / "run.json"

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / "tensorboard"

    @property
    def logdirs_file(self) -> Path:
        """TensorBoard log dirs rank 0 wrote to (one absolute path a line)."""
        return self.tensorboard_dir / "logdirs"

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoints"

    # reading and writing -----------------------------------------------------
    def spec(self) -> dict:
        data = read_json(self.spec_file)
        if data is None:
            raise FileNotFoundError(f"{self.spec_file} is missing or unreadable")
        return data

    def write_spec(self, spec: dict) -> None:
        write_json_atomic(self.spec_file, spec)

    def status(self) -> dict | None:
        return read_json(self.status_file)

    def write_status(self, state: str, reason: str = "", **extra: Any) -> None:
        write_json_atomic(self.status_file, {"state": state, "reason": reason, **extra})

    def runner(self) -> dict | None:
        return read_json(self.runner_file)

    def run_id(self) -> str | None:
        data = read_json(self.run_file)
        return data.get("run_id") if data else None
