"""``danlu render k8s``: danlu.yaml and the governed profiles as a cluster deployment, file by file.

:func:`render` is pure: :class:`~danlu.hub.config.Settings` plus the
:class:`~danlu.hub.profiles.ProfileSet` in, ``{file name: text}`` out, the same bytes wherever it
runs (sorted keys, no time stamps, no paths of the machine that renders), so a committed copy
(``helm-values/``) can be compared with a fresh rendering. :func:`write` puts the files in a
folder. The objects come from :mod:`danlu.hub.kueue`, :mod:`danlu.hub.k8s.manifests` and
:mod:`danlu.hub.k8s.values`; this module decides the values they get:

* the images: ``kubernetes.hub_image``, each profile's ``environment.image``,
  ``kubernetes.mlflow.image`` (default: the hub image, which has MLflow and danlu) and
  ``postgres_image``; an unset one becomes a placeholder pinned to an all-zero digest, which
  no registry serves, so a forgotten one fails at pull time instead of running something else;
* the cluster's own danlu.yaml (:func:`cluster_settings`): the admin's file, with the paths
  and stores that a cluster has instead of one machine's state folder;
* how users log in (:mod:`danlu.hub.k8s.auth`): an identity provider whose client secret the
  hub reads from the ``danlu-secrets`` Secret, or a trial that says so; never the chart's
  default, which lets anyone in.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from danlu.errors import ConfigError
from danlu.hub import gpus, kueue
from danlu.hub.config import Settings, secret_options
from danlu.hub.k8s import auth, kueueconfig, manifests, names, policies, readme, values
from danlu.hub.kueue import memory_quantity
from danlu.hub.profiles import ProfileSet

PLACEHOLDER_DIGEST = "sha256:" + "0" * 64
PLACEHOLDER_REGISTRY = "registry.example.com/danlu"
DEFAULT_POSTGRES = f"docker.io/library/postgres:17@{PLACEHOLDER_DIGEST}"
STATE_DIR = "/srv/jupyterhub/danlu"  # on the hub's own volume (the chart's sqlite-pvc)
FILES = (
    "README.md",
    "namespace.yaml",
    "kueue.yaml",
    "kueue-config.yaml",
    "trainer.yaml",
    "mlflow.yaml",
    "rbac.yaml",
    "values.yaml",
)


def placeholder(name: str) -> str:
    return f"{PLACEHOLDER_REGISTRY}/{name}@{PLACEHOLDER_DIGEST}"


def profile_image(profile) -> str:
    return profile.environment.get("image") or placeholder(profile.slug)


def _database_url(driver: str, database: str) -> str:
    # no password: libpq reads $PGPASSWORD, set from the danlu-secrets Secret
    return f"{driver}://{manifests.POSTGRES_USER}@{names.POSTGRES_SERVICE}:{names.POSTGRES_PORT}/{database}"


def check_no_secrets(settings: Settings) -> None:
    """danlu.yaml goes into a ConfigMap, which any reader of the namespace may read: refuse secrets."""
    for path in secret_options():
        if settings.is_set(*path):
            raise ConfigError(
                f"{settings.where(*path)}: {'.'.join(path)} would be written into the {names.CONFIG_MAP} ConfigMap",
                fix="remove it from the file you render and give it to the hub from a Secret "
                "(docs/kubernetes.md, Secrets)",
            )
    urls = {
        ("jobs", "database_url"): settings.jobs.database_url,
        ("mlflow", "backend_store_uri"): settings.mlflow.backend_store_uri,
        ("mlflow", "auth_database_uri"): settings.mlflow.auth_database_uri,
    }
    for (section, key), url in urls.items():
        url = url or ""
        if "@" in url and ":" in url.split("://", 1)[-1].split("@", 1)[0]:
            raise ConfigError(
                f"{settings.where(section, key)}: {section}.{key} holds a password",
                fix="leave the password out; the pods read it from $PGPASSWORD (danlu-secrets)",
            )


def cluster_settings(settings: Settings) -> dict:
    """The danlu.yaml the hub and MLflow read on the cluster (``/etc/danlu/danlu.yaml``).

    On top of the admin's file: jobs run as TrainJobs (``jobs.backend: kubernetes``); the state
    folder is on the hub's volume; profiles are ``/etc/danlu/profiles.yaml``; the jobs service and
    MLflow keep their data in Danlu's PostgreSQL and MLflow its artifacts on its volume (or the
    object store ``kubernetes.mlflow.artifacts_destination``), unless danlu.yaml names others.
    """
    data = settings.explicit()
    data.pop("profiles_file", None)
    data["auth"] = auth.cluster_auth(settings)
    data["state_dir"] = STATE_DIR
    data["profiles_file"] = f"{names.CONFIG_DIR}/profiles.yaml"
    jobs = data.setdefault("jobs", {})
    jobs["backend"] = "kubernetes"
    jobs.setdefault("database_url", _database_url("postgresql+psycopg", "danlu"))
    mlflow = data.setdefault("mlflow", {})
    mlflow.setdefault("backend_store_uri", _database_url("postgresql+psycopg", "mlflow"))
    mlflow.setdefault("auth_database_uri", _database_url("postgresql+psycopg", "mlflow_auth"))
    store = settings.kubernetes.mlflow.artifacts_destination
    mlflow.setdefault("artifacts_destination", store or manifests.ARTIFACTS_DIR)
    return data


def cluster_profiles(profiles: ProfileSet) -> dict:
    """profiles.yaml for the cluster: each environment is its image (built from the pinned requirements)."""
    out = []
    for p in profiles:
        entry: dict = {"slug": p.slug, "display_name": p.display_name}
        if p.description:
            entry["description"] = p.description
        if p.default:
            entry["default"] = True
        entry["environment"] = {"image": profile_image(p)}
        resources = {k: v for k, v in (("cpu", p.cpu), ("memory", p.memory)) if v is not None}
        resources["gpus"] = list(p.gpu_choices)
        entry["resources"] = resources
        if p.groups:
            entry["groups"] = list(p.groups)
        out.append(entry)
    return {"profiles": out}


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's files, the hub's extraConfig) as readable ``|`` blocks."""


