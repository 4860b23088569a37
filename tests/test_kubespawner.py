"""Pure tests of the Kubernetes spawner and hub configuration (danlu.hub.k8s.spawner, .hubconfig).

Pods are rendered offline the way KubeSpawner's own tests do (``get_pod_manifest`` on a spawner built
with ``_mock=True``, KubeSpawner's test hook, and a user that stands in for JupyterHub's), after the
request went through JupyterHub's own ``_run_apply_user_options``. KubeSpawner loads a kubeconfig when
it is built, so each test points it at one naming an address nothing listens on; nothing
is ever sent. Every rendered pod is checked against the official Pod schema.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import kubernetes_asyncio.client
import pytest
import yaml
from jupyterhub.objects import Hub
from kubernetes_asyncio.config import kube_config
from tornado import web
from traitlets.config import Config

from danlu import env as names
from danlu.errors import ConfigError
from danlu.hub.config import load_settings
from danlu.hub.k8s import names as k8s
from danlu.hub.k8s.hubconfig import configure
from danlu.hub.k8s.spawner import DanluKubeSpawner, gpu_flavors, profile_entry
from danlu.hub.profiles import load_profiles
from danlu.hub.scopes import WRITE
from tests.k8sschemas import errors

IMAGE = "registry.example.org/danlu/pytorch@sha256:" + "a" * 64
CPU_IMAGE = "registry.example.org/danlu/cpu@sha256:" + "b" * 64
A100_LABELS = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
SETTINGS_YAML = {
    "admin_users": ["root-admin"],
    "groups": {"vision": ["ana"], "nlp": ["bo"], "interns": ["cy"]},
    "gpus": {
        "declared": [
            {"count": 8, "flavor": "a100", "node_labels": A100_LABELS, "tolerations": [GPU_TAINT]},
            {"count": 4, "flavor": "h100", "node_labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
        ]
    },
    "teams": {"vision": {"quota": {"gpus": {"a100": 4}}}, "nlp": {"quota": {"gpus": {"h100": 4}}}},
    "priority_classes": {"normal": {"value": 0, "default": True}, "urgent": {"value": 100}},
    "kubernetes": {"namespace": "research", "shm_size": "16G", "trial": True},
    "jobs": {"backend": "kubernetes"},
}
PROFILES_YAML = {
    "profiles": [
        {"slug": "python", "display_name": "Workbench Python", "environment": {"current": True}},
        {
            "slug": "cpu",
            "display_name": "CPU notebook",
            "description": "Small.",
            "default": True,
            "environment": {"image": CPU_IMAGE},
            "resources": {"cpu": 2, "memory": "8G", "gpus": [0]},
        },
        {
            "slug": "pytorch",
            "display_name": "PyTorch",
            "description": "GPUs.",
            "environment": {"image": IMAGE},
            "resources": {"cpu": 8, "memory": "32G", "gpus": [0, 1, 2, 4]},
            "groups": ["vision", "nlp"],
        },
    ]
}


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    kubeconfig = tmp_path / "kubeconfig"
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
    # kubernetes_asyncio reads $KUBECONFIG when imported, so its default location is what to point elsewhere
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    folder = tmp_path / "etc-danlu"
    folder.mkdir()
    (folder / "danlu.yaml").write_text(yaml.safe_dump(SETTINGS_YAML))
    (folder / "profiles.yaml").write_text(yaml.safe_dump(PROFILES_YAML))
    return folder


class User:
    """What KubeSpawner and Danlu read of JupyterHub's user: name, id, admin, groups, URL."""

    def __init__(self, name: str, groups=(), admin: bool = False):
        self.name = self.escaped_name = name
        self.id, self.admin, self.url, self.server = 1, admin, f"/user/{name}/", None
        self.groups = [SimpleNamespace(name=g) for g in groups]


def make_spawner(config_dir, name="ana", groups=("vision",), *, data=None, admin=False) -> DanluKubeSpawner:
    """Built inside a running loop, like JupyterHub builds it (KubeSpawner takes the loop's API client)."""
    if data is None:
        settings = load_settings(config_dir / "danlu.yaml", environ={})
    else:
        (config_dir / "other.yaml").write_text(yaml.safe_dump(data))
        settings = load_settings(config_dir / "other.yaml", environ={})
    user = User(name, groups, admin=admin)
    return DanluKubeSpawner(
        _mock=True, user=user, hub=Hub(), settings=settings, profiles=load_profiles(config_dir / "profiles.yaml")
    )


def render(config_dir, options: dict | None = None, *, form: dict | None = None, **who) -> dict:
    """A spawn as JupyterHub runs it (form or API options), up to the pod KubeSpawner would create, as the
    API server sees it."""

    async def spawn():
        s = make_spawner(config_dir, **who)
        s.user_options = s.options_from_form(form) if form is not None else options
        await s._run_apply_user_options(s.user_options)
        await s.load_user_options()
        pod = await s.get_pod_manifest()
        async with kubernetes_asyncio.client.ApiClient() as api:
            return api.sanitize_for_serialization(pod)

    manifest = asyncio.run(spawn())
    assert errors(manifest) == []
    return manifest


