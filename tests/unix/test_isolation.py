"""Unix-accounts mode keeps users apart: bob's code cannot reach alice, root, or the workbench's secrets.

Written to the intended behaviour: the jobs service runs as root and trusts
nothing in a job's folder, which belongs to the job's user. Each test is one
thing bob tries, mostly from a job of his own (his code runs as his account
there, the service reads and writes his folder as root). Links and FIFOs point
at root-owned canary files where the service could write through them, at
``/etc/shadow`` only where it could only read. See ``conftest.py`` for the
accounts, the workbench and alice's job.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from danlu import env

from .conftest import (
    ALICE,
    BOB,
    KILL_MY_RUNNER,
    PROBE,
    bob_job,
    canary,
    canary_changes,
    mode_of,
    notebook,
    refused,
    result_of,
    wait_for,
)

pytestmark = pytest.mark.service


def _environ(proc: psutil.Process) -> dict:
    try:
        return proc.environ()
    except (psutil.Error, OSError):
        return {}


def _shadow_line() -> str:
    return Path("/etc/shadow").read_text().splitlines()[0]


def _marker(wb, name: str) -> Path:
    """A file in bob's home that tells a job's second attempt from its first (his home is his alone)."""
    return wb.users[BOB].home / f".{name}-{os.urandom(4).hex()}"


# who runs what ---------------------------------------------------------------------------------
def test_servers_and_jobs_run_as_each_users_account(wb, alice_job, bob_kernel):
    alice, bob = wb.users[ALICE], wb.users[BOB]
    procs = [p for p in psutil.process_iter() if _environ(p).get(env.JOB_ID) == alice_job.id]
    assert procs and {p.uids().real for p in procs} == {alice.uid}, [(p.pid, p.cmdline()) for p in procs]
    assert mode_of(alice_job.dir) == (alice.uid, 0o700)
    out = bob_kernel.execute("import os; print(os.getuid(), os.getcwd())")
    uid, cwd = out["stdout"].split()
    assert uid == str(bob.uid) and cwd.startswith(str(bob.home)), out


def test_a_user_without_an_account_is_refused(wb):
    # the hub (PAM, a LocalAuthenticator) creates no user without an account ...
    assert wb.hub("POST", "/users/no-account-here").status_code == 400
    # ... and the service runs nothing for one whose account went away
    subprocess.run(["useradd", "-M", "danlu-gone"], check=True, capture_output=True)
    try:
        token = wb.create_user("danlu-gone")
    finally:
        subprocess.run(["userdel", "danlu-gone"], check=True, capture_output=True)
    answer = wb.api("POST", "/jobs", token=token, json={"notebook": notebook("1")})
    assert answer.status_code == 403 and answer.json()["reason"] == "no_unix_account", answer.text


def test_a_hub_user_named_after_a_system_account_runs_nothing_as_it(wb):
    answer = wb.api("POST", "/jobs", token=wb.create_user("daemon"), json={"notebook": notebook("1")})
    assert answer.status_code == 403 and answer.json()["reason"] == "system_account", answer.text
    server = wb.hub("POST", "/users/daemon/server")
    assert server.status_code >= 400 or "system account" in wb.log_tail(), server.text


# bob's code against alice's files --------------------------------------------------------------
def test_alices_home_is_closed_to_bob(wb, bob_kernel):
    """Not even its listing: the names of her files and folders are hers.

    Accounts made as the admin guide says (``useradd -m -K HOME_MODE=0700``; plain ``useradd -m``
    gives 0755 on Debian 12, which the spawner warns about), and servers and runners with umask 077.
    """
    home = wb.users[ALICE].home
    out = bob_kernel.execute(PROBE + f"attempt('list', lambda: os.listdir({str(home)!r}))\nreport()")
    assert refused(result_of(out["stdout"])) == {}, f"{home} is mode {oct(mode_of(home)[1])}"


def test_bobs_job_cannot_read_or_change_alices_home_or_job(wb, alice_job):
    home, jobdir = str(wb.users[ALICE].home), str(alice_job.dir)
    job = bob_job(
        wb,
        PROBE
        + f"""
