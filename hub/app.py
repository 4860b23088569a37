"""``danlu up``: start the whole workbench on this machine, and stop all of it.

:class:`DanluUp` is the traitlets root of a workbench. It validates danlu.yaml
and the profiles, prepares the profile kernels, then starts and supervises:

1. the MLflow tracking server (SQLite and artifacts in the state dir) on a
   loopback port, with ``--static-prefix /services/mlflow`` and MLflow's
   basic-auth app, whose users are the hub's (:mod:`danlu.hub.mlflow_auth`);
2. JupyterHub, which starts configurable-http-proxy, the jobs service and the
   MLflow gateway as managed services, and users' servers.

Only one ``danlu up`` runs per state folder: a second one refuses, naming the
first, before it starts anything. Before anything opens the jobs database it is
brought to the current schema (a SQLite file is backed up first). Every
process carries ``DANLU_INSTANCE=<id>`` in its environment. On Ctrl-C or
SIGTERM, running jobs are interrupted and requeued, JupyterHub and MLflow are
stopped, and whatever still carries the marker is ended: no orphan remains.
"""

from __future__ import annotations

import fcntl
import getpass
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from traitlets import Bool, Unicode, default
from traitlets.config import Application

from danlu import __version__, env, proctree
from danlu.errors import ConfigError, DanluError
from danlu.hub import accounts, gpus, mlflow_auth
from danlu.hub.config import Settings, load_settings
from danlu.hub.environments import prepare_profiles
from danlu.hub.profiles import builtin_profiles, load_profiles
from danlu.hub.service.admission import quotas
from danlu.hub.service.jobs.recovery import interrupt_running_jobs
from danlu.hub.service.store import audit, schema
from danlu.hub.service.store.database import make_sessionmaker
from danlu.jobdir import write_json_atomic


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise DanluError(f"{what or url} exited with code {proc.returncode} while starting", reason="start_failed")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):  # HTTPError included: not routed yet
            pass
        time.sleep(0.25)
    raise DanluError(f"{what or url} did not answer within {timeout:.0f}s", reason="start_timeout")


