"""danlu.yaml: the one file an admin edits to configure a workbench, as traitlets options.

Every option is a trait with a default and a help text: the top-level ones are traits of
:class:`Settings`, the root ``Configurable``, and each section of the file is a small
``Configurable`` that Settings builds with itself as parent (``jobs:`` is :class:`JobsConfig`,
reached as ``settings.jobs``). The JSON Schema that danlu.yaml is validated with
(line-accurate errors through :mod:`danlu.hub.yamlconfig`) is generated from these traits
(:func:`schema`), so it accepts exactly what they do and refuses any other key, naming the
nearest valid one. :func:`load_settings` reads the file, the environment variables and the
command-line flags into one ``traitlets.config.Config`` (class name -> options) and builds
Settings from it; precedence: command-line flag > environment variable > danlu.yaml > default.
``danlu up``, the jobs service, the MLflow gateway and the generated JupyterHub configuration
all build their configuration from the same Settings, so one file means the same thing to
every process. ``danlu config`` prints every option with its help, default and current value
(:func:`describe`).
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib.util
import json
import os
import re
import textwrap
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path as FilePath
from typing import Any, ClassVar

from traitlets import Bool, Enum, Float, Integer, TraitError, Unicode, default, validate
from traitlets.config import Config, Configurable

from danlu import env
from danlu.errors import ConfigError
from danlu.hub import accounts, yamlconfig
from danlu.hub.traits import Dict, List, Path, Positive, Record, Size, Text, from_base, options, schema_of, type_text

ENV_OVERRIDES = {
    "ip": env.IP,
    "port": env.PORT,
    "state_dir": env.STATE_DIR,
    "profiles_file": env.PROFILES_FILE,
}

DEFAULT_QUEUE = "default"
_SIZE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}

#: a Kubernetes name (DNS label): teams, cohorts, priority classes, the namespace
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
#: a GPU flavor (a Kueue ResourceFlavor's name)
FLAVOR = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: an image pinned by digest
DIGEST = r"^[^@\s]+@sha256:[0-9a-f]{64}$"
URL = r"^https?://"
#: option names whose values are never shown (``danlu config``) nor rendered into a ConfigMap
SECRET_SUFFIXES = ("_password", "_secret")


def parse_size(value) -> float:
    """Bytes in ``512M``, ``8G``, ``1.5T`` (binary units; ``Gi`` is accepted too) or a plain number."""
    try:
        if isinstance(value, (int, float)):
            return float(value)
        text = str(value).strip().removesuffix("i").removesuffix("B")
        unit = text[-1:].upper() if text[-1:].isalpha() else ""
        return float(text[:-1] if unit else text) * _SIZE[unit]
    except OverflowError:  # an integer beyond a double's range
        raise ValueError(f"{str(value)[:40]} is too large for a size") from None


def is_secret(name: str) -> bool:
    return name.endswith(SECRET_SUFFIXES)


# the shapes of structured values ------------------------------------------------------------------------------

def _amounts(help: str) -> Record:
    return Record({
        "gpus": Dict(Integer(min=0, max=1_000_000), key_trait=Text(pattern=FLAVOR),
                     help="GPUs per flavor; the flavors must exist. Their order is the order in which the team's "
                          "jobs try flavors."),
        "cpu": Float(min=0, max=1_000_000, help="CPUs (cores)."),
        "memory": Size(help="Memory: 512M, 64G, 1T, 64Gi, or bytes."),
    }, help=help)


def _team() -> Record:
    return Record({
        "quota": _amounts("The nominal quota: what the team is guaranteed."),
        "cohort": Text(pattern=DNS_LABEL, help="The cohort whose members lend each other unused nominal quota."),
        "borrowing_limit": _amounts("The most the team may borrow from its cohort beyond its quota, per resource "
                                    "(default unlimited). Needs cohort."),
        "lending_limit": _amounts("The most of its unused quota the team lends to its cohort (default all of it). "
                                  "Needs cohort."),
        "preemption": Record({
            "within_team": Enum(["lower_priority", "never"],
                                help="lower_priority (default): a job may preempt lower-priority jobs of its own "
                                     "team; never: it may not."),
            "reclaim": Enum(["any", "lower_priority", "never"],
                            help="any (default): a job that fits the team's nominal quota may preempt jobs of teams "
                                 "that borrow from the cohort; lower_priority: only lower-priority ones; never."),
        }, help="Whom the team's jobs may preempt."),
    }, required=("quota",))


def _gpu_group() -> Record:
    return Record({
        "count": Integer(min=1, max=1024, help="The number of devices in this group."),
        "flavor": Text(pattern=FLAVOR, help="The resource flavor (GPU type) these devices are, e.g. a100 or sim "
                                            "(default gpu). Team quotas are given per flavor."),
        "memory_gib": Float(min=0, help="The memory per device, reported in the ledger."),
        "resource": Text(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-zA-Z0-9]([-a-zA-Z0-9_.]*[a-zA-Z0-9])?$",
                         help="Kubernetes: the extended resource these GPUs are (default nvidia.com/gpu)."),
        "node_labels": Dict(Text(pattern=r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"),
                            key_trait=Text(pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?"
                                                   r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"),
                            maxlen=16,
                            help="Kubernetes: labels of the nodes that have this flavor (the ResourceFlavor's "
                                 "nodeLabels and the nodeSelector of notebook and job pods), e.g. "
                                 "nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3."),
        "tolerations": List(Record({
            "key": Text(min_length=1, max_length=316),
            "operator": Enum(["Exists", "Equal"]),
            "value": Text(max_length=63),
            "effect": Enum(["NoSchedule", "PreferNoSchedule", "NoExecute"]),
        }, required=("key",)), maxlen=16,
            help="Kubernetes: tolerations for the taints of those nodes (the ResourceFlavor's and the pods')."),
    }, required=("count",))


def _evaluation() -> Record:
    return Record({
        "notebook": Text(min_length=1, help="The evaluation notebook (.ipynb), read at every registration of a "
                                            "version (at most 16 MiB); relative paths start where danlu up runs. "
                                            "Keep it where only admins can write."),
        "profile": Unicode(help="The profile the evaluation job runs on (default the registrant's default "
                                "profile); the registrant must be allowed to use it."),
        "thresholds": Dict(Text(pattern=r"^\s*(>=|<=|==|>|<)\s*-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?\s*$"),
                           key_trait=Text(min_length=1, max_length=250), minlen=1, maxlen=50,
                           help='Metric name -> "OP VALUE", OP one of >= <= > < ==, e.g. accuracy: ">= 0.9". A '
                                "metric the evaluation run did not log fails its threshold."),
    }, required=("notebook", "thresholds"))


class PriorityClassTable(dict):
    """Priority class name -> value (higher is admitted first, and may preempt lower), in declared order.

    ``specs`` keeps each class as danlu.yaml declares it (``value``, ``default``, ``description``):
    the default class and Kueue's WorkloadPriorityClasses are read from it.
    """

    def __init__(self, specs: dict[str, dict]):
        super().__init__((name, int(spec["value"])) for name, spec in specs.items())
        self.specs = {name: dict(spec) for name, spec in specs.items()}

    @property
    def defaults(self) -> list[str]:
        """The classes marked default (danlu.yaml may mark one at most)."""
        return [name for name, spec in self.specs.items() if spec.get("default")]


class PriorityClasses(Dict):
    """danlu.yaml's ``priority_classes`` (name -> value, default, description), read as a :class:`PriorityClassTable`.

    An empty map means the built-in one: ``normal``, value 0, the default.
    """

    BUILTIN = {"normal": {"value": 0, "default": True}}

    def __init__(self, **kwargs):
        entry = Record({
            "value": Integer(min=-1_000_000_000, max=1_000_000_000,
                             help="Higher values are admitted first and may preempt lower ones."),
            "default": Bool(help="The class of jobs that name none. At most one class may set it."),
            "description": Unicode(help="Written into the rendered Kueue WorkloadPriorityClass."),
        }, required=("value",))
        super().__init__(entry, key_trait=Text(pattern=DNS_LABEL), default_value=self.BUILTIN, **kwargs)

    def validate(self, obj, value):
        if isinstance(value, PriorityClassTable):
            value = value.specs
        return PriorityClassTable(super().validate(obj, value) or self.BUILTIN)


# the sections ---------------------------------------------------------------------------------------------------

class _Options(Configurable):
    """Options of danlu.yaml at one level: traits, plus ``sections`` (key -> class) built as children."""

    #: danlu.yaml key -> the class of that section, built with this object as its parent
    sections: ClassVar[dict[str, type[Section]]] = {}
    #: JSON Schema that the traits cannot say, merged into this level's generated schema
    json_schema: ClassVar[dict] = {}
    key_path: tuple[str, ...] = ()

    def _build_sections(self) -> None:
        for key, cls in self.sections.items():
            setattr(self, key, cls(self, key))


class Section(_Options):
    """A section of danlu.yaml (``jobs:``, ``usage:``, ...); its options are its traits."""

    def __init__(self, parent: _Options, key: str):
        self.key_path = (*parent.key_path, key)
        super().__init__(parent=parent)
        self._build_sections()

    @property
    def base_dir(self) -> FilePath:
        """Where relative paths start: the folder ``danlu up`` runs in."""
        return self.parent.base_dir

    @property
    def root(self) -> Settings:
        node = self.parent
        while isinstance(node, Section):
            node = node.parent
        return node

    def where(self, name: str) -> str:
        """``file:line`` of one of this section's options (or of the section when it is not in the file)."""
        return self.root.where(*self.key_path, name)



