"""Service tier: bad input gets a 4xx that names the field, and nothing is stored."""

from __future__ import annotations

import copy
import json

import pytest
import requests

from danlu.hub.service.validation import check_schema

pytestmark = pytest.mark.service

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


def body(**changes) -> dict:
    out = {
        "notebook": copy.deepcopy(NB),
        "parameters": {"lr": 0.1},
        "resources": {"nproc": 1, "gpus": 0},
        "profile": "python",
        "name": "ok",
    }
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            out[outer] = {**out.get(outer, {}), inner: value}
        else:
            out[key] = value
    return out


BAD = [
    # (id, body, status, field)
    ("unknown-field", body(colour="red"), 422, "colour"),
    ("unknown-resource", body(**{"resources.tpus": 1}), 422, "resources.tpus"),
    ("negative-nproc", body(**{"resources.nproc": -1}), 422, "resources.nproc"),
    ("zero-nproc", body(**{"resources.nproc": 0}), 422, "resources.nproc"),
    ("huge-nproc", body(**{"resources.nproc": 10**9}), 422, "resources.nproc"),
    ("nproc-over-limit", body(**{"resources.nproc": 500}), 422, "resources.nproc"),
    ("negative-gpus", body(**{"resources.gpus": -2}), 422, "resources.gpus"),
    ("huge-gpus", body(**{"resources.gpus": 10**12}), 422, "resources.gpus"),
    ("more-gpus-than-exist", body(**{"resources.gpus": 3}), 403, "resources.gpus"),
    ("string-gpus", body(**{"resources.gpus": "1"}), 422, "resources.gpus"),
    ("unknown-profile", body(profile="no-such-profile"), 404, "profile"),
    ("traversal-profile", body(profile="../python"), 404, "profile"),
    ("unknown-queue", body(queue="fast-lane"), 422, "queue"),
    ("name-with-slash", body(name="../../etc"), 422, "name"),
    ("cwd-dotdot", body(cwd="../bob"), 422, "cwd"),
    ("cwd-absolute", body(cwd="/etc"), 422, "cwd"),
    ("cwd-encoded", body(cwd="%2e%2e/bob"), 422, "cwd"),
    ("cwd-double-encoded", body(cwd="%252e%252e/bob"), 422, "cwd"),
    ("dataset-dotdot", body(datasets=["data/../../bob/secret"]), 422, "datasets[0]"),
    ("dataset-absolute", body(datasets=["/etc/passwd"]), 422, "datasets[0]"),
    ("dataset-encoded", body(datasets=["ok", "%2E%2E/x"]), 422, "datasets[1]"),
    ("dataset-unknown-root", body(datasets=["shared:imagenet"]), 422, "datasets[0]"),
    ("notebook-path-dotdot", body(source={"notebook_path": "../bob/x.ipynb"}), 422, "source.notebook_path"),
    ("notebook-path-absolute", body(source={"notebook_path": "/home/bob/x.ipynb"}), 422, "source.notebook_path"),
    ("notebook-path-encoded", body(source={"notebook_path": "%2e%2e%2fbob.ipynb"}), 422, "source.notebook_path"),
    ("missing-notebook", {"parameters": {}}, 422, "notebook"),
    ("notebook-v3", body(notebook={"nbformat": 3, "worksheets": []}), 422, "notebook"),
    ("notebook-no-code", body(notebook={**NB, "cells": []}), 422, "notebook"),
    ("notebook-bad-cells", body(notebook={**NB, "cells": ["print(1)"]}), 422, "notebook"),
    ("parameter-keyword", body(parameters={"class": 1}), 422, "parameters.class"),
    ("body-not-object", [1, 2], 422, "body"),
]


@pytest.mark.parametrize("case,payload,status,field", BAD, ids=[b[0] for b in BAD])
def test_bad_submission_names_the_field_and_stores_nothing(workbench, case, payload, status, field):
    alice = workbench.tokens["alice"]
    before = workbench.api("GET", "/jobs", token=workbench.tokens["admin"]).json()["jobs"]
    dirs = set((workbench.state / "jobs").iterdir())
    r = workbench.api("POST", "/jobs", token=alice, json=payload)
    assert r.status_code == status, r.text
    error = r.json()
    check_schema("Error", error)
    assert error["field"] == field, error
    assert error["message"] and "Traceback" not in r.text
    assert workbench.api("GET", "/jobs", token=workbench.tokens["admin"]).json()["jobs"] == before
    assert set((workbench.state / "jobs").iterdir()) == dirs


