"""Which Unix account a hub user's servers and jobs run as.

Two modes, set by ``users.unix_accounts`` in danlu.yaml:

``on``
    Each user's server and jobs run as the Unix account of the same name, with
    its home folder -- the file system keeps users apart, as with JupyterHub's
    ``LocalProcessSpawner``. A user without an account (or root) is refused.
    Needs root, and a Danlu installation other accounts can run.
``auto`` (the default)
    ``on`` when ``danlu up`` runs as root and other accounts can run its Python
    (see :func:`runnable_by_others`), else ``off``.
``off``
    Everything runs as the account that runs ``danlu up``; each user gets a
    home folder under ``<state-dir>/users/``. Users are kept apart by the hub
    and the jobs API, not by the file system: fit for one person, or a team
    that trusts each other.

:func:`demote` is the ``preexec_fn`` that drops to an account before a
server or job runner starts.
"""

from __future__ import annotations

import os
import pwd
import sys
from dataclasses import dataclass
from pathlib import Path

from danlu.errors import PolicyError


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    home: str

    def to_dict(self) -> dict:
        return {"name": self.name, "uid": self.uid, "gid": self.gid, "home": self.home}


def runnable_by_others(path: str | None = None) -> bool:
    """Whether an ordinary account can execute this Python (every folder on the way searchable)."""
    real = Path(os.path.realpath(path or sys.executable))
    paths = [real, *real.parents]
    venv = Path(path or sys.executable).parent
    paths += [venv, *venv.parents]
    for p in paths:
        try:
            mode = p.stat().st_mode
        except OSError:
            return False
        if not mode & 0o001:  # o+x: search for folders, execute for the binary
            return False
    return True


def enabled(mode: str) -> bool:
    """Resolve ``auto``/``on``/``off`` in this process."""
    if mode == "auto":
        return os.geteuid() == 0 and runnable_by_others()
    return mode == "on"


def lookup(username: str) -> Account:
    """The Unix account of a hub user, or a PolicyError that says what to do."""
    try:
        entry = pwd.getpwnam(username)
    except KeyError:
        raise PolicyError(
            f"there is no Unix account named '{username}' on this machine",
            reason="no_unix_account",
            fix=f"an admin creates it (useradd -m -K HOME_MODE=0700 {username}), or sets users.unix_accounts: off",
        ) from None
    if entry.pw_uid == 0:
        raise PolicyError(
            f"'{username}' is the root account; Danlu does not run servers or jobs as root",
            reason="root_account",
            fix="log in with an ordinary account",
        )
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def demote(account: Account):
    """A ``preexec_fn`` that becomes ``account`` (groups, gid, then uid) in the child."""

    def preexec():
        os.setgid(account.gid)
        try:
            os.initgroups(account.name, account.gid)
        except OSError:
            os.setgroups([account.gid])
        os.setuid(account.uid)

    return preexec


def give(path: Path, account: Account | None, mode: int | None = None) -> None:
    """Hand a file or folder to the account (no-op in shared-account mode)."""
    if account is not None:
        os.chown(path, account.uid, account.gid)
    if mode is not None:
        os.chmod(path, mode)
