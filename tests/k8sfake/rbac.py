"""RBAC as the API server enforces it, for service accounts: Roles and RoleBindings in the store decide.

A request made with the cluster's own token is the cluster admin's (every test before issue 16 ran so). A
token from :meth:`~tests.k8sfake.server.FakeCluster.service_account_token` is the service account
``system:serviceaccount:<ns>:<name>``; its request is allowed only if a RoleBinding in the request's
namespace binds it to a Role with a rule matching the API group, the resource (``pods/log``:
resource/subresource) and the verb (``*`` matches any) — what ``danlu render k8s`` writes in rbac.yaml.
Otherwise 403 ``Forbidden`` with the API server's message. :func:`access_review` answers a
``SelfSubjectAccessReview`` (``kubectl auth can-i``) by the same rules. ClusterRoles, ClusterRoleBindings,
groups and ``resourceNames`` are not modelled (tests/k8sfake/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from .store import ApiError, Store


@dataclass(frozen=True)
class Subject:
    namespace: str
    name: str

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.name}"


def _matches(values: list, value: str) -> bool:
    return "*" in values or value in values


def allowed(store: Store, who: Subject, verb: str, group: str, resource: str, namespace: str | None) -> bool:
    """Whether a RoleBinding in ``namespace`` lets ``who`` do ``verb`` on ``resource`` (``plural[/sub]``)."""
    if namespace is None:
        return False  # cluster-scoped: only ClusterRoles grant it, and they are not modelled
    for binding in store.list("RoleBinding", namespace):
        bound = any(
            s.get("kind") == "ServiceAccount"
            and s.get("name") == who.name
            and (s.get("namespace") or namespace) == who.namespace
            for s in binding.get("subjects") or []
        )
        ref = binding.get("roleRef") or {}
        if not bound or ref.get("kind") != "Role":
            continue
        role = store.find("Role", namespace, ref.get("name"))
        for rule in (role or {}).get("rules") or []:
            if (
                _matches(rule.get("apiGroups") or [], group)
                and _matches(rule.get("resources") or [], resource)
                and _matches(rule.get("verbs") or [], verb)
            ):
                return True
    return False


def check(store: Store, who: Subject | None, verb: str, group: str, resource: str, namespace: str | None) -> None:
    """Raise the API server's 403 unless ``who`` (None: the admin) may do it."""
    if who is None or allowed(store, who, verb, group, resource, namespace):
        return
    plural, _, sub = resource.partition("/")
    name = f"{plural}.{group}" if group else plural
    where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
    what = f'resource "{plural}"' + (f' with subresource "{sub}"' if sub else "")
    raise ApiError(
        403,
        "Forbidden",
        f'{name} is forbidden: User "{who.user}" cannot {verb} {what} in API group "{group}"{where}',
        {"group": group, "kind": plural},
    )


def access_review(store: Store, who: Subject | None, review: dict) -> dict:
    """A SelfSubjectAccessReview, answered (``status.allowed``) by the same rules."""
    attrs = (review.get("spec") or {}).get("resourceAttributes") or {}
    resource = attrs.get("resource", "") + (f"/{attrs['subresource']}" if attrs.get("subresource") else "")
    ok = who is None or allowed(
        store, who, attrs.get("verb", ""), attrs.get("group", ""), resource, attrs.get("namespace")
    )
    return {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "metadata": {},
        "spec": review.get("spec") or {},
        "status": {"allowed": ok} if ok else {"allowed": False, "reason": "no RoleBinding allows it"},
    }
