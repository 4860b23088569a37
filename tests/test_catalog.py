"""The dataset catalog, in process, through the manager on a fake backend (tests/fakes.py): no hub, no HTTP.

Registering the same content twice answers the same version; a changed file is a new version with a
new digest; groups hide a dataset (404) or refuse a registrant (403 with the fix); paths that leave
their root, directly or through a symbolic link, are refused; CSV and Parquet files get their columns
and row counts; a folder over the file bound is refused before it is hashed. Then the CLI's
``datasets`` commands, on a client that answers what the manager answered.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import json
import os
from pathlib import Path

import pytest

from danlu import cli, cliclient
from danlu.digests import DatasetChanged, changes, digest, scan, verify
from danlu.errors import Conflict, DanluError, Forbidden, NotFound, UsageError, ValidationError
from danlu.hub.service.datasets import catalog
from danlu.hub.service.datasets import scan as reading
from danlu.runner.base import describe_error

from .fakes import FakeBackend, SlowBackend, admin, final, make_manager, make_settings, notebook, serving, until, user

ALICE = user("alice", "research")  # FakeGroups: alice in research, bob in none, carol in vision
BOB = user("bob")
CAROL = user("carol", "vision")
ADMIN = admin()


def in_loop(test):
    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


@contextlib.asynccontextmanager
async def service(tmp_path: Path, backend: FakeBackend | None = None):
    """A manager whose danlu.yaml has one dataset root, ``shared``, and users' homes under the state folder."""
    state = tmp_path / "state"
    shared = tmp_path / "shared"
    shared.mkdir(exist_ok=True)
    for name in ("alice", "bob", "carol"):
        (state / "users" / name).mkdir(parents=True, exist_ok=True)
    settings = make_settings(state, datasets={"roots": {"shared": str(shared)}})
    manager = make_manager(backend or FakeBackend(), state, settings=settings)
    async with serving(manager):
        yield manager


def home(tmp_path: Path, name: str = "alice") -> Path:
    return tmp_path / "state" / "users" / name


