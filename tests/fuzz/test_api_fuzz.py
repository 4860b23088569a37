"""Service tier: the jobs service against its own OpenAPI document, fuzzed and probed, as three principals.

Schemathesis generates requests for every operation of ``openapi.yaml`` (valid
ones and ones that break the document's rules: wrong types, out-of-range
numbers, missing fields) and sends them through the proxy of a real, drained
workbench as an anonymous caller, a user (alice) and an admin (the admin
token); the runner API gets random bearer tokens. Every answer must be no 5xx,
a status the document lists for the operation, a content type it lists, and a
body that matches its schema. ``/drain`` is left out of the fuzzing so no job
ever starts. Then the classes of input a hostile probe tried, sent on
purpose: every method on every route (real and not), deep and non-finite
JSON, lone surrogates and NUL, out-of-range dates, offsets and counts,
hostile path parameters, bodies that are not objects. Each refusal is a JSON
error naming the field.
"""

from __future__ import annotations

import itertools
import json
import re

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from danlu.hub.service.validation import check_schema, openapi

pytestmark = pytest.mark.service

PREFIX = "/services/danlu/api/v1"


def refusals_name_the_field_and_the_fix(ctx, response, case):
    """A 400, 413 or 422 says which parameter or body field is wrong, and what to send instead."""
    if response.status_code in (400, 413, 422):
        body = json.loads(response.content)
        assert body.get("field") and body.get("fix"), f"a {response.status_code} without field and fix: {body}"


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    refusals_name_the_field_and_the_fix,
]
# Per operation and principal, on top of the examples and coverage phases (bounds, missing and wrong-typed
# values: ~3000 requests): 23 operations x 3 principals and 3 runner operations make ~3500 requests.
MAX_EXAMPLES = 10
CONFIG = schemathesis.Config.from_dict(
    {
        "generation": {"mode": "all", "deterministic": True, "database": "none", "with-security-parameters": False},
        "phases": {"stateful": {"enabled": False}},
        "suppress-health-check": ["all"],
    }
)
SCHEMA = schemathesis.openapi.from_dict(openapi(), config=CONFIG)
USER_API = SCHEMA.exclude(path="/drain").exclude(path_regex="^/runner/")
RUNNER_API = SCHEMA.include(path_regex="^/runner/")
FUZZ = settings(
    max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
)
# what a runner might send: well-formed tokens nobody holds, and anything printable
BEARERS = st.one_of(
    st.from_regex(r"\A[A-Za-z0-9_-]{20,100}\Z"),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=200),
)


def headers_of(wb, principal: str) -> dict:
    return {
        "anonymous": {},
        "user": {"Authorization": f"token {wb.tokens['alice']}"},
        "admin": {"Authorization": f"token {wb.admin_token}"},
    }[principal]


@pytest.mark.parametrize("principal", ["anonymous", "user", "admin"])
@USER_API.parametrize()
@FUZZ
def test_every_operation_keeps_to_the_document(case, principal, fuzz_workbench, fuzz_session):
    case.call_and_validate(
        base_url=fuzz_workbench.url + PREFIX,
        session=fuzz_session,
        headers=headers_of(fuzz_workbench, principal),
        checks=CHECKS,
        timeout=60,
    )


@RUNNER_API.parametrize()
@RUNNER_API.given(bearer=BEARERS)
@FUZZ
def test_runner_api_keeps_to_the_document_whatever_the_token(case, bearer, fuzz_workbench, fuzz_session):
    case.call_and_validate(
        base_url=fuzz_workbench.url + PREFIX,
        session=fuzz_session,
        headers={"Authorization": f"Bearer {bearer}"},
        checks=CHECKS,
        timeout=60,
    )


# the classes a hostile probe tried, on purpose ----------------------------------------------------

