"""The server extension's calls to the jobs service, MLflow and the hub, made server-side.

Every call carries a token this server was given at spawn ($JUPYTERHUB_API_TOKEN,
$MLFLOW_TRACKING_TOKEN); the browser never sees one. :class:`Upstream` turns
what can go wrong into :class:`~danlu.errors.DanluError` with the status the
handlers answer: an unreachable service is a 503 that names it, an upstream
4xx keeps its status, reason, message and field, an upstream 5xx is a 502
(:func:`danlu.client.error_from`, shared with the magic, the CLI and the spawner).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from urllib.parse import urlencode

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.simple_httpclient import SimpleAsyncHTTPClient
from tornado.tcpclient import TCPClient

from danlu.client import error_from
from danlu.errors import DanluError, Unreachable


class _TrackingTCPClient(TCPClient):
    """A TCPClient that remembers its streams, so a follower can hang up on the jobs service."""

    def __init__(self):
        super().__init__()
        self.streams = []

    async def connect(self, *args, **kwargs):
        stream = await super().connect(*args, **kwargs)
        self.streams.append(stream)
        return stream


class Stream:
    """One streamed upstream response (a log being followed); :meth:`close` ends it from our side."""

    def __init__(self):
        self.client = SimpleAsyncHTTPClient(force_instance=True)
        self.client.tcp_client = _TrackingTCPClient()  # its own connections, so closing them is ours to do

    def close(self) -> None:
        for stream in self.client.tcp_client.streams:
            stream.close()
        self.client.close()


class Upstream:
    """One named HTTP service (the jobs service, MLflow, the hub API) at ``url``, with ``token``."""

    def __init__(self, name: str, url: str, token: str, *, timeout: float = 30.0):
        self.name, self.url, self.token, self.timeout = name, url.rstrip("/"), token, timeout

    def request(
        self, method: str, path: str, *, params: dict | None = None, body=None, timeout: float | None = None, **kwargs
    ) -> HTTPRequest:
        query = f"?{urlencode(params, doseq=True)}" if params else ""
        return HTTPRequest(
            f"{self.url}{path}{query}",
            method=method,
            body=json.dumps(body) if body is not None else (b"" if method == "POST" else None),
            headers={
                "Authorization": f"token {self.token}",
                "Content-Type": "application/json",
                "Accept": "application/json",
            },
            request_timeout=timeout or self.timeout,
            connect_timeout=10,
            **kwargs,
        )

    def error(self, e: Exception) -> DanluError:
        """What a failed call means for the caller (the one parser of Danlu's error bodies: error_from)."""
        if isinstance(e, HTTPClientError) and e.response is not None and e.code != 599:
            return error_from(e.code, e.response.body or e.message, self.name)
        if isinstance(e, HTTPClientError):  # 599: timed out or the connection dropped
            return Unreachable(f"the {self.name} did not answer in time ({e.message})", reason="upstream_timeout")
        return Unreachable(
            f"the {self.name} is not reachable at {self.url} ({e})",
            fix="is the workbench (danlu up) running? try again in a moment",
        )

    async def fetch_raw(self, method: str, path: str, **kwargs) -> bytes:
        try:
            response = await AsyncHTTPClient().fetch(self.request(method, path, **kwargs))
        except (HTTPClientError, OSError) as e:
            raise self.error(e) from None
        return response.body

    async def fetch(self, method: str, path: str, **kwargs):
        raw = await self.fetch_raw(method, path, **kwargs)
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            raise DanluError(
                f"the {self.name} answered something that is not JSON", status=502, reason="upstream_error"
            ) from None

    async def stream(self, stream: Stream, path: str, on_chunk: Callable[[bytes], None], **kwargs) -> None:
        """GET ``path``, handing each chunk of the body to ``on_chunk``, until it ends or ``stream`` closes."""
        try:
            await stream.client.fetch(self.request("GET", path, streaming_callback=on_chunk, **kwargs))
        except (HTTPClientError, OSError) as e:
            raise self.error(e) from None
