"""What every client command of ``danlu`` shares: the ``--url`` and ``--token`` options, and the client they make.

The command modules (:mod:`danlu.cli`, :mod:`danlu.jobs_cli`,
:mod:`danlu.datasets_cli`, :mod:`danlu.models_cli`) reach the jobs service
only through :func:`client`, a :class:`~danlu.client.DanluClient` for the
workbench the options name (by default ``$DANLU_URL`` and the user's token).
"""

from __future__ import annotations


def add_client_args(parser) -> None:
    """``--url`` and ``--token`` on a command's parser."""
    parser.add_argument("--url", help="workbench URL (default $DANLU_URL or http://127.0.0.1:8000)")
    parser.add_argument("--token", help="JupyterHub API token (default $DANLU_TOKEN or $JUPYTERHUB_API_TOKEN)")


def client(args):
    """The jobs-API client for a command's ``--url`` and ``--token``."""
    from danlu.client import DanluClient  # deferred: requests takes ~75 ms; danlu up, render and --help need none

    return DanluClient(url=args.url, token=args.token)
