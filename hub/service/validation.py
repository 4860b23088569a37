"""Request validation against the OpenAPI document, plus the checks a schema cannot say.

The OpenAPI document (``openapi.yaml``) is the contract: request bodies are
validated against its component schemas here, so a field the document does not
list is refused (422, ``field`` named). On top of that: every path-like field
(``cwd``, ``datasets[i]``, ``source.notebook_path``) must be a relative path
that stays inside its root (no ``..``, no absolute path, no percent-encoded
escape, no backslash or NUL), and the notebook must be valid nbformat 4.
"""

from __future__ import annotations

import functools
import json
import keyword
import posixpath
import re
from importlib import resources
from typing import Any
from urllib.parse import unquote

import jsonschema
import yaml

from danlu.errors import UsageError, ValidationError


@functools.cache
def openapi() -> dict:
    text = resources.files("danlu.hub.service").joinpath("openapi.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


@functools.cache
def _validator(name: str) -> jsonschema.Draft202012Validator:
    doc = openapi()
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema)


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
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out or "body"


def _message_of(error: jsonschema.ValidationError, field: str) -> str:
    if error.validator == "additionalProperties":
        return f"unknown field '{field}'"
    if error.validator == "required":
        return f"missing required field '{field}'"
    if error.validator in ("minimum", "exclusiveMinimum"):
        return f"{field} must be at least {error.validator_value}, got {error.instance!r}"
    if error.validator in ("maximum", "exclusiveMaximum"):
        return f"{field} must be at most {error.validator_value}, got {error.instance!r}"
    if error.validator == "type":
        return f"{field} must be of type {error.validator_value}, got {type(error.instance).__name__}"
    if error.validator == "pattern":
        return f"{field} {error.instance!r} does not match {error.validator_value}"
    return f"{field}: {error.message}"


def check_schema(name: str, body: Any) -> None:
    """Validate ``body`` against ``components.schemas[name]``; raise on the first problem."""
    errors = sorted(_validator(name).iter_errors(body), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        # additionalProperties before the rest so an unknown field is named even if other things are wrong
        errors.sort(key=lambda e: e.validator != "additionalProperties")
        error = errors[0]
        field = _field_of(error)
        raise ValidationError(_message_of(error, field), field=field, reason="invalid_field")


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise UsageError(f"the request body is not valid JSON{where}", field="body", reason="malformed_json",
                         fix="send a JSON object with Content-Type: application/json") from None


_ENCODED = re.compile(r"%(2e|2f|5c|00)", re.I)


def safe_relative_path(value: str, field: str) -> str:
    """A normalized relative POSIX path that cannot leave its root, or a ValidationError."""
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(f"{field} must be a non-empty relative path", field=field, reason="bad_path")
    stage = value
    for _ in range(3):  # %252e%252e -> %2e%2e -> ..
        if _ENCODED.search(stage):
            raise ValidationError(f"{field} {value!r} contains an encoded dot, slash or NUL", field=field,
                                  reason="path_traversal", fix="send the plain relative path")
        decoded = unquote(stage)
        if decoded == stage:
            break
        stage = decoded
    if "\x00" in value or "\\" in value:
        raise ValidationError(f"{field} {value!r} contains a NUL or backslash", field=field, reason="bad_path")
    if value.startswith("/") or value.startswith("~") or re.match(r"^[A-Za-z]:", value):
        raise ValidationError(f"{field} {value!r} is absolute; it must be relative to your home folder",
                              field=field, reason="absolute_path", fix="drop the leading / or ~")
    parts = value.split("/")
    if ".." in parts:
        raise ValidationError(f"{field} {value!r} leaves its folder with '..'", field=field, reason="path_traversal",
                              fix="use a path inside your home folder")
    return posixpath.normpath(value)


def check_dataset(value: str, field: str, roots: dict) -> str:
    """``path`` (relative to the job's cwd) or ``root:path`` under a configured dataset root."""
    is_rooted = isinstance(value, str) and re.match(r"^[a-z][a-z0-9_-]*:(?!//)", value)
    if is_rooted and not re.match(r"^[A-Za-z]:[\\/]", value):
        root, _, rest = value.partition(":")
        if root not in roots:
            known = ", ".join(sorted(roots)) or "none are configured"
            raise ValidationError(f"{field}: unknown dataset root '{root}'", field=field, reason="unknown_dataset_root",
                                  fix=f"known roots: {known}")
        return f"{root}:{safe_relative_path(rest, field)}"
    return safe_relative_path(value, field)


def check_notebook(nb: dict) -> Any:
    import nbformat

    if nb.get("nbformat") != 4:
        raise ValidationError("notebook must be an nbformat 4 notebook (nbformat: 4)", field="notebook",
                              reason="bad_notebook")
    if not isinstance(nb.get("cells"), list) or not all(isinstance(c, dict) for c in nb["cells"]) \
            or not isinstance(nb.get("metadata", {}), dict):
        raise ValidationError("notebook.cells must be a list of cell objects and notebook.metadata an object",
                              field="notebook", reason="bad_notebook")
    try:
        node = nbformat.from_dict(nb)
        nbformat.validate(node)
    except (TypeError, AttributeError, KeyError) as e:
        raise ValidationError(f"notebook is not valid nbformat: {e}", field="notebook", reason="bad_notebook") from None
    except nbformat.ValidationError as e:
        raise ValidationError(f"notebook is not valid nbformat: {e.message}", field="notebook",
                              reason="bad_notebook") from None
    if not any(c.get("cell_type") == "code" for c in nb.get("cells", [])):
        raise ValidationError("notebook has no code cell to run", field="notebook", reason="empty_notebook")
    return node


def check_size(value, field: str) -> float:
    """Bytes from a size (``8G``, ``512M``) or a number; a ValidationError naming the field otherwise."""
    from danlu.hub.config import parse_size

    try:
        size = parse_size(value)
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValidationError(f"{field}: {value!r} is not a size", field=field, fix="write 512M, 8G or 1T") from None
    if size < 0:
        raise ValidationError(f"{field} must not be negative", field=field)
    return size


@functools.cache
def _team_schema() -> jsonschema.Draft202012Validator:
    from danlu.hub.config import schema

    full = schema()
    change = {"type": "object", "additionalProperties": False, "minProperties": 1,
              "properties": {k: {"$ref": "#/$defs/amounts"} for k in ("quota", "borrowing_limit", "lending_limit")}}
    return jsonschema.Draft202012Validator({**change, "$defs": full["$defs"]})


def check_team_change(changes, flavors) -> None:
    """A live change of a team's quota or limits: the shape of danlu.yaml's teams, known GPU flavors."""
    errors = sorted(_team_schema().iter_errors(changes), key=lambda e: list(e.absolute_path))
    if errors:
        error = errors[0]
        field = _field_of(error)
        raise ValidationError(_message_of(error, field), field=field, reason="invalid_field")
    for section, amounts in changes.items():
        for flavor in (amounts.get("gpus") or {}):
            if flavor not in flavors:
                raise ValidationError(f"{section}.gpus.{flavor}: no GPUs of that flavor here",
                                      field=f"{section}.gpus.{flavor}", fix=f"flavors: {', '.join(flavors)}")


def check_parameters(params: dict) -> None:
    for key in params:
        if not key.isidentifier() or keyword.iskeyword(key):
            raise ValidationError(f"parameter name {key!r} is not a Python identifier", field=f"parameters.{key}",
                                  reason="bad_parameter", fix="use letters, digits and _ (not starting with a digit)")
