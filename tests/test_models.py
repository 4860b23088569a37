"""Registered models, the evaluation gate, approvals and aliases, on a real MLflow server with permissions on.

One MLflow basic-auth server for the module, started as ``danlu up`` starts it; each test builds its own
jobs service (a JobManager on a fresh database, as in test_catalog.py) whose MLflow access is that server's.
Evaluation jobs run on :class:`EvaluatingBackend`: its runner, like a real job, logs to MLflow as the job's
owner with the credentials the service gave it -- the metrics the test assigned to the model being
evaluated -- and reports its run. Users' runs are made over MLflow's REST API with their own credentials.

What is proved: a version registers from a run's logged model or its artifacts, and another user's run is a
404; a failing evaluation blocks approval (and a pending one does too), a passing one is approved by an
approver and not by its author nor by a non-approver; the alias follows (MLflow's get-by-alias) and moves
only to approved versions; a user's direct alias, tag and version writes to MLflow with their own
credentials (the job's, and the gateway's) are refused; every step is in the audit log and the chain
verifies; a same-named MLflow model Danlu did not create is never written to; hostile bodies are refused
naming the field. Then the CLI's ``models`` commands, on a client that answers what the service answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid

import pytest
import requests
import yaml

from danlu import cli, cliclient, tags
from danlu.env import MLFLOW_AUTH_SECRET
from danlu.errors import Conflict, DanluError, Forbidden, NotFound, ValidationError
from danlu.hub import mlflow_auth
from danlu.hub.config import load_settings
from danlu.hub.mlflow_auth import SERVICE_ACCOUNT, MlflowUsers, password
from danlu.hub.service.mlflow_client import MlflowAccess
from danlu.hub.testing import free_port

from .fakes import FakeBackend, FakeGroups, FakeRun, admin, make_manager, make_settings, notebook, serving, until, user

pytestmark = pytest.mark.service

ALICE = user("alice", "research")
BOB = user("bob")
CAROL = user("carol", "ml-leads")  # an approver
DAVE = user("dave", "research", "ml-leads")  # an approver who registers his own
ADMIN = admin()
GROUPS = {"alice": ["research"], "bob": [], "carol": ["ml-leads"], "dave": ["ml-leads", "research"], "admin": []}
EVAL_NOTEBOOK = notebook(
    "import danlu, mlflow\nmodel = mlflow.pyfunc.load_model(str(danlu.model(model_name, model_version)))\n"
    "mlflow.log_metric('accuracy', 0.95)"
)


# one MLflow server for the module -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """MLflow as danlu up starts it (basic-auth, default_permission READ); alice, bob, carol, dave its users."""
    yield from started_mlflow(tmp_path_factory, {})


@pytest.fixture(scope="module")
def private_mlflow_server(tmp_path_factory):
    """As :func:`mlflow_server`, with ``mlflow.default_permission: NO_PERMISSIONS``."""
    yield from started_mlflow(tmp_path_factory, {"mlflow": {"default_permission": "NO_PERMISSIONS"}})


def started_mlflow(tmp_path_factory, config: dict):
    from danlu.hub.app import DanluUp, wait_http

    folder = tmp_path_factory.mktemp("mlflow-models")
    (folder / "danlu.yaml").write_text(yaml.safe_dump(config))
    settings = load_settings(folder / "danlu.yaml", {"state_dir": str(folder / "state")})
    (settings.state_dir / "logs").mkdir(parents=True)
    secret = mlflow_auth.ensure_secret(settings.state_dir)
    port = free_port()
    proc = DanluUp().start_mlflow(settings, port, {**os.environ, str(MLFLOW_AUTH_SECRET): secret})
    url = f"http://127.0.0.1:{port}/services/mlflow"
    try:
        wait_http(f"{url}/health", 300, proc, "MLflow")
        users = MlflowUsers(url, secret)

        async def provision():
            for name in ("alice", "bob", "carol", "dave"):
                await users.ensure_user(name)

        asyncio.run(provision())
        yield MlflowServer(url, secret)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


class MlflowServer:
    """The module's MLflow: REST calls as one of its users, with the password the service derives for them."""

    def __init__(self, url: str, secret: str):
        self.url, self.secret = url, secret

    def call(self, who: str, method: str, path: str, **kwargs) -> requests.Response:
        return requests.request(
            method, f"{self.url}{path}", auth=(who, password(self.secret, who)), timeout=60, **kwargs
        )

    def ok(self, who: str, method: str, path: str, **kwargs) -> dict:
        r = self.call(who, method, path, **kwargs)
        assert r.status_code == 200, (method, path, r.status_code, r.text)
        return r.json()

    def experiment(self, who: str, name: str) -> str:
        r = self.call(who, "GET", "/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": name})
        if r.status_code == 200:
            return r.json()["experiment"]["experiment_id"]
        return self.ok(who, "POST", "/api/2.0/mlflow/experiments/create", json={"name": name})["experiment_id"]

    def run(
        self,
        who: str,
        *,
        logged_model: str | None = None,
        artifact: str | None = None,
        metrics: dict | None = None,
        experiment: str | None = None,
        run_tags: dict | None = None,
    ) -> str:
        """A finished run ``who`` made in MLflow outside any job (tagged with ``run_tags``, by default as a job's
        runner tags it), with a logged model or an artifact file."""
        experiment_id = self.experiment(who, experiment or f"{who}/models-{uuid.uuid4().hex[:8]}")
        run = self.ok(
            who,
            "POST",
            "/api/2.0/mlflow/runs/create",
            json={
                "experiment_id": experiment_id,
                "tags": [{"key": k, "value": v} for k, v in (run_tags or {tags.USER: who}).items()],
            },
        )["run"]
        self.log(run["info"]["run_id"], experiment_id, metrics, logged_model, artifact, who)
        return run["info"]["run_id"]

    def log(self, run_id, experiment_id, metrics=None, logged_model=None, artifact=None, who="job") -> None:
        """Into ``run_id``: metrics, a logged model, an artifact file; then the run is finished."""
        if metrics:
            now = int(time.time() * 1000)
            self.ok(
                who,
                "POST",
                "/api/2.0/mlflow/runs/log-batch",
                json={
                    "run_id": run_id,
                    "metrics": [{"key": k, "value": v, "timestamp": now, "step": 0} for k, v in metrics.items()],
                },
            )
        if logged_model:
            self.ok(
                who,
                "POST",
                "/api/2.0/mlflow/logged-models",
                json={"experiment_id": experiment_id, "name": logged_model, "source_run_id": run_id},
            )
        if artifact:
            info = self.ok(who, "GET", "/api/2.0/mlflow/runs/get", params={"run_id": run_id})["run"]["info"]
            where = info["artifact_uri"].split("mlflow-artifacts:", 1)[1].strip("/")
            r = self.call(who, "PUT", f"/api/2.0/mlflow-artifacts/artifacts/{where}/{artifact}", data=b"flavors: {}\n")
            assert r.status_code == 200, r.text
        self.ok(who, "POST", "/api/2.0/mlflow/runs/update", json={"run_id": run_id, "status": "FINISHED"})

    def version(self, name: str, version: int) -> dict:
        return self.ok(
            "alice", "GET", "/api/2.0/mlflow/model-versions/get", params={"name": name, "version": str(version)}
        )["model_version"]


