"""A registered version's files are Danlu's copy: a hostile registrant cannot swap an approved model.

On the real MLflow server of tests/test_models.py (basic auth, the service as its admin). The registrant, alice,
owns her run's artifacts in MLflow and may overwrite or delete them after approval, as any MLflow user may: the
version keeps the files copied at registration (``<state>/models/<name>/<version>``), and ``danlu.model`` --
over HTTP, through the service's routes -- returns those, each checked against the manifest whose digest is on
the version. Someone with file access who alters the stored copy makes approval refuse (409 ``copy_changed``
naming the file) and loading refuse. A model over ``model_max_bytes`` is refused at registration; a version
registered before copies (no digest) still shows and loads, from MLflow, saying "not copied".
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid

import pytest
from sqlalchemy import update
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from danlu import cli, cliclient, models
from danlu.client import DanluClient
from danlu.errors import Conflict, DanluError, NotFound
from danlu.hub.mlflow_auth import password
from danlu.hub.service.api.routes import routes
from danlu.hub.service.api.web import APIHandler
from danlu.hub.service.store.orm import ModelVersionRecord

from .fakes import admin
from .test_models import ALICE, CAROL, GROUPS, EvaluatingBackend, in_loop, mlflow_server, service, trained

pytestmark = pytest.mark.service
__all__ = ["mlflow_server"]  # the module's MLflow fixture, shared with test_models
ORIGINAL = b"flavors: {}\n"  # what the training job logs as model/MLmodel


async def _identify(self):
    """Tokens are user names here (the hub's own check is test_workbench's)."""
    name = self.request.headers.get("Authorization", "").partition(" ")[2]
    model = {"kind": "user", "name": name, "scopes": [], "groups": GROUPS.get(name, [])}
    self._hub_auth_user_cache = model if name in GROUPS else None


@pytest.fixture
def http(monkeypatch):
    """Serve a manager's routes on loopback; answers a client factory (token: the user's name)."""
    monkeypatch.setattr(APIHandler, "identify", _identify)
    servers = []

    def serve(manager):
        sockets = bind_sockets(0, "127.0.0.1")
        server = HTTPServer(web.Application(routes("/services/danlu/"), danlu_manager=manager, hub_auth=None))
        server.add_sockets(sockets)
        servers.append(server)
        port = sockets[0].getsockname()[1]
        return lambda who: DanluClient(f"http://127.0.0.1:{port}", token=who)

    yield serve
    for server in servers:
        server.stop()


def _artifact(mlflow, who: str, run_id: str, path: str, data: bytes | None) -> int:
    """Overwrite (or, with None, delete) one of a run's artifacts in MLflow, as ``who``."""
    info = mlflow.ok(who, "GET", "/api/2.0/mlflow/runs/get", params={"run_id": run_id})["run"]["info"]
    where = info["artifact_uri"].split("mlflow-artifacts:", 1)[1].strip("/")
    url = f"/api/2.0/mlflow-artifacts/artifacts/{where}/{path}"
    r = mlflow.call(who, "PUT", url, data=data) if data is not None else mlflow.call(who, "DELETE", url)
    return r.status_code


def _stored(manager, name: str, version: int, *parts: str):
    return manager.settings.state_dir / "models" / name / str(version) / os.path.join(*parts)


@in_loop
async def test_the_approved_copy_outlives_the_registrants_changes_in_mlflow(tmp_path, mlflow_server, http):
    mlflow, name = mlflow_server, f"kept-{uuid.uuid4().hex[:6]}"
    async with service(tmp_path, mlflow, EvaluatingBackend({})) as manager:
        run_id = await trained(manager, ALICE, artifact="model/MLmodel")
        _, v1 = await manager.models.register(ALICE, {"run_id": run_id, "name": name, "artifact_path": "model"})
        approved = await manager.models.decide(CAROL, name, 1, {"decision": "approve", "comment": "ok"})
        # the registrant swaps the model in MLflow, then deletes it: MLflow lets her
        assert await asyncio.to_thread(_artifact, mlflow, "alice", run_id, "model/MLmodel", b"evil") == 200
        assert await asyncio.to_thread(_artifact, mlflow, "alice", run_id, "model/MLmodel", None) == 200
        client = http(manager)
        loaded = await asyncio.to_thread(models.load, name, 1, tmp_path / "loaded", client("bob"))
        manifest = await asyncio.to_thread(client("bob").model_files, name, 1)
        records = await manager.audit.records(admin(), limit=20, action="approve_model", target=None)

    digest = v1["digest"]
    assert digest and digest.startswith("sha256:") and approved["digest"] == digest
    assert approved["decisions"][0]["digest"] == digest and records[0]["after"]["digest"] == digest
    assert (loaded / "MLmodel").read_bytes() == ORIGINAL
    [entry] = manifest["files"]
    assert entry == {"path": "MLmodel", "size": len(ORIGINAL), "sha256": hashlib.sha256(ORIGINAL).hexdigest()}
    assert models.manifest_digest(manifest["files"]) == digest == manifest["digest"]
    folder = _stored(manager, name, 1, "files", "MLmodel")
    assert folder.stat().st_mode & 0o777 == 0o600 and folder.parent.parent.stat().st_mode & 0o777 == 0o700


