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
from typing import Any

from traitlets import Integer, TraitError, Unicode, default, validate
from traitlets.config import Config

from danlu import env
from danlu.errors import ConfigError
from danlu.hub import accounts, yamlconfig
from danlu.hub.backends import backends
from danlu.hub.k8s.options import KubernetesConfig
from danlu.hub.login_options import AuthConfig
from danlu.hub.options import (
    DNS_LABEL,
    URL,
    DatasetsConfig,
    GpusConfig,
    HubConfig,
    JobsConfig,
    MlflowConfig,
    ModelsConfig,
    Options,
    PriorityClasses,
    PriorityClassTable,
    PrivacyConfig,
    ResourcesConfig,
    UsageConfig,
    UsersConfig,
    amounts,
    is_secret,
    team_record,
)
from danlu.hub.teams import parse_size
from danlu.hub.traits import Dict, List, Path, Text, options, schema_of, type_text

ENV_OVERRIDES = {
    "ip": env.IP,
    "port": env.PORT,
    "state_dir": env.STATE_DIR,
    "profiles_file": env.PROFILES_FILE,
}

# the root ------------------------------------------------------------------------------------------------------


class Settings(Options):
    """danlu.yaml with flags and environment variables on top; every option has a usable default.

    Build it with :func:`load_settings` (a file, the environment, flags) or :meth:`from_data`
    (a dict, for tests and tools); ``Settings()`` is every default.
    """

    sections = {
        "auth": AuthConfig,
        "users": UsersConfig,
        "gpus": GpusConfig,
        "resources": ResourcesConfig,
        "jobs": JobsConfig,
        "mlflow": MlflowConfig,
        "usage": UsageConfig,
        "datasets": DatasetsConfig,
        "models": ModelsConfig,
        "hub": HubConfig,
        "privacy": PrivacyConfig,
        "kubernetes": KubernetesConfig,
    }
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
    privacy: PrivacyConfig
    kubernetes: KubernetesConfig

    ip = Unicode(
        "127.0.0.1", help="The address the proxy listens on (DANLU_IP, --ip); 0.0.0.0 for every interface."
    ).tag(config=True)
    port = Integer(
        8000,
        min=1,
        max=65535,
        help="The port of the proxy, which is the workbench's only public port (DANLU_PORT, --port).",
    ).tag(config=True)
    state_dir = Path(
        ".danlu",
        resolve=True,
        help="Where the databases, job files, MLflow data, environments and tokens live "
        "(DANLU_STATE_DIR, --state-dir). A relative path starts where danlu up runs.",
    ).tag(config=True)
    public_url = Text(
        pattern=URL,
        help="The address users reach the workbench at, used in links (job cards, danlu "
        "jobs show, MLflow run links). Set it when users come in by host name or "
        "through a reverse proxy.",
    ).tag(config=True, default_text="http://<ip>:<port>")
    admin_users = List(
        Text(pattern=r"^[a-z0-9][a-z0-9._-]*$"),
        help="Hub users who are admins: JupyterHub admins, who also see every job, cancel any job, "
        "read the GPU ledger and operate the queues.",
    ).tag(config=True)
    groups = Dict(
        List(Unicode()),
        key_trait=Unicode(),
        help="JupyterHub groups and their members, created at start-up. Profiles are restricted by "
        "group, and a group named under teams is a team.",
    ).tag(config=True)
    profiles_file = Path(
        "kernel-images/profiles.yaml",
        help="The governed profiles (DANLU_PROFILES_FILE). If the file does not exist, only a "
        "built-in python profile on the workbench's own Python is offered.",
    ).tag(config=True)
    teams = Dict(
        team_record(),
        key_trait=Text(pattern=DNS_LABEL),
        help="Teams are JupyterHub groups; each is a queue with a nominal quota (a Kueue ClusterQueue and "
        "its LocalQueue). Without teams, one queue, default, holds the whole machine.",
    ).tag(config=True)
    priority_classes = PriorityClasses(
        help="Priority classes (Kueue WorkloadPriorityClasses) jobs may ask for: name -> value (higher runs first), "
        "default, description. Read as name -> value."
    ).tag(config=True)

    def __init__(
        self,
        config: Config | None = None,
        *,
        base_dir: str | os.PathLike | None = None,
        source: str | None = None,
        marks: dict | None = None,
        origins: dict | None = None,
    ):
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

    @cached_property
    def uid_range(self) -> tuple[int, int]:
        """The UIDs hub users may be mapped to (users.uid_min/uid_max over /etc/login.defs)."""
        low, high = accounts.login_defs_range()
        return (self.users.uid_min or low, self.users.uid_max or high)

    def account(self, username: str) -> accounts.Account | None:
        """The Unix account a user's processes run as; None when everything runs as this account."""
        return accounts.lookup(username, self.uid_range) if self.unix_accounts else None

    def check_unix_login(self) -> None:
        """With Unix accounts, refuse a login that does not prove the account (a ConfigError naming the fix)."""
        if self.unix_accounts:
            accounts.check_login(self.auth.type, self.users.account_claim, self.auth.where("type"))

    @property
    def jobs_database_url(self) -> str:
        return self.jobs.database_url or f"sqlite:///{self.state_dir / 'danlu.sqlite'}"

    @property
    def job_resources(self) -> dict:
        """CPU and memory jobs may use on this machine (memory: inf when not declared)."""
        cpu, memory = self.resources.cpu, self.resources.memory
        return {
            "cpu": float(cpu if cpu is not None else os.cpu_count() or 1),
            "memory": parse_size(memory) if memory is not None else float("inf"),
        }

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

    def _explicit(self, cls: type[Options], path: tuple) -> dict:
        given = self.config[cls.__name__] if self.config._has_section(cls.__name__) else {}
        out = {name: copy.deepcopy(given[name]) for name in options(cls) if name in given}
        for key, sub in cls.sections.items():
            if (*path, key) in self._origins:
                out[key] = self._explicit(sub, (*path, key))
        return out

    def walk(self) -> Iterator[Options]:
        """Settings, then every section (and sub-section) in order."""

        def down(node: Options):
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
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "danlu.yaml",
        "description": "Every key is optional: Danlu runs with no file at all. `danlu config` lists every "
        "option with its help.",
        **_level_schema(Settings),
        "$defs": {
            "amounts": schema_of(amounts("Amounts per resource: gpus per flavor, cpu (cores), memory (a size)."))
        },
    }


