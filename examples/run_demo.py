"""``make demo``: run examples/quickstart.ipynb headless against a running workbench.

It needs a workbench started with ``make up`` (default http://127.0.0.1:8000,
state in ``.danlu/``). As the admin (``$DANLU_ADMIN_TOKEN``, else
``<state-dir>/admin-token``) it creates the user ``demo`` through the hub's
REST API (if missing) and an API token for them, copies the notebook into
their home folder (``<state-dir>/users/demo``), and executes it there with
papermill on a local ``python3`` kernel whose environment points ``%%train``
at the workbench (``DANLU_URL``, ``JUPYTERHUB_API_TOKEN``), as a Danlu server
would. The ``%%train --wait`` cell submits a real job and waits for it. The
script then reads the demo user's newest job from the jobs API and prints its
state and MLflow run URL; it exits non-zero if the job did not succeed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import requests

from danlu import env

HERE = Path(__file__).resolve().parent
NOTEBOOK = HERE / "quickstart.ipynb"
USER = "demo"


class DemoError(Exception):
    """A one-line reason the demo cannot go on."""


def admin_token(state_dir: Path) -> str:
    token = env.ADMIN_TOKEN.get("").strip()
    path = state_dir / "admin-token"
    if not token and path.exists():
        token = path.read_text().strip()
    if not token:
        raise DemoError(
            f"no admin token: $DANLU_ADMIN_TOKEN is unset and {path} does not exist; "
            "run `make up` first (or pass --state-dir)"
        )
    return token


def call(method: str, url: str, token: str, **kwargs) -> requests.Response:
    try:
        return requests.request(method, url, headers={"Authorization": f"token {token}"}, timeout=60, **kwargs)
    except requests.ConnectionError:
        raise DemoError(
            f"no Danlu workbench answers at {url.split('/hub/')[0].split('/services/')[0]}: "
            "run `make up` first (or pass --url)"
        ) from None


def demo_token(url: str, admin: str) -> str:
    """Create the demo user if missing and return a new API token of theirs."""
    r = call("POST", f"{url}/hub/api/users/{USER}", admin)
    if r.status_code in (401, 403):
        raise DemoError(
            f"the admin token was refused by {url} ({r.status_code}): is it the token of this "
            "workbench? (set DANLU_ADMIN_TOKEN or --state-dir)"
        )
    if r.status_code not in (201, 409):
        raise DemoError(f"creating user {USER!r} failed: {r.status_code} {r.text[:300]}")
    r = call("POST", f"{url}/hub/api/users/{USER}/tokens", admin, json={"note": "make demo", "expires_in": 86400})
    if r.status_code != 201:
        raise DemoError(f"creating an API token for {USER!r} failed: {r.status_code} {r.text[:300]}")
    return r.json()["token"]


def list_jobs(url: str, token: str) -> list[dict]:
    r = call("GET", f"{url}/services/danlu/api/v1/jobs", token)
    if r.status_code != 200:
        raise DemoError(f"listing jobs failed: {r.status_code} {r.text[:300]}")
    return r.json()["jobs"]  # newest first


def run_notebook(url: str, token: str, home: Path) -> tuple[int, Path]:
    """Execute the quickstart in the demo user's home with papermill; returns (exit code, output path)."""
    notebook = home / NOTEBOOK.name
    output = home / f"{NOTEBOOK.stem}.output.ipynb"
    shutil.copyfile(NOTEBOOK, notebook)
    environ = {
        **os.environ,
        env.URL: url,
        "JUPYTERHUB_API_TOKEN": token,
        "HOME": str(home),
        # what a Danlu server's kernel has: the notebook's path names the job and its MLflow experiment
        "JPY_SESSION_NAME": str(notebook),
    }
    environ.pop(env.TOKEN, None)  # it would win over JUPYTERHUB_API_TOKEN
    papermill = Path(sys.executable).parent / "papermill"
    cmd = [str(papermill), str(notebook), str(output), "--kernel", "python3", "--log-output", "--no-progress-bar"]
    print(f"[demo] running {NOTEBOOK.name} as {USER!r} with papermill in {home}", flush=True)
    return subprocess.run(cmd, cwd=home, env=environ).returncode, output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url",
        default=env.URL.get("http://127.0.0.1:8000"),
        help="the workbench's URL (default $DANLU_URL or http://127.0.0.1:8000)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path(env.STATE_DIR.get(".danlu")),
        help="the workbench's state folder, for admin-token and users/ (default .danlu)",
    )
    args = parser.parse_args(argv)
    url = args.url.rstrip("/")
    state_dir = args.state_dir.resolve()
    try:
        admin = admin_token(state_dir)
        health = call("GET", f"{url}/services/danlu/api/v1/health", admin)
        if health.status_code != 200:
            raise DemoError(
                f"{url} answers, but not as a Danlu workbench ({health.status_code}): "
                "run `make up` first (or pass --url)"
            )
        token = demo_token(url, admin)
        home = state_dir / "users" / USER
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        before = {job["id"] for job in list_jobs(url, token)}
        code, output = run_notebook(url, token, home)
        jobs = [job for job in list_jobs(url, token) if job["id"] not in before]
        if not jobs:
            raise DemoError(f"the notebook submitted no job (papermill exited with {code}); see {output}")
        job = jobs[0]
    except DemoError as e:
        print(f"make demo: {e}", file=sys.stderr)
        return 1
    print(
        f"[demo] job {job['id']} ({job['name']}): {job['state']}" + (f": {job['reason']}" if job.get("reason") else "")
    )
    print(f"[demo] MLflow run: {job.get('mlflow_run_url') or '(none)'}")
    print(f"[demo] executed notebook: {output}")
    return 0 if job["state"] == "succeeded" and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
