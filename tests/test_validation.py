"""Pure tests of request validation in the jobs service.

:mod:`danlu.hub.service.validation` turns every bad request into a
``ValidationError`` (422) or ``UsageError`` (400) that names the field, never a
500. Paths must stay inside their root however they are spelled, and datasets
inside their root on disk, after every symlink (a temporary tree with links
in and out). ``test_input_properties.py`` checks the same functions on random
input.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import nbformat
import pytest

from danlu.errors import UsageError, ValidationError
from danlu.hub.service.jsonbody import parse_json
from danlu.hub.service.paths import check_dataset, resolve_dataset, safe_relative_path
from danlu.hub.service.validation import (
    check_notebook,
    check_parameters,
    check_schema,
    check_size,
    int_param,
    parse_time,
    time_range,
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
    check_schema(
        "JobSubmission",
        submission(
            parameters={"lr": 0.01},
            resources={"nproc": 2, "gpus": 1},
            profile="python",
            name="mnist-1.0",
            queue="default",
            datasets=["data/mnist"],
            cwd=".",
            source={"cell_id": "abc", "git_commit": "0123abc"},
            dry_run=True,
        ),
    )


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


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("nproc", -1, "at least 1"),
        ("nproc", 0, "at least 1"),
        ("nproc", 10**6, "at most 1024"),
        ("gpus", -1, "at least 0"),
        ("gpus", 4096, "at most 1024"),
    ],
)
def test_resource_bounds(field, value, words):
    error = schema_error(submission(resources={field: value}))

    assert error.field == f"resources.{field}"
    assert words in error.message
    assert repr(value) in error.message


@pytest.mark.parametrize("field, value", [("nproc", 2.0), ("gpus", 1.0), ("nproc", True), ("gpus", 1e300)])
def test_integer_fields_take_only_integers(field, value):
    error = schema_error(submission(resources={field: value}))

    assert error.field == f"resources.{field}"
    assert "must be of type integer" in error.message
    assert error.fix


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


@pytest.mark.parametrize(
    "value, reason",
    [
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
        ("%25252e%25252e/x", "path_traversal"),  # encoded three times
        ("a%5cb", "path_traversal"),
        ("a%00b", "path_traversal"),
        ("%7e/x", "path_traversal"),  # decodes to ~/x
        ("a\nb", "bad_path"),
        ("a\x7fb", "bad_path"),
        ("a\ud800b", "bad_path"),
        ("a/" * 2100, "bad_path"),
        ("\\\\server\\share", "bad_path"),
    ],
)
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


@pytest.mark.parametrize(
    "value, normalized",
    [
        ("data/train.csv", "data/train.csv"),
        (".", "."),
        ("a/./b//c/", "a/b/c"),
        ("notes..txt", "notes..txt"),
        ("100%25 done.csv", "100%25 done.csv"),  # a literal % that decodes to nothing dangerous
        ("données/été.csv", "données/été.csv"),
        ("a/~b", "a/~b"),
    ],
)
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


def test_a_url_is_not_a_dataset():
    with pytest.raises(ValidationError) as info:
        check_dataset("s3://bucket/imagenet", "datasets[0]", ROOTS)

    assert info.value.reason == "bad_path"
    assert "URL" in info.value.message


# resolve_dataset --------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path):
    """alice's home (workdir ``work``), a dataset root, and links that stay in or lead out of each."""
    home, shared, outside = tmp_path / "home" / "alice", tmp_path / "shared", tmp_path / "outside"
    work = home / "work"
    for folder in (work / "data" / "mnist", home / "elsewhere", shared / "imagenet" / "train", outside):
        folder.mkdir(parents=True)
    (work / "data" / "mnist" / "train.csv").write_text("x,y\n")
    (work / "notes.txt").write_text("hi")
    (home / "elsewhere" / "big.bin").write_bytes(b"0")
    (outside / "secret.txt").write_text("secret")
    links = {
        work / "link-in": "../elsewhere",
        work / "link-etc": "/etc",
        work / "link-out": "../../../outside",
        work / "dangling-out": "../../../outside/missing",
        work / "dangling-in": "data/missing",
        work / "loop-a": "loop-b",
        work / "loop-b": "loop-a",
        shared / "link-to-outside": "../outside",
        shared / "link-inside": "imagenet",
        tmp_path / "linked-root": "shared",
    }
    for link, target in links.items():
        link.symlink_to(target)
    os.mkfifo(work / "fifo")
    roots = {"shared": shared, "linked": tmp_path / "linked-root", "gone": tmp_path / "no-such-root"}
    return {"home": home, "workdir": work, "roots": roots, "outside": outside, "shared": shared}