def _str(dumper, value: str):
    style = "|" if "\n" in value and not value.endswith((" ", "\t")) and " \n" not in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _dump(data) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=True, default_flow_style=False, allow_unicode=True)


def _stream(objects: list[dict], header: str) -> str:
    return header + yaml.dump_all(
        objects, Dumper=_Dumper, sort_keys=True, default_flow_style=False, explicit_start=True, allow_unicode=True
    )


def _comment(text: str) -> str:
    return "".join(f"# {line}".rstrip() + "\n" for line in text.splitlines())


def values_text(data: dict, header: str) -> str:
    """The values as YAML, top-level keys sorted, each preceded by its comment (values.COMMENTS)."""
    parts = [header]
    for key in sorted(data):
        if key in values.COMMENTS:
            parts.append(_comment(values.COMMENTS[key]))
        parts.append(_dump({key: data[key]}))
    return "".join(parts)


def objects(settings: Settings, profiles: ProfileSet) -> dict[str, list[dict]]:
    """Every Kubernetes object, by the file it goes to (values.yaml apart: see :func:`chart_values`)."""
    check_no_secrets(settings)
    auth.check(settings)
    kube = settings.kubernetes
    ns = kube.namespace
    mlflow = kube.mlflow
    hub_image = kube.hub_image or placeholder("hub")
    notebook_image = profile_image(profiles.default)
    danlu_yaml = _dump(cluster_settings(settings))
    profiles_yaml = _dump(cluster_profiles(profiles))
    artifacts_claim = None if mlflow.artifacts_destination else f"{names.MLFLOW_SERVICE}-artifacts"
    storage_class = mlflow.storage_class
    mlflow_objects = [
        manifests.make_config_map(ns, danlu_yaml, profiles_yaml),
        manifests.make_postgres_init(ns),
        manifests.make_service(
            names.POSTGRES_SERVICE, ns, names.DATABASE, manifests.POSTGRES_POD, names.POSTGRES_PORT, headless=True
        ),
        manifests.make_postgres(
            ns, mlflow.postgres_image or DEFAULT_POSTGRES, memory_quantity(mlflow.database_size), storage_class
        ),
    ]
    if artifacts_claim:
        mlflow_objects.append(
            manifests.make_pvc(artifacts_claim, ns, names.MLFLOW, memory_quantity(mlflow.artifacts_size), storage_class)
        )
    mlflow_objects += [
        manifests.make_service(names.MLFLOW_SERVICE, ns, names.MLFLOW, manifests.MLFLOW_POD, names.MLFLOW_PORT),
        manifests.make_mlflow_deployment(
            ns,
            mlflow.image or hub_image,
            artifacts_claim=artifacts_claim,
            allow_outbound=settings.privacy.allow_outbound,
        ),
        *manifests.make_mlflow_policies(ns),
    ]
    return {
        "namespace.yaml": policies.namespace_objects(ns),
        "kueue.yaml": kueue.render(settings, gpus.inventory(settings.gpus), namespace=ns),
        "kueue-config.yaml": [kueueconfig.requirements(kube.pods_ready_timeout)],
        "trainer.yaml": [
            manifests.make_training_runtime(
                notebook_image, memory_quantity(kube.shm_size), kube.runtime, kube.image_pull_secrets
            )
        ],
        "mlflow.yaml": mlflow_objects,
        "rbac.yaml": manifests.make_jobs_rbac(ns),
    }