# a job's runner: it trains or evaluates -------------------------------------------------------------------
class EvaluatingBackend(FakeBackend):
    """Its runner does what a real job does with the run the service made for it, with the attempt's MLflow
    credentials from its spec: a job with ``model_name`` evaluates (it loads the version, then logs the metrics
    :attr:`scores` gives that model), any other trains (it logs what its parameters ``logged_model``,
    ``artifact`` and ``metrics`` say). It reports the run and succeeds -- or, for a model in :attr:`forge` or
    with a parameter ``claim``, reports that run instead, as a hostile job would. While :attr:`hold` is clear,
    runners wait."""

    def __init__(self, scores: dict[str, dict], **kwargs):
        super().__init__(**kwargs)
        self.scores = scores
        self.forge: dict[str, str] = {}
        self.refusals: list = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.parameters: list[dict] = []
        self.specs: list[dict] = []

    async def runner(self, run: FakeRun) -> int:
        spec = await run.fetch_spec()
        if spec is None:
            return 3
        self.specs.append(spec)
        await self.hold.wait()
        params = spec["parameters"]
        if "model_name" in params:
            self.parameters.append(params)
        run_id = spec["tracking"]["run_id"]
        assert run_id and spec["mlflow_env"]["MLFLOW_TRACKING_USERNAME"].startswith(f"job/{run.job_id}/")
        await asyncio.to_thread(self._log, spec)
        reported = params.get("claim") or self.forge.get(params.get("model_name"), run_id)
        launch = run.launch
        event = {"event": "tracking", "run_id": reported}
        try:  # straight to the runner API, to keep its refusal (FakeRun.call keeps only the status)
            await run.machine.api.event(launch.job_id, launch.attempt, launch.token, event)
        except DanluError as e:
            self.refusals.append(e)
        await run.report("succeeded")
        return 0

    def _log(self, spec: dict) -> None:
        env, params = spec["mlflow_env"], spec["parameters"]
        server = MlflowServer(env["MLFLOW_TRACKING_URI"], None)
        auth = (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"])
        server.call = lambda who, method, path, **kw: requests.request(
            method, f"{server.url}{path}", auth=auth, timeout=60, **kw
        )
        run_id, experiment_id = spec["tracking"]["run_id"], spec["tracking"]["experiment_id"]
        if "model_name" in params:
            # what the notebook does first: load the version it evaluates, which its job may read
            model = {"name": params["model_name"], "version": str(params["model_version"])}
            server.ok("job", "GET", "/api/2.0/mlflow/model-versions/get", params=model)
            metrics = self.scores[params["model_name"]]
        else:
            metrics = params.get("metrics") or {}
        server.log(run_id, experiment_id, metrics, params.get("logged_model"), params.get("artifact"))


async def trained(manager, who, **what) -> str:
    """The MLflow run of a finished training job of ``who``'s (what the service recorded)."""
    status, job = await manager.submit(who, {"notebook": notebook("train()"), "parameters": what})
    assert status == 201, job

    async def finished():
        j = await manager.get(who, job["id"])
        return j if j.state == "succeeded" and j.mlflow_run_id else None

    return (await until(finished, "the training job to succeed with its run", patience=120, every=0.1)).mlflow_run_id


@contextlib.asynccontextmanager
async def service(
    tmp_path,
    mlflow: MlflowServer,
    backend: FakeBackend,
    evaluations: dict | None = None,
    mlflow_settings=None,
    **models,
):
    """A jobs service on the module's MLflow whose danlu.yaml has approvers ml-leads and ``evaluations``."""
    state = tmp_path / "state"
    for name in GROUPS:
        (state / "users" / name).mkdir(parents=True, exist_ok=True)
    specs = {}
    for name, (thresholds, nb) in (evaluations or {}).items():
        path = tmp_path / f"evaluate-{name}.ipynb"
        path.write_text(json.dumps(nb))
        specs[name] = {"notebook": str(path), "thresholds": thresholds}
    extra = {"mlflow": mlflow_settings} if mlflow_settings else {}
    settings = make_settings(state, models={"approvers": ["ml-leads"], "evaluations": specs, **models}, **extra)
    manager = make_manager(
        backend, state, settings=settings, groups=FakeGroups(GROUPS), mlflow=MlflowAccess(mlflow.url, mlflow.secret)
    )
    async with serving(manager):
        yield manager


def in_loop(test):
    import functools

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


async def gate(manager, name: str, version: int, *states: str) -> dict:
    """The version once its evaluation is in one of ``states``."""

    async def check():
        v = await manager.models.version_view(ALICE, name, version)
        return v if v["evaluation"]["state"] in states else None

    return await until(check, f"{name} v{version}'s evaluation to be {' or '.join(states)}", patience=120, every=0.1)


# the whole path ------------------------------------------------------------------------------------------
@in_loop
async def test_a_passing_evaluation_is_approved_by_an_approver_not_its_author_and_the_alias_follows(
    tmp_path, mlflow_server
):
    mlflow = mlflow_server
    name = f"gated-{uuid.uuid4().hex[:6]}"
    backend = EvaluatingBackend({name: {"accuracy": 0.95, "loss": 0.2}})
    async with service(
        tmp_path, mlflow, backend, {name: ({"accuracy": ">= 0.9", "loss": "<= 0.5"}, EVAL_NOTEBOOK)}
    ) as manager:
        run_id = await trained(manager, DAVE, logged_model="model")
        status, registered = await manager.models.register(
            DAVE, {"run_id": run_id, "name": name, "description": "digits"}
        )
        passed = await gate(manager, name, 1, "passed", "failed", "error")
        with pytest.raises(Forbidden) as own:
            await manager.models.decide(DAVE, name, 1, {"decision": "approve", "comment": "mine is great"})
        with pytest.raises(Forbidden) as outsider:
            await manager.models.decide(ALICE, name, 1, {"decision": "approve", "comment": "looks fine"})
        with pytest.raises(Forbidden) as early_alias:
            await manager.models.set_alias(BOB, name, "champion", {"version": 1})
        approved = await manager.models.decide(CAROL, name, 1, {"decision": "approve", "comment": "meets the bar"})
        with pytest.raises(Conflict) as twice:
            await manager.models.decide(CAROL, name, 1, {"decision": "reject", "comment": "changed my mind"})
        moved = await manager.models.set_alias(CAROL, name, "champion", {"version": 1})
        shown = await manager.models.show(ALICE, name)
        listed = await manager.models.list(BOB)
        records = await manager.audit.records(ADMIN, limit=50, action=None, target=None)
        verified = await manager.audit.verify(ADMIN)
        evaluation_job = await manager.get(DAVE, passed["evaluation"]["job_id"])

    assert status == 201 and registered["version"] == 1 and registered["run_id"] == run_id
    assert registered["source"].startswith("models:/m-") and registered["registered_by"] == "dave"
    assert registered["approval"] == "pending" and registered["evaluation"]["job_id"]  # the fake job may be done
    # the evaluation ran as an ordinary job of dave's, on the version, and its metrics are on the version
    assert evaluation_job.owner == "dave" and evaluation_job.state == "succeeded"
    # and names the copy the service made, which danlu.model loads and checks (the run can still be rewritten)
    assert registered["digest"] and backend.parameters == [
        {"model_uri": f"models:/{name}/1", "model_name": name, "model_version": 1, "model_digest": registered["digest"]}
    ]
    assert passed["evaluation"]["state"] == "passed", passed["evaluation"]
    assert passed["evaluation"]["metrics"] == {"accuracy": 0.95, "loss": 0.2} and passed["evaluation"]["failures"] == []
    assert own.value.reason == "self_approval" and outsider.value.reason == "not_an_approver"
    assert early_alias.value.reason == "not_an_approver" and twice.value.reason == "already_decided"
    assert approved["approval"] == "approved"
    [decision] = approved["decisions"]
    assert decision["actor"] == "carol" and decision["comment"] == "meets the bar"
    assert moved == {"name": name, "alias": "champion", "version": 1, "previous": None}
    assert shown["aliases"] == {"champion": 1} and shown["versions"][0]["aliases"] == ["champion"]
    assert [m["name"] for m in listed if m["name"] == name] == [name]

    # MLflow's copy: the alias follows, the version's tags say what the database says
    by_alias = await asyncio.to_thread(
        mlflow.ok, "bob", "GET", "/api/2.0/mlflow/registered-models/alias", params={"name": name, "alias": "champion"}
    )
    assert by_alias["model_version"]["version"] == "1"
    version_tags = {t["key"]: t["value"] for t in (await asyncio.to_thread(mlflow.version, name, 1))["tags"]}
    assert version_tags[tags.APPROVAL] == "approved" and version_tags[tags.APPROVED_BY] == "carol"
    assert version_tags[tags.EVALUATION] == "passed" and version_tags[tags.REGISTERED_BY] == "dave"
    assert json.loads(version_tags[tags.EVALUATION_METRICS]) == {"accuracy": 0.95, "loss": 0.2}

    # every step is in the audit log, and the chain holds
    mine = [(r["action"], r["target"], r["actor"]) for r in reversed(records) if r["target"].startswith(name)]
    assert mine == [
        ("create_model", name, "dave"),
        ("register_model", f"{name}@1", "dave"),
        ("evaluate_model", f"{name}@1", "danlu"),
        ("approve_model", f"{name}@1", "carol"),
        ("set_model_alias", f"{name}@1", "carol"),
    ]
    approval = next(r for r in records if r["action"] == "approve_model")
    assert approval["after"] == {"approval": "approved", "comment": "meets the bar", "digest": registered["digest"]}
    assert approval["seq"] == decision["audit_seq"]
    assert verified["ok"] and verified["records"] == len(records)


@in_loop
async def test_users_cannot_write_around_the_approvals_in_mlflow(tmp_path, mlflow_server, caplog):
    """alice's own credentials -- a job's, and what the gateway forwards for her -- change nothing of the model."""
    mlflow = mlflow_server
    name = f"guarded-{uuid.uuid4().hex[:6]}"
    async with service(tmp_path, mlflow, EvaluatingBackend({})) as manager:
        run_id = await trained(manager, ALICE, artifact="model/MLmodel")
        _, v1 = await manager.models.register(ALICE, {"run_id": run_id, "name": name, "artifact_path": "model"})
        _, v2 = await manager.models.register(ALICE, {"run_id": run_id, "name": name, "artifact_path": "model"})
        await manager.models.decide(CAROL, name, 1, {"decision": "approve", "comment": "ok"})
        await manager.models.set_alias(CAROL, name, "champion", {"version": 1})
        with pytest.raises(Conflict) as unapproved:
            await manager.models.set_alias(CAROL, name, "champion", {"version": 2})

    assert "could not grant" not in caplog.text  # the registrant was granted READ on the model
    assert v1["source"] == f"runs:/{run_id}/model" and v2["version"] == 2
    assert v1["evaluation"]["state"] == "not_required" and unapproved.value.reason == "not_approved"
    writes = [
        ("POST", "/api/2.0/mlflow/registered-models/alias", {"name": name, "alias": "champion", "version": "2"}),
        ("POST", "/api/2.0/mlflow/registered-models/alias", {"name": name, "alias": "staging", "version": "2"}),
        ("DELETE", "/api/2.0/mlflow/registered-models/alias", {"name": name, "alias": "champion"}),
        (
            "POST",
            "/api/2.0/mlflow/model-versions/set-tag",
            {"name": name, "version": "2", "key": tags.APPROVAL, "value": "approved"},
        ),
        ("POST", "/api/2.0/mlflow/registered-models/set-tag", {"name": name, "key": "k", "value": "v"}),
        (
            "POST",
            "/api/2.0/mlflow/model-versions/create",
            {"name": name, "source": f"runs:/{run_id}/model", "run_id": run_id},
        ),
        (
            "POST",
            "/api/2.0/mlflow/model-versions/transition-stage",
            {"name": name, "version": "2", "stage": "Production", "archive_existing_versions": False},
        ),
        ("POST", "/api/2.0/mlflow/registered-models/rename", {"name": name, "new_name": f"{name}-x"}),
        ("DELETE", "/api/2.0/mlflow/model-versions/delete", {"name": name, "version": "1"}),
        ("DELETE", "/api/2.0/mlflow/registered-models/delete", {"name": name}),
    ]
    for who in ("alice", "bob"):
        for method, path, body in writes:
            r = await asyncio.to_thread(mlflow.call, who, method, path, json=body)
            assert r.status_code == 403, (who, method, path, r.status_code, r.text)
    # nothing moved, and alice reads her versions (what her evaluation job needs)
    by_alias = await asyncio.to_thread(
        mlflow.ok, "alice", "GET", "/api/2.0/mlflow/registered-models/alias", params={"name": name, "alias": "champion"}
    )
    assert by_alias["model_version"]["version"] == "1"
    version_tags = {t["key"]: t["value"] for t in (await asyncio.to_thread(mlflow.version, name, 2))["tags"]}
    assert version_tags[tags.APPROVAL] == "pending"


@in_loop
async def test_a_failing_or_unfinished_evaluation_blocks_approval(tmp_path, mlflow_server):
    mlflow = mlflow_server
    name = f"weak-{uuid.uuid4().hex[:6]}"
    backend = EvaluatingBackend({name: {"accuracy": 0.5}})
    async with service(
        tmp_path, mlflow, backend, {name: ({"accuracy": ">= 0.9", "loss": "<= 0.5"}, EVAL_NOTEBOOK)}
    ) as manager:
        run_id = await trained(manager, ALICE, logged_model="model")
        backend.hold.clear()
        await manager.models.register(ALICE, {"run_id": run_id, "name": name})
        waiting = await gate(manager, name, 1, "running")
        with pytest.raises(Conflict) as pending:
            await manager.models.decide(CAROL, name, 1, {"decision": "approve", "comment": "ship it"})
        backend.hold.set()
        failed = await gate(manager, name, 1, "passed", "failed", "error")
        with pytest.raises(Conflict) as blocked:
            await manager.models.decide(CAROL, name, 1, {"decision": "approve", "comment": "ship it anyway"})
        with pytest.raises(Conflict) as no_alias:
            await manager.models.set_alias(ADMIN, name, "staging", {"version": 1})
        rejected = await manager.models.decide(ADMIN, name, 1, {"decision": "reject", "comment": "too weak"})
        verdicts = await manager.audit.records(ADMIN, limit=10, action="evaluate_model", target=f"{name}@1")

    assert waiting["evaluation"]["state"] == "running" and pending.value.reason == "evaluation_pending"
    assert failed["evaluation"]["state"] == "failed"
    assert failed["evaluation"]["failures"] == [
        "accuracy = 0.5, needs >= 0.9",
        "loss was not logged by the evaluation run (needs <= 0.5)",
    ]
    assert blocked.value.reason == "evaluation_failed" and "accuracy = 0.5" in str(blocked.value)
    assert no_alias.value.reason == "not_approved"
    assert rejected["approval"] == "rejected" and rejected["decisions"][0]["decision"] == "reject"
    assert [r["after"]["evaluation"] for r in verdicts] == ["failed"]


@in_loop
async def test_another_users_run_is_not_found_and_names_danlu_did_not_make_are_refused(tmp_path, mlflow_server):
    mlflow = mlflow_server
    suffix = uuid.uuid4().hex[:6]
    # bob may not make a registered model in MLflow himself (the server's rules, danlu.hub.mlflowserver) ...
    squat = f"squat-{suffix}"
    r = await asyncio.to_thread(
        mlflow.call, "bob", "POST", "/api/2.0/mlflow/registered-models/create", json={"name": squat}
    )
    assert (r.status_code, r.json()["reason"]) == (403, "registry_writes"), r.text
    # ... but one Danlu did not create may be there (made before, or by MLflow's own admin)
    await asyncio.to_thread(
        mlflow.ok, SERVICE_ACCOUNT, "POST", "/api/2.0/mlflow/registered-models/create", json={"name": squat}
    )
    async with service(tmp_path, mlflow, EvaluatingBackend({})) as manager:
        alices = await trained(manager, ALICE, logged_model="model")
        bare = await trained(manager, ALICE)
        refusals = {}
        for key, who, body in (
            ("bob's view of alice's run", BOB, {"run_id": alices, "name": f"b-{suffix}"}),
            ("no such run", ALICE, {"run_id": "0" * 32, "name": f"b-{suffix}"}),
            ("no model", ALICE, {"run_id": bare, "name": f"b-{suffix}"}),
            ("no such artifact", ALICE, {"run_id": alices, "name": f"b-{suffix}", "artifact_path": "nope"}),
            ("squatted", ALICE, {"run_id": alices, "name": squat}),
        ):
            with pytest.raises(DanluError) as e:
                await manager.models.register(who, body)
            refusals[key] = (type(e.value), e.value.reason, e.value.field)
        _, by_admin = await manager.models.register(ADMIN, {"run_id": alices, "name": f"a-{suffix}"})
        with pytest.raises(NotFound) as missing:
            await manager.models.version_view(BOB, f"a-{suffix}", 2)
        with pytest.raises(NotFound) as no_model:
            await manager.models.show(BOB, f"nope-{suffix}")

    assert refusals == {
        "bob's view of alice's run": (NotFound, "no_such_run", "run_id"),
        "no such run": (NotFound, "no_such_run", "run_id"),
        "no model": (ValidationError, "no_model", "artifact_path"),
        "no such artifact": (ValidationError, "no_model", "artifact_path"),
        "squatted": (Conflict, "name_taken", "name"),
    }
    assert by_admin["registered_by"] == "admin"  # admins may register any run
    assert missing.value.reason == "no_such_version" and no_model.value.reason == "no_such_model"
    squatted = await asyncio.to_thread(
        mlflow.ok, "bob", "GET", "/api/2.0/mlflow/registered-models/get", params={"name": squat}
    )
    assert not squatted["registered_model"].get("latest_versions")  # nothing was added to that model


# evidence the registrant cannot write ------------------------------------------------------------------------
@in_loop
async def test_a_job_cannot_claim_anothers_run_and_run_tags_prove_nothing(tmp_path, mlflow_server):
    """bob's job reports alice's run as its own, and bob tags a run of his with alice's job: neither lets him
    register her model, nor makes lineage name her job."""
    mlflow = mlflow_server
    suffix = uuid.uuid4().hex[:6]
    backend = EvaluatingBackend({})
    async with service(tmp_path, mlflow, backend) as manager:
        alices = await trained(manager, ALICE, logged_model="model")
        alices_job = next(j.id for j in await manager.list(ADMIN) if j.mlflow_run_id == alices)
        bobs = await trained(manager, BOB, claim=alices)
        forged = await asyncio.to_thread(
            mlflow.run, "bob", logged_model="model", run_tags={tags.USER: "bob", tags.JOB_ID: alices_job}
        )
        refused = {}
        for key, run_id in (("claimed", alices), ("tagged", forged)):
            with pytest.raises(NotFound) as e:
                await manager.models.register(BOB, {"run_id": run_id, "name": f"{key}-{suffix}"})
            refused[key] = (e.value.reason, e.value.field)
        listed = await manager.models.list(ADMIN)

    [claim] = backend.refusals
    assert isinstance(claim, Conflict) and claim.reason == "not_this_jobs_run" and alices in str(claim)
    assert bobs != alices  # bob's job keeps the run the service made for it
    assert refused == {"claimed": ("no_such_run", "run_id"), "tagged": ("no_such_run", "run_id")}
    assert not [m for m in listed if m["name"].endswith(suffix)]


@in_loop
async def test_the_evaluation_verdict_comes_from_a_run_the_registrant_cannot_write(tmp_path, mlflow_server):
    """alice's model scores 0.5. She logs accuracy=0.99 into her evaluation's run with her own credentials,
    and her evaluation job reports a run of hers that says 0.99: the gate fails all the same."""
    mlflow = mlflow_server
    name = f"forged-{uuid.uuid4().hex[:6]}"
    backend = EvaluatingBackend({name: {"accuracy": 0.5}})
    async with service(tmp_path, mlflow, backend, {name: ({"accuracy": ">= 0.9"}, EVAL_NOTEBOOK)}) as manager:
        run_id = await trained(manager, ALICE, logged_model="model")
        backend.forge[name] = await asyncio.to_thread(mlflow.run, "alice", metrics={"accuracy": 0.99})
        backend.hold.clear()
        await manager.models.register(ALICE, {"run_id": run_id, "name": name})
        running = await gate(manager, name, 1, "running")
        evaluation = await until(
            lambda: next((s for s in backend.specs if s["parameters"].get("model_name") == name), None),
            "the evaluation job to fetch its spec",
        )
        now = int(time.time() * 1000)
        write = await asyncio.to_thread(
            mlflow.call,
            "alice",
            "POST",
            "/api/2.0/mlflow/runs/log-metric",
            json={"run_id": evaluation["tracking"]["run_id"], "key": "accuracy", "value": 0.99, "timestamp": now},
        )
        backend.hold.set()
        failed = await gate(manager, name, 1, "passed", "failed", "error")
        with pytest.raises(Conflict) as blocked:
            await manager.models.decide(CAROL, name, 1, {"decision": "approve", "comment": "0.99!"})
        job = await manager.get(ALICE, running["evaluation"]["job_id"])

    assert write.status_code == 403, write.text  # the evaluation's experiment is the service's
    assert evaluation["experiment"].startswith("danlu-evaluations/")
    assert [e.reason for e in backend.refusals] == ["not_this_jobs_run"]
    assert job.mlflow_run_id == evaluation["tracking"]["run_id"] != backend.forge[name]
    assert failed["evaluation"]["state"] == "failed" and failed["evaluation"]["metrics"] == {"accuracy": 0.5}
    assert blocked.value.reason == "evaluation_failed"


@in_loop
async def test_model_reads_follow_the_experiments_permissions(tmp_path, private_mlflow_server):
    """Under NO_PERMISSIONS bob may not read alice's experiment, so he sees none of her versions: not their run,
    not their evaluation's metrics; alice and the approvers do."""
    mlflow = private_mlflow_server
    name = f"private-{uuid.uuid4().hex[:6]}"
    async with service(
        tmp_path, mlflow, EvaluatingBackend({}), mlflow_settings={"default_permission": "NO_PERMISSIONS"}
    ) as manager:
        run_id = await trained(manager, ALICE, logged_model="model")
        await manager.models.register(ALICE, {"run_id": run_id, "name": name})
        shown = {who.name: await manager.models.show(who, name) for who in (ALICE, BOB, CAROL)}
        listed = {m["name"]: m for m in await manager.models.list(BOB)}
        with pytest.raises(NotFound) as version:
            await manager.models.version_view(BOB, name, 1)
        with pytest.raises(NotFound) as lineage:
            await manager.lineage(BOB, name, 1)

    assert [v["run_id"] for v in shown["alice"]["versions"]] == [run_id]
    assert [v["run_id"] for v in shown["carol"]["versions"]] == [run_id]  # an approver decides on it
    assert shown["bob"]["versions"] == [] and shown["bob"]["latest"] is None
    assert listed[name]["latest"] is None and run_id not in json.dumps(listed)
    assert version.value.reason == lineage.value.reason == "no_such_version"


@in_loop
async def test_credentials_of_attempts_that_ended_while_the_service_was_away_stop_working(tmp_path, mlflow_server):
    """An attempt whose end the service never saw (it was stopped) keeps no MLflow login: the service sweeps
    such attempts' users when it starts."""
    mlflow = mlflow_server
    stale = mlflow_auth.job_username(uuid.uuid4().hex[:12], 1, uuid.uuid4().hex)
    await MlflowUsers(mlflow.url, mlflow.secret).ensure_user(stale)

    def status() -> int:
        return mlflow.call(stale, "GET", "/api/2.0/mlflow/experiments/search", params={"max_results": 1}).status_code

    before = await asyncio.to_thread(status)
    async with service(tmp_path, mlflow, EvaluatingBackend({})):
        await until(lambda: asyncio.to_thread(lambda: status() == 401), "the stale attempt's login to be refused")
    assert before == 200


HOSTILE = [
    ({"run_id": "r", "name": "x", "extra": 1}, "extra"),
    ({"name": "x"}, "run_id"),
    ({"run_id": "r", "name": "a/b"}, "name"),
    ({"run_id": "r", "name": "x\n"}, "name"),
    ({"run_id": "r\n", "name": "x"}, "run_id"),
    ({"run_id": "r", "name": "x" * 200}, "name"),
    ({"run_id": "r", "name": "x", "artifact_path": "../other-run"}, "artifact_path"),
    ({"run_id": "r", "name": "x", "artifact_path": "/etc/passwd"}, "artifact_path"),
    ({"run_id": "r", "name": "x", "artifact_path": "a//b"}, "artifact_path"),
    ({"run_id": "r", "name": "x", "artifact_path": "a\x00"}, "artifact_path"),
    ({"run_id": ["r"], "name": "x"}, "run_id"),
    ({"run_id": "r", "name": "x", "description": "d" * 5000}, "description"),
]


@in_loop
async def test_hostile_bodies_are_refused_naming_the_field(tmp_path, mlflow_server):
    async with service(tmp_path, mlflow_server, EvaluatingBackend({})) as manager:
        found = []
        for body, _field in HOSTILE:
            with pytest.raises(ValidationError) as e:
                await manager.models.register(ALICE, body)
            found.append((e.value.field, e.value.status < 500 and bool(e.value.fix)))
        decisions = []
        for body in (
            {"decision": "approve"},
            {"decision": "approve", "comment": " "},
            {"decision": "merge", "comment": "x"},
            {"decision": "approve", "comment": "x", "by": "carol"},
        ):
            with pytest.raises(ValidationError) as e:
                await manager.models.decide(CAROL, "any", 1, body)
            decisions.append(e.value.field)
        with pytest.raises(ValidationError) as reserved:
            await manager.models.set_alias(CAROL, "any", "latest", {"version": 1})
        with pytest.raises(ValidationError) as bad_version:
            await manager.models.set_alias(CAROL, "any", "champion", {"version": "1"})
        with pytest.raises(Forbidden) as service_token:
            from danlu.hub.service.auth import Principal

            await manager.models.register(Principal("svc", "service"), {"run_id": "r", "name": "x"})

    assert found == [(field, True) for _, field in HOSTILE]
    assert decisions == ["comment", "comment", "decision", "by"]
    assert reserved.value.reason == "reserved_alias" and bad_version.value.field == "version"
    assert service_token.value.reason == "not_a_user"


# the CLI ------------------------------------------------------------------------------------------------
class AnsweringClient:
    """What DanluClient would return, from answers the service gave."""

    def __init__(self, answers: dict):
        self.answers = answers
        self.calls = []

    def register_model(self, body):
        self.calls.append(("register", body))
        return self.answers["register"]

    def models(self):
        return self.answers["list"]

    def model(self, name):
        return self.answers["show"]

    def model_version(self, name, version):
        return self.answers["version"]

    def decide_model(self, name, version, decision, comment):
        self.calls.append((decision, name, version, comment))
        return self.answers["version"]

    def set_model_alias(self, name, alias, version):
        self.calls.append(("alias", name, alias, version))
        return self.answers["alias"]

    def delete_model_alias(self, name, alias):
        self.calls.append(("unalias", name, alias))
        return {**self.answers["alias"], "version": None, "previous": 1}


def test_cli_models_commands_print_tables_and_the_apis_json(tmp_path, mlflow_server, monkeypatch, capsys):
    name = f"cli-{uuid.uuid4().hex[:6]}"

    async def answers():
        async with service(tmp_path, mlflow_server, EvaluatingBackend({})) as manager:
            run_id = await trained(manager, ALICE, logged_model="model")
            _, registered = await manager.models.register(ALICE, {"run_id": run_id, "name": name})
            await manager.models.decide(CAROL, name, 1, {"decision": "approve", "comment": "fine"})
            alias = await manager.models.set_alias(CAROL, name, "staging", {"version": 1})
            return {
                "register": registered,
                "list": await manager.models.list(ALICE),
                "show": await manager.models.show(ALICE, name),
                "version": await manager.models.version_view(ALICE, name, 1),
                "alias": alias,
            }

    client = AnsweringClient(asyncio.run(answers()))
    run_id = client.answers["register"]["run_id"]
    monkeypatch.setattr(cliclient, "client", lambda args: client)
    for argv, key in (
        (["register", run_id, name], "register"),
        (["list"], "list"),
        (["show", name], "show"),
        (["show", name, "1"], "version"),
        (["approve", name, "1", "--comment", "ok"], "version"),
        (["alias", name, "staging", "1"], "alias"),
    ):
        assert cli.main(["models", *argv, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == client.answers[key]
        assert cli.main(["models", *argv]) == 0
        text = capsys.readouterr().out
        assert name in text, (argv, text)
    assert cli.main(["models", "show", name, "1"]) == 0
    text = capsys.readouterr().out
    assert "approve by carol" in text and "staging" in text
    assert cli.main(["models", "reject", name, "1", "--comment", "no"]) == 0
    assert cli.main(["models", "alias", name, "staging", "--delete"]) == 0
    assert "removed (was 1)" in capsys.readouterr().out
    assert client.calls[-2:] == [("reject", name, 1, "no"), ("unalias", name, "staging")]
    assert cli.main(["models", "alias", name, "staging"]) == 2
    assert "VERSION" in capsys.readouterr().err
    assert cli.main(["models", "approve", name, "1", "--comment", "  "]) == 2


# lineage ----------------------------------------------------------------------------------------------------
@in_loop
async def test_lineage_walks_from_a_version_to_its_data_environment_and_approvals(tmp_path, mlflow_server):
    from danlu.hub.service.registry.lineage import KINDS

    mlflow = mlflow_server
    name = f"traced-{uuid.uuid4().hex[:6]}"
    backend = EvaluatingBackend({})
    async with service(tmp_path, mlflow, backend) as manager:
        data = tmp_path / "state" / "users" / "alice" / "digits"
        data.mkdir()
        (data / "train.csv").write_text("x,y\n1,2\n")
        _, dataset = await manager.datasets.register(ALICE, {"name": "digits", "path": "digits"})
        status, job = await manager.submit(
            ALICE,
            {
                "notebook": notebook("import random\nrandom.seed(7)"),
                "parameters": {"lr": 0.1, "logged_model": "model", "metrics": {"accuracy": 0.97}},
                "datasets": ["digits@1", {"ref": "digits@1", "context": "evaluation"}],
                "source": {"notebook_path": "work/train.ipynb"},
            },
        )
        assert status == 201, job
        done = await until(lambda: manager.get(ALICE, job["id"]), "the training job")

        async def finished():
            j = await manager.get(ALICE, job["id"])
            return j if j.state == "succeeded" and j.mlflow_run_id else None

        trained = await until(finished, "the training job to succeed with its run", patience=120, every=0.1)
        _, version = await manager.models.register(ALICE, {"run_id": trained.mlflow_run_id, "name": name})
        await manager.models.decide(CAROL, name, 1, {"decision": "approve", "comment": "traced end to end"})
        await manager.models.set_alias(CAROL, name, "champion", {"version": 1})
        mine = await manager.lineage(ALICE, name, 1)
        theirs = await manager.lineage(BOB, name, 1)
        with pytest.raises(NotFound):
            await manager.lineage(ALICE, name, 2)
    assert done is not None and version["job_id"] == job["id"]

    kinds = {n["kind"]: n for n in mine["nodes"]}
    assert set(kinds) == {
        "model_version",
        "approval",
        "run",
        "job",
        "notebook",
        "cell",
        "dataset_version",
        "environment",
    } and set(kinds) <= set(KINDS)
    assert mine["model"] == {
        "name": name,
        "version": 1,
        "approval": "approved",
        "aliases": ["champion"],
        "run_id": trained.mlflow_run_id,
        "job_id": job["id"],
    }
    assert kinds["approval"]["detail"]["comment"] == "traced end to end"
    assert kinds["job"]["detail"]["owner"] == "alice" and kinds["notebook"]["label"] == "work/train.ipynb"
    assert kinds["cell"]["detail"]["sha256"] == trained.cell_sha256
    assert kinds["dataset_version"]["label"] == "digits@1"
    assert kinds["dataset_version"]["detail"]["digest"] == dataset["digest"]
    assert kinds["environment"]["detail"]["profile"] == trained.profile and kinds["environment"]["detail"]["digest"]
    edges = {(e["from"].split(":")[0], e["to"].split(":")[0], e["relation"]) for e in mine["edges"]}
    assert edges == {
        ("approval", "model_version", "decided"),
        ("model_version", "run", "produced_by"),
        ("run", "job", "ran_as"),
        ("job", "notebook", "executed"),
        ("job", "cell", "ran_cell"),
        ("job", "dataset_version", "used (training)"),
        ("job", "dataset_version", "used (evaluation)"),
        ("job", "environment", "ran_in"),
    }
    ids = {n["id"] for n in mine["nodes"]}
    assert all(e["from"] in ids and e["to"] in ids for e in mine["edges"])
    # bob may read the model but not alice's job: the chain stops at a node that says so
    hidden = {n["kind"]: n for n in theirs["nodes"]}
    assert set(hidden) == {"model_version", "approval", "run", "job"}
    assert "not yours to see" in hidden["job"]["detail"]["note"]


def test_cli_lineage_prints_the_chain_and_the_apis_json(monkeypatch, capsys):
    answer = {
        "model": {"name": "m", "version": 2, "approval": "approved", "aliases": ["champion"]},
        "nodes": [
            {"id": "job:abc", "kind": "job", "label": "train", "detail": {"owner": "alice"}, "url": None},
            {
                "id": "model_version:m/2",
                "kind": "model_version",
                "label": "m v2",
                "detail": {"approval": "approved"},
                "url": "http://x/models/m/versions/2",
            },
            {
                "id": "dataset_version:d@1",
                "kind": "dataset_version",
                "label": "d@1",
                "detail": {"digest": "ab" * 32},
                "url": None,
            },
        ],
        "edges": [{"from": "model_version:m/2", "to": "job:abc", "relation": "ran_as"}],
    }
    asked = []

    class Client:
        def lineage(self, name, version):
            asked.append((name, version))
            return answer

    monkeypatch.setattr(cliclient, "client", lambda args: Client())
    assert cli.main(["lineage", "m@2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == answer
    assert cli.main(["lineage", "m", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0].strip() for line in lines if not line.startswith(" " * 16)] == [
        "model version",
        "job",
        "dataset version",
    ]
    assert asked == [("m", 2), ("m", 2)]
    assert cli.main(["lineage", "m"]) != 0
    assert "name a model version" in capsys.readouterr().err
