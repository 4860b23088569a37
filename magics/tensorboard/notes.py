"""How the metric forwarder words what went wrong, for the job's tracking health (its notes) and its log.

Short on purpose: a note names the metric (:func:`quoted`, start and end of a long name), how many points it
concerns (:func:`counted`, :func:`render`) and MLflow's reason (:func:`describe`, one line, clipped).
"""

from __future__ import annotations


def describe(error: BaseException, limit: int = 200) -> str:
    return clip(" ".join(str(error).split()) or type(error).__name__, limit)


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def quoted(name: str, limit: int = 60) -> str:
    """A name for a note: its start and its end (where a hash suffix is) when it is long."""
    return repr(name if len(name) <= limit else f"{name[: limit - 15]}...{name[-12:]}")


def counted(n: int, unit: str) -> str:
    return f"1 {unit}" if n == 1 else f"{n} {unit}s"


def render(count: int | None, unit: str, text: str) -> str:
    return text if count is None else counted(count, unit) + text