def _level_schema(cls: type[Options]) -> dict:
    properties = {name: schema_of(trait) for name, trait in options(cls).items()}
    for key, sub in cls.sections.items():
        properties[key] = {"description": _first_paragraph(sub.__doc__), **_level_schema(sub)}
    return {"type": "object", "additionalProperties": False, "properties": properties, **cls.json_schema}


def _first_paragraph(doc: str | None) -> str:
    return " ".join(textwrap.dedent(doc or "").strip().split("\n\n")[0].split())


def _classes(cls: type[Options]) -> Iterator[type[Options]]:
    yield cls
    for sub in cls.sections.values():
        yield from _classes(sub)


def secret_options() -> list[tuple[str, ...]]:
    """Key paths of the options that hold secrets (``("auth", "client_secret")``, ...)."""

    def down(cls: type[Options], path: tuple) -> Iterator[tuple[str, ...]]:
        yield from ((*path, name) for name in options(cls) if is_secret(name))
        for key, sub in cls.sections.items():
            yield from down(sub, (*path, key))

    return list(down(Settings, ()))


# loading --------------------------------------------------------------------------------------------------------


def _flatten(data: dict, cls: type[Options] = Settings, path: tuple = ()) -> Iterator[tuple]:
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


def load_settings(
    config_file: str | os.PathLike | None = None, overrides: dict | None = None, *, environ: dict | None = None
) -> Settings:
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
    return _built(
        lambda: Settings(config, base_dir=base_dir, source=source, marks=marks, origins=origins), source or "danlu.yaml"
    )


