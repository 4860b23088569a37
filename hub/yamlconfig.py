"""Load the YAML files admins edit and validate them with line-accurate errors.

``load_validated(path, schema)`` parses a YAML file while remembering the line
of every key and item, validates the result against a JSON Schema (danlu.yaml's
is generated from its options' traits, :func:`danlu.hub.config.schema`;
profiles.yaml's is written as YAML next to the code that reads it) and raises
one :class:`ConfigError` that lists every problem as ``file:line: key.path: what
is wrong (how to fix it)``. An unknown key gets the nearest allowed name and the
keys allowed there, so a typo in ``danlu.yaml`` or ``profiles.yaml`` stops
start-up with a message an admin can act on instead of being silently ignored.
"""

from __future__ import annotations

import difflib
import json
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from danlu.errors import ConfigError

Path_ = tuple  # a key path into the document: ("teams", "vision", "quota")


def load_schema(package: str, name: str) -> dict:
    """A JSON Schema stored as YAML inside a package."""
    text = resources.files(package).joinpath(name).read_text(encoding="utf-8")
    return yaml.safe_load(text)


def _construct(node: yaml.Node, path: Path_, marks: dict[Path_, int], loader: yaml.SafeLoader) -> Any:
    marks.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            marks[path + (key,)] = key_node.start_mark.line + 1
            out[key] = _construct(value_node, path + (key,), marks, loader)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(item, path + (i,), marks, loader) for i, item in enumerate(node.value)]
    return loader.construct_object(node, deep=True)


def parse_with_marks(text: str, filename: str) -> tuple[Any, dict[Path_, int]]:
    """Parse YAML text; return the data and a map from key path to line number."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{filename}:{mark.line + 1}" if mark else filename
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(
            f"{where}: not valid YAML: {problem}",
            fix="check the indentation and quoting on that line",
        ) from None
    marks: dict[Path_, int] = {}
    if node is None:
        return {}, marks
    loader = yaml.SafeLoader("")
    try:
        return _construct(node, (), marks, loader), marks
    finally:
        loader.dispose()


def _dotted(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _fix_for(error: jsonschema.ValidationError) -> str:
    schema = error.schema if isinstance(error.schema, dict) else {}
    if "x-fix" in schema:
        return schema["x-fix"]
    if error.validator == "enum":
        return "use one of: " + ", ".join(json.dumps(v) for v in error.validator_value)
    if error.validator == "required":
        return "add the missing key"
    if error.validator in {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}:
        return f"use a value within the allowed range ({error.validator} {error.validator_value})"
    if error.validator == "pattern":
        return f"it must match {error.validator_value}"
    if error.validator == "type":
        kind = error.validator_value if isinstance(error.validator_value, str) else " or ".join(error.validator_value)
        return f"use {'an' if kind[0] in 'aeiou' else 'a'} {kind}"
    return ""


def _unknown_keys(error: jsonschema.ValidationError) -> list[tuple[Path_, str, str]]:
    """(key path, message, fix) for each key an object does not allow, with the nearest allowed name."""
    allowed = sorted(error.schema.get("properties", {})) if isinstance(error.schema, dict) else []
    parent = tuple(error.absolute_path)
    owner = f"the keys of {_dotted(parent)} are" if parent else "the top-level keys are"
    out = []
    for key in (k for k in error.instance if k not in allowed):
        close = difflib.get_close_matches(str(key), allowed, n=1)
        message = f"unknown key, did you mean '{close[0]}'?" if close else "unknown key"
        fix = (
            (f"{owner} {', '.join(allowed)}" if allowed else "remove it")
            if close
            else (f"remove '{key}'; {owner} {', '.join(allowed)}" if allowed else f"remove '{key}'")
        )
        out.append((parent + (key,), message, fix))
    return out


def _problems(error: jsonschema.ValidationError) -> list[tuple[Path_, str, str]]:
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        return _unknown_keys(error)
    return [(tuple(error.absolute_path), error.message, _fix_for(error))]


def problems(errors, marks: dict[Path_, int], filename: str) -> list[tuple[str, str]]:
    """(``file:line: key.path: what is wrong``, how to fix it) for each problem, in the file's order."""
    found = [problem for error in errors for problem in _problems(error)]
    out = []
    for path, message, fix in sorted(found, key=lambda p: (marks.get(_marked(p[0], marks), 0), [str(k) for k in p[0]])):
        out.append((f"{line_of(marks, path, filename)}: {_dotted(path)}: {message}", fix))
    return out


def describe_errors(errors, marks: dict[Path_, int], filename: str) -> list[str]:
    return [f"{text} ({fix})" if fix else text for text, fix in problems(errors, marks, filename)]


def validate(data: Any, schema: dict, marks: dict[Path_, int], filename: str) -> Any:
    """Validate ``data`` against ``schema``; raise one ConfigError listing every problem."""
    validator = jsonschema.Draft202012Validator(schema)
    found = problems(validator.iter_errors(data), marks, filename)
    if len(found) == 1:
        raise ConfigError(found[0][0], fix=found[0][1] or None, reason="bad_config")
    if found:
        lines = [f"{text} ({fix})" if fix else text for text, fix in found]
        raise ConfigError(f"{filename} has {len(lines)} problems:\n  " + "\n  ".join(lines), reason="bad_config")
    return data


def load_validated(path: str | Path, schema: dict) -> tuple[Any, dict[Path_, int]]:
    """Read, parse and validate a YAML file; returns (data, marks)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found", fix="create it or point to the right file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    data, marks = parse_with_marks(text, str(path))
    if data is None:
        data = {}
    validate(data, schema, marks, str(path))
    return data, marks


def _marked(path: Path_, marks: dict[Path_, int]) -> Path_:
    """The key path itself, or its nearest parent that has a line."""
    probe = tuple(path)
    while probe and probe not in marks:
        probe = probe[:-1]
    return probe


def line_of(marks: dict[Path_, int], path: Path_, filename: str) -> str:
    """``file:line`` for a key path (or its nearest parent), for semantic errors."""
    line = marks.get(_marked(path, marks))
    return f"{filename}:{line}" if line else filename
