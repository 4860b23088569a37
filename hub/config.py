"""danlu.yaml: the one file an admin edits to configure a workbench.

:func:`load_settings` reads and validates it (schema in ``danlu.schema.yaml``,
line-accurate errors through :mod:`danlu.hub.yamlconfig`), applies the values
given as flags or environment variables on top, and returns :class:`Settings`,
an immutable view with every default filled in. ``danlu up``, the jobs service,
the MLflow gateway and the generated JupyterHub configuration all build their
configuration from the same Settings, so one file means the same thing to every
process. Precedence: command-line flag > environment variable > danlu.yaml >
built-in default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from danlu import env
from danlu.errors import ConfigError
from danlu.hub import accounts, yamlconfig

ENV_OVERRIDES = {
    "ip": env.IP,
    "port": env.PORT,
    "state_dir": env.STATE_DIR,
    "profiles_file": env.PROFILES_FILE,
}

JOB_DEFAULTS = {
    "backend": "local",
    "warm_runners": 1,
    "warm_idle_seconds": 600.0,
    "warm_runners_max": 4,
    "warm_runners_per_user": 2,
    "max_nproc": 64,
    "grace_period_seconds": 10.0,
    "max_runtime_seconds": 7 * 24 * 3600,
    "default_retries": 0,
    "max_retries": 10,
    "retry_backoff_seconds": 10.0,
    "preemption_grace_seconds": 30.0,
    "starvation_seconds": 600.0,
}

DEFAULT_QUEUE = "default"
_SIZE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


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


def schema() -> dict:
    return yamlconfig.load_schema("danlu.hub", "danlu.schema.yaml")


@dataclass(frozen=True)
class Settings:
    """Validated danlu.yaml plus overrides; every accessor returns a usable default."""

    data: dict = field(default_factory=dict)
    source: str | None = None
    marks: dict = field(default_factory=dict, repr=False)
    base_dir: Path = field(default_factory=Path.cwd)

    def _path(self, value: str) -> Path:
        path = Path(os.path.expanduser(value))
        return path if path.is_absolute() else (self.base_dir / path)

    @property
    def ip(self) -> str:
        return self.data.get("ip", "127.0.0.1")

    @property
    def port(self) -> int:
        return int(self.data.get("port", 8000))

    @cached_property
    def state_dir(self) -> Path:
        return self._path(self.data.get("state_dir", ".danlu")).resolve()

    @property
    def local_host(self) -> str:
        """The host processes on this machine use to reach the proxy."""
        return "127.0.0.1" if self.ip in ("", "0.0.0.0", "::") else self.ip

    @property
    def local_url(self) -> str:
        return f"http://{self.local_host}:{self.port}"

    @property
    def public_url(self) -> str:
        return self.data.get("public_url", self.local_url).rstrip("/")

    @property
    def admin_users(self) -> list[str]:
        return list(self.data.get("admin_users", []))

    @property
    def groups(self) -> dict[str, list[str]]:
        return {name: list(members) for name, members in self.data.get("groups", {}).items()}

    @property
    def auth(self) -> dict:
        return {"type": "pam", **self.data.get("auth", {})}

    @cached_property
    def unix_accounts(self) -> bool:
        """Whether servers and jobs run as each user's Unix account (see danlu.hub.accounts)."""
        return accounts.enabled(self.data.get("users", {}).get("unix_accounts", "auto"))

    def account(self, username: str) -> "accounts.Account | None":
        """The Unix account a user's processes run as; None when everything runs as this account."""
        return accounts.lookup(username) if self.unix_accounts else None

    @property
    def profiles_file(self) -> Path:
        return self._path(self.data.get("profiles_file", "kernel-images/profiles.yaml"))

    @property
    def jobs(self) -> dict:
        return {**JOB_DEFAULTS, **self.data.get("jobs", {})}

    @property
    def jobs_database_url(self) -> str:
        return self.jobs.get("database_url") or f"sqlite:///{self.state_dir / 'danlu.sqlite'}"

    @property
    def job_resources(self) -> dict:
        """CPU and memory jobs may use on this machine (memory: inf when not declared)."""
        declared = self.data.get("resources", {})
        return {"cpu": float(declared.get("cpu", os.cpu_count() or 1)),
                "memory": parse_size(declared["memory"]) if "memory" in declared else float("inf")}

    @property
    def teams(self) -> dict[str, dict]:
        """Team (queue) name -> its settings; without teams, one queue ``default`` holds everything."""
        return {name: dict(team) for name, team in self.data.get("teams", {}).items()}

    @property
    def priority_classes(self) -> dict[str, int]:
        classes = self.data.get("priority_classes") or {"normal": {"value": 0, "default": True}}
        return {name: int(spec["value"]) for name, spec in classes.items()}

    @property
    def default_priority_class(self) -> str | None:
        classes = self.data.get("priority_classes") or {"normal": {"value": 0, "default": True}}
        marked = [name for name, spec in classes.items() if spec.get("default")]
        return marked[0] if marked else None

    @property
    def usage(self) -> dict:
        """Usage reports and what they keep: costs, the idle-server threshold, and how many days raw NVML
        samples are kept once rolled up (hourly and daily rollups, and the jobs' attempts, are kept)."""
        return {"gpu_hour_cost": {}, "currency": "", "idle_server_minutes": 30, "sample_retention_days": 14,
                **self.data.get("usage", {})}

    @property
    def mlflow(self) -> dict:
        return dict(self.data.get("mlflow", {}))

    @property
    def gpus(self) -> dict:
        return {"detect": True, **self.data.get("gpus", {})}

    @property
    def kubernetes(self) -> dict:
        """The ``kubernetes`` section with its defaults."""
        data = dict(self.data.get("kubernetes", {}))
        return {"namespace": "danlu", "runtime": "danlu-torch", "home_size": "10Gi", "shm_size": "8Gi", **data,
                "mlflow": dict(data.get("mlflow", {}))}

    @property
    def extra_config_file(self) -> Path | None:
        value = self.hub.get("extra_config_file")
        return self._path(value) if value else None

    @property
    def dataset_roots(self) -> dict[str, Path]:
        roots = self.data.get("datasets", {}).get("roots", {})
        return {name: self._path(p) for name, p in roots.items()}

    @property
    def models(self) -> dict:
        """The ``models`` section: approver groups, self-approval, evaluations (notebook paths made absolute)."""
        data = self.data.get("models", {})
        evaluations = {name: {**spec, "notebook": str(self._path(spec["notebook"]))}
                       for name, spec in data.get("evaluations", {}).items()}
        return {"approvers": list(data.get("approvers", [])), "self_approval": bool(data.get("self_approval", False)),
                "evaluations": evaluations}

    @property
    def hub(self) -> dict:
        return {"idle_timeout_seconds": 3600, **self.data.get("hub", {})}

    @property
    def jobs_dir(self) -> Path:
        return self.state_dir / "jobs"

    def user_home(self, username: str) -> Path:
        """A user's home folder: notebooks, datasets and job working directories live under it."""
        account = self.account(username)
        return Path(account.home) if account else self.state_dir / "users" / username

    def where(self, *path: Any) -> str:
        """``file:line`` of a key, for errors found after schema validation."""
        return yamlconfig.line_of(self.marks, path, self.source or "danlu.yaml")


