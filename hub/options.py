"""The sections of danlu.yaml as traitlets options: one ``Configurable`` per section, each option a trait.

``jobs:`` is :class:`JobsConfig`, ``usage:`` :class:`UsageConfig`, and so on; :class:`~danlu.hub.config.Settings`
(the root, in :mod:`danlu.hub.config`) builds each with itself as parent and reaches it as ``settings.jobs``.
Every option is ``.tag(config=True)`` with a default and a help text, which ``danlu config`` prints and from
which danlu.yaml's JSON Schema is generated. Structured values (teams, priority classes, declared GPUs,
evaluations) are :class:`~danlu.hub.traits.Record` traits with named fields.
"""

from __future__ import annotations

from pathlib import Path as FilePath
from typing import TYPE_CHECKING, ClassVar

from traitlets import Bool, Enum, Float, Integer, Unicode, validate
from traitlets.config import Configurable

from danlu.hub.traits import Dict, List, Path, Positive, Record, Size, Text, from_base

if TYPE_CHECKING:
    from danlu.hub.config import Settings

#: a Kubernetes name (DNS label): teams, cohorts, priority classes, the namespace
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
#: a GPU flavor (a Kueue ResourceFlavor's name)
FLAVOR = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
#: an image pinned by digest
DIGEST = r"^[^@\s]+@sha256:[0-9a-f]{64}$"
URL = r"^https?://"
#: option names whose values are never shown (``danlu config``) nor rendered into a ConfigMap
SECRET_SUFFIXES = ("_password", "_secret")


def is_secret(name: str) -> bool:
    return name.endswith(SECRET_SUFFIXES)


# the shapes of structured values ------------------------------------------------------------------------------


def amounts(help: str) -> Record:
    return Record(
        {
            "gpus": Dict(
                Integer(min=0, max=1_000_000),
                key_trait=Text(pattern=FLAVOR),
                help="GPUs per flavor; the flavors must exist. Their order is the order in which the team's "
                "jobs try flavors.",
            ),
            "cpu": Float(min=0, max=1_000_000, help="CPUs (cores)."),
            "memory": Size(help="Memory: 512M, 64G, 1T, 64Gi, or bytes."),
        },
        help=help,
    )


def team_record() -> Record:
    return Record(
        {
            "quota": amounts("The nominal quota: what the team is guaranteed."),
            "cohort": Text(pattern=DNS_LABEL, help="The cohort whose members lend each other unused nominal quota."),
            "borrowing_limit": amounts(
                "The most the team may borrow from its cohort beyond its quota, per resource "
                "(default unlimited). Needs cohort."
            ),
            "lending_limit": amounts(
                "The most of its unused quota the team lends to its cohort (default all of it). Needs cohort."
            ),
            "preemption": Record(
                {
                    "within_team": Enum(
                        ["lower_priority", "never"],
                        help="lower_priority (default): a job may preempt lower-priority jobs of its own "
                        "team; never: it may not.",
                    ),
                    "reclaim": Enum(
                        ["any", "lower_priority", "never"],
                        help="any (default): a job that fits the team's nominal quota may preempt jobs of teams "
                        "that borrow from the cohort; lower_priority: only lower-priority ones; never.",
                    ),
                },
                help="Whom the team's jobs may preempt.",
            ),
        },
        required=("quota",),
    )


def gpu_group_record() -> Record:
    return Record(
        {
            "count": Integer(min=1, max=1024, help="The number of devices in this group."),
            "flavor": Text(
                pattern=FLAVOR,
                help="The resource flavor (GPU type) these devices are, e.g. a100 or sim "
                "(default gpu). Team quotas are given per flavor.",
            ),
            "memory_gib": Float(min=0, help="The memory per device, reported in the ledger."),
            "resource": Text(
                pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-zA-Z0-9]([-a-zA-Z0-9_.]*[a-zA-Z0-9])?$",
                help="Kubernetes: the extended resource these GPUs are (default nvidia.com/gpu).",
            ),
            "node_labels": Dict(
                Text(pattern=r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"),
                key_trait=Text(
                    pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?"
                    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
                ),
                maxlen=16,
                help="Kubernetes: labels of the nodes that have this flavor (the ResourceFlavor's "
                "nodeLabels and the nodeSelector of notebook and job pods), e.g. "
                "nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3.",
            ),
            "tolerations": List(
                Record(
                    {
                        "key": Text(min_length=1, max_length=316),
                        "operator": Enum(["Exists", "Equal"]),
                        "value": Text(max_length=63),
                        "effect": Enum(["NoSchedule", "PreferNoSchedule", "NoExecute"]),
                    },
                    required=("key",),
                ),
                maxlen=16,
                help="Kubernetes: tolerations for the taints of those nodes (the ResourceFlavor's and the pods').",
            ),
        },
        required=("count",),
    )


