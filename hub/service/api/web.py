"""What every HTTP handler of the jobs service shares: who is calling, bounded input, JSON errors.

:class:`BaseHandler` maps every error to a JSON body in one place
(:meth:`~BaseHandler.write_error`): a :class:`~danlu.errors.DanluError` keeps
its status, reason, field and fix; a method a route does not have is a 405
that lists the allowed ones (an unknown route is a 404 whatever the method);
anything unexpected is a logged 500 with no traceback in the response.
Request bodies are streamed (``stream_request_body``): the caller is identified in ``prepare``, before
a byte of the body is read, and a caller no one has authenticated may send at most
:data:`ANONYMOUS_BODY` bytes (``JobsServiceApp.anonymous_max_body``); authenticated callers keep their
route's bound (``max_body``). A body over the bound is never kept: it is read and dropped (up to
:data:`DISCARD_BODY`, beyond which the answer comes at once) and answered with a 413 that says so. Every refusal
decided before the body (:meth:`BaseHandler.admit`: a method the route lacks, an unknown route, a rate bound; a
size) is answered the same way, once the body is in, because an answer before it makes tornado close the
connection that configurable-http-proxy reuses; an answer that does end the connection says so
(``Connection: close``). Bodies then go
through :func:`~danlu.hub.service.jsonbody.parse_json` (size, depth, non-finite numbers, surrogates, NUL)
and must be JSON objects; path and
query parameters are read as sent (UTF-8, given once, no control character
quietly turned into a space, as tornado's ``get_argument`` would) through
typed, bounded readers, and each refusal names the parameter and the fix.
:class:`APIHandler` adds the caller's identity from JupyterHub (token header
or the browser's hub login, via :class:`~danlu.hub.hubauth.AsyncHubAuthenticated`, which never
blocks the event loop on the hub). Handlers stay thin:
HTTP in, one :class:`~danlu.hub.service.manager.JobManager` call, HTTP out.
"""

from __future__ import annotations

import json
import re

from tornado import httputil, web
from tornado.log import app_log

from danlu.errors import DanluError, Forbidden, UsageError, ValidationError
from danlu.hub.hubauth import AsyncHubAuthenticated
from danlu.hub.service import jsonbody, validation
from danlu.hub.service.auth import Principal, require_admin
from danlu.hub.service.formats import JOB_ID
from danlu.hub.service.manager import JobManager

MAX_BODY = jsonbody.MAX_BODY
#: what the service reads and drops of a body over its caller's bound before it answers 413; a body announced
#: larger is answered at once (configurable-http-proxy, still writing it, may then give the caller a 503)
DISCARD_BODY = 2**20
#: what a caller no one has authenticated may send, unless the app says otherwise (anonymous_max_body)
ANONYMOUS_BODY = 64 * 1024
MAX_QUERY = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")
METHODS = ("get", "post", "put", "patch", "delete", "head", "options")
_JSON_TYPES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}
# the document's names of path parameters whose route group is named otherwise
PATH_NAMES = {"job_id": "id"}


def too_large(limit: int, who: str) -> DanluError:
    amount = f"{limit // 2**20} MiB" if limit % 2**20 == 0 else f"{limit // 1024} KiB"
    return DanluError(
        f"the request body is larger than {amount}, the most {who} may send here",
        status=413,
        reason="too_large",
        field="body",
        fix="authenticate first ('Authorization: token <JupyterHub token>'), and send less"
        if who == "an unauthenticated caller"
        else "send less: large data belongs in a dataset, not in the request",
    )


