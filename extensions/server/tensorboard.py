"""TensorBoards for jobs and runs: one process per set of logdirs, behind this server's login.

:class:`TensorBoardManager` starts ``tensorboard`` on a loopback port with
``--path_prefix {base_url}danlu/tensorboard/<id>``, where ``<id>`` is a short
hash of the set of logdirs, so asking again for the same jobs reuses the same
process. A TensorBoard with no proxied request for ``idle_seconds`` is stopped;
it is started again, with the same id and URL, when its page asks for anything
(an open tab keeps working). Every process is stopped with the server, and dies
with it if the server is killed (Linux's parent-death signal).
:class:`TensorBoardProxyHandler` forwards GET and POST to it after Jupyter's own
authentication. TensorBoard has no login of its own, and a loopback port is
open to every account of the machine: each TensorBoard gets a random token in
its environment and answers only requests that carry it
(:mod:`danlu.lab.tensorboard_main`), which only this proxy adds.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_server.base.handlers import JupyterHandler
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.ioloop import PeriodicCallback

from danlu import env
from danlu.errors import DanluError, NotFound, Unreachable
from danlu.lab.tensorboard_main import HEADER

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "content-encoding",
    "host",
    "authorization",
    "cookie",
    "set-cookie",
    HEADER.lower(),
}


def logdir_set_id(logdirs: dict[str, str]) -> str:
    """The id of a set of logdirs: the same set (in any order) always gets the same id."""
    return hashlib.sha256(json.dumps(sorted(logdirs.items())).encode()).hexdigest()[:12]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class TensorBoard:
    id: str
    logdirs: dict[str, str]
    prefix: str
    port: int = 0
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    last_used: float = field(default_factory=time.monotonic)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            return ""
        return " | ".join(line for line in text.splitlines()[-lines:] if line.strip())


class TensorBoardManager:
    """Starts, reuses, idles out and stops this server's TensorBoards (see the module docstring)."""

    def __init__(self, *, base_url: str, command: list[str], idle_seconds: float, start_timeout: float, log):
        self.base_url = base_url if base_url.endswith("/") else base_url + "/"
        self.command, self.idle_seconds, self.start_timeout, self.log = command, idle_seconds, start_timeout, log
        self.boards: dict[str, TensorBoard] = {}  # every set asked for; the process only while in use
        self._lock = asyncio.Lock()
        self._reaper: PeriodicCallback | None = None
        self._logs = tempfile.TemporaryDirectory(prefix="danlu-tensorboard-")

    def url(self, board_id: str) -> str:
        return f"{self.base_url}danlu/tensorboard/{board_id}/"

    def register(self, logdirs: dict[str, str]) -> TensorBoard:
        board_id = logdir_set_id(logdirs)
        if board_id not in self.boards:
            self.boards[board_id] = TensorBoard(board_id, dict(logdirs), self.url(board_id).rstrip("/"))
        return self.boards[board_id]

    async def ensure(self, board_id: str) -> TensorBoard:
        """The running TensorBoard ``board_id``, started (again) if needed and ready to answer."""
        board = self.boards.get(board_id)
        if board is None:
            raise NotFound(
                f"no TensorBoard {board_id} on this server; open it again from the Danlu sidebar",
                reason="no_tensorboard",
                field="id",
            )
        board.last_used = time.monotonic()
        async with self._lock:
            if not board.running:
                self._start(board)
        await self._wait_ready(board)
        board.last_used = time.monotonic()
        return board

    def _start(self, board: TensorBoard) -> None:
        board.port = _free_port()
        board.ready = asyncio.Event()
        spec = ",".join(f"{name}:{path}" for name, path in sorted(board.logdirs.items()))
        board.log_path = Path(self._logs.name) / f"{board.id}.log"
        argv = [
            *self.command,
            "--logdir_spec",
            spec,
            "--host",
            "127.0.0.1",
            "--port",
            str(board.port),
            "--path_prefix",
            board.prefix,
        ]
        with open(board.log_path, "wb") as out:
            board.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, env.TENSORBOARD_TOKEN: board.token},
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self.log.info(
            "danlu: started TensorBoard %s (pid %s) on port %s for %s", board.id, board.proc.pid, board.port, spec
        )
        self._start_reaper()

    async def _wait_ready(self, board: TensorBoard) -> None:
        if board.ready.is_set():
            return
        deadline = time.monotonic() + self.start_timeout
        url = f"http://127.0.0.1:{board.port}{board.prefix}/"
        while time.monotonic() < deadline:
            if not board.running:
                raise DanluError(
                    f"TensorBoard {board.id} exited while starting: {board.log_tail() or 'no output'}",
                    status=502,
                    reason="tensorboard_failed",
                )
            try:
                await AsyncHTTPClient().fetch(
                    url, headers={HEADER: board.token}, request_timeout=5, follow_redirects=False
                )
                board.ready.set()
                board.last_used = time.monotonic()  # idle from when it answers
                return
            except HTTPClientError as e:
                if e.code != 599:  # it answers (a redirect is an answer too)
                    board.ready.set()
                    board.last_used = time.monotonic()
                    return
            except OSError:
                pass
            await asyncio.sleep(0.25)
        raise Unreachable(
            f"TensorBoard {board.id} did not start within {self.start_timeout:g} s; try again",
            reason="tensorboard_slow",
        )

    # stopping ---------------------------------------------------------------------
    def _start_reaper(self) -> None:
        if self._reaper is None and self.idle_seconds > 0:
            every = max(0.2, min(self.idle_seconds / 4, 30.0))
            self._reaper = PeriodicCallback(self.reap, every * 1000)
            self._reaper.start()

    async def reap(self) -> None:
        """Stop every TensorBoard idle for longer than ``idle_seconds``."""
        now = time.monotonic()
        for board in list(self.boards.values()):
            # one still starting is not idle (a cold TensorBoard on a busy machine takes longer than a short
            # idle time to answer): it is stopped only once it could not have started in time
            idle = self.idle_seconds if board.ready.is_set() else self.idle_seconds + self.start_timeout
            if board.running and now - board.last_used > idle:
                self.log.info("danlu: stopping TensorBoard %s after %g s idle", board.id, self.idle_seconds)
                await self._stop(board)

    async def _stop(self, board: TensorBoard, grace: float = 5.0) -> None:
        proc, board.proc = board.proc, None
        board.ready = asyncio.Event()
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        deadline = time.monotonic() + grace
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)

    async def stop_all(self) -> None:
        if self._reaper is not None:
            self._reaper.stop()
            self._reaper = None
        await asyncio.gather(*(self._stop(b) for b in self.boards.values()))
        self._logs.cleanup()

    def pids(self) -> list[int]:
        return [b.proc.pid for b in self.boards.values() if b.running]


