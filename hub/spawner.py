"""The local spawner: a user's JupyterLab from a governed profile, on this machine.

:class:`DanluLocalSpawner` extends JupyterHub's local process spawner with
Danlu's profiles: the spawn form lists only the profiles the user's groups
allow (with their GPU choices), and every request -- form, REST API or stored
``user_options`` -- goes through the same server-side check
(:meth:`~danlu.hub.profiles.ProfileSet.authorize`) in ``apply_user_options``,
so a refused profile gets a 403 that names the profile and the reason. GPUs
come from the jobs service's ledger, the same one jobs use, and reach the
server as ``CUDA_VISIBLE_DEVICES``; they are given back when the server stops.
The server offers only its profile's kernel. It loads Danlu's lab extension (the
server extension :mod:`danlu.lab` and the prebuilt JupyterLab extension) because
they are installed in its environment the way Jupyter finds extensions (see
:mod:`danlu.lab`), not through its arguments.

With ``unix_accounts`` on (the default when the hub runs as root) a server
runs as the user's Unix account in its home folder, exactly as JupyterHub's
``LocalProcessSpawner`` does; otherwise as the hub's own account in a home
folder under the state dir (see :mod:`danlu.hub.accounts`).
"""

from __future__ import annotations

import asyncio
import html
import json
import os
from pathlib import Path

from jupyterhub.spawner import LocalProcessSpawner
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPClientError
from traitlets import Any, Bool, Dict, Integer, Tuple, Unicode, default

from danlu import env as names
from danlu.client import error_from
from danlu.errors import DanluError
from danlu.hub import accounts
from danlu.hub.profiles import ProfileSet, builtin_profiles, load_profiles


