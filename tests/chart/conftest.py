"""The chart tier: Danlu's values rendered by the real Zero to JupyterHub 4.4.0 chart, and its hub
configuration run as the hub pod runs it.

Upstream parts only: ``helm template`` (helm installed by ``make install``, tests/chart/get_helm.py)
renders the published chart (``tests/charts/jupyterhub-4.4.0``, vendored; provenance in
``tests/charts/SOURCES.md``) for every committed ``helm-values/*/values.yaml`` and for the values
``danlu render k8s`` writes from each ``examples/config/*.yaml``. :func:`hub_config` then lays out the
hub pod's mounts as the rendered Deployment declares them (the chart's ConfigMap and Secret, Danlu's
ConfigMap) in a temporary folder, gives the process the pod's environment (its ``env`` entries and the
variables Kubernetes sets for each Service) and loads the chart's own ``jupyterhub_config.py`` with
traitlets' loader, as JupyterHub does; that file runs ``hub.extraConfig`` last, Danlu's ``configure(c)``
among them.

What differs from the pod, and why: paths of the pod's file system (its mount points and the chart's
``/usr/local/etc/jupyterhub``) point into the temporary folder wherever a mounted ConfigMap's file or
an environment variable names them (``z2jh.py`` reads there, ``danlu.yaml`` names
``/etc/danlu/profiles.yaml``); tornado's curl client, which the chart selects, is not installed here,
so its selection is recorded instead of made; ``KUBERNETES_SERVICE_*`` stay unset and the kubeconfig
names an address nothing listens on, so no spawner ever reaches a cluster.

Without helm or the chart the tier skips, naming what is missing (``DANLU_TEST_REQUIRE=chart`` makes
it fail instead, as ``.ci/run`` does).
"""

from __future__ import annotations

import base64
import hashlib
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio.config import kube_config
from tornado.httpclient import AsyncHTTPClient
from traitlets.config import Config, PyFileConfigLoader

from danlu import env
from danlu.hub.config import load_settings
from danlu.hub.k8s import names, render
from danlu.hub.profiles import load_profiles

from ..conftest import cannot_run

ROOT = Path(__file__).resolve().parents[2]  # the checkout
CHART = ROOT / "tests" / "charts" / "jupyterhub-4.4.0"  # the published chart, vendored: tests/charts/SOURCES.md
CHART_DIR = "/usr/local/etc/jupyterhub"  # where the hub pod mounts the chart's files (z2jh.py reads there)
#: the newest Kubernetes whose schemas kubernetes-validate ships besides 1.37 (the issue's target)
KUBERNETES_VERSION = "1.36.0"
RELEASE = "danlu"


def helm() -> str | None:
    """The helm beside the interpreter (``make install`` puts it in .venv/bin), else one on PATH."""
    local = Path(sys.executable).parent / "helm"
    return str(local) if local.is_file() else shutil.which("helm")


def require_chart() -> str:
    tool = helm()
    if tool is None:
        cannot_run("chart", "no helm: `make install` installs it (tests/chart/get_helm.py)")
    if not (CHART / "Chart.yaml").is_file():
        cannot_run("chart", f"the Zero to JupyterHub 4.4.0 chart is not at {CHART}")
    return tool


# --- the deployments: committed and freshly rendered ---------------------------------------------