@web.stream_request_body
class BaseHandler(web.RequestHandler):
    """JSON in, JSON out, errors as JSON; no authentication of its own.

    The body is streamed: :meth:`prepare` runs once the headers are in, identifies the caller
    (:meth:`authenticate`) and bounds what may follow (:meth:`body_limit`), before anything is buffered.
    """

    max_body = MAX_BODY
    _body: bytearray | None = None

    async def authenticate(self) -> bool:
        """Identify the caller before the body is read; True if someone is authenticated (none here)."""
        return False

    def body_limit(self, authenticated: bool) -> int:
        if authenticated:
            return self.max_body
        return min(self.max_body, self.settings.get("danlu_anonymous_max_body", ANONYMOUS_BODY))

    async def admit(self) -> None:
        """What refuses the request before its body is read, raised: here a method the route does not have
        (a 405); a rate bound, an unknown route in subclasses."""
        if self.request.method not in self.allowed_methods():
            raise web.HTTPError(405)

    async def prepare(self):
        self._received, self._refusal = 0, None
        self._body_limit, self._who = self.max_body, "you"
        length = self.request.headers.get("Content-Length")
        if length is not None and not length.strip().isdigit():
            raise too_large(self._body_limit, self._who)  # answered at once: the connection closes
        try:
            await self.admit()
            authenticated = await self.authenticate()
            self._body_limit = self.body_limit(authenticated)
            self._who = "you" if authenticated else "an unauthenticated caller"
            if length is not None and int(length) > self._body_limit:
                raise too_large(self._body_limit, self._who)
        except (DanluError, web.HTTPError) as refusal:
            # A refusal is answered once the body is in (read and dropped, up to DISCARD_BODY): answering
            # before it makes tornado close the connection after the answer, which configurable-http-proxy may
            # be writing to still or reusing for its next request (that caller then gets the proxy's 503)
            if length is not None and int(length) > DISCARD_BODY:
                raise  # answered at once, with Connection: close (see finish)
            self._refuse_after_body(refusal)
        # tornado itself cuts off a body past this (a chunked one, which announces no length)
        self.request.connection.set_max_body_size(max(self._body_limit, DISCARD_BODY))

    def _refuse_after_body(self, error: Exception) -> None:
        """Answer ``error`` once the body is in (read and dropped), instead of the route's own method."""
        self._refusal, self._body = error, None

        def refused(*args, **kwargs):
            raise error

        setattr(self, self.request.method.lower(), refused)  # what tornado calls once the body is in

    def finish(self, chunk=None):
        # An answer before the whole body is read (a body too large, a method tornado does not know) ends the
        # connection: say so, or the proxy may send its next request down a socket that is closing
        body_read = getattr(self.request, "_body_future", None)  # tornado's, set while a body streams in
        if body_read is not None and not body_read.done() and not self._headers_written:
            self.set_header("Connection", "close")
        return super().finish(chunk)

    def data_received(self, chunk: bytes) -> None:
        if self._refusal is not None:
            return  # dropped
        self._received += len(chunk)
        if self._received > self._body_limit:  # a chunked body, past the limit
            self._refuse_after_body(too_large(self._body_limit, self._who))
            return
        if self._body is None:
            self._body = bytearray()
        self._body += chunk

    @property
    def body(self) -> bytes:
        """The whole request body, as received (within :meth:`body_limit`)."""
        return bytes(self._body) if self._body else b""

    @property
    def manager(self) -> JobManager:
        """The service's :class:`~danlu.hub.service.manager.JobManager`: every handler's one counterpart."""
        return self.settings["danlu_manager"]

    def set_default_headers(self):
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Content-Type-Options", "nosniff")

    def allowed_methods(self) -> list[str]:
        return [m.upper() for m in METHODS if getattr(type(self), m) is not getattr(web.RequestHandler, m)]

    # input ---------------------------------------------------------------------------------
    def decode_argument(self, value: bytes, name: str | None = None) -> str:
        """Every path and query parameter as text: bytes that are not UTF-8 are a 400 naming the parameter."""
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            field = PATH_NAMES.get(name or "", name) or "path"
            raise UsageError(
                f"{field}: {value[:40]!r} is not UTF-8 once percent-decoded",
                field=field,
                reason="bad_unicode",
                fix="percent-encode UTF-8 text (e.g. %C3%A9 for \u00e9)",
            ) from None

    def json_body(self, *, anything: bool = False):
        """The request body: a JSON object (any JSON value with ``anything``, for a caller that refuses
        the rest itself) within every bound of :func:`~danlu.hub.service.jsonbody.parse_json`."""
        body = jsonbody.parse_json(self.body, max_bytes=self.max_body)
        if not anything and not isinstance(body, dict):
            raise ValidationError(
                f"the request body must be a JSON object, not {_JSON_TYPES[type(body)]}",
                field="body",
                reason="not_an_object",
                fix="send a JSON object: {...}",
            )
        return body

    def query_arg(self, name: str) -> str | None:
        """A query parameter as sent (tornado's ``get_argument`` would turn NUL and other control characters
        into spaces and strip it), or None; given twice it is a 400, as the two could be read differently."""
        values = self.request.query_arguments.get(name)
        if not values:
            return None
        if len(values) > 1:
            raise UsageError(
                f"query parameter {name} is given {len(values)} times",
                field=name,
                reason="bad_query",
                fix=f"give {name} once",
            )
        return self.decode_argument(values[0], name)

    def str_arg(self, name: str, default: str | None = None, *, choices=None, max_length: int = MAX_QUERY):
        raw = self.query_arg(name)
        if raw is None:
            return default
        if len(raw) > max_length or _CONTROL.search(raw):
            raise UsageError(
                f"query parameter {name} must be at most {max_length} printable characters",
                field=name,
                reason="bad_query",
                fix=f"send {name} without NUL, tabs, newlines or other control characters",
            )
        if choices is not None and raw not in choices:
            raise UsageError(
                f"query parameter {name} must be one of {', '.join(choices)}, got {raw[:40]!r}",
                field=name,
                reason="bad_query",
                fix=f"e.g. {name}={choices[0]}",
            )
        return raw

    def int_arg(self, name: str, default=None, minimum: int = 0, maximum: int = validation.MAX_SAFE_INT):
        return validation.int_param(self.query_arg(name), name, default=default, minimum=minimum, maximum=maximum)

    def bool_arg(self, name: str) -> bool:
        raw = self.str_arg(name, "false")
        if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise UsageError(
                f"query parameter {name} must be true or false, got {raw[:40]!r}",
                field=name,
                reason="bad_query",
                fix=f"{name}=true or {name}=false",
            )
        return raw.lower() in ("1", "true", "yes", "on")

    def job_arg(self, value: str) -> str:
        return self.path_arg(value, "id", JOB_ID, "a job id (12 hex digits)")

    @staticmethod
    def path_arg(value: str, name: str, pattern: re.Pattern, what: str) -> str:
        if not isinstance(value, str) or not pattern.match(value):
            shown = pattern.pattern.removesuffix("\\Z") + "$"  # as the OpenAPI document writes it (ECMA)
            raise UsageError(
                f"{name}: {value[:40]!r} is not {what}", field=name, reason="bad_id", fix=f"it must match {shown}"
            )
        return value

    # output --------------------------------------------------------------------------------
    def write_json(self, data, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(data))

    def write_error(self, status_code: int, **kwargs) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        allowed = self.allowed_methods() if status_code == 405 else []
        if isinstance(exc, DanluError):
            body = exc.to_dict()
            if exc.fix:
                body["fix"] = exc.fix
            self.set_status(exc.status)
            if exc.retry_after:  # a 429 or 503 says when to come back
                self.set_header("Retry-After", str(int(exc.retry_after)))
        elif status_code == 405 and not allowed:  # a method tornado does not know, on a route that has none
            body = NotFoundHandler.missing(self.request).to_dict()
            self.set_status(404)
        elif status_code == 405:
            self.set_header("Allow", ", ".join(allowed))
            body = {
                "status": 405,
                "reason": "method_not_allowed",
                "message": f"{self.request.method} is not allowed on {self.request.path[:200]}",
                "fix": f"use {', '.join(allowed)}",
            }
        elif isinstance(exc, web.HTTPError) and isinstance(exc.__cause__, httputil.HTTPInputError):
            # tornado parses form-encoded and multipart bodies before any handler runs
            body = {
                "status": status_code,
                "reason": "malformed_body",
                "field": "body",
                "message": f"the request body cannot be read: {str(exc.__cause__)[:200]}",
                "fix": "send a JSON object with Content-Type: application/json",
            }
        elif isinstance(exc, web.HTTPError) and status_code < 500:
            phrase = exc.reason or httputil.responses.get(status_code, "error")
            body = {
                "status": status_code,
                "reason": re.sub(r"[^a-z0-9]+", "_", phrase.lower()).strip("_") or "error",
                "message": exc.log_message or phrase,
            }
        else:
            body = {
                "status": status_code,
                "reason": "internal_error" if status_code >= 500 else "error",
                "message": "internal error: see the service log" if status_code >= 500 else self._reason,
            }
        self.clear_header("Content-Disposition")
        self.clear_header("Content-Security-Policy")
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.finish(json.dumps(body))

    def log_exception(self, typ, value, tb):
        if isinstance(value, DanluError) and value.status < 500:
            app_log.info(
                "%s %s -> %s %s: %s",
                self.request.method,
                self.request.path,
                value.status,
                value.reason,
                value.log_message,
            )
        elif isinstance(value, web.HTTPError) and value.status_code < 500:
            app_log.info("%s %s -> %s", self.request.method, self.request.path, value.status_code)
        else:
            super().log_exception(typ, value, tb)


