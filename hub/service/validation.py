"""Request validation: the OpenAPI contract, plus every bound a schema cannot say.

The OpenAPI document (``openapi.yaml``) is the contract: request bodies are validated against its component
schemas here, so a field the document does not list is refused (422, ``field`` named); before that,
:func:`~.jsonbody.parse_json` has made the raw body a value that is safe to keep. Query parameters are read
by :func:`int_param` (bounded whole numbers), :func:`parse_time` and :func:`time_range` (ISO 8601,
1970-01-01..9999-12-30, naive UTC). Sizes go through :func:`check_size` (finite, 0..2**60 bytes). Path-like
fields are :mod:`.paths`'s. The notebook must be valid nbformat 4. These are pure functions; each refusal is
a :class:`~danlu.errors.UsageError` (400) or :class:`~danlu.errors.ValidationError` (422) naming the field
and the fix.
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
from danlu.hub.service.jsonbody import MAX_BODY

#: how usage reports may be grouped (``GET /usage?by=``)
USAGE_GROUPINGS = ("user", "team", "queue", "profile")
#: an executed notebook a runner hands over (the same bound as a submitted one)
MAX_OUTPUT = MAX_BODY
MAX_SIZE = 2**60
#: the most bytes of JSON one job parameter's value may take, and all of them together
MAX_PARAMETER = 16 * 1024
MAX_PARAMETERS = 64 * 1024
MAX_SAFE_INT = 2**53 - 1  # the largest integer every JSON client (JavaScript included) reads exactly
EARLIEST = dt.datetime(1970, 1, 1)
LATEST = dt.datetime(9999, 12, 30, 23, 59, 59, 999999)  # a day short of datetime.max: end + 1 day still works


@functools.cache
def openapi() -> dict:
    text = resources.files("danlu.hub.service").joinpath("openapi.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


# "integer" means an int: jsonschema also takes 2.0 and 1e300, which would reach range() and the database
_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool)
    ),
)


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
        raise ValidationError(_message_of(error, field), field=field, reason="invalid_field", fix=_fix_of(error, field))


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
        raise UsageError(
            f"query parameter {field} must be {allowed}, got {show(raw)}",
            field=field,
            reason="bad_query",
            fix=f"e.g. {field}={minimum if default is None else default}",
        )
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
    out_of_range = UsageError(
        f"query parameter {field} must be between 1970-01-01 and 9999-12-30, got {show(raw)}",
        field=field,
        reason="bad_time",
        fix=fix,
    )
    try:
        if not isinstance(raw, str) or len(raw) > 64:
            raise ValueError(raw)
        value = dt.datetime.fromisoformat(raw[:-1] + "Z" if raw.endswith("z") else raw)  # RFC 3339 allows z
    except ValueError:
        raise UsageError(
            f"query parameter {field} must be an ISO 8601 date or time, got {show(raw)}",
            field=field,
            reason="bad_time",
            fix=fix,
        ) from None
    if value.tzinfo is not None:
        try:
            value = value.astimezone(dt.timezone.utc).replace(tzinfo=None)
        except OverflowError:  # 0001-01-01T00:00+01:00 is before datetime.min in UTC
            raise out_of_range from None
    if not EARLIEST <= value <= LATEST:
        raise out_of_range
    return value


def time_range(
    raw_from: str | None,
    raw_to: str | None,
    default_days: int = 30,
    max_days: int = 3660,
    *,
    now: dt.datetime | None = None,
) -> tuple[dt.datetime, dt.datetime]:
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
        raise UsageError(
            f"from ({start.isoformat()}) must be before to ({end.isoformat()})",
            field="from",
            reason="bad_time_range",
            fix="e.g. from=2026-10-01&to=2026-11-01",
        )
    if end - start > dt.timedelta(days=max_days):
        raise UsageError(
            f"from..to spans {(end - start).days} days, more than {max_days}",
            field="from",
            reason="bad_time_range",
            fix=f"ask for at most {max_days} days at a time",
        )
    return start, end


_SIZE_TEXT = re.compile(
    r"\s*(-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]{1,4})?)\s*"
    r"(?:([KMGTkmgt])i?)?B?\s*\Z"
)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def check_nodes(resources: dict, *, multi_node: bool) -> None:
    """``resources.nodes``: more than one only where the backend has nodes; the job's GPUs split evenly."""
    nodes = resources["nodes"]
    if nodes > 1 and not multi_node:
        raise ValidationError(
            f"resources.nodes: this workbench runs jobs on one machine, {nodes} nodes asked",
            field="resources.nodes",
            reason="one_machine",
            fix="leave nodes out (or 1); more nodes need the Kubernetes backend",
        )
    if nodes > 1 and resources.get("gpus", 0) % nodes:
        raise ValidationError(
            f"resources.gpus: {resources['gpus']} GPUs do not split evenly over {nodes} nodes",
            field="resources.gpus",
            reason="uneven_gpus",
            fix=f"ask for a multiple of {nodes} GPUs (the same on every node)",
        )


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
        raise ValidationError(
            f"{field} must be a finite number of bytes, got {value}", field=field, reason="bad_size", fix=fix
        )
    if size < 0:
        raise ValidationError(f"{field} must not be negative", field=field, reason="bad_size", fix=fix)
    if size > MAX_SIZE:
        raise ValidationError(
            f"{field}: {show(value)} is more than 2**60 bytes (1 EiB)", field=field, reason="bad_size", fix=fix
        )
    return abs(size)  # -0 is 0


