"""Who may change what in MLflow: MLflow's own permissions, driven by hub identities.

``danlu up`` runs MLflow's basic-auth app (``mlflow server --app-name basic-auth``)
with the ini file :func:`write_auth_config` writes: everyone may read (or, with
``mlflow.default_permission: NO_PERMISSIONS``, nobody but the owner), the creator
of an experiment gets MANAGE on it, and runs and artifacts follow their
experiment. Every MLflow user is a hub identity -- a user by name, a hub service
as ``service/<name>`` -- and every password is derived from one workbench secret
(``<state>/mlflow-auth-secret``) by :func:`password`, so nothing is stored and
:func:`authenticate`, the check MLflow calls on each request, is one HMAC. Only
the MLflow server, the gateway and the jobs service hold the secret: the gateway
forwards each hub-authenticated request with its user's credentials, the jobs
service gives each attempt of a job an MLflow user of its own (:func:`job_username`,
:func:`job_environment`), which :func:`authenticate` confines to the job's run
(:func:`run_scope`) and which stops working when the service deletes it at the
attempt's end, and both
create hub users in MLflow's user store on first sight (:class:`MlflowUsers`),
using the workbench's own MLflow admin, :data:`SERVICE_ACCOUNT`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlencode

from danlu.env import MLFLOW_AUTH_SECRET
from danlu.errors import ConfigError, DanluError, PolicyError, Unreachable
from danlu.hub.scopes import ADMIN

SECRET_FILE = "mlflow-auth-secret"
#: the MLflow admin the gateway and the jobs service act as; JupyterHub refuses "/" in
#: user names, so no hub user can ever log in as it
SERVICE_ACCOUNT = "service/danlu"
DEFAULT_PERMISSIONS = ("READ", "NO_PERMISSIONS")
#: the permissions that let a job log into an experiment (MLflow's EDIT and MANAGE)
WRITE_PERMISSIONS = ("EDIT", "MANAGE")
AUTHORIZATION_FUNCTION = "danlu.hub.mlflow_auth:authenticate"
#: the name space of attempts' MLflow users (:func:`job_username`); "/" is never in a hub user's name
JOB_PREFIX = "job/"
_REST_PATH = re.compile(r"/(?:api|ajax-api)/[0-9.]+/mlflow/(.+)$")


# the secret and what is derived from it ----------------------------------------------------
def ensure_secret(state_dir: Path) -> str:
    """The workbench secret, created once (random, mode 0600) in the state dir."""
    path = Path(state_dir) / SECRET_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    os.chmod(path, 0o600)
    secret = path.read_text().strip()
    if not secret:
        raise ConfigError(
            f"{path} is empty", fix="delete it; danlu up creates a new one (every MLflow password changes with it)"
        )
    return secret


def read_secret(state_dir: Path) -> str | None:
    """The workbench secret if ``danlu up`` has made it (None before, or without MLflow permissions)."""
    try:
        return (Path(state_dir) / SECRET_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


def password(secret: str, username: str) -> str:
    """The MLflow password of ``username``: HMAC-SHA256 of the name under the workbench secret, hex."""
    return hmac.new(secret.encode(), username.encode(), hashlib.sha256).hexdigest()


def flask_secret_key(secret: str) -> str:
    """MLflow's Flask secret key (CSRF of its sign-up form), kept apart from every password."""
    return hashlib.sha256(b"danlu mlflow flask secret key\0" + secret.encode()).hexdigest()


def basic_authorization(username: str, secret: str) -> str:
    """The ``Authorization`` header value that logs ``username`` in to MLflow."""
    pair = f"{username}:{password(secret, username)}".encode()
    return "Basic " + base64.b64encode(pair).decode("ascii")


def mlflow_username(model: dict) -> str:
    """The MLflow user of a hub user model: users by name, services as ``service/<name>``."""
    return model["name"] if model.get("kind", "user") == "user" else f"service/{model['name']}"


