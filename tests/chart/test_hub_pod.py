"""The hub as its pod runs it: the chart's own ``jupyterhub_config.py`` with the rendered values, then
``hub.extraConfig`` (Danlu's ``configure(c)``), then the spawner it names, for users whose names
KubeSpawner has to slug, every profile and every GPU option.

Each spawn goes the way JupyterHub takes it (``_run_apply_user_options``, then KubeSpawner's
``load_user_options`` and ``get_pod_manifest``, as in tests/test_kubespawner.py) with the
configuration the chart built, which is what a first spawn on a real cluster would meet. The pods
are checked for what the API server refuses beyond the schema (two mounts at one path, two volumes
of one name) and for what the jobs backend must agree on (the home claim).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from types import SimpleNamespace

import kubernetes_asyncio.client
import kubernetes_validate
import pytest
from jupyterhub.objects import Hub
from traitlets.utils.importstring import import_item

from danlu.hub.backends.base import Launch
from danlu.hub.backends.kubernetes import KubernetesBackend
from danlu.hub.k8s import names
from danlu.hub.k8s.spawner import DanluKubeSpawner, gpu_flavors

from .conftest import KUBERNETES_VERSION

#: plain; dots and underscores; an e-mail; non-ASCII; and a name crafted to be another's slug
USERS = ["alice", "alice.smith", "bob_x", "carol@example.org", "zoë", "alice-smith---63425827"]


class User:
    """What KubeSpawner and Danlu read of JupyterHub's user (as in tests/test_kubespawner.py)."""

    def __init__(self, name: str, groups=()):
        self.name = self.escaped_name = name
        self.id, self.admin, self.url, self.server = 1, False, f"/user/{name}/", None
        self.groups = [SimpleNamespace(name=g) for g in groups]


@dataclass
class Spawn:
    user: str
    options: dict
    pod: dict | None = None
    error: str | None = None
    pvc_name: str = ""
    start_timeout: int = 0
    profile_list: list | None = None


def choices(spawner: DanluKubeSpawner) -> list[dict]:
    """Every profile with an image and every GPU count and flavor it offers."""
    flavors = list(gpu_flavors(spawner.settings)) or [None]
    out = []
    for profile in spawner.profiles:
        if not profile.environment.get("image"):
            continue
        for gpus, flavor in itertools.product(profile.gpu_choices, flavors):
            options = {"profile": profile.slug, "gpus": str(gpus)} if profile.max_gpus else {"profile": profile.slug}
            if profile.max_gpus and flavor:
                options["gpu_flavor"] = flavor
            if options not in out:
                out.append(options)
    return out


def run_spawns(config) -> list[Spawn]:
    cls = import_item(config.JupyterHub.spawner_class)

    async def one(name: str, options: dict | None) -> Spawn:
        settings = config.DanluKubeSpawner.settings
        groups = sorted(set(settings.groups) | set(settings.teams))  # every profile and a team
        spawner = cls(config=config, user=User(name, groups), hub=Hub(), _mock=True)
        record = Spawn(name, options or {}, pvc_name=spawner.pvc_name)
        if options is None:  # the options of this deployment's profiles
            record.profile_list = spawner.profile_list(spawner) if callable(spawner.profile_list) else []
            record.options = choices(spawner)
            return record
        try:
            spawner.user_options = dict(options)
            await spawner._run_apply_user_options(spawner.user_options)
            await spawner.load_user_options()
            pod = await spawner.get_pod_manifest()
        except Exception as e:  # noqa: BLE001 - reported by the test that every spawn succeeds
            record.error = f"{type(e).__name__}: {e}"
            return record
        async with kubernetes_asyncio.client.ApiClient() as api:
            record.pod = api.sanitize_for_serialization(pod)
        record.start_timeout = spawner.start_timeout
        return record

    async def every():
        listing = await one(USERS[0], None)
        return [listing] + [await one(user, options) for user in USERS for options in listing.options]

    return asyncio.run(every())


_spawns: dict[str, list[Spawn]] = {}


@pytest.fixture
def spawns(deployment, hub_pod) -> list[Spawn]:
    if deployment.digest not in _spawns:
        _spawns[deployment.digest] = run_spawns(hub_pod.config)
    return _spawns[deployment.digest][1:]


@pytest.fixture
def listing(deployment, hub_pod, spawns) -> Spawn:
    return _spawns[deployment.digest][0]


def test_the_hub_runs_danlus_spawner_and_services(hub_pod):
    c = hub_pod.config
    assert c.JupyterHub.spawner_class == "danlu.hub.k8s.spawner.DanluKubeSpawner"
    assert hub_pod.chart_http_client == ["tornado.curl_httpclient.CurlAsyncHTTPClient"]
    services = {s["name"]: s for s in c.JupyterHub.services}
    assert {"danlu", "mlflow", "jupyterhub-idle-culler"} <= set(services)
    assert services["danlu"]["url"] == f"http://hub:{names.JOBS_SERVICE_PORT}"
    assert c.KubeSpawner.profile_list == []  # what the chart sets (singleuser.profileList: [])


