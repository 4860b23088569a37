"""``python -m danlu.hub.mlflowserver ARGS``: ``mlflow server ARGS`` as one process, without what Danlu never uses.

``mlflow server`` (MLflow 3) is a launcher: it imports all of MLflow, prepares the stores and
the basic-auth app, then starts uvicorn as a child and waits for it, keeping its own ~250 MB
resident for nothing. Unless told otherwise it also starts MLflow's job-execution machinery (a
job runner and seven huey consumers, another ~1.7 GB) for MLflow's GenAI scorers and judges,
which Danlu does not use. This entry point runs MLflow's own CLI, unchanged, with these
differences:

* it holds no token it does not need: :func:`server_environ` drops the hub's and the proxy's
  tokens (JupyterHub's API token, Danlu's admin token, configurable-http-proxy's) from the
  environment ``danlu up`` or a Deployment gives it, before MLflow is imported, so neither
  MLflow nor any code it runs can act as the hub's admin;
* job execution is off (``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``) unless the environment
  that starts the workbench sets that variable itself;
* the launcher *becomes* the server: where MLflow would start the server command as a child,
  this process replaces itself with it (``exec``), so the process ``danlu up`` (or a cluster's
  Deployment) started is the uvicorn server, and its memory is the server's alone;
* the basic-auth app is served inside :class:`Rules` (:func:`create_app`): every caller but the
  jobs service's own account is held to the gateway's allow-list and name-space rule
  (:mod:`danlu.hub.mlflow_routes`), so a job, whose runner and kernels hold their owner's MLflow
  credentials and reach this server directly (its loopback port, on a cluster its Service),
  cannot call the AI gateway, webhooks or registry writes, nor create ``alice/...`` as bob.

The replacement hooks ``mlflow.server._exec_cmd``, the one call through which MLflow starts
the server; if a future MLflow renames it, the launcher says so in the log and runs MLflow as
it is (two processes), rather than failing. :class:`Rules` hooks ``mlflow.server._find_app``,
where ``--app-name basic-auth`` becomes the app uvicorn serves; without it the server does not
start (it would run without the rules).
"""

from __future__ import annotations

import json
import logging
import os
import sys

from danlu import env
from danlu.hub import mlflow_routes
from danlu.hub.mlflow_auth import SERVICE_ACCOUNT

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


# the rules, in the server ----------------------------------------------------------------------
#: MLflow's entry point of ``--app-name basic-auth``, and ours that serves it inside :class:`Rules`
BASIC_AUTH, RULED = "basic-auth", "danlu.hub.mlflowserver:create_app"


def claimed_user(headers) -> str | None:
    """The MLflow user name a request's ``Authorization`` header claims, read as MLflow reads it.

    Werkzeug's parser is the one Flask's ``request.authorization`` (MLflow's basic auth, and
    :func:`danlu.hub.mlflow_auth.authenticate`) uses, so the name here is the name MLflow then
    authenticates. None without exactly one Basic header (two could be read two ways).
    """
    from werkzeug.datastructures import Authorization  # deferred: the MLflow server's process has werkzeug

    values = [value for name, value in headers if name.lower() == b"authorization"]
    if len(values) != 1:
        return None
    auth = Authorization.from_header(values[0].decode("latin-1"))
    return auth.username if auth is not None and auth.type == "basic" and auth.username else None


def _mlflow_admin(name: str) -> bool:
    """Whether MLflow's user store has ``name`` as an admin (the hub's admins are, mlflow_auth)."""
    from mlflow.server.auth import store  # deferred: MLflow's auth store, set up by its create_app

    try:
        return bool(store.get_user(name).is_admin)
    except Exception:  # no such user, or the store failing: no exemption
        return False


