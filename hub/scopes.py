"""Danlu's custom JupyterHub scopes, named once.

The generated hub configuration loads them (``c.JupyterHub.custom_scopes``)
and gives them to roles; the jobs service checks them
(:mod:`danlu.hub.service.auth`). ``custom:danlu:jobs!user`` -- a user's own
jobs -- is every user's; ``custom:danlu:admin`` is the admins'.
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
