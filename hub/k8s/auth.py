"""How users log in to a cluster deployment: what ``danlu render k8s`` accepts and renders for ``auth``.

On one machine an absent ``auth`` section means PAM, the machine's own accounts. In the hub pod
there are none, and the Zero to JupyterHub chart's default authenticator is JupyterHub's
DummyAuthenticator, which lets anyone log in as anyone, admins included. So on a cluster
:func:`check` requires an identity provider (``auth.type`` github, gitlab or oidc, which
OAuthenticator's classes serve), unless danlu.yaml says that the deployment is a throwaway trial
(``kubernetes.trial: true``), which renders DummyAuthenticator on purpose and says so in every
file's header.

The OAuth client's secret never goes into danlu.yaml's ConfigMap: it is the key
:data:`SECRET_OAUTH_CLIENT` of the ``danlu-secrets`` Secret, which the chart's ``hub.extraEnv``
gives the hub as ``$OAUTH_CLIENT_SECRET`` (:func:`chart_env`), the variable every OAuthenticator
class reads when ``client_secret`` is not configured. Client id, callback and provider URLs are
not secret and stay in danlu.yaml.
"""

from __future__ import annotations

from danlu.errors import ConfigError
from danlu.hub.config import Settings
from danlu.hub.k8s import names

#: the key of the danlu-secrets Secret that holds the OAuth client's secret
SECRET_OAUTH_CLIENT = "oauth-client-secret"
#: what OAuthenticator reads when its client_secret is not configured
CLIENT_SECRET_ENV = "OAUTH_CLIENT_SECRET"
OAUTH = ("github", "gitlab", "oidc")
TRIAL = "dummy"
FIX = (
    "set auth.type to oidc, github or gitlab with client_id and oauth_callback_url, and put the client's "
    f"secret in the {names.SECRET} Secret as {SECRET_OAUTH_CLIENT} (docs/kubernetes.md, Authentication); "
    "for a throwaway trial that anyone may enter as anyone, set kubernetes.trial: true instead"
)


def check(settings: Settings, *, rendered: bool = False) -> None:
    """Refuse a cluster deployment whose hub would let anyone in without being told so (module docs).

    ``rendered``: ``settings`` is the cluster's danlu.yaml (the hub checks it at start), where a
    trial has ``auth.type: dummy`` (:func:`cluster_auth`), not the admin's file.
    """
    trial = settings.kubernetes.trial
    auth = settings.auth
    if rendered and trial and settings.is_set("auth") and auth.type == TRIAL:
        return
    if not settings.is_set("auth"):
        if trial:
            return
        raise ConfigError(
            f"{settings.where('auth')}: danlu.yaml has no auth section; on a cluster the chart's "
            "DummyAuthenticator would let anyone log in as anyone, admins included",
            fix=FIX,
        )
    if trial:
        raise ConfigError(
            f"{settings.kubernetes.where('trial')}: kubernetes.trial lets anyone in, but auth names {auth.type}",
            fix="remove kubernetes.trial (or auth, for a throwaway trial)",
        )
    if auth.type not in OAUTH:
        why = {
            "pam": "the hub pod has no Unix accounts",
            "shared-password": "its password would go into the danlu-config ConfigMap",
            TRIAL: "it lets anyone log in as anyone",
        }[auth.type]
        raise ConfigError(f"{auth.where('type')}: auth.type {auth.type} does not work on a cluster: {why}", fix=FIX)


def cluster_auth(settings: Settings) -> dict:
    """The ``auth`` section of the cluster's danlu.yaml: the admin's (its secret is in the Secret),
    or DummyAuthenticator for a trial, so the hub sets its authenticator itself in both cases."""
    if settings.kubernetes.trial:
        return {"type": TRIAL}
    return settings.explicit().get("auth", {})


def chart_env(settings: Settings) -> dict:
    """``hub.extraEnv`` entries for the authenticator: the OAuth client's secret from the Secret."""
    if settings.kubernetes.trial or settings.auth.type not in OAUTH:
        return {}
    ref = {"name": names.SECRET, "key": SECRET_OAUTH_CLIENT}
    return {CLIENT_SECRET_ENV: {"valueFrom": {"secretKeyRef": ref}}}


def header(settings: Settings) -> str:
    """A warning for the top of every rendered file of a trial ("" otherwise)."""
    if not settings.kubernetes.trial:
        return ""
    return (
        "THROWAWAY TRIAL (kubernetes.trial): anyone who reaches the hub may log in as anyone,\n"
        "admins included. Never give it data or GPUs you care about."
    )


def readme(settings: Settings) -> str:
    """The README's section on logging in."""
    if settings.kubernetes.trial:
        return (
            f"\n## Logging in\n\n{' '.join(header(settings).split())} Set `auth` in danlu.yaml and "
            "render again for real use.\n"
        )
    return f"""
## Logging in

Users log in with {settings.auth.type} (`auth` in danlu.yaml). The OAuth client's secret is the key
`{SECRET_OAUTH_CLIENT}` of the `{names.SECRET}` Secret; add it before installing the chart:

```sh
kubectl -n {settings.kubernetes.namespace} patch secret {names.SECRET} --type merge \\
  -p '{{"stringData": {{"{SECRET_OAUTH_CLIENT}": "THE-CLIENT-SECRET"}}}}'
```
"""
