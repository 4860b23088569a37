"""The Kubernetes spawner: a user's JupyterLab as a pod, from a governed profile.

:class:`DanluKubeSpawner` is KubeSpawner with only what governance needs. Its
``profile_list`` is built from ``kernel-images/profiles.yaml`` (:func:`profile_entry`):
a profile's digest-pinned ``environment.image``, its CPU and memory as limits and
guarantees, and two options, the GPU count (the profile's ``resources.gpus``) and the
GPU flavor (danlu.yaml's ``gpus.declared``: its resource, node labels and tolerations).
Profiles without an image are not offered here. KubeSpawner filters nothing on the
server (its issue #889), so every request -- form, REST API or stored options -- goes
through :meth:`~danlu.hub.profiles.ProfileSet.authorize` in ``apply_user_options``, the
same check the local spawner uses; a refusal is a 403 that names the profile and groups.

The profile list is always Danlu's: the Zero to JupyterHub chart sets
``c.KubeSpawner.profile_list`` from ``singleuser.profileList`` (``[]`` by default), and
configuration beats a ``@default``, so a validator puts the governed list back (an
admin's own list there is ignored, with a warning).

A pod with GPUs is queued by Kueue's pod integration in its owner's team queue (the
``kueue.x-k8s.io/queue-name`` label) at danlu.yaml's default priority class; a pod
without GPUs carries no queue label and is not counted against any quota. A queued pod
may wait for quota, so its spawn gets ``kubernetes.gpu_notebook_start_timeout_seconds``
instead of ``start_timeout`` (the chart's ``singleuser.startTimeout``, 300 s), whichever
is longer. Every pod gets Danlu's labels (:mod:`danlu.hub.k8s.names`), one memory-backed
``/dev/shm`` of ``kubernetes.shm_size`` (none added where the configuration already
mounts one there) and the user-server variables of :mod:`danlu.env`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from kubernetes_asyncio.client.models import V1EmptyDirVolumeSource, V1Volume, V1VolumeMount
from kubespawner import KubeSpawner
from tornado import web
from traitlets import Any, Dict, default, validate

from danlu import env as names
from danlu.errors import DanluError
from danlu.hub.config import Settings, load_settings
from danlu.hub.k8s import names as k8s
from danlu.hub.kueue import GPU_RESOURCE, memory_quantity
from danlu.hub.profiles import Profile, ProfileSet, builtin_profiles, load_profiles
from danlu.hub.teams import DEFAULT_QUEUE

SHM_VOLUME = "dshm"
SHM_PATH = "/dev/shm"
OPTIONS = ("profile", "gpus", "gpu_flavor")


@dataclass(frozen=True)
class Flavor:
    """A GPU flavor of danlu.yaml's inventory, as a notebook pod is placed on it."""

    name: str
    resource: str = GPU_RESOURCE
    node_labels: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[dict, ...] = ()

    def override(self) -> dict:
        return {"node_selector": dict(self.node_labels), "tolerations": [dict(t) for t in self.tolerations]}


def gpu_flavors(settings: Settings) -> dict[str, Flavor]:
    """The declared GPU flavors in danlu.yaml order (the first group of a flavor describes it)."""
    flavors: dict[str, Flavor] = {}
    for group in settings.gpus.declared:
        name = group.get("flavor", "gpu")
        flavors.setdefault(
            name,
            Flavor(
                name,
                group.get("resource", GPU_RESOURCE),
                tuple((group.get("node_labels") or {}).items()),
                tuple(group.get("tolerations") or ()),
            ),
        )
    return flavors


def profile_entry(profile: Profile, flavors: dict[str, Flavor], *, default: bool = False) -> dict:
    """One ``profile_list`` entry in KubeSpawner 7's format (the profile must have an image)."""
    override: dict = {"image": profile.environment["image"]}
    if profile.cpu:
        override.update(cpu_limit=float(profile.cpu), cpu_guarantee=float(profile.cpu))
    if profile.memory:
        override.update(mem_limit=profile.memory, mem_guarantee=profile.memory)
    entry = {
        "display_name": profile.display_name,
        "slug": profile.slug,
        "description": profile.description,
        "default": default,
        "kubespawner_override": override,
    }
    if profile.max_gpus:
        # the count is a limit: the API server refuses an extended resource requested without one
        resource = next(iter(flavors.values())).resource if flavors else GPU_RESOURCE
        options = {
            "gpus": {
                "display_name": "GPUs",
                "choices": {
                    str(n): {
                        "display_name": f"{n} GPU{'' if n == 1 else 's'}",
                        "default": i == 0,
                        "kubespawner_override": {"extra_resource_limits": {resource: str(n)}} if n else {},
                    }
                    for i, n in enumerate(profile.gpu_choices)
                },
            }
        }
        if flavors:
            options["gpu_flavor"] = {
                "display_name": "GPU type",
                "choices": {
                    f.name: {"display_name": f.name, "default": i == 0, "kubespawner_override": f.override()}
                    for i, f in enumerate(flavors.values())
                },
            }
        entry["profile_options"] = options
    return entry