class AuthConfig(Section):
    """How users log in (JupyterHub's authenticator)."""

    type = Enum(["pam", "github", "gitlab", "oidc", "shared-password", "dummy"], "pam",
                help="The authenticator: pam (the machine's Unix accounts and passwords), github, gitlab, oidc "
                     "(OAuthenticator), shared-password (JupyterHub's, for workshops: anyone with the password may "
                     "log in as any non-admin user), dummy (any password; tests only).").tag(config=True)
    allowed_users = List(Unicode(), help="Only these users may log in, plus any other allow-list below.").tag(
        config=True)
    client_id = Unicode(None, allow_none=True, help="github, gitlab, oidc (required): the OAuth client's id.").tag(
        config=True)
    client_secret = Unicode(None, allow_none=True,
                            help="github, gitlab, oidc (required): the OAuth client's secret.").tag(config=True)
    oauth_callback_url = Text(None, allow_none=True, pattern=URL,
                              help="github, gitlab, oidc (required): <public_url>/hub/oauth_callback, registered "
                                   "with the provider.").tag(config=True)
    allowed_organizations = List(Unicode(), help="github: members of these GitHub organizations, or org:team, may "
                                                 "log in.").tag(config=True)
    allowed_gitlab_groups = List(Unicode(), help="gitlab: members of these GitLab groups may log in.").tag(
        config=True)
    gitlab_url = Text(None, allow_none=True, pattern=URL,
                      help="gitlab: a self-hosted GitLab (default OAuthenticator's, https://gitlab.com).").tag(
        config=True)
    authorize_url = Text(None, allow_none=True, pattern=URL,
                         help="oidc (required): the provider's authorization endpoint.").tag(config=True)
    token_url = Text(None, allow_none=True, pattern=URL, help="oidc (required): the provider's token endpoint.").tag(
        config=True)
    userdata_url = Text(None, allow_none=True, pattern=URL,
                        help="oidc (required): the provider's userinfo endpoint.").tag(config=True)
    username_claim = Unicode("preferred_username", help="oidc: the claim that becomes the hub user name.").tag(
        config=True)
    scope = List(Unicode(), ["openid", "profile", "email", "groups"], help="oidc: the scopes requested.").tag(
        config=True)
    allowed_groups = List(Unicode(), help="oidc: values of the groups claim that may log in. Turns manage_groups "
                                          "on (OAuthenticator reads groups only when it manages them).").tag(
        config=True)
    manage_groups = Bool(False, help="oidc: take JupyterHub group membership (teams) from the groups claim of the "
                                     "userinfo response at every login.").tag(config=True)
    user_password = Text(None, allow_none=True, min_length=8,
                         help="shared-password (required): the password every non-admin user logs in with (8+ "
                              "characters).").tag(config=True)
    admin_password = Text(None, allow_none=True, min_length=32,
                          help="shared-password: the password the admin_users log in with (32+ characters). "
                               "Without it, admins cannot log in.").tag(config=True)
    options = Dict(help="Any further traits of the authenticator class, passed through as JupyterHub "
                        'configuration, e.g. {scope: ["read:org"]} for GitHub.').tag(config=True)

    json_schema = {"allOf": [
        {"if": {"properties": {"type": {"enum": ["github", "gitlab", "oidc"]}}, "required": ["type"]},
         "then": {"required": ["client_id", "client_secret", "oauth_callback_url"]}},
        {"if": {"properties": {"type": {"const": "oidc"}}, "required": ["type"]},
         "then": {"required": ["authorize_url", "token_url", "userdata_url"]}},
        {"if": {"properties": {"type": {"const": "shared-password"}}, "required": ["type"]},
         "then": {"required": ["user_password"]}},
    ]}


