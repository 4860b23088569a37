"""JupyterHub's configuration, derived from danlu.yaml.

``danlu up`` writes a two-line ``jupyterhub_config.py`` into the state dir that
calls :func:`configure`; everything else comes from :class:`Settings` and from
the ports and tokens ``danlu up`` passes in the environment. This is where the
parts are wired together: the authenticator, the spawner and its profiles, the
custom scopes and roles that keep users to their own jobs, the jobs service
and the MLflow gateway as managed services (the jobs service also runs the idle
culler, :mod:`danlu.hub.service.culling`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
from pathlib import Path

from tornado.httpclient import AsyncHTTPClient

from danlu import env as names
from danlu.errors import ConfigError
from danlu.hub import mlflow_auth
from danlu.hub.config import Settings, load_settings
from danlu.hub.oidc import discover
from danlu.hub.scopes import ADMIN, CULLER_SCOPES, CUSTOM_SCOPES, WRITE

AUTHENTICATORS = {
    "pam": "jupyterhub.auth.PAMAuthenticator",
    "shared-password": "jupyterhub.authenticators.shared.SharedPasswordAuthenticator",
    "github": "oauthenticator.github.GitHubOAuthenticator",
    "gitlab": "oauthenticator.gitlab.GitLabOAuthenticator",
    "oidc": "danlu.hub.oidc.DanluOIDCAuthenticator",
    "dummy": "jupyterhub.auth.DummyAuthenticator",
}
#: where OAuthenticator reads its client's secret when auth.client_secret is not set
OAUTH_CLIENT_SECRET = "OAUTH_CLIENT_SECRET"
#: JupyterHub's key for users' auth state (auth_state_key keeps one in the state dir when unset)
CRYPT_KEY = "JUPYTERHUB_CRYPT_KEY"

#: scopes of the token a user's server gets ($JUPYTERHUB_API_TOKEN): enough for %%train and MLflow
SERVER_TOKEN_SCOPES = [
    "access:servers!server",
    "users:activity!user",
    "read:users:name!user",
    "read:users:groups!user",
    "access:services!service=danlu",
    "access:services!service=mlflow",
    f"{WRITE}!user",
]


#: JupyterLab's own calls outside, off unless privacy.allow_outbound: its news feed (without one, the lab
#: extension turns off the question whether to fetch it), its update check and its extension
#: manager's listing (both pypi.org)
LAB_PRIVATE_ARGS = (
    "--LabApp.news_url=None",
    "--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate",
    "--LabApp.extension_manager=readonly",
)


def lab_args(settings: Settings) -> list[str]:
    """The arguments of every user server that keep JupyterLab from reaching outside (see privacy)."""
    return [] if settings.privacy.allow_outbound else list(LAB_PRIVATE_ARGS)


def authenticator(c, settings: Settings, environ=os.environ) -> None:
    """The authenticator danlu.yaml's ``auth`` names, and its options.

    An OAuth client's secret is ``auth.client_secret`` or, where danlu.yaml must not hold it (a
    cluster's ConfigMap), ``$OAUTH_CLIENT_SECRET`` in the hub's environment, which OAuthenticator
    reads itself; without either, no login could succeed, so the hub does not start.
    """
    auth = settings.auth
    kind = auth.type
    if kind in ("github", "gitlab", "oidc") and not (auth.client_secret or environ.get(OAUTH_CLIENT_SECRET)):
        raise ConfigError(
            f"{auth.where('client_secret')}: the {kind} OAuth client has no secret",
            fix=f"set auth.client_secret, or ${OAUTH_CLIENT_SECRET} in the hub's environment (on a cluster: "
            "the oauth-client-secret key of the danlu-secrets Secret; docs/kubernetes.md, Authentication)",
        )
    c.JupyterHub.authenticator_class = AUTHENTICATORS[kind]
    if auth.allowed_users:
        c.Authenticator.allowed_users = set(auth.allowed_users)
    if kind == "dummy":
        c.Authenticator.allow_all = True
    elif kind == "pam":
        # every account of this machine may log in unless allowed_users narrows it
        c.Authenticator.allow_all = not auth.allowed_users
    elif kind == "shared-password":
        c.SharedPasswordAuthenticator.user_password = auth.user_password
        if auth.admin_password:
            c.SharedPasswordAuthenticator.admin_password = auth.admin_password
        c.Authenticator.allow_all = not auth.allowed_users
    else:
        section = {
            "github": c.GitHubOAuthenticator,
            "gitlab": c.GitLabOAuthenticator,
            "oidc": c.DanluOIDCAuthenticator,
        }[kind]
        section.client_id = auth.client_id
        if auth.client_secret:
            section.client_secret = auth.client_secret
        section.oauth_callback_url = auth.oauth_callback_url
        if kind == "github" and auth.allowed_organizations:
            section.allowed_organizations = set(auth.allowed_organizations)
        if kind == "gitlab":
            if auth.allowed_gitlab_groups:
                section.allowed_gitlab_groups = set(auth.allowed_gitlab_groups)
            if auth.gitlab_url:
                section.gitlab_url = auth.gitlab_url
        if kind == "oidc":
            oidc(c, section, auth)
        if not (auth.allowed_users or auth.allowed_organizations or auth.allowed_gitlab_groups or auth.allowed_groups):
            c.Authenticator.allow_all = False  # OAuth with no allow-list admits only admin_users
    for key, value in auth.options.items():
        setattr(authenticator_section(c, kind), key, value)


def authenticator_section(c, kind: str):
    """The config section of the authenticator class of login ``kind``."""
    return getattr(c, AUTHENTICATORS[kind].rsplit(".", 1)[1])


def oidc(c, section, auth) -> None:
    """The OpenID Connect options (:mod:`danlu.hub.oidc`): endpoints from the issuer's discovery document unless
    given, groups from the groups claim, and the auth state (tokens) kept so groups can be refreshed."""
    found = discover(auth.issuer, where=auth.where("issuer")) if auth.issuer else {}
    section.authorize_url = auth.authorize_url or found["authorize_url"]
    section.token_url = auth.token_url or found["token_url"]
    if not auth.options.get("userdata_from_id_token"):  # Azure AD: groups are in the ID token, not userinfo
        section.userdata_url = auth.userdata_url or found["userdata_url"]
    if found:
        section.basic_auth = found["basic_auth"]
    section.username_claim = auth.username_claim
    section.scope = auth.scope
    if auth.provider_groups:
        section.manage_groups = True
        section.auth_state_groups_key = f"oauth_user.{auth.groups_claim}"
        if auth.allowed_groups:
            section.allowed_groups = set(auth.allowed_groups)
        if auth.admin_groups:
            section.admin_groups = set(auth.admin_groups)
        # groups at the provider decide, so the tokens are kept (encrypted: auth_state_key) to ask it again
        c.Authenticator.enable_auth_state = True
        c.Authenticator.refresh_pre_spawn = True
        c.Authenticator.auth_refresh_age = auth.refresh_seconds or 300
        section.refresh_seconds = auth.refresh_seconds
        # a user once admitted by a group is not admitted for ever (JupyterHub's default keeps them allowed)
        c.Authenticator.allow_existing_users = False


def auth_state_key(c, state: Path, environ=os.environ) -> None:
    """The key that encrypts users' auth state (their OAuth tokens) in jupyterhub.sqlite: ``$JUPYTERHUB_CRYPT_KEY``
    when set, else one kept in the state dir, made once (a cluster's hub has the chart's, from its Secret)."""
    if environ.get(CRYPT_KEY):
        return
    path = state / "jupyterhub_crypt_key"
    if not path.exists():
        state.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    c.CryptKeeper.keys = [path.read_text().strip()]


def admins_and_groups(c, settings: Settings) -> None:
    """Admins and groups from danlu.yaml; groups only when the identity provider does not own membership."""
    # JupyterHub's own admin list: admins may log in (OAuth's check_allowed admits them) and are hub admins
    c.Authenticator.admin_users = set(settings.admin_users)
    if not settings.auth.provider_groups:
        c.JupyterHub.load_groups = {name: {"users": members} for name, members in settings.groups.items()}


def jobs_service(url: str, command: list[str], environment: dict) -> dict:
    """The jobs service ``danlu`` as a hub-managed service."""
    return {
        "name": "danlu",
        "display": True,
        "url": url,
        "command": command,
        "environment": environment,
        "oauth_no_confirm": True,
        "oauth_client_allowed_scopes": list(CUSTOM_SCOPES),
    }


def roles(settings: Settings, services, *, service_culls: bool = True) -> list[dict]:
    """The roles that keep users to their own jobs, for the services that exist (names in ``services``).

    ``danlu-admin`` is both the admins' role and, where it exists, the service holding the automation token.
    ``service_culls``: the jobs service stops idle servers (on a cluster the chart's culler does, not it).
    """
    services = set(services)
    reachable = [f"access:services!service={name}" for name in ("danlu", "mlflow") if name in services]
    automation = ["danlu-admin"] if "danlu-admin" in services else []
    out = [
        {
            "name": "user",
            "description": "Every user: their own server, jobs and MLflow.",
            "scopes": ["self", *reachable, f"{WRITE}!user"],
        },
        {
            "name": "danlu-admin",
            "description": "Operate Danlu: every job, the queue and GPU allocations.",
            "scopes": [ADMIN, "access:services"],
            "users": settings.admin_users,
            # oidc: members of the admin groups, for as long as the provider lists them (danlu.hub.oidc)
            "groups": list(settings.auth.admin_groups) if settings.auth.provider_groups else [],
            "services": automation,
        },
    ]
    if automation:  # the automation token (DANLU_ADMIN_TOKEN / <state>/admin-token) is a hub admin too
        out.append({"name": "admin", "services": automation})
    scopes = ["read:users", "read:groups", "list:users", "read:servers"]
    culls = settings.hub.idle_timeout_seconds or settings.hub.gpu_idle_timeout_seconds  # (and GPU culling)
    if culls and service_culls:  # it runs the idle culler (danlu.hub.service.culling, .gpuculling)
        scopes += [s for s in CULLER_SCOPES if s not in scopes]
    out.append(
        {
            "name": "danlu-service",
            "description": "The jobs service reads users' groups and stops idle servers.",
            "scopes": scopes,
            "services": ["danlu"],
        }
    )
    return out


def audit_logins(jobs_api: str, token: str):
    """A post_auth_hook that records every login in Danlu's audit log (never blocks the login)."""

    async def hook(authenticator, handler, auth_model):

        body = {
            "action": "login",
            "actor": auth_model["name"],
            "details": {
                "admin": bool(auth_model.get("admin")),
                "from": handler.request.remote_ip,
                "authenticator": type(authenticator).__name__,
            },
        }
        try:
            await AsyncHTTPClient().fetch(
                f"{jobs_api}/audit",
                method="POST",
                body=json.dumps(body),
                headers={"Authorization": f"token {token}"},
                request_timeout=5,
            )
        except Exception as e:  # the jobs service restarting must not lock people out
            authenticator.log.warning("could not record the login of %s in the audit log: %s", auth_model["name"], e)
        return auth_model

    return hook


def configure(c, environ=os.environ) -> Settings:
    settings = load_settings(environ=environ)
    state = settings.state_dir
    venv_bin = Path(sys.executable).parent
    python = sys.executable

    c.JupyterHub.ip = settings.ip
    c.JupyterHub.port = settings.port
    c.JupyterHub.hub_ip = "127.0.0.1"
    c.JupyterHub.hub_port = int(environ[names.HUB_PORT])
    c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
    c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
    c.JupyterHub.pid_file = str(state / "jupyterhub.pid")
    c.JupyterHub.cleanup_servers = True
    c.JupyterHub.cleanup_proxy = True
    c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{environ[names.PROXY_API_PORT]}"
    c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")
    chp = shutil.which("configurable-http-proxy", path=f"{venv_bin}{os.pathsep}{environ.get('PATH', '')}")
    if chp:
        c.ConfigurableHTTPProxy.command = [chp]

    authenticator(c, settings, environ)
    auth_state_key(c, state, environ)
    admins_and_groups(c, settings)

    admin_token = environ[names.ADMIN_TOKEN]
    instance = {names.INSTANCE: environ[names.INSTANCE]} if names.INSTANCE in environ else {}
    # tests on machines without GPUs: the fake NVML's state reaches the services that sample (tests/fakenvml)
    instance.update({names.FAKE_NVML: environ[names.FAKE_NVML]} if names.FAKE_NVML in environ else {})
    private = names.private_environment(settings.privacy.allow_outbound, environ)
    common_env = {
        **private,
        names.CONFIG: environ.get(names.CONFIG, ""),
        names.STATE_DIR: str(state),
        names.BASE_DIR: str(settings.base_dir),
        names.MLFLOW_URL: environ[names.MLFLOW_URL],
        names.IP: settings.ip,
        names.PORT: str(settings.port),
        "PATH": f"{venv_bin}{os.pathsep}{environ.get('PATH', '')}",
        **instance,
    }
    # the MLflow credentials' secret, read from its file: for these two services only, never for users'
    # servers, and not in the hub's own environment either (configurable-http-proxy inherits that)
    secret = mlflow_auth.read_secret(state)
    mlflow_secret = {names.MLFLOW_AUTH_SECRET: secret} if secret else {}
    service_port = int(environ[names.SERVICE_PORT])
    gateway_port = int(environ[names.GATEWAY_PORT])
    c.JupyterHub.services = [
        jobs_service(
            f"http://127.0.0.1:{service_port}", [python, "-m", "danlu.hub.service"], {**common_env, **mlflow_secret}
        ),
        {
            "name": "mlflow",
            "display": True,
            "url": f"http://127.0.0.1:{gateway_port}",
            "command": [python, "-m", "danlu.hub.mlflow_gateway"],
            "environment": {**common_env, **mlflow_secret},
            "oauth_no_confirm": True,
        },
        {"name": "danlu-admin", "api_token": admin_token},
    ]
    c.JupyterHub.custom_scopes = CUSTOM_SCOPES
    c.JupyterHub.load_roles = roles(settings, [s["name"] for s in c.JupyterHub.services])

    c.JupyterHub.spawner_class = "danlu.hub.spawner.DanluLocalSpawner"
    c.Spawner.cmd = [str(venv_bin / "jupyterhub-singleuser")]
    c.Spawner.default_url = "/lab"
    c.Spawner.args = lab_args(settings)
    c.Spawner.server_token_scopes = SERVER_TOKEN_SCOPES
    c.Spawner.start_timeout = 120
    c.Spawner.http_timeout = 120
    c.Spawner.env_keep = ["PATH", "LANG", "LC_ALL", "LD_LIBRARY_PATH", "TZ", names.INSTANCE]
    c.DanluLocalSpawner.profiles_file = str(settings.profiles_file)
    c.DanluLocalSpawner.home_root = str(state / "users")
    c.DanluLocalSpawner.unix_accounts = settings.unix_accounts
    if settings.unix_accounts:  # the hub user name is the account: only a login that proves it
        settings.check_unix_login()
        c.DanluLocalSpawner.uid_range = settings.uid_range
        if settings.auth.type != "pam":  # the provider's claim that holds the account's name
            authenticator_section(c, settings.auth.type).username_claim = settings.users.account_claim
    c.DanluLocalSpawner.jobs_api_url = f"http://127.0.0.1:{service_port}/services/danlu/api/v1"
    c.DanluLocalSpawner.jobs_api_token = admin_token
    c.Authenticator.post_auth_hook = audit_logins(f"http://127.0.0.1:{service_port}/services/danlu/api/v1", admin_token)
    c.DanluLocalSpawner.extra_env = {
        names.URL: settings.local_url,
        names.PUBLIC_URL: settings.public_url,
        "MLFLOW_TRACKING_URI": f"{settings.local_url}/services/mlflow",
        "JUPYTER_PATH": str(state / "share" / "jupyter"),
        **private,
        **instance,
    }
    return settings
