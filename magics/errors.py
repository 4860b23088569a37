"""The exception hierarchy every Danlu component raises.

One root, :class:`DanluError`. Each error carries the message a user should read
(``str(err)``), an optional separate ``log_message`` for operators, a keyword-only
``reason`` (a short machine word, usable as a metrics label and returned in API
errors) and the HTTP ``status`` it maps to. The jobs service maps these to HTTP in
one base handler; the CLI prints ``str(err)`` and exits 2; ``%%train`` turns them
into IPython ``UsageError`` so a user never sees a traceback for their own mistake.
This mirrors JupyterHub's ``SpawnException`` (user-facing message, log message,
status) without depending on JupyterHub, because this module is imported inside
kernels and jobs too.
"""

from __future__ import annotations


class DanluError(Exception):
    """Root of every error Danlu raises on purpose."""

    status: int = 500
    default_reason: str = "error"
    #: seconds a refused caller should wait before trying again (the answer's Retry-After), when it may
    retry_after: float | None = None

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        status: int | None = None,
        log_message: str | None = None,
        field: str | None = None,
        fix: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        if status is not None:
            self.status = status
        self.log_message = log_message or message
        self.field = field
        self.fix = fix

    def __str__(self) -> str:
        text = self.message
        if self.fix and self.fix not in text:
            text = f"{text} ({self.fix})"
        return text

    def to_dict(self) -> dict:
        """The JSON body of an API error response."""
        body = {"status": self.status, "reason": self.reason, "message": str(self)}
        if self.field:
            body["field"] = self.field
        return body


class UsageError(DanluError):
    """The caller asked for something malformed (bad option, bad JSON, bad value)."""

    status = 400
    default_reason = "bad_request"


class ValidationError(UsageError):
    """A field of a request or a configuration value is invalid; ``field`` names it."""

    status = 422
    default_reason = "invalid"


class ConfigError(DanluError):
    """A file an admin edits (danlu.yaml, profiles.yaml) is invalid.

    The message names the file, the line, the key and how to fix it.
    """

    status = 500
    default_reason = "bad_config"


class NotFound(DanluError):
    status = 404
    default_reason = "not_found"


class Forbidden(DanluError):
    """Authenticated, but not allowed: another user's job, an admin operation."""

    status = 403
    default_reason = "forbidden"


class PolicyError(Forbidden):
    """Refused by governance: a profile outside the user's groups, too many GPUs."""

    default_reason = "policy"


class Conflict(DanluError):
    """The request is valid but not in the object's current state (cancel a finished job)."""

    status = 409
    default_reason = "conflict"


class Unreachable(DanluError):
    """A component (the hub, the jobs service, MLflow) could not be reached."""

    status = 503
    default_reason = "unreachable"
