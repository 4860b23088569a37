"""Pure tests of ``%%train``: parameters, the job notebook it builds, and the magic in a real shell.

The magic runs in a real IPython ``InteractiveShell`` with a fake client of
the jobs service (selected through ``TrainMagics.client_factory``), so what is
checked is what a user sees and the exact body the service would receive.
"""

from __future__ import annotations

import nbformat
import pytest
from IPython.core.error import UsageError as IPythonUsageError
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

import danlu
from danlu import submit
from danlu.errors import UsageError
from danlu.hub.service.validation import check_notebook, check_schema
from danlu.submit import SetupCells, build_job_notebook, parse_param

# parse_param ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("lr=0.01", ("lr", 0.01)),
        ("epochs=3", ("epochs", 3)),
        ("flag=true", ("flag", True)),
        ("nothing=null", ("nothing", None)),
        ("layers=[64, 32]", ("layers", [64, 32])),
        ('cfg={"a": 1}', ("cfg", {"a": 1})),
    ],
)
def test_param_values_are_read_as_json(text, expected):
    assert parse_param(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("flag=True", ("flag", True)),
        ("shape=(1, 2)", ("shape", (1, 2))),
        ("name='resnet 50'", ("name", "resnet 50")),
        ("cfg={'a': None}", ("cfg", {"a": None})),
    ],
)
def test_param_values_fall_back_to_python_literals(text, expected):
    assert parse_param(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("model=resnet", ("model", "resnet")),
        ("path=data/train.csv", ("path", "data/train.csv")),
        ("expr=__import__('os')", ("expr", "__import__('os')")),
        ("eq=a=b", ("eq", "a=b")),
        ("empty=", ("empty", "")),
        (" lr = 0.1 ", ("lr", 0.1)),
    ],
)
def test_other_values_are_kept_as_strings(text, expected):
    assert parse_param(text) == expected


@pytest.mark.parametrize("text", ["nokey", "=5", "  =5"])
def test_param_without_key_is_refused(text):
    with pytest.raises(UsageError) as info:
        parse_param(text)

    assert "write KEY=VALUE" in str(info.value)


@pytest.mark.parametrize("text", ["1st=2", "learning-rate=0.1", "a.b=1"])
def test_param_key_must_be_a_python_name(text):
    with pytest.raises(UsageError) as info:
        parse_param(text)

    assert "is not a usable Python name" in str(info.value)


def test_param_key_must_not_be_a_keyword():
    with pytest.raises(UsageError):
        parse_param("class=1")


# SetupCells -------------------------------------------------------------------------


def test_setup_cells_keep_first_run_order_and_latest_source():
    setup = SetupCells()

    setup.record("a", "import torch")
    setup.record("b", "data = load()")
    setup.record("a", "import torch, numpy")

    assert list(setup.cells.items()) == [("a", "import torch, numpy"), ("b", "data = load()")]


def test_setup_cells_forget_deleted_cells():
    setup = SetupCells()
    setup.record("a", "x = 1")
    setup.record("b", "y = 2")

    setup.forget(["a", "never-recorded"])
    setup.forget(None)

    assert setup.cells == {"b": "y = 2"}


# build_job_notebook -----------------------------------------------------------------


def job_notebook(**kwargs):
    setup = SetupCells()
    setup.record("imports", "import math")
    setup.record("data", "data = [1, 2, 3]")
    setup.record("imports", "import math, statistics")
    defaults = dict(
        cell="print(lr * sum(data))",
        params={"lr": 0.1, "model": "resnet"},
        setup=setup.cells,
        kernel_name="danlu-python",
    )
    return build_job_notebook(**{**defaults, **kwargs})