def write(folder: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    return folder


async def register(manager, who=ALICE, **body) -> tuple[int, dict]:
    return await manager.datasets.register(who, body)


@in_loop
async def test_same_content_is_the_same_version_and_a_changed_file_a_new_one(tmp_path):
    data = write(home(tmp_path) / "mnist", {"train.csv": "x,y\n1,2\n", "labels/a.txt": "a"})
    async with service(tmp_path) as manager:
        first = await register(manager, name="mnist", path="mnist", description="digits")
        again = await register(manager, name="mnist", path="./mnist/")
        (data / "labels" / "a.txt").write_text("b")
        changed = await register(manager, name="mnist", path="mnist")
        shown = await manager.datasets.show(ALICE, "mnist")
        v1 = await manager.datasets.version(ALICE, "mnist", 1)
        with pytest.raises(NotFound) as missing:
            await manager.datasets.version(ALICE, "mnist", 3)
        records = await manager.audit.records(ADMIN, limit=10, action="register_dataset", target=None)

    assert first[0] == 201 and first[1]["version"] == 1 and first[1]["ref"] == "mnist@1"
    assert again == (200, first[1])
    assert changed[0] == 201 and changed[1]["version"] == 2 and changed[1]["digest"] != first[1]["digest"]
    assert [v["version"] for v in shown["versions"]] == [1, 2] and shown["latest"]["version"] == 2
    assert shown["description"] == "digits" and shown["read_groups"] == [] and shown["created_by"] == "alice"
    assert v1["files"] == 2 and v1["bytes"] == len("x,y\n1,2\n") + 1 and v1["source"] == "mnist"
    assert [row[:2] for row in v1["manifest"]] == [["labels/a.txt", 1], ["train.csv", 8]]
    assert v1["path"] == os.path.realpath(data)
    assert missing.value.reason == "no_such_version"
    assert [r["target"] for r in records] == ["mnist@2", "mnist@1"]  # the unchanged registration wrote nothing


@in_loop
async def test_the_digest_is_the_one_jobs_log(tmp_path):
    data = write(home(tmp_path) / "d", {"a.txt": "a", "b/c.txt": "c"})
    expected = digest(data).digest  # before anything could change it
    async with service(tmp_path) as manager:
        _, version = await register(manager, name="d", path="d")
    assert version["digest"] == expected


@in_loop
async def test_read_groups_hide_a_dataset_and_register_groups_refuse_with_the_fix(tmp_path):
    write(home(tmp_path), {"faces/a.txt": "a"})
    write(home(tmp_path, "carol"), {"faces/a.txt": "other"})
    async with service(tmp_path) as manager:
        await register(
            manager, name="faces", path="faces", read_groups=["research", "vision"], register_groups=["research"]
        )
        with pytest.raises(NotFound) as hidden:
            await manager.datasets.show(BOB, "faces")
        with pytest.raises(NotFound):
            await manager.datasets.version(BOB, "faces", 1)
        bobs_list = await manager.datasets.list(BOB)
        with pytest.raises(Conflict) as taken:
            await register(manager, BOB, name="faces", path=".")
        carols = await manager.datasets.show(CAROL, "faces")
        with pytest.raises(Forbidden) as refused:
            await register(manager, CAROL, name="faces", path="faces")
        with pytest.raises(ValidationError) as fixed:
            await register(manager, name="faces", path="faces", read_groups=["research"])
        by_admin = await register(manager, ADMIN, name="faces", path="shared:.")
        listed = await manager.datasets.list(CAROL)

    assert hidden.value.status == 404 and hidden.value.reason == "no_such_dataset"
    assert bobs_list == []
    assert taken.value.status == 409 and taken.value.reason == "name_taken"
    assert carols["name"] == "faces"
    assert refused.value.status == 403 and refused.value.reason == "not_a_registrant"
    assert "research" in refused.value.fix and refused.value.field == "name"
    assert fixed.value.field == "read_groups" and fixed.value.reason == "groups_fixed"
    assert by_admin[0] == 201 and by_admin[1]["version"] == 2 and by_admin[1]["source"] == "shared:."
    assert [(d["name"], d["latest"]["version"]) for d in listed] == [("faces", 2)]


@in_loop
async def test_paths_that_leave_their_root_are_refused(tmp_path):
    outside = write(tmp_path / "outside", {"secret.txt": "s"})
    write(home(tmp_path), {"data/ok.txt": "ok"})
    os.symlink(outside, home(tmp_path) / "link")
    os.symlink(outside / "secret.txt", home(tmp_path) / "data" / "sneaky.txt")
    (tmp_path / "shared" / "inner").mkdir(parents=True)
    os.symlink(outside, tmp_path / "shared" / "inner" / "out")
    cases = {
        "../bob": "path_traversal",
        "/etc": "absolute_path",
        str(outside): "absolute_path",
        "shared:../outside": "path_traversal",
        "nowhere:x": "unknown_dataset_root",
        "link": "escapes_root",
        "shared:inner/out": "escapes_root",
        "data": "escapes_root",
        "%2e%2e/bob": "path_traversal",
        "missing": "no_dataset",
    }
    async with service(tmp_path) as manager:
        reasons = {}
        for path, _ in cases.items():
            with pytest.raises(ValidationError) as refused:
                await register(manager, name="x", path=path)
            assert refused.value.field == "path" and refused.value.fix
            reasons[path] = refused.value.reason
        assert await manager.datasets.list(ADMIN) == []
    assert reasons == cases


@in_loop
async def test_csv_and_parquet_files_get_columns_and_row_counts(tmp_path, monkeypatch):
    folder = write(
        home(tmp_path) / "tab",
        {"people.csv": 'name,age,note\nann,3,"two\nlines"\nbo,4,x\n\n', "empty.csv": "", "readme.txt": "hi"},
    )
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        pq = None
    else:
        pq.write_table(pa.table({"a": [1, 2, 3], "b": ["x", "y", "z"]}), folder / "t.parquet")
    async with service(tmp_path) as manager:
        _, version = await register(manager, name="tab", path="tab")
        real_import = builtins.__import__

        def no_pyarrow(name, *args, **kwargs):
            if name.startswith("pyarrow"):
                raise ImportError(name)
            return real_import(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", no_pyarrow)
        (folder / "t.parquet").write_bytes(b"PAR1")
        # the registration reads in a child process: the reader itself, here, without pyarrow
        without = {"tables": reading.tables_of(folder, [["t.parquet", 4, "0" * 64]])}
        monkeypatch.undo()
    tables = {t["path"]: t for t in version["tables"]}
    assert tables["people.csv"] == {
        "path": "people.csv",
        "format": "csv",
        "columns": ["name", "age", "note"],
        "rows": 2,
    }
    assert tables["empty.csv"]["columns"] == [] and tables["empty.csv"]["rows"] == 0
    if pq is not None:
        assert tables["t.parquet"]["columns"] == ["a", "b"] and tables["t.parquet"]["rows"] == 3
    parquet = next(t for t in without["tables"] if t["path"] == "t.parquet")
    assert parquet["note"] == "schema not read: pyarrow is not installed" and parquet["rows"] is None


@in_loop
async def test_a_folder_over_the_file_bound_is_refused_before_it_is_hashed(tmp_path, monkeypatch):
    write(home(tmp_path) / "many", {f"f{i}.txt": str(i) for i in range(4)})
    monkeypatch.setattr(reading, "MAX_FILES", 3)
    hashed = []
    monkeypatch.setattr("danlu.digests._file_sha256", lambda p: hashed.append(p) or "0" * 64)
    async with service(tmp_path) as manager:
        with pytest.raises(ValidationError) as refused:
            await register(manager, name="many", path="many")
    assert refused.value.reason == "too_many_files" and "more than 3 files" in str(refused.value)
    assert refused.value.fix and hashed == []


@in_loop
async def test_a_bad_name_or_a_service_token_is_refused(tmp_path):
    write(home(tmp_path), {"d/a.txt": "a"})
    async with service(tmp_path) as manager:
        with pytest.raises(ValidationError) as bad:
            await register(manager, name="Bad Name", path="d")
        with pytest.raises(NotFound):
            await manager.datasets.show(ALICE, "nothing")
    assert bad.value.field == "name" and bad.value.reason == "invalid_field"


# jobs that name a version ----------------------------------------------------------------------------------
@in_loop
async def test_a_job_names_a_version_and_its_runner_gets_the_digest_and_manifest(tmp_path):
    data = write(home(tmp_path) / "mnist", {"a.txt": "a"})
    backend = SlowBackend()
    async with service(tmp_path, backend) as manager:
        _, v1 = await register(manager, name="mnist", path="mnist", read_groups=["research"])
        (data / "a.txt").write_text("changed")
        _, v2 = await register(manager, name="mnist", path="mnist")
        status, job = await manager.submit(
            ALICE, {"notebook": notebook("pass"), "datasets": ["mnist@1", "mnist@latest"]}
        )
        assert status == 201, job
        await until(lambda: backend.launches, "the job to start")
        spec = await manager.runner_api.spec(job["id"], 1, backend.launches[0].token)
        backend.finish(job["id"])
        await final(manager, job["id"])
        with pytest.raises(NotFound) as hidden:
            await manager.submit(BOB, {"notebook": notebook("pass"), "datasets": ["mnist@1"]})
        with pytest.raises(NotFound) as missing:
            await manager.submit(ALICE, {"notebook": notebook("pass"), "datasets": ["./mnist", "mnist@7"]})
    assert job["datasets"] == ["mnist@1", "mnist@2"]
    first, latest = spec["datasets"]
    assert first == {
        "name": "mnist@1",
        "path": v1["path"],
        "dataset": "mnist",
        "version": 1,
        "digest": v1["digest"],
        "context": "training",
        "manifest": [["a.txt", 1, first["manifest"][0][2]]],
    }
    assert latest["digest"] == v2["digest"] and latest["manifest"][0][:2] == ["a.txt", 7]
    assert hidden.value.field == "datasets[0]" and hidden.value.reason == "no_such_dataset"
    assert missing.value.field == "datasets[1]" and missing.value.reason == "no_such_version"


def test_a_version_whose_files_changed_fails_the_job_naming_them(tmp_path):
    data = write(tmp_path / "d", {"keep.txt": "k", "edit.txt": "1", "gone.txt": "g"})
    registered, manifest = scan(data)
    assert verify(data, "d@1", registered.digest, manifest).digest == registered.digest
    (data / "edit.txt").write_text("2")
    (data / "gone.txt").unlink()
    (data / "new.txt").write_text("n")
    with pytest.raises(DatasetChanged) as changed:
        verify(data, "d@1", registered.digest, manifest)
    assert "dataset d@1 changed since it was registered: edit.txt changed, gone.txt removed, new.txt added" in str(
        changed.value
    )
    assert describe_error(changed.value) == (str(changed.value), False)  # the user's to fix: no retry
    many = changes([[f"f{i}", 1, "a"] for i in range(12)], [])
    assert len(many) == 11 and many[-1] == "and 2 more"


# bare names, contexts, uses ------------------------------------------------------------------------------
@in_loop
async def test_a_bare_name_is_the_latest_readable_version_and_an_ambiguous_one_is_refused(tmp_path):
    data = write(home(tmp_path) / "data" / "mnist", {"a.txt": "a"})
    async with service(tmp_path) as manager:
        await register(manager, name="mnist", path="data/mnist", read_groups=["research"])
        _, first = await manager.submit(ALICE, {"notebook": notebook("pass"), "datasets": ["mnist"], "dry_run": True})
        _, job1 = await manager.submit(ALICE, {"notebook": notebook("pass"), "datasets": ["mnist"]})
        (data / "a.txt").write_text("changed")
        await register(manager, name="mnist", path="data/mnist")
        _, job2 = await manager.submit(ALICE, {"notebook": notebook("pass"), "datasets": ["mnist"]})
        write(home(tmp_path), {"mnist/b.txt": "a folder of that name"})
        with pytest.raises(UsageError) as ambiguous:
            await manager.submit(ALICE, {"notebook": notebook("pass"), "datasets": ["mnist"]})
        _, by_path = await manager.submit(ALICE, {"notebook": notebook("pass"), "datasets": ["./mnist"]})
        _, by_ref = await manager.submit(ALICE, {"notebook": notebook("pass"), "datasets": ["mnist@latest"]})
        with pytest.raises(ValidationError) as bobs:  # not his to read: a path, and there is none
            await manager.submit(BOB, {"notebook": notebook("pass"), "datasets": ["mnist"]})
    assert first["dry_run"] is True
    assert job1["datasets"] == ["mnist@1"] and job2["datasets"] == ["mnist@2"]
    assert [i["ref"] for i in job2["inputs"]] == ["mnist@2"] and job2["inputs"][0]["context"] == "training"
    assert ambiguous.value.status == 400 and ambiguous.value.reason == "ambiguous_dataset"
    assert ambiguous.value.field == "datasets[0]"
    assert "both a dataset of the catalog and a file or folder" in str(ambiguous.value)
    assert "./mnist" in ambiguous.value.fix and "mnist@latest" in ambiguous.value.fix
    assert by_path["datasets"] == ["mnist"] and by_path["inputs"] == []
    assert by_ref["datasets"] == ["mnist@2"]
    assert bobs.value.reason == "no_dataset" and "catalog" not in str(bobs.value)


@in_loop
async def test_uses_both_ways_and_the_runner_api_resolves_as_the_jobs_owner(tmp_path):
    write(home(tmp_path) / "faces", {"a.txt": "a"})
    write(home(tmp_path, "bob"), {"mine.txt": "bob's"})
    backend = SlowBackend()
    async with service(tmp_path, backend) as manager:
        _, v1 = await register(manager, name="faces", path="faces", read_groups=["research", "vision"])
        _, job = await manager.submit(
            ALICE,
            {
                "notebook": notebook("pass"),
                "datasets": ["faces@1", {"ref": "faces@1", "context": "evaluation"}, {"ref": "faces@latest"}],
            },
        )
        _, bobs = await manager.submit(BOB, {"notebook": notebook("pass"), "datasets": ["mine.txt"]})
        await until(lambda: len(backend.launches) == 2, "both jobs to start")
        token = {launch.job_id: launch.token for launch in backend.launches}
        reports = manager.runner_api

        async def ask(job_id, body, tok=None):
            owner = await reports.owner(job_id, 1, tok or token[job_id])
            return await reports.dataset(job_id, 1, tok or token[job_id], owner, body)

        spec = await reports.spec(job["id"], 1, token[job["id"]])
        asked = await ask(job["id"], {"ref": "faces@latest", "context": "evaluation"})
        again = await ask(job["id"], {"ref": "faces@1"})
        with pytest.raises(NotFound) as hidden:  # bob is not in the read groups: his job is not either
            await ask(bobs["id"], {"ref": "faces@1"})
        refused = {}
        for name, (job_id, tok) in {
            "wrong token": (job["id"], "x" * 40),
            "not a token": (job["id"], "a b"),
            "other job's token": (job["id"], token[bobs["id"]]),
        }.items():
            with pytest.raises(DanluError) as e:
                await reports.owner(job_id, 1, tok)
            refused[name] = e.value.status
        invalid = []
        for body in (
            {"ref": "faces"},
            {"ref": "../faces@1"},
            {"ref": "faces@1", "context": "testing"},
            {"ref": "faces@1", "owner": "admin"},
            {"ref": ["faces@1"]},
        ):
            with pytest.raises(ValidationError) as e:
                await ask(job["id"], body)
            invalid.append(e.value.field)
        viewed = await manager.job_dict(job["id"])
        listed = await manager.views_of(await manager.list(ALICE))
        sent = json.loads(await manager.page_json(ALICE))["jobs"]  # GET /jobs: its uses read for all at once
        for_alice = await manager.datasets.version(ALICE, "faces", 1)
        for_carol = await manager.datasets.version(CAROL, "faces", 1)
        for_admin = await manager.datasets.version(ADMIN, "faces", 1)
        for j in (job, bobs):
            backend.finish(j["id"])
            await final(manager, j["id"])
        with manager.database.sessions() as s:
            uses = catalog.uses_of_job(s, job["id"])

    assert [(d["name"], d["context"]) for d in spec["datasets"]] == [
        ("faces@1", "training"),
        ("faces@1", "evaluation"),
        ("faces@1", "training"),
    ]
    assert asked == {
        "ref": "faces@1",
        "dataset": "faces",
        "version": 1,
        "digest": v1["digest"],
        "path": v1["path"],
        "context": "evaluation",
        "manifest": asked["manifest"],
    }
    assert asked["manifest"][0][:2] == ["a.txt", 1] and again["context"] == "training"
    assert hidden.value.status == 404 and hidden.value.reason == "no_such_dataset" and hidden.value.field == "ref"
    assert refused == {"wrong token": 403, "not a token": 401, "other job's token": 403}
    assert invalid == ["ref", "ref", "context", "owner", "ref"]
    expected = [
        {"ref": "faces@1", "dataset": "faces", "version": 1, "digest": v1["digest"], "context": c}
        for c in ("training", "evaluation")
    ]  # one per version and context, however often asked
    assert viewed["inputs"] == expected and uses == expected
    assert [j["inputs"] for j in listed if j["id"] == job["id"]] == [expected]
    assert [j["inputs"] for j in sent if j["id"] == job["id"]] == [expected]
    assert [(u["job_id"], u["owner"], u["context"]) for u in for_alice["used_by"]] == [
        (job["id"], "alice", "evaluation"),
        (job["id"], "alice", "training"),
    ]
    assert {u["attempt"] for u in for_alice["used_by"]} == {None}  # named at submission
    assert for_carol["used_by"] == []  # she reads the dataset, not alice's jobs
    assert [u["job_id"] for u in for_admin["used_by"]] == [job["id"]] * 2


# the CLI ------------------------------------------------------------------------------------------------
class AnsweringClient:
    """What DanluClient would return, from answers the manager gave."""

    def __init__(self, answers: dict):
        self.answers = answers
        self.bodies = []

    def register_dataset(self, body):
        self.bodies.append(body)
        return True, self.answers["register"]

    def datasets(self):
        return self.answers["list"]

    def dataset(self, name):
        return self.answers["show"]

    def dataset_version(self, name, version):
        return self.answers["version"]


def test_cli_datasets_commands_print_tables_and_the_apis_json(tmp_path, monkeypatch, capsys):
    write(home(tmp_path) / "tab", {"a.csv": "x\n1\n"})

    async def answers():
        async with service(tmp_path) as manager:
            _, registered = await register(manager, name="tab", path="tab", description="a table")
            return {
                "register": registered,
                "list": await manager.datasets.list(ALICE),
                "show": await manager.datasets.show(ALICE, "tab"),
                "version": await manager.datasets.version(ALICE, "tab", 1),
            }

    client = AnsweringClient(asyncio.run(answers()))
    monkeypatch.setattr(cliclient, "client", lambda args: client)
    for argv, key in (
        (["register", "tab", "tab"], "register"),
        (["list"], "list"),
        (["show", "tab"], "show"),
        (["show", "tab@1"], "version"),
    ):
        assert cli.main(["datasets", *argv, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == client.answers[key]
        assert cli.main(["datasets", *argv]) == 0
        text = capsys.readouterr().out
        assert client.answers["register"]["digest"][:16] in text and "tab" in text
    assert (
        cli.main(
            [
                "datasets",
                "register",
                "t",
                "shared:x",
                "--read-group",
                "a",
                "--read-group",
                "b",
                "--register-group",
                "a",
                "--description",
                "d",
            ]
        )
        == 0
    )
    assert client.bodies[-1] == {
        "name": "t",
        "path": "shared:x",
        "description": "d",
        "read_groups": ["a", "b"],
        "register_groups": ["a"],
    }
    capsys.readouterr()
    assert cli.main(["datasets", "show", "tab@latest"]) == 2
    assert "NAME@VERSION" in capsys.readouterr().err


def test_cli_shows_who_used_a_version_and_what_a_job_used(monkeypatch, capsys):
    digest = "ab" * 32
    used = {"ref": "faces@1", "dataset": "faces", "version": 1, "digest": digest, "context": "evaluation"}
    version = {
        "ref": "faces@1",
        "digest": digest,
        "files": 1,
        "bytes": 1,
        "source": "faces",
        "path": "/h/faces",
        "created_by": "alice",
        "created_at": "2026-12-01T00:00:00Z",
        "tables": [],
        "manifest": [],
        "used_by": [
            {
                "job_id": "0123456789ab",
                "owner": "alice",
                "state": "succeeded",
                "mlflow_run_id": "r1",
                "context": "evaluation",
                "attempt": None,
                "at": "x",
            }
        ],
    }
    job = {
        "id": "0123456789ab",
        "name": "j",
        "owner": "alice",
        "state": "succeeded",
        "resources": {"nproc": 1, "gpus": 0},
        "attempts": [],
        "inputs": [used],
    }

    class Client:
        def dataset_version(self, name, number):
            return version

        def job(self, job_id):
            return job

    monkeypatch.setattr(cliclient, "client", lambda args: Client())
    assert cli.main(["datasets", "show", "faces@1"]) == 0
    text = capsys.readouterr().out
    assert "used by" in text and "0123456789ab" in text and "evaluation" in text and "r1" in text
    assert cli.main(["jobs", "show", "0123456789ab"]) == 0
    assert "inputs: faces@1" in capsys.readouterr().out.replace("  ", " ").replace("  ", " ")
    assert cli.main(["jobs", "show", "0123456789ab", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"] == [used]


def test_with_unix_accounts_the_files_are_read_in_a_child_process_as_the_user(tmp_path):
    """The same answer as in-process, and the same refusals, from a process running as the account."""
    import getpass
    import os

    from danlu.errors import ValidationError
    from danlu.hub.accounts import Account

    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    (home / "data" / "t.csv").write_text("a,b\n1,2\n3,4\n")
    account = Account(getpass.getuser(), os.getuid(), os.getgid(), str(home))
    here = reading.digest_of("data", home, {}, None)
    there = asyncio.run(reading.hash_as(account, "data", home, {}))
    assert there == here and there[3][0]["rows"] == 2
    os.symlink("/etc/hostname", home / "data" / "out")
    with pytest.raises(ValidationError) as escaped:
        asyncio.run(reading.hash_as(account, "data", home, {}))
    assert escaped.value.reason == "escapes_root"
