"""Service tier: a hostile user against the jobs service's bounds, through its public HTTP API.

One workbench (``danlu up``) with ``danlu_service_config.py`` beside its danlu.yaml setting small bounds, so
each refusal shows in a second: bodies bounded before authentication, XSRF for every cookie, admin routes
that authorize before they validate, parameter sizes, HTML renders at once, the runner API's rate per
attempt, dataset versions from their owner only, and data too large to scan refused before it is read.
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import os
import re
import socket
import time

import pytest
import requests

from danlu.hub.testing import Workbench

from .conftest import CONFIG, PROFILES
from .test_api_input import NB, body

pytestmark = pytest.mark.service

SERVICE_CONFIG = """
c.JobsServiceApp.max_html_renders = 1
c.JobsServiceApp.dataset_max_bytes = 2**30
c.JobsServiceApp.dataset_scan_timeout = 30
c.JobsServiceApp.runner_api_rate = 1
c.JobsServiceApp.runner_api_burst = 20
"""


@pytest.fixture(scope="module")
def wb(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bounds")
    (tmp / "danlu_service_config.py").write_text(SERVICE_CONFIG)
    bench = Workbench(tmp, config={**CONFIG, "jobs": dict(CONFIG["jobs"])}, profiles=PROFILES)
    bench.start()
    bench.tokens = {name: bench.create_user(name, groups) for name, groups in (("alice", ["research"]), ("bob", []))}
    yield bench
    assert bench.stop() == 0, bench.log_tail()


def raw_request(wb, head: str, timeout: float = 10) -> tuple[int, dict]:
    """Send ``head`` (request line and headers) and the first KiB of the body, and read the answer: a server
    that waits for the rest of the body it was promised times out here."""
    with socket.create_connection(("127.0.0.1", wb.port), timeout=timeout) as sock:
        sock.sendall(head.encode() + b" " * 1024)  # the proxy forwards the request once some body comes
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1] or b"{}")


def _length(data: bytes) -> int:
    match = re.search(rb"(?i)\r\ncontent-length: *(\d+)", data)
    return int(match.group(1)) if match else 0


def test_an_anonymous_body_is_refused_before_it_is_read(wb):
    """50 MB announced, none sent: a 413 at once, not a wait for (and a buffer of) the body."""
    status, error = raw_request(
        wb,
        "POST /services/danlu/api/v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 50000000\r\n\r\n",
    )
    assert status == 413 and error["reason"] == "too_large", error
    assert "unauthenticated" in error["message"] and "Authorization" in error["fix"]
    # the runner API likewise, before its token is checked against the database
    status, error = raw_request(
        wb,
        "PUT /services/danlu/api/v1/runner/jobs/0123456789ab/attempts/1/outputs/0 HTTP/1.1\r\nHost: x\r\n"
        "Authorization: Bearer nope\r\nContent-Length: 50000000\r\n\r\n",
    )
    assert status in (401, 403, 413), error
    # an authenticated caller keeps the route's own bound: a 1 MiB notebook is fine
    nb = copy.deepcopy(NB)
    nb["cells"].append({"cell_type": "markdown", "id": "big", "metadata": {}, "source": "x" * 2**20})
    r = wb.api("POST", "/jobs", token=wb.tokens["alice"], json=body(notebook=nb, dry_run=True))
    assert r.status_code == 200, r.text


def log_in(wb, user: str) -> requests.Session:
    """A browser: the hub's login form (any password), then the service's OAuth, which sets its cookie."""
    session = requests.Session()
    page = session.get(f"{wb.url}/hub/login", timeout=30)
    xsrf = re.search(r'name="_xsrf" value="([^"]+)"', page.text).group(1)
    r = session.post(
        f"{wb.url}/hub/login",
        data={"username": user, "password": "any", "_xsrf": xsrf},
        allow_redirects=False,
        timeout=30,
    )
    assert r.status_code == 302, r.text
    r = session.get(f"{wb.url}/services/danlu/", headers={"Accept": "text/html"}, timeout=60)
    assert r.status_code == 200 and "Danlu jobs" in r.text, r.text[:500]
    return session


def test_xsrf_is_checked_for_every_cookie_whatever_the_other_headers(wb):
    browser = log_in(wb, "alice")
    jobs = f"{wb.url}/services/danlu/api/v1/jobs"
    assert browser.get(jobs, timeout=30).status_code == 200  # the cookie authenticates
    submit = body(dry_run=True)
    assert browser.post(jobs, json=submit, timeout=30).status_code in (401, 403)  # no XSRF token: no login
    for header in ("Basic Zm9vOmJhcg==", "token not-a-token", "Bearer junk"):
        r = browser.post(jobs, json=submit, headers={"Authorization": header}, timeout=30)
        assert r.status_code in (401, 403), (header, r.status_code, r.text)
    # a token needs no XSRF token, cookie or not
    r = browser.post(jobs, json=submit, headers={"Authorization": f"token {wb.tokens['alice']}"}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "method, path, raw",
    [
        ("POST", "/drain", b"{"),
        ("POST", "/drain", b'{"on": "maybe"}'),
        ("PATCH", "/queues/default", b"[]"),
        ("POST", "/allocations", b'{"holder": 1}'),
        ("DELETE", "/allocations/server/%00", b""),
        ("GET", "/audit?limit=banana", b""),
    ],
)
def test_a_non_admin_gets_403_on_an_admin_route_whatever_the_body(wb, method, path, raw):
    r = wb.api(method, path, token=wb.tokens["bob"], data=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 403 and r.json()["reason"] == "not_admin", r.text


def test_parameter_values_are_bounded(wb):
    alice = wb.tokens["alice"]
    r = wb.api("POST", "/jobs", token=alice, json=body(dry_run=True, parameters={"blob": "x" * 100_000}))
    assert r.status_code == 422, r.text
    error = r.json()
    assert error["field"] == "parameters.blob" and error["reason"] == "too_large"
    assert "16384 bytes" in error["message"]
    many = {f"p{i}": "y" * 10_000 for i in range(10)}
    r = wb.api("POST", "/jobs", token=alice, json=body(dry_run=True, parameters=many))
    assert r.status_code == 422 and "65536 bytes" in r.json()["message"], r.text


def home_of(wb, user: str):
    home = wb.state / "users" / user
    home.mkdir(parents=True, exist_ok=True)
    return home


def test_a_datasets_versions_come_from_its_owner_only(wb):
    (home_of(wb, "alice") / "mine").mkdir(exist_ok=True)
    (home_of(wb, "alice") / "mine" / "a.csv").write_text("a\n1\n")
    (home_of(wb, "bob") / "poison").mkdir(exist_ok=True)
    (home_of(wb, "bob") / "poison" / "a.csv").write_text("a\n666\n")
    r = wb.api("POST", "/datasets", token=wb.tokens["alice"], json={"name": "alices", "path": "mine"})
    assert r.status_code == 201, r.text
    r = wb.api("POST", "/datasets", token=wb.tokens["bob"], json={"name": "alices", "path": "poison"})
    assert r.status_code == 403 and r.json()["reason"] == "not_a_registrant", r.text
    latest = wb.api("GET", "/datasets/alices", token=wb.tokens["bob"]).json()["latest"]
    assert latest["version"] == 1 and latest["created_by"] == "alice"


def test_a_sparse_terabyte_is_refused_before_it_is_read(wb):
    big = home_of(wb, "bob") / "huge.bin"
    with open(big, "wb") as f:
        f.truncate(2**40)  # a sparse 1 TiB: no disk, but hashing it would read for an hour
    started = time.monotonic()
    r = wb.api("POST", "/datasets", token=wb.tokens["bob"], json={"name": "huge", "path": "huge.bin"}, timeout=30)
    assert r.status_code == 422 and r.json()["reason"] == "too_large", r.text
    assert "sparse files count in full" in r.json()["message"] and time.monotonic() - started < 20
    os.unlink(big)


def slow_notebook() -> dict:
    nb = copy.deepcopy(NB)
    text = {"output_type": "stream", "name": "stdout", "text": ["line of output\n"] * 200}
    nb["cells"] += [
        {"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": 1, "source": "pass", "outputs": [text]}
        for i in range(300)
    ]
    return nb


def test_html_renders_are_bounded_in_concurrency(wb):
    alice = wb.tokens["alice"]
    r = wb.api("POST", "/jobs", token=alice, json=body(notebook=slow_notebook(), name="slow-render"))
    assert r.status_code == 201, r.text
    job = r.json()["id"]

    def render(_):
        r = wb.api("GET", f"/jobs/{job}/input?format=html", token=alice, timeout=120)
        return r.status_code, r.headers.get("Retry-After"), r.headers.get("Content-Type", "")

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(render, range(6)))
    wb.api("POST", f"/jobs/{job}/cancel", token=alice)
    statuses = [a[0] for a in answers]
    assert 200 in statuses and 503 in statuses, answers
    assert all(a[1] == "5" and a[2].startswith("application/json") for a in answers if a[0] == 503), answers


HAMMER = """
import json, os, urllib.request, urllib.error
names = ("DANLU_RUNNER_API", "DANLU_JOB_ID", "DANLU_ATTEMPT", "DANLU_JOB_TOKEN")
api, job, attempt, token = (os.environ[k] for k in names)
seen = []
for _ in range(30):
    url = f"{api}/runner/jobs/{job}/attempts/{attempt}/spec"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        urllib.request.urlopen(req, timeout=30).read()
        seen.append([200, None])
    except urllib.error.HTTPError as e:
        seen.append([e.code, e.headers.get("Retry-After")])