def test_job_notebook_order_and_tags():
    nb = job_notebook()

    assert [cell.metadata["tags"] for cell in nb.cells] == [
        ["parameters"],
        ["danlu-setup"],
        ["danlu-setup"],
        ["danlu-cell"],
    ]
    assert [cell.source for cell in nb.cells] == [
        "lr = 0.1\nmodel = 'resnet'",
        "import math, statistics",
        "data = [1, 2, 3]",
        "print(lr * sum(data))",
    ]
    assert [cell.metadata.get("danlu", {}).get("cell_id") for cell in nb.cells] == [None, "imports", "data", None]


def test_job_notebook_is_valid_nbformat_4():
    nb = job_notebook()

    nbformat.validate(nb)
    assert nb.nbformat == 4
    assert nb.metadata["kernelspec"]["name"] == "danlu-python"
    assert all(cell.cell_type == "code" for cell in nb.cells)


def test_parameters_cell_assigns_every_parameter():
    params = {"lr": 0.01, "name": "it's", "layers": [64, 32], "cfg": {"a": None}, "flag": True}
    nb = job_notebook(params=params)

    namespace: dict = {}
    exec(nb.cells[0].source, namespace)

    assert {key: namespace[key] for key in params} == params


def test_parameters_cell_assigns_infinite_float():
    nb = job_notebook(params={"limit": float("inf")})

    namespace: dict = {}
    exec(nb.cells[0].source, namespace)

    assert namespace["limit"] == float("inf")


def test_no_parameters_still_gives_a_parameters_cell():
    nb = job_notebook(params={}, setup={})

    assert [cell.source for cell in nb.cells] == ["# no parameters", "print(lr * sum(data))"]
    assert nb.cells[0].metadata["tags"] == ["parameters"]


def test_job_cell_keeps_a_valid_cell_id_only():
    assert job_notebook(cell_id="f00d-cafe_1").cells[-1].id == "f00d-cafe_1"
    assert job_notebook(cell_id="not a valid id!").cells[-1].id != "not a valid id!"


# the magic in a real shell ----------------------------------------------------------


class DryRunClient:
    """Records each submitted body and answers like the service's dry run (admitted, nothing stored)."""

    def __init__(self):
        self.bodies: list[dict] = []

    def submit(self, body: dict) -> dict:
        self.bodies.append(body)
        return {
            "dry_run": True,
            "admitted": True,
            "reason": "",
            "queue_position": None,
            "profile": body.get("profile", "python"),
            "resources": body["resources"],
            "notebook": body["notebook"],
        }


class FailingJobClient:
    """Accepts a job, streams two log lines, then reports that the job failed."""

    def submit(self, body: dict) -> dict:
        return {"id": "0123456789ab", "state": "queued"}

    def logs(self, job_id: str, follow: bool = False):
        yield "step 1\n"
        yield "ZeroDivisionError: division by zero\n"

    def job(self, job_id: str) -> dict:
        return {"id": job_id, "state": "failed", "reason": "the cell raised ZeroDivisionError"}


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    config = Config()
    config.HistoryManager.enabled = False
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("IPYTHONDIR", str(tmp_path_factory.mktemp("ipython")))
        shell = InteractiveShell.instance(config=config)
    yield shell
    InteractiveShell.clear_instance()


