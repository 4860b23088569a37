"""Pure test: the wheel installs the lab extension the way Jupyter finds extensions.

``pip install danlu`` must be enough for any environment (a user image on Kubernetes too) to show
Danlu in JupyterLab: the prebuilt extension under ``share/jupyter/labextensions/<package name>/`` and
the server extension enabled by ``etc/jupyter/jupyter_server_config.d/danlu.json``. The wheel is
built from a copy of the sources (no ``build/`` folder left in the checkout), without build isolation,
so no network is needed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LABEXTENSION = ROOT / "extensions" / "server" / "labextension"
SOURCES = [
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "magics",
    "hub",
    "extensions/server",
    "extensions/jupyter-config",
    "extensions/lab/install.json",
    "extensions/lab/package.json",
]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    if not (LABEXTENSION / "package.json").exists():
        pytest.skip("the lab extension is not built (make install builds it into extensions/server/labextension)")
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "node_modules")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore, symlinks=False)
        elif path.exists():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [built] = out.glob("danlu-*.whl")
    return zipfile.ZipFile(built)


def test_wheel_installs_the_prebuilt_lab_extension(wheel):
    name = json.loads((ROOT / "extensions" / "lab" / "package.json").read_text())["name"]
    data = next(n.split("/", 1)[0] for n in wheel.namelist() if ".data/" in n)
    where = f"{data}/data/share/jupyter/labextensions/{name}"
    names = set(wheel.namelist())
    assert f"{where}/package.json" in names
    assert json.loads(wheel.read(f"{where}/install.json")) == {
        "packageManager": "python",
        "packageName": "danlu",
        "uninstallInstructions": "Use your Python package manager (pip, conda, etc.) to uninstall the package danlu",
    }
    static = {p.name for p in (LABEXTENSION / "static").iterdir()}
    assert static and {n.rsplit("/", 1)[1] for n in names if n.startswith(f"{where}/static/")} == static
    remote = json.loads(wheel.read(f"{where}/package.json"))["jupyterlab"]["_build"]["load"]
    assert f"{where}/{remote}" in names  # the entry point JupyterLab loads is in the wheel
    assert f"{where}/schemas/{name}/plugin.json" in names


def test_wheel_enables_the_server_extension(wheel):
    data = next(n.split("/", 1)[0] for n in wheel.namelist() if ".data/" in n)
    config = json.loads(wheel.read(f"{data}/data/etc/jupyter/jupyter_server_config.d/danlu.json"))
    assert config == {"ServerApp": {"jpserver_extensions": {"danlu.lab": True}}}
