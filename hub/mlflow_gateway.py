"""MLflow behind the hub login: ``python -m danlu.hub.mlflow_gateway``.

A JupyterHub managed service at ``/services/mlflow/`` that authenticates every
request with the hub (a browser is sent through the hub's OAuth login; API
clients send ``Authorization: token <JupyterHub token>`` or ``Bearer``, which
is what ``MLFLOW_TRACKING_TOKEN`` produces) and then streams it to the MLflow
tracking server on loopback, which ``danlu up`` starts with
``--static-prefix /services/mlflow`` so UI links and the REST API keep their
paths. Unauthenticated API requests get a JSON 401/403; nothing reaches MLflow
without a hub identity. Jobs, which run on this machine, talk to MLflow
directly on loopback and never pass through here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from urllib.parse import urlparse

from jupyterhub.services.auth import HubOAuth, HubOAuthCallbackHandler, HubOAuthenticated
from tornado import httpclient, web
from tornado.httpserver import HTTPServer

log = logging.getLogger("danlu.mlflow_gateway")

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "content-length", "host", "authorization", "cookie"}


@web.stream_request_body
class ProxyHandler(HubOAuthenticated, web.RequestHandler):
    SUPPORTED_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")

    def initialize(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self._queue: asyncio.Queue | None = None

    def check_xsrf_cookie(self):
        # MLflow's UI posts JSON with the hub cookie; token calls are exempt. The cookie is
        # SameSite and scoped to /services/mlflow/, which limits cross-site use.
        return

    def _wants_html(self) -> bool:
        return self.request.method == "GET" and "text/html" in self.request.headers.get("Accept", "")

    async def prepare(self):
        user = self.current_user
        if not user:
            if self._wants_html():
                self.redirect(self.get_login_url())
                return
            status = 403 if self.request.headers.get("Authorization") else 401
            self.set_status(status)
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({
                "status": status, "reason": "unauthenticated" if status == 401 else "token_rejected",
                "message": "MLflow on Danlu needs a hub login: send 'Authorization: token <JupyterHub token>' "
                           "(or set MLFLOW_TRACKING_TOKEN) or log in at /hub/login"}))
            return
        self.user = user
        self._queue = asyncio.Queue()
        self._forward = asyncio.ensure_future(self._proxy())

    def data_received(self, chunk: bytes):
        if self._queue is not None:
            self._queue.put_nowait(chunk)

    async def _body_producer(self, write):
        while True:
            chunk = await self._queue.get()
            if chunk is None:
                return
            await write(chunk)

    async def _proxy(self):
        # Content-Length travels: MLflow's server does not read chunked request bodies
        headers = {k: v for k, v in self.request.headers.get_all()
                   if k.lower() not in HOP_BY_HOP or k.lower() == "content-length"}
        headers["X-Forwarded-User"] = self.user["name"]
        up = urlparse(self.upstream)
        headers["Host"] = up.netloc
        has_body = self.request.method in ("POST", "PUT", "PATCH") or (
            self.request.method == "DELETE" and self.request.headers.get("Content-Length"))
        request = httpclient.HTTPRequest(
            f"{self.upstream}{self.request.uri}", method=self.request.method, headers=headers,
            body_producer=self._body_producer if has_body else None,
            allow_nonstandard_methods=True, follow_redirects=False, decompress_response=False,
            request_timeout=3600, header_callback=self._on_header, streaming_callback=self._on_chunk,
        )
        if not has_body:
            self._queue = None
        try:
            await httpclient.AsyncHTTPClient().fetch(request, raise_error=False)
        except Exception as e:  # MLflow down
            if not self._headers_written:
                self.set_status(502)
                self.set_header("Content-Type", "application/json")
                self.write(json.dumps({"status": 502, "reason": "mlflow_unreachable",
                                       "message": f"the MLflow server is not answering: {e}"}))

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
        if name.lower() in HOP_BY_HOP or name.lower() in ("server", "date"):
            return
        self.add_header(name.strip(), value.strip())

    def _on_chunk(self, chunk: bytes):
        self.write(chunk)
        self.flush()

    async def _finish(self, *_path):
        if self._queue is not None:
            self._queue.put_nowait(None)
        await self._forward
        if not self._finished:
            self.finish()

    get = head = post = put = patch = delete = options = _finish


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(levelname).1s %(asctime)s mlflow-gateway] %(message)s")
    upstream = os.environ.get("DANLU_MLFLOW_URL")
    if not upstream:
        print("danlu mlflow gateway: DANLU_MLFLOW_URL is not set", file=sys.stderr)
        return 2
    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/mlflow/")
    url = urlparse(os.environ.get("JUPYTERHUB_SERVICE_URL", "http://127.0.0.1:10102"))
    origin = f"{urlparse(upstream).scheme}://{urlparse(upstream).netloc}"
    hub_auth = HubOAuth(api_token=os.environ.get("JUPYTERHUB_API_TOKEN", ""), cache_max_age=60)
    app = web.Application([
        (f"{prefix.rstrip('/')}/oauth_callback", HubOAuthCallbackHandler),
        (f"{prefix.rstrip('/')}(/.*)?", ProxyHandler, {"upstream": origin}),
    ], hub_auth=hub_auth, cookie_secret=os.urandom(32), log_function=lambda h: None)
    httpclient.AsyncHTTPClient.configure(None, max_body_size=2**34, max_buffer_size=2**30)

    async def run():
        server = HTTPServer(app, max_body_size=2**34, xheaders=True)
        server.listen(url.port, url.hostname)
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