def _check(settings: Settings) -> None:
    """What the traits cannot say: combinations of options, and the backend's name."""
    auth = settings.auth
    if (auth.manage_groups or auth.allowed_groups or auth.admin_groups) and settings.groups:
        raise ConfigError(
            f"{settings.where('groups')}: groups cannot be listed when the identity provider "
            "manages them (auth.manage_groups, auth.allowed_groups or auth.admin_groups)",
            fix="its groups claim decides membership then; remove 'groups'",
        )
    if (auth.allowed_groups or auth.admin_groups or auth.issuer) and auth.type != "oidc":
        key = "allowed_groups" if auth.allowed_groups else "admin_groups" if auth.admin_groups else "issuer"
        raise ConfigError(
            f"{auth.where(key)}: auth.{key} is for oidc",
            fix="set auth.type: oidc, or remove it (github: allowed_organizations; gitlab: allowed_gitlab_groups)",
        )
    defaults = settings.priority_classes.defaults
    if len(defaults) > 1:
        raise ConfigError(
            f"{settings.where('priority_classes')}: priority classes {', '.join(defaults)} are all marked default",
            fix="mark only one",
        )
    jobs = settings.jobs
    if jobs.default_retries > jobs.max_retries:
        raise ConfigError(
            f"{jobs.where('default_retries')}: jobs.default_retries ({jobs.default_retries}) is above "
            f"jobs.max_retries ({jobs.max_retries})",
            fix="lower default_retries or raise max_retries",
        )
    for name, team in settings.teams.items():
        if team.get("cohort") is None and (team.get("borrowing_limit") or team.get("lending_limit")):
            raise ConfigError(
                f"{settings.where('teams', name)}: teams.{name} sets a borrowing or lending limit "
                "but belongs to no cohort",
                fix=f"add teams.{name}.cohort, or remove the limits",
            )
    extra = settings.extra_config_file
    if extra is not None and not extra.exists():
        raise ConfigError(
            f"{settings.hub.where('extra_config_file')}: {extra} does not exist",
            fix="fix the path (relative paths start where danlu up runs)",
        )
    _check_backend(settings)


@functools.cache
def _installed_backends() -> tuple[str, ...]:
    """The backends' names, looked up once per process (reading every distribution's entry points is slow)."""
    return tuple(backends.names())


def _check_backend(settings: Settings) -> None:
    """jobs.backend names an installed backend (a danlu.backends entry point) or an importable module:Class."""
    name = settings.jobs.backend
    where = settings.jobs.where("backend")
    if ":" in name:
        module = name.partition(":")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(
                f"{where}: jobs.backend: there is no module {module} to import {name} from",
                fix="install the package that provides it, or name a backend: " + ", ".join(backends.names()),
            )
        return
    if name in _installed_backends():
        return
    names = backends.names()  # again: one may have been registered since
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        raise ConfigError(
            f"{where}: jobs.backend: unknown backend '{name}'" + (f", did you mean '{close[0]}'?" if close else ""),
            fix=f"backends here: {', '.join(names)} (or an import string module:Class)",
        )


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
            rows.append(
                {
                    "key": ".".join(path),
                    "section": ".".join(node.key_path),
                    "class": type(node).__name__,
                    "type": type_text(trait),
                    "default": fallback if fallback else _shown(trait.default(), secret=secret),
                    "value": _shown(getattr(node, name), secret=secret),
                    "source": kind,
                    "where": where,
                    "help": " ".join(trait.help.split()),
                }
            )
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
        out += [
            "",
            f"{row['key']} = {json.dumps(row['value'])}  {came[row['source']].format(row['where'])}",
            f"    {row['type']}; default {json.dumps(row['default'])}",
        ]
        out += textwrap.wrap(row["help"], 100, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(out) + "\n"