def chart_values(settings: Settings, profiles: ProfileSet) -> dict:
    kube = settings.kubernetes
    data = values.make_values(
        namespace=kube.namespace,
        hub_image=kube.hub_image or placeholder("hub"),
        notebook_image=profile_image(profiles.default),
        home_size=memory_quantity(kube.home_size),
        home_storage_class=kube.home_storage_class,
        idle_timeout=settings.hub.idle_timeout_seconds,
        allow_outbound=settings.privacy.allow_outbound,
    )
    data["hub"]["extraEnv"].update(auth.chart_env(settings))
    return data


def placeholders(settings: Settings, profiles: ProfileSet) -> list[str]:
    """The images still on a placeholder, for the README and the header comments."""
    kube = settings.kubernetes
    out = [] if kube.hub_image else ["kubernetes.hub_image"]
    out += [f"profile {p.slug}: environment.image" for p in profiles if not p.environment.get("image")]
    if not kube.mlflow.postgres_image:
        out.append("kubernetes.mlflow.postgres_image")
    return out


def render(settings: Settings, profiles: ProfileSet) -> dict[str, str]:
    """Every file of ``danlu render k8s``, by name."""
    source = Path(settings.source).name if settings.source else "(no danlu.yaml)"
    missing = placeholders(settings, profiles)
    header = _comment(f"Rendered by `danlu render k8s` from {source}; edit that file and render again.")
    header += _comment(auth.header(settings))
    if missing:
        header += _comment(
            f"Placeholder images ({PLACEHOLDER_DIGEST[:15]}...: replace with the digest you "
            f"pushed/pulled, in danlu.yaml or profiles.yaml): {', '.join(missing)}."
        )
    files = {name: _stream(objs, header) for name, objs in objects(settings, profiles).items()}
    files["values.yaml"] = values_text(
        chart_values(settings, profiles),
        header
        + _comment(
            f"Zero to JupyterHub chart {values.CHART_VERSION} values: helm upgrade --install danlu "
            f"jupyterhub/jupyterhub --version {values.CHART_VERSION} -n {settings.kubernetes.namespace} -f values.yaml"
        ),
    )
    files["README.md"] = readme.text(settings, source, missing) + auth.readme(settings)
    return {name: files[name] for name in FILES}


def write(files: dict[str, str], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
        written.append(out / name)
    return written