class UsersConfig(Section):
    """Which account runs users' servers and jobs."""

    unix_accounts = Enum(["auto", "on", "off"], "auto",
                         help="on: each user's server and jobs run as the Unix account of the same name (needs "
                              "root); off: everything runs as the account running danlu up, with homes under "
                              "<state_dir>/users; auto: on when danlu up runs as root and other accounts can run "
                              "its Python.").tag(config=True)


class GpusConfig(Section):
    """The GPU inventory: detected through NVML / nvidia-smi unless declared."""

    detect = Bool(True, help="Look for NVIDIA GPUs at start, through NVML if pynvml is installed, else "
                             "nvidia-smi. Ignored when declared is set.").tag(config=True)
    declared = List(_gpu_group(), help="Declared devices, in index order: groups of count and flavor. Declared "
                                       "GPUs are what Danlu allocates, present or not.").tag(config=True)


class ResourcesConfig(Section):
    """What jobs may use besides GPUs (counted, not enforced)."""

    cpu = Positive(None, allow_none=True,
                   help="The CPUs all running jobs may ask for together (default: this machine's CPU count). It "
                        "may be set above the number of cores to let more jobs run at once.").tag(config=True)
    memory = Size(None, allow_none=True, help="The memory all running jobs may ask for together: 512M, 64G, 1T, "
                                              "64Gi, or bytes (default unlimited).").tag(config=True)