def resolve(tree, value, **changes):
    args = {"workdir": tree["workdir"], "home": tree["home"], "roots": tree["roots"], "field": "datasets[0]"}
    return resolve_dataset(value, **{**args, **changes})


def refusal(tree, value, **changes) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        resolve(tree, value, **changes)
    assert info.value.field == "datasets[0]"
    assert info.value.status == 422
    assert info.value.fix
    return info.value


@pytest.mark.parametrize(
    "value, real",
    [
        ("data/mnist", "home/alice/work/data/mnist"),
        ("data/mnist/train.csv", "home/alice/work/data/mnist/train.csv"),
        ("./data//mnist/", "home/alice/work/data/mnist"),
        (".", "home/alice/work"),
        ("link-in/big.bin", "home/alice/elsewhere/big.bin"),  # a link that stays in the home folder
        ("shared:imagenet/train", "shared/imagenet/train"),
        ("shared:link-inside", "shared/imagenet"),
        ("linked:imagenet", "shared/imagenet"),  # a root configured through a link
    ],
)
def test_dataset_inside_its_root_resolves_to_its_real_path(tree, value, real):
    name, path = resolve(tree, value)

    assert path == Path(os.path.realpath(tree["home"].parents[1] / real))
    assert name == check_dataset(value, "datasets[0]", tree["roots"])


@pytest.mark.parametrize(
    "value",
    [
        "link-etc",
        "link-etc/passwd",
        "link-out",
        "link-out/secret.txt",
        "shared:link-to-outside",
        "shared:link-to-outside/secret.txt",
    ],
)
def test_dataset_through_a_link_out_of_its_root_is_refused(tree, value):
    error = refusal(tree, value)

    assert error.reason == "escapes_root"
    assert "leads outside" in error.message


def test_a_dangling_link_out_says_it_leads_out_not_whether_the_target_exists(tree):
    assert refusal(tree, "dangling-out").reason == "escapes_root"
    assert refusal(tree, "dangling-out/deeper").reason == "escapes_root"


def test_a_workdir_outside_the_home_folder_confines_nothing(tree):
    assert refusal(tree, "secret.txt", workdir=tree["outside"]).reason == "escapes_root"


@pytest.mark.parametrize(
    "value", ["missing", "data/missing.csv", "dangling-in", "notes.txt/inside", "shared:imagenet/val"]
)
def test_dataset_that_does_not_exist(tree, value):
    error = refusal(tree, value)

    assert error.reason == "no_dataset"
    assert error.message.endswith("does not exist")


def test_symlink_loop_has_its_own_message(tree):
    error = refusal(tree, "loop-a")

    assert error.reason == "bad_path"
    assert "loop of symbolic links" in error.message


def test_a_chain_of_links_longer_than_python_can_follow_is_refused(tree):
    work = tree["workdir"]
    (work / "chain-0").symlink_to("data")
    for i in range(1, 3000):
        (work / f"chain-{i}").symlink_to(f"chain-{i - 1}")

    assert resolve(tree, "chain-20")[1] == Path(os.path.realpath(work / "data"))
    error = refusal(tree, "chain-2999")
    assert error.reason == "bad_path"
    assert "too many symbolic links" in error.message


