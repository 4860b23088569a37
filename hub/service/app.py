"""The jobs service process: ``python -m danlu.hub.service``.

JupyterHub starts it as a managed service (see :mod:`danlu.hub.hubconfig`) with
``JUPYTERHUB_SERVICE_URL``, ``JUPYTERHUB_SERVICE_PREFIX`` and its API token in
the environment, plus ``DANLU_CONFIG``/``DANLU_STATE_DIR``/``DANLU_BASE_DIR``
so it reads the same danlu.yaml as ``danlu up``, and ``DANLU_MLFLOW_URL``, the
loopback address of the MLflow server jobs log to. Only one runs per state
folder (a lock file). On start it re-attaches to attempts that were running
(a SIGKILLed service loses nothing) before it answers anyone. With
``hub.idle_timeout_seconds`` it also stops users' idle servers (:mod:`.culling`).
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
from tornado import web
from tornado.httpserver import HTTPServer
from traitlets import Instance, Integer, Unicode, default
from traitlets.config import Application

from danlu import __version__, env
from danlu.errors import ConfigError, DanluError
from danlu.hub import gpus as gpu_inventory
from danlu.hub.backends import backends
from danlu.hub.config import Settings, load_settings
from danlu.hub.profiles import builtin_profiles, load_profiles
from danlu.hub.service import culling, validation
from danlu.hub.service.api import jobs as handlers
from danlu.hub.service.api.web import MAX_BODY, NotFoundHandler
from danlu.hub.service.auth import GroupDirectory
from danlu.hub.service.jobs import provenance
from danlu.hub.service.manager import JobManager
from danlu.hub.service.mlflow_client import MlflowAccess
from danlu.hub.service.store import database as db
from danlu.hub.service.store.orm import make_sessionmaker


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
                raise ConfigError(f"another jobs service is running on {path.parent}",
                                  fix="stop it first: one workbench per state folder") from None
            time.sleep(0.5)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


class JobsServiceApp(Application):
    name = "danlu-jobs"
    description = "The Danlu jobs service (a JupyterHub service)."
    version = __version__

    backend = Unicode("", help="Where jobs run: a name from the danlu.backends entry points "
                               "(default: danlu.yaml's jobs.backend).").tag(config=True)
    mlflow_url = Unicode(help="Loopback URL of the MLflow tracking server jobs log to ($DANLU_MLFLOW_URL).").tag(
        config=True)
    service_url = Unicode(help="Where this service listens ($JUPYTERHUB_SERVICE_URL).").tag(config=True)
    service_prefix = Unicode("/services/danlu/", help="URL prefix ($JUPYTERHUB_SERVICE_PREFIX).").tag(config=True)
    ip = Unicode(help="The address to listen on (default: the host of service_url). On Kubernetes 0.0.0.0: the "
                      "proxy and job pods reach the service through the hub's Service name, which is no address "
                      "of the hub pod.").tag(config=True)
    schedule_interval = Integer(2, help="Seconds between admission passes when nothing else triggers one.").tag(
        config=True)
    settings_ = Instance(Settings, allow_none=True)

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

    def initialize(self, argv=None):
        super().initialize(argv)
        logging.getLogger("tornado.access").setLevel(logging.WARNING)
        self.settings_ = settings = load_settings()
        profiles_file = settings.profiles_file
        profiles = load_profiles(profiles_file) if profiles_file.exists() else builtin_profiles()
        inventory = gpu_inventory.inventory(settings.gpus)
        if settings.jobs["backend"] == "kubernetes":  # no danlu up runs on a cluster: the hub pod's service does
            db.upgrade(settings.jobs_database_url, backup_dir=settings.state_dir / "backups", log=self.log)
        else:
            db.check(settings.jobs_database_url)  # danlu up upgrades it; the service never runs on an unknown schema
        sessions = make_sessionmaker(settings.jobs_database_url)
        settings.jobs_dir.mkdir(parents=True, exist_ok=True)
        self._lock = hold_lock(settings.state_dir / "jobs-service.lock")
        # with Unix accounts each job's folder belongs to its user; the parent only lets them reach it
        os.chmod(settings.jobs_dir, 0o711 if settings.unix_accounts else 0o700)
        name = self.backend or settings.jobs["backend"]
        backend_cls = backends.get(name)
        if name == "kubernetes":
            k8s = settings.kubernetes
            backend = backend_cls(parent=self, settings=settings, profiles=profiles, namespace=k8s["namespace"],
                                  runtime=k8s["runtime"], logs_dir=str(settings.state_dir / "job-logs"))
        else:
            runner_env = {"JUPYTER_PATH": str(settings.state_dir / "share" / "jupyter")}
            if env.INSTANCE.get():
                runner_env[env.INSTANCE] = env.INSTANCE.get()
            jobs = settings.jobs
            backend = backend_cls(parent=self, jobs_root=str(settings.jobs_dir), runner_env=runner_env,
                                  warm_runners=jobs["warm_runners"], warm_idle_seconds=jobs["warm_idle_seconds"],
                                  warm_runners_max=jobs["warm_runners_max"],
                                  warm_runners_per_user=jobs["warm_runners_per_user"])
        self.hub_auth = HubOAuth(api_token=os.environ.get("JUPYTERHUB_API_TOKEN", ""), cache_max_age=60)
        service_api = f"{self.service_url.rstrip('/')}{self.service_prefix.rstrip('/')}/api/v1"
        mlflow = MlflowAccess(self.mlflow_url, env.MLFLOW_AUTH_SECRET.get(), log=self.log)
        self.manager = JobManager(settings=settings, profiles=profiles, inventory=inventory, sessions=sessions,
                                  backend=backend, groups=GroupDirectory(self.hub_auth), log=self.log,
                                  service_api=service_api, mlflow=mlflow)
        self.default_kernel = profiles.default.kernel_name
        self.manager.record_profiles(profiles)

    def make_app(self) -> web.Application:
        prefix = self.service_prefix
        return web.Application(
            handlers.routes(prefix) + [
                (f"{prefix.rstrip('/')}/oauth_callback", HubOAuthCallbackHandler),
                (rf"{prefix.rstrip('/')}/.*", NotFoundHandler),
            ],
            hub_auth=self.hub_auth, danlu_jobs=self.manager, cookie_secret=os.urandom(32),
            xsrf_cookies=False, log_function=self._log_request,
        )

    def _log_request(self, handler):
        status = handler.get_status()
        level = logging.WARNING if status >= 500 else (
            logging.INFO if handler.request.method != "GET" else logging.DEBUG)
        self.log.log(level, "%s %s %s %.1fms", status, handler.request.method, handler.request.uri,
                     1000 * handler.request.request_time())

    async def run(self) -> None:
        url = urlparse(self.service_url)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.manager.recover()  # before anyone, runners included, is answered
        server = HTTPServer(self.make_app(), max_body_size=MAX_BODY + 1024, xheaders=True)
        server.listen(url.port, self.ip or url.hostname)
        self.log.info("Danlu jobs service listening on %s%s", self.service_url, self.service_prefix)
        tasks = [asyncio.ensure_future(self.manager.run_forever(self.schedule_interval))]
        # the digest of the workbench's own Python (every installed distribution) is read once, now rather
        # than in the first submission
        tasks.append(asyncio.ensure_future(provenance.environment_of(self.settings_, self.manager.profiles.default)))
        tasks.append(asyncio.ensure_future(asyncio.to_thread(validation.warm)))  # likewise the validators
        idle = self.settings_.hub["idle_timeout_seconds"]
        if idle and self.settings_.jobs["backend"] != "kubernetes":  # on a cluster the chart's culler does it
            tasks.append(asyncio.ensure_future(culling.cull_forever(self.hub_auth.api_url, self.hub_auth.api_token,
                                                                    idle, self.log)))
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