def test_the_profile_list_is_danlus_despite_the_charts(listing):
    """The chart's ``c.KubeSpawner.profile_list = []`` beat the spawner's @default: no profile
    was offered and every spawn failed with ``No such profile: python``."""
    offered = [p["slug"] for p in listing.profile_list]
    assert offered and offered == [o["profile"] for o in listing.options if list(o) == ["profile"]] + [
        slug for slug in dict.fromkeys(o["profile"] for o in listing.options if "gpus" in o)
    ]


def test_every_profile_and_gpu_option_spawns_for_every_user(spawns):
    assert len(spawns) >= len(USERS) * 2
    assert [f"{s.user} {s.options}: {s.error}" for s in spawns if s.error] == []


_validated: dict[str, list[str]] = {}


def test_pods_are_valid_for_kubernetes_1_36(spawns, deployment):
    if deployment.digest not in _validated:  # the committed and the fresh rendering are the same when fresh
        refused = []
        for s in (s for s in spawns if s.pod):
            try:
                kubernetes_validate.validate(s.pod, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                refused.append(f"{s.user} {s.options}: {'/'.join(map(str, e.path))}: {e.message}")
        _validated[deployment.digest] = refused
    assert _validated[deployment.digest] == []


def test_pods_mount_each_path_and_volume_once(spawns):
    """Schemas cannot see it; the API server refuses such a pod (422): /dev/shm was mounted twice,
    from the chart values' extraVolumes and from the spawner's own."""
    for s in (s for s in spawns if s.pod):
        spec = s.pod["spec"]
        volumes = [v["name"] for v in spec["volumes"]]
        assert len(volumes) == len(set(volumes)), (s.user, s.options, volumes)
        for container in spec["containers"]:
            mounts = container.get("volumeMounts") or []
            paths = [m["mountPath"].rstrip("/") for m in mounts]
            assert len(paths) == len(set(paths)), (s.user, s.options, paths)
            assert {m["name"] for m in mounts} <= set(volumes)
        assert [m["mountPath"] for m in spec["containers"][0]["volumeMounts"]].count("/dev/shm") == 1


def test_pods_run_their_profiles_image(spawns, hub_pod):
    profiles = hub_pod.config.DanluKubeSpawner.profiles
    for s in (s for s in spawns if s.pod):
        assert s.pod["spec"]["containers"][0]["image"] == profiles.get(s.options["profile"]).environment["image"]


def _claims(obj) -> list[str]:
    """Every persistentVolumeClaim named anywhere in a manifest."""
    if isinstance(obj, dict):
        found = [obj["persistentVolumeClaim"]["claimName"]] if "persistentVolumeClaim" in obj else []
        return found + [c for v in obj.values() for c in _claims(v)]
    if isinstance(obj, list):
        return [c for v in obj for c in _claims(v)]
    return []


def test_jobs_mount_the_home_claim_the_notebook_mounts(spawns, hub_pod):
    """KubeSpawner 7 names claims with safe slugs (``alice.smith`` -> ``claim-alice-smith---63425827``);
    a job that mounted ``claim-{username}`` waited for a claim that never exists, holding its GPUs, and
    the name ``alice-smith---63425827`` mounted alice.smith's home."""
    config = hub_pod.config
    backend = KubernetesBackend(settings=config.DanluKubeSpawner.settings, profiles=config.DanluKubeSpawner.profiles)
    job_claims = {}
    for s in (s for s in spawns if s.pod):
        home = next(m for m in s.pod["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == names.HOME)
        volume = next(v for v in s.pod["spec"]["volumes"] if v["name"] == home["name"])
        assert volume["persistentVolumeClaim"]["claimName"] == s.pvc_name
        launch = Launch(job_id="j1", attempt=1, owner=s.user, kernel_name="python3", profile=s.options["profile"])
        job_claims[s.user] = _claims(backend._manifest(launch))
        assert job_claims[s.user] == [s.pvc_name], s.user
    assert len({tuple(c) for c in job_claims.values()}) == len(USERS)  # nobody mounts another's home


def test_notebooks_queued_in_kueue_outlast_the_charts_start_timeout(spawns, hub_pod):
    """A GPU notebook waits in its team's queue for quota: the chart's 300 s start timeout killed it."""
    chart = hub_pod.config.KubeSpawner.start_timeout
    queued = hub_pod.config.DanluKubeSpawner.settings.kubernetes.gpu_notebook_start_timeout_seconds
    assert chart == 300 and queued > chart
    for s in (s for s in spawns if s.pod):
        in_kueue = names.QUEUE_NAME in s.pod["metadata"]["labels"]
        assert in_kueue == (int(s.options.get("gpus", 0)) > 0)
        assert s.start_timeout == (queued if in_kueue else chart), (s.user, s.options)
