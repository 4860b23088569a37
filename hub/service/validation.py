"""Request validation: the OpenAPI contract, plus every bound a schema cannot say.

The OpenAPI document (``openapi.yaml``) is the contract: request bodies are
validated against its component schemas here, so a field the document does not
list is refused (422, ``field`` named). Before that, :func:`parse_json` turns
the raw body into a value that is safe to keep: UTF-8, valid JSON, at most 64
MiB, nested at most 64 deep, no ``NaN``/``Infinity``, no lone surrogate and no
NUL in any string or key (the message names the JSON path). Query parameters
are read by :func:`int_param` (bounded whole numbers), :func:`parse_time` and
:func:`time_range` (ISO 8601, 1970-01-01..9999-12-30, naive UTC). Sizes go
through :func:`check_size` (finite, 0..2**60 bytes). Every path-like field
(``cwd``, ``datasets[i]``, ``source.notebook_path``) is a relative path that
stays inside its root however it is spelled, and a dataset is confined again on
disk on its real path after every symlink: that is :mod:`.paths`. The notebook must be valid nbformat 4. These are pure
functions; each refusal is a :class:`~danlu.errors.UsageError` (400) or
:class:`~danlu.errors.ValidationError` (422) naming the field and the fix.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import keyword
import math
import re
from importlib import resources
from typing import Any

import jsonschema
import nbformat
import yaml

from danlu.errors import UsageError, ValidationError
from danlu.hub.config import schema
from danlu.hub.service.formats import short, show

MAX_BODY = 64 * 2**20
#: how usage reports may be grouped (``GET /usage?by=``)
USAGE_GROUPINGS = ("user", "team", "queue", "profile")
#: an executed notebook a runner hands over (the same bound as a submitted one)
MAX_OUTPUT = MAX_BODY
MAX_DEPTH = 64
MAX_SIZE = 2**60
MAX_SAFE_INT = 2**53 - 1  # the largest integer every JSON client (JavaScript included) reads exactly
EARLIEST = dt.datetime(1970, 1, 1)
LATEST = dt.datetime(9999, 12, 30, 23, 59, 59, 999999)  # a day short of datetime.max: end + 1 day still works


@functools.cache
def openapi() -> dict:
    text = resources.files("danlu.hub.service").joinpath("openapi.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


# "integer" means an int: jsonschema also takes 2.0 and 1e300, which would reach range() and the database
_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator,
                                          type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
                                              "integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool)))


@functools.cache
def _validator(name: str) -> jsonschema.Draft202012Validator:
    doc = openapi()
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return _Validator(schema)


def _field_of(error: jsonschema.ValidationError) -> str:
    parts = [str(p) for p in error.absolute_path]
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = set(error.schema.get("properties", {}))
        extra = sorted(k for k in error.instance if k not in allowed)
        if extra:
            parts.append(extra[0])
    if error.validator == "required" and isinstance(error.validator_value, list) and isinstance(error.instance, dict):
        missing = [k for k in error.validator_value if k not in error.instance]
        if missing:
            parts.append(missing[0])
    out = ""
    for part in parts:
        part = part if len(part) <= 64 else f"{part[:60]}..."
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out or "body"


def _message_of(error: jsonschema.ValidationError, field: str) -> str:
    if error.validator == "additionalProperties":
        return f"unknown field '{field}'"
    if error.validator == "required":
        return f"missing required field '{field}'"
    if error.validator in ("minimum", "exclusiveMinimum"):
        return f"{field} must be at least {error.validator_value}, got {show(error.instance)}"
    if error.validator in ("maximum", "exclusiveMaximum"):
        return f"{field} must be at most {error.validator_value}, got {show(error.instance)}"
    if error.validator == "type":
        return f"{field} must be of type {error.validator_value}, got {type(error.instance).__name__}"
    if error.validator == "pattern":
        return f"{field} {show(error.instance)} does not match {error.validator_value}"
    if error.validator in ("maxLength", "maxItems", "maxProperties"):
        return f"{field} is longer than {error.validator_value} {'characters' if 'Len' in error.validator else 'items'}"
    return f"{field}: {short(error.message)}"  # jsonschema's words embed the whole value, maybe megabytes


def _fix_of(error: jsonschema.ValidationError, field: str) -> str:
    if error.validator == "additionalProperties":
        known = ", ".join(sorted(error.schema.get("properties", {})))
        return f"remove it; the fields here are: {known}" if known else "remove it"
    if error.validator == "required":
        return f"add {field}"
    return "the API's request schemas are in its openapi.json"


def check_schema(name: str, body: Any) -> None:
    """Validate ``body`` against ``components.schemas[name]``; raise on the first problem."""
    errors = sorted(_validator(name).iter_errors(body), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        # additionalProperties before the rest so an unknown field is named even if other things are wrong
        errors.sort(key=lambda e: e.validator != "additionalProperties")
        error = errors[0]
        field = _field_of(error)
        raise ValidationError(_message_of(error, field), field=field, reason="invalid_field",
                              fix=_fix_of(error, field))


# the request body ---------------------------------------------------------------------

class _Constant(float):
    """``NaN``, ``Infinity`` or ``-Infinity`` as written in a body (Python's json reads them; JSON has none)."""


_DECODER = json.JSONDecoder(parse_constant=_Constant)
# NUL and lone surrogates reach a parsed string only through these escapes: strict UTF-8 decoding refuses
# encoded surrogates and the JSON grammar refuses raw control characters, so without them no string is checked
_RISKY_ESCAPE = re.compile(r"\\u(?:0000|[dD][89a-fA-F])")
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*\Z")


def _body_error(message: str, fix: str, reason: str, **kw) -> UsageError:
    return UsageError(f"the request body {message}", field="body", reason=reason, fix=fix, **kw)


def _json_path(frame, key) -> str:
    """``notebook.cells[3].source`` for ``key`` inside the container of ``frame`` (keys to the root)."""
    keys = [key]
    while frame is not None and frame[0] is not None:
        keys.append(frame[1])
        frame = frame[0]
    out = ""
    for k in reversed(keys):
        if len(out) > 160:
            out += "..."
            break
        if isinstance(k, int):
            out += f"[{k}]"
        elif _PLAIN_KEY.match(k) and len(k) <= 64:
            out += f".{k}" if out else k
        else:
            out += f"[{json.dumps(k[:40] + ('...' if len(k) > 40 else ''))}]"
    return out


def _string_problem(s: str) -> tuple[str, int] | None:
    """``("nul", i)`` or ``("surrogate", i)`` for a string that may not be kept, else None; at C speed."""
    if "\x00" in s:
        return "nul", s.index("\x00")
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            return "surrogate", e.start
    return None


def _string_error(s: str, problem: tuple[str, int], where: str) -> UsageError:
    what, at = problem
    if what == "nul":
        return _body_error(f"has a NUL character (\\u0000) {where}, character {at}",
                           "remove NUL characters: text fields cannot hold them", "nul_character")
    return _body_error(f"has a lone surrogate (\\u{ord(s[at]):04x}) {where}, character {at}",
                       "send valid Unicode: every \\ud800-\\udbff escape needs a \\udc00-\\udfff after it",
                       "bad_unicode")


def _number_error(value: float, where: str) -> UsageError:
    if type(value) is _Constant:
        word = "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
        return _body_error(f"has {word} {where}", "JSON numbers are finite: send a number or null",
                           "non_finite_number")
    return _body_error(f"has a number too large for a double {where}", "send a number of magnitude below 1.7e308",
                       "non_finite_number")


def _too_deep(max_depth: int, where: str = "") -> UsageError:
    return _body_error(f"nests arrays and objects deeper than {max_depth} levels{where}",
                       f"send at most {max_depth} levels of nesting", "too_deep")


def _plain_list(items: list, check_strings: bool) -> bool:
    """True when ``items`` are all good strings or all finite numbers, checked at C speed (notebook sources
    and outputs are lists of lines); False means "look at each item", not "bad"."""
    try:
        joined = "".join(items)
    except TypeError:
        try:
            return math.isfinite(sum(items, 0.0))
        except (TypeError, OverflowError):
            return False
    return not check_strings or _string_problem(joined) is None


def _check_tree(value, max_depth: int, check_strings: bool) -> None:
    """Walk ``value`` without recursion; refuse the first thing that may not be kept, naming its path.

    Depth-first in document order: the stack holds one iterator per open container, and a frame
    ``(parent frame, key in the parent, depth)`` from which the path is rebuilt only for a refusal.
    """
    kind = type(value)
    if kind is str and check_strings and (problem := _string_problem(value)):
        raise _string_error(value, problem, "in its top-level string")
    if kind is _Constant or (kind is float and not math.isfinite(value)):
        raise _number_error(value, "as its value")
    if kind is not dict and kind is not list:
        return
    if max_depth < 1:
        raise _too_deep(max_depth)
    stack = [(iter(value.items()) if kind is dict else enumerate(value), (None, None, 1), kind is dict)]
    while stack:
        items, frame, is_dict = stack[-1]
        for key, child in items:
            if is_dict and check_strings and (problem := _string_problem(key)):
                raise _string_error(key, problem, f"in the key {_json_path(frame, key)}")
            kind = type(child)
            if kind is dict or kind is list:
                depth = frame[2] + 1
                if depth > max_depth:
                    raise _too_deep(max_depth, f" at {_json_path(frame, key)}")
                if child and not (kind is list and _plain_list(child, check_strings)):
                    stack.append((iter(child.items()) if kind is dict else enumerate(child), (frame, key, depth),
                                  kind is dict))
                    break  # into the child; this container's iterator resumes after it
            elif kind is str:
                if check_strings and (problem := _string_problem(child)):
                    raise _string_error(child, problem, f"in {_json_path(frame, key)}")
            elif kind is _Constant or (kind is float and not math.isfinite(child)):
                raise _number_error(child, f"at {_json_path(frame, key)}")
        else:
            stack.pop()


def parse_json(raw: bytes, *, max_bytes: int = MAX_BODY, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value in a request body, or a UsageError (``field="body"``) that says what to fix.

    Refused: more than ``max_bytes`` (413), bytes that are not UTF-8, invalid JSON (line and column),
    ``NaN``/``Infinity``/``-Infinity`` and numbers that overflow a double, arrays and objects nested deeper
    than ``max_depth``, lone surrogates and NUL characters in any string or key. A refusal after parsing
    names the JSON path of the first bad value (``notebook.cells[3].source``). The walk is iterative and
    checks each string at C speed (and only when the text has a ``\\u0000`` or ``\\ud8..``-``\\udf..``
    escape), so a 64 MiB notebook costs little more than ``json.loads``.
    """
    if raw is None:
        raw = b""
    if isinstance(raw, str):
        try:
            raw = raw.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _body_error("is not valid JSON", f"character {e.start} is a lone surrogate: send UTF-8 text",
                              "malformed_json", log_message="body given as str with a lone surrogate") from None
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise TypeError(f"parse_json takes the raw body as bytes, not {type(raw).__name__}")
    raw = bytes(raw)  # no copy when it already is
    if len(raw) > max_bytes:
        amount = f"{max_bytes // 2**20} MiB" if max_bytes % 2**20 == 0 else f"{max_bytes} bytes"
        raise _body_error(f"is larger than {amount}", "send less: large data belongs in a dataset, not in the request",
                          "too_large", status=413)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise _body_error("is not valid JSON", f"byte 0x{raw[e.start]:02x} at line {line} column {column} is not "
                          "UTF-8: send the body UTF-8 encoded", "malformed_json") from None
    text = text.removeprefix("\ufeff")  # a UTF-8 byte order mark, which RFC 8259 lets a parser ignore
    try:
        value = _DECODER.decode(text)
    except json.JSONDecodeError as e:
        raise _body_error(f"is not valid JSON at line {e.lineno} column {e.colno}",
                          f"{e.msg.removesuffix(' at').lower()}: send a JSON object with Content-Type: "
                          "application/json", "malformed_json") from None
    except RecursionError:  # json's C scanner stops near sys.getrecursionlimit() levels
        raise _too_deep(max_depth) from None
    except ValueError as e:  # an integer of more than sys.get_int_max_str_digits() digits
        raise _body_error("has a number with too many digits", "send numbers of at most 4300 digits",
                          "number_out_of_range", log_message=f"body: {str(e)[:200]}") from None
    _check_tree(value, max_depth, _RISKY_ESCAPE.search(text) is not None)
    return value


# query parameters and sizes -----------------------------------------------------------

_UNSIGNED = re.compile(r"[0-9]{1,20}\Z")
_SIGNED = re.compile(r"-?[0-9]{1,20}\Z")


def int_param(raw: str | None, field: str, *, default=None, minimum: int = 0, maximum: int = MAX_SAFE_INT):
    """A query parameter as a whole number in ``minimum..maximum``; ``default`` when it is absent.

    Only ASCII digits, with a leading ``-`` only where ``minimum`` is negative (no ``+``, spaces, ``_`` or
    other scripts' digits, all of which ``int()`` would take); a UsageError naming the field and the range.
    """
    if raw is None:
        return default
    allowed = f"a whole number from {minimum} to {maximum}"
    pattern = _SIGNED if minimum < 0 else _UNSIGNED
    if not isinstance(raw, str) or not pattern.match(raw) or not minimum <= int(raw) <= maximum:
        raise UsageError(f"query parameter {field} must be {allowed}, got {show(raw)}", field=field,
                         reason="bad_query", fix=f"e.g. {field}={minimum if default is None else default}")
    return int(raw)


def parse_time(raw: str | None, field: str, default):
    """An ISO 8601 date or date and time (``Z`` or an offset, or none for UTC) as a naive UTC datetime.

    ``default`` when ``raw`` is None. Refused (UsageError naming the query parameter, with an example):
    anything ``datetime.fromisoformat`` cannot read, and times outside 1970-01-01..9999-12-30, so that a
    range of a day or a few thousand days around it never overflows.
    """
    if raw is None:
        return default
    fix = "e.g. 2026-11-01 or 2026-11-01T08:00:00Z"
    out_of_range = UsageError(f"query parameter {field} must be between 1970-01-01 and 9999-12-30, got "
                              f"{show(raw)}", field=field, reason="bad_time", fix=fix)
    try:
        if not isinstance(raw, str) or len(raw) > 64:
            raise ValueError(raw)
        value = dt.datetime.fromisoformat(raw[:-1] + "Z" if raw.endswith("z") else raw)  # RFC 3339 allows z
    except ValueError:
        raise UsageError(f"query parameter {field} must be an ISO 8601 date or time, got {show(raw)}",
                         field=field, reason="bad_time", fix=fix) from None
    if value.tzinfo is not None:
        try:
            value = value.astimezone(dt.timezone.utc).replace(tzinfo=None)
        except OverflowError:  # 0001-01-01T00:00+01:00 is before datetime.min in UTC
            raise out_of_range from None
    if not EARLIEST <= value <= LATEST:
        raise out_of_range
    return value


def time_range(raw_from: str | None, raw_to: str | None, default_days: int = 30, max_days: int = 3660, *,
               now: dt.datetime | None = None) -> tuple[dt.datetime, dt.datetime]:
    """``(start, end)`` from the ``from`` and ``to`` query parameters, naive UTC.

    ``to`` defaults to ``now`` (the current UTC time), ``from`` to ``default_days`` before ``to``. Refused:
    either one unreadable or out of range (:func:`parse_time`), ``from`` not before ``to``, and a range
    longer than ``max_days``.
    """
    start = parse_time(raw_from, "from", None)
    end = parse_time(raw_to, "to", None)
    if end is None:
        end = now if now is not None else dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
    if start is None:
        start = end - dt.timedelta(days=default_days)
    if start >= end:
        raise UsageError(f"from ({start.isoformat()}) must be before to ({end.isoformat()})", field="from",
                         reason="bad_time_range", fix="e.g. from=2026-10-01&to=2026-11-01")
    if end - start > dt.timedelta(days=max_days):
        raise UsageError(f"from..to spans {(end - start).days} days, more than {max_days}", field="from",
                         reason="bad_time_range", fix=f"ask for at most {max_days} days at a time")
    return start, end


_SIZE_TEXT = re.compile(r"\s*(-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]{1,4})?)\s*"
                        r"(?:([KMGTkmgt])i?)?B?\s*\Z")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def check_nodes(resources: dict, *, multi_node: bool) -> None:
    """``resources.nodes``: more than one only where the backend has nodes; the job's GPUs split evenly."""
    nodes = resources["nodes"]
    if nodes > 1 and not multi_node:
        raise ValidationError(f"resources.nodes: this workbench runs jobs on one machine, {nodes} nodes asked",
                              field="resources.nodes", reason="one_machine",
                              fix="leave nodes out (or 1); more nodes need the Kubernetes backend")
    if nodes > 1 and resources.get("gpus", 0) % nodes:
        raise ValidationError(f"resources.gpus: {resources['gpus']} GPUs do not split evenly over {nodes} nodes",
                              field="resources.gpus", reason="uneven_gpus",
                              fix=f"ask for a multiple of {nodes} GPUs (the same on every node)")


def check_size(value, field: str) -> float:
    """Bytes from a size (``512M``, ``8G``, ``1.5T``, ``8Gi``; binary units) or a number of bytes.

    Refused with a ValidationError naming the field: booleans, anything else that is not a number or such
    a string, NaN and infinities, negative sizes, and sizes above 2**60 bytes (1 EiB).
    """
    fix = "write 512M, 8G or 1.5T (binary units), or a number of bytes"
    if isinstance(value, str) and len(value) <= 64 and (m := _SIZE_TEXT.match(value)):
        size = float(m[1]) * _UNITS[(m[2] or "").upper()]
    elif isinstance(value, float):
        size = value
    elif isinstance(value, int) and not isinstance(value, bool):
        # float(10**400) would raise
        size = float(value) if abs(value) <= MAX_SIZE else (math.inf if value > 0 else -math.inf)
    else:
        raise ValidationError(f"{field}: {show(value)} is not a size", field=field, reason="bad_size", fix=fix)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValidationError(f"{field} must be a finite number of bytes, got {value}", field=field,
                              reason="bad_size", fix=fix)
    if size < 0:
        raise ValidationError(f"{field} must not be negative", field=field, reason="bad_size", fix=fix)
    if size > MAX_SIZE:
        raise ValidationError(f"{field}: {show(value)} is more than 2**60 bytes (1 EiB)", field=field,
                              reason="bad_size", fix=fix)
    return abs(size)  # -0 is 0


def warm() -> None:
    """Build what a first submission would otherwise build on the event loop: the JobSubmission validator and
    nbformat's (its schema read, its validator compiled; about 0.2 s of CPU, once per process)."""
    check_schema("JobSubmission", {"notebook": {}})
    check_notebook({"nbformat": 4, "nbformat_minor": 5, "metadata": {},
                    "cells": [{"cell_type": "code", "id": "warm", "metadata": {}, "source": "", "outputs": [],
                               "execution_count": None}]})


def check_notebook(nb: dict) -> Any:

    if nb.get("nbformat") != 4:
        raise ValidationError("notebook must be an nbformat 4 notebook (nbformat: 4)", field="notebook",
                              reason="bad_notebook", fix="save it with Jupyter 4 or later, or convert it with "
                              "jupyter nbconvert --to notebook")
    if not isinstance(nb.get("cells"), list) or not all(isinstance(c, dict) for c in nb["cells"]) \
            or not isinstance(nb.get("metadata", {}), dict):
        raise ValidationError("notebook.cells must be a list of cell objects and notebook.metadata an object",
                              field="notebook", reason="bad_notebook", fix="send the .ipynb file's JSON as it is")
    fix = "send the .ipynb file's JSON as Jupyter saved it (jupyter nbconvert --to notebook repairs most)"
    try:
        node = nbformat.from_dict(nb)
        nbformat.validate(node)
    except (TypeError, AttributeError, KeyError) as e:
        raise ValidationError(f"notebook is not valid nbformat: {short(str(e))}", field="notebook",
                              reason="bad_notebook", fix=fix) from None
    except nbformat.ValidationError as e:
        raise ValidationError(f"notebook is not valid nbformat: {short(e.message)}", field="notebook",
                              reason="bad_notebook", fix=fix) from None
    if not any(c.get("cell_type") == "code" for c in nb.get("cells", [])):
        raise ValidationError("notebook has no code cell to run", field="notebook", reason="empty_notebook",
                              fix="add the code to run to a code cell")
    return node


@functools.cache
def _team_schema() -> jsonschema.Draft202012Validator:

    full = schema()
    change = {"type": "object", "additionalProperties": False, "minProperties": 1,
              "properties": {k: {"$ref": "#/$defs/amounts"} for k in ("quota", "borrowing_limit", "lending_limit")}}
    return _Validator({**change, "$defs": full["$defs"]})


def check_team_change(changes, flavors) -> None:
    """A live change of a team's quota or limits: the shape of danlu.yaml's teams, known GPU flavors."""
    errors = sorted(_team_schema().iter_errors(changes), key=lambda e: list(e.absolute_path))
    if errors:
        error = errors[0]
        field = _field_of(error)
        raise ValidationError(_message_of(error, field), field=field, reason="invalid_field",
                              fix=_fix_of(error, field))
    for section, amounts in changes.items():
        for flavor in (amounts.get("gpus") or {}):
            if flavor not in flavors:
                raise ValidationError(f"{section}.gpus.{flavor}: no GPUs of that flavor here",
                                      field=f"{section}.gpus.{flavor}", fix=f"flavors: {', '.join(flavors)}")
        if "memory" in amounts:
            check_size(amounts["memory"], f"{section}.memory")


def check_parameters(params: dict) -> None:
    for key in params:
        if not key.isidentifier() or keyword.iskeyword(key):
            raise ValidationError(f"parameter name {show(key)} is not a Python identifier",
                                  field=f"parameters.{key if len(key) <= 64 else key[:60] + '...'}",
                                  reason="bad_parameter", fix="use letters, digits and _ (not starting with a digit)")
