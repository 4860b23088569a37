"""Property tests of request validation: random input is refused cleanly or kept safely, never a 500.

For random strings, bytes and JSON-like values, each function of
:mod:`danlu.hub.service.validation` either returns a value that keeps its
promise or raises a :class:`~danlu.errors.DanluError` subclass naming the field;
anything else would reach the service's error handler as a 500.
``resolve_dataset`` runs against a temporary tree with symlinks that stay inside
and that lead out of the home folder and a dataset root, and must never return
a path outside the root the reference names. ``parse_json`` is compared with an
independent oracle (``json.loads`` plus a recursive check): it accepts exactly
the bodies whose values have no NaN or infinity, no lone surrogate or NUL and
at most 64 levels of nesting, and returns what ``json.loads`` returns.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from danlu.errors import DanluError, UsageError, ValidationError
from danlu.hub.service.jsonbody import parse_json
from danlu.hub.service.paths import resolve_dataset, safe_relative_path
from danlu.hub.service.validation import (
    EARLIEST,
    LATEST,
    check_notebook,
    check_schema,
    check_size,
    int_param,
    parse_time,
)

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SPECIAL = ["\x00", "\ud800", "\udbff", "\udc00", "\udfff", "\U0001f600", "é", "\\", "%", "%2e", "%00", "\n"]


def nasty_text(max_size: int = 20):
    """Unicode text, sometimes with NUL, lone surrogates (which st.text never makes) and friends."""
    return st.one_of(
        st.text(max_size=max_size),
        st.lists(st.one_of(st.sampled_from(SPECIAL), st.text(max_size=3)), max_size=6).map("".join),
    )


# resolve_dataset --------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("datasets")
    home, shared, outside = base / "home" / "alice", base / "shared", base / "outside"
    work = home / "work"
    for folder in (work / "data" / "mnist", home / "elsewhere", shared / "imagenet" / "train", outside / "deep"):
        folder.mkdir(parents=True)
    for file in (
        work / "data" / "mnist" / "train.csv",
        home / "elsewhere" / "big.bin",
        outside / "secret.txt",
        shared / "imagenet" / "train" / "0.jpg",
    ):
        file.write_bytes(b"x")
    links = {
        work / "link-in": "../elsewhere",
        work / "link-etc": "/etc",
        work / "link-out": "../../../outside",
        work / "dangling-out": "../../../outside/missing",
        work / "dangling-in": "data/missing",
        work / "loop-a": "loop-b",
        work / "loop-b": "loop-a",
        work / "up": "..",
        work / "top": "/",
        home / "elsewhere" / "back-out": "../../../outside/deep",
        shared / "link-to-outside": "../outside",
        shared / "link-inside": "imagenet",
        shared / "up": "..",
        base / "linked-root": "shared",
    }
    for link, target in links.items():
        link.symlink_to(target)
    os.mkfifo(work / "fifo")
    roots = {"shared": shared, "linked": base / "linked-root"}
    return {"home": home, "workdir": work, "roots": roots, "outside": outside}


PIECES = [
    "..",
    ".",
    "",
    "a",
    "data",
    "mnist",
    "train.csv",
    "imagenet",
    "train",
    "link-in",
    "link-etc",
    "link-out",
    "dangling-out",
    "dangling-in",
    "loop-a",
    "up",
    "top",
    "back-out",
    "big.bin",
    "elsewhere",
    "fifo",
    "link-to-outside",
    "link-inside",
    "secret.txt",
    "etc",
    "passwd",
    "%2e",
    "%2e%2e",
    "%252e%252e",
    "%2f",
    "%5c",
    "%00",
    "%",
    "~",
    "\\",
    "\x00",
    "\ud800",
    "\udcff",
    "é",
    "C:",
    "//",
    "file:",
]
PREFIXES = ["", "", "shared:", "linked:", "nope:", "c:", "C:\\", "~", "/", "file://"]

# walks through the tree: these resolve, escape through a link, loop, or name nothing
NAMES = [
    "data",
    "mnist",
    "train.csv",
    "link-in",
    "big.bin",
    "link-etc",
    "passwd",
    "link-out",
    "secret.txt",
    "deep",
    "dangling-out",
    "dangling-in",
    "loop-a",
    "up",
    "top",
    "etc",
    "back-out",
    "fifo",
    "imagenet",
    "train",
    "link-to-outside",
    "link-inside",
    "elsewhere",
    "work",
    ".",
]
walks = st.tuples(
    st.sampled_from(["", "", "shared:", "linked:"]),
    st.lists(st.sampled_from(NAMES), min_size=1, max_size=5).map("/".join),
).map("".join)

path_values = st.one_of(
    walks,
    walks,
    nasty_text(40),
    st.text(alphabet=st.sampled_from("./\\%~:2eEfF05acd\x00\ud800é"), max_size=30),
    st.tuples(st.sampled_from(PREFIXES), st.lists(st.sampled_from(PIECES), max_size=8).map("/".join)).map("".join),
    st.sampled_from([None, 7, ["data"], b"data"]),
)


def inside(path: str, top: str) -> bool:
    return os.path.commonpath([path, top]) == top


@PROPERTY
@given(value=path_values)
def test_resolve_dataset_never_leaves_its_root(world, value):
    check_resolved(world, value)


@PROPERTY
@given(data=st.data())
def test_walks_through_the_real_tree_never_leave_their_root(world, data):
    """Paths built from what is really there (links included, followed when they lead to folders)."""
    root = data.draw(st.sampled_from(["", "shared", "linked"]))
    here = world["roots"][root] if root else world["workdir"]
    parts = []
    for _ in range(data.draw(st.integers(0, 5))):
        entries = sorted(os.listdir(here)) if here.is_dir() else []
        if not entries:
            break
        parts.append(data.draw(st.sampled_from(entries)))
        here = here / parts[-1]
    check_resolved(world, (f"{root}:" if root else "") + ("/".join(parts) or "."))


def check_resolved(world, value) -> None:
    try:
        name, path = resolve_dataset(
            value, workdir=world["workdir"], home=world["home"], roots=world["roots"], field="datasets[0]"
        )
    except DanluError as e:
        assert isinstance(e, ValidationError)
        assert e.field == "datasets[0]"
        assert e.reason in {
            "path_traversal",
            "escapes_root",
            "no_dataset",
            "unknown_dataset_root",
            "bad_path",
            "absolute_path",
        }
        event(f"refused: {e.reason}")
        return
    event("resolved")
    root = next((r for r in world["roots"] if name.startswith(f"{r}:")), None)
    top = os.path.realpath(world["roots"][root] if root else world["home"])
    assert os.path.realpath(path) == str(path)  # the real path, no link left to follow
    assert inside(str(path), top)
    assert not inside(str(path), os.path.realpath(world["outside"]))
    assert path.is_dir() or path.is_file()


@PROPERTY
@given(value=path_values)
def test_safe_relative_paths_stay_relative(value):
    try:
        path = safe_relative_path(value, "cwd")
    except ValidationError as e:
        assert e.field == "cwd"
        return
    assert not path.startswith(("/", "~")) and ".." not in path.split("/")
    assert not re.search(r"[\x00-\x1f\x7f\\\ud800-\udfff]", path)
    assert not re.search(r"%(2e|2f|5c|00)", path, re.I)


# parse_json -------------------------------------------------------------------------


def acceptable(value, depth: int = 0, max_depth: int = 64) -> bool:
    """The oracle: what parse_json may return (recursive, independent of its iterative walk)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        return "\x00" not in value and not re.search("[\ud800-\udfff]", value)
    if isinstance(value, (list, dict)):
        if depth + 1 > max_depth:
            return False
        children = list(value.values()) + list(value) if isinstance(value, dict) else value
        return all(acceptable(v, depth + 1, max_depth) for v in children)
    return True


