"""``danlu doctor k8s``: the live cluster checked in the order a first install fails, each answer with its fix.

The nine checks (docs/kubernetes.md, "First hour on a real cluster") are pure functions
(:mod:`danlu.hub.k8s.doctor_checks`): each takes what the API returned (the *facts*, gathered by
:mod:`danlu.hub.k8s.doctor_io`) and what ``danlu render k8s`` renders from the same danlu.yaml
(:class:`Expected`), and returns the problems it sees, each with its fix. This module owns the order
and the stop-or-continue policy (:data:`CHECKS`): a check runs unless a check it ``needs`` failed,
in which case it is *skipped* (``skipped: needs 3``); every other failure lets the later checks run,
so one run lists every problem. The exit status is 1 when a check failed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

from danlu import env
from danlu.hub import gpus, kueue
from danlu.hub.k8s import names, render
from danlu.hub.k8s.doctor_checks import (
    Problem,
    check_api,
    check_gpu_nodes,
    check_kueue,
    check_mlflow,
    check_probe,
    check_rbac,
    check_storage,
    check_trainer,
    check_visibility,
)

METADATA_ADDRESS = "169.254.169.254:80"
APISERVER_IN_POD = "$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT"
PROBE_LABEL = "danlu.io/doctor"


@dataclass
class Result:
    number: int
    title: str
    status: str  # ok, failed, skipped
    detail: str = ""
    problems: list[Problem] = field(default_factory=list)


@dataclass
class ProbeTarget:
    """An address the probe pod tries: ``blocked`` ones must fail (the policies fence job pods), the rest
    must answer (the policies let job pods reach them)."""

    name: str
    address: str
    blocked: bool


@dataclass
class Expected:
    """What ``danlu render k8s`` renders from this danlu.yaml: what the live cluster should have."""

    namespace: str
    service_account: str
    rules: list[tuple[str, str, str]]  # (verb, group, resource[/subresource])
    kueue_objects: list[dict]
    runtime: str
    flavors: dict[str, dict]  # flavor -> node_labels, tolerations, resource, count
    home_storage_class: str | None
    mlflow_url: str
    probe_image: str | None
    probe_targets: list[ProbeTarget]
    pods_ready_timeout: int = 0  # kubernetes.pods_ready_timeout: Kueue's waitForPodsReady must be on


def expected(settings, profiles) -> Expected:
    """The objects and addresses of the deployment ``danlu render k8s`` writes for ``settings``."""
    objects = render.objects(settings, profiles)
    kube = settings.kubernetes
    ns = kube.namespace
    role = next(o for o in objects["rbac.yaml"] if o["kind"] == "Role")
    binding = next(o for o in objects["rbac.yaml"] if o["kind"] == "RoleBinding")
    rules = [
        (verb, group, resource)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    ]
    inventory = gpus.inventory(settings.gpus)
    flavors = {g.flavor: {"count": 0} for g in inventory}
    for g in inventory:
        flavors[g.flavor]["count"] += 1
    for flavor, spec in kueue.flavor_specs(settings).items():
        flavors.setdefault(flavor, {"count": 0}).update(spec)
    hub_env = render.chart_values(settings, profiles)["hub"]["extraEnv"]
    probe_image = kube.hub_image or render.profile_image(profiles.default)
    if render.PLACEHOLDER_DIGEST in probe_image:
        probe_image = None
    mlflow = urlsplit(hub_env[str(env.MLFLOW_URL)])
    return Expected(
        namespace=ns,
        service_account=binding["subjects"][0]["name"],
        rules=rules,
        kueue_objects=objects["kueue.yaml"],
        runtime=kube.runtime,
        flavors=flavors,
        home_storage_class=kube.home_storage_class,
        mlflow_url=mlflow.geturl(),
        probe_image=probe_image,
        probe_targets=[
            ProbeTarget("metadata", METADATA_ADDRESS, True),
            ProbeTarget("apiserver", APISERVER_IN_POD, True),
            ProbeTarget("mlflow", mlflow.netloc, False),
            ProbeTarget("jobs", f"hub.{ns}.svc:{names.JOBS_SERVICE_PORT}", False),
        ],
        pods_ready_timeout=kube.pods_ready_timeout,
    )


@dataclass(frozen=True)
class Check:
    number: int
    title: str
    judge: Callable
    needs: tuple[int, ...] = (1,)


CHECKS = (
    Check(1, "API server", check_api, ()),
    Check(2, "jobs service RBAC", check_rbac),
    Check(3, "Kueue", check_kueue),
    Check(4, "Kueue visibility API", check_visibility, (1, 3)),
    Check(5, "Trainer and JobSet", check_trainer),
    Check(6, "storage for homes", check_storage),
    Check(7, "GPU nodes", check_gpu_nodes),
    Check(8, "MLflow", check_mlflow),
    Check(9, "network policies (probe pod)", check_probe),
)


def run(gather: Callable[[int, Expected], dict], exp: Expected, *, skip: Iterable[int] = ()) -> list[Result]:
    """Every check in order: facts from ``gather(number, exp)``, judged; skipped where a needed check failed.

    ``gather`` may raise :class:`Failed` (an API call the admin's account cannot make): that check fails.
    """
    results: dict[int, Result] = {}
    for check in CHECKS:
        failed = [n for n in check.needs if results[n].status != "ok"]
        if check.number in skip:
            results[check.number] = Result(check.number, check.title, "skipped", "skipped: --no-probe")
            continue
        if failed:
            text = "skipped: needs " + ", ".join(map(str, failed))
            results[check.number] = Result(check.number, check.title, "skipped", text)
            continue
        try:
            detail, problems = check.judge(gather(check.number, exp), exp)
        except Failed as e:
            detail, problems = "", [Problem(e.problem, e.fix)]
        status = "failed" if problems else "ok"
        results[check.number] = Result(check.number, check.title, status, detail, problems)
    return list(results.values())


class Failed(Exception):
    """A check could not get its facts (an API answer the admin's account cannot change by itself)."""

    def __init__(self, problem: str, fix: str):
        super().__init__(problem)
        self.problem, self.fix = problem, fix


def text(results: list[Result]) -> str:
    lines = []
    for r in results:
        head = f"{r.number}. {r.title}"
        if r.status == "ok":
            lines.append(f"[ok] {head}: {r.detail}")
        elif r.status == "skipped":
            lines.append(f"[skipped] {head}: {r.detail}")
        for p in r.problems:
            lines.append(f"[FAILED] {head}: {p.problem} — fix: {p.fix}")
    return "\n".join(lines) + "\n"


def as_json(results: list[Result]) -> str:
    return json.dumps({"ok": exit_status(results) == 0, "checks": [asdict(r) for r in results]}, indent=2)


def exit_status(results: list[Result]) -> int:
    return 1 if any(r.status == "failed" for r in results) else 0
