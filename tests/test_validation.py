"""Pure tests of request validation in the jobs service.

:mod:`danlu.hub.service.validation` turns every bad request into a
``ValidationError`` (422) or ``UsageError`` (400) that names the field, never a
500. Paths must stay inside their root however they are spelled.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from danlu.errors import UsageError, ValidationError
from danlu.hub.service.validation import (
    check_dataset,
    check_notebook,
    check_parameters,
    check_schema,
    parse_json,
    safe_relative_path,
)


def notebook(*cells) -> dict:
    nb = nbformat.v4.new_notebook()
    nb.cells = list(cells)
    return dict(nbformat.from_dict(nb))


def submission(**fields) -> dict:
    return {"notebook": notebook(nbformat.v4.new_code_cell("print(1)")), **fields}


def schema_error(body) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        check_schema("JobSubmission", body)
    return info.value


# check_schema -----------------------------------------------------------------------

def test_complete_submission_is_accepted():
    check_schema("JobSubmission", submission(
        parameters={"lr": 0.01}, resources={"nproc": 2, "gpus": 1}, profile="python", name="mnist-1.0",
        queue="default", datasets=["data/mnist"], cwd=".", source={"cell_id": "abc", "git_commit": "0123abc"},
        dry_run=True))


def test_unknown_field_is_named():
    error = schema_error(submission(colour="blue"))

    assert error.field == "colour"
    assert error.reason == "invalid_field"
    assert error.status == 422
    assert error.message == "unknown field 'colour'"


def test_unknown_field_is_named_even_when_other_fields_are_wrong():
    error = schema_error(submission(colour="blue", resources={"nproc": 0}))

    assert error.field == "colour"


def test_unknown_nested_field_is_named_with_its_path():
    error = schema_error(submission(resources={"nproc": 1, "cpus": 4}))

    assert error.field == "resources.cpus"


def test_missing_notebook_is_named():
    error = schema_error({"parameters": {}})

    assert error.field == "notebook"
    assert error.message == "missing required field 'notebook'"


@pytest.mark.parametrize("field, value, words", [
    ("nproc", -1, "at least 1"),
    ("nproc", 0, "at least 1"),
    ("nproc", 10**6, "at most 1024"),
    ("gpus", -1, "at least 0"),
    ("gpus", 4096, "at most 1024"),
])
def test_resource_bounds(field, value, words):
    error = schema_error(submission(resources={field: value}))

    assert error.field == f"resources.{field}"
    assert words in error.message
    assert repr(value) in error.message


def test_resource_of_wrong_type():
    error = schema_error(submission(resources={"nproc": "2"}))

    assert error.field == "resources.nproc"
    assert "must be of type integer" in error.message


@pytest.mark.parametrize("name", ["-leading-dash", "has space", "x" * 101, "semi;colon"])
def test_bad_job_name(name):
    error = schema_error(submission(name=name))

    assert error.field == "name"
    assert "does not match" in error.message


def test_bad_item_in_a_list_is_named_with_its_index():
    error = schema_error(submission(datasets=["data/ok", 7]))

    assert error.field == "datasets[1]"


# safe_relative_path -----------------------------------------------------------------

@pytest.mark.parametrize("value, reason", [
    ("../x", "path_traversal"),
    ("a/../../b", "path_traversal"),
    ("..", "path_traversal"),
    ("/etc/passwd", "absolute_path"),
    ("~/x", "absolute_path"),
    ("~root", "absolute_path"),
    ("%2e%2e/x", "path_traversal"),
    ("%2E%2E/x", "path_traversal"),
    ("%252e%252e/x", "path_traversal"),
    ("a%2fb", "path_traversal"),
    ("a\\b", "bad_path"),
    ("..\\x", "bad_path"),
    ("C:/x", "absolute_path"),
    ("c:x", "absolute_path"),
    ("a\x00b", "bad_path"),
    ("", "bad_path"),
    ("   ", "bad_path"),
])
def test_escaping_or_malformed_paths_are_refused(value, reason):
    with pytest.raises(ValidationError) as info:
        safe_relative_path(value, "cwd")

    assert info.value.reason == reason
    assert info.value.field == "cwd"
    assert info.value.message.startswith("cwd ")


def test_non_string_path_is_refused():
    with pytest.raises(ValidationError) as info:
        safe_relative_path(["data"], "datasets[0]")

    assert info.value.field == "datasets[0]"


@pytest.mark.parametrize("value, normalized", [
    ("data/train.csv", "data/train.csv"),
    (".", "."),
    ("a/./b//c/", "a/b/c"),
    ("notes..txt", "notes..txt"),
])
def test_relative_paths_are_accepted_and_normalized(value, normalized):
    assert safe_relative_path(value, "cwd") == normalized


# check_dataset ----------------------------------------------------------------------

ROOTS = {"shared": Path("/data/shared"), "scratch": Path("/scratch")}


def test_dataset_under_a_configured_root():
    assert check_dataset("shared:imagenet", "datasets[0]", ROOTS) == "shared:imagenet"
    assert check_dataset("shared:imagenet/./train", "datasets[0]", ROOTS) == "shared:imagenet/train"


def test_dataset_under_an_unknown_root_lists_the_known_ones():
    with pytest.raises(ValidationError) as info:
        check_dataset("team:imagenet", "datasets[2]", ROOTS)

    assert info.value.reason == "unknown_dataset_root"
    assert info.value.field == "datasets[2]"
    assert str(info.value) == "datasets[2]: unknown dataset root 'team' (known roots: scratch, shared)"


def test_dataset_root_when_none_are_configured():
    with pytest.raises(ValidationError) as info:
        check_dataset("shared:imagenet", "datasets[0]", {})

    assert "none are configured" in str(info.value)


def test_dataset_cannot_escape_its_root():
    with pytest.raises(ValidationError) as info:
        check_dataset("shared:../etc", "datasets[0]", ROOTS)

    assert info.value.reason == "path_traversal"


def test_dataset_relative_to_home():
    assert check_dataset("data/mnist", "datasets[0]", ROOTS) == "data/mnist"


def test_windows_drive_is_not_taken_for_a_root():
    with pytest.raises(ValidationError) as info:
        check_dataset("c:/x", "datasets[0]", {"c": Path("/c")})

    assert info.value.reason == "absolute_path"


# parse_json -------------------------------------------------------------------------

def test_valid_json_is_parsed():
    assert parse_json(b'{"notebook": {}}') == {"notebook": {}}


@pytest.mark.parametrize("raw, where", [
    (b'{"notebook": ', "at line 1 column 14"),
    (b"", "at line 1 column 1"),
    (b'{\n  "a": 1,\n}', "at line 3 column 1"),
])
def test_malformed_json_says_where(raw, where):
    with pytest.raises(UsageError) as info:
        parse_json(raw)

    assert not isinstance(info.value, ValidationError)
    assert info.value.status == 400
    assert info.value.reason == "malformed_json"
    assert info.value.message == f"the request body is not valid JSON {where}"


def test_body_that_is_not_utf8():
    with pytest.raises(UsageError) as info:
        parse_json(b'{"a": "\xff"}')

    assert info.value.reason == "malformed_json"
    assert info.value.message == "the request body is not valid JSON"


# check_notebook ---------------------------------------------------------------------

def test_valid_notebook_is_returned_as_a_node():
    node = check_notebook(notebook(nbformat.v4.new_markdown_cell("# hi"), nbformat.v4.new_code_cell("x = 1")))

    assert node.cells[1].source == "x = 1"


def test_nbformat_3_is_refused():
    with pytest.raises(ValidationError) as info:
        check_notebook({"nbformat": 3, "nbformat_minor": 0, "metadata": {}, "worksheets": []})

    assert info.value.reason == "bad_notebook"
    assert "nbformat 4" in info.value.message


def test_invalid_notebook_is_refused_with_the_problem():
    nb = notebook(nbformat.v4.new_code_cell("x = 1"))
    del nb["metadata"]

    with pytest.raises(ValidationError) as info:
        check_notebook(nb)

    assert info.value.reason == "bad_notebook"
    assert info.value.field == "notebook"
    assert "'metadata' is a required property" in info.value.message


@pytest.mark.filterwarnings("ignore::nbformat.warnings.MissingIDFieldWarning")
def test_cells_that_are_not_objects_are_refused():
    nb = notebook()
    nb["cells"] = ["print(1)"]

    with pytest.raises(ValidationError) as info:
        check_notebook(nb)

    assert info.value.reason == "bad_notebook"


def test_notebook_without_code_cell_is_refused():
    with pytest.raises(ValidationError) as info:
        check_notebook(notebook(nbformat.v4.new_markdown_cell("only prose")))

    assert info.value.reason == "empty_notebook"


# check_parameters -------------------------------------------------------------------

def test_identifier_parameters_are_accepted():
    check_parameters({"lr": 0.1, "_private": 1, "batch_size2": 64})


@pytest.mark.parametrize("key", ["1st", "learning-rate", "a b", "", "None", "True", "x.y"])
def test_non_identifier_parameters_are_refused(key):
    with pytest.raises(ValidationError) as info:
        check_parameters({"lr": 0.1, key: 1})

    assert info.value.field == f"parameters.{key}"
    assert info.value.reason == "bad_parameter"
    assert repr(key) in info.value.message


@pytest.mark.parametrize("key", ["class", "lambda", "for"])
def test_python_keywords_are_refused(key):
    with pytest.raises(ValidationError):
        check_parameters({key: 1})