def evaluation_record() -> Record:
    return Record(
        {
            "notebook": Text(
                min_length=1,
                help="The evaluation notebook (.ipynb), read at every registration of a "
                "version (at most 16 MiB); relative paths start where danlu up runs. "
                "Keep it where only admins can write.",
            ),
            "profile": Unicode(
                help="The profile the evaluation job runs on (default the registrant's default "
                "profile); the registrant must be allowed to use it."
            ),
            "thresholds": Dict(
                Text(pattern=r"^\s*(>=|<=|==|>|<)\s*-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?\s*$"),
                key_trait=Text(min_length=1, max_length=250),
                minlen=1,
                maxlen=50,
                help='Metric name -> "OP VALUE", OP one of >= <= > < ==, e.g. accuracy: ">= 0.9". A '
                "metric the evaluation run did not log fails its threshold.",
            ),
        },
        required=("notebook", "thresholds"),
    )


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
        entry = Record(
            {
                "value": Integer(
                    min=-1_000_000_000,
                    max=1_000_000_000,
                    help="Higher values are admitted first and may preempt lower ones.",
                ),
                "default": Bool(help="The class of jobs that name none. At most one class may set it."),
                "description": Unicode(help="Written into the rendered Kueue WorkloadPriorityClass."),
            },
            required=("value",),
        )
        super().__init__(entry, key_trait=Text(pattern=DNS_LABEL), default_value=self.BUILTIN, **kwargs)

    def validate(self, obj, value):
        if isinstance(value, PriorityClassTable):
            value = value.specs
        return PriorityClassTable(super().validate(obj, value) or self.BUILTIN)


# the sections ---------------------------------------------------------------------------------------------------


class Options(Configurable):
    """Options of danlu.yaml at one level: traits, plus ``sections`` (key -> class) built as children."""

    #: danlu.yaml key -> the class of that section, built with this object as its parent
    sections: ClassVar[dict[str, type[Section]]] = {}
    #: JSON Schema that the traits cannot say, merged into this level's generated schema
    json_schema: ClassVar[dict] = {}
    key_path: tuple[str, ...] = ()

    def _build_sections(self) -> None:
        for key, cls in self.sections.items():
            setattr(self, key, cls(self, key))


class Section(Options):
    """A section of danlu.yaml (``jobs:``, ``usage:``, ...); its options are its traits."""

    def __init__(self, parent: Options, key: str):
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


class UsersConfig(Section):
    """Which account runs users' servers and jobs."""

    unix_accounts = Enum(
        ["auto", "on", "off"],
        "auto",
        help="on: each user's server and jobs run as the Unix account of the same name (needs "
        "root); off: everything runs as the account running danlu up, with homes under "
        "<state_dir>/users; auto: on when danlu up runs as root and other accounts can run "
        "its Python.",
    ).tag(config=True)
    uid_min = Integer(
        None,
        allow_none=True,
        min=1,
        help="With Unix accounts: the lowest UID a hub user may be mapped to (default UID_MIN of "
        "/etc/login.defs, else 1000). System accounts, below it, are never mapped.",
    ).tag(config=True)
    uid_max = Integer(
        None,
        allow_none=True,
        min=1,
        help="With Unix accounts: the highest UID a hub user may be mapped to (default UID_MAX of "
        "/etc/login.defs, else 60000).",
    ).tag(config=True)
    account_claim = Unicode(
        "",
        help="With Unix accounts and an OAuth login (oidc, github, gitlab): the claim (or user-data field) of "
        "the identity provider whose value is the user's Unix account name; it becomes the hub user name. "
        "Without it, Unix accounts refuse an OAuth login: a provider's user name proves no local account.",
    ).tag(config=True)


class GpusConfig(Section):
    """The GPU inventory: detected through NVML / nvidia-smi unless declared."""

    detect = Bool(
        True,
        help="Look for NVIDIA GPUs at start, through NVML if pynvml is installed, else "
        "nvidia-smi. Ignored when declared is set.",
    ).tag(config=True)
    declared = List(
        gpu_group_record(),
        help="Declared devices, in index order: groups of count and flavor. Declared "
        "GPUs are what Danlu allocates, present or not.",
    ).tag(config=True)