class DanluUp(Application):
    name = "danlu up"
    description = "Start the Danlu workbench: JupyterHub, the jobs service and MLflow, on this machine."
    version = __version__

    ip = Unicode(None, allow_none=True, help="Address to listen on ($DANLU_IP; default 127.0.0.1).").tag(config=True)
    port = Unicode(None, allow_none=True, help="Port of the workbench ($DANLU_PORT; default 8000).").tag(config=True)
    state_dir = Unicode(None, allow_none=True, help="State folder ($DANLU_STATE_DIR; default .danlu/).").tag(
        config=True
    )
    config_file = Unicode(None, allow_none=True, help="A danlu.yaml ($DANLU_CONFIG).").tag(config=True)
    admin_token = Unicode(
        help="Admin API token for automation ($DANLU_ADMIN_TOKEN; else generated into <state-dir>/admin-token)."
    ).tag(config=True)
    quiet_hub = Bool(False, help="Write JupyterHub's log to <state-dir>/logs/jupyterhub.log only.").tag(config=True)

    aliases = {
        "ip": "DanluUp.ip",
        "port": "DanluUp.port",
        "state-dir": "DanluUp.state_dir",
        "config": "DanluUp.config_file",
        "log-level": "Application.log_level",
    }
    flags = {"quiet-hub": ({"DanluUp": {"quiet_hub": True}}, "Keep JupyterHub's log out of the terminal.")}

    @default("admin_token")
    def _admin_token_default(self):
        return env.ADMIN_TOKEN.get("")

    def _say(self, text: str) -> None:
        print(f"[danlu] {text}", flush=True)

    # preparation -----------------------------------------------------------------
    def load(self) -> Settings:
        settings = load_settings(self.config_file, {"ip": self.ip, "port": self.port, "state_dir": self.state_dir})
        profiles = load_profiles(settings.profiles_file) if settings.profiles_file.exists() else builtin_profiles()

        quotas.check(settings, gpus.inventory(settings.gpus))  # teams name GPU flavors this machine has
        settings.check_unix_login()  # Unix accounts only with a login that proves the account
        if not settings.profiles_file.exists():
            self.log.warning(
                "no profiles file at %s: offering only the built-in 'python' profile", settings.profiles_file
            )
        os.umask(0o077)  # databases, tokens, logs and job files: owner only, from the very first file
        state = settings.state_dir
        state.mkdir(parents=True, exist_ok=True)
        self.lock_state(state)
        # users' servers and jobs must reach the kernelspecs and environments, nothing else
        os.chmod(state, 0o711 if settings.unix_accounts else 0o700)
        (state / "logs").mkdir(mode=0o700, exist_ok=True)
        for path in state.iterdir():  # files an older Danlu (or MLflow) left open to others: the owner's only
            if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o077:
                os.chmod(path, 0o600)
        self.upgrade_database(settings)
        old = os.umask(0o022)  # the environments and kernelspecs are for every account to run
        try:
            prepare_profiles(state, profiles)
        finally:
            os.umask(old)
        self.profiles = profiles
        return settings

    def lock_state(self, state: Path) -> None:
        """Hold ``<state>/danlu-up.lock`` for this process's life, or refuse: one workbench per state folder."""
        fd = os.open(state / "danlu-up.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(
                f"another danlu up (pid {holder}) is already running on {state}",
                fix="stop it first, or give this one its own --state-dir",
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd  # released when this process ends, however it ends

    def upgrade_database(self, settings: Settings) -> None:
        """Bring the jobs database to this Danlu's schema (after a backup), and carry over old job inputs."""
        audit.use_key(audit.load_key(settings.state_dir))  # the upgrade to 0009 keys the audit chain
        done = schema.upgrade(settings.jobs_database_url, backup_dir=settings.state_dir / "backups", log=self.log)
        schema.make_private(settings.jobs_database_url)  # a database an older Danlu left readable is closed
        if done["from"] != done["to"]:
            self._say(
                f"jobs database: schema {done['from'] or 'new'} -> {done['to']}"
                + (f" (backup: {done['backup']})" if done["backup"] else "")
            )
        if done["from"] == schema.BASE_REVISION:
            carried = schema.import_legacy_inputs(
                make_sessionmaker(settings.jobs_database_url), settings.jobs_dir, log=self.log
            )
            if carried:
                self._say(f"carried over the notebooks of {len(carried)} unfinished job(s)")

    def resolve_admin_token(self, state: Path) -> str:
        if self.admin_token:
            return self.admin_token
        path = state / "admin-token"
        if path.exists():
            token = path.read_text().strip()
        else:
            token = secrets.token_hex(32)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token + "\n")
        os.chmod(path, 0o600)
        return token

    def chp_command(self) -> str:
        venv_bin = Path(sys.executable).parent
        found = shutil.which("configurable-http-proxy", path=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}")
        if not found:
            raise ConfigError(
                "configurable-http-proxy was not found",
                fix="run 'make install' (it installs it into .venv) or 'npm install -g configurable-http-proxy'",
            )
        return found

    # processes ------------------------------------------------------------------------
    def start_mlflow(self, settings: Settings, port: int, environ: dict) -> subprocess.Popen:
        state = settings.state_dir
        mlflow = settings.mlflow
        backend = mlflow.backend_store_uri or f"sqlite:///{state / 'mlflow.db'}"
        artifacts = mlflow.artifacts_destination or str(state / "mlartifacts")
        secret = mlflow_auth.ensure_secret(state)  # never in the hub's own environment (its proxy inherits it)
        config = mlflow_auth.write_auth_config(state, settings, secret)
        environ = {**environ, **mlflow_auth.server_environment(config, secret)}
        cmd = [
            sys.executable,
            "-m",
            "danlu.hub.mlflowserver",
            "--app-name",
            "basic-auth",
            "--backend-store-uri",
            backend,
            "--artifacts-destination",
            artifacts,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--static-prefix",
            "/services/mlflow",
            "--workers",
            str(mlflow.workers),
            "--allowed-hosts",
            f"127.0.0.1:{port},localhost:{port}",
        ]
        log = open(state / "logs" / "mlflow.log", "ab")
        return subprocess.Popen(
            cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=environ, start_new_session=True
        )

    def start_hub(self, settings: Settings, environ: dict) -> subprocess.Popen:
        state = settings.state_dir
        config = state / "jupyterhub_config.py"
        config.write_text(
            "# Generated by danlu up; edit danlu.yaml instead (hub.extra_config_file for raw JupyterHub options).\n"
            "from danlu.hub.hubconfig import configure\n"
            "settings = configure(c)\n"
            "if settings.extra_config_file:\n"
            "    load_subconfig(str(settings.extra_config_file))\n"
        )
        out = open(state / "logs" / "jupyterhub.log", "ab") if self.quiet_hub else None
        return subprocess.Popen(
            [sys.executable, "-m", "danlu.hub.hubmain", "-f", str(config)],
            cwd=str(state),
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def banner(self, settings: Settings, token_source: str) -> None:
        kind = settings.auth.type
        how = {
            "pam": "your account and password on this machine"
            + ("" if os.geteuid() == 0 else f" (only '{getpass.getuser()}' can log in unless danlu runs as root)"),
            "shared-password": "any allowed name with the shared password",
            "dummy": "any username and password (testing only!)",
        }.get(kind, f"log in with {kind}")
        self._say(f"Danlu {__version__} is up: {settings.public_url}")
        self._say(f"log in: {how}")
        for line in self.isolation(settings):
            self._say(line)
        self._say(f"admin API token: {token_source}")
        self._say(f"state and logs: {settings.state_dir}   stop: Ctrl-C")

    @staticmethod
    def isolation(settings: Settings) -> list[str]:
        """What the banner says about who can do what (docs/security.md says the same at length)."""
        if settings.unix_accounts:
            return [
                "servers and jobs run as each user's Unix account: the file system keeps users apart (docs/security.md)"
            ]
        me = getpass.getuser()
        lines = [f"servers and jobs run as '{me}', homes in {settings.state_dir / 'users'} (users.unix_accounts: off)"]
        single = settings.auth.type == "pam" and os.geteuid() != 0  # PAM without root: only this account
        if os.geteuid() == 0:
            why = (
                ""
                if accounts.runnable_by_others()
                else f"; other accounts cannot run {sys.executable}, so install Danlu where they can (e.g. /opt)"
            )
            lines.append(
                f"WARNING: that account is root: every user's code runs as root and can do anything on "
                f"this machine. Set users.unix_accounts: on{why}"
            )
        elif not single:
            lines.append(
                f"WARNING: every user's code runs as '{me}': any user can read and change every other "
                f"user's files, jobs, logs and the workbench's state, and act as '{me}'. Fine for one "
                "person or a team that trusts each other; to keep users apart, run danlu up as root with "
                "users.unix_accounts: on (docs/security.md)"
            )
        return lines

    # the whole life -----------------------------------------------------------------
    def start(self):
        try:
            settings = self.load()
            chp = self.chp_command()
        except DanluError as e:
            print(f"danlu up: {e}", file=sys.stderr)
            self.exit(2)
        state = settings.state_dir
        token = self.resolve_admin_token(state)
        token_source = f"${env.ADMIN_TOKEN}" if self.admin_token else str(state / "admin-token")
        instance = uuid.uuid4().hex
        mlflow_port = settings.mlflow.port or free_port()
        mlflow_url = f"http://127.0.0.1:{mlflow_port}/services/mlflow"
        environ = {
            **os.environ,
            env.INSTANCE: instance,
            env.STATE_DIR: str(state),
            env.BASE_DIR: str(settings.base_dir),
            env.CONFIG: str(Path(settings.source).resolve()) if settings.source else "",
            env.IP: settings.ip,
            env.PORT: str(settings.port),
            env.ADMIN_TOKEN: token,
            env.MLFLOW_URL: mlflow_url,
            env.HUB_PORT: str(free_port()),
            env.PROXY_API_PORT: str(free_port()),
            env.SERVICE_PORT: str(free_port()),
            env.GATEWAY_PORT: str(free_port()),
            "CONFIGPROXY_AUTH_TOKEN": secrets.token_hex(32),
            "PATH": f"{Path(chp).parent}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
            f"{os.environ.get('PATH', '')}",
            "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
            # MLflow and JupyterHub, and through them every process: no telemetry unless allowed
            **env.private_environment(settings.privacy.allow_outbound),
        }
        procs: list[tuple[str, subprocess.Popen]] = []
        stop = {"signal": None}

        def on_signal(signum, _frame):
            stop["signal"] = signum

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        code = 0
        try:
            self._say(f"starting MLflow on 127.0.0.1:{mlflow_port}")
            mlflow = self.start_mlflow(settings, mlflow_port, environ)
            procs.append(("mlflow", mlflow))
            wait_http(f"{mlflow_url}/health", 180, mlflow, "MLflow")  # the one route that needs no login
            self._say(f"starting JupyterHub on {settings.ip}:{settings.port}")
            hub = self.start_hub(settings, environ)
            procs.append(("jupyterhub", hub))
            wait_http(f"{settings.local_url}/hub/api/", 180, hub, "JupyterHub")
            wait_http(f"{settings.local_url}/services/danlu/api/v1/health", 120, hub, "the jobs service")
            write_json_atomic(
                state / "danlu-up.json",
                {
                    "pid": os.getpid(),
                    "instance": instance,
                    "url": settings.public_url,
                    "local_url": settings.local_url,
                    "mlflow_url": mlflow_url,
                    "service_port": int(environ[env.SERVICE_PORT]),
                    "version": __version__,
                },
            )
            self.banner(settings, token_source)
            while stop["signal"] is None:
                for name, proc in procs:
                    if proc.poll() is not None:
                        self._say(f"{name} exited with code {proc.returncode}; stopping the workbench")
                        stop["signal"] = -1
                        code = 1
                time.sleep(0.5)
        except DanluError as e:
            print(f"danlu up: {e}", file=sys.stderr)
            code = 1
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self.shutdown(settings, procs, instance)
        self.exit(code)

    def shutdown(self, settings: Settings, procs, instance: str) -> None:
        self._say("stopping")
        hub = dict(procs).get("jupyterhub")
        if hub is not None and hub.poll() is None:
            hub.send_signal(signal.SIGTERM)  # stops servers, services and the proxy
            try:
                hub.wait(60)
            except subprocess.TimeoutExpired:
                proctree.kill_matching(hub.pid, grace=0)
        try:
            requeued = interrupt_running_jobs(settings)
            if requeued:
                self._say(f"interrupted and requeued {len(requeued)} running job(s): {', '.join(requeued)}")
        except Exception as e:  # the database may not exist yet
            self.log.warning("could not requeue running jobs: %s", e)
        for _name, proc in procs:
            if proc.poll() is None:
                proctree.kill_matching(proc.pid, grace=10)
        left = proctree.kill_matching(env={env.INSTANCE: instance}, grace=5)
        if left:
            self._say(f"ended {left} leftover process(es)")
        (settings.state_dir / "danlu-up.json").unlink(missing_ok=True)
        self._say("stopped")


def main(argv=None) -> int:
    app = DanluUp()
    try:
        app.initialize(argv)
        app.start()
    except SystemExit as e:
        return e.code or 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
