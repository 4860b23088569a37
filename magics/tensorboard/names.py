"""MLflow metric names for TensorBoard tags: a tag MLflow accepts is kept, any other changed in one fixed way.

:func:`metric_key` is the rule, documented there; the forwarder
(:mod:`danlu.tensorboard.forwarder`) names every point with it and notes each
tag it had to change.
"""

from __future__ import annotations

import hashlib
import re

MAX_KEY_LENGTH = 250  # MLflow's limit on a metric name
_NAME_CHARS = re.compile(r"[/\w.\- :]*\Z")
_BAD_CHAR = re.compile(r"[^/\w.\- :]")
_SUFFIX_LENGTH = 9  # "_" and 8 hex digits


def metric_key(tag: str) -> str:
    """The MLflow metric name for a TensorBoard tag.

    A tag MLflow accepts as a metric name is used unchanged. A name is accepted
    when it has at most 250 characters, all of them letters, digits or
    underscores (any script), ``-``, ``.``, space, ``:`` or ``/``, and it is a
    plain relative path: not empty, not starting with ``/`` or ``..``, and
    with no empty, ``.`` or ``..`` part between slashes. One exception:
    MLflow also lets a single trailing newline through (its pattern ends in
    ``$``). That name is treated as invalid, because a newline cannot be seen
    in the MLflow UI.

    Any other tag is changed, always in the same way:

    1. each character not allowed above becomes ``_``;
    2. empty, ``.`` and ``..`` parts are removed, so leading, trailing and
       doubled slashes go; a name that then starts with ``..`` gets ``_`` in
       front;
    3. the result is cut to 241 characters (step 2 is applied again to the
       cut end), or is ``metric`` if nothing is left;
    4. ``_`` and the first 8 hex digits of the SHA-256 of the original tag
       (UTF-8) are appended, so two different tags do not share a name.

    For example ``a//b`` becomes ``a/b_`` plus 8 hex digits,
    ``acc@top-1 (val)`` becomes ``acc_top-1 _val_`` plus 8, and a 300-character
    tag is cut to 250 characters in all. A changed name could only equal
    another tag's if that tag were exactly the changed name, hash included.
    """
    if len(tag) <= MAX_KEY_LENGTH and _NAME_CHARS.match(tag) and _plain_path(tag):
        return tag
    body = _clean_path(_BAD_CHAR.sub("_", tag))
    body = _clean_path(body[: MAX_KEY_LENGTH - _SUFFIX_LENGTH]) or "metric"
    digest = hashlib.sha256(tag.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{body}_{digest}"


def _plain_path(name: str) -> bool:
    """What MLflow's ``path_not_unique`` lets through: a normalized relative path."""
    return (
        bool(name) and not name.startswith(("/", "..")) and all(part not in ("", ".", "..") for part in name.split("/"))
    )


def _clean_path(name: str) -> str:
    name = "/".join(part for part in name.split("/") if part not in ("", ".", ".."))
    return "_" + name if name.startswith("..") else name