def test_a_fifo_is_not_a_dataset(tree):
    error = refusal(tree, "fifo")

    assert error.reason == "bad_path"
    assert "neither a file nor a folder" in error.message


def test_a_root_missing_on_this_server_is_named(tree):
    error = refusal(tree, "gone:x")

    assert error.reason == "no_dataset"
    assert "the dataset root 'gone' is not available" in error.message


@pytest.mark.parametrize(
    "value, reason",
    [
        ("../work/data", "path_traversal"),
        ("data/../../elsewhere", "path_traversal"),
        ("shared:../outside", "path_traversal"),
        ("/etc/passwd", "absolute_path"),
        ("~/work", "absolute_path"),
        ("~alice/work", "absolute_path"),
        ("C:/data", "absolute_path"),
        ("data\\mnist", "bad_path"),
        ("data/mnist\x00", "bad_path"),
        ("%2e%2e/outside", "path_traversal"),
        ("%252e%252e/outside", "path_traversal"),
        ("data%2fmnist", "path_traversal"),
        ("data%00", "path_traversal"),
        ("", "bad_path"),
        ("shared:", "bad_path"),
        ("team:imagenet", "unknown_dataset_root"),
        ("file:///etc/passwd", "bad_path"),
    ],
)
def test_lexical_refusals_come_before_the_file_system(tree, value, reason):
    assert refusal(tree, value).reason == reason


# parse_json -------------------------------------------------------------------------


def test_valid_json_is_parsed():
    assert parse_json(b'{"notebook": {}}') == {"notebook": {}}


@pytest.mark.parametrize(
    "raw, where",
    [
        (b'{"notebook": ', "at line 1 column 14"),
        (b"", "at line 1 column 1"),
        (b'{\n  "a": 1,\n}', "at line 3 column 1"),
    ],
)
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
    assert info.value.fix == "byte 0xff at line 1 column 8 is not UTF-8: send the body UTF-8 encoded"


def body_refusal(raw, **limits) -> UsageError:
    with pytest.raises(UsageError) as info:
        parse_json(raw, **limits)
    assert info.value.field == "body"
    assert info.value.fix
    return info.value


@pytest.mark.parametrize(
    "raw, reason, words",
    [
        (b'{"lr": NaN}', "non_finite_number", "has NaN at lr"),
        (b'{"lr": Infinity}', "non_finite_number", "has Infinity at lr"),
        (b"[1, -Infinity]", "non_finite_number", "has -Infinity at [1]"),
        (b"NaN", "non_finite_number", "has NaN as its value"),
        (b'{"resources": {"memory": 1e400}}', "non_finite_number", "too large for a double at resources.memory"),
        (b'{"a": "x\\ud800"}', "bad_unicode", "lone surrogate (\\ud800) in a, character 1"),
        (b'{"a": ["ok", "\\udfff"]}', "bad_unicode", "lone surrogate (\\udfff) in a[1], character 0"),
        (b'{"a": "\\ude00\\ud83d"}', "bad_unicode", "in a, character 0"),  # a pair the wrong way round
        (b'{"a": "\\uD800"}', "bad_unicode", "lone surrogate (\\ud800) in a"),  # escapes are case-insensitive
        (b'{"a": ["\\uDFFF"]}', "bad_unicode", "lone surrogate (\\udfff) in a[0]"),
        (b'{"k\\udbff": 1}', "bad_unicode", 'in the key ["k\\udbff"]'),
        (b'"\\ud800"', "bad_unicode", "in its top-level string"),
        (b'{"a": "x\\u0000"}', "nul_character", "NUL character (\\u0000) in a, character 1"),
        (b'{"a\\u0000b": 1}', "nul_character", 'in the key ["a\\u0000b"]'),
        (b'{"a": ' + b"1" * 5000 + b"}", "number_out_of_range", "too many digits"),
        (b'{"a": "\xed\xa0\x80"}', "malformed_json", "not valid JSON"),  # a surrogate encoded as UTF-8
        (b"\xff\xfe{\x00}\x00", "malformed_json", "not valid JSON"),  # UTF-16
        (b'{"a": "tab\there"}', "malformed_json", "at line 1 column 11"),
    ],
)
def test_body_values_that_cannot_be_kept_are_refused_with_their_path(raw, reason, words):
    error = body_refusal(raw)

    assert error.reason == reason
    assert error.status == 400
    assert words in error.message


