"""Which Unix account a hub user's servers and jobs run as.

Two modes, set by ``users.unix_accounts`` in danlu.yaml:

``on``
    Each user's server and jobs run as the Unix account of the same name, with
    its home folder -- the file system keeps users apart, as with JupyterHub's
    ``LocalProcessSpawner``. A user without an account, or whose account is
    outside ``users.uid_min``..``uid_max`` (root and system accounts), is
    refused; and only a login that proves the account may be used with it
    (:func:`check_login`: PAM, or OAuth with ``users.account_claim``). Needs
    root, and a Danlu installation other accounts can run.
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

from danlu.errors import ConfigError, PolicyError

#: the UIDs of ordinary accounts where /etc/login.defs does not say (shadow-utils' defaults)
UID_MIN, UID_MAX = 1000, 60000
#: logins that prove the Unix account: PAM checks its password; OAuth only with users.account_claim
OAUTH_LOGINS = ("oidc", "github", "gitlab")


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


def login_defs_range(path: str = "/etc/login.defs") -> tuple[int, int]:
    """UID_MIN and UID_MAX of ``path`` (the range ``useradd`` gives ordinary accounts), else 1000..60000."""
    found = {"UID_MIN": UID_MIN, "UID_MAX": UID_MAX}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] in found and parts[1].isdigit():
                    found[parts[0]] = int(parts[1])
    except OSError:
        pass
    return found["UID_MIN"], found["UID_MAX"]


def lookup(username: str, uid_range: tuple[int, int] | None = None) -> Account:
    """The Unix account of a hub user, or a PolicyError that says what to do.

    Only accounts whose UID is in ``uid_range`` (default :func:`login_defs_range`) are ever used:
    a hub user named ``daemon`` or ``postgres`` must not become that system account.
    """
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
    low, high = uid_range or login_defs_range()
    if not low <= entry.pw_uid <= high:
        raise PolicyError(
            f"the Unix account '{username}' (UID {entry.pw_uid}) is outside the UIDs of users' accounts "
            f"({low}..{high}): Danlu never runs servers or jobs as a system account",
            reason="system_account",
            fix="log in with an ordinary account, or an admin widens users.uid_min / users.uid_max in danlu.yaml",
        )
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def check_login(auth_type: str, account_claim: str, where: str) -> None:
    """Refuse a login that does not prove the Unix account it maps to (at start, before any login).

    With Unix accounts, the hub user name *is* the account: a shared password or the dummy login
    lets anyone name any account, and an OAuth provider's user name is not a local account unless
    the admin says which claim holds it (``users.account_claim``).
    """
    if auth_type == "pam":
        return
    if auth_type in OAUTH_LOGINS:
        if account_claim:
            return
        raise ConfigError(
            f"{where}: users.unix_accounts is on with the {auth_type} login, but nothing says which of its "
            "claims is the Unix account: any user of the provider could become any local account of that name",
            reason="unix_login",
            fix="set users.account_claim to the claim that holds the account name (e.g. preferred_username "
            "from your directory), or log in with auth.type: pam, or set users.unix_accounts: off",
        )
    raise ConfigError(
        f"{where}: users.unix_accounts is on with the {auth_type} login, which proves no account: "
        "anyone could log in as any user and run as that Unix account",
        reason="unix_login",
        fix="use auth.type: pam (or oidc with users.account_claim), or set users.unix_accounts: off",
    )


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
