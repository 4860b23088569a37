"""Pure tests of dataset digests: :func:`danlu.digests.digest`, and ``danlu.dataset`` which verifies with them.

The digest identifies content: the same bytes give the same digest wherever
they live, any change gives another, and a cache file spares re-hashing files
that did not change.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from danlu import digests


def make_dataset(folder, files: dict[str, bytes]):
    for rel, content in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return folder


FILES = {"train.csv": b"x,y\n1,2\n", "images/a.png": b"\x89PNG a", "images/b.png": b"\x89PNG b"}


@pytest.fixture
def hash_calls(monkeypatch):
    """Counts the files whose content is actually hashed."""
    calls = []
    real = digests._file_sha256

    def counting(path):
        calls.append(path.name)
        return real(path)

    monkeypatch.setattr(digests, "_file_sha256", counting)
    return calls


def test_same_content_in_different_folders_has_the_same_digest(tmp_path):
    first = digests.digest(make_dataset(tmp_path / "one" / "mnist", FILES))
    second = digests.digest(make_dataset(tmp_path / "two" / "copy", FILES))

    assert first.digest == second.digest
    assert (first.files, first.bytes) == (3, sum(len(c) for c in FILES.values()))
    assert first.name == "mnist" and second.name == "copy"
    assert first.path == str((tmp_path / "one" / "mnist").resolve())


def test_digest_is_stable_across_calls(tmp_path):
    folder = make_dataset(tmp_path / "ds", FILES)

    assert digests.digest(folder).digest == digests.digest(folder).digest


@pytest.mark.parametrize(
    "change",
    [
        lambda d: (d / "images" / "a.png").write_bytes(b"\x89PNG A"),  # one byte, same size
        lambda d: (d / "train.csv").write_bytes(b"x,y\n1,2\n3,4\n"),
        lambda d: (d / "images" / "b.png").rename(d / "images" / "c.png"),
        lambda d: (d / "extra.txt").write_bytes(b""),
        lambda d: (d / "train.csv").unlink(),
    ],
    ids=["byte", "append", "rename", "new-empty-file", "remove"],
)
def test_any_change_changes_the_digest(tmp_path, change):
    folder = make_dataset(tmp_path / "ds", FILES)
    before = digests.digest(folder).digest

    change(folder)

    assert digests.digest(folder).digest != before


def test_single_file_dataset(tmp_path):
    path = tmp_path / "train.csv"
    path.write_bytes(b"x,y\n1,2\n")

    result = digests.digest(path, name="train")

    assert (result.name, result.files, result.bytes) == ("train", 1, 8)
    sha = hashlib.sha256(b"x,y\n1,2\n").hexdigest()
    assert result.digest == hashlib.sha256(f"train.csv\0{8}\0{sha}".encode()).hexdigest()


def test_file_and_folder_holding_more_differ(tmp_path):
    folder = make_dataset(tmp_path / "ds", FILES)

    assert digests.digest(folder / "train.csv").digest != digests.digest(folder).digest


def test_empty_folder_has_a_digest(tmp_path):
    (tmp_path / "empty").mkdir()

    result = digests.digest(tmp_path / "empty")

    assert (result.files, result.bytes, result.digest) == (0, 0, hashlib.sha256(b"").hexdigest())


def test_missing_dataset_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent does not exist"):
        digests.digest(tmp_path / "absent")


def test_cache_file_spares_rehashing(tmp_path, hash_calls):
    folder = make_dataset(tmp_path / "ds", FILES)
    cache = tmp_path / "state" / "dataset-digests.json"

    first = digests.digest(folder, cache_file=cache)
    assert sorted(hash_calls) == ["a.png", "b.png", "train.csv"]
    assert len(json.loads(cache.read_text())) == 3

    hash_calls.clear()
    second = digests.digest(folder, cache_file=cache)

    assert hash_calls == []
    assert second.digest == first.digest


def test_cache_rehashes_only_changed_files(tmp_path, hash_calls):
    folder = make_dataset(tmp_path / "ds", FILES)
    cache = tmp_path / "dataset-digests.json"
    before = digests.digest(folder, cache_file=cache)
    hash_calls.clear()

    (folder / "train.csv").write_bytes(b"x,y\n1,2\n3,4\n")
    after = digests.digest(folder, cache_file=cache)

    assert hash_calls == ["train.csv"]
    assert after.digest != before.digest
    assert after.digest == digests.digest(folder).digest  # same answer as with no cache


def test_corrupt_cache_file_is_ignored(tmp_path, hash_calls):
    folder = make_dataset(tmp_path / "ds", FILES)
    cache = tmp_path / "dataset-digests.json"
    cache.write_text("{not json")

    result = digests.digest(folder, cache_file=cache)

    assert len(hash_calls) == 3
    assert result.digest == digests.digest(folder).digest
    assert len(json.loads(cache.read_text())) == 3


def test_a_fifo_swapped_in_for_a_file_is_refused_without_blocking(tmp_path):
    import os

    from danlu.digests import open_regular

    fifo = tmp_path / "data.csv"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        open_regular(fifo)  # a plain open() would wait here for a writer forever


# danlu.dataset outside a job ----------------------------------------------------------------------------
@pytest.fixture
def outside_a_job(monkeypatch, tmp_path):
    from danlu import env

    for var in (env.JOB_ID, env.RUNNER_API, env.JOB_TOKEN, env.ATTEMPT):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def catalog_answering(monkeypatch, folder, name="faces", version=1):
    """DanluClient answering GET /datasets/{name}(/versions/{n}) for a version registered from ``folder``."""
    from danlu import datasets

    found, manifest = digests.scan(folder)
    answer = {
        "ref": f"{name}@{version}",
        "dataset": name,
        "version": version,
        "digest": found.digest,
        "path": str(folder),
        "manifest": manifest,
        "used_by": [],
    }
    asked = []

    class Client:
        def __init__(self, *args, **kwargs):
            pass

        def dataset(self, n):
            asked.append(("dataset", n))
            return {"name": n, "latest": {"version": version}}

        def dataset_version(self, n, v):
            asked.append(("version", n, v))
            return answer

    monkeypatch.setattr(datasets, "DanluClient", Client)
    return asked


def test_danlu_dataset_resolves_verifies_and_returns_the_path(tmp_path, monkeypatch, outside_a_job):
    import danlu

    folder = make_dataset(tmp_path / "faces", FILES)
    asked = catalog_answering(monkeypatch, folder)
    assert danlu.dataset("faces@1") == folder
    assert danlu.dataset("faces", context="evaluation") == folder  # bare: the latest
    assert asked == [("version", "faces", 1), ("dataset", "faces"), ("version", "faces", 1)]
    (folder / "train.csv").write_bytes(b"x,y\n9,9\n")
    with pytest.raises(digests.DatasetChanged, match="dataset faces@1 changed since it was registered: train.csv"):
        danlu.dataset("faces@1")


@pytest.mark.parametrize(
    "ref, context, reason",
    [
        ("../faces@1", "training", "bad_ref"),
        ("faces@0", "training", "bad_ref"),
        ("Faces", "training", "bad_ref"),
        (3, "training", "bad_ref"),
        ("faces@1", "testing", "bad_context"),
    ],
)
def test_danlu_dataset_refuses_what_is_not_a_version_in_one_line(ref, context, reason, outside_a_job):
    import danlu
    from danlu.errors import UsageError

    with pytest.raises(UsageError) as refused:
        danlu.dataset(ref, context=context)
    assert refused.value.reason == reason and refused.value.fix


def test_danlu_dataset_without_a_service_says_so(monkeypatch, outside_a_job):
    import socket

    import danlu
    from danlu import env
    from danlu.errors import Unreachable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(env.URL, f"http://127.0.0.1:{port}")
    monkeypatch.setenv(env.TOKEN, "t" * 32)
    with pytest.raises(Unreachable, match="cannot reach the Danlu jobs service"):
        danlu.dataset("faces@1")


def test_danlu_dataset_logs_on_the_active_mlflow_run_outside_a_job(tmp_path, monkeypatch, outside_a_job):
    import mlflow

    import danlu

    folder = make_dataset(tmp_path / "faces", FILES)
    catalog_answering(monkeypatch, folder)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    with mlflow.start_run() as run:
        danlu.dataset("faces@1", context="evaluation")
    inputs = mlflow.MlflowClient().get_run(run.info.run_id).inputs.dataset_inputs
    assert [(i.dataset.name, {t.key: t.value for t in i.tags}["mlflow.data.context"]) for i in inputs] == [
        ("faces@1", "evaluation")
    ]
    assert json.loads(inputs[0].dataset.profile)["sha256"] == digests.digest(folder).digest