class JobsConfig(Section):
    """Jobs: where they run, their limits, retries and warm runners."""

    backend = Text("local", pattern=r"^([A-Za-z0-9_.-]+|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$",
                   help="Where jobs run: the name of a danlu.backends entry point (local: processes on this "
                        "machine, admitted by Danlu's own quota model; kubernetes: TrainJobs admitted by Kueue, see "
                        "docs/kubernetes.md) or an import string module:Class.").tag(config=True)
    database_url = Unicode(None, allow_none=True,
                           help="The SQLAlchemy URL of the jobs database, e.g. postgresql+psycopg://danlu@db/danlu "
                                "(default sqlite:///<state_dir>/danlu.sqlite).").tag(config=True)
    warm_runners = Integer(1, min=0, max=16,
                           help="Job runners kept started (papermill and a kernel loaded) per profile while it is in "
                                "use (with Unix accounts, per user too), so a job starts at once. 0 disables "
                                "them.").tag(config=True)
    warm_idle_seconds = Float(600.0, min=1,
                              help="A profile's warm runners that no job used (and no server start asked for) for "
                                   "this long are stopped, with their kernels; the next demand starts them "
                                   "again.").tag(config=True)
    warm_runners_max = Integer(4, min=0, max=256, help="The most warm runners waiting at once, every profile and "
                                                       "user together.").tag(config=True)
    warm_runners_per_user = Integer(2, min=0, max=64, help="With Unix accounts, the most warm runners waiting for "
                                                           "one user.").tag(config=True)
    max_nproc = Integer(64, min=1, help="The largest --nproc a job may ask for.").tag(config=True)
    grace_period_seconds = Float(10.0, min=0, help="The time between SIGTERM and SIGKILL when a job is cancelled or "
                                                   "outruns its time limit.").tag(config=True)
    preemption_grace_seconds = Float(30.0, min=0, help="The time a preempted job gets between SIGTERM and SIGKILL "
                                                       "to checkpoint.").tag(config=True)
    max_runtime_seconds = Integer(7 * 24 * 3600, min=1,
                                  help="The longest one attempt of a job may run; a job's --timeout may ask for "
                                       "less, never more. A job that runs longer is stopped and ends "
                                       "timed_out.").tag(config=True)
    default_retries = Integer(0, min=0, max=100,
                              help="How many times a job whose attempt ended by an infrastructure failure (killed, "
                                   "lost) is retried when it does not say (--retries). At most "
                                   "max_retries.").tag(config=True)
    max_retries = Integer(10, min=0, max=100, help="The most retries a job may ask for.").tag(config=True)
    retry_backoff_seconds = Float(10.0, min=0, help="The wait before the first retry; it doubles for each further "
                                                    "retry, up to an hour.").tag(config=True)
    starvation_seconds = Float(600.0, min=0, help="A job that has waited this long has what it needs held back from "
                                                  "younger jobs of its team.").tag(config=True)


class MlflowConfig(Section):
    """The MLflow tracking server that danlu up starts (passed to mlflow server as they are: use absolute paths)."""

    port = Integer(0, min=0, max=65535, help="The loopback port of the MLflow tracking server (0: a free "
                                             "one).").tag(config=True)
    backend_store_uri = Unicode(None, allow_none=True, help="MLflow's backend store (default "
                                                            "sqlite:///<state_dir>/mlflow.db).").tag(config=True)
    artifacts_destination = Unicode(None, allow_none=True,
                                    help="Where MLflow stores artifacts (default <state_dir>/mlartifacts). The "
                                         "server proxies artifact uploads and downloads.").tag(config=True)
    workers = Integer(1, min=1, help="The MLflow server's worker processes.").tag(config=True)
    default_permission = Enum(["READ", "NO_PERMISSIONS"], "READ",
                              help="What every user may do with experiments (and their runs and artifacts) they "
                                   "neither created nor were granted: READ lets everyone read everything, "
                                   "NO_PERMISSIONS hides them.").tag(config=True)
    auth_database_uri = Unicode(None, allow_none=True,
                                help="Where MLflow keeps its users and permissions (its basic-auth app's "
                                     "database_uri; default sqlite:///<state_dir>/mlflow-auth.db).").tag(config=True)


class UsageConfig(Section):
    """Usage reports and what they keep."""

    gpu_hour_cost = Dict(Float(min=0), key_trait=Unicode(),
                         help="The cost of one GPU-hour per flavor, for usage reports (default cost 0).").tag(
        config=True)
    currency = Unicode("", help="The currency the costs are in, as reports show it.").tag(config=True)
    idle_server_minutes = Integer(30, min=1, help="A server that holds GPUs and has had no activity for this long "
                                                  "is reported as idle.").tag(config=True)
    sample_retention_days = Integer(14, min=1, max=36600,
                                    help="Days raw NVML utilization samples are kept. Older ones are deleted once "
                                         "they are rolled up into hourly and daily usage, which reports read and "
                                         "which are kept, with the jobs' attempts, for good.").tag(config=True)


class DatasetsConfig(Section):
    """Named dataset roots."""

    roots = Dict(Path(), key_trait=Unicode(),
                 help="Named dataset roots: --dataset shared:imagenet/train resolves to imagenet/train under the "
                      "root named shared. Relative paths start where danlu up runs.").tag(config=True)


class ModelsConfig(Section):
    """Who approves model versions and moves their aliases, and the evaluation that gates approval."""

    approvers = List(Text(min_length=1, max_length=255), maxlen=100,
                     help="Groups whose members may approve or reject model versions and set or delete aliases "
                          "(admins always may).").tag(config=True)
    self_approval = Bool(False, help="Whether the user who registered a version may decide on it.").tag(config=True)
    evaluations = Dict(_evaluation(), key_trait=Text(pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,126}[A-Za-z0-9])?$"),
                       help="Per registered model name, the notebook that evaluates each new version, the profile "
                            "it runs on and the metric thresholds it must meet (notebook paths read as absolute "
                            "ones).").tag(config=True)

    @validate("evaluations")
    def _notebooks_from_base_dir(self, proposal) -> dict:
        return {name: {**spec, "notebook": str(from_base(spec["notebook"], self.base_dir))}
                for name, spec in proposal.value.items()}