class DanluLocalSpawner(LocalProcessSpawner):
    """JupyterLab servers from governed profiles, as local processes."""

    profiles_file = Unicode(help="The governed profiles file (kernel-images/profiles.yaml).").tag(config=True)
    home_root = Unicode(help="Folder holding one home folder per user (when unix_accounts is off).").tag(config=True)
    unix_accounts = Bool(False, help="Run each server as the user's Unix account (needs root).").tag(config=True)
    uid_range = Tuple(
        Integer(), Integer(), default_value=(1000, 60000), help="The UIDs a user's Unix account may have."
    ).tag(config=True)
    jobs_api_url = Unicode(help="The jobs service's API (for GPU allocations), on loopback.").tag(config=True)
    jobs_api_token = Unicode(help="A token with custom:danlu:admin, used to reserve GPUs.").tag(config=True)
    extra_env = Dict(help="Environment added to every server (DANLU_URL, MLflow, JUPYTER_PATH).").tag(config=True)
    umask = Integer(
        0o077,
        help="The umask of every user server (and so of its kernels and terminals): by default "
        "what a user creates is theirs alone.",
    ).tag(config=True)
    profiles = Any(help="The loaded ProfileSet (read from profiles_file on first use).")

    @default("profiles")
    def _profiles_default(self) -> ProfileSet:
        path = Path(self.profiles_file) if self.profiles_file else None
        return load_profiles(path) if path and path.exists() else builtin_profiles()

    @default("apply_user_options")
    def _apply_default(self):
        return DanluLocalSpawner._apply_profile

    # identity and home ----------------------------------------------------------
    @property
    def account(self) -> accounts.Account | None:
        return accounts.lookup(self.user.name, self.uid_range) if self.unix_accounts else None

    @property
    def home_dir(self) -> str:
        account = self.account
        return account.home if account else str(Path(self.home_root) / self.user.name)

    @property
    def holder(self) -> str:
        return f"{self.user.name}:{self.name}" if self.name else self.user.name

    @property
    def _is_admin(self) -> bool:
        return bool(getattr(self.user, "admin", False))

    def _groups(self) -> list[str]:
        return [g.name for g in getattr(self.user, "groups", [])]

    def make_preexec_fn(self, name):
        umask = self.umask
        if self.unix_accounts:
            become = super().make_preexec_fn(name)  # setuid to the user, cd to their home

            def preexec():
                become()
                os.umask(umask)  # what the server and its kernels create is the user's alone

            return preexec
        home = self.home_dir

        def preexec():
            os.makedirs(home, 0o700, exist_ok=True)
            os.chdir(home)
            os.umask(umask)

        return preexec

    def _warn_open_home(self) -> None:
        """Files keep their modes, but a home other accounts can read is an open door: say so."""
        try:
            mode = os.stat(self.home_dir).st_mode & 0o777
        except OSError:
            return
        if mode & 0o077:
            self.log.warning(
                "%s's home %s has mode %o: other accounts can look into it. chmod 700 it "
                "(create accounts with useradd -m -K HOME_MODE=0700)",
                self.user.name,
                self.home_dir,
                mode,
            )

    def user_env(self, env):
        if self.unix_accounts:
            return super().user_env(env)
        env["USER"] = self.user.name
        env["HOME"] = self.home_dir
        env["SHELL"] = os.environ.get("SHELL", "/bin/bash")
        return env

    # the form ---------------------------------------------------------------------
    def _options_form(self, spawner=None) -> str:
        allowed = self.profiles.for_user(self._groups(), admin=self._is_admin)
        if not allowed:
            return "<p>No profile is open to your groups. Ask an admin to add you to a team.</p>"
        default = self.profiles.default_for(self._groups(), admin=self._is_admin)
        rows = []
        for p in allowed:
            checked = " checked" if p is default else ""
            gpu_options = "".join(f'<option value="{n}">{n}</option>' for n in p.gpu_choices)
            limits = ", ".join(
                x for x in (f"{p.cpu:g} CPU" if p.cpu else "", f"{p.memory} memory" if p.memory else "") if x
            )
            rows.append(
                f'<label class="danlu-profile" style="display:block;border:1px solid #ddd;padding:.6em;margin:.4em 0">'
                f'<input type="radio" name="profile" value="{html.escape(p.slug)}"{checked}> '
                f"<strong>{html.escape(p.display_name)}</strong> <code>{html.escape(p.slug)}</code>"
                f'<div style="margin-left:1.6em;color:#555">{html.escape(p.description)}'
                f"{' (' + html.escape(limits) + ')' if limits else ''}</div>"
                f'<div style="margin-left:1.6em">GPUs: <select name="gpus-{html.escape(p.slug)}" '
                f'aria-label="GPUs for {html.escape(p.display_name)}">{gpu_options}</select></div></label>'
            )
        return "<fieldset><legend>Profile</legend>" + "".join(rows) + "</fieldset>"

    @default("options_form")
    def _options_form_default(self):
        return DanluLocalSpawner._options_form

    def options_from_form(self, formdata):
        slug = (formdata.get("profile") or [None])[0]
        raw = (formdata.get(f"gpus-{slug}") or ["0"])[0]
        try:
            gpus = int(raw)
        except ValueError:
            raise web.HTTPError(400, f"GPUs must be a number, got {raw!r}") from None
        return {"profile": slug, "gpus": gpus}

    # policy -------------------------------------------------------------------------
    def _apply_profile(self, user_options):
        options = dict(user_options or {})
        unknown = sorted(set(options) - {"profile", "gpus"})
        if unknown:
            raise web.HTTPError(400, f"unknown server option(s): {', '.join(unknown)}; use profile and gpus")
        gpus = options.get("gpus", 0)
        if isinstance(gpus, str) and gpus.isdigit():
            gpus = int(gpus)
        try:
            profile = self.profiles.authorize(
                options.get("profile"), self._groups(), admin=self._is_admin, gpus=gpus, server_choice=True
            )
        except DanluError as e:
            raise web.HTTPError(e.status if e.status < 500 else 400, str(e)) from None
        if self.unix_accounts:
            try:
                self.account  # noqa: B018 - refuse users without an account before anything starts
            except DanluError as e:
                raise web.HTTPError(e.status, str(e)) from None
        self.profile = profile
        self.gpus_requested = gpus
        if profile.cpu:
            self.cpu_limit = float(profile.cpu)
        if profile.memory:
            self.mem_limit = profile.memory

    def get_args(self):
        args = list(super().get_args())  # JupyterHub returns self.args itself: a spawner lives on across restarts
        if os.geteuid() == 0 and not self.unix_accounts:
            args.append("--allow-root")  # servers run as the hub's account (see the module docstring)
        profile = getattr(self, "profile", None)
        if profile is not None:  # only the profile's kernel is offered
            args += [
                f"--KernelSpecManager.allowed_kernelspecs={profile.kernel_name}",
                f"--MultiKernelManager.default_kernel_name={profile.kernel_name}",
            ]
        return args

    # GPUs ---------------------------------------------------------------------------
    async def _jobs_api(self, method: str, path: str, body: dict | None = None):
        try:
            response = await AsyncHTTPClient().fetch(
                f"{self.jobs_api_url.rstrip('/')}{path}",
                method=method,
                body=json.dumps(body) if body is not None else None,
                headers={"Authorization": f"token {self.jobs_api_token}", "Content-Type": "application/json"},
                request_timeout=30,
                allow_nonstandard_methods=True,
            )
        except HTTPClientError as e:
            if e.response is None or e.code == 599:
                raise web.HTTPError(
                    503, f"the Danlu jobs service did not answer to allocate GPUs ({e.message}); try again"
                ) from None
            error = error_from(e.code, e.response.body, "Danlu jobs service")
            raise web.HTTPError(
                error.status if error.status < 500 else 503, f"GPU allocation failed: {error}"
            ) from None
        except OSError as e:
            raise web.HTTPError(
                503, f"the Danlu jobs service is not reachable to allocate GPUs ({e}); try again"
            ) from None
        return json.loads(response.body) if response.body else None

    def get_env(self):
        env = super().get_env()
        env.update(self.extra_env)
        env["MLFLOW_TRACKING_TOKEN"] = self.api_token or ""
        profile = getattr(self, "profile", None)
        if profile is not None:
            env[names.PROFILE] = profile.slug
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in getattr(self, "devices", []))
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the ledger's indices are nvidia-smi's (PCI) order
        return env

    async def start(self):
        if getattr(self, "profile", None) is None:  # restarted with stored options
            self._apply_profile(self.user_options)
        self.devices = []
        if self.gpus_requested:
            result = await self._jobs_api(
                "POST",
                "/allocations",
                {
                    "holder": self.holder,
                    "owner": self.user.name,
                    "gpus": self.gpus_requested,
                    "profile": self.profile.slug,
                    "groups": self._groups(),
                },
            )
            self.devices = result["devices"]
        if not self.unix_accounts:
            Path(self.home_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        else:
            self._warn_open_home()
        try:
            started = await super().start()
        except BaseException:
            await self._release()
            raise
        self._warm_soon()
        return started

    def _warm_soon(self) -> None:
        """Ask the jobs service for a warm runner of this profile: the user's first %%train need not start one."""

        async def warm():
            try:
                await self._jobs_api("POST", "/runners/warm", {"user": self.user.name, "profile": self.profile.slug})
            except Exception as e:  # noqa: BLE001 - only a slower first job: never the server's start
                self.log.info("no warm runner for %s: %s", self.user.name, getattr(e, "log_message", None) or e)

        if self.jobs_api_url:
            self._warm_task = asyncio.ensure_future(warm())

    async def _release(self):
        if getattr(self, "devices", None):
            try:
                await self._jobs_api("DELETE", f"/allocations/server/{self.holder}")
            except web.HTTPError as e:
                self.log.warning("releasing GPUs of %s: %s", self.holder, e.log_message)
            self.devices = []

    async def run_post_stop_hook(self):
        # JupyterHub runs this after every stop, also when the server died by itself
        # (then Spawner.stop is not called), so GPUs are always given back.
        try:
            await self._release()
        finally:
            result = super().run_post_stop_hook()
            if hasattr(result, "__await__"):
                await result

    def get_state(self):
        state = super().get_state()
        if getattr(self, "devices", None):
            state["devices"] = self.devices
        return state

    def load_state(self, state):
        super().load_state(state)
        self.devices = state.get("devices", [])
