"""MLflow behind the hub login: ``python -m danlu.hub.mlflow_gateway``.

A JupyterHub managed service at ``/services/mlflow/`` that authenticates every
request with the hub (a browser is sent through the hub's OAuth login; API
clients send ``Authorization: token <JupyterHub token>`` or ``Bearer``, which
is what ``MLFLOW_TRACKING_TOKEN`` produces) and then streams it to the MLflow
tracking server on loopback, which ``danlu up`` starts with
``--static-prefix /services/mlflow`` so UI links and the REST API keep their
paths. Unauthenticated API requests get a JSON 401/403; nothing reaches MLflow
without a hub identity. Only the routes the tracking UI and MLflow's clients
need are forwarded (:mod:`danlu.hub.mlflow_routes`); the AI gateway, webhooks,
prompts, the assistant and the rest are refused with a JSON 403 that names the
route. An experiment named ``<user>/...`` may be created, or renamed into, only
by that user. Each request reaches MLflow with its user's MLflow credentials
(:mod:`danlu.hub.mlflow_auth`), so MLflow's own permissions decide what they
may change. A cookie-authenticated request needs JupyterHub's XSRF token like
any hub page; MLflow's UI does not send one, so its page (the route ``/``) gets
a small script that adds it to the UI's own requests; every other answer,
artifacts included, passes through unchanged. Jobs and the jobs service talk to
MLflow directly (loopback, or its Service on a cluster) and never pass through
here.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Callable
from urllib.parse import urlparse

from jupyterhub.services.auth import HubOAuth, HubOAuthCallbackHandler
from tornado import httpclient, iostream, web
from tornado.httpserver import HTTPServer

from danlu.env import MLFLOW_AUTH_SECRET, MLFLOW_URL
from danlu.errors import DanluError
from danlu.hub import mlflow_auth, mlflow_routes
from danlu.hub.hubauth import AsyncHubAuthenticated

log = logging.getLogger("danlu.mlflow_gateway")

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
    "host",
    "authorization",
    "cookie",
}
#: dropped from requests for HTML pages: their body is edited, and never answered from a stale cache
HTML_REQUEST_DROP = {"accept-encoding", "if-none-match", "if-modified-since"}

# Adds the hub's XSRF token to the MLflow UI's own requests (fetch and XMLHttpRequest, to this
# gateway only): JupyterHub accepts a cookie-authenticated request only with it, and a browser's
# fetch() needs it even for GET (Sec-Fetch-Mode: cors).
#
# It also opens the UI on its model-training view: MLflow 3.17 starts a browser that has no choice stored on
# its GenAI view (the useLocalStorage key mlflow.workflowType, version 1, JSON); a user's own later choice
# stays.
XSRF_SCRIPT = """<script>(function () {
  try {
    if (!localStorage.getItem("mlflow.workflowType_v1")) {
      localStorage.setItem("mlflow.workflowType_v1", JSON.stringify("machine_learning"));
    }
  } catch (e) {}
  var token = %(token)s, prefix = %(prefix)s;
  function ours(url) {
    try { var u = new URL(url, location.href); } catch (e) { return false; }
    return u.origin === location.origin && u.pathname.indexOf(prefix) === 0;
  }
  var fetch0 = window.fetch;
  if (fetch0) {
    window.fetch = function (input, init) {
      var url = typeof input === "string" ? input : (input && input.url) || String(input);
      if (ours(url)) {
        init = Object.assign({}, init);
        var headers = new Headers(init.headers || (input instanceof Request ? input.headers : undefined));
        headers.set("X-XSRFToken", token);
        init.headers = headers;
      }
      return fetch0.call(this, input, init);
    };
  }
  var open0 = XMLHttpRequest.prototype.open, send0 = XMLHttpRequest.prototype.send;
  XMLHttpRequest.prototype.open = function (method, url) {
    this._danluXsrf = ours(url);
    return open0.apply(this, arguments);
  };
  XMLHttpRequest.prototype.send = function () {
    if (this._danluXsrf) this.setRequestHeader("X-XSRFToken", token);
    return send0.apply(this, arguments);
  };
})();</script>"""


def inject_xsrf(html: bytes, token: str, prefix: str) -> bytes:
    """``html`` with :data:`XSRF_SCRIPT` first in its head (before MLflow's own scripts)."""
    script = (XSRF_SCRIPT % {"token": json.dumps(token), "prefix": json.dumps(prefix)}).encode()
    head = re.search(rb"<head[^>]*>", html, re.IGNORECASE)
    at = head.end() if head else 0
    return html[:at] + script + html[at:]


#: request chunks (64 KiB each, tornado's) waiting for MLflow to take them: the upload's backpressure
UPLOAD_QUEUE = 4
#: the most bytes of an experiment create/rename body, read whole to check the name before MLflow sees it
MAX_NAMING_BODY = mlflow_routes.MAX_NAMING_BODY


@web.stream_request_body
class ProxyHandler(AsyncHubAuthenticated, web.RequestHandler):
    """One request: authenticated, checked against :mod:`danlu.hub.mlflow_routes`, then streamed both ways.

    Bodies flow with backpressure: a request chunk is taken from the client only when the
    one before is on its way to MLflow (a bounded queue), and an answer's chunk is read from
    MLflow only when the one before has been written to the client. Only the UI's page (the
    route ``/``, by path, never by content type) is read whole, to add the XSRF script; every
    other answer, artifacts included, passes through byte for byte.
    """

    SUPPORTED_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")

    def initialize(self, upstream: str, users: mlflow_auth.MlflowUsers, prefix: str = "/services/mlflow/"):
        self.upstream = upstream.rstrip("/")
        self.users = users
        self.prefix = prefix
        self._queue: asyncio.Queue | None = None  # request chunks on their way to MLflow (None: no body to send)
        self._forward: asyncio.Future | None = None
        self._sent = False  # MLflow's answer is in (no more request chunks are taken)
        self._refusal: Callable[[], None] | None = None  # what to answer instead of MLflow, once the body is read
        self._naming: bytearray | None = None  # a create/rename body, checked before it is forwarded
        self._index = False  # the UI's page: the one answer the gateway edits
        self._html: bytearray | None = None  # that page being read to add the XSRF script

    def _wants_html(self) -> bool:
        return self.request.method == "GET" and "text/html" in self.request.headers.get("Accept", "")

    def _refuse(self, status: int, reason: str, message: str, route: str | None = None) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(mlflow_routes.refusal(status, reason, message, route)))

    def _refuse_login(self) -> None:
        if self._wants_html():
            self.redirect(self.get_login_url())
            return
        status = 403 if self.request.headers.get("Authorization") else 401
        self._refuse(
            status,
            "unauthenticated" if status == 401 else "token_rejected",
            "MLflow on Danlu needs a hub login: send 'Authorization: token <JupyterHub token>' "
            "(or set MLFLOW_TRACKING_TOKEN) or log in at /hub/login",
        )

    async def prepare(self):
        # A refusal waits for the verb method: finishing before the body is read makes tornado drop
        # the connection, which the proxy may be reusing already (its next request: "socket hang up").
        # JupyterHub's XSRF check stays on: a cookie-authenticated request without the token has no user.
        await self.identify()  # never the hub's round trip on the event loop (danlu.hub.hubauth)
        user = self.current_user
        if not user:
            self._refusal = self._refuse_login
            return
        route = mlflow_routes.route_path(self.request.path, self.prefix) or "/"
        decision = mlflow_routes.decide(self.request.method, route)
        if not decision.allowed:
            log.info("refused %s %s for %s: %s", self.request.method, route, user["name"], decision.reason)
            self._refusal = functools.partial(
                self._refuse, decision.status, decision.reason, decision.message, decision.route
            )
            return
        self.user = user
        self.mlflow_user = mlflow_auth.mlflow_username(user)
        try:
            await self.users.ensure_user(self.mlflow_user, admin=mlflow_auth.is_admin(user))
        except DanluError as e:
            self._refusal = functools.partial(self._refuse, e.status, e.reason, str(e))
            return
        self._index = route == "/" and self.request.method == "GET"
        if route in mlflow_routes.EXPERIMENT_NAMING and not mlflow_auth.is_admin(user):
            self._naming = bytearray()  # forwarded from the verb method, once its names are checked
            return
        self._start()

    def _has_body(self) -> bool:
        return self.request.method in ("POST", "PUT", "PATCH") or bool(
            self.request.method == "DELETE" and self.request.headers.get("Content-Length")
        )

    def _start(self) -> None:
        self._queue = asyncio.Queue(maxsize=UPLOAD_QUEUE) if self._has_body() else None
        self._forward = asyncio.ensure_future(self._proxy())

    async def data_received(self, chunk: bytes):
        if self._refusal is not None:
            return
        if self._naming is not None:
            if len(self._naming) + len(chunk) > MAX_NAMING_BODY:
                self._naming = None
                self._refusal = functools.partial(
                    self._refuse,
                    413,
                    "body_too_large",
                    f"an experiment request body is at most {MAX_NAMING_BODY} bytes",
                )
                return
            self._naming.extend(chunk)
            return
        if self._queue is not None and not self._sent:
            await self._queue.put(chunk)  # waits while MLflow has not taken the chunks before it

    async def _body_producer(self, write):
        while True:
            chunk = await self._queue.get()
            if chunk is None:
                return
            await write(chunk)  # resolves once the chunk is written to MLflow's socket

    async def _proxy(self):
        # Content-Length travels: MLflow's server does not read chunked request bodies
        drop = HOP_BY_HOP | (HTML_REQUEST_DROP if self._index else set())
        headers = {
            k: v for k, v in self.request.headers.get_all() if k.lower() not in drop or k.lower() == "content-length"
        }
        headers["X-Forwarded-User"] = self.user["name"]
        headers["Authorization"] = mlflow_auth.basic_authorization(self.mlflow_user, self.users.secret)
        up = urlparse(self.upstream)
        headers["Host"] = up.netloc
        request = httpclient.HTTPRequest(
            f"{self.upstream}{self.request.uri}",
            method=self.request.method,
            headers=headers,
            body_producer=self._body_producer if self._queue is not None else None,
            allow_nonstandard_methods=True,
            follow_redirects=False,
            decompress_response=False,
            request_timeout=3600,
            header_callback=self._on_header,
            streaming_callback=self._on_chunk,
        )
        try:
            await httpclient.AsyncHTTPClient().fetch(request, raise_error=False)
        except Exception as e:  # MLflow down, or the client went away
            if not self._headers_written:
                self.set_status(502)
                self.set_header("Content-Type", "application/json")
                self.write(
                    json.dumps(
                        {
                            "status": 502,
                            "reason": "mlflow_unreachable",
                            "message": f"the MLflow server is not answering: {e}",
                        }
                    )
                )
        finally:
            self._sent = True  # MLflow answered before it read the whole body: the rest is dropped
            while self._queue is not None and not self._queue.empty():
                self._queue.get_nowait()

    def _on_header(self, line: str):
        line = line.strip()
        if not line:
            return
        if line.startswith("HTTP/"):
            parts = line.split(" ", 2)
            self.set_status(int(parts[1]), parts[2] if len(parts) > 2 else None)
            self.clear_header("Content-Type")
            return
        name, _, value = line.partition(":")
        name, value = name.strip(), value.strip()
        if name.lower() in HOP_BY_HOP or name.lower() in ("server", "date"):
            return
        if name.lower() == "content-type" and value.lower().startswith("text/html") and self._index:
            self._html = bytearray()
        if name.lower() == "content-encoding":  # not asked for; leave such a page as it is
            self._html = None
        self.add_header(name, value)

    def _on_chunk(self, chunk: bytes):
        if self._html is not None:
            self._html.extend(chunk)
            return None
        self.write(chunk)
        return self.flush()  # tornado's client reads MLflow's next chunk once this one is written

    async def _finish(self, *_path):
        if self._refusal is not None:
            self._refusal()
            return
        if self._naming is not None:
            why = mlflow_routes.namespace_refusal(bytes(self._naming), self.user["name"])
            if why:
                log.info("refused %s %s for %s: %s", self.request.method, self.request.path, self.user["name"], why)
                self._refuse(403, "experiment_not_yours", why, mlflow_routes.route_path(self.request.path, self.prefix))
                return
            self._start()
            if self._queue is not None:
                await self._queue.put(bytes(self._naming))
        if self._queue is not None:
            await self._queue.put(None)
        await self._forward
        if self._html is not None and not self._finished:
            for name in ("ETag", "Last-Modified"):
                self.clear_header(name)
            self.set_header("Cache-Control", "no-store")  # the token in it changes with the login
            # tornado sets Content-Length for the edited body
            self.write(inject_xsrf(bytes(self._html), self.xsrf_token.decode(), self.hub_auth.base_url))
        if not self._finished:
            try:
                self.finish()
            except iostream.StreamClosedError:  # the client went away mid-answer
                pass

    get = head = post = put = patch = delete = options = _finish


