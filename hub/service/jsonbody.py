"""A request body as JSON that is safe to keep: one pass over the raw bytes, every bound checked.

:func:`parse_json` turns the raw body into a value: UTF-8, valid JSON, at most :data:`MAX_BODY` bytes, nested
at most :data:`MAX_DEPTH` deep, no ``NaN``/``Infinity``, no lone surrogate and no NUL in any string or key.
Each refusal is a :class:`~danlu.errors.UsageError` (400) whose message names the JSON path of what it refuses
and the fix. The walk is iterative (a deep body cannot exhaust the stack) and checks a string only where an
escape could have hidden something in it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from danlu.errors import UsageError

MAX_BODY = 64 * 2**20
MAX_DEPTH = 64


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
        return _body_error(
            f"has a NUL character (\\u0000) {where}, character {at}",
            "remove NUL characters: text fields cannot hold them",
            "nul_character",
        )
    return _body_error(
        f"has a lone surrogate (\\u{ord(s[at]):04x}) {where}, character {at}",
        "send valid Unicode: every \\ud800-\\udbff escape needs a \\udc00-\\udfff after it",
        "bad_unicode",
    )


def _number_error(value: float, where: str) -> UsageError:
    if type(value) is _Constant:
        word = "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
        return _body_error(f"has {word} {where}", "JSON numbers are finite: send a number or null", "non_finite_number")
    return _body_error(
        f"has a number too large for a double {where}", "send a number of magnitude below 1.7e308", "non_finite_number"
    )


def _too_deep(max_depth: int, where: str = "") -> UsageError:
    return _body_error(
        f"nests arrays and objects deeper than {max_depth} levels{where}",
        f"send at most {max_depth} levels of nesting",
        "too_deep",
    )


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
    stack: list[tuple[Any, tuple, bool]] = [
        (iter(value.items()) if kind is dict else enumerate(value), (None, None, 1), kind is dict)
    ]
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
                    stack.append(
                        (iter(child.items()) if kind is dict else enumerate(child), (frame, key, depth), kind is dict)
                    )
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
            raise _body_error(
                "is not valid JSON",
                f"character {e.start} is a lone surrogate: send UTF-8 text",
                "malformed_json",
                log_message="body given as str with a lone surrogate",
            ) from None
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise TypeError(f"parse_json takes the raw body as bytes, not {type(raw).__name__}")
    raw = bytes(raw)  # no copy when it already is
    if len(raw) > max_bytes:
        amount = f"{max_bytes // 2**20} MiB" if max_bytes % 2**20 == 0 else f"{max_bytes} bytes"
        raise _body_error(
            f"is larger than {amount}",
            "send less: large data belongs in a dataset, not in the request",
            "too_large",
            status=413,
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise _body_error(
            "is not valid JSON",
            f"byte 0x{raw[e.start]:02x} at line {line} column {column} is not UTF-8: send the body UTF-8 encoded",
            "malformed_json",
        ) from None
    text = text.removeprefix("\ufeff")  # a UTF-8 byte order mark, which RFC 8259 lets a parser ignore
    try:
        value = _DECODER.decode(text)
    except json.JSONDecodeError as e:
        raise _body_error(
            f"is not valid JSON at line {e.lineno} column {e.colno}",
            f"{e.msg.removesuffix(' at').lower()}: send a JSON object with Content-Type: application/json",
            "malformed_json",
        ) from None
    except RecursionError:  # json's C scanner stops near sys.getrecursionlimit() levels
        raise _too_deep(max_depth) from None
    except ValueError as e:  # an integer of more than sys.get_int_max_str_digits() digits
        raise _body_error(
            "has a number with too many digits",
            "send numbers of at most 4300 digits",
            "number_out_of_range",
            log_message=f"body: {str(e)[:200]}",
        ) from None
    _check_tree(value, max_depth, _RISKY_ESCAPE.search(text) is not None)
    return value