@dataclass(frozen=True)
class Decision:
    """What a request was granted: the profile, its GPUs and where they are, the team queue."""

    profile: Profile
    gpus: int
    flavor: Flavor | None
    team: str | None


class DanluKubeSpawner(KubeSpawner):
    """JupyterLab servers from governed profiles, as Kubernetes pods."""

    settings = Any(
        help="danlu.yaml as Settings (danlu.hub.k8s.hubconfig passes the one it loaded; default: $DANLU_CONFIG)."
    ).tag(config=True)
    profiles = Any(help="The governed profiles as a ProfileSet (default: Settings.profiles_file).").tag(config=True)
    extra_env = Dict(help="Environment added to every server (DANLU_URL, DANLU_PUBLIC_URL).").tag(config=True)

    _said_unoffered: set[str] = set()  # profiles without an image, logged once per hub

    @default("settings")
    def _settings_default(self) -> Settings:
        return load_settings()

    @default("profiles")
    def _profiles_default(self) -> ProfileSet:
        path = self.settings.profiles_file
        return load_profiles(path) if path.exists() else builtin_profiles()

    @default("profile_list")
    def _profile_list_default(self):
        return DanluKubeSpawner._profile_list

    @validate("profile_list")
    def _governed_profile_list(self, proposal):
        """Danlu's list whatever the configuration says: the chart always sets one (``[]``)."""
        if proposal["value"] and proposal["value"] is not DanluKubeSpawner._profile_list:
            self.log.warning(
                "profile_list from the configuration (the chart's singleuser.profileList) is ignored: "
                "Danlu offers the profiles of profiles.yaml; remove it from the chart values"
            )
        return DanluKubeSpawner._profile_list

    @default("apply_user_options")
    def _apply_default(self):
        return DanluKubeSpawner._apply_options

    # who and what -----------------------------------------------------------------------
    @property
    def _admin(self) -> bool:
        return bool(getattr(self.user, "admin", False))

    def _groups(self) -> list[str]:
        return [g.name for g in getattr(self.user, "groups", [])]

    def _offered(self) -> list[Profile]:
        """The profiles this user may start here: allowed to their groups, with an image."""
        unoffered = [p.slug for p in self.profiles if not p.environment.get("image")]
        if set(unoffered) - DanluKubeSpawner._said_unoffered:
            DanluKubeSpawner._said_unoffered.update(unoffered)
            self.log.warning(
                "profiles %s have no environment.image, so they are not offered on Kubernetes", ", ".join(unoffered)
            )
        return [p for p in self.profiles.for_user(self._groups(), admin=self._admin) if p.environment.get("image")]

    def _profile_list(self, spawner=None) -> list[dict]:
        offered = self._offered()
        default = next((p for p in offered if p.default), offered[0] if offered else None)
        flavors = gpu_flavors(self.settings)
        return [profile_entry(p, flavors, default=p is default) for p in offered]

    # policy -------------------------------------------------------------------------------
    @staticmethod
    def _http(error: DanluError) -> web.HTTPError:
        return web.HTTPError(error.status if error.status < 500 else 400, str(error))

    def _apply_options(self, user_options) -> None:
        """Authorize a request whatever it came from, and keep what it was granted."""
        options = dict(user_options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:  # KubeSpawner's unlisted choices ("<option>--unlisted-choice") among them
            raise web.HTTPError(400, f"unknown server option(s): {', '.join(unknown)}; use {', '.join(OPTIONS)}")
        groups, admin = self._groups(), self._admin
        slug = options.get("profile") or None
        if slug is None:
            offered = self._offered()
            if not offered:
                raise web.HTTPError(
                    403,
                    "no profile with an image is open to your groups "
                    f"({', '.join(groups) or 'none'}); ask an admin to add you to a group",
                )
            slug = next((p for p in offered if p.default), offered[0]).slug
        try:
            profile = self.profiles.authorize(slug, groups, admin=admin)
        except DanluError as e:
            raise self._http(e) from None
        if not profile.environment.get("image"):
            raise web.HTTPError(
                400,
                f"profile '{profile.slug}' has no environment.image, so it is not offered on "
                "Kubernetes; choose another profile",
            )
        raw = options.get("gpus", profile.gpu_choices[0])
        try:
            gpus = int(raw)
        except (TypeError, ValueError):
            raise web.HTTPError(400, f"gpus must be a whole number, got {raw!r}") from None
        try:
            self.profiles.authorize(profile.slug, groups, admin=admin, gpus=gpus, server_choice=True)
        except DanluError as e:
            raise self._http(e) from None
        flavors = gpu_flavors(self.settings)
        flavor = None
        if gpus and flavors:
            name = options.get("gpu_flavor") or next(iter(flavors))
            if name not in flavors:
                raise web.HTTPError(400, f"unknown GPU flavor {name!r}; choose one of: {', '.join(flavors)}")
            flavor = flavors[name]
        self._decision = Decision(profile, gpus, flavor, self._team(groups) if gpus else None)
        self._set_start_timeout(queued=bool(gpus))
        self.user_options = {
            "profile": profile.slug,
            **({"gpus": str(gpus)} if profile.max_gpus else {}),
            **({"gpu_flavor": (flavor or next(iter(flavors.values()))).name} if profile.max_gpus and flavors else {}),
        }

    def _set_start_timeout(self, *, queued: bool) -> None:
        """A pod queued in Kueue may wait for quota before it is scheduled: JupyterHub reads
        ``start_timeout`` after ``apply_user_options`` and KubeSpawner waits for the pod with it, so
        both give a queued pod the longer ``kubernetes.gpu_notebook_start_timeout_seconds``."""
        configured: int | None = getattr(self, "_configured_start_timeout", None)
        if configured is None:
            configured = self._configured_start_timeout = int(self.start_timeout)
        queued_timeout = self.settings.kubernetes.gpu_notebook_start_timeout_seconds
        self.set_trait("start_timeout", max(configured, queued_timeout if queued else 0))

    def _team(self, groups: list[str]) -> str:
        """The queue of a GPU notebook: the first of the user's groups that is a team."""
        teams = self.settings.teams
        if not teams:
            return DEFAULT_QUEUE
        mine = [g for g in groups if g in teams]
        if not mine:
            raise web.HTTPError(
                403,
                f"a notebook with GPUs is queued under its owner's team, and none of your "
                f"groups ({', '.join(groups) or 'none'}) is a team; the teams are "
                f"{', '.join(teams)}. Ask an admin to add you to one, or start without GPUs",
            )
        return mine[0]

    async def load_user_options(self):
        if getattr(self, "_decision", None) is None:  # started without JupyterHub's apply_user_options
            self._apply_options(self.user_options)
        if getattr(self, "_configured", None) is None:  # the configuration, before any profile touched it
            self._configured = copy.deepcopy(
                (self.node_selector, self._sorted_dict_values(self.tolerations), self.extra_resource_limits)
            )
        # KubeSpawner merges overrides into these traits: start every spawn from the configuration
        self.node_selector, self.tolerations, self.extra_resource_limits = copy.deepcopy(self._configured)
        await super().load_user_options()
        self._place(self._decision)

    def _place(self, decision: Decision) -> None:
        """GPU count and flavor are one decision, while KubeSpawner applies options one at a time: a pod
        without GPUs goes where the configuration says (not to GPU nodes), one with GPUs gets the limit of
        its flavor's resource and keeps the configured tolerations beside the flavor's."""
        selector, tolerations, limits = copy.deepcopy(self._configured)
        gpu_resources = {f.resource for f in gpu_flavors(self.settings).values()} | {GPU_RESOURCE}
        limits = {k: v for k, v in limits.items() if k not in gpu_resources}
        if decision.gpus:
            resource = decision.flavor.resource if decision.flavor else GPU_RESOURCE
            limits[resource] = str(decision.gpus)
            if decision.flavor:
                selector = {**selector, **dict(decision.flavor.node_labels)}
                tolerations = [*tolerations, *(dict(t) for t in decision.flavor.tolerations)]
        self.node_selector, self.tolerations, self.extra_resource_limits = selector, tolerations, limits

    # the pod --------------------------------------------------------------------------------
    def danlu_labels(self) -> dict[str, str]:
        labels = {k8s.MANAGED_BY: k8s.MANAGER, k8s.COMPONENT: k8s.NOTEBOOK, k8s.OWNER: k8s.owner_label(self.user.name)}
        decision = getattr(self, "_decision", None)
        if decision is not None and decision.gpus:
            labels[k8s.QUEUE_NAME] = decision.team
            if self.settings.default_priority_class:
                labels[k8s.PRIORITY_CLASS] = self.settings.default_priority_class
        return labels

    async def get_pod_manifest(self):
        pod = await super().get_pod_manifest()
        # after KubeSpawner's own labels: app.kubernetes.io/component becomes notebook; the legacy
        # component label stays singleuser-server, which KubeSpawner and the chart select pods by
        pod.metadata.labels = {**(pod.metadata.labels or {}), **self.danlu_labels()}
        container = pod.spec.containers[0]
        # one volume at /dev/shm: the API server refuses a pod with two mounts at one path (422)
        if not any(m.mount_path.rstrip("/") == SHM_PATH for m in container.volume_mounts or []):
            size = memory_quantity(self.settings.kubernetes.shm_size)
            pod.spec.volumes = [
                *(pod.spec.volumes or []),
                V1Volume(name=SHM_VOLUME, empty_dir=V1EmptyDirVolumeSource(medium="Memory", size_limit=size)),
            ]
            container.volume_mounts = [
                *(container.volume_mounts or []),
                V1VolumeMount(name=SHM_VOLUME, mount_path=SHM_PATH),
            ]
        return pod

    def get_env(self):
        env = super().get_env()
        env.update(self.extra_env)
        decision = getattr(self, "_decision", None)
        if decision is not None:
            env[names.PROFILE] = decision.profile.slug
        return env
