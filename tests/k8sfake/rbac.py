"""RBAC as the API server enforces it, for service accounts: Roles and RoleBindings in the store decide.

A request made with the cluster's own token is the cluster admin's (every test before issue 16 ran so). A
token from :meth:`~tests.k8sfake.server.FakeCluster.service_account_token` is the service account
``system:serviceaccount:<ns>:<name>``; its request is allowed only if a RoleBinding in the request's
namespace binds it to a Role with a rule matching the API group, the resource (``pods/log``:
resource/subresource) and the verb (``*`` matches any) — what ``danlu render k8s`` writes in rbac.yaml.
Otherwise 403 ``Forbidden`` with the API server's message. :func:`access_review` answers a
``SelfSubjectAccessReview`` (``kubectl auth can-i``) by the same rules. ClusterRoles, ClusterRoleBindings,
``resourceNames``, aggregated ClusterRoles and non-resource URLs are not modelled (tests/k8sfake/README.md).
:func:`decide` is the one evaluator: Roles and ClusterRoles through RoleBindings and ClusterRoleBindings, for
users, groups and service accounts; the doctor's ``SubjectAccessReview`` (:mod:`.extras`) asks it too.
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


def _subject_is(subject: dict, user: str, groups: list[str]) -> bool:
    kind = subject.get("kind")
    if kind == "User":
        return subject.get("name") == user
    if kind == "Group":
        return subject.get("name") in groups
    if kind == "ServiceAccount":
        return user == f"system:serviceaccount:{subject.get('namespace')}:{subject.get('name')}"
    return False


def decide(store: Store, user: str, groups: list[str], attrs: dict) -> tuple[bool, str]:
    """RBAC's answer for one request (what a SubjectAccessReview returns), from the stored objects: a
    ClusterRoleBinding, or a RoleBinding in the request's namespace, binding the user (or one of its groups)
    to a rule matching the verb, the API group and the resource (``plural/sub``; ``*/sub`` too)."""
    ns = attrs.get("namespace") or None
    resource = attrs.get("resource", "") + (f"/{attrs['subresource']}" if attrs.get("subresource") else "")
    bindings = store.list("ClusterRoleBinding") + (store.list("RoleBinding", ns) if ns else [])
    for binding in bindings:
        if not any(_subject_is(s, user, groups) for s in binding.get("subjects") or []):
            continue
        ref = binding.get("roleRef") or {}
        role = store.find(ref.get("kind"), ns if ref.get("kind") == "Role" else None, ref.get("name"))
        for rule in (role or {}).get("rules") or []:
            if (
                _matches(rule.get("verbs") or [], attrs.get("verb", ""))
                and _matches(rule.get("apiGroups") or [], attrs.get("group", ""))
                and (
                    _matches(rule.get("resources") or [], resource)
                    or ("/" in resource and "*/" + resource.split("/", 1)[1] in (rule.get("resources") or []))
                )
            ):
                where = f'{binding["kind"]} "{binding["metadata"]["name"]}"'
                return True, f'RBAC: allowed by {where} of {ref.get("kind")} "{ref.get("name")}"'
    return False, ""


def allowed(store: Store, who: Subject, verb: str, group: str, resource: str, namespace: str | None) -> bool:
    """Whether ``who`` may do ``verb`` on ``resource`` (``plural[/sub]``) in ``namespace`` (:func:`decide`)."""
    plural, _, sub = resource.partition("/")
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{who.namespace}", "system:authenticated"]
    attrs = {"verb": verb, "group": group, "resource": plural, "subresource": sub, "namespace": namespace}
    return decide(store, who.user, groups, attrs)[0]


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