class ResourcesConfig(Section):
    """What jobs may use besides GPUs (counted, not enforced)."""

    cpu = Positive(
        None,
        allow_none=True,
        help="The CPUs all running jobs may ask for together (default: this machine's CPU count). It "
        "may be set above the number of cores to let more jobs run at once.",
    ).tag(config=True)
    memory = Size(
        None,
        allow_none=True,
        help="The memory all running jobs may ask for together: 512M, 64G, 1T, 64Gi, or bytes (default unlimited).",
    ).tag(config=True)


class JobsConfig(Section):
    """Jobs: where they run, their limits, retries and warm runners."""

    backend = Text(
        "local",
        pattern=r"^([A-Za-z0-9_.-]+|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$",
        help="Where jobs run: the name of a danlu.backends entry point (local: processes on this "
        "machine, admitted by Danlu's own quota model; kubernetes: TrainJobs admitted by Kueue, see "
        "docs/kubernetes.md) or an import string module:Class.",
    ).tag(config=True)
    database_url = Unicode(
        None,
        allow_none=True,
        help="The SQLAlchemy URL of the jobs database, e.g. postgresql+psycopg://danlu@db/danlu "
        "(default sqlite:///<state_dir>/danlu.sqlite).",
    ).tag(config=True)
    warm_runners = Integer(
        1,
        min=0,
        max=16,
        help="Job runners kept started (papermill and a kernel loaded) per profile while it is in "
        "use (with Unix accounts, per user too), so a job starts at once. 0 disables "
        "them.",
    ).tag(config=True)
    warm_idle_seconds = Float(
        600.0,
        min=1,
        help="A profile's warm runners that no job used (and no server start asked for) for "
        "this long are stopped, with their kernels; the next demand starts them "
        "again.",
    ).tag(config=True)
    warm_runners_max = Integer(
        4, min=0, max=256, help="The most warm runners waiting at once, every profile and user together."
    ).tag(config=True)
    warm_runners_per_user = Integer(
        2, min=0, max=64, help="With Unix accounts, the most warm runners waiting for one user."
    ).tag(config=True)
    max_nproc = Integer(64, min=1, help="The largest --nproc a job may ask for.").tag(config=True)
    grace_period_seconds = Float(
        10.0, min=0, help="The time between SIGTERM and SIGKILL when a job is cancelled or outruns its time limit."
    ).tag(config=True)
    preemption_grace_seconds = Float(
        30.0, min=0, help="The time a preempted job gets between SIGTERM and SIGKILL to checkpoint."
    ).tag(config=True)
    max_runtime_seconds = Integer(
        7 * 24 * 3600,
        min=1,
        help="The longest one attempt of a job may run; a job's --timeout may ask for "
        "less, never more. A job that runs longer is stopped and ends "
        "timed_out.",
    ).tag(config=True)
    default_retries = Integer(
        0,
        min=0,
        max=100,
        help="How many times a job whose attempt ended by an infrastructure failure (killed, "
        "lost) is retried when it does not say (--retries). At most "
        "max_retries.",
    ).tag(config=True)
    max_retries = Integer(10, min=0, max=100, help="The most retries a job may ask for.").tag(config=True)
    retry_backoff_seconds = Float(
        10.0, min=0, help="The wait before the first retry; it doubles for each further retry, up to an hour."
    ).tag(config=True)
    starvation_seconds = Float(
        600.0, min=0, help="A job that has waited this long has what it needs held back from younger jobs of its team."
    ).tag(config=True)


class MlflowConfig(Section):
    """The MLflow tracking server that danlu up starts (passed to mlflow server as they are: use absolute paths)."""

    port = Integer(0, min=0, max=65535, help="The loopback port of the MLflow tracking server (0: a free one).").tag(
        config=True
    )
    backend_store_uri = Unicode(
        None, allow_none=True, help="MLflow's backend store (default sqlite:///<state_dir>/mlflow.db)."
    ).tag(config=True)
    artifacts_destination = Unicode(
        None,
        allow_none=True,
        help="Where MLflow stores artifacts (default <state_dir>/mlartifacts). The "
        "server proxies artifact uploads and downloads.",
    ).tag(config=True)
    workers = Integer(1, min=1, help="The MLflow server's worker processes.").tag(config=True)
    default_permission = Enum(
        ["READ", "NO_PERMISSIONS"],
        "READ",
        help="What every user may do with experiments (and their runs and artifacts) they "
        "neither created nor were granted: READ lets everyone read everything, "
        "NO_PERMISSIONS hides them.",
    ).tag(config=True)
    auth_database_uri = Unicode(
        None,
        allow_none=True,
        help="Where MLflow keeps its users and permissions (its basic-auth app's "
        "database_uri; default sqlite:///<state_dir>/mlflow-auth.db).",
    ).tag(config=True)