class TensorBoardProxyHandler(JupyterHandler):
    """``{base_url}danlu/tensorboard/<id>/...`` -> the TensorBoard ``<id>`` on loopback (GET and POST)."""

    @property
    def manager(self) -> TensorBoardManager:
        return self.settings["danlu_tensorboards"]

    @property
    def content_security_policy(self) -> str:
        # The single-user server forbids framing (frame-ancestors 'none'); this page lives in a
        # JupyterLab tab of the same origin.
        return "frame-ancestors 'self'"

    def check_xsrf_cookie(self):
        # TensorBoard's own page posts its data queries without Jupyter's XSRF token, as it does
        # behind jupyter-server-proxy; a cross-site request is still refused here.
        if self.request.headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none"):
            raise web.HTTPError(403, "cross-site requests to TensorBoard are refused")

    def write_error(self, status_code: int, **kwargs) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = (
            str(exc)
            if isinstance(exc, DanluError)
            else (exc.log_message if isinstance(exc, web.HTTPError) and exc.log_message else self._reason)
        )
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.finish(json.dumps({"message": message}))

    @web.authenticated
    async def get(self, board_id: str, rest: str | None = None):
        await self._proxy(board_id, rest)

    @web.authenticated
    async def post(self, board_id: str, rest: str | None = None):
        await self._proxy(board_id, rest)

    async def _proxy(self, board_id: str, rest: str | None) -> None:
        try:
            board = await self.manager.ensure(board_id)
        except DanluError as e:
            self.set_status(e.status)
            self.write_error(e.status, exc_info=(type(e), e, None))
            return
        headers = {k: v for k, v in self.request.headers.get_all() if k.lower() not in HOP_BY_HOP}
        headers[HEADER] = board.token  # after Jupyter's login: what this TensorBoard requires
        request = HTTPRequest(
            f"http://127.0.0.1:{board.port}{self.request.uri}",
            method=self.request.method,
            headers=headers,
            body=self.request.body if self.request.method == "POST" else None,
            follow_redirects=False,
            request_timeout=300,
            decompress_response=True,
        )
        try:
            response = await AsyncHTTPClient().fetch(request, raise_error=False)
        except OSError as e:
            self.set_status(502)
            self.finish(json.dumps({"message": f"TensorBoard {board_id} is not answering ({e}); reload the tab"}))
            return
        board.last_used = time.monotonic()
        if response.code == 599:
            self.set_status(502)
            self.finish(json.dumps({"message": f"TensorBoard {board_id} is not answering; reload the tab"}))
            return
        self.set_status(response.code, response.reason)
        self.clear_header("Content-Type")
        for name, value in response.headers.get_all():
            lower = name.lower()
            if lower == "content-security-policy":  # one policy: TensorBoard's, framed by JupyterLab only
                rules = [r for r in value.split(";") if r.strip() and not r.strip().startswith("frame-ancestors")]
                self.set_header(name, "; ".join([*(r.strip() for r in rules), "frame-ancestors 'self'"]))
            elif lower not in HOP_BY_HOP and lower != "x-frame-options":
                self.add_header(name, value)
        if response.body:
            self.write(response.body)
        self.finish()


ROUTES = [(r"danlu/tensorboard/(?P<board_id>[^/]+)(?P<rest>/.*)?", TensorBoardProxyHandler)]
