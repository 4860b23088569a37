"""The Jupyter server extension ``danlu.lab``: its options, its upstreams, its handlers.

:class:`DanluLab` is the one traitlets root of the server part of the lab
extension (configure it as ``c.DanluLab.<option>`` in a Jupyter server config,
or ``--DanluLab.<option>=`` on the server's command line). The defaults come
from the environment every Danlu server gets from the spawner: ``$DANLU_URL``,
``$JUPYTERHUB_API_TOKEN``, ``$MLFLOW_TRACKING_URI``, ``$MLFLOW_TRACKING_TOKEN``.
"""

from __future__ import annotations

import os
import sys
from urllib.parse import urlparse

from jupyter_server._tz import utcnow
from jupyter_server.extension.application import ExtensionApp
from tornado.ioloop import IOLoop, PeriodicCallback
from traitlets import Float, List, Unicode, default

from danlu import env
from danlu.lab.handlers import ROUTES
from danlu.lab.tensorboard import ROUTES as TENSORBOARD_ROUTES
from danlu.lab.tensorboard import TensorBoardManager
from danlu.lab.upstream import Upstream

#: JupyterLab's plugin that asks every new user whether to fetch Jupyter news, and checks for updates
ANNOUNCEMENTS = "@jupyterlab/apputils-extension:announcements"


def without_news(previous=None):
    """A ``page_config_hook``: where the server fetches no news (``LabApp.news_url`` None, as Danlu's
    spawners set unless ``privacy.allow_outbound``), JupyterLab's announcements plugin is off too, so
    nobody is asked whether to fetch news and the page never asks for an update check. ``previous``:
    a hook already set, which runs first."""

    def hook(handler, page_config):
        if previous is not None:
            page_config = previous(handler, page_config)
        if (page_config.get("news") or {}).get("disabled"):
            disabled = list(page_config.get("disabledExtensions") or [])
            if ANNOUNCEMENTS not in disabled:
                page_config["disabledExtensions"] = [*disabled, ANNOUNCEMENTS]
        return page_config

    return hook