def main(argv=None) -> int:

    parser = argparse.ArgumentParser(prog="python -m danlu.hub.mlflow_gateway")
    parser.add_argument("--ip", help="listen here instead of the host of JUPYTERHUB_SERVICE_URL (in a pod: 0.0.0.0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(levelname).1s %(asctime)s mlflow-gateway] %(message)s")
    upstream = MLFLOW_URL.get()
    secret = MLFLOW_AUTH_SECRET.get()
    for var, value in ((MLFLOW_URL, upstream), (MLFLOW_AUTH_SECRET, secret)):
        if not value:
            print(f"danlu mlflow gateway: {var} is not set", file=sys.stderr)
            return 2
    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/mlflow/")
    url = urlparse(os.environ.get("JUPYTERHUB_SERVICE_URL", "http://127.0.0.1:10102"))
    origin = f"{urlparse(upstream).scheme}://{urlparse(upstream).netloc}"
    hub_auth = HubOAuth(api_token=os.environ.get("JUPYTERHUB_API_TOKEN", ""), cache_max_age=60)
    app = web.Application(
        [
            (f"{prefix.rstrip('/')}/oauth_callback", HubOAuthCallbackHandler),
            (
                f"{prefix.rstrip('/')}(/.*)?",
                ProxyHandler,
                {"upstream": origin, "users": mlflow_auth.MlflowUsers(upstream, secret), "prefix": prefix},
            ),
        ],
        hub_auth=hub_auth,
        cookie_secret=os.urandom(32),
        log_function=lambda h: None,
    )
    httpclient.AsyncHTTPClient.configure(None, max_clients=100, max_body_size=2**34, max_buffer_size=2**30)

    async def run():
        server = HTTPServer(app, max_body_size=2**34, xheaders=True)
        server.listen(url.port, args.ip or url.hostname)
        log.info("MLflow gateway on %s%s -> %s", url.geturl(), prefix, origin)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        server.stop()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