def is_admin(model: dict) -> bool:
    """Hub admins are MLflow admins (the ``admin`` flag, or the Danlu admin scope on the token)."""
    return bool(model.get("admin")) or ADMIN in model.get("scopes", ())


def job_username(job_id: str, attempt: int, run_id: str) -> str:
    """The MLflow user of one attempt of a job: it names the one run it may write (see :func:`run_scope`)."""
    return f"{JOB_PREFIX}{job_id}/{int(attempt)}/{run_id}"


def job_environment(username: str, secret: str | None) -> dict:
    """What a job's runner needs to log to MLflow as its attempt's user (nothing without a secret).

    ``username`` is :func:`job_username`'s: the service creates that MLflow user (never an admin) when the
    attempt fetches its spec, gives it EDIT on the run's experiment, and deletes it when the attempt ends,
    so the password stops working with the attempt; :func:`authenticate` confines it to its run.
    """
    if not secret:
        return {}
    if not username.startswith(JOB_PREFIX):
        raise PolicyError(f"'{username}' is not a job's MLflow user", reason="not_a_job_user")
    return {"MLFLOW_TRACKING_USERNAME": username, "MLFLOW_TRACKING_PASSWORD": password(secret, username)}


def run_scope(username: str, method: str, path: str, args: dict, body) -> str | None:
    """Why an attempt's MLflow user may not make this request (None: it may), or None for other users.

    MLflow's permissions stop at the experiment: EDIT there lets its holder write every run in it, and
    create runs. A job's user is confined to the one run in its name: a request that names another run
    (``run_id``/``run_uuid`` in the query or the JSON body, or an artifact path of another run), or that
    creates a run or an experiment, is refused. Reads that name no run follow MLflow's permissions.
    """
    if not username.startswith(JOB_PREFIX):
        return None
    run_id = username.rsplit("/", 1)[-1]
    match = _REST_PATH.search(path)
    tail = match.group(1) if match else ""
    if method != "GET" and tail in ("runs/create", "experiments/create", "runs/delete", "runs/restore"):
        return f"a job's credentials may not {tail.replace('/', ' ')}: the service made the job's run {run_id}"
    named = [args.get(k) for k in ("run_id", "run_uuid")]
    if isinstance(body, dict):
        named += [body.get(k) for k in ("run_id", "run_uuid", "source_run_id")]
    for other in named:
        if other not in (None, "", run_id):
            return f"run {str(other)[:40]} is not this job's run ({run_id})"
    if "/mlflow-artifacts/artifacts/" in path and method not in ("GET", "HEAD"):
        parts = path.split("/mlflow-artifacts/artifacts/", 1)[1].split("/")
        if run_id not in parts[:3] and "models" not in parts[:2]:
            return f"artifacts outside this job's run ({run_id}) are not the job's to write"
    return None


# the MLflow server's side ------------------------------------------------------------------
def authenticate():
    """MLflow's ``authorization_function``: accept basic-auth credentials with the derived password.

    Runs inside the MLflow server's Flask request. Returns ``request.authorization``
    for good credentials, else MLflow's own 401 response.
    """
    from flask import request  # deferred: flask and MLflow's server exist in the MLflow server's process, not the hub's
    from mlflow.server.auth import make_basic_auth_response  # deferred: as flask above

    auth = request.authorization
    secret = MLFLOW_AUTH_SECRET.get()
    if (
        secret
        and auth is not None
        and auth.type == "basic"
        and auth.username
        and hmac.compare_digest((auth.password or "").encode(), password(secret, auth.username).encode())
    ):
        if auth.username.startswith(JOB_PREFIX):
            return _job_request(auth)
        return auth
    return make_basic_auth_response()