def refusal(config_dir, options: dict, **who) -> web.HTTPError:
    with pytest.raises(web.HTTPError) as caught:
        render(config_dir, options, **who)
    return caught.value


def profile_list(config_dir, **who) -> list[dict]:
    async def listed():
        s = make_spawner(config_dir, **who)
        return s.profile_list(s)

    return asyncio.run(listed())


def base_labels(user="ana") -> dict:
    return {
        "hub.jupyter.org/username": user,
        "hub.jupyter.org/servername": "",
        "component": "singleuser-server",
        "app.kubernetes.io/name": "jupyterhub",
        "app": "jupyterhub",
        "heritage": "jupyterhub",
        k8s.MANAGED_BY: k8s.MANAGER,
        k8s.COMPONENT: k8s.NOTEBOOK,
        k8s.OWNER: user,
    }


SHM = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}


def test_cpu_profile(config_dir):
    pod = render(config_dir, {"profile": "cpu"})
    container = pod["spec"]["containers"][0]
    assert pod["metadata"]["labels"] == base_labels()  # no queue: a pod without GPUs is not quota-counted
    assert container["image"] == CPU_IMAGE
    assert container["resources"] == {
        "limits": {"cpu": 2.0, "memory": 8 * 2**30},
        "requests": {"cpu": 2.0, "memory": 8 * 2**30},
    }
    assert "nodeSelector" not in pod["spec"] and "tolerations" not in pod["spec"]
    assert pod["spec"]["volumes"] == [SHM]
    assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[names.PROFILE] == "cpu"


def test_gpu_profile_a100_x2_from_the_form(config_dir):
    pod = render(
        config_dir,
        form={
            "profile": ["pytorch"],
            "profile-option-pytorch--gpus": ["2"],
            "profile-option-pytorch--gpu_flavor": ["a100"],
        },
    )
    spec = pod["spec"]
    assert pod["metadata"]["labels"] == {**base_labels(), k8s.QUEUE_NAME: "vision", k8s.PRIORITY_CLASS: "normal"}
    assert spec["containers"][0]["image"] == IMAGE
    assert spec["containers"][0]["resources"]["limits"] == {"cpu": 8.0, "memory": 32 * 2**30, "nvidia.com/gpu": "2"}
    assert spec["nodeSelector"] == A100_LABELS
    assert spec["tolerations"] == [GPU_TAINT]
    assert spec["volumes"] == [SHM]


def test_zero_gpus_of_a_gpu_profile_stay_off_gpu_nodes(config_dir):
    pod = render(config_dir, {"profile": "pytorch", "gpus": 0, "gpu_flavor": "a100"})
    assert pod["metadata"]["labels"] == base_labels()
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"cpu": 8.0, "memory": 32 * 2**30}
    assert "nodeSelector" not in pod["spec"] and "tolerations" not in pod["spec"]


def test_profile_outside_the_users_groups_is_refused(config_dir):
    error = refusal(config_dir, {"profile": "pytorch", "gpus": 1}, name="cy", groups=("interns",))
    assert error.status_code == 403
    assert "profile 'pytorch' is restricted to groups vision, nlp; you are in interns" in error.log_message


def test_gpu_count_not_offered_is_refused(config_dir):
    error = refusal(config_dir, {"profile": "pytorch", "gpus": "3"})
    assert error.status_code == 403
    assert error.log_message == "profile 'pytorch' offers 0, 1, 2, 4 GPUs, not 3"


def test_unlisted_choices_unknown_flavors_and_imageless_profiles_are_refused(config_dir):
    assert refusal(config_dir, {"profile": "pytorch", "gpus--unlisted-choice": "64"}).status_code == 400
    error = refusal(config_dir, {"profile": "pytorch", "gpus": 1, "gpu_flavor": "v100"})
    assert error.status_code == 400 and "choose one of: a100, h100" in error.log_message
    error = refusal(config_dir, {"profile": "python"})
    assert error.status_code == 400 and "no environment.image" in error.log_message


def test_user_without_a_team(config_dir):
    error = refusal(config_dir, {"profile": "pytorch", "gpus": 1}, name="root-admin", groups=(), admin=True)
    assert error.status_code == 403
    assert "none of your groups (none) is a team; the teams are nlp, vision" in error.log_message
    # without GPUs there is no queue, so no team is needed
    assert render(config_dir, {}, name="cy", groups=("interns",))["metadata"]["labels"] == base_labels("cy")


