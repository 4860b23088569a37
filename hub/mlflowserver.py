"""``python -m danlu.hub.mlflowserver ARGS``: ``mlflow server ARGS`` as one process, without what Danlu never uses.

``mlflow server`` (MLflow 3) is a launcher: it imports all of MLflow, prepares the stores and
the basic-auth app, then starts uvicorn as a child and waits for it, keeping its own ~250 MB
resident for nothing. Unless told otherwise it also starts MLflow's job-execution machinery (a
job runner and seven huey consumers, another ~1.7 GB) for MLflow's GenAI scorers and judges,
which Danlu does not use. This entry point runs MLflow's own CLI, unchanged, with two
differences:

* it holds no token it does not need: :func:`server_environ` drops the hub's and the proxy's
  tokens (JupyterHub's API token, Danlu's admin token, configurable-http-proxy's) from the
  environment ``danlu up`` or a Deployment gives it, before MLflow is imported, so neither
  MLflow nor any code it runs can act as the hub's admin;
* job execution is off (``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``) unless the environment
  that starts the workbench sets that variable itself;
* the launcher *becomes* the server: where MLflow would start the server command as a child,
  this process replaces itself with it (``exec``), so the process ``danlu up`` (or a cluster's
  Deployment) started is the uvicorn server, and its memory is the server's alone.

The replacement hooks ``mlflow.server._exec_cmd``, the one call through which MLflow starts
the server; if a future MLflow renames it, the launcher says so in the log and runs MLflow as
it is (two processes), rather than failing.
"""

from __future__ import annotations

import logging
import os
import sys

from danlu import env

JOB_EXECUTION = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"
#: variables of the hub, its proxy and its clients: their tokens, never the MLflow server's business
FOREIGN_PREFIXES = ("JUPYTERHUB_", "JPY_", "CONFIGPROXY_")
FOREIGN = frozenset({"MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"})
#: the one secret of Danlu's the server needs (its basic-auth check, :mod:`danlu.hub.mlflow_auth`)
KEPT = frozenset({str(env.MLFLOW_AUTH_SECRET)})

log = logging.getLogger("danlu.mlflowserver")


def server_environ(environ) -> dict:
    """``environ`` without the tokens the MLflow server has no use for.

    Dropped: every ``JUPYTERHUB_*``, ``JPY_*`` and ``CONFIGPROXY_*`` variable (the hub's API
    token and crypt key, the proxy's auth token), MLflow's client credentials
    (``MLFLOW_TRACKING_TOKEN``, ``_USERNAME``, ``_PASSWORD``), and every ``DANLU_*`` variable
    whose name ends in ``_TOKEN``, ``_KEY`` or ``_SECRET`` (the admin token among them) except
    the MLflow auth secret.
    The artifact store's own credentials (``AWS_*``, ``GOOGLE_*``, ``AZURE_*``) stay.
    """

    def foreign(name: str) -> bool:
        if name in KEPT:
            return False
        if name in FOREIGN or name.startswith(FOREIGN_PREFIXES):
            return True
        return name.startswith("DANLU_") and name.endswith(("_TOKEN", "_KEY", "_SECRET"))

    return {name: value for name, value in environ.items() if not foreign(name)}


def _become(cmd, extra_env=None, **_ignored):
    """What ``mlflow server`` would start as its child, in place of this process."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], list(cmd), {**os.environ, **(extra_env or {})})


def main(argv: list[str] | None = None) -> None:
    for name in set(os.environ) - set(server_environ(os.environ)):
        del os.environ[name]
    os.environ.setdefault(JOB_EXECUTION, "false")
    import mlflow.server  # deferred: MLflow (~2 s) after JOB_EXECUTION is set, which it reads at import
    from mlflow.cli import cli  # deferred: as mlflow.server above

    if callable(getattr(mlflow.server, "_exec_cmd", None)):
        mlflow.server._exec_cmd = _become
    else:  # pragma: no cover - a future MLflow
        logging.basicConfig()
        log.warning(
            "mlflow.server._exec_cmd is gone in MLflow %s: the server runs as a child of its launcher",
            mlflow.__version__,
        )
    cli.main(["server", *(sys.argv[1:] if argv is None else argv)], prog_name="mlflow")


if __name__ == "__main__":
    main()