NB = {
    "cells": [
        {
            "cell_type": "code",
            "id": "c1",
            "metadata": {},
            "outputs": [],
            "execution_count": None,
            "source": "print('hi')",
        }
    ],
    "metadata": {},
    "nbformat": 4,
    "nbformat_minor": 5,
}
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "TRACE", "PROPFIND")
JOB = "0123456789ab"  # no such job
ROUTES = [
    "/health",
    "/openapi.json",
    "/profiles",
    "/jobs",
    f"/jobs/{JOB}",
    f"/jobs/{JOB}/cancel",
    f"/jobs/{JOB}/logs",
    f"/jobs/{JOB}/output",
    f"/jobs/{JOB}/input",
    "/queues",
    "/queues/research",
    "/queues/research/hold",
    "/queues/research/release",
    "/drain",
    "/audit",
    "/audit/verify",
    "/usage",
    "/allocations",
    "/allocations/server/alice",
    f"/runner/jobs/{JOB}/attempts/1/spec",
    f"/runner/jobs/{JOB}/attempts/1/stop",
    f"/runner/jobs/{JOB}/attempts/1/events",
    # no such route
    "",
    "/",
    "/nope",
    "/allocations/nope",
    "/allocations/server",
    "/allocations/server/a/b",
    "/jobs/x/y/z",
    f"/jobs/{JOB}/logs/more",
    "/queues/a/b/c",
    "/runner",
    f"/runner/jobs/{JOB}/attempts/1",
    "/audit/verify/x",
    "/openapi.yaml",
    "/../metrics",
    # hostile path parameters
    "/jobs/%00",
    "/jobs/%2e%2e",
    "/jobs/%2e%2e/%2e%2e/metrics",
    "/jobs/..%2f..%2fetc/output",
    "/jobs/" + "a" * 4000,
    "/queues/%00",
    "/queues/" + "q" * 4000,
    "/allocations/server/%00",
    "/allocations/server/%2e%2e",
    "/allocations/server/" + "h" * 4000,
    f"/runner/jobs/{JOB}/attempts/0/spec",
    f"/runner/jobs/{JOB}/attempts/99999999999999999999/stop",
    "/runner/jobs/%00/attempts/1/events",
]


@pytest.fixture(scope="module")
def queued_job(fuzz_workbench) -> str:
    """A job of alice's that stays queued (the workbench drains): the target of queries about a real job."""
    r = fuzz_workbench.api("POST", "/jobs", token=fuzz_workbench.tokens["alice"], json={"notebook": NB, "name": "q"})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def documented(path: str, method: str) -> bool:
    """Whether ``method path`` is an operation of the document (any value in a path parameter)."""
    for template, item in openapi()["paths"].items():
        pattern = "^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$"
        if re.match(pattern, path) and method.lower() in item:
            return True
    return False


def error_of(r: requests.Response) -> dict:
    """The JSON error of a refusal, checked against the document's Error schema."""
    assert r.headers["Content-Type"].startswith("application/json"), (r.status_code, r.headers, r.text[:300])
    body = r.json()
    check_schema("Error", body)
    assert body["status"] == r.status_code and "Traceback" not in r.text, body
    return body


@pytest.mark.parametrize("principal", ["anonymous", "user", "admin"])
def test_every_method_on_every_route_is_an_answer_not_a_crash(fuzz_workbench, fuzz_session, principal):
    """Undocumented method/route combinations are 401/403/404/405 JSON (a 405 says what is allowed)."""
    headers = headers_of(fuzz_workbench, principal)
    for route, method in itertools.product(ROUTES, METHODS):
        if route == "/drain" and method == "POST":
            continue  # a valid body would end the drain; its refusals are below
        r = fuzz_session.request(
            method,
            fuzz_workbench.url + PREFIX + route,
            headers=headers,
            timeout=60,
            data=b"{}" if method in ("POST", "PUT", "PATCH") else None,
            allow_redirects=False,
        )
        where = f"{principal}: {method} {route[:80]} -> {r.status_code}"
        assert r.status_code < 500, f"{where} {r.text[:300]}"
        if documented(route, method):
            continue  # the fuzzing above holds these to the document
        assert r.status_code in (401, 403, 404, 405), f"{where} {r.text[:300]}"
        if r.status_code == 405:
            allowed = {m.strip() for m in r.headers["Allow"].split(",")}
            assert allowed and method not in allowed, where
            assert all(documented(route, m) for m in allowed), where
        if method != "HEAD":
            error_of(r)