def check_against_oracle(raw: bytes, max_depth: int = 64) -> None:
    try:
        expected = json.loads(raw.decode("utf-8").removeprefix("\ufeff"))
        ok = acceptable(expected, max_depth=max_depth)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, a number of too many digits, too deep
        ok = False
    try:
        value = parse_json(raw, max_depth=max_depth)
    except UsageError as e:  # and nothing else
        assert e.field == "body"
        assert e.status in (400, 413)
        assert not ok, f"refused a good body: {e}"
        event(f"refused: {e.reason}")
        return
    assert ok, "accepted a body the oracle refuses"
    event("accepted")
    assert value == expected


leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), nasty_text())
json_values = st.recursive(
    leaves,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(nasty_text(6), children, max_size=4)),
    max_leaves=20,
)


def encode(value, ascii_only: bool) -> bytes:
    # ensure_ascii writes a lone surrogate as an escape; without it, "surrogatepass" writes its (invalid) UTF-8
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@PROPERTY
@given(
    value=json_values,
    ascii_only=st.booleans(),
    wrap=st.integers(0, 80),
    in_object=st.booleans(),
    max_depth=st.sampled_from([1, 2, 3, 4, 64]),
)
def test_parse_json_agrees_with_the_oracle_on_json_like_values(value, ascii_only, wrap, in_object, max_depth):
    for _ in range(wrap if max_depth == 64 else wrap % 3):
        value = {"a": value} if in_object else [value]
    check_against_oracle(encode(value, ascii_only), max_depth=max_depth)