@pytest.fixture
def magics(shell, tmp_path, monkeypatch):
    """Fresh TrainMagics registered by ``%load_ext danlu``, in a home folder that is not a git checkout."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for name in ("DANLU_PROFILE", "JPY_SESSION_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(submit, "_git_commit", lambda folder: "0123abc")
    danlu.load_ipython_extension(shell)
    return shell.magics_manager.registry["TrainMagics"]


@pytest.fixture
def dry_run_client(magics):
    client = DryRunClient()
    magics.client_factory = lambda: client
    return client


def test_dry_run_sends_one_valid_submission(shell, dry_run_client):
    shell.run_cell_magic(
        "train",
        "--dry-run --nproc 2 --gpus 1 --profile pytorch --name mnist-1 "
        "--param lr=0.01 -p model=resnet --dataset data/mnist",
        "print(lr)",
    )

    [body] = dry_run_client.bodies
    assert body["dry_run"] is True
    assert body["parameters"] == {"lr": 0.01, "model": "resnet"}
    assert body["resources"] == {"nproc": 2, "gpus": 1}
    assert body["profile"] == "pytorch"
    assert body["name"] == "mnist-1"
    assert body["datasets"] == ["data/mnist"]
    assert body["cwd"] == "."
    assert body["source"] == {"git_commit": "0123abc", "included_cells": []}
    assert body["notebook"]["metadata"]["kernelspec"]["name"] == "danlu-pytorch"
    check_schema("JobSubmission", body)  # what the magic sends is what the service accepts
    check_notebook(body["notebook"])


def test_eval_datasets_are_sent_with_context_evaluation(shell, dry_run_client):
    shell.run_cell_magic(
        "train", "--dry-run --dataset mnist@3 --eval-dataset mnist-test --eval-dataset data/x.csv", "pass"
    )

    [body] = dry_run_client.bodies
    assert body["datasets"] == [
        "mnist@3",
        {"ref": "mnist-test", "context": "evaluation"},
        {"ref": "data/x.csv", "context": "evaluation"},
    ]
    check_schema("JobSubmission", body)


def test_dry_run_shows_the_notebook_and_the_verdict(shell, dry_run_client, capsys):
    shell.run_cell_magic("train", "--dry-run --param lr=0.01", "print(lr)")

    out = capsys.readouterr().out
    assert out.startswith("Dry run: nothing was submitted.\n")
    assert "# --- cell 1 [parameters] ---\nlr = 0.01\n" in out
    assert "# --- cell 2 [danlu-cell] ---\nprint(lr)\n" in out
    assert out.rstrip().endswith("# profile python, queue default, 1 process(es), 0 GPU(s): would start now")


def test_setup_cells_run_here_and_join_the_job(shell, magics, dry_run_client):
    shell.run_cell_magic("train_setup", "", "base = 40 + 2")
    shell.run_cell("1 / 0")  # an ordinary failing cell is not recorded
    shell.run_cell_magic("train_setup", "", "raise RuntimeError('broken setup')")  # nor a failing setup cell

    shell.run_cell_magic("train", "--dry-run", "print(base)")

    assert shell.user_ns["base"] == 42
    [body] = dry_run_client.bodies
    assert body["source"]["included_cells"] == ["setup-1"]
    sources = ["".join(cell["source"]) for cell in body["notebook"]["cells"]]
    assert sources == ["# no parameters", "base = 40 + 2", "print(base)"]


@pytest.mark.parametrize(
    "line, message",
    [
        ("--param nokey", "--param 'nokey': write KEY=VALUE, e.g. --param lr=0.01"),
        ("--param 2x=1", "--param '2x=1': '2x' is not a usable Python name (letters, digits, _; not a keyword)"),
        ("--nproc 0", "--nproc must be at least 1, got 0"),
        ("--gpus -1", "--gpus must be 0 or more, got -1"),
        ("--nproc two", "argument --nproc: invalid int value: 'two'"),
    ],
)
def test_bad_input_is_one_clear_usage_error(shell, dry_run_client, line, message):
    with pytest.raises(IPythonUsageError) as info:
        shell.run_cell_magic("train", f"--dry-run {line}", "pass")

    assert str(info.value) == message
    assert "\n" not in str(info.value)
    assert dry_run_client.bodies == []


def test_waiting_on_a_failed_job_streams_its_log_and_raises(shell, magics, capsys):
    magics.client_factory = FailingJobClient

    with pytest.raises(IPythonUsageError) as info:
        shell.run_cell_magic("train", "--wait", "1 / 0")

    out = capsys.readouterr().out
    assert "step 1\nZeroDivisionError: division by zero\n" in out
    assert "Job 0123456789ab failed: the cell raised ZeroDivisionError" in out
    assert str(info.value) == "job 0123456789ab failed: the cell raised ZeroDivisionError"
