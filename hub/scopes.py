"""Danlu's custom JupyterHub scopes, and the hub scopes its services need, named once.

The generated hub configuration loads them (``c.JupyterHub.custom_scopes``)
and gives them to roles; the jobs service checks them
(:mod:`danlu.hub.service.auth`). ``custom:danlu:jobs!user`` -- a user's own
jobs -- is every user's; ``custom:danlu:admin`` is the admins'.
:data:`CULLER_SCOPES` are what the jobs service's idle-server pass needs
(:mod:`danlu.hub.service.culling`).
"""

from __future__ import annotations

READ = "custom:danlu:jobs:read"
WRITE = "custom:danlu:jobs"
ADMIN = "custom:danlu:admin"

CUSTOM_SCOPES = {
    READ: {"description": "See Danlu jobs, their logs and outputs."},
    WRITE: {"description": "Submit and cancel Danlu jobs.", "subscopes": [READ]},
    ADMIN: {"description": "Operate the Danlu queue: every job, GPU allocations, quotas.", "subscopes": [WRITE]},
}

#: The hub scopes a pass of the idle culler needs (jupyterhub-idle-culler's README), granted to the jobs service.
CULLER_SCOPES = ("list:users", "read:users:activity", "read:servers", "delete:servers")