class Rules:
    """ASGI middleware around MLflow's app: :mod:`danlu.hub.mlflow_routes` for every caller but the service.

    Requests that claim :data:`~danlu.hub.mlflow_auth.SERVICE_ACCOUNT` pass as they are (the jobs
    service registers models and manages MLflow's users; the gateway creates users). Every other
    request, with or without credentials, is decided as the gateway decides: a route refused on
    purpose is a JSON 403 naming it, an unknown one a 404; an experiment create or rename is read
    (at most :data:`~danlu.hub.mlflow_routes.MAX_NAMING_BODY` bytes) and refused with 403
    ``experiment_not_yours`` when it names another user's ``<user>/...`` and its caller is no MLflow
    admin, else passed on with its body unchanged.

    The middleware runs before MLflow's basic auth and reads the name the request claims, without
    its password. That is enough because it only refuses: whatever it lets through, MLflow's own
    auth still checks (a false claim to be the service, or an admin, is MLflow's 401).
    """

    def __init__(self, app, prefix: str = "", is_admin=_mlflow_admin):
        self.app = app
        self.prefix = prefix
        self.is_admin = is_admin

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)  # lifespan
        user = claimed_user(scope.get("headers", ()))
        if user == SERVICE_ACCOUNT:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # MLflow serves none: refused before it is accepted
            return await send({"type": "websocket.close", "code": 1008})
        route = mlflow_routes.server_route(scope["path"], self.prefix)
        decision = mlflow_routes.decide(scope["method"], route)
        if not decision.allowed:
            log.info("refused %s %s for %s: %s", scope["method"], route, user, decision.reason)
            await _drain(receive)
            return await _answer(send, decision.status, decision.reason, decision.message, decision.route)
        if route in mlflow_routes.EXPERIMENT_NAMING:
            body = await _read(receive, mlflow_routes.MAX_NAMING_BODY)
            if body is None:
                return await _answer(
                    send,
                    413,
                    "body_too_large",
                    f"an experiment request body is at most {mlflow_routes.MAX_NAMING_BODY} bytes",
                )
            why = mlflow_routes.namespace_refusal(body, user or "")
            if why and not (user and await _in_thread(self.is_admin, user)):
                log.info("refused %s %s for %s: %s", scope["method"], route, user, why)
                return await _answer(send, 403, "experiment_not_yours", why, route)
            receive = _replay(body, receive)
        return await self.app(scope, receive, send)


async def _in_thread(fn, *args):
    import anyio.to_thread  # deferred: the MLflow server's event loop library (FastAPI's)

    return await anyio.to_thread.run_sync(fn, *args)


async def _read(receive, limit: int) -> bytes | None:
    """The whole request body (None past ``limit`` bytes, or when the client went away)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _drain(receive, limit: int = mlflow_routes.MAX_NAMING_BODY) -> None:
    """Read a refused request's (small) body, so the refusal is answered on a connection still in step."""
    size = 0
    while size <= limit:
        message = await receive()
        size += len(message.get("body", b""))
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return


def _replay(body: bytes, receive):
    """``receive`` as the app sees it: the body read already, then the client's next messages."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _answer(send, status: int, reason: str, message: str, route: str | None = None) -> None:
    data = json.dumps(mlflow_routes.refusal(status, reason, message, route)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def create_app():
    """What uvicorn serves for ``--app-name basic-auth``: MLflow's basic-auth app inside :class:`Rules`.

    A factory (uvicorn's ``--factory``), called once in each worker process.
    """
    from mlflow.server.auth import create_app as basic_auth  # deferred: MLflow's server, in its own process
    from mlflow.server.handlers import STATIC_PREFIX_ENV_VAR  # deferred: as basic_auth above

    app = basic_auth()
    if not hasattr(app, "router"):  # a Flask app: MLflow under gunicorn or waitress, not Danlu's uvicorn
        raise RuntimeError("Danlu serves MLflow with uvicorn only: leave out --gunicorn-opts and --waitress-opts")
    return Rules(app, prefix=os.environ.get(STATIC_PREFIX_ENV_VAR, ""))


def _find_app(find_app):
    """MLflow's ``_find_app``, with ``basic-auth`` served inside :class:`Rules`."""

    def find(app_name: str) -> str:
        return RULED if app_name == BASIC_AUTH else find_app(app_name)

    return find


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

    if not callable(getattr(mlflow.server, "_find_app", None)):
        raise SystemExit(
            f"danlu mlflowserver: mlflow.server._find_app is gone in MLflow {mlflow.__version__}, so Danlu's "
            "route rules cannot be installed; use the MLflow version Danlu pins"
        )
    mlflow.server._find_app = _find_app(mlflow.server._find_app)
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