class HubConfig(Section):
    """JupyterHub itself."""

    idle_timeout_seconds = Integer(3600, min=0, help="Stop users' servers idle for this long (0 disables).").tag(
        config=True)
    extra_config_file = Path(None, allow_none=True,
                             help="A jupyterhub_config.py loaded after Danlu's settings: the escape hatch for any "
                                  "JupyterHub option. A relative path starts where danlu up runs; a missing file "
                                  "stops start-up.").tag(config=True)


class KubernetesMlflowConfig(Section):
    """MLflow and its PostgreSQL on the cluster (danlu render k8s)."""

    image = Text(None, allow_none=True, pattern=DIGEST,
                 help="The MLflow server image, pinned by digest (default the hub image, which has MLflow and "
                      "danlu).").tag(config=True)
    postgres_image = Text(None, allow_none=True, pattern=DIGEST,
                          help="The PostgreSQL image for MLflow's and Danlu's databases, pinned by digest (default a "
                               "placeholder that no registry serves).").tag(config=True)
    storage_class = Unicode(None, allow_none=True, help="The StorageClass of the database and artifact volumes "
                                                        "(default the cluster's default).").tag(config=True)
    database_size = Size("10Gi", help="The size of the database volume.").tag(config=True)
    artifacts_size = Size("50Gi", help="The size of the artifacts volume (none with "
                                       "artifacts_destination).").tag(config=True)
    artifacts_destination = Text(None, allow_none=True, pattern=r"^(s3|gs|wasbs)://",
                                 help="An object store for artifacts instead of a volume (s3://bucket/prefix, "
                                      "gs://...).").tag(config=True)


class KubernetesConfig(Section):
    """How Danlu runs on a Kubernetes cluster (danlu render k8s; jobs.backend kubernetes). See docs/kubernetes.md."""

    sections = {"mlflow": KubernetesMlflowConfig}
    mlflow: KubernetesMlflowConfig

    namespace = Text("danlu", pattern=DNS_LABEL, help="The one namespace of the hub, user pods, jobs and "
                                                      "LocalQueues.").tag(config=True)
    hub_image = Text(None, allow_none=True, pattern=DIGEST,
                     help="The hub image (the chart's hub image plus danlu), pinned by digest (default a placeholder "
                          "that no registry serves).").tag(config=True)
    runtime = Text("danlu-torch", pattern=DNS_LABEL,
                   help="The ClusterTrainingRuntime jobs run on (rendered by danlu render k8s).").tag(config=True)
    home_storage_class = Unicode(None, allow_none=True,
                                 help="The StorageClass of user homes (default the cluster's default). Jobs mount "
                                      "their owner's home, so it must be ReadWriteMany (NFS, CephFS, a cloud file "
                                      "store) for a job to run on another node than its notebook.").tag(config=True)
    home_size = Size("10Gi", help="The size of each user's home volume.").tag(config=True)
    shm_size = Size("8Gi", help="The size of the memory-backed /dev/shm of notebook and job pods.").tag(config=True)


# the root ------------------------------------------------------------------------------------------------------