@in_loop
async def test_a_stored_copy_altered_on_disk_is_neither_approved_nor_loaded(tmp_path, mlflow_server, http):
    mlflow, name = mlflow_server, f"altered-{uuid.uuid4().hex[:6]}"
    async with service(tmp_path, mlflow, EvaluatingBackend({})) as manager:
        run_id = await trained(manager, ALICE, artifact="model/MLmodel")
        for _ in range(2):
            await manager.models.register(ALICE, {"run_id": run_id, "name": name, "artifact_path": "model"})
        _stored(manager, name, 1, "files", "MLmodel").write_bytes(b"flavors: {evil: 1}\n")
        with pytest.raises(Conflict) as approving:
            await manager.models.decide(CAROL, name, 1, {"decision": "approve", "comment": "ok"})
        await manager.models.decide(CAROL, name, 2, {"decision": "approve", "comment": "ok"})
        _stored(manager, name, 2, "manifest.json").write_text('{"files": []}')
        client = http(manager)
        with pytest.raises(models.ModelChanged) as loading:
            await asyncio.to_thread(models.load, name, 1, tmp_path / "one", client("alice"))
        with pytest.raises(DanluError) as listing:
            await asyncio.to_thread(models.load, name, 2, tmp_path / "two", client("alice"))
        shown = await manager.models.version_view(ALICE, name, 1)

    assert approving.value.status == 409 and approving.value.reason == "copy_changed"
    assert "MLmodel was altered" in str(approving.value) and shown["approval"] == "pending"
    assert loading.value.reason == "copy_changed" and "MLmodel" in str(loading.value)
    assert not (tmp_path / "one").exists()
    assert listing.value.status == 409 and listing.value.reason == "copy_changed"
    assert "manifest.json" in str(listing.value)


@in_loop
async def test_a_model_larger_than_the_bound_is_refused_at_registration(tmp_path, mlflow_server):
    mlflow, name = mlflow_server, f"huge-{uuid.uuid4().hex[:6]}"
    async with service(tmp_path, mlflow, EvaluatingBackend({})) as manager:
        manager.models.max_bytes = 5  # c.JobsServiceApp.model_max_bytes
        run_id = await trained(manager, ALICE, artifact="model/MLmodel")
        with pytest.raises(DanluError) as refused:
            await manager.models.register(ALICE, {"run_id": run_id, "name": name, "artifact_path": "model"})
        with pytest.raises(NotFound):
            await manager.models.show(ALICE, name)

    assert refused.value.status == 413 and refused.value.reason == "model_too_large"
    assert "model_max_bytes" in refused.value.fix
    staging = manager.settings.state_dir / "models" / ".incoming"
    assert not staging.exists() or not list(staging.iterdir())  # refused from MLflow's listing, before a download


@in_loop
async def test_a_version_registered_before_copies_shows_and_loads_as_not_copied(
    tmp_path, mlflow_server, http, monkeypatch, capsys
):
    mlflow, name = mlflow_server, f"older-{uuid.uuid4().hex[:6]}"
    async with service(tmp_path, mlflow, EvaluatingBackend({})) as manager:
        run_id = await trained(manager, ALICE, artifact="model/MLmodel")
        await manager.models.register(ALICE, {"run_id": run_id, "name": name, "artifact_path": "model"})
        # as migration 0010 leaves a version registered before it: no digest, no copy
        await manager.database.write(
            lambda s: s.execute(update(ModelVersionRecord).where(ModelVersionRecord.name == name).values(digest=None))
        )
        client = http(manager)
        shown = await manager.models.version_view(ALICE, name, 1)
        with pytest.raises(NotFound) as no_copy:
            await asyncio.to_thread(client("alice").model_files, name, 1)
        with pytest.raises(Conflict) as approving:
            await manager.models.decide(CAROL, name, 1, {"decision": "approve", "comment": "ok"})
        monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow.url)
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password(mlflow.secret, "alice"))
        with pytest.warns(UserWarning, match="not copied"):
            loaded = await asyncio.to_thread(models.load, name, 1, tmp_path / "old", client("alice"))
        monkeypatch.setattr(cliclient, "client", lambda args: client("alice"))
        await asyncio.to_thread(cli.main, ["models", "show", name, "1"])

    assert shown["digest"] is None and no_copy.value.reason == "not_copied"
    assert approving.value.reason == "not_copied"
    assert (loaded / "MLmodel").read_bytes() == ORIGINAL
    assert "not copied" in capsys.readouterr().out
