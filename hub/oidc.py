"""Login through an OpenID Connect provider, configured from its issuer URL, with rights that follow the provider.

``auth.type: oidc`` names :class:`DanluOIDCAuthenticator`, OAuthenticator's ``GenericOAuthenticator`` with
two additions. :func:`discover` reads the provider's endpoints from ``<issuer>/.well-known/openid-configuration``
when the hub starts, so an admin gives the issuer URL alone. And group membership follows the provider:
the groups claim becomes the user's JupyterHub groups (``manage_groups``), which are Danlu's teams and what
profiles, datasets and model approvals check, and the admin groups make hub admins. OAuthenticator
refreshes a user's groups only when that user's own request reaches the hub after ``auth_refresh_age``;
a user who works through a token the jobs service has cached, or who is idle, would keep groups the
provider took away. So every ``refresh_seconds`` :meth:`DanluOIDCAuthenticator.refresh_everyone` asks the
provider about every user with an auth state (renewing expired access tokens with their refresh tokens,
OAuthenticator's :meth:`refresh_user`) and applies the answer as a login would. A user the provider no
longer knows, or who is no longer allowed, loses their groups and admin rights and must log in again.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from jupyterhub import orm, roles
from oauthenticator.generic import GenericOAuthenticator
from tornado.ioloop import PeriodicCallback
from traitlets import Integer

from danlu.errors import ConfigError

DISCOVERY = "/.well-known/openid-configuration"
#: what the hub needs from the discovery document
ENDPOINTS = {
    "authorize_url": "authorization_endpoint",
    "token_url": "token_endpoint",
    "userdata_url": "userinfo_endpoint",
}


def discover(issuer: str, *, where: str = "auth.issuer", timeout: float = 10) -> dict:
    """The hub's endpoints and token-endpoint authentication from the issuer's discovery document.

    Returns ``authorize_url``, ``token_url``, ``userdata_url`` and ``basic_auth`` (the client's secret in
    an HTTP Basic header, when the provider does not take it in the form body). The document must name
    the same issuer (OpenID Connect Discovery 1.0, section 4.3): a proxy or a typo that serves another
    provider's document is refused.
    """
    url = issuer.rstrip("/") + DISCOVERY
    fix = f"check {where} (the provider's issuer URL; {url} must answer) and that the hub can reach it"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (http(s) by the option's pattern)
            document = json.loads(response.read(1 << 20))
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ConfigError(f"{where}: cannot read the provider's OpenID configuration at {url}: {e}", fix=fix) from e
    if not isinstance(document, dict):
        raise ConfigError(f"{where}: {url} is not an OpenID configuration (not a JSON object)", fix=fix)
    if document.get("issuer", "").rstrip("/") != issuer.rstrip("/"):
        raise ConfigError(
            f"{where}: {url} names the issuer {document.get('issuer')!r}, not {issuer!r}",
            fix=f"set {where} to exactly the issuer the provider names",
        )
    missing = [key for key in ENDPOINTS.values() if not document.get(key)]
    if missing:
        raise ConfigError(f"{where}: {url} names no {', '.join(missing)}", fix=fix)
    methods = document.get("token_endpoint_auth_methods_supported") or ["client_secret_basic"]
    out = {option: document[key] for option, key in ENDPOINTS.items()}
    out["basic_auth"] = "client_secret_post" not in methods
    return out


class DanluOIDCAuthenticator(GenericOAuthenticator):
    """GenericOAuthenticator whose groups and admin rights follow the provider within ``refresh_seconds``."""

    refresh_seconds = Integer(
        30,
        min=0,
        config=True,
        help="Every this many seconds, ask the provider about every user with an auth state and apply "
        "their groups and admin rights (0: only when their own requests reach the hub, OAuthenticator's way).",
    )

    _refresher: PeriodicCallback | None = None

    def get_handlers(self, app):
        """OAuthenticator's handlers; also starts the refresh of everyone, now that the hub's database is up."""
        if self.refresh_seconds and self.enable_auth_state and self._refresher is None:
            self._refresher = PeriodicCallback(lambda: self.refresh_everyone(app), self.refresh_seconds * 1000)
            self._refresher.start()
        return super().get_handlers(app)

    async def refresh_user(self, user, handler=None, **kwargs):
        """OAuthenticator's refresh (a new access token from the refresh token when it has expired), and
        the allow-lists checked again: a user the provider moved out of ``allowed_groups`` must log in,
        and that login is refused."""
        model = await super().refresh_user(user, handler, **kwargs)
        if isinstance(model, dict) and not await self.check_allowed(user.name, model):
            self.log.warning("%s is no longer allowed by the identity provider's groups", user.name)
            return False
        return model

    async def refresh_everyone(self, app) -> None:
        """Refresh each user with an auth state whose auth is older than ``refresh_seconds`` (module docs)."""
        now = time.monotonic()
        names = [u.name for u in app.db.query(orm.User).filter(orm.User.encrypted_auth_state.isnot(None))]
        for name in names:
            user = app.users.get(name)
            if user is None or (user._auth_refreshed and now - user._auth_refreshed < self.refresh_seconds):
                continue
            try:
                model = await self.refresh_user(user)
            except Exception as e:  # the provider unreachable: keep what the user has until it answers
                self.log.warning("could not refresh %s's groups at the identity provider: %s", name, e)
                continue
            await self.apply(app, user, model)

    async def apply(self, app, user, model) -> None:
        """Store a refresh's answer as a login does (JupyterHub's ``auth_to_user``): admin, groups, auth state.
        ``False`` (cannot refresh, or no longer allowed) takes the provider's groups and admin away and clears
        the auth state, so the user's next page asks for a login."""
        if model is True:
            user._auth_refreshed = time.monotonic()
            return
        if not model:
            self.log.warning("%s's login at the identity provider is no longer valid: removing their groups", user.name)
            model = {"admin": user.name in self.admin_users, "groups": [], "auth_state": None}
        admin = model.get("admin")
        if admin is not None and admin != user.admin:
            user.admin = admin
        roles.assign_default_roles(app.db, entity=user)
        if self.manage_groups and model.get("groups") is not None:
            user.sync_groups(model["groups"])
        await user.save_auth_state(model.get("auth_state"))
        app.db.commit()
        if model.get("auth_state") is not None:
            user._auth_refreshed = time.monotonic()