class Settings(_Options):
    """danlu.yaml with flags and environment variables on top; every option has a usable default.

    Build it with :func:`load_settings` (a file, the environment, flags) or :meth:`from_data`
    (a dict, for tests and tools); ``Settings()`` is every default.
    """

    sections = {"auth": AuthConfig, "users": UsersConfig, "gpus": GpusConfig, "resources": ResourcesConfig,
                "jobs": JobsConfig, "mlflow": MlflowConfig, "usage": UsageConfig, "datasets": DatasetsConfig,
                "models": ModelsConfig, "hub": HubConfig, "kubernetes": KubernetesConfig}
    auth: AuthConfig
    users: UsersConfig
    gpus: GpusConfig
    resources: ResourcesConfig
    jobs: JobsConfig
    mlflow: MlflowConfig
    usage: UsageConfig
    datasets: DatasetsConfig
    models: ModelsConfig
    hub: HubConfig
    kubernetes: KubernetesConfig

    ip = Unicode("127.0.0.1", help="The address the proxy listens on (DANLU_IP, --ip); 0.0.0.0 for every "
                                   "interface.").tag(config=True)
    port = Integer(8000, min=1, max=65535, help="The port of the proxy, which is the workbench's only public port "
                                                "(DANLU_PORT, --port).").tag(config=True)
    state_dir = Path(".danlu", resolve=True,
                     help="Where the databases, job files, MLflow data, environments and tokens live "
                          "(DANLU_STATE_DIR, --state-dir). A relative path starts where danlu up runs.").tag(
        config=True)
    public_url = Text(pattern=URL, help="The address users reach the workbench at, used in links (job cards, danlu "
                                        "jobs show, MLflow run links). Set it when users come in by host name or "
                                        "through a reverse proxy.").tag(config=True,
                                                                        default_text="http://<ip>:<port>")
    admin_users = List(Text(pattern=r"^[a-z0-9][a-z0-9._-]*$"),
                       help="Hub users who are admins: JupyterHub admins, who also see every job, cancel any job, "
                            "read the GPU ledger and operate the queues.").tag(config=True)
    groups = Dict(List(Unicode()), key_trait=Unicode(),
                  help="JupyterHub groups and their members, created at start-up. Profiles are restricted by "
                       "group, and a group named under teams is a team.").tag(config=True)
    profiles_file = Path("kernel-images/profiles.yaml",
                         help="The governed profiles (DANLU_PROFILES_FILE). If the file does not exist, only a "
                              "built-in python profile on the workbench's own Python is offered.").tag(config=True)
    teams = Dict(_team(), key_trait=Text(pattern=DNS_LABEL),
                 help="Teams are JupyterHub groups; each is a queue with a nominal quota (a Kueue ClusterQueue and "
                      "its LocalQueue). Without teams, one queue, default, holds the whole machine.").tag(config=True)
    priority_classes = PriorityClasses(
        help="Priority classes (Kueue WorkloadPriorityClasses) jobs may ask for: name -> value (higher runs first), "
             "default, description. Read as name -> value.").tag(config=True)

    def __init__(self, config: Config | None = None, *, base_dir: str | os.PathLike | None = None,
                 source: str | None = None, marks: dict | None = None, origins: dict | None = None):
        # before the options load: relative paths among them start at base_dir
        self.base_dir = FilePath(base_dir) if base_dir else FilePath.cwd()
        self.source = source
        self.marks = dict(marks or {})
        self._origins = dict(origins or {})
        super().__init__(config=config if config is not None else Config())
        self._build_sections()

    @classmethod
    def from_data(cls, data: dict | None = None, *, base_dir: str | os.PathLike | None = None) -> Settings:
        """Settings from danlu.yaml's content as a dict, validated like the file; reads no environment variable."""
        data = copy.deepcopy(data or {})
        yamlconfig.validate(data, schema(), {}, "danlu.yaml data")
        config, origins = _config([(data, lambda path: ("data", ""))])
        return _built(lambda: cls(config, base_dir=base_dir, origins=origins), "danlu.yaml data")

    @default("public_url")
    def _public_url_default(self) -> str:
        return self.local_url

    @validate("public_url")
    def _no_trailing_slash(self, proposal) -> str:
        return proposal.value.rstrip("/")

    # what the options imply --------------------------------------------------------------------------------------
    @property
    def local_host(self) -> str:
        """The host processes on this machine use to reach the proxy."""
        return "127.0.0.1" if self.ip in ("", "0.0.0.0", "::") else self.ip

    @property
    def local_url(self) -> str:
        return f"http://{self.local_host}:{self.port}"

    @cached_property
    def unix_accounts(self) -> bool:
        """Whether servers and jobs run as each user's Unix account (see danlu.hub.accounts)."""
        return accounts.enabled(self.users.unix_accounts)

    def account(self, username: str) -> accounts.Account | None:
        """The Unix account a user's processes run as; None when everything runs as this account."""
        return accounts.lookup(username) if self.unix_accounts else None

    @property
    def jobs_database_url(self) -> str:
        return self.jobs.database_url or f"sqlite:///{self.state_dir / 'danlu.sqlite'}"

    @property
    def job_resources(self) -> dict:
        """CPU and memory jobs may use on this machine (memory: inf when not declared)."""
        cpu, memory = self.resources.cpu, self.resources.memory
        return {"cpu": float(cpu if cpu is not None else os.cpu_count() or 1),
                "memory": parse_size(memory) if memory is not None else float("inf")}

    @property
    def default_priority_class(self) -> str | None:
        defaults = self.priority_classes.defaults
        return defaults[0] if defaults else None

    @property
    def extra_config_file(self) -> FilePath | None:
        return self.hub.extra_config_file

    @property
    def dataset_roots(self) -> dict[str, FilePath]:
        return self.datasets.roots

    @property
    def jobs_dir(self) -> FilePath:
        return self.state_dir / "jobs"

    def user_home(self, username: str) -> FilePath:
        """A user's home folder: notebooks, datasets and job working directories live under it."""
        account = self.account(username)
        return FilePath(account.home) if account else self.state_dir / "users" / username

    # where the options came from ---------------------------------------------------------------------------------
    def where(self, *path: Any) -> str:
        """``file:line`` of a key, for errors found after schema validation."""
        return yamlconfig.line_of(self.marks, path, self.source or "danlu.yaml")

    def is_set(self, *path: str) -> bool:
        """Whether an option (``"jobs", "backend"``) or a section (``"auth"``) was given: in the file, the
        environment or a flag, rather than left to its default."""
        return tuple(path) in self._origins

    def origin(self, *path: str) -> tuple[str, str]:
        """Where an option's value came from: ``("file", "danlu.yaml:7")``, ``("environment", "DANLU_PORT")``,
        ``("flag", "--port")``, ``("data", "")`` or ``("default", "")``."""
        return self._origins.get(tuple(path), ("default", ""))

    def explicit(self) -> dict:
        """The options given (file, environment, flags), section by section, as danlu.yaml would hold them."""
        return self._explicit(type(self), ())

    def _explicit(self, cls: type[_Options], path: tuple) -> dict:
        given = self.config[cls.__name__] if self.config._has_section(cls.__name__) else {}
        out = {name: copy.deepcopy(given[name]) for name in options(cls) if name in given}
        for key, sub in cls.sections.items():
            if (*path, key) in self._origins:
                out[key] = self._explicit(sub, (*path, key))
        return out

    def walk(self) -> Iterator[_Options]:
        """Settings, then every section (and sub-section) in order."""
        def down(node: _Options):
            yield node
            for key in node.sections:
                yield from down(getattr(node, key))
        return down(self)


