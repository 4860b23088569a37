"""Who is calling, and what they may do: JupyterHub scopes turned into checks.

Danlu defines three custom JupyterHub scopes (:mod:`danlu.hub.scopes`, loaded
by the generated hub configuration): ``custom:danlu:jobs:read`` (see jobs, logs
and outputs), ``custom:danlu:jobs`` (also submit and cancel) and
``custom:danlu:admin`` (every job and the queue's administration). Every user
holds ``custom:danlu:jobs!user`` -- their own jobs only -- and admins hold
``custom:danlu:admin``. :class:`Principal` answers "may this caller read/write
jobs owned by X" with JupyterHub's own filter logic (``check_scopes``).
Group memberships come from the hub API with the service's own token and are
cached briefly, so they are right whatever token the caller used.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from urllib.parse import quote

from jupyterhub.services.auth import check_scopes
from tornado.httpclient import AsyncHTTPClient, HTTPClientError

from danlu.errors import Forbidden
from danlu.hub.scopes import ADMIN, READ, WRITE


@dataclass(frozen=True)
class Principal:
    name: str
    kind: str  # "user" | "service"
    scopes: frozenset = field(default_factory=frozenset)
    groups: tuple = ()

    @property
    def admin(self) -> bool:
        return bool(check_scopes({ADMIN}, self.scopes))

    @property
    def is_user(self) -> bool:
        return self.kind == "user"

    def can_read(self, owner: str) -> bool:
        return self.admin or bool(check_scopes({f"{READ}!user={owner}"}, self.scopes))

    def can_write(self, owner: str) -> bool:
        return self.admin or bool(check_scopes({f"{WRITE}!user={owner}"}, self.scopes))


class GroupDirectory:
    """User -> groups, from the hub API (with the service's token), cached for ``ttl`` seconds."""

    def __init__(self, hub_auth, ttl: float = 15.0):
        self.hub_auth = hub_auth
        self.ttl = ttl
        self._cache: dict[str, tuple[float, tuple[str, ...]]] = {}

    async def user(self, username: str) -> dict | None:
        """The hub's model of a user (groups, servers and their activity), or None if unreachable."""
        url = f"{self.hub_auth.api_url}/users/{quote(username, safe='')}"
        try:
            response = await AsyncHTTPClient().fetch(
                url, headers={"Authorization": f"token {self.hub_auth.api_token}"}, request_timeout=10
            )
        except (HTTPClientError, OSError):
            return None
        try:
            model = json.loads(response.body)
        except ValueError:
            return None
        return model if isinstance(model, dict) else None

    async def exists(self, username: str) -> bool:
        """Whether the hub has a user of this name (False when the hub cannot say)."""
        return await self.user(username) is not None

    async def groups_of(self, username: str, fallback=()) -> tuple[str, ...]:
        hit = self._cache.get(username)
        if hit and time.monotonic() - hit[0] < self.ttl:
            return hit[1]
        model = await self.user(username)
        if model is None:
            return tuple(fallback)
        groups = tuple(sorted(model.get("groups") or ()))
        self._cache[username] = (time.monotonic(), groups)
        return groups

    def forget(self, username: str | None = None) -> None:
        if username is None:
            self._cache.clear()
        else:
            self._cache.pop(username, None)


ADMIN_FIX = "use an admin's token: the workbench's admin token, or one an admin makes at /hub/token"


def require_admin(principal: Principal, message: str = "this is an admin operation") -> None:
    """A 403 for anyone but an admin, saying how to become one for this call."""
    if not principal.admin:
        raise Forbidden(message, reason="not_admin", fix=ADMIN_FIX)