def test_without_teams_gpu_pods_go_to_the_default_queue(config_dir):
    data = {k: v for k, v in SETTINGS_YAML.items() if k not in ("teams", "priority_classes")}
    pod = render(config_dir, {"profile": "pytorch", "gpus": 4, "gpu_flavor": "h100"}, data=data)
    # no priority_classes: Danlu's built-in default class, normal
    assert pod["metadata"]["labels"] == {**base_labels(), k8s.QUEUE_NAME: "default", k8s.PRIORITY_CLASS: "normal"}
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert "tolerations" not in pod["spec"]


def test_profile_list_offers_only_allowed_profiles_with_images(config_dir):
    assert profile_list(config_dir, name="cy", groups=("interns",)) == [
        {
            "display_name": "CPU notebook",
            "slug": "cpu",
            "description": "Small.",
            "default": True,
            "kubespawner_override": {
                "image": CPU_IMAGE,
                "cpu_limit": 2.0,
                "cpu_guarantee": 2.0,
                "mem_limit": "8G",
                "mem_guarantee": "8G",
            },
        }
    ]
    assert [p["slug"] for p in profile_list(config_dir)] == ["cpu", "pytorch"]


def test_profile_entry_of_a_gpu_profile(config_dir):
    settings = load_settings(config_dir / "danlu.yaml", environ={})
    pytorch = load_profiles(config_dir / "profiles.yaml").get("pytorch")
    assert profile_entry(pytorch, gpu_flavors(settings)) == {
        "display_name": "PyTorch",
        "slug": "pytorch",
        "description": "GPUs.",
        "default": False,
        "kubespawner_override": {
            "image": IMAGE,
            "cpu_limit": 8.0,
            "cpu_guarantee": 8.0,
            "mem_limit": "32G",
            "mem_guarantee": "32G",
        },
        "profile_options": {
            "gpus": {
                "display_name": "GPUs",
                "choices": {
                    "0": {"display_name": "0 GPUs", "default": True, "kubespawner_override": {}},
                    "1": {
                        "display_name": "1 GPU",
                        "default": False,
                        "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "1"}},
                    },
                    "2": {
                        "display_name": "2 GPUs",
                        "default": False,
                        "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "2"}},
                    },
                    "4": {
                        "display_name": "4 GPUs",
                        "default": False,
                        "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "4"}},
                    },
                },
            },
            "gpu_flavor": {
                "display_name": "GPU type",
                "choices": {
                    "a100": {
                        "display_name": "a100",
                        "default": True,
                        "kubespawner_override": {"node_selector": A100_LABELS, "tolerations": [GPU_TAINT]},
                    },
                    "h100": {
                        "display_name": "h100",
                        "default": False,
                        "kubespawner_override": {
                            "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                            "tolerations": [],
                        },
                    },
                },
            },
        },
    }


# the hub's configuration ---------------------------------------------------------------------------


def test_configure_adds_danlu_to_the_charts_configuration(config_dir):
    c = Config()
    # what the chart set before hub.extraConfig runs
    c.Authenticator.admin_users = {"chart-admin"}
    c.JupyterHub.services = [{"name": "jupyterhub-idle-culler", "admin": False}]
    c.JupyterHub.load_roles = [{"name": "jupyterhub-idle-culler", "services": ["jupyterhub-idle-culler"]}]
    settings = configure(c, config_dir, environ={})
    assert settings.kubernetes.namespace == "research"
    assert c.JupyterHub.spawner_class == "danlu.hub.k8s.spawner.DanluKubeSpawner"
    assert c.Authenticator.admin_users == {"chart-admin", "root-admin"}
    assert c.JupyterHub.load_groups == {
        "vision": {"users": ["ana"]},
        "nlp": {"users": ["bo"]},
        "interns": {"users": ["cy"]},
    }
    services = {s["name"]: s for s in c.JupyterHub.services}
    assert set(services) == {"jupyterhub-idle-culler", "danlu", "mlflow"}
    danlu, gateway = services["danlu"], services["mlflow"]
    assert danlu["url"] == "http://hub:10101"
    assert danlu["command"][1:] == [
        "-m",
        "danlu.hub.service",
        "--JobsServiceApp.backend_class=kubernetes",
        "--JobsServiceApp.upgrade_database=True",
        "--JobsServiceApp.cull_idle_servers=False",
        "--JobsServiceApp.ip=0.0.0.0",
    ]
    assert danlu["environment"] == {
        **names.TELEMETRY_OFF,  # privacy.allow_outbound is off
        names.CONFIG: str(config_dir / "danlu.yaml"),
        names.PROFILES_FILE: str(config_dir / "profiles.yaml"),
        names.BASE_DIR: str(config_dir),
        names.STATE_DIR: "/srv/jupyterhub/danlu",
        names.MLFLOW_URL: "http://danlu-mlflow.research.svc:5000/services/mlflow",
    }
    # users reach MLflow through the gateway (hub login); jobs reach it in the namespace
    assert gateway["url"] == "http://hub:10102"
    assert gateway["command"][1:] == ["-m", "danlu.hub.mlflow_gateway", "--ip=0.0.0.0"]
    assert gateway["environment"] == {
        **names.TELEMETRY_OFF,
        names.MLFLOW_URL: "http://danlu-mlflow.research.svc:5000/services/mlflow",
    }
    roles = {r["name"]: r for r in c.JupyterHub.load_roles}
    assert set(roles) == {"jupyterhub-idle-culler", "user", "danlu-admin", "danlu-service"}
    assert roles["user"]["scopes"] == [
        "self",
        "access:services!service=danlu",
        "access:services!service=mlflow",
        f"{WRITE}!user",
    ]
    assert roles["danlu-admin"]["users"] == ["root-admin"]
    assert WRITE in c.JupyterHub.custom_scopes
    assert [p.slug for p in c.DanluKubeSpawner.profiles] == ["python", "cpu", "pytorch"]
    assert c.DanluKubeSpawner.namespace == "research"
    assert c.DanluKubeSpawner.extra_env == {**names.TELEMETRY_OFF, names.URL: "http://proxy-public.research.svc"}
    # the service reads the same files through its environment
    same = load_settings(environ=danlu["environment"])
    assert same.profiles_file == config_dir / "profiles.yaml" and same.jobs.backend == "kubernetes"


