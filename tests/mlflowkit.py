"""A real MLflow tracking server on loopback, for the tests that need one (as ``danlu up`` starts it).

:func:`running_mlflow` starts ``command`` (by default :func:`plain_command`: ``python -m
danlu.hub.mlflowserver`` with SQLite and local artifacts, no permissions) in a session of its own, waits
until ``health`` answers (failing the test with the server's log if it exits first), yields its URL and
stops it with its whole process group.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from danlu.hub.testing import free_port

from .fakes import until


def plain_command(folder: Path, port: int) -> list[str]:
    """MLflow as Danlu runs it, with its stores in ``folder`` and no permissions."""
    return [
        sys.executable,
        "-m",
        "danlu.hub.mlflowserver",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        f"sqlite:///{folder / 'mlflow.db'}",
        "--serve-artifacts",
        "--artifacts-destination",
        str(folder / "artifacts"),
        "--workers",
        "1",
    ]


@contextmanager
def running_mlflow(
    folder: Path,
    patience: float,
    command: list[str] | None = None,
    port: int | None = None,
    env: dict | None = None,
    health: str = "/health",
) -> Iterator[str]:
    """The server's URL while it runs (``command`` listens on ``port``; both chosen here by default)."""
    if command is None:
        port = free_port()
        command = plain_command(folder, port)
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(folder / "mlflow.log", "wb"),
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    def healthy():
        try:
            return requests.get(f"{url}{health}", timeout=2).ok
        except requests.RequestException:
            return proc.poll() is not None and pytest.fail((folder / "mlflow.log").read_text()[-2000:])

    try:
        asyncio.run(until(healthy, "MLflow to answer", patience, 0.5))
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