home, jobdir = {home!r}, {jobdir!r}
attempt("read alice's home file", lambda: open(home + "/secret.txt").read())
attempt("write into alice's home", lambda: open(home + "/from-bob", "x").close())
attempt("list alice's job folder", lambda: os.listdir(jobdir))
attempt("read alice's job.log", lambda: open(jobdir + "/job.log").read())
attempt("append to alice's job.log", lambda: open(jobdir + "/job.log", "a").close())
attempt("read alice's output.ipynb", lambda: open(jobdir + "/output.ipynb").read())
attempt("change alice's output.ipynb", lambda: open(jobdir + "/output.ipynb", "r+").close())
attempt("write into alice's job folder", lambda: open(jobdir + "/from-bob", "x").close())
report()
""",
    )
    assert job["state"] == "succeeded", job["log"][-3000:]
    assert refused(result_of(job["log"])) == {}
    assert alice_job.secret not in job["log"]


def test_the_api_shows_bob_nothing_of_alices_job(wb, alice_job):
    bob, alice = wb.tokens[BOB], wb.tokens[ALICE]
    answers = {
        f"{method} {path}": wb.api(method, f"/jobs/{alice_job.id}{path}", token=bob)
        for method, path in [
            ("GET", ""),
            ("GET", "/logs"),
            ("GET", "/logs?tail=5"),
            ("GET", "/output"),
            ("GET", "/output?format=html"),
            ("GET", "/input"),
            ("POST", "/cancel"),
        ]
    }
    assert {k: r.status_code for k, r in answers.items() if r.status_code != 404} == {}
    assert not [k for k, r in answers.items() if alice_job.secret in r.text]
    listed = wb.api("GET", "/jobs", token=bob).json()["jobs"]
    assert alice_job.id not in [j["id"] for j in listed]
    assert wb.api("GET", f"/jobs/{alice_job.id}", token=alice).json()["state"] == "running"


# links, FIFOs and renames in bob's own job folder -------------------------------------------
LINKS = """
import os, time
def link(target, name):
    os.symlink(target, os.path.join(jd, name + ".new"))
    os.replace(os.path.join(jd, name + ".new"), os.path.join(jd, name))
if os.environ.get("RANK") == "1":
    open(os.path.join(jd, "rank-1-started"), "w").close()
else:
    deadline = time.time() + 120  # rank 1 has saved its notebook once its cell runs
    while not os.path.exists(os.path.join(jd, "rank-1-started")) and time.time() < deadline:
        time.sleep(0.2)
    link("/etc/shadow", "job.log")
    link({alice_output!r}, "output.ipynb")
    link({alice_input!r}, "input.ipynb")
    os.rename(os.path.join(jd, "ranks"), os.path.join(jd, "ranks.mine"))
    link({root_only!r}, "ranks")
    open(os.path.join(jd, "links-ready"), "w").close()
time.sleep(600)
"""


def test_links_in_bobs_job_folder_are_never_followed(wb, alice_job):
    root_only = wb.tmp / "root-only"
    root_only.mkdir(mode=0o700, exist_ok=True)
    root_secret = f"root-secret-{os.urandom(8).hex()}"
    (root_only / "rank-1.ipynb").write_text(json.dumps(notebook(f"print({root_secret!r})")))
    secrets = {"/etc/shadow": _shadow_line(), "alice's notebooks": alice_job.secret, "root-only dir": root_secret}
    source = LINKS.format(
        alice_output=str(alice_job.dir / "output.ipynb"),
        alice_input=str(alice_job.dir / "input.ipynb"),
        root_only=str(root_only),
    )
    job = bob_job(wb, source, wait=False, resources={"nproc": 2})
    token = wb.tokens[BOB]
    try:
        wait_for(wb, job["id"], wb.state / "jobs" / job["id"] / "links-ready", timeout=240)
        leaks, slow = {}, {}
        for name, path in [
            ("log", "/logs"),
            ("log tail", "/logs?tail=20"),
            ("output", "/output"),
            ("output as html", "/output?format=html"),
            ("input", "/input"),
            ("rank 1", "/output?rank=1"),
            ("job", ""),
        ]:
            started = time.monotonic()
            r = wb.api("GET", f"/jobs/{job['id']}{path}", token=token, timeout=30)
            if time.monotonic() - started > 10:
                slow[name] = round(time.monotonic() - started, 1)
            leaks.update({f"{name}: {what}": r.status_code for what, text in secrets.items() if text in r.text})
        assert leaks == {}, "the service followed bob's links as root"
        assert slow == {}
    finally:
        wb.api("POST", f"/jobs/{job['id']}/cancel", token=token, timeout=60)


FIFOS = """
import os, time
for name in ("output.ipynb", "job.log", "run.json"):
    os.mkfifo(os.path.join(jd, name + ".new"))
    os.replace(os.path.join(jd, name + ".new"), os.path.join(jd, name))