@pytest.mark.parametrize("raw", [b"{", b"not json", b'{"notebook": }', b"\xff\xfe"])
def test_malformed_json_is_a_400(workbench, raw):
    r = workbench.api(
        "POST", "/jobs", token=workbench.tokens["alice"], data=raw, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400
    assert r.json()["field"] == "body" and r.json()["reason"] == "malformed_json"


@pytest.mark.parametrize(
    "path, status, reason",
    [
        ("/jobs/..%2f..%2fetc/output", 400, "bad_id"),  # an encoded slash stays in the id, which is refused
        ("/jobs/%2e%2e/logs", 404, "no_endpoint"),  # the proxy resolves the dots: .../api/v1/logs is no route
        ("/jobs/0123/cancel", 400, "bad_id"),
        ("/jobs/ZZZZZZZZZZZZ", 400, "bad_id"),
    ],
)
def test_bad_job_ids(workbench, path, status, reason):
    method = "POST" if path.endswith("cancel") else "GET"
    r = workbench.api(method, path, token=workbench.tokens["alice"])
    assert (r.status_code, r.json()["reason"]) == (status, reason), r.text
    assert r.headers["Content-Type"].startswith("application/json")
    if status == 400:
        assert r.json()["field"] == "id" and r.json()["fix"] == "it must match ^[0-9a-f]{12}$"


def test_unauthenticated_and_unknown_endpoints(workbench):
    r = requests.get(f"{workbench.url}/services/danlu/api/v1/jobs", timeout=30)
    assert r.status_code == 401 and r.json()["reason"] == "unauthenticated"
    r = workbench.api("GET", "/jobs", token="not-a-real-token")
    assert r.status_code == 403
    r = workbench.api("GET", "/nope", token=workbench.tokens["alice"])
    assert r.status_code == 404 and r.json()["reason"] == "no_endpoint"
    r = workbench.api("GET", "/jobs?limit=banana", token=workbench.tokens["alice"])
    assert r.status_code == 400 and r.json()["field"] == "limit"
    r = workbench.api("GET", "/jobs?state=sleeping", token=workbench.tokens["alice"])
    assert r.status_code == 422 and r.json()["field"] == "state"


def test_services_cannot_submit_and_users_cannot_allocate(workbench):
    r = workbench.api("POST", "/jobs", token=workbench.admin_token, json=body())
    assert r.status_code == 403 and r.json()["reason"] == "not_a_user"
    r = workbench.api(
        "POST", "/allocations", token=workbench.tokens["alice"], json={"holder": "alice", "owner": "alice", "gpus": 1}
    )
    assert r.status_code == 403


def test_dry_run_says_whether_it_would_start_and_stores_nothing(workbench):
    alice = workbench.tokens["alice"]
    before = workbench.api("GET", "/jobs", token=alice).json()["jobs"]
    nb = copy.deepcopy(NB)
    nb["cells"].insert(
        0,
        {
            "cell_type": "code",
            "id": "p",
            "metadata": {"tags": ["parameters"]},
            "outputs": [],
            "execution_count": None,
            "source": "lr = 1.0",
        },
    )
    r = workbench.api("POST", "/jobs", token=alice, json=body(notebook=nb, dry_run=True, parameters={"lr": 0.25}))
    assert r.status_code == 200, r.text
    answer = r.json()
    check_schema("DryRun", answer)
    assert answer["dry_run"] is True and answer["admitted"] is True and answer["reason"] == "would start now"
    sources = ["".join(c["source"]) for c in answer["notebook"]["cells"]]
    assert any("lr = 0.25" in s for s in sources)  # papermill's injected parameters
    r = workbench.api(
        "POST",
        "/jobs",
        token=alice,
        json=body(dry_run=True, profile="python", **{"resources.gpus": 2, "resources.nproc": 1}),
    )
    # 2 GPUs exist but the python profile allows at most 1
    assert r.status_code == 403 and r.json()["field"] == "resources.gpus"
    assert workbench.api("GET", "/jobs", token=alice).json()["jobs"] == before


def test_openapi_document_is_served_and_matches_routes(workbench):
    doc = requests.get(f"{workbench.url}/services/danlu/api/v1/openapi.json", timeout=30).json()
    assert doc["openapi"].startswith("3.")
    assert {"/jobs", "/jobs/{id}", "/jobs/{id}/cancel", "/jobs/{id}/logs", "/jobs/{id}/output", "/profiles"} <= set(
        doc["paths"]
    )
    assert json.dumps(doc)  # serializable as served