@dataclass
class Deployment:
    """Chart values and Danlu's ConfigMap (danlu.yaml, profiles.yaml), as the admin installs them."""

    name: str
    values: str
    danlu_config: dict[str, str]
    namespace: str
    objects: list[dict] = field(default_factory=list)  # what helm template renders

    @property
    def digest(self) -> str:
        text = self.values + yaml.safe_dump(self.danlu_config, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


def _config_map(objects: list[dict]) -> dict:
    return next(o for o in objects if o and o["kind"] == "ConfigMap" and o["metadata"]["name"] == names.CONFIG_MAP)


def committed(name: str) -> Deployment:
    folder = ROOT / "helm-values" / name
    objects = [
        o for f in sorted(folder.glob("*.yaml")) if f.name != "values.yaml" for o in yaml.safe_load_all(f.read_text())
    ]
    cm = _config_map(objects)
    return Deployment(
        f"committed/{name}", (folder / "values.yaml").read_text(), cm["data"], cm["metadata"]["namespace"]
    )


def generated(name: str) -> Deployment:
    """What ``danlu render k8s --config examples/config/NAME.yaml`` writes (as test_k8s_render loads it)."""
    settings = load_settings(ROOT / "examples" / "config" / f"{name}.yaml", environ={env.BASE_DIR: str(ROOT)})
    files = render.render(settings, load_profiles(settings.profiles_file))
    objects = [
        o for n, text in files.items() if n.endswith(".yaml") and n != "values.yaml" for o in yaml.safe_load_all(text)
    ]
    cm = _config_map(objects)
    return Deployment(f"generated/{name}", files["values.yaml"], cm["data"], cm["metadata"]["namespace"])


DEPLOYMENTS = [f"committed/{p.name}" for p in sorted((ROOT / "helm-values").iterdir()) if (p / "values.yaml").is_file()]
DEPLOYMENTS += [f"generated/{p.stem}" for p in sorted((ROOT / "examples" / "config").glob("*.yaml"))]
_rendered: dict[str, Deployment] = {}


def helm_template(tool: str, deployment: Deployment, tmp: Path) -> list[dict]:
    values = tmp / "values.yaml"
    values.write_text(deployment.values)
    out = subprocess.run(
        [tool, "template", RELEASE, str(CHART), "--namespace", deployment.namespace, "--values", str(values)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"helm template refused {deployment.name}: {out.stderr}"
    return [o for o in yaml.safe_load_all(out.stdout) if o]


@pytest.fixture(scope="session", params=DEPLOYMENTS)
def deployment(request, tmp_path_factory) -> Deployment:
    """One deployment, rendered by the chart (once per session)."""
    tool = require_chart()
    if request.param not in _rendered:
        kind, name = request.param.split("/")
        found = committed(name) if kind == "committed" else generated(name)
        found.objects = helm_template(tool, found, tmp_path_factory.mktemp("helm"))
        _rendered[request.param] = found
    return _rendered[request.param]


def find(objects: list[dict], kind: str, name: str) -> dict:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


# --- the hub pod, emulated ---------------------------------------------------------------------------


def _volume_files(objects: list[dict], deployment: Deployment, volume: dict) -> dict[str, str] | None:
    """The files a volume of the hub pod shows (None: a volume of its own, e.g. the hub's PVC)."""
    if "configMap" in volume:
        name = volume["configMap"]["name"]
        if name == names.CONFIG_MAP:
            return dict(deployment.danlu_config)
        return dict(find(objects, "ConfigMap", name)["data"])
    if "secret" in volume:
        secret = find(objects, "Secret", volume["secret"]["secretName"])
        data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
        return {**data, **(secret.get("stringData") or {})}
    return None


def _service_env(objects: list[dict]) -> dict[str, str]:
    """What Kubernetes sets in every pod for each Service of its namespace (``HUB_SERVICE_PORT``, ...)."""
    out = {}
    for i, service in enumerate(o for o in objects if o["kind"] == "Service"):
        prefix = service["metadata"]["name"].upper().replace("-", "_")
        out[f"{prefix}_SERVICE_HOST"] = f"10.96.0.{10 + i}"
        out[f"{prefix}_SERVICE_PORT"] = str(service["spec"]["ports"][0]["port"])
    return out


@dataclass
class HubPod:
    """The hub's configuration as its pod loads it, and where its files were laid out."""

    config: Config
    root: Path
    chart_http_client: list[str]


def load_hub_config(deployment: Deployment, root: Path) -> HubPod:
    """Lay out the hub pod's mounts under ``root``, set its environment, load the chart's
    ``jupyterhub_config.py`` (which runs ``hub.extraConfig``); the process is as before afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        return _load_hub_config(deployment, root, mp)


def _load_hub_config(deployment: Deployment, root: Path, mp: pytest.MonkeyPatch) -> HubPod:
    objects = deployment.objects
    hub = find(objects, "Deployment", "hub")
    pod = hub["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "hub")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = sorted(container["volumeMounts"], key=lambda m: len(m["mountPath"]))

    prefixes = sorted({CHART_DIR, *(m["mountPath"].rstrip("/") for m in mounts)}, key=len, reverse=True)
    in_pod = re.compile(r"(?<![\w./-])(" + "|".join(map(re.escape, prefixes)) + ")")

    def relocate(text: str) -> str:
        """A path of the pod's file system in a mounted file or variable, pointed under root."""
        return in_pod.sub(lambda m: str(root) + m.group(1), text)

    for mount in mounts:
        target = root / mount["mountPath"].lstrip("/")
        volume = volumes[mount["name"]]
        files = _volume_files(objects, deployment, volume)
        if files is not None and "configMap" in volume:  # not the Secrets: values.yaml is the values
            files = {key: relocate(text) for key, text in files.items()}
        if files is None:
            target.mkdir(parents=True, exist_ok=True)
        elif "subPath" in mount:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(files[mount["subPath"]])
        else:
            target.mkdir(parents=True, exist_ok=True)
            for key, text in files.items():
                (target / key).write_text(text)
    chart_dir = root / CHART_DIR.lstrip("/")

    secrets = {}
    for entry in container.get("env") or []:
        source = entry.get("valueFrom") or {}
        if "value" in entry:
            value = relocate(entry["value"])
        elif "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.namespace", entry
            value = deployment.namespace
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            rendered = [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == ref["name"]]
            # the chart's own Secret is rendered; Danlu's (danlu-secrets) the admin creates: a stand-in
            value = (
                _volume_files(objects, deployment, {"secret": {"secretName": ref["name"]}})[ref["key"]]
                if rendered
                else f"test-{ref['key']}"
            )
            secrets[entry["name"]] = value
        else:
            raise AssertionError(f"an env entry the emulation does not know: {entry}")
        mp.setenv(entry["name"], value)
    for key, value in _service_env(objects).items():
        mp.setenv(key, value)
    for key in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        mp.delenv(key, raising=False)

    chosen: list[str] = []
    mp.setattr(AsyncHTTPClient, "configure", classmethod(lambda cls, impl, **kw: chosen.append(impl)))
    mp.setattr(sys, "path", list(sys.path))  # the chart's file puts its folder first
    mp.chdir(root / "srv" / "jupyterhub")  # the hub's working folder (its PVC)
    sys.modules.pop("z2jh", None)
    try:
        config = PyFileConfigLoader("jupyterhub_config.py", path=str(chart_dir)).load_config()
    finally:
        sys.modules.pop("z2jh", None)
    return HubPod(config, root, chosen)


def point_kubeconfig_nowhere(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    """KubeSpawner loads a kubeconfig when it is built: one naming an address nothing listens on."""
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "none",
                "clusters": [{"name": "none", "cluster": {"server": "https://127.0.0.1:9"}}],
                "users": [{"name": "none", "user": {"token": "unused"}}],
                "contexts": [{"name": "none", "context": {"cluster": "none", "user": "none"}}],
            }
        )
    )
    mp.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))


_hubs: dict[str, HubPod] = {}


@pytest.fixture(scope="module")
def no_cluster(tmp_path_factory):
    """While spawners are built in the module: the kubeconfig names an address nothing listens on."""
    with pytest.MonkeyPatch.context() as mp:
        point_kubeconfig_nowhere(tmp_path_factory.mktemp("kube"), mp)
        mp.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield


@pytest.fixture
def hub_pod(deployment, no_cluster, tmp_path_factory) -> HubPod:
    """The hub's configuration for ``deployment`` (loaded once per distinct deployment)."""
    if deployment.digest not in _hubs:
        _hubs[deployment.digest] = load_hub_config(deployment, tmp_path_factory.mktemp("hubpod"))
    return _hubs[deployment.digest]