def test_the_first_bad_value_is_named_by_its_json_path():
    nb = {"cells": [{"source": f"x = {i}"} for i in range(5)]}
    raw = json.dumps({"notebook": nb}).replace('"x = 3"', '"x = \\u0000"').replace('"x = 4"', "NaN").encode()

    assert "in notebook.cells[3].source" in body_refusal(raw).message


def test_odd_keys_are_quoted_in_the_path():
    error = body_refusal(b'{"a.b": {"c d": [0, {"": NaN}]}}')

    assert 'at ["a.b"]["c d"][1][""]' in error.message


@pytest.mark.parametrize("depth", [65, 100, 1000, 5000, 200_000])
def test_nesting_deeper_than_the_limit_is_refused(depth):
    for raw in (b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth):
        error = body_refusal(raw)

        assert error.reason == "too_deep"
        assert "deeper than 64 levels" in error.message


def test_nesting_at_the_limit_is_accepted():
    value = parse_json(b'{"a":' * 63 + b"[]" + b"}" * 63)

    for _ in range(63):
        value = value["a"]
    assert value == []
    assert body_refusal(b"[[[1]]]", max_depth=2).reason == "too_deep"
    assert parse_json(b"[[1]]", max_depth=2) == [[1]]


def test_a_body_over_the_limit_is_a_413():
    error = body_refusal(b"[" + b"1," * 600 + b"1]", max_bytes=1000)

    assert error.status == 413
    assert error.reason == "too_large"
    assert parse_json(b"[" + b"1," * 400 + b"1]", max_bytes=1000)[-1] == 1


@pytest.mark.parametrize(
    "raw, value",
    [
        (b'["\\ud83d\\ude00", "\\ud83d\\ude00"]', ["\U0001f600"] * 2),  # a surrogate pair is one character
        ('{"caf\u00e9": "\u6f22\u5b57"}'.encode(), {"caf\u00e9": "\u6f22\u5b57"}),
        (b'{"a": "\\\\u0000 \\\\ud800"}', {"a": "\\u0000 \\ud800"}),  # escaped backslashes: plain text
        (b'\xef\xbb\xbf{"a": 1}', {"a": 1}),  # a UTF-8 byte order mark
        (b'{"a": [1.5, -2, 1e308, true, null]}', {"a": [1.5, -2, 1e308, True, None]}),
        ('{"a": 1}', {"a": 1}),  # str is taken too
    ],
)
def test_good_bodies_are_parsed(raw, value):
    assert parse_json(raw) == value


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


# check_size -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, size",
    [
        ("512M", 512 * 2**20),
        ("8G", 8 * 2**30),
        ("1.5T", 1.5 * 2**40),
        ("8Gi", 8 * 2**30),
        ("8GiB", 8 * 2**30),
        ("8GB", 8 * 2**30),
        ("8g", 8 * 2**30),
        (" 8 G ", 8 * 2**30),
        ("1024", 1024),
        (".5K", 512),
        (4096, 4096),
        (1.5, 1.5),
        (0, 0),
        (2**60, 2**60),
        ("1024T", 2**50),
    ],
)
def test_sizes_are_read_in_bytes(value, size):
    assert check_size(value, "resources.memory") == size


