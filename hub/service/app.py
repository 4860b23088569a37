"""The jobs service process: ``python -m danlu.hub.service``, and the traitlets root that wires it.

JupyterHub starts it as a managed service (see :mod:`danlu.hub.hubconfig`) with
``JUPYTERHUB_SERVICE_URL``, ``JUPYTERHUB_SERVICE_PREFIX`` and its API token in
the environment, plus ``DANLU_CONFIG``/``DANLU_STATE_DIR``/``DANLU_BASE_DIR``
so it reads the same danlu.yaml as ``danlu up``, and ``DANLU_MLFLOW_URL``, the
loopback address of the MLflow server jobs log to. :class:`JobsServiceApp`
builds, once: the database, the backend (``backend_class``, an entry point
name of the ``danlu.backends`` group, built with ``parent=`` itself), the
scheduler class (``scheduler_class``: Danlu's own admission, or the backend's
own queue when it has one -- the one place that asks), and the
:class:`~danlu.hub.service.manager.JobManager` around them. Only one service
runs per state folder (a lock file). On start it re-attaches to attempts that
were running (a SIGKILLed service loses nothing) before it answers anyone.
With ``hub.idle_timeout_seconds`` it also stops users' idle servers
(:mod:`.culling`).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import signal
import sys
import time
from urllib.parse import urlparse

from jupyterhub.services.auth import HubOAuth, HubOAuthCallbackHandler
from jupyterhub.traitlets import EntryPointType
from tornado import web
from tornado.httpserver import HTTPServer
from traitlets import Bool, Float, Instance, Integer, Type, Unicode, default
from traitlets.config import Application

from danlu import __version__, env
from danlu.errors import ConfigError, DanluError
from danlu.hub import gpus as gpu_inventory
from danlu.hub.backends import backends
from danlu.hub.backends.base import Backend
from danlu.hub.config import Settings, load_settings
from danlu.hub.profiles import builtin_profiles, load_profiles
from danlu.hub.service import culling, validation
from danlu.hub.service.api.routes import routes
from danlu.hub.service.api.runner import RateBounds
from danlu.hub.service.api.web import ANONYMOUS_BODY, MAX_BODY, NotFoundHandler
from danlu.hub.service.auth import GroupDirectory
from danlu.hub.service.jobs import gpuculling, outputs, provenance
from danlu.hub.service.jobs.scheduler import DanluScheduler, QueueingScheduler, Scheduler
from danlu.hub.service.manager import JobManager
from danlu.hub.service.mlflow_client import MlflowAccess
from danlu.hub.service.registry import copies
from danlu.hub.service.store import audit, schema
from danlu.hub.service.store.database import Database


def hold_lock(path, wait: float = 30.0):
    """An exclusive lock on ``path`` held for this process's life; ConfigError if another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise ConfigError(
                    f"another jobs service is running on {path.parent}",
                    fix="stop it first: one workbench per state folder",
                ) from None
            time.sleep(0.5)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def scheduler_class_for(backend_class: type[Backend]) -> type[Scheduler]:
    """Who admits the jobs ``backend_class`` runs: its own queue, if it has one (Kueue), else Danlu."""
    return QueueingScheduler if backend_class.queues else DanluScheduler