open(os.path.join(jd, "fifos-ready"), "w").close()
time.sleep(600)
"""


def _unblock(jobdir: Path) -> None:
    """Release whoever waits on the FIFOs (a writer appears, then goes), and put plain files in their place."""
    fifos = [p for p in jobdir.iterdir() if p.is_fifo()]
    fds = [os.open(p, os.O_RDWR | os.O_NONBLOCK) for p in fifos]
    for path in fifos:
        path.with_name(path.name + ".plain").write_bytes(b"")
        os.replace(path.with_name(path.name + ".plain"), path)
    for fd in fds:
        os.close(fd)


def test_a_fifo_in_bobs_job_folder_never_blocks_the_service(wb, alice_job):
    bob, alice = wb.tokens[BOB], wb.tokens[ALICE]
    job = bob_job(wb, FIFOS, wait=False)
    jobdir = wb.state / "jobs" / job["id"]
    try:
        wait_for(wb, job["id"], jobdir / "fifos-ready", ask=False)
        with ThreadPoolExecutor(3) as pool:
            asked = {
                name: pool.submit(wb.api, "GET", f"/jobs/{job['id']}{path}", token=bob, timeout=30)
                for name, path in [("output", "/output"), ("log", "/logs"), ("job", "")]
            }
            time.sleep(1)
            try:
                health = wb.api("GET", "/health", timeout=5).status_code
                alices = wb.api("GET", f"/jobs/{alice_job.id}", token=alice, timeout=5).status_code
            except OSError as e:
                health = alices = f"no answer: {type(e).__name__}"
            hung = {}
            for name, future in asked.items():
                try:
                    future.result(timeout=10)
                except Exception as e:  # noqa: BLE001 - a timeout of either kind is the finding
                    hung[name] = type(e).__name__
                    _unblock(jobdir)
        assert (health, alices) == (200, 200), "the service stopped answering while it read bob's FIFO"
        assert hung == {}, "answers about bob's own job hung on his FIFOs"
    finally:
        _unblock(jobdir)
        wb.api("POST", f"/jobs/{job['id']}/cancel", token=bob, timeout=60)


WRITE_LINKS = (
    """
import os, time
def link(target, name):
    os.symlink(target, os.path.join(jd, name + ".new"))
    os.replace(os.path.join(jd, name + ".new"), os.path.join(jd, name))
link({stop!r}, "stop")  # the service writes the stop file when the job is cancelled
if not os.path.exists({marker!r}):  # first attempt: leave links for the retry, and die
    open({marker!r}, "w").close()
    link({log!r}, "job.log")
    link({attempt!r}, "attempt.json")
    link({status!r}, "status.json")
"""
    + textwrap.indent(KILL_MY_RUNNER, "    ")
    + """
open(os.path.join(jd, "second-attempt-ready"), "w").close()
time.sleep(600)
"""
)


def test_the_service_never_writes_through_bobs_links(wb):
    canaries = {name: canary(wb, name) for name in ("stop", "log", "attempt", "status")}
    source = WRITE_LINKS.format(marker=str(_marker(wb, "write-links")), **{k: str(v) for k, v in canaries.items()})
    job = bob_job(wb, source, wait=False, retries=1)
    token = wb.tokens[BOB]
    try:
        wait_for(wb, job["id"], wb.state / "jobs" / job["id"] / "second-attempt-ready", timeout=240)
    finally:
        wb.api("POST", f"/jobs/{job['id']}/cancel", token=token, timeout=60)
        wb.wait_job(job["id"], token, timeout=120)
    assert canary_changes(list(canaries.values())) == {}, "the service wrote, chowned or chmodded through a link"


RENAMES = """
jobs = os.path.dirname(jd)
def swap_log_for_hard_link():
    os.link({canary!r}, os.path.join(jd, "job.log.new"))
    os.replace(os.path.join(jd, "job.log.new"), os.path.join(jd, "job.log"))