TOKENS = [
    "[",
    "]",
    "{",
    "}",
    '"a"',
    ":",
    ",",
    "0",
    "-1",
    "1.5",
    "1e400",
    "-1e999",
    "1" * 4400,
    "NaN",
    "Infinity",
    "-Infinity",
    '"\\ud800"',
    '"\\uDBFF"',
    '"\\udc00\\ud800"',
    '"\\u0000"',
    '"\\ud83d\\ude00"',
    '"\\\\ud800"',
    "null",
    "true",
    '"x"',
    " ",
    "\n",
    "\\",
    '"',
    "\x00",
    "\ufeff",
    "é",
]


@PROPERTY
@given(tokens=st.lists(st.sampled_from(TOKENS), max_size=60), max_depth=st.sampled_from([1, 3, 64]))
def test_parse_json_agrees_with_the_oracle_on_token_soup(tokens, max_depth):
    check_against_oracle("".join(tokens).encode("utf-8", "surrogatepass"), max_depth=max_depth)


@PROPERTY
@given(raw=st.binary(max_size=300))
def test_parse_json_on_random_bytes(raw):
    check_against_oracle(raw)


@pytest.mark.filterwarnings("ignore::nbformat.warnings.MissingIDFieldWarning")
@PROPERTY
@given(value=json_values)
def test_schema_and_notebook_checks_refuse_cleanly(value):
    """What parse_json lets through reaches these next; they refuse with a DanluError, never a crash."""
    body = {"notebook": {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [value]}, "parameters": {}}
    for check in (
        lambda: check_schema("JobSubmission", value),
        lambda: check_schema("JobSubmission", body),
        lambda: check_notebook(body["notebook"]),
    ):
        try:
            check()
        except DanluError as e:
            assert isinstance(e, ValidationError) and e.field and e.fix


# query parameters and sizes ---------------------------------------------------------


@PROPERTY
@given(raw=st.one_of(st.none(), nasty_text(30), st.from_regex(r"\A[0-9T:+\-Z. ]{0,30}\Z")))
def test_parse_time_refuses_or_returns_a_naive_utc_time_in_range(raw):
    try:
        value = parse_time(raw, "from", default=EARLIEST)
    except UsageError as e:
        assert e.field == "from" and e.fix
        return
    assert value.tzinfo is None
    assert EARLIEST <= value <= LATEST


offsets = st.integers(-23 * 60 - 59, 23 * 60 + 59).map(lambda m: dt.timezone(dt.timedelta(minutes=m)))


@PROPERTY
@given(
    when=st.datetimes(min_value=dt.datetime(1970, 1, 2), max_value=dt.datetime(9999, 12, 29)),
    zone=st.one_of(st.none(), offsets),
    sep=st.sampled_from(["T", " "]),
)
def test_parse_time_reads_what_isoformat_writes(when, zone, sep):
    text = when.replace(tzinfo=zone).isoformat(sep=sep)
    expected = when - zone.utcoffset(None) if zone else when

    assert parse_time(text, "to", None) == expected


@PROPERTY
@given(
    raw=st.one_of(st.none(), nasty_text(25), st.from_regex(r"\A[-+]?[0-9]{0,25}\Z"), st.integers().map(str)),
    bounds=st.sampled_from([(0, 100_000), (1, 1000), (-10, 10), (0, 2**53 - 1)]),
)
def test_int_param_refuses_or_returns_an_int_in_range(raw, bounds):
    lo, hi = bounds
    try:
        value = int_param(raw, "offset", default=None, minimum=lo, maximum=hi)
    except UsageError as e:
        assert e.field == "offset" and f"from {lo} to {hi}" in e.message
        return
    if raw is None:
        assert value is None
        return
    assert re.fullmatch(r"-?[0-9]+" if lo < 0 else "[0-9]+", raw)
    assert type(value) is int and lo <= value <= hi and value == int(raw)


@PROPERTY
@given(n=st.integers(0, 2**53 - 1))
def test_int_param_reads_every_number_in_range(n):
    assert int_param(str(n), "offset", default=None) == n


sizes = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    nasty_text(12),
    st.from_regex(r"\A-?[0-9.]{0,8}(e[-+]?[0-9]{1,4})?[KMGTkmgtXx]?i?B?\Z"),
    st.lists(st.integers()),
)


@PROPERTY
@given(value=sizes)
def test_check_size_refuses_or_returns_finite_bytes(value):
    try:
        size = check_size(value, "resources.memory")
    except ValidationError as e:
        assert e.field == "resources.memory" and e.fix
        return
    assert type(size) is float and math.isfinite(size) and 0 <= size <= 2**60


@PROPERTY
@given(amount=st.integers(0, 4096), unit=st.sampled_from(["", "K", "M", "G", "T"]), suffix=st.sampled_from(["", "i"]))
def test_check_size_reads_units(amount, unit, suffix):
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit]

    assert check_size(f"{amount}{unit}{suffix if unit else ''}", "memory") == amount * scale
    assert check_size(amount * scale, "memory") == amount * scale