DEEP = 100_000
BODIES = {
    "deep-array": b"[" * DEEP + b"]" * DEEP,
    "deep-object": b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    "nan": b'{"on": NaN, "priority": NaN, "gpus": NaN}',
    "infinity": b'{"on": Infinity, "gpus": -Infinity}',
    "huge-float": b'{"holder": "alice", "owner": "alice", "gpus": 1e999, "quota": {"memory": 1e999}}',
    "huge-int": b'{"holder": "alice", "owner": "alice", "gpus": ' + b"9" * 5000 + b"}",
    "surrogate-value": b'{"priority": "\\ud800", "actor": "\\udfff", "action": "login"}',
    "surrogate-key": b'{"\\ud800": 1}',
    "nul-value": b'{"priority": "a\\u0000b", "actor": "\\u0000", "action": "login"}',
    "nul-key": b'{"a\\u0000": 1}',
    "array": b"[]",
    "number": b"1",
    "null": b"null",
    "string": b'"on"',
    "empty": b"",
    "not-utf8": b'{"a": "\xff"}',
    "not-json": b"{'on': true}",
    "truncated": b'\xef\xbb\xbf{"on": true',
}
WRITES = [
    ("POST", "/jobs"),
    ("PATCH", f"/jobs/{JOB}"),
    ("PATCH", "/queues/research"),
    ("POST", "/drain"),
    ("POST", "/audit"),
    ("POST", "/allocations"),
    ("POST", f"/runner/jobs/{JOB}/attempts/1/events"),
]


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_hostile_bodies_are_refused_with_the_field_named(fuzz_workbench, fuzz_session, kind):
    for principal, (method, route) in itertools.product(("anonymous", "user", "admin"), WRITES):
        headers = {**headers_of(fuzz_workbench, principal), "Content-Type": "application/json"}
        if route.startswith("/runner/"):
            headers["Authorization"] = "Bearer " + "t" * 40
        r = fuzz_session.request(
            method, fuzz_workbench.url + PREFIX + route, headers=headers, data=BODIES[kind], timeout=120
        )
        where = f"{kind}: {principal} {method} {route} -> {r.status_code}"
        assert r.status_code in (400, 401, 403, 404, 413, 422), f"{where} {r.text[:300]}"
        body = error_of(r)
        if r.status_code in (400, 413, 422):
            assert body.get("field") and body.get("fix"), where