attempt("rename the job folder", lambda: os.rename(jd, jd + "-moved"))
attempt("put a folder into jobs/", lambda: os.mkdir(os.path.join(jobs, "from-bob")))
attempt("put a link to alice's folder into jobs/", lambda: os.symlink({alice!r}, os.path.join(jobs, "from-bob")))
attempt("replace job.log with a hard link to a root file", swap_log_for_hard_link)
report()
"""


def test_bob_cannot_rename_or_hard_link_his_way_out(wb, alice_job):
    root_file = canary(wb, "hard-link")
    job = bob_job(wb, PROBE + RENAMES.format(canary=str(root_file), alice=str(alice_job.dir)))
    results = result_of(job["log"])
    # the hard link is refused by the kernel's fs.protected_hardlinks, which the service must not rely on
    assert refused(results) == {}, Path("/proc/sys/fs/protected_hardlinks").read_text().strip()
    jobdir = wb.state / "jobs" / job["id"]
    assert mode_of(jobdir) == (wb.users[BOB].uid, 0o700)
    assert sorted(p.name for p in jobdir.parent.iterdir() if not p.name.isalnum()) == []
    assert "canary hard-link" not in job["log"]
    assert canary_changes([root_file]) == {}


# becoming someone else -----------------------------------------------------------------------------
FORGE_SPEC = (
    """
import json, os
def forge(name, data):
    with open(os.path.join(jd, name + ".new"), "w") as f:
        json.dump(data, f)
    os.replace(os.path.join(jd, name + ".new"), os.path.join(jd, name))
if not os.path.exists({marker!r}):
    open({marker!r}, "w").close()
    try:
        spec = json.load(open(os.path.join(jd, "job.json")))
    except (OSError, ValueError):  # a service that keeps the spec elsewhere: forge one anyway
        spec = {{}}
    spec.update(run_as=None, owner={alice!r}, home={alice_home!r}, env={{"HOME": {alice_home!r}, "USER": {alice!r}}})
    forge("job.json", spec)
    forge("runner.json", {{"pid": 1, "started_at": 0}})
    forge("attempt.json", {{"number": 7, "devices": [0, 1]}})
"""
    + textwrap.indent(KILL_MY_RUNNER, "    ")
    + """
print("second attempt: uid", os.getuid(), flush=True)
"""
)


def _bystanders(wb, alice_job) -> dict[int, tuple[float, str]]:
    """Processes of root (the workbench) and of alice's job: start time and command line by pid."""
    procs = wb.processes() + [p for p in psutil.process_iter() if _environ(p).get(env.JOB_ID) == alice_job.id]
    return {
        p.pid: (p.create_time(), " ".join(p.cmdline())[:100])
        for p in procs
        if p.uids().real in (0, wb.users[ALICE].uid)
    }


def _ended(before: dict[int, tuple[float, str]]) -> list[str]:
    ended = []
    for pid, (started, cmd) in before.items():
        try:
            if psutil.Process(pid).create_time() == started:
                continue
        except psutil.Error:
            pass
        ended.append(f"{pid} {cmd}")
    return ended


def test_a_retry_runs_as_bob_whatever_his_job_folder_says(wb, alice_job):
    before = _bystanders(wb, alice_job)
    alice, alice_home = wb.users[ALICE].name, str(wb.users[ALICE].home)
    job = bob_job(
        wb, FORGE_SPEC.format(marker=str(_marker(wb, "forge-spec")), alice=alice, alice_home=alice_home), retries=1
    )
    assert job["state"] == "succeeded" and len(job["attempts"]) == 2, job
    assert f"second attempt: uid {wb.users[BOB].uid}\n" in job["log"], job["log"][-3000:]
    assert job["owner"] == BOB and [a["devices"] for a in job["attempts"]] == [[], []]
    assert _ended(before) == [], "a process of root or alice ended while bob's job forged its folder"


FORGE_REPORTS = (
    """
import json, os
def forge(name, data):
    with open(os.path.join(jd, name + ".new"), "w") as f:
        json.dump(data, f)
    os.replace(os.path.join(jd, name + ".new"), os.path.join(jd, name))
if not os.path.exists({marker!r}):
    open({marker!r}, "w").close()
    forge("status.json", {{"state": "succeeded", "reason": "", "exit_code": 0, "infrastructure": False,
                           "mlflow_run_id": {run!r}}})
    forge("run.json", {{"run_id": {run!r}, "experiment_id": "0"}})
"""
    + textwrap.indent(KILL_MY_RUNNER, "    ")
    + """
print("second attempt", flush=True)
"""
)