class APIHandler(AsyncHubAuthenticated, BaseHandler):
    """A handler for hub users and services: :meth:`principal` says who calls.

    ``login_redirect``: whether a browser with no token and no login (a GET that accepts HTML) is sent
    through the hub's login and back, as for the pages and the links on them; elsewhere it gets a 401.
    """

    login_redirect = False

    async def authenticate(self) -> bool:
        # never the hub's round trip on the event loop (danlu.hub.hubauth). XSRF is JupyterHub's check: it is
        # skipped only for a request its token authenticated, so a cookie is checked whatever other headers
        # come with it (an Authorization header that authenticates no one included)
        await self.identify()
        return bool(self.current_user)

    def admin(self) -> Principal:
        """The caller, if an admin; a 403 otherwise, before the request's body or arguments are looked at."""
        who = self.principal()
        require_admin(who)
        return who

    def wants_html(self) -> bool:
        return self.request.method == "GET" and "text/html" in self.request.headers.get("Accept", "")

    def principal(self) -> Principal:
        model = self.current_user
        browser = self.login_redirect and self.wants_html() and not self.request.headers.get("Authorization")
        if not model and browser:
            # a browser following a link (job card, Services menu): through the hub's login and back
            self.redirect(self.get_login_url())
            raise web.Finish()
        if not model:
            if self.request.headers.get("Authorization"):
                raise Forbidden(
                    "this token may not use the Danlu service",
                    reason="token_rejected",
                    fix="use a JupyterHub token of yours (JUPYTERHUB_API_TOKEN in your server)",
                )
            raise DanluError(
                "authentication required",
                status=401,
                reason="unauthenticated",
                fix="send 'Authorization: token <JupyterHub token>' or log in at /hub/login",
            )
        return Principal(
            name=model["name"],
            kind=model.get("kind", "user"),
            scopes=frozenset(model.get("scopes", [])),
            groups=tuple(model.get("groups") or ()),
        )


class NotFoundHandler(BaseHandler):
    """Anything under the service's prefix that no route matches: a JSON 404, whatever the method."""

    @staticmethod
    def missing(request) -> DanluError:
        return DanluError(
            f"no such endpoint: {request.method[:20]} {request.path[:200]}",
            status=404,
            reason="no_endpoint",
            fix="see /services/danlu/api/v1/openapi.json",
        )

    async def admit(self) -> None:
        raise self.missing(self.request)