def test_quota_changes_are_bounded(fuzz_workbench, fuzz_session):
    """A live quota is a finite, bounded amount: nothing is stored that the scheduler cannot use."""
    admin = headers_of(fuzz_workbench, "admin")
    url = fuzz_workbench.url + PREFIX + "/queues/research"
    assert fuzz_session.delete(url, headers=admin, timeout=60).status_code == 200  # whatever the fuzzing set
    for change, field in [
        ({"quota": {"memory": 10**400}}, "quota.memory"),
        ({"quota": {"memory": 2**61}}, "quota.memory"),
        ({"quota": {"memory": "99999999999999999999T"}}, "quota.memory"),
        ({"quota": {"cpu": 1e308}}, "quota.cpu"),
        ({"quota": {"gpus": {"sim": 10**30}}}, "quota.gpus.sim"),
        ({"borrowing_limit": {"gpus": {"sim": -1}}}, "borrowing_limit.gpus.sim"),
        ({"lending_limit": {"memory": -5}}, "lending_limit.memory"),
        ({}, "body"),
    ]:
        r = fuzz_session.patch(url, headers=admin, json=change, timeout=60)
        assert r.status_code == 422, (change, r.status_code, r.text[:300])
        assert error_of(r)["field"] == field, (change, r.text)
    r = fuzz_session.patch(url, headers=admin, json={"quota": {"memory": "64G", "cpu": 8}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["quota"] == {"gpus": {"sim": 1}, "memory": "64G", "cpu": 8}
    assert fuzz_session.delete(url, headers=admin, timeout=60).json()["quota"] == {"gpus": {"sim": 1}}


@pytest.mark.parametrize(
    "memory",
    ["1e999G", "1e308T", "inf", "NaNG", "-1G", "99999999999999999999T", 1e308, 2**61, -1, True, [1], "1" * 100],
)
def test_sizes_are_finite_and_bounded(fuzz_workbench, fuzz_session, memory):
    r = fuzz_session.post(
        fuzz_workbench.url + PREFIX + "/jobs",
        headers=headers_of(fuzz_workbench, "user"),
        json={"notebook": NB, "resources": {"memory": memory}, "dry_run": True},
        timeout=60,
    )
    assert r.status_code == 422, (memory, r.status_code, r.text[:300])
    body = error_of(r)
    assert body["field"] == "resources.memory" and body["fix"], body


def queries(job: str) -> dict[str, list[str]]:
    return {
        "/jobs": [
            "limit=99999999999999999999999",
            "limit=0",
            "limit=-1",
            "limit=1e3",
            "limit=%00",
            "limit=%D9%A1",
            "limit=%201",
            "limit=1&limit=2",
            "state=%00",
            "state=" + "x" * 300,
            "owner=%ED%A0%80",
            "owner=" + "o" * 1000,
            "queue=%00",
            "queue=a%0Ab",
        ],
        f"/jobs/{job}/logs": [
            "offset=" + "9" * 30,
            "offset=9007199254740992",
            "offset=-1",
            "tail=9007199254740991",
            "tail=-1",
            "tail=100001",
            "follow=maybe",
            "follow=%00",
            "follow=true&follow=false",
        ],
        f"/jobs/{job}/output": ["rank=99999", "rank=-1", "rank=1e2", "rank=4096", "format=pdf", "format=%00"],
        f"/jobs/{job}/input": ["format=pdf", "format=html%00"],
        "/usage": [
            "from=0001-01-01",
            "to=9999-12-31T23:59:59-05:00",
            "from=9999-12-31T23:59:59-05:00",
            "to=0001-01-01T00:00:00%2B14:00",
            "from=2020-13-45",
            "to=%2B275760-09-13",
            "from=1969-12-31",
            "from=2026-01-01T00:00:00%2B99:00",
            "from=2026-01-02&to=2026-01-01",
            "from=1970-01-01&to=9999-12-30",
            "by=x",
            "user=%00",
            "from=" + "2" * 100,
            "from=%ED%A0%80",
            "from=2026-01-01%00",
        ],
        "/audit": ["limit=10001", "limit=0", "action=%00", "target=" + "t" * 300],
    }


def test_out_of_range_queries_are_refused_with_the_field_named(fuzz_workbench, fuzz_session, queued_job):
    for principal in ("user", "admin"):
        for route, values in queries(queued_job).items():
            for query in values:
                r = fuzz_session.get(
                    f"{fuzz_workbench.url}{PREFIX}{route}?{query}",
                    headers=headers_of(fuzz_workbench, principal),
                    timeout=60,
                )
                where = f"{principal}: GET {route}?{query[:60]} -> {r.status_code}"
                assert r.status_code in (400, 403, 404, 422), f"{where} {r.text[:300]}"
                body = error_of(r)
                if r.status_code != 403:
                    assert body.get("field") in (query.split("=")[0], "from", "to"), f"{where} {body}"


def test_the_largest_values_in_range_are_answered(fuzz_workbench, fuzz_session, queued_job):
    """Each bound is a bound, not a crash one past it: the extremes the document allows get a 200."""
    for principal, route in [
        ("user", f"/jobs/{queued_job}/logs?offset=9007199254740991"),
        ("user", f"/jobs/{queued_job}/logs?tail=100000&offset=0"),
        ("user", f"/jobs/{queued_job}/logs?tail=0"),
        ("user", f"/jobs/{queued_job}/input?format=ipynb"),
        ("user", "/jobs?limit=1000&state=queued,running"),
        ("user", "/usage?from=9999-12-29&to=9999-12-30T23:59:59"),
        ("user", "/usage?from=1970-01-01T00:00:00Z&to=1970-01-02"),
        ("user", "/usage?from=2026-01-01T00:00:00%2B14:00&to=2026-01-01T00:00:00-14:00"),
        ("admin", "/usage?from=2016-01-01&to=2026-01-01&by=profile"),
        ("admin", "/audit?limit=10000"),
        ("admin", f"/jobs?limit=1&owner={'o' * 256}"),
    ]:
        r = fuzz_session.get(
            fuzz_workbench.url + PREFIX + route, headers=headers_of(fuzz_workbench, principal), timeout=60
        )
        assert r.status_code == 200, (principal, route, r.status_code, r.text[:300])


def test_malformed_percent_encoding_is_a_json_400_at_the_service(fuzz_workbench, fuzz_session, queued_job):
    """Percent-escapes that are not UTF-8, straight to the service (the proxy in front answers these with its
    own 500 before they reach it: a configurable-http-proxy limit)."""
    service = f"http://127.0.0.1:{fuzz_workbench.info['service_port']}{PREFIX}"
    admin = headers_of(fuzz_workbench, "admin")
    for method, path, field in [
        ("GET", "/jobs/%ff", "id"),
        ("DELETE", "/queues/%ff", "name"),
        ("DELETE", "/allocations/server/%c0%af", "holder"),
        ("GET", "/jobs?owner=%ff", "owner"),
        ("GET", f"/jobs/{queued_job}/logs?tail=%ff", "tail"),
        ("GET", f"/runner/jobs/{JOB}/attempts/%ff/stop", "attempt"),
        ("FOO", "/jobs", None),
        ("FOO", "/nope", None),
    ]:
        r = fuzz_session.request(method, service + path, headers=admin, timeout=60)
        body = error_of(r)
        if field:
            assert r.status_code == 400 and body["field"] == field and body["fix"], (method, path, body)
        else:
            assert r.status_code in (404, 405), (method, path, r.status_code)


def test_document_and_routes_agree():
    """Every path and method of the document has a handler, and every route and method is in the document."""
    from tornado import web

    from danlu.hub.service.api.routes import routes as service_routes
    from danlu.hub.service.api.web import METHODS as HANDLED

    samples = {
        "id": JOB,
        "attempt": "1",
        "name": "research",
        "holder": "alice",
        "version": "1",
        "rank": "0",
        "alias": "champion",
        "other": JOB,
    }
    documented_paths = {
        PREFIX + path.format(**samples): {m.upper() for m in item if m in HANDLED}
        for path, item in openapi()["paths"].items()
    }
    routes = [
        (re.compile(pattern + "$"), handler)
        for pattern, handler in service_routes("/services/danlu/")
        if pattern.startswith(PREFIX)
    ]
    for path, methods in documented_paths.items():
        handler = next((h for route, h in routes if route.match(path)), None)
        assert handler is not None, f"{path} has no route"
        implemented = {m.upper() for m in HANDLED if getattr(handler, m) is not getattr(web.RequestHandler, m)}
        assert methods == implemented, (path, methods, implemented)
    for route, _ in routes:
        assert any(route.match(path) for path in documented_paths), f"{route.pattern} is not in the document"
