"""Stopping users' idle servers, from inside the jobs service: JupyterHub's idle culler without its own process.

On one machine ``hub.idle_timeout_seconds`` of danlu.yaml stops servers idle for that long. The work is
:func:`jupyterhub_idle_culler.cull_idle`, the library the hub's own ``jupyterhub-idle-culler`` service runs,
called every ``every`` seconds on the jobs service's event loop with the service's hub token (whose role
carries the culler's scopes, :data:`danlu.hub.scopes.CULLER_SCOPES`, see :func:`danlu.hub.hubconfig.roles`),
instead of as one more Python process (~30 MB) idling beside the hub. A failed pass (the hub restarting) is
logged and the next one runs as usual. On Kubernetes the chart's culler does this (``cull`` in the rendered
values), not the service (``JobsServiceApp.cull_idle_servers``).
"""

from __future__ import annotations

import asyncio
import logging


def interval(timeout: float) -> float:
    """Seconds between passes: the culler's default minute, sooner for a timeout under four minutes."""
    return max(5.0, min(60.0, timeout / 4))


async def cull_forever(
    api_url: str, token: str, timeout: float, log: logging.Logger, every: float | None = None
) -> None:
    """Stop servers idle for ``timeout`` seconds, a pass every ``every`` seconds, until cancelled."""
    # deferred: only a service that culls imports the culler (and its dateutil)
    from jupyterhub_idle_culler import cull_idle

    every = interval(timeout) if every is None else every
    log.info("stopping servers idle for %ss (a pass every %ss)", int(timeout), int(every))
    while True:
        await asyncio.sleep(every)
        try:
            await cull_idle(api_url, token, int(timeout), log)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the next pass tries again
            log.warning("idle-server pass failed: %s", e)