def _coerce_override(key: str, value: str, origin: str) -> Any:
    if key == "port":
        try:
            port = int(value)
        except ValueError:
            raise ConfigError(f"{origin}: port must be a number, got {value!r}") from None
        if not 0 < port < 65536:
            raise ConfigError(f"{origin}: port {port} is out of range", fix="use 1-65535")
        return port
    return value


def load_settings(config_file: str | os.PathLike | None = None, overrides: dict | None = None,
                  *, environ: dict | None = None) -> Settings:
    """Read danlu.yaml (if any), then environment variables, then explicit overrides.

    ``config_file`` defaults to ``$DANLU_CONFIG``. Relative paths inside the file
    are resolved against the directory ``danlu up`` runs in, like the
    ``--state-dir`` flag; child processes receive it as ``$DANLU_BASE_DIR``.
    """
    environ = os.environ if environ is None else environ
    config_file = config_file or env.CONFIG.get(environ=environ)
    data: dict = {}
    marks: dict = {}
    source = None
    if config_file:
        source = str(config_file)
        data, marks = yamlconfig.load_validated(config_file, schema())
        data = dict(data or {})
    for key, var in ENV_OVERRIDES.items():
        if environ.get(var):
            data[key] = _coerce_override(key, environ[var], var)
    for key, value in (overrides or {}).items():
        if value is not None:
            flag = f"--{key.replace('_', '-')}"
            data[key] = _coerce_override(key, str(value), flag) if key in ENV_OVERRIDES else value
    base_dir = Path(env.BASE_DIR.get(environ=environ) or Path.cwd())
    settings = Settings(data=data, source=source, marks=marks, base_dir=base_dir)
    _check(settings)
    return settings


def _check(settings: Settings) -> None:
    """What the schema cannot say: combinations of keys."""
    auth = settings.data.get("auth", {})
    if (auth.get("manage_groups") or auth.get("allowed_groups")) and settings.data.get("groups"):
        raise ConfigError(f"{settings.where('groups')}: groups cannot be listed when the identity provider "
                          "manages them (auth.manage_groups or auth.allowed_groups)",
                          fix="its groups claim decides membership then; remove 'groups'")
    if auth.get("allowed_groups") and auth.get("type") != "oidc":
        raise ConfigError(f"{settings.where('auth', 'allowed_groups')}: auth.allowed_groups is for oidc",
                          fix="use allowed_organizations (github) or allowed_gitlab_groups (gitlab)")
    classes = settings.data.get("priority_classes") or {}
    defaults = [name for name, spec in classes.items() if spec.get("default")]
    if len(defaults) > 1:
        raise ConfigError(f"{settings.where('priority_classes')}: priority classes {', '.join(defaults)} are all "
                          "marked default", fix="mark only one")
    retries, most = settings.jobs["default_retries"], settings.jobs["max_retries"]
    if retries > most:
        raise ConfigError(f"{settings.where('jobs', 'default_retries')}: jobs.default_retries ({retries}) is above "
                          f"jobs.max_retries ({most})", fix="lower default_retries or raise max_retries")
    for name, team in settings.data.get("teams", {}).items():
        if team.get("cohort") is None and (team.get("borrowing_limit") or team.get("lending_limit")):
            raise ConfigError(f"{settings.where('teams', name)}: teams.{name} sets a borrowing or lending limit "
                              "but belongs to no cohort", fix=f"add teams.{name}.cohort, or remove the limits")
    extra = settings.hub.get("extra_config_file")
    if extra and not settings.extra_config_file.exists():
        raise ConfigError(f"{settings.where('hub', 'extra_config_file')}: {settings.extra_config_file} does not exist",
                          fix="fix the path (relative paths start where danlu up runs)")