def test_configure_refuses_local_jobs_and_a_missing_folder(config_dir, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        configure(Config(), tmp_path / "nowhere", environ={})
    (config_dir / "danlu.yaml").write_text(yaml.safe_dump({**SETTINGS_YAML, "jobs": {"backend": "local"}}))
    with pytest.raises(ConfigError, match="jobs.backend is local"):
        configure(Config(), config_dir, environ={})
    other = config_dir / "elsewhere.yaml"
    other.write_text(yaml.safe_dump({"kubernetes": {"namespace": "x", "trial": True}}))
    assert configure(Config(), config_dir, environ={names.CONFIG: str(other)}).kubernetes.namespace == "x"


# what the Zero to JupyterHub chart configures before Danlu's configure(c) -----------------------------


def chart_spawner(config_dir, name="ana", groups=("vision",)) -> DanluKubeSpawner:
    """A spawner under what the chart's jupyterhub_config.py sets (tests/chart/ runs the chart itself)."""
    c = Config()
    c.KubeSpawner.profile_list = []  # singleuser.profileList: []
    c.KubeSpawner.start_timeout = 300  # singleuser.startTimeout
    c.KubeSpawner.volume_mounts = {"0-shm": {"name": "shm", "mountPath": "/dev/shm"}}  # an admin's own
    c.KubeSpawner.volumes = {"shm": {"name": "shm", "emptyDir": {"medium": "Memory"}}}
    c.DanluKubeSpawner.settings = load_settings(config_dir / "danlu.yaml", environ={})
    c.DanluKubeSpawner.profiles = load_profiles(config_dir / "profiles.yaml")
    return DanluKubeSpawner(config=c, _mock=True, user=User(name, groups), hub=Hub())


def test_under_the_charts_configuration(config_dir):
    """The chart's empty profile_list beat the @default (every spawn: ``No such profile``); its 300 s
    start timeout killed GPU notebooks waiting in Kueue; a /dev/shm mounted twice is refused (422)."""

    async def spawn(options):
        s = chart_spawner(config_dir)
        assert [p["slug"] for p in s.profile_list(s)] == ["cpu", "pytorch"]
        s.user_options = options
        await s._run_apply_user_options(options)
        await s.load_user_options()
        pod = await s.get_pod_manifest()
        async with kubernetes_asyncio.client.ApiClient() as api:
            return s.start_timeout, api.sanitize_for_serialization(pod)

    timeout, pod = asyncio.run(spawn({"profile": "pytorch", "gpus": "1", "gpu_flavor": "a100"}))
    assert timeout == 3600 and pod["spec"]["containers"][0]["image"] == IMAGE
    assert [m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]] == ["/dev/shm"]
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["shm"]
    timeout, pod = asyncio.run(spawn({"profile": "cpu"}))
    assert timeout == 300 and pod["spec"]["containers"][0]["image"] == CPU_IMAGE


@pytest.mark.parametrize("name", ["ana", "alice.smith", "bob_x", "carol@example.org", "zoë", "alice-smith---63425827"])
def test_jobs_name_the_home_claim_as_kubespawner_does(config_dir, name):
    async def claim():
        return chart_spawner(config_dir, name).pvc_name

    assert k8s.home_claim(name, namespace="research") == asyncio.run(claim())
    assert k8s.home_claim("alice-smith---63425827") != k8s.home_claim("alice.smith")