def _job_request(auth):
    """An attempt's credentials: valid while its MLflow user exists (the attempt runs), for its run only."""
    from flask import make_response, request  # deferred: as in authenticate
    from mlflow.server.auth import make_basic_auth_response, store  # deferred: as in authenticate

    if not store.has_user(auth.username):  # the attempt ended: the service deleted its user
        return make_basic_auth_response()
    body = request.get_json(silent=True) if request.is_json else None
    why = run_scope(auth.username, request.method, request.path, request.args, body)
    if why is None:
        return auth
    answer = make_response(json.dumps({"error_code": "PERMISSION_DENIED", "message": why}), 403)
    answer.headers["Content-Type"] = "application/json"
    return answer


def _ini_value(key: str, value: str) -> str:
    if "\n" in value or "\r" in value:
        raise ConfigError(f"mlflow: {key} must be one line", field=f"mlflow.{key}")
    return value.replace("%", "%%")  # MLflow reads the file with configparser's interpolation


def write_auth_config(state_dir: Path, settings, secret: str) -> Path:
    """Write the basic-auth app's ini (mode 0600) into the state dir; return its path."""
    state_dir = Path(state_dir)
    mlflow = settings.mlflow
    database = mlflow.auth_database_uri or f"sqlite:///{state_dir / 'mlflow-auth.db'}"
    values = {
        "default_permission": mlflow.default_permission,
        "database_uri": database,
        "admin_username": SERVICE_ACCOUNT,
        "admin_password": password(secret, SERVICE_ACCOUNT),
        "authorization_function": AUTHORIZATION_FUNCTION,
    }
    text = "# Written by danlu up on every start; edit danlu.yaml (mlflow:) instead.\n[mlflow]\n" + "".join(
        f"{key} = {_ini_value(key, value)}\n" for key, value in values.items()
    )
    path = state_dir / "mlflow-auth.ini"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)
    return path


def server_environment(config: Path, secret: str) -> dict:
    """The environment the MLflow server needs on top of the workbench's."""
    return {
        "MLFLOW_AUTH_CONFIG_PATH": str(config),
        "MLFLOW_FLASK_SERVER_SECRET_KEY": flask_secret_key(secret),
        str(MLFLOW_AUTH_SECRET): secret,
    }


# provisioning, as the workbench's MLflow admin ---------------------------------------------------

#: the most bytes of one MLflow answer the workbench reads (a run with many metrics and tags fits)
MAX_ANSWER = 16 * 2**20


async def rest(
    url: str,
    headers: dict,
    method: str,
    path: str,
    *,
    params: dict | None = None,
    body: dict | None = None,
    timeout: float = 30.0,
    max_body: int = MAX_ANSWER,
) -> tuple[int, dict]:
    """``(status, JSON object)`` of one MLflow REST call, async, with a timeout and at most ``max_body``
    bytes of answer (a non-object answer is ``{}``); Unreachable when MLflow does not answer or fails (5xx).
    The one client of MLflow's REST API on the service side: users, the model registry, run metrics."""
    # deferred: the MLflow server's process, which imports this module too, runs no tornado
    from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

    target = f"{url}{path}" + (f"?{urlencode(params)}" if params else "")
    request = HTTPRequest(
        target,
        method=method,
        headers=headers,
        request_timeout=timeout,
        body=json.dumps(body) if body is not None else None,
        allow_nonstandard_methods=True,
    )
    client = AsyncHTTPClient(force_instance=True, max_body_size=max_body)
    try:
        response = await client.fetch(request, raise_error=False)
    except (HTTPClientError, OSError) as e:
        raise Unreachable(f"MLflow is not answering: {e}", reason="mlflow_unreachable") from None
    finally:
        client.close()
    if response.code == 599 or response.code >= 500:
        raise Unreachable(f"MLflow answered {response.code} to {method} {path}", reason="mlflow_unreachable")
    try:
        data = json.loads(response.body or b"{}")
    except ValueError:
        data = {}
    return response.code, data if isinstance(data, dict) else {}


def refused(what: str, code: int, data: dict) -> DanluError:
    """MLflow said no to something the workbench needed (a 502: the service's dependency failed)."""
    return DanluError(
        f"MLflow refused to {what} ({code}): {str(data.get('message', ''))[:300]}", reason="mlflow_refused", status=502
    )