def schema() -> dict:
    """The JSON Schema of danlu.yaml, generated from the options' traits."""
    return copy.deepcopy(_schema())


@functools.cache
def _schema() -> dict:
    # $defs: shapes that other documents validate against too (the queue API's live quota changes: amounts)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "danlu.yaml",
            "description": "Every key is optional: Danlu runs with no file at all. `danlu config` lists every "
                           "option with its help.", **_level_schema(Settings),
            "$defs": {"amounts": schema_of(_amounts("Amounts per resource: gpus per flavor, cpu (cores), memory "
                                                    "(a size)."))}}


def _level_schema(cls: type[_Options]) -> dict:
    properties = {name: schema_of(trait) for name, trait in options(cls).items()}
    for key, sub in cls.sections.items():
        properties[key] = {"description": _first_paragraph(sub.__doc__), **_level_schema(sub)}
    return {"type": "object", "additionalProperties": False, "properties": properties, **cls.json_schema}


def _first_paragraph(doc: str | None) -> str:
    return " ".join(textwrap.dedent(doc or "").strip().split("\n\n")[0].split())


def _classes(cls: type[_Options]) -> Iterator[type[_Options]]:
    yield cls
    for sub in cls.sections.values():
        yield from _classes(sub)


def secret_options() -> list[tuple[str, ...]]:
    """Key paths of the options that hold secrets (``("auth", "client_secret")``, ...)."""
    def down(cls: type[_Options], path: tuple) -> Iterator[tuple[str, ...]]:
        yield from ((*path, name) for name in options(cls) if is_secret(name))
        for key, sub in cls.sections.items():
            yield from down(sub, (*path, key))
    return list(down(Settings, ()))


# loading --------------------------------------------------------------------------------------------------------

def _flatten(data: dict, cls: type[_Options] = Settings, path: tuple = ()) -> Iterator[tuple]:
    """(key path, class, option name or None for a section, value) of every key in danlu.yaml-shaped data."""
    for key, value in data.items():
        if key in cls.sections:
            yield (*path, key), cls.sections[key], None, value
            yield from _flatten(value or {}, cls.sections[key], (*path, key))
        else:
            yield (*path, key), cls, key, value


def _config(layers) -> tuple[Config, dict]:
    """One Config (class name -> options) from validated layers, the later winning; and where each key came from."""
    config, origins = Config(), {}
    for data, origin_of in layers:
        for path, cls, name, value in _flatten(data):
            if name is not None:
                config[cls.__name__][name] = copy.deepcopy(value)
            origins[path] = origin_of(path)
    return config, origins


def _built(make, source: str) -> Settings:
    try:
        settings = make()
    except TraitError as e:  # the schema let through what a trait refuses (e.g. 8000.0 for an integer)
        raise ConfigError(f"{source}: {e}") from None
    _check(settings)
    return settings


def _from_text(key: str, value: str, origin: str) -> Any:
    """A top-level option's value from an environment variable or a flag."""
    trait = options(Settings)[key]
    if isinstance(trait, Integer):
        try:
            number = int(value)
        except ValueError:
            raise ConfigError(f"{origin}: {key} must be a number, got {value!r}") from None
        if not trait.min <= number <= trait.max:
            raise ConfigError(f"{origin}: {key} {number} is out of range", fix=f"use {trait.min}-{trait.max}")
        return number
    return value


def load_settings(config_file: str | os.PathLike | None = None, overrides: dict | None = None,
                  *, environ: dict | None = None) -> Settings:
    """Read danlu.yaml (if any), then environment variables, then explicit overrides (flags).

    ``config_file`` defaults to ``$DANLU_CONFIG``. Relative paths inside the file
    are resolved against the directory ``danlu up`` runs in, like the
    ``--state-dir`` flag; child processes receive it as ``$DANLU_BASE_DIR``.
    ``overrides`` holds options as danlu.yaml would (``{"port": 8100}``); None values are skipped.
    """
    environ = os.environ if environ is None else environ
    config_file = config_file or env.CONFIG.get(environ=environ)
    layers, marks, source = [], {}, None
    if config_file:
        source = str(config_file)
        data, marks = yamlconfig.load_validated(config_file, schema())
        layers.append((data, lambda path: ("file", yamlconfig.line_of(marks, path, source))))
    from_env = {key: _from_text(key, environ[var], var) for key, var in ENV_OVERRIDES.items() if environ.get(var)}
    yamlconfig.validate(from_env, schema(), {}, "the environment")
    layers.append((from_env, lambda path: ("environment", ENV_OVERRIDES[path[0]])))
    flags = {}
    for key, value in (overrides or {}).items():
        if value is not None:
            flag = f"--{key.replace('_', '-')}"
            flags[key] = _from_text(key, str(value), flag) if key in ENV_OVERRIDES else copy.deepcopy(value)
    yamlconfig.validate(flags, schema(), {}, "the command line")
    layers.append((flags, lambda path: ("flag", "--" + ".".join(path).replace("_", "-"))))
    config, origins = _config(layers)
    base_dir = env.BASE_DIR.get(environ=environ) or FilePath.cwd()
    return _built(lambda: Settings(config, base_dir=base_dir, source=source, marks=marks, origins=origins),
                  source or "danlu.yaml")