# then calls that cost 1 until one is refused: the attempt's bucket is empty as the cell ends, and the runner's
# own reports (its job's end among them) must wait their turn, not be lost
for _ in range(100):
    try:
        urllib.request.urlopen(urllib.request.Request(f"{api}/runner/jobs/{job}/attempts/{attempt}/stop",
                               headers={"Authorization": f"Bearer {token}"}), timeout=30).read()
    except urllib.error.HTTPError as e:
        if e.code == 429:
            break
print("SEEN" + json.dumps(seen))
"""


def test_a_jobs_code_is_rate_bounded_on_the_runner_api(wb):
    """The job's code reads its spec 30 times (at most 1 a second here, a read costing 10): refused with 429 and
    Retry-After; and the runner's reports after the cell used up the rate wait and arrive (the job succeeds)."""
    alice = wb.tokens["alice"]
    nb = copy.deepcopy(NB)
    nb["cells"][0]["source"] = HAMMER
    r = wb.api("POST", "/jobs", token=alice, json=body(notebook=nb, name="hammer", parameters={}))
    assert r.status_code == 201, r.text
    job = wb.wait_job(r.json()["id"], alice, timeout=240)
    assert job["state"] == "succeeded", job
    output = wb.api("GET", f"/jobs/{job['id']}/output", token=alice).text
    seen = json.loads(re.search(r"SEEN(\[.*?\]\])", output.replace('\\"', '"')).group(1))
    codes = [code for code, _ in seen]
    assert codes[0] == 200 and 429 in codes, codes
    assert all(int(after) >= 1 for code, after in seen if code == 429), seen