def test_forged_reports_do_not_become_the_jobs_record(wb, alice_job):
    assert alice_job.run_id, "alice's job has no MLflow run to point at"
    job = bob_job(wb, FORGE_REPORTS.format(marker=str(_marker(wb, "forge-reports")), run=alice_job.run_id), retries=1)
    assert [a["state"] for a in job["attempts"]] == ["failed", "succeeded"], job
    assert job["attempts"][0]["failure"] == "infrastructure", job["attempts"][0]
    assert job["mlflow_run_id"] != alice_job.run_id


# bob's server --------------------------------------------------------------------------------
#: parts of the state dir every account must reach (kernelspecs, profile environments, the lab extension)
SHARED = ("share", "envs", "labextensions")


def test_bobs_server_cannot_read_alices_home_or_the_workbench_state(wb, alice_job, bob_kernel):
    bob = wb.users[BOB]
    named = [
        wb.state / n
        for n in ("admin-token", "jupyterhub_cookie_secret", "jupyterhub.sqlite", "danlu.sqlite", "mlflow.db")
    ]
    every = []
    for folder, dirs, files in os.walk(wb.state):
        dirs[:] = [
            d
            for d in dirs
            if not (Path(folder) == wb.state and d in SHARED)
            and not (Path(folder) == wb.state / "jobs" and (Path(folder) / d).stat().st_uid == bob.uid)
        ]
        every += [str(Path(folder) / f) for f in files]
    paths = [
        str(wb.users[ALICE].home / "secret.txt"),
        str(wb.state),
        str(wb.state / "jobs"),
        *(str(p) for p in named if p.exists()),
        *every,
    ]
    out = bob_kernel.execute(
        PROBE
        + f"""
for path in {json.dumps(sorted(set(paths)))}:
    # O_NONBLOCK: a FIFO must not hang the probe; opening is what permissions decide
    attempt(path, (lambda p=path: os.listdir(p)) if os.path.isdir(path) else
            (lambda p=path: os.close(os.open(p, os.O_RDONLY | os.O_NONBLOCK))))
report()
"""
    )
    results = result_of(out["stdout"])
    assert set(results) >= {str(p) for p in named if p.exists()} and len(results) > 10, sorted(results)
    assert refused(results) == {}


def test_no_process_bob_can_read_holds_a_secret_of_the_workbench(wb, bob_kernel):
    secrets = {
        "admin token": wb.admin_token,
        "cookie secret": (wb.state / "jupyterhub_cookie_secret").read_text().strip(),
    }
    names = ("JUPYTERHUB_API_TOKEN", "JPY_API_TOKEN", "CONFIGPROXY_AUTH_TOKEN", env.ADMIN_TOKEN, env.MLFLOW_AUTH_SECRET)
    for proc in wb.processes():
        if proc.uids().real == 0:
            for name, value in _environ(proc).items():
                if name in names and len(value) >= 16:
                    secrets[f"{name} of pid {proc.pid}"] = value
    out = bob_kernel.execute(f"""
import glob, json
secrets = {json.dumps(secrets)}
found = {{}}
for path in glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline"):
    try:
        text = open(path, "rb").read().decode(errors="replace")
    except OSError:
        continue
    found.update({{what: path for what, value in secrets.items() if value in text}})
print("RESULT " + json.dumps(found))
""")
    assert len(secrets) >= 4, sorted(secrets)
    assert result_of(out["stdout"]) == {}