@pytest.mark.parametrize(
    "value, words",
    [
        (float("nan"), "must be a finite number of bytes"),
        (float("inf"), "must be a finite number of bytes"),
        (float("-inf"), "must be a finite number of bytes"),
        (-1, "must not be negative"),
        ("-1G", "must not be negative"),
        (2**60 + 1, "more than 2**60 bytes"),
        (10**400, "more than 2**60 bytes"),
        ("1e400", "more than 2**60 bytes"),
        ("2000000T", "more than 2**60 bytes"),
        (True, "is not a size"),
        (None, "is not a size"),
        ([8], "is not a size"),
        ("nan", "is not a size"),
        ("inf", "is not a size"),
        ("8 gigabytes", "is not a size"),
        ("1_000", "is not a size"),
        ("\u0668G", "is not a size"),  # an Arabic-Indic digit, which float() would take
        ("8X", "is not a size"),
    ],
)
def test_sizes_that_are_not_sizes_are_refused(value, words):
    with pytest.raises(ValidationError) as info:
        check_size(value, "resources.memory")

    assert info.value.field == "resources.memory"
    assert info.value.reason == "bad_size"
    assert words in info.value.message
    assert "512M" in str(info.value)


# int_param --------------------------------------------------------------------------


@pytest.mark.parametrize("raw, value", [(None, 7), ("0", 0), ("42", 42), ("0042", 42), ("100000", 100_000)])
def test_int_param_reads_digits(raw, value):
    assert int_param(raw, "tail", default=7, minimum=0, maximum=100_000) == value


@pytest.mark.parametrize(
    "raw",
    [
        "",
        " 5",
        "5 ",
        "+5",
        "-5",
        "-0",
        "5.0",
        "1e3",
        "1_000",
        "0x10",
        "\u0663",
        "five",
        "100001",
        str(2**53),
        "9" * 5000,
    ],
)
def test_int_param_refuses_anything_else_naming_the_range(raw):
    with pytest.raises(UsageError) as info:
        int_param(raw, "tail", default=None, minimum=0, maximum=100_000)

    assert info.value.field == "tail"
    assert info.value.status == 400
    assert "query parameter tail must be a whole number from 0 to 100000" in info.value.message


def test_int_param_takes_a_sign_only_where_negatives_are_allowed():
    assert int_param("-3", "shift", minimum=-10, maximum=10) == -3
    with pytest.raises(UsageError):
        int_param("-11", "shift", minimum=-10, maximum=10)


def test_offsets_stop_at_2_53():
    assert int_param(str(2**53 - 1), "offset", default=0) == 2**53 - 1
    with pytest.raises(UsageError) as info:
        int_param(str(2**53), "offset", default=0)

    assert "from 0 to 9007199254740991" in info.value.message


# parse_time and time_range ----------------------------------------------------------

NOW = dt.datetime(2026, 11, 1, 12, 0)


@pytest.mark.parametrize(
    "raw, value",
    [
        ("2026-11-01", dt.datetime(2026, 11, 1)),
        ("2026-11-01T08:00:00", dt.datetime(2026, 11, 1, 8)),
        ("2026-11-01T08:00:00Z", dt.datetime(2026, 11, 1, 8)),
        ("2026-11-01T08:00:00z", dt.datetime(2026, 11, 1, 8)),
        ("2026-11-01T08:00:00+05:30", dt.datetime(2026, 11, 1, 2, 30)),
        ("2026-11-01T01:00:00-02:00", dt.datetime(2026, 11, 1, 3)),
        ("1970-01-01", dt.datetime(1970, 1, 1)),
        ("9999-12-30T23:59:59", dt.datetime(9999, 12, 30, 23, 59, 59)),
    ],
)
def test_times_are_read_as_naive_utc(raw, value):
    assert parse_time(raw, "from", None) == value


def test_an_absent_time_is_the_default():
    assert parse_time(None, "from", NOW) is NOW