class UsageConfig(Section):
    """Usage reports and what they keep."""

    gpu_hour_cost = Dict(
        Float(min=0),
        key_trait=Unicode(),
        help="The cost of one GPU-hour per flavor, for usage reports (default cost 0).",
    ).tag(config=True)
    currency = Unicode("", help="The currency the costs are in, as reports show it.").tag(config=True)
    idle_server_minutes = Integer(
        30, min=1, help="A server that holds GPUs and has had no activity for this long is reported as idle."
    ).tag(config=True)
    sample_retention_days = Integer(
        14,
        min=1,
        max=36600,
        help="Days raw NVML utilization samples are kept. Older ones are deleted once "
        "they are rolled up into hourly and daily usage, which reports read and "
        "which are kept, with the jobs' attempts, for good.",
    ).tag(config=True)


class DatasetsConfig(Section):
    """Named dataset roots."""

    roots = Dict(
        Path(),
        key_trait=Unicode(),
        help="Named dataset roots: --dataset shared:imagenet/train resolves to imagenet/train under the "
        "root named shared. Relative paths start where danlu up runs.",
    ).tag(config=True)


class ModelsConfig(Section):
    """Who approves model versions and moves their aliases, and the evaluation that gates approval."""

    approvers = List(
        Text(min_length=1, max_length=255),
        maxlen=100,
        help="Groups whose members may approve or reject model versions and set or delete aliases (admins always may).",
    ).tag(config=True)
    self_approval = Bool(False, help="Whether the user who registered a version may decide on it.").tag(config=True)
    evaluations = Dict(
        evaluation_record(),
        key_trait=Text(pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,126}[A-Za-z0-9])?$"),
        help="Per registered model name, the notebook that evaluates each new version, the profile "
        "it runs on and the metric thresholds it must meet (notebook paths read as absolute "
        "ones).",
    ).tag(config=True)

    @validate("evaluations")
    def _notebooks_from_base_dir(self, proposal) -> dict:
        return {
            name: {**spec, "notebook": str(from_base(spec["notebook"], self.base_dir))}
            for name, spec in proposal.value.items()
        }


class HubConfig(Section):
    """JupyterHub itself."""

    idle_timeout_seconds = Integer(3600, min=0, help="Stop users' servers idle for this long (0 disables).").tag(
        config=True
    )
    gpu_idle_timeout_seconds = Integer(
        900, min=0, help="Stop a server whose GPUs NVML saw idle, no kernel busy, this long (0: never; see profiles)."
    ).tag(config=True)
    gpu_idle_warning_seconds = Integer(300, min=0, help="Warn in JupyterLab this long before.").tag(config=True)
    gpu_idle_threshold_percent = Float(5.0, min=0.0, max=100.0, help="Busy from this NVML %.").tag(config=True)
    extra_config_file = Path(
        None,
        allow_none=True,
        help="A jupyterhub_config.py loaded after Danlu's settings: the escape hatch for any "
        "JupyterHub option. A relative path starts where danlu up runs; a missing file "
        "stops start-up.",
    ).tag(config=True)


class PrivacyConfig(Section):
    """What the workbench's own processes tell the outside world: by default, nothing."""

    allow_outbound = Bool(
        False,
        help="Let the workbench's own software reach the internet on its own: MLflow's usage telemetry "
        "(its server, its UI and every client, jobs included), JupyterLab's news feed, its update check "
        "and its extension manager's PyPI listing (pypi.org). Off (the default): every process runs with "
        "MLFLOW_DISABLE_TELEMETRY, DO_NOT_TRACK and HF_HUB_DISABLE_TELEMETRY set, and JupyterLab neither "
        "fetches news nor asks users whether to. Either way the site's proxy variables (HTTPS_PROXY, ...) "
        "reach every process. Users' own code is not limited by this: network policies do that.",
    ).tag(config=True)
