"""Service tier, in a browser: the lab extension clicked through against a real ``danlu up``.

Starts a workbench (dummy login, the default profiles), creates alice, starts
her server with the ``python`` profile, writes a small notebook and a catalog
dataset (which the training cell reads, so a model's lineage has a dataset
version) into her home and runs the Playwright/Galata tests of
``extensions/lab/ui-tests`` against ``/user/alice/lab`` with Debian's Chromium
(Playwright never downloads a browser). Galata's page fixture needs ``window.jupyterapp`` and its helper lab
extension: alice's own Jupyter config turns both on (``~/.jupyter`` and
``~/.local/share/jupyter/labextensions`` in her home), so the workbench itself
runs unmodified. Screenshots land in ``extensions/lab/ui-tests/screenshots/``
(and in ``docs/images/lab-*.png`` with ``DANLU_UI_DOCS_IMAGES=1``); traces and
the HTML report of a failure in ``test-artifacts/ui-tests/``. ``DANLU_UI_SPEC=sweeps``
runs one spec file (``tests/sweeps.spec.ts``) instead of all of them.

alice's server holds one GPU of ``tests/fakenvml`` (the workbench detects four), busy while the specs run;
then the last test makes it idle and runs ``tests/cull.spec.ts`` alone: the sidebar warns her before GPU-aware
culling stops the server, which the test then sees stopped and audited.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import requests

from danlu.hub.testing import Workbench

from .conftest import cannot_run
from .gpukit import FLAVOR, GPU_PROFILES, fake_nvml_env, write_gpus

ROOT = Path(__file__).resolve().parents[1]  # the checkout the tests run from

pytestmark = pytest.mark.service

UI_TESTS = ROOT / "extensions" / "lab" / "ui-tests"
LABEXTENSION = ROOT / "extensions" / "server" / "labextension" / "package.json"
SERVER_EXTENSION = ROOT / "extensions" / "server" / "__init__.py"
CHROMIUM = os.environ.get("DANLU_UI_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = ROOT / "test-artifacts" / "ui-tests"
FOLDER, NOTEBOOK = "ui-tests", "train.ipynb"
GPU_CONFIG = {
    "groups": {"research": ["alice"]},
    "teams": {"research": {"quota": {"gpus": {FLAVOR: 4}}}},
    # an idle GPU server is warned after 10 s idle, for 80 s, then stopped
    "hub": {"idle_timeout_seconds": 0, "gpu_idle_timeout_seconds": 90, "gpu_idle_warning_seconds": 80},
}


DATASET = "ui-points"  # registered by alice; the training cell reads it, so lineage has a dataset version


def _missing() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is missing (apt-get install chromium; .ci/run installs it)"
    if not (UI_TESTS / "node_modules" / "@jupyterlab" / "galata").exists():
        return (
            f"{UI_TESTS / 'node_modules'} is missing "
            f"(cd {UI_TESTS.relative_to(ROOT)} && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci)"
        )
    if not SERVER_EXTENSION.exists():
        return f"the server extension {SERVER_EXTENSION.relative_to(ROOT)} is missing"
    if not LABEXTENSION.exists():
        return f"the lab extension is not built ({LABEXTENSION.relative_to(ROOT)} is missing; run make install)"
    if shutil.which("npx") is None:
        return "npx (Node.js) is not on PATH"
    return None


def notebook(kernel_name: str, display_name: str) -> dict:
    """A parameters cell and a training cell that writes a few scalars, logs a model and prints a known line."""

    def cell(source: str, tags: list[str] = ()) -> dict:
        return {
            "cell_type": "code",
            "execution_count": None,
            "metadata": {"tags": list(tags)} if tags else {},
            "outputs": [],
            "source": source,
        }

    train = (
        "import danlu\n"
        "import torch\n"
        "from torch.utils.tensorboard import SummaryWriter\n"
        "\n"
        'rows = (danlu.dataset("ui-points") / "points.csv").read_text().splitlines()  # a catalog dataset\n'
        "writer = SummaryWriter()\n"
        "w = torch.zeros(1, requires_grad=True)\n"
        "for step in range(20):\n"
        "    loss = (w - 3.0).pow(2).sum()\n"
        "    loss.backward()\n"
        "    with torch.no_grad():\n"
        "        w -= lr * w.grad\n"
        "        w.grad.zero_()\n"
        '    writer.add_scalar("loss", loss.item(), step)\n'
        "writer.close()\n"
        "import mlflow\n"
        'mlflow.create_external_model(name="model")  # what the sidebar registers as a model\n'
        'print(f"danlu-ui-test finished: lr={lr}")'
    )
    cells = [cell("lr = 0.1", ["parameters"]), cell(train)]
    for i, c in enumerate(cells):
        c["id"] = f"cell-{i}"
    return {
        "cells": cells,
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": kernel_name, "display_name": display_name, "language": "python"}},
    }


def prepare_home(home: Path) -> None:
    """alice's own Jupyter config: expose the app to the page, load Galata's helper extension, and this
    checkout's build of the lab extension (a user's labextensions come before the venv's, which may link
    another checkout's)."""
    import jupyterlab

    config = home / ".jupyter"
    config.mkdir(parents=True, exist_ok=True)
    labextensions = home / ".local" / "share" / "jupyter" / "labextensions" / "@jupyterlab"
    # first on the path: in a venv Jupyter prefers the venv's labextensions to the user's
    lab = {"expose_app_in_browser": True, "extra_labextensions_path": [str(labextensions.parent)]}
    (config / "jupyter_server_config.json").write_text(json.dumps({"LabApp": lab}))
    labextensions.mkdir(parents=True, exist_ok=True)
    link = labextensions / "galata-extension"
    if not link.exists():
        link.symlink_to(
            Path(jupyterlab.__file__).parent / "galata" / "@jupyterlab" / "galata-extension", target_is_directory=True
        )
    ours = labextensions.parent / "danlu-lab"
    if not ours.exists():
        ours.symlink_to(LABEXTENSION.parent, target_is_directory=True)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    reason = _missing()
    if reason:
        cannot_run("ui", reason)
    tmp = tmp_path_factory.mktemp("wb-lab-ui")
    nvml = tmp / "nvml.json"
    write_gpus(nvml, 4, 50)
    (tmp / "danlu_service_config.py").write_text("c.JobsServiceApp.gpu_sample_interval = 1\n")
    wb = Workbench(
        tmp,
        config=GPU_CONFIG,
        profiles=GPU_PROFILES,
        extra_env=fake_nvml_env(nvml),
    )
    wb.nvml = nvml
    wb.start()
    try:
        token = wb.create_user("alice", ["research"])
        prepare_home(wb.state / "users" / "alice")
        r = wb.start_server("alice", {"profile": "python", "gpus": 1})
        assert r.status_code in (201, 202), r.text
        api = f"{wb.url}/user/alice/api"
        headers = {"Authorization": f"token {token}"}
        specs = requests.get(f"{api}/kernelspecs", headers=headers, timeout=30).json()
        name = specs["default"]
        display = specs["kernelspecs"][name]["spec"]["display_name"]
        r = requests.put(f"{api}/contents/{FOLDER}", headers=headers, json={"type": "directory"}, timeout=30)
        assert r.status_code in (200, 201), r.text
        r = requests.put(f"{api}/contents/{FOLDER}/data", headers=headers, json={"type": "directory"}, timeout=30)
        assert r.status_code in (200, 201), r.text
        r = requests.put(
            f"{api}/contents/{FOLDER}/data/points.csv",
            headers=headers,
            timeout=30,
            json={"type": "file", "format": "text", "content": "x,y\n1,2\n2,4\n3,6\n"},
        )
        assert r.status_code in (200, 201), r.text
        r = wb.api(
            "POST",
            "/datasets",
            token=token,
            json={
                "name": DATASET,
                "path": f"{FOLDER}/data",
                "description": "three points on a line (the UI tests' data)",
            },
        )
        assert r.status_code in (200, 201), r.text
        r = requests.put(
            f"{api}/contents/{FOLDER}/{NOTEBOOK}",
            headers=headers,
            timeout=30,
            json={"type": "notebook", "format": "json", "content": notebook(name, display)},
        )
        assert r.status_code in (200, 201), r.text
        yield wb, token
    finally:
        wb.stop()


