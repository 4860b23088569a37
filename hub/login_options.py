"""The ``auth:`` section of danlu.yaml: how users log in (JupyterHub's authenticator), as traitlets options.

Kept beside :mod:`danlu.hub.options` (the other sections) because the login types (PAM, OAuth, OpenID Connect
with discovery and group refresh, shared password, dummy) carry the most options and their checks; the
authenticator they configure is built in :mod:`danlu.hub.hubconfig` (and :mod:`danlu.hub.oidc`).
"""

from __future__ import annotations

from traitlets import Bool, Enum, Integer, Unicode

from danlu.hub.options import URL, Section
from danlu.hub.traits import Dict, List, Text


class AuthConfig(Section):
    """How users log in (JupyterHub's authenticator)."""

    type = Enum(
        ["pam", "github", "gitlab", "oidc", "shared-password", "dummy"],
        "pam",
        help="The authenticator: pam (the machine's Unix accounts and passwords), github, gitlab, oidc "
        "(OAuthenticator), shared-password (JupyterHub's, for workshops: anyone with the password may "
        "log in as any non-admin user), dummy (any name, any password; tests only: on Kubernetes a "
        "throwaway trial says kubernetes.trial instead).",
    ).tag(config=True)
    allowed_users = List(Unicode(), help="Only these users may log in, plus any other allow-list below.").tag(
        config=True
    )
    client_id = Unicode(None, allow_none=True, help="github, gitlab, oidc (required): the OAuth client's id.").tag(
        config=True
    )
    client_secret = Unicode(
        None,
        allow_none=True,
        help="github, gitlab, oidc: the OAuth client's secret. Or leave it out and give the hub "
        "$OAUTH_CLIENT_SECRET (on Kubernetes it must: danlu render k8s takes it from the danlu-secrets Secret).",
    ).tag(config=True)
    oauth_callback_url = Text(
        None,
        allow_none=True,
        pattern=URL,
        help="github, gitlab, oidc (required): <public_url>/hub/oauth_callback, registered with the provider.",
    ).tag(config=True)
    allowed_organizations = List(
        Unicode(), help="github: members of these GitHub organizations, or org:team, may log in."
    ).tag(config=True)
    allowed_gitlab_groups = List(Unicode(), help="gitlab: members of these GitLab groups may log in.").tag(config=True)
    gitlab_url = Text(
        None,
        allow_none=True,
        pattern=URL,
        help="gitlab: a self-hosted GitLab (default OAuthenticator's, https://gitlab.com).",
    ).tag(config=True)
    issuer = Text(
        None,
        allow_none=True,
        pattern=URL,
        help="oidc: the provider's issuer URL. The hub reads the authorization, token and userinfo endpoints "
        "from <issuer>/.well-known/openid-configuration when it starts (OpenID Connect Discovery), so "
        "authorize_url, token_url and userdata_url are needed only for a provider without discovery.",
    ).tag(config=True)
    authorize_url = Text(
        None, allow_none=True, pattern=URL, help="oidc without issuer (required): the authorization endpoint."
    ).tag(config=True)
    token_url = Text(
        None, allow_none=True, pattern=URL, help="oidc without issuer (required): the token endpoint."
    ).tag(config=True)
    userdata_url = Text(
        None, allow_none=True, pattern=URL, help="oidc without issuer (required): the userinfo endpoint."
    ).tag(config=True)
    username_claim = Unicode("preferred_username", help="oidc: the claim that becomes the hub user name.").tag(
        config=True
    )
    scope = List(Unicode(), ["openid", "profile", "email", "groups"], help="oidc: the scopes requested.").tag(
        config=True
    )
    groups_claim = Text(
        "groups",
        pattern=r"^[^.\s]+(\.[^.\s]+)*$",
        help="oidc: the userinfo claim that lists the user's groups; a dotted path reaches into an object "
        "(realm_access.roles for Keycloak's realm roles).",
    ).tag(config=True)
    allowed_groups = List(
        Unicode(),
        help="oidc: members of these groups (values of the groups claim) may log in. Turns manage_groups on.",
    ).tag(config=True)
    admin_groups = List(
        Unicode(),
        help="oidc: members of these groups are admins (JupyterHub's and Danlu's), for as long as the provider "
        "says they are members. Turns manage_groups on.",
    ).tag(config=True)
    manage_groups = Bool(
        False,
        help="oidc: the user's JupyterHub groups (teams, profiles, dataset and approver rights) are the values "
        "of the groups claim, at login and at every refresh (refresh_seconds).",
    ).tag(config=True)
    refresh_seconds = Integer(
        30,
        min=0,
        max=86400,
        help="oidc: how often the hub asks the provider again about each logged-in user (renewing expired "
        "access tokens with refresh tokens), so a group removed at the provider is removed here within this "
        "time plus the jobs service's cache (15 s for groups, 60 s for admin rights). 0: only when the "
        "user's own requests reach the hub, every 5 minutes.",
    ).tag(config=True)
    user_password = Text(
        None,
        allow_none=True,
        min_length=8,
        help="shared-password (required): the password every non-admin user logs in with (8+ characters).",
    ).tag(config=True)
    admin_password = Text(
        None,
        allow_none=True,
        min_length=32,
        help="shared-password: the password the admin_users log in with (32+ characters). "
        "Without it, admins cannot log in.",
    ).tag(config=True)
    options = Dict(
        help="Any further traits of the authenticator class, passed through as JupyterHub "
        'configuration, e.g. {scope: ["read:org"]} for GitHub.'
    ).tag(config=True)

    @property
    def provider_groups(self) -> bool:
        """Whether the identity provider's groups claim decides JupyterHub group membership (oidc)."""
        return self.type == "oidc" and bool(self.manage_groups or self.allowed_groups or self.admin_groups)

    json_schema = {
        "allOf": [
            {
                "if": {"properties": {"type": {"enum": ["github", "gitlab", "oidc"]}}, "required": ["type"]},
                "then": {"required": ["client_id", "oauth_callback_url"]},
            },
            {
                # the issuer (discovery), unless all three endpoints are given
                "if": {
                    "properties": {"type": {"const": "oidc"}},
                    "required": ["type"],
                    "not": {"required": ["authorize_url", "token_url", "userdata_url"]},
                },
                "then": {"required": ["issuer"]},
            },
            {
                "if": {"properties": {"type": {"const": "shared-password"}}, "required": ["type"]},
                "then": {"required": ["user_password"]},
            },
        ]
    }