class JobsServiceApp(Application):
    name = "danlu-jobs"
    description = "The Danlu jobs service (a JupyterHub service)."
    version = __version__

    backend_class = EntryPointType(
        klass=Backend,
        entry_point_group="danlu.backends",
        help="Where jobs run: a name of the danlu.backends entry points (local: processes on this machine; "
        "kubernetes: Kueue-admitted TrainJobs) or the import name of a Backend class. Default: danlu.yaml's "
        "jobs.backend.",
    ).tag(config=True)
    scheduler_class = Type(
        klass=Scheduler,
        help="Who admits jobs: DanluScheduler (Danlu's own quotas, cohorts and preemption) or QueueingScheduler "
        "(the backend's own queue, as Kueue is on Kubernetes). Default: QueueingScheduler for a backend that "
        "queues attempts itself, else DanluScheduler.",
    ).tag(config=True)
    mlflow_url = Unicode(help="Loopback URL of the MLflow tracking server jobs log to ($DANLU_MLFLOW_URL).").tag(
        config=True
    )
    service_url = Unicode(help="Where this service listens ($JUPYTERHUB_SERVICE_URL).").tag(config=True)
    service_prefix = Unicode("/services/danlu/", help="URL prefix ($JUPYTERHUB_SERVICE_PREFIX).").tag(config=True)
    ip = Unicode(
        help="The address to listen on (default: the host of service_url). On Kubernetes 0.0.0.0: the "
        "proxy and job pods reach the service through the hub's Service name, which is no address "
        "of the hub pod."
    ).tag(config=True)
    schedule_interval = Integer(2, help="Seconds between admission passes when nothing else triggers one.").tag(
        config=True
    )
    upgrade_database = Bool(
        False,
        help="Upgrade the jobs database's schema at start, where no danlu up runs first "
        "(the hub pod); otherwise the service refuses a schema it does not know "
        "and never changes it.",
    ).tag(config=True)
    cull_idle_servers = Bool(
        True,
        help="Stop users' servers idle for danlu.yaml's hub.idle_timeout_seconds (off "
        "where the hub has a culler of its own: the chart's, on Kubernetes).",
    ).tag(config=True)
    config_file = Unicode(
        help="A traitlets configuration file of this service (c.JobsServiceApp.<option> = ...), read at start if "
        "it exists. Default: danlu_service_config.py beside danlu.yaml."
    ).tag(config=True)
    anonymous_max_body = Integer(
        ANONYMOUS_BODY,
        min=0,
        help="The most bytes of request body a caller no one has authenticated may send (413 beyond, before "
        "anything is buffered); authenticated callers keep each route's own bound (64 MiB for a submission).",
    ).tag(config=True)
    max_html_renders = Integer(
        2,
        min=1,
        help="Notebooks rendered as HTML at once (format=html); a request beyond gets a 503 with Retry-After "
        "rather than waiting. Each render takes a CPU core and up to a few hundred MiB of memory.",
    ).tag(config=True)
    runner_api_rate = Float(
        5.0,
        min=0.01,
        help="Requests per second each attempt's runner (and its job's code) may make to the runner API, on "
        "average; a spec read counts as 10. Beyond it: 429 with Retry-After.",
    ).tag(config=True)
    runner_api_burst = Integer(
        60,
        min=10,
        help="Requests an attempt may make to the runner API at once before runner_api_rate applies.",
    ).tag(config=True)
    dataset_scan_timeout = Float(
        3600.0,
        min=1,
        help="Seconds a dataset registration may spend reading the data (it runs in a child process, killed "
        "then); a registration that takes longer is refused, naming the limit.",
    ).tag(config=True)
    dataset_max_bytes = Integer(
        16 * 2**40,
        min=1,
        help="The most bytes (apparent size: a sparse file counts in full) a dataset version may hold; larger "
        "data is refused before any of it is read.",
    ).tag(config=True)
    outputs_per_user_bytes = Integer(
        outputs.PER_USER_DEFAULT,
        min=1,
        help="The most bytes of executed notebooks that runners hand over (job pods) the service keeps for one "
        "user, all their jobs together. An upload beyond prunes that user's oldest ended jobs' outputs first; "
        "if their running jobs' outputs alone are too many, it is refused (413, in the job's log).",
    ).tag(config=True)
    outputs_max_age_days = Float(
        outputs.MAX_AGE_DEFAULT,
        min=0,
        help="Days an ended job's handed-over notebooks are kept (0: no age limit); older ones are pruned hourly "
        "and reading them answers 410 Gone. The job's view shows outputs_pruned.",
    ).tag(config=True)
    model_max_bytes = Integer(
        copies.MAX_BYTES_DEFAULT,
        min=1,
        help="The most bytes of model files one registered version may hold: the service copies them at "
        "registration into <state>/models, where only it writes; a larger model is refused (413 model_too_large).",
    ).tag(config=True)
    sweep_max_trials = Integer(
        1000, min=1, help="The most trials one sweep may ask for (--trials); more is refused (400 naming trials)."
    ).tag(config=True)
    sweep_max_parallel = Integer(
        64,
        min=1,
        help="The most trials of one sweep under way at once (--parallel); the team's quota queues them beyond.",
    ).tag(config=True)
    gpu_sample_interval = Float(
        30.0,
        min=0.5,
        help="Seconds between two NVML samples of the detected GPUs (usage, GPU culling, the GPU metrics).",
    ).tag(config=True)
    sweep_interval = Float(
        5.0,
        min=0.01,
        help="Seconds between two reads of running trials' objectives from MLflow (and pruning decisions).",
    ).tag(config=True)
    sweeps_storage_url = Unicode(
        help="The SQLAlchemy URL of Optuna's storage for sweeps. Default: beside the jobs database "
        "(SQLite: <jobs database>-optuna.sqlite next to it; PostgreSQL: the same database, schema danlu_optuna)."
    ).tag(config=True)
    settings_ = Instance(Settings)

    @default("log_level")
    def _log_level(self):
        return logging.INFO

    @default("mlflow_url")
    def _mlflow_url(self):
        return env.MLFLOW_URL.get("")

    @default("service_url")
    def _service_url(self):
        return os.environ.get("JUPYTERHUB_SERVICE_URL", "http://127.0.0.1:10101")

    @default("service_prefix")
    def _service_prefix(self):
        return os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/danlu/")

    @default("backend_class")
    def _backend_class(self):
        return backends.get(self.settings_.jobs.backend)

    @default("scheduler_class")
    def _scheduler_class(self):
        return scheduler_class_for(self.backend_class)

    def initialize(self, argv=None):
        super().initialize(argv)
        logging.getLogger("tornado.access").setLevel(logging.WARNING)
        self.settings_ = settings = load_settings()
        config_file = self.config_file or str(settings.base_dir / "danlu_service_config.py")
        if os.path.isfile(config_file):
            self.load_config_file(os.path.basename(config_file), path=[os.path.dirname(config_file)])
        profiles_file = settings.profiles_file
        profiles = load_profiles(profiles_file) if profiles_file.exists() else builtin_profiles()
        inventory = gpu_inventory.inventory(settings.gpus)
        audit.use_key(audit.load_key(settings.state_dir))  # before an upgrade: 0009 keys the audit chain
        if self.upgrade_database:
            schema.upgrade(settings.jobs_database_url, backup_dir=settings.state_dir / "backups", log=self.log)
        else:
            schema.check(settings.jobs_database_url)  # danlu up upgrades it; the service never runs on an unknown one
        settings.jobs_dir.mkdir(parents=True, exist_ok=True)
        self._lock = hold_lock(settings.state_dir / "jobs-service.lock")
        # with Unix accounts each job's folder belongs to its user; the parent only lets them reach it
        os.chmod(settings.jobs_dir, 0o711 if settings.unix_accounts else 0o700)
        backend = self.backend_class(parent=self, settings=settings, profiles=profiles)
        # a token's answer (admin or not) is kept 30 s: with the OIDC refresh (30 s) a right taken away at the
        # provider is gone within a minute (issue 17); groups have their own 15 s cache (auth.GroupDirectory)
        self.hub_auth = HubOAuth(api_token=os.environ.get("JUPYTERHUB_API_TOKEN", ""), cache_max_age=30)
        service_api = f"{self.service_url.rstrip('/')}{self.service_prefix.rstrip('/')}/api/v1"
        mlflow = MlflowAccess(self.mlflow_url, env.MLFLOW_AUTH_SECRET.get(), log=self.log)
        self.manager = JobManager(
            settings=settings,
            profiles=profiles,
            inventory=inventory,
            database=Database.at(settings.jobs_database_url),
            backend=backend,
            groups=GroupDirectory(self.hub_auth),
            scheduler_class=self.scheduler_class,
            mlflow=mlflow,
            service_api=service_api,
            log=self.log,
        )
        self.manager.audit.record_profiles(profiles)
        self.manager.datasets.bound(timeout=self.dataset_scan_timeout, max_bytes=self.dataset_max_bytes)
        self.manager.models.max_bytes = self.model_max_bytes
        self.manager.sweeps.bound(
            max_trials=self.sweep_max_trials,
            max_parallel=self.sweep_max_parallel,
            interval=self.sweep_interval,
            storage_url=self.sweeps_storage_url or None,
        )
        self.manager.runner_api.outputs.bound(
            per_user_bytes=self.outputs_per_user_bytes, max_age_days=self.outputs_max_age_days
        )

    def make_app(self) -> web.Application:
        prefix = self.service_prefix
        return web.Application(
            routes(prefix)
            + [
                (f"{prefix.rstrip('/')}/oauth_callback", HubOAuthCallbackHandler),
                (rf"{prefix.rstrip('/')}/.*", NotFoundHandler),
            ],
            hub_auth=self.hub_auth,
            danlu_manager=self.manager,
            cookie_secret=os.urandom(32),
            xsrf_cookies=False,  # JupyterHub's own check, in HubOAuth, for every cookie-authenticated request
            danlu_anonymous_max_body=self.anonymous_max_body,
            danlu_html_renders=asyncio.Semaphore(self.max_html_renders),
            danlu_runner_rate=RateBounds(self.runner_api_rate, self.runner_api_burst),
            log_function=self._log_request,
        )

    def _log_request(self, handler):
        status = handler.get_status()
        level = (
            logging.WARNING if status >= 500 else (logging.INFO if handler.request.method != "GET" else logging.DEBUG)
        )
        self.log.log(
            level,
            "%s %s %s %.1fms",
            status,
            handler.request.method,
            handler.request.uri,
            1000 * handler.request.request_time(),
        )

    async def run(self) -> None:
        url = urlparse(self.service_url)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.manager.recover()  # before anyone, runners included, is answered
        await self.manager.runner_api.outputs.rebuild()  # each user's stored outputs, counted once
        server = HTTPServer(self.make_app(), max_body_size=MAX_BODY + 1024, xheaders=True)
        server.listen(url.port or 80, self.ip or url.hostname or "")
        self.log.info("Danlu jobs service listening on %s%s", self.service_url, self.service_prefix)
        tasks = [asyncio.ensure_future(self.manager.run_forever(self.schedule_interval))]
        # the digest of the workbench's own Python (every installed distribution) is read once, now rather
        # than in the first submission; likewise the validators are built
        default_profile = self.manager.profiles.default
        tasks.append(
            asyncio.ensure_future(
                provenance.environment_of(default_profile, in_image=self.backend_class.runs_in_images)
            )
        )
        tasks.append(asyncio.ensure_future(asyncio.to_thread(validation.warm)))
        tasks.append(asyncio.ensure_future(self.manager.runner_api.outputs.prune_forever()))
        idle = self.settings_.hub.idle_timeout_seconds
        if idle and self.cull_idle_servers:
            tasks.append(
                asyncio.ensure_future(
                    culling.cull_forever(self.hub_auth.api_url, self.hub_auth.api_token, idle, self.log)
                )
            )
        self.manager.scheduler.sample_interval = self.gpu_sample_interval
        gpu_culler = None
        if self.cull_idle_servers:  # servers idle on their GPUs: stopped after a warning (jobs.gpuculling)
            gpu_culler = gpuculling.for_service(self.manager, self.hub_auth.api_url, self.hub_auth.api_token, self.log)
        if gpu_culler is not None:
            self.manager.gpu_culler = gpu_culler
            tasks.append(asyncio.ensure_future(gpu_culler.run_forever(min(30.0, self.gpu_sample_interval))))
        await stop.wait()
        self.log.info("stopping the jobs service (running jobs continue)")
        server.stop()
        for task in tasks:
            task.cancel()
        await self.manager.stop()

    def start(self):
        asyncio.run(self.run())


def main(argv=None) -> int:
    app = JobsServiceApp()
    try:
        app.initialize(argv)
    except DanluError as e:
        print(f"danlu jobs service: {e}", file=sys.stderr)
        return 2
    app.start()
    return 0