class MlflowUsers:
    """Hub identities in MLflow's user store, and questions about who may write where.

    MLflow checks permissions only for users in its store, so the gateway and the
    jobs service call :meth:`ensure_user` before acting for someone. What is known
    is remembered, so it costs a round trip per user per process.
    """

    def __init__(self, url: str, secret: str, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.secret = secret
        self.timeout = timeout
        self._headers = {
            "Authorization": basic_authorization(SERVICE_ACCOUNT, secret),
            "Content-Type": "application/json",
        }
        self._known: dict[str, bool | None] = {}  # user -> their admin flag in MLflow (None: unknown)

    async def _call(self, method: str, path: str, params: dict | None = None, body: dict | None = None):
        return await rest(self.url, self._headers, method, path, params=params, body=body, timeout=self.timeout)

    _refused = staticmethod(refused)

    async def ensure_user(self, name: str, admin: bool | None = None) -> None:
        """Make ``name`` an MLflow user with its derived password; set its admin flag to ``admin``.

        ``admin=None`` leaves an existing user's flag as it is (a new user is not an admin).
        """
        if name == SERVICE_ACCOUNT:
            raise PolicyError(f"'{name}' is the workbench's MLflow account", reason="reserved_name")
        if name in self._known and (admin is None or self._known[name] == admin):
            return
        code, data = await self._call("GET", "/api/2.0/mlflow/users/get", params={"username": name})
        if code == 200:
            current = bool(data["user"]["is_admin"])
        elif data.get("error_code") == "RESOURCE_DOES_NOT_EXIST":
            code, data = await self._call(
                "POST", "/api/2.0/mlflow/users/create", body={"username": name, "password": password(self.secret, name)}
            )
            if code == 200:
                current = False
            elif data.get("error_code") == "RESOURCE_ALREADY_EXISTS":  # another process was first
                current = None
            else:
                raise self._refused(f"create the user {name}", code, data)
        else:
            raise self._refused(f"look up the user {name}", code, data)
        if admin is not None and current != admin:
            code, data = await self._call(
                "PATCH", "/api/2.0/mlflow/users/update-admin", body={"username": name, "is_admin": admin}
            )
            if code != 200:
                raise self._refused(f"set the admin flag of {name}", code, data)
            current = admin
        self._known[name] = current

    async def check_experiment(
        self, name: str, owner: str, admin: bool, user_exists: Callable[[str], Awaitable[bool]]
    ) -> None:
        """Refuse a job's experiment its owner could not write to (PolicyError); admins may use any.

        Refused: a name under another hub user (``bob/...``), and an existing experiment
        on which the owner has less than EDIT. An unreachable MLflow lets the job through:
        it reports MLflow's absence itself.
        """
        if admin:
            return
        head, slash, _ = name.partition("/")
        if slash and head != owner and await user_exists(head):
            raise PolicyError(
                f"experiment '{name}' is in {head}'s name space",
                reason="experiment_not_yours",
                field="experiment",
                fix=f"name it '{owner}/...' or leave it out",
            )
        try:
            code, data = await self._call(
                "GET", "/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": name}
            )
            if code != 200:
                return  # not there yet (the job creates it and gets MANAGE), or MLflow cannot tell
            experiment_id = data["experiment"]["experiment_id"]
            code, data = await self._call(
                "GET",
                "/api/3.0/mlflow/users/permissions/get",
                params={"username": owner, "resource_type": "experiment", "resource_id": experiment_id},
            )
        except Unreachable:
            return
        if code != 200 or data.get("permission") not in WRITE_PERMISSIONS:
            raise PolicyError(
                f"you may not log to experiment '{name}' (your permission: {data.get('permission', 'none')})",
                reason="experiment_not_yours",
                field="experiment",
                fix="choose another experiment name, or ask its owner for EDIT in MLflow",
            )