@pytest.mark.parametrize(
    "raw, words",
    [
        ("yesterday", "must be an ISO 8601 date or time"),
        ("", "must be an ISO 8601 date or time"),
        ("2026-02-30", "must be an ISO 8601 date or time"),
        ("2026-11-01T25:00", "must be an ISO 8601 date or time"),
        ("2026-11-01T08:00+24:00", "must be an ISO 8601 date or time"),
        ("2026-11-01\x00", "must be an ISO 8601 date or time"),
        ("\ud800", "must be an ISO 8601 date or time"),
        ("2026-11-01" + "0" * 100, "must be an ISO 8601 date or time"),
        ("1969-12-31T23:59:59Z", "between 1970-01-01 and 9999-12-30"),
        ("1970-01-01T00:30:00+01:00", "between 1970-01-01 and 9999-12-30"),
        ("0001-01-01", "between 1970-01-01 and 9999-12-30"),
        ("0001-01-01T00:00:00+01:00", "between 1970-01-01 and 9999-12-30"),  # before datetime.min in UTC
        ("9999-12-31", "between 1970-01-01 and 9999-12-30"),
        ("9999-12-31T23:00:00-05:00", "between 1970-01-01 and 9999-12-30"),  # after datetime.max in UTC
    ],
)
def test_bad_times_name_the_parameter_and_an_example(raw, words):
    with pytest.raises(UsageError) as info:
        parse_time(raw, "to", None)

    assert info.value.field == "to"
    assert info.value.status == 400
    assert info.value.message.startswith("query parameter to must be")
    assert words in info.value.message
    assert "2026-11-01T08:00:00Z" in str(info.value)


def test_time_range_defaults_to_the_last_30_days():
    assert time_range(None, None, now=NOW) == (NOW - dt.timedelta(days=30), NOW)
    assert time_range("2026-10-01", None, now=NOW) == (dt.datetime(2026, 10, 1), NOW)
    assert time_range(None, "2026-06-01", now=NOW) == (dt.datetime(2026, 5, 2), dt.datetime(2026, 6, 1))


def test_time_range_at_the_edges_does_not_overflow():
    assert time_range(None, "1970-01-01", now=NOW)[0] == dt.datetime(1969, 12, 2)
    assert time_range("9999-12-01", "9999-12-30", now=NOW)[1] == dt.datetime(9999, 12, 30)


@pytest.mark.parametrize(
    "raw_from, raw_to, words",
    [
        ("2026-11-02", None, "must be before to"),
        ("2026-11-01T12:00:00", None, "must be before to"),
        ("2026-06-01", "2026-05-01", "must be before to"),
        ("1970-01-01", None, "more than 3660"),
        ("2000-01-01", "9999-12-30", "more than 3660"),
    ],
)
def test_time_range_refusals_name_from(raw_from, raw_to, words):
    with pytest.raises(UsageError) as info:
        time_range(raw_from, raw_to, now=NOW)

    assert info.value.field == "from"
    assert words in info.value.message
    assert info.value.fix


def test_time_range_names_the_bad_parameter():
    with pytest.raises(UsageError) as info:
        time_range("2026-10-01", "soon", now=NOW)

    assert info.value.field == "to"


def test_more_than_one_node_needs_a_backend_with_nodes_and_gpus_that_split_evenly():
    from danlu.hub.service.validation import check_nodes

    check_nodes({"nodes": 1, "gpus": 3}, multi_node=False)
    check_nodes({"nodes": 2, "gpus": 4}, multi_node=True)
    with pytest.raises(ValidationError) as one_machine:
        check_nodes({"nodes": 2, "gpus": 0}, multi_node=False)
    assert (one_machine.value.field, one_machine.value.reason) == ("resources.nodes", "one_machine")
    assert "Kubernetes backend" in one_machine.value.fix
    with pytest.raises(ValidationError) as uneven:
        check_nodes({"nodes": 2, "gpus": 3}, multi_node=True)
    assert (uneven.value.field, uneven.value.reason) == ("resources.gpus", "uneven_gpus")