def _answers(sock: socket.socket) -> tuple[bytes, bytes]:
    """One answer's head and body from a keep-alive connection (b"", b"" once the server closed it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b"", b""
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    while len(rest) < _length(head + b"\r\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return head, rest


@pytest.mark.parametrize(
    "refused",
    [
        "PROPFIND /services/danlu/api/v1/jobs HTTP/1.1\r\nHost: x\r\n\r\n",  # a method tornado does not know
        "POST /services/danlu/api/v1/health HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",  # a 405
        "POST /services/danlu/api/v1/nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",  # a 404
        # a body over an unauthenticated caller's bound, sent whole
        "POST /services/danlu/api/v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 70000\r\n\r\n" + "x" * 70000,
        # the runner API: a method its route does not have, before its rate bound
        "POST /services/danlu/api/v1/runner/jobs/0123456789ab/attempts/1/spec HTTP/1.1\r\nHost: x\r\n"
        "Authorization: Bearer nope\r\nContent-Length: 2\r\n\r\n{}",
    ],
    ids=["unknown-method", "405", "404", "413", "runner-405"],
)
def test_a_refusal_before_the_body_keeps_the_connection_or_says_it_ends(wb, refused):
    """configurable-http-proxy reuses its connections to the service: an answer given before the body was read
    used to end the connection without 'Connection: close', so the proxy's next request on it (anyone's)
    got a 503. A refusal is now answered after the body is read, and the connection serves the next request;
    where tornado answers before any handler runs, the answer says the connection ends."""
    with socket.create_connection(("127.0.0.1", wb.info["service_port"]), timeout=20) as sock:
        sock.sendall(refused.encode())
        head, body_ = _answers(sock)
        status = int(head.split(b" ", 2)[1])
        assert 400 <= status < 500 and json.loads(body_)["reason"], head + body_
        if b"connection: close" in head.lower():  # tornado refuses an unknown method before any handler runs
            assert refused.startswith("PROPFIND") and sock.recv(1) == b"", head
            return
        sock.sendall(b"GET /services/danlu/api/v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
        head, body_ = _answers(sock)
        assert head.startswith(b"HTTP/1.1 200"), (head, body_)


def test_a_body_too_large_to_read_ends_the_connection_and_says_so(wb):
    """Over 1 MiB announced, the refusal comes at once and the connection ends: the answer says so."""
    with socket.create_connection(("127.0.0.1", wb.info["service_port"]), timeout=20) as sock:
        sock.sendall(b"POST /services/danlu/api/v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n\r\n")
        head, body_ = _answers(sock)
        assert head.startswith(b"HTTP/1.1 413") and json.loads(body_)["reason"] == "too_large", head
        assert b"connection: close" in head.lower(), head