def warm() -> None:
    """Build what a first submission would otherwise build on the event loop: the JobSubmission validator and
    nbformat's (its schema read, its validator compiled; about 0.2 s of CPU, once per process)."""
    check_schema("JobSubmission", {"notebook": {}})
    check_notebook(
        {
            "nbformat": 4,
            "nbformat_minor": 5,
            "metadata": {},
            "cells": [
                {
                    "cell_type": "code",
                    "id": "warm",
                    "metadata": {},
                    "source": "",
                    "outputs": [],
                    "execution_count": None,
                }
            ],
        }
    )


def check_notebook(nb: dict) -> Any:

    if nb.get("nbformat") != 4:
        raise ValidationError(
            "notebook must be an nbformat 4 notebook (nbformat: 4)",
            field="notebook",
            reason="bad_notebook",
            fix="save it with Jupyter 4 or later, or convert it with jupyter nbconvert --to notebook",
        )
    if (
        not isinstance(nb.get("cells"), list)
        or not all(isinstance(c, dict) for c in nb["cells"])
        or not isinstance(nb.get("metadata", {}), dict)
    ):
        raise ValidationError(
            "notebook.cells must be a list of cell objects and notebook.metadata an object",
            field="notebook",
            reason="bad_notebook",
            fix="send the .ipynb file's JSON as it is",
        )
    fix = "send the .ipynb file's JSON as Jupyter saved it (jupyter nbconvert --to notebook repairs most)"
    try:
        node = nbformat.from_dict(nb)
        nbformat.validate(node)
    except (TypeError, AttributeError, KeyError) as e:
        raise ValidationError(
            f"notebook is not valid nbformat: {short(str(e))}", field="notebook", reason="bad_notebook", fix=fix
        ) from None
    except nbformat.ValidationError as e:
        raise ValidationError(
            f"notebook is not valid nbformat: {short(e.message)}", field="notebook", reason="bad_notebook", fix=fix
        ) from None
    if not any(c.get("cell_type") == "code" for c in nb.get("cells", [])):
        raise ValidationError(
            "notebook has no code cell to run",
            field="notebook",
            reason="empty_notebook",
            fix="add the code to run to a code cell",
        )
    return node


@functools.cache
def _team_schema() -> jsonschema.Draft202012Validator:

    full = schema()
    change = {
        "type": "object",
        "additionalProperties": False,
        "minProperties": 1,
        "properties": {k: {"$ref": "#/$defs/amounts"} for k in ("quota", "borrowing_limit", "lending_limit")},
    }
    return _Validator({**change, "$defs": full["$defs"]})


def check_team_change(changes, flavors) -> None:
    """A live change of a team's quota or limits: the shape of danlu.yaml's teams, known GPU flavors."""
    errors = sorted(_team_schema().iter_errors(changes), key=lambda e: list(e.absolute_path))
    if errors:
        error = errors[0]
        field = _field_of(error)
        raise ValidationError(_message_of(error, field), field=field, reason="invalid_field", fix=_fix_of(error, field))
    for section, amounts in changes.items():
        for flavor in amounts.get("gpus") or {}:
            if flavor not in flavors:
                raise ValidationError(
                    f"{section}.gpus.{flavor}: no GPUs of that flavor here",
                    field=f"{section}.gpus.{flavor}",
                    fix=f"flavors: {', '.join(flavors)}",
                )
        if "memory" in amounts:
            check_size(amounts["memory"], f"{section}.memory")


def check_parameters(params: dict) -> None:
    """Names that are Python identifiers, and values of bounded size: a parameter is injected into the notebook
    and kept in the job's row and every view of it, so at most :data:`MAX_PARAMETER` bytes of JSON each and
    :data:`MAX_PARAMETERS` together (data belongs in a dataset)."""
    total = 0
    for key, value in params.items():
        field = f"parameters.{key if len(key) <= 64 else key[:60] + '...'}"
        if not key.isidentifier() or keyword.iskeyword(key):
            raise ValidationError(
                f"parameter name {show(key)} is not a Python identifier",
                field=field,
                reason="bad_parameter",
                fix="use letters, digits and _ (not starting with a digit)",
            )
        size = len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        if size > MAX_PARAMETER:
            raise ValidationError(
                f"parameter {key[:64]} is {size} bytes as JSON, over the limit of {MAX_PARAMETER} bytes a value",
                field=field,
                reason="too_large",
                fix="pass large values as a dataset (or a file) and give the job its name",
            )
        total += size + len(key)
        if total > MAX_PARAMETERS:
            raise ValidationError(
                f"parameters are over {MAX_PARAMETERS} bytes together (as JSON), at parameter {key[:64]}",
                field=field,
                reason="too_large",
                fix="pass fewer or smaller parameters; large values belong in a dataset",
            )