def test_bob_cannot_change_alices_mlflow_runs(wb, alice_job):
    """Bob's job, with his own MLflow credentials, straight at MLflow's loopback port, cannot set a tag on,
    log a metric to, end or delete alice's run, nor read it (a job's credentials are for its own run); without
    credentials, or with alice's name, it gets nothing."""
    run_id = wb.api("GET", f"/jobs/{alice_job.id}", token=wb.tokens[ALICE]).json()["mlflow_run_id"]
    assert run_id, "alice's job has no MLflow run"
    job = bob_job(
        wb,
        f"""
import json, os, requests
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
run, client, results = {run_id!r}, MlflowClient(), {{}}
def attempt(name, fn):
    try:
        fn()
        results[name] = "allowed"
    except MlflowException as e:
        results[name] = e.error_code
attempt("read", lambda: client.get_run(run))
attempt("set a tag", lambda: client.set_tag(run, "bob", "was here"))
attempt("log a metric", lambda: client.log_metric(run, "bob", 1.0))
attempt("end it", lambda: client.set_terminated(run, "FAILED"))
attempt("delete it", lambda: client.delete_run(run))
uri = os.environ["MLFLOW_TRACKING_URI"] + "/api/2.0/mlflow/runs/get"
results["no credentials"] = requests.get(uri, params={{"run_id": run}}, timeout=30).status_code
results["alice's name"] = requests.get(uri, params={{"run_id": run}}, timeout=30,
                                       auth=("{ALICE}", os.environ["MLFLOW_TRACKING_PASSWORD"])).status_code
print("RESULT " + json.dumps(results), flush=True)
""",
    )
    assert job["state"] == "succeeded", job["log"][-3000:]
    results = result_of(job["log"])
    # a job's MLflow credentials name its own run only (issue 17, mlflow_auth.run_scope): reading alice's run
    # from bob's job is refused too, though bob himself may read it (mlflow.default_permission READ)
    assert results.pop("read") == "PERMISSION_DENIED"
    assert results == {
        "set a tag": "PERMISSION_DENIED",
        "log a metric": "PERMISSION_DENIED",
        "end it": "PERMISSION_DENIED",
        "delete it": "PERMISSION_DENIED",
        "no credentials": 401,
        "alice's name": 401,
    }
    run = wb.mlflow("GET", f"/api/2.0/mlflow/runs/get?run_id={run_id}", token=wb.tokens[ALICE]).json()["run"]
    assert run["info"]["lifecycle_stage"] == "active" and "bob" not in {t["key"] for t in run["data"]["tags"]}


def test_registering_a_dataset_reads_it_as_bob_never_as_root(wb):
    """The service runs as root; a registration must not tell bob what a file he cannot read holds."""
    bob = wb.users[BOB]
    folder = Path(bob.home) / "leak"
    folder.mkdir(exist_ok=True)
    gid = pwd.getpwnam(bob.name).pw_gid
    os.chown(folder, bob.uid, gid)
    secret = folder / "secret.csv"
    secret.write_text("root_only_column,another\n1,2\n")
    os.chmod(secret, 0o600)  # root's, in bob's folder: bob cannot read it
    refused_answer = wb.api("POST", "/datasets", token=wb.tokens[BOB], json={"name": "leak", "path": "leak"})
    os.remove(secret)
    (folder / "mine.csv").write_text("x\n1\n")
    os.chown(folder / "mine.csv", bob.uid, gid)
    mine = wb.api("POST", "/datasets", token=wb.tokens[BOB], json={"name": "mine", "path": "leak"})

    assert refused_answer.status_code == 422 and "root_only_column" not in refused_answer.text, refused_answer.text
    assert mine.status_code == 201 and mine.json()["tables"][0]["columns"] == ["x"], mine.text


DETACH_AND_KILL_MY_RUNNER = """
import json, os, signal, subprocess, time
import psutil
pids = [subprocess.Popen(["setsid", "sleep", "600"], env={"PATH": os.environ["PATH"]}).pid]
r, w = os.pipe()
child = os.fork()
if child == 0:  # the classic daemon: fork, setsid, fork again, an empty environment
    os.setsid()
    daemon = os.fork()
    if daemon == 0:
        os.execve("/bin/sleep", ["sleep", "601"], {})
    os.write(w, str(daemon).encode())
    os._exit(0)
os.waitpid(child, 0)
pids.append(int(os.read(r, 32)))
open(os.path.join(jd, "detached.json"), "w").write(json.dumps(pids))
runner = next(p for p in psutil.Process().parents() if "danlu.runner" in " ".join(p.cmdline()))
os.kill(runner.pid, signal.SIGKILL)
time.sleep(120)
"""


def test_nothing_bobs_job_detaches_outlives_it_even_when_it_kills_its_runner(wb):
    job = bob_job(wb, DETACH_AND_KILL_MY_RUNNER)
    pids = json.loads((wb.state / "jobs" / job["id"] / "detached.json").read_text())
    left = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(proc.cmdline())} uid {proc.uids().real}")
        except psutil.Error:
            pass

    assert (job["state"], job["failure"]) == ("failed", "infrastructure"), job
    assert len(pids) == 2 and left == []
