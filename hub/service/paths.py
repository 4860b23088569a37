"""Paths a request names: relative paths that cannot leave their root, datasets confined on their real path.

Lexical checks first (:func:`safe_relative_path`, :func:`check_dataset`): no
``..``, nothing absolute, no encoded dots or slashes however deeply encoded, no
control characters, NUL or lone surrogates. Then, for datasets, the file
system (:func:`resolve_dataset`): the path is resolved with every symlink and
must stay inside the real path of its root, which is checked before anything
about the target is said.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import stat
from pathlib import Path
from urllib.parse import unquote

from danlu.errors import ValidationError
from danlu.hub.service.formats import show

MAX_PATH = 4096

_ENCODED = re.compile(r"%(2e|2f|5c|00)", re.I)
_CONTROL = re.compile(r"[\x01-\x1f\x7f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_DRIVE = re.compile(r"[A-Za-z]:")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_ROOTED = re.compile(r"[a-z][a-z0-9_-]*:(?!//)")


def safe_relative_path(value: str, field: str) -> str:
    """A normalized relative POSIX path that cannot leave its root, or a ValidationError.

    Refused: empty, longer than 4096 characters, NUL, backslashes, control characters, lone surrogates
    (``bad_path``); ``/``, ``~`` and drive letters (``absolute_path``); ``..`` segments and percent-encoded
    dots, slashes, backslashes or NUL, however many times encoded (``path_traversal``). Lexical only:
    :func:`resolve_dataset` checks a path on disk.
    """
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(
            f"{field} must be a non-empty relative path",
            field=field,
            reason="bad_path",
            fix="send a path relative to your home folder, such as data/train.csv or .",
        )
    if len(value) > MAX_PATH:
        raise ValidationError(
            f"{field} is longer than {MAX_PATH} characters", field=field, reason="bad_path", fix="use a shorter path"
        )
    stage = value
    while True:  # %252e%252e -> %2e%2e -> ..; each round is shorter, so this ends
        if _ENCODED.search(stage):
            raise ValidationError(
                f"{field} {show(value)} contains an encoded dot, slash or NUL",
                field=field,
                reason="path_traversal",
                fix="send the plain relative path",
            )
        decoded = unquote(stage)
        if decoded == stage:
            break
        if decoded.startswith("~") or _CONTROL.search(decoded):
            raise ValidationError(
                f"{field} {show(value)} is percent-encoded",
                field=field,
                reason="path_traversal",
                fix="send the plain relative path",
            )
        stage = decoded
    if "\x00" in value or "\\" in value:
        raise ValidationError(
            f"{field} {show(value)} contains a NUL or backslash",
            field=field,
            reason="bad_path",
            fix="separate folders with / and leave out NUL characters",
        )
    if _CONTROL.search(value):
        raise ValidationError(
            f"{field} {show(value)} contains a control character",
            field=field,
            reason="bad_path",
            fix="rename the file without tabs, newlines or other control characters",
        )
    if _SURROGATE.search(value):
        raise ValidationError(
            f"{field} {show(value)} contains a lone surrogate, which is not valid Unicode",
            field=field,
            reason="bad_path",
            fix="send the path as valid Unicode",
        )
    if value.startswith("/") or value.startswith("~") or _DRIVE.match(value):
        raise ValidationError(
            f"{field} {show(value)} is absolute; it must be relative to your home folder",
            field=field,
            reason="absolute_path",
            fix="drop the leading / or ~",
        )
    if ".." in value.split("/"):
        raise ValidationError(
            f"{field} {show(value)} leaves its folder with '..'",
            field=field,
            reason="path_traversal",
            fix="use a path inside your home folder",
        )
    return posixpath.normpath(value)


def _split_dataset(value, field: str, roots: dict) -> tuple[str | None, str]:
    """(root name or None, normalized relative path) of a dataset reference; lexical checks only."""
    if isinstance(value, str) and _URL.match(value):
        raise ValidationError(
            f"{field} {show(value)} is a URL; a dataset is a path",
            field=field,
            reason="bad_path",
            fix="copy the data under a dataset root and name it <root>:<path>",
        )
    if isinstance(value, str) and _ROOTED.match(value) and not re.match(r"[A-Za-z]:[\\/]", value):
        root, _, rest = value.partition(":")
        if root not in roots:
            known = ", ".join(sorted(roots)) or "none are configured"
            raise ValidationError(
                f"{field}: unknown dataset root '{root}'",
                field=field,
                reason="unknown_dataset_root",
                fix=f"known roots: {known}",
            )
        return root, safe_relative_path(rest, field)
    return None, safe_relative_path(value, field)


def check_dataset(value: str, field: str, roots: dict) -> str:
    """``path`` (relative to the job's cwd) or ``root:path`` under a configured dataset root, normalized.

    Lexical only (it needs no file system); :func:`resolve_dataset` also confines the path on disk.
    """
    root, rel = _split_dataset(value, field, roots)
    return rel if root is None else f"{root}:{rel}"


def _inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip(os.sep) + os.sep)


def resolve_dataset(value: str, *, workdir: Path, home: Path, roots: dict[str, Path], field: str) -> tuple[str, Path]:
    """``(name, real path)`` of a dataset that exists inside its root, after every symlink.

    ``relative/path`` is relative to ``workdir`` (the job's folder) and must stay inside ``home``;
    ``root:relative/path`` must stay inside ``roots[root]``. After the lexical checks of
    :func:`check_dataset`, the path is resolved (``os.path.realpath``) and compared with the real path of
    its root, so a symlink that points out (``home/link -> /etc``, ``shared:link-to-outside``) is refused
    (``escapes_root``) whether or not its target exists, before anything about the target is said. Then,
    with distinct messages: a path that does not exist (``no_dataset``), a symlink loop, or something that
    is neither a file nor a folder, such as a FIFO (``bad_path``). The returned path is the real one, so a
    link changed afterwards does not move the job.
    """
    root, rel = _split_dataset(value, field, roots)
    name = rel if root is None else f"{root}:{rel}"
    if root is None:
        top, base, where = home, workdir, "your home folder"
    else:
        top = base = roots[root]
        where = f"the dataset root '{root}'"
    try:
        real_top = os.path.realpath(top, strict=True)
    except (OSError, ValueError, RecursionError):
        raise ValidationError(
            f"{field}: {where} is not available on this server",
            field=field,
            reason="no_dataset",
            fix="ask an admin to check " + ("danlu.yaml's dataset roots" if root else "that your home folder exists"),
            log_message=f"{field}: {top} cannot be resolved",
        ) from None
    candidate = os.path.join(os.fspath(base), rel)
    escapes = ValidationError(
        f"{field}: dataset {show(value)} leads outside {where} once symbolic links are followed",
        field=field,
        reason="escapes_root",
        fix=f"use data inside {where}, or a dataset root",
    )
    chain = ValidationError(
        f"{field}: dataset {show(value)} goes through too many symbolic links",
        field=field,
        reason="bad_path",
        fix="point the link at the file or folder itself",
    )
    try:  # first, so a refusal says nothing about what lies outside
        if not _inside(os.path.realpath(candidate), real_top):
            raise escapes
    except RecursionError:  # posixpath.realpath recurses once per link of a chain
        raise chain from None
    try:
        real = os.path.realpath(candidate, strict=True)
        mode = os.stat(real).st_mode
    except RecursionError:
        raise chain from None
    except (FileNotFoundError, NotADirectoryError):
        raise ValidationError(
            f"{field}: dataset {show(value)} does not exist",
            field=field,
            reason="no_dataset",
            fix="paths are relative to the notebook's folder (cwd), or <root>:<path>",
        ) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValidationError(
                f"{field}: dataset {show(value)} is a loop of symbolic links",
                field=field,
                reason="bad_path",
                fix="point the link at a file or folder",
            ) from None
        if e.errno == errno.ENAMETOOLONG:
            raise ValidationError(
                f"{field}: dataset {show(value)} has a name too long for the file system",
                field=field,
                reason="bad_path",
                fix="use shorter names",
            ) from None
        raise ValidationError(
            f"{field}: dataset {show(value)} cannot be read ({e.strerror})",
            field=field,
            reason="no_dataset",
            fix="check the permissions of the path",
        ) from None
    if not _inside(real, real_top):  # a link that changed between the two looks
        raise escapes
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise ValidationError(
            f"{field}: dataset {show(value)} is neither a file nor a folder",
            field=field,
            reason="bad_path",
            fix="name a file or a folder of files",
        )
    return name, Path(real)