def run_playwright(lab, token: str, specs: list[str]) -> None:
    env = {
        **os.environ,
        "DANLU_UI_HUB_URL": lab.url,
        "DANLU_UI_USER": "alice",
        "DANLU_UI_FOLDER": FOLDER,
        "DANLU_UI_NOTEBOOK": NOTEBOOK,
        "DANLU_UI_CHROMIUM": CHROMIUM,
        "DANLU_UI_DATASET": DATASET,
        # an admin (admins may always decide on a model version), who approves alice's in the lineage scenario
        "DANLU_UI_APPROVER_TOKEN": lab.admin_token,
        # alice's API token: the sweeps scenario starts its sweep through the jobs API, as %%train --sweep does
        "DANLU_UI_TOKEN": token,
        "DANLU_UI_ARTIFACTS": str(ARTIFACTS),
        "PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD": "1",
        "CI": "1",
    }
    try:
        done = subprocess.run(
            ["npx", "--no-install", "playwright", "test", *(f"tests/{spec}.spec.ts" for spec in specs)],
            cwd=UI_TESTS,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=20 * 60,
        )
        output, code = done.stdout, done.returncode
    except subprocess.TimeoutExpired as e:
        output = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        code = "timeout (20 min)"
    assert code == 0, (
        f"playwright test exited {code}:\n{output}\n--- traces and report: {ARTIFACTS}\n"
        f"--- workbench log:\n{lab.log_tail(80)}"
    )


def test_lab_extension_in_the_browser(lab):
    wb, token = lab
    chosen = os.environ.get("DANLU_UI_SPEC", "")
    if chosen == "cull":
        pytest.skip("DANLU_UI_SPEC=cull: only the culling spec runs")
    every = sorted(p.name.removesuffix(".spec.ts") for p in (UI_TESTS / "tests").glob("*.spec.ts"))
    run_playwright(wb, token, [chosen] if chosen else [s for s in every if s != "cull"])


def test_an_idle_gpu_server_is_warned_in_the_sidebar_then_stopped(lab):
    """Last: it stops alice's server."""
    wb, token = lab
    if os.environ.get("DANLU_UI_SPEC", "cull") != "cull":
        pytest.skip("DANLU_UI_SPEC names another spec")
    write_gpus(wb.nvml, 4, 0)  # alice's GPU goes idle
    run_playwright(wb, token, ["cull"])
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        model = requests.get(
            f"{wb.url}/hub/api/users/alice", headers={"Authorization": f"token {wb.admin_token}"}, timeout=30
        ).json()
        if not (model.get("servers") or {}).get(""):
            break
        time.sleep(2)
    else:
        raise AssertionError("alice's idle GPU server was not stopped")
    records = wb.api("GET", "/audit", params={"action": "cull_gpu_server"}).json()
    records = records.get("records", records) if isinstance(records, dict) else records
    assert [r["target"] for r in records] == ["alice"], records
