"""Identifying a hub user in a Danlu service without blocking its event loop.

JupyterHub's ``HubOAuthenticated`` mixin identifies the caller in tornado's synchronous
``get_current_user``: on a cache miss it asks the hub's API from a background thread and
*waits* for the answer, holding the service's event loop for that round trip. With many users
(each token is looked up again once its cache entry expires, every ``cache_max_age`` seconds)
every request behind the one being identified waits with it. :class:`AsyncHubAuthenticated`
identifies the caller in ``prepare`` with JupyterHub's own asynchronous call
(``HubAuth.get_user(handler, sync=False)``, JupyterHub >= 2.4) and leaves the result where
``get_current_user`` looks first, so ``self.current_user`` never blocks. Everything else --
tokens before cookies, the scopes check, XSRF -- is JupyterHub's, unchanged.
"""

from __future__ import annotations

from jupyterhub.services.auth import HubOAuthenticated, UserNotAllowed


class AsyncHubAuthenticated(HubOAuthenticated):
    async def identify(self) -> None:
        """Look the caller up with the hub (off the loop's critical path); ``current_user`` then answers at once."""
        if hasattr(self, "_hub_auth_user_cache"):
            return
        model = await self.hub_auth.get_user(self, sync=False)
        try:
            self._hub_auth_user_cache = self.check_hub_user(model) if model else None
        except UserNotAllowed:  # as HubOAuthenticated does: no user, so the caller gets its 401/403
            self._hub_auth_user_cache = None