def _check(settings: Settings) -> None:
    """What the traits cannot say: combinations of options, and the backend's name."""
    auth = settings.auth
    if (auth.manage_groups or auth.allowed_groups) and settings.groups:
        raise ConfigError(f"{settings.where('groups')}: groups cannot be listed when the identity provider "
                          "manages them (auth.manage_groups or auth.allowed_groups)",
                          fix="its groups claim decides membership then; remove 'groups'")
    if auth.allowed_groups and auth.type != "oidc":
        raise ConfigError(f"{auth.where('allowed_groups')}: auth.allowed_groups is for oidc",
                          fix="use allowed_organizations (github) or allowed_gitlab_groups (gitlab)")
    defaults = settings.priority_classes.defaults
    if len(defaults) > 1:
        raise ConfigError(f"{settings.where('priority_classes')}: priority classes {', '.join(defaults)} are all "
                          "marked default", fix="mark only one")
    jobs = settings.jobs
    if jobs.default_retries > jobs.max_retries:
        raise ConfigError(f"{jobs.where('default_retries')}: jobs.default_retries ({jobs.default_retries}) is above "
                          f"jobs.max_retries ({jobs.max_retries})", fix="lower default_retries or raise max_retries")
    for name, team in settings.teams.items():
        if team.get("cohort") is None and (team.get("borrowing_limit") or team.get("lending_limit")):
            raise ConfigError(f"{settings.where('teams', name)}: teams.{name} sets a borrowing or lending limit "
                              "but belongs to no cohort", fix=f"add teams.{name}.cohort, or remove the limits")
    extra = settings.extra_config_file
    if extra is not None and not extra.exists():
        raise ConfigError(f"{settings.hub.where('extra_config_file')}: {extra} does not exist",
                          fix="fix the path (relative paths start where danlu up runs)")
    _check_backend(settings)


@functools.cache
def _installed_backends() -> tuple[str, ...]:
    """The backends' names, looked up once per process (reading every distribution's entry points is slow)."""
    from danlu.hub.backends import backends

    return tuple(backends.names())


def _check_backend(settings: Settings) -> None:
    """jobs.backend names an installed backend (a danlu.backends entry point) or an importable module:Class."""
    from danlu.hub.backends import backends

    name = settings.jobs.backend
    where = settings.jobs.where("backend")
    if ":" in name:
        module = name.partition(":")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(f"{where}: jobs.backend: there is no module {module} to import {name} from",
                              fix="install the package that provides it, or name a backend: "
                                  + ", ".join(backends.names()))
        return
    if name in _installed_backends():
        return
    names = backends.names()  # again: one may have been registered since
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        raise ConfigError(f"{where}: jobs.backend: unknown backend '{name}'"
                          + (f", did you mean '{close[0]}'?" if close else ""),
                          fix=f"backends here: {', '.join(names)} (or an import string module:Class)")


# danlu config ---------------------------------------------------------------------------------------------------

_URL_PASSWORD = re.compile(r"(://[^:/@\s]+:)[^@\s]+@")


def _shown(value: Any, *, secret: bool = False) -> Any:
    """A value as danlu config shows it (JSON-ready): secrets hidden, paths as text, passwords in URLs masked."""
    if secret:
        return "(set)" if value not in (None, "") else "(not set)"
    if isinstance(value, PriorityClassTable):
        value = value.specs
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, str):
        return _URL_PASSWORD.sub(r"\1***@", value)
    if isinstance(value, dict):
        return {key: _shown(item, secret=isinstance(key, str) and is_secret(key)) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_shown(item) for item in value]
    return value


def describe(settings: Settings) -> list[dict]:
    """Every option with its type, default, current value, where that came from, and help; secrets hidden."""
    rows = []
    for node in settings.walk():
        for name, trait in options(type(node)).items():
            path = (*node.key_path, name)
            secret = is_secret(name)
            kind, where = settings.origin(*path)
            fallback = trait.metadata.get("default_text")
            rows.append({
                "key": ".".join(path), "section": ".".join(node.key_path), "class": type(node).__name__,
                "type": type_text(trait),
                "default": fallback if fallback else _shown(trait.default(), secret=secret),
                "value": _shown(getattr(node, name), secret=secret),
                "source": kind, "where": where, "help": " ".join(trait.help.split()),
            })
    return rows


def format_options(rows: list[dict], source: str | None) -> str:
    """``danlu config``'s text: a block per option, section by section, as ``jupyterhub --help-all`` prints traits."""
    came = {"file": "[{}]", "environment": "[${}]", "flag": "[{}]", "data": "[given]", "default": "[default]"}
    docs = {cls.__name__: _first_paragraph(cls.__doc__) for cls in _classes(Settings)}
    out = [f"danlu.yaml options, from {source or 'no file (every default)'}; danlu config --json for JSON"]
    section = None
    for row in rows:
        if row["section"] != section:
            section = row["section"]
            out += ["", f"{section or 'top level'} ({row['class']}): {docs[row['class']]}"]
        out += ["", f"{row['key']} = {json.dumps(row['value'])}  {came[row['source']].format(row['where'])}",
                f"    {row['type']}; default {json.dumps(row['default'])}"]
        out += textwrap.wrap(row["help"], 100, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(out) + "\n"