class DanluLab(ExtensionApp):
    """Danlu's queue, experiments and TensorBoard endpoints in a user's Jupyter server."""

    name = "danlu_lab"
    load_other_extensions = True

    jobs_api_url = Unicode(
        help="The Danlu jobs service's REST API. Default: $DANLU_URL/services/danlu/api/v1, "
        "the workbench's loopback address that the spawner sets."
    ).tag(config=True)
    jobs_api_token = Unicode(
        help="Token for the jobs service. Default: $JUPYTERHUB_API_TOKEN, this server's own "
        "token (it may read and cancel its user's jobs)."
    ).tag(config=True)
    mlflow_url = Unicode(help="MLflow's tracking URI (the hub's MLflow gateway). Default: $MLFLOW_TRACKING_URI.").tag(
        config=True
    )
    mlflow_token = Unicode(help="Token for MLflow. Default: $MLFLOW_TRACKING_TOKEN, else $JUPYTERHUB_API_TOKEN.").tag(
        config=True
    )
    mlflow_ui_url = Unicode(
        help="Where browsers open MLflow (links to runs). Default: the path of mlflow_url, e.g. /services/mlflow/."
    ).tag(config=True)
    hub_api_url = Unicode(
        help="JupyterHub's REST API, to tell whether the user is an admin. Default: $JUPYTERHUB_API_URL."
    ).tag(config=True)
    hub_url = Unicode(
        help="Where browsers find the hub (Home, Token pages). Default: $JUPYTERHUB_BASE_URL + hub/."
    ).tag(config=True)
    user_name = Unicode(
        help="Whose server this is; upstream answers are filtered to them. "
        "Default: $JUPYTERHUB_USER, else the logged-in user."
    ).tag(config=True)
    request_timeout = Float(30.0, help="Seconds to wait for the jobs service or MLflow to answer.").tag(config=True)
    busy_check_seconds = Float(
        30.0, help="Seconds between two looks at the kernels: one busy counts as the server's activity."
    ).tag(config=True)
    output_dir = Unicode(
        "danlu-outputs", help="Folder under the server's root where 'Open output' saves a job's executed notebook."
    ).tag(config=True)
    tensorboard_idle_seconds = Float(
        600.0,
        help="Stop a TensorBoard after this many seconds with no request "
        "through its proxy (0: never). It starts again, under the same "
        "URL, when its page asks for anything.",
    ).tag(config=True)
    tensorboard_start_timeout = Float(90.0, help="Seconds a new TensorBoard may take to start answering.").tag(
        config=True
    )
    tensorboard_command = List(
        Unicode(),
        help="The command that starts TensorBoard; Danlu appends --logdir_spec, "
        "--host 127.0.0.1, --port and --path_prefix, and sets $DANLU_TENSORBOARD_TOKEN, which every "
        "request must carry (the default, python -m danlu.lab.tensorboard_main, refuses others: a "
        "loopback port is open to every account of the machine).",
    ).tag(config=True)

    @default("jobs_api_url")
    def _jobs_api_url(self):
        return f"{env.URL.get('http://127.0.0.1:8000').rstrip('/')}/services/danlu/api/v1"

    @default("jobs_api_token")
    def _jobs_api_token(self):
        return os.environ.get("JUPYTERHUB_API_TOKEN", "")

    @default("mlflow_url")
    def _mlflow_url(self):
        return os.environ.get("MLFLOW_TRACKING_URI", "http://127.0.0.1:8000/services/mlflow")

    @default("mlflow_token")
    def _mlflow_token(self):
        return os.environ.get("MLFLOW_TRACKING_TOKEN") or os.environ.get("JUPYTERHUB_API_TOKEN", "")

    @default("mlflow_ui_url")
    def _mlflow_ui_url(self):
        return urlparse(self.mlflow_url).path.rstrip("/") + "/"

    @default("hub_api_url")
    def _hub_api_url(self):
        return os.environ.get("JUPYTERHUB_API_URL", "")

    @default("hub_url")
    def _hub_url(self):
        return os.environ.get("JUPYTERHUB_BASE_URL", "/").rstrip("/") + "/hub/"

    @default("user_name")
    def _user_name(self):
        return os.environ.get("JUPYTERHUB_USER", "")

    @default("tensorboard_command")
    def _tensorboard_command(self):
        return [sys.executable, "-m", "danlu.lab.tensorboard_main"]

    # wiring ---------------------------------------------------------------------
    def initialize_settings(self):
        self.jobs = Upstream("Danlu jobs service", self.jobs_api_url, self.jobs_api_token, timeout=self.request_timeout)
        self.mlflow = Upstream(
            "MLflow tracking server",
            f"{self.mlflow_url.rstrip('/')}/api/2.0/mlflow",
            self.mlflow_token,
            timeout=self.request_timeout,
        )
        self.hub = Upstream("JupyterHub API", self.hub_api_url, self.jobs_api_token, timeout=self.request_timeout)
        self.tensorboards = TensorBoardManager(
            base_url=self.serverapp.base_url,
            command=list(self.tensorboard_command),
            idle_seconds=self.tensorboard_idle_seconds,
            start_timeout=self.tensorboard_start_timeout,
            log=self.log,
        )
        self._admin: bool | None = None
        self.settings.update({"danlu_lab": self, "danlu_tensorboards": self.tensorboards})
        # JupyterHub's single-user server sets its own page_config_hook after the extensions load: wrap
        # whichever hook is set once the server runs, before it answers any request
        IOLoop.current().add_callback(self._quiet_news)
        self._busy_check = PeriodicCallback(self.note_busy_kernels, self.busy_check_seconds * 1000)
        self._busy_check.start()

    def note_busy_kernels(self) -> None:
        """A kernel computing counts as the server's activity. Jupyter Server counts a kernel's messages only, so
        a cell that runs for an hour without output looks idle to the hub (and to the idle and GPU cullers,
        which read the hub's last activity); any ``*_last_activity`` setting is counted by the server."""
        if self.serverapp is None:
            return
        kernels = self.serverapp.kernel_manager.list_kernels()
        if any(k.get("execution_state") == "busy" for k in kernels):
            self.serverapp.web_app.settings["danlu_busy_kernels_last_activity"] = utcnow()

    def _quiet_news(self) -> None:
        if self.serverapp is None:  # not loaded by a server (never in a running lab)
            return
        settings = self.serverapp.web_app.settings
        settings["page_config_hook"] = without_news(settings.get("page_config_hook"))

    def initialize_handlers(self):
        self.handlers.extend(ROUTES + TENSORBOARD_ROUTES)

    async def is_admin(self) -> bool:
        """Whether the server's user is a hub admin (asked once; False if the hub cannot say)."""
        if self._admin is None:
            if not self.hub_api_url:
                return False
            try:
                self._admin = bool((await self.hub.fetch("GET", "/user") or {}).get("admin"))
            except Exception as e:  # noqa: BLE001 - the answer only decides whether quota bars show
                self.log.warning("danlu: could not ask the hub whether %s is an admin: %s", self.user_name, e)
                return False
        return self._admin

    async def stop_extension(self):
        self._busy_check.stop()
        await self.tensorboards.stop_all()
