"""Why a workload waits, in words: what it waits for, and where its team stands now.

A reason has two parts: what the workload waits for, which depends on its request alone and is worked out
once per ask (:func:`waits_for`), and where its team stands on the resource it lacks (:func:`standing`), which
alike workloads share and which is worked out once per pass from the figures it shows. Pure: no I/O, no
clock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from danlu.hub.service.admission.workloads import Team, Workload, gib

if TYPE_CHECKING:
    from danlu.hub.service.admission.model import Model


def reason(m: Model, wl: Workload, resource: str | None) -> str:
    """Why a workload waits, short of ``resource``, in words."""
    parts = _parts(m, wl, resource)
    return parts if isinstance(parts, str) else parts[0] + parts[1]


def _parts(m: Model, wl: Workload, resource: str | None) -> str | tuple[str, str]:
    """:func:`reason`, or its two parts (what it waits for, and where its team stands now), which a
    :class:`~.workloads.Waiting` joins when it is read."""
    if resource is None:
        return "waiting"
    key = ("reason", wl.ask, resource)
    what = m._static.get(key)
    if what is None:
        what = m._static[key] = waits_for(wl, resource)
    return what if resource == "gpu" else (what, _state(m, m.teams[wl.team], resource))


def waits_for(wl: Workload, resource: str) -> str:
    """What the workload waits for (the part of its reason that depends on the request only)."""
    request = wl.request
    if resource == "gpu":
        return f"waiting for {request.gpus} GPUs: team {wl.team} may use no GPU flavor"
    if resource.startswith("gpu/"):
        return f"waiting for {request.gpus} `{resource[4:]}` GPU{'s' if request.gpus != 1 else ''}"
    if resource == "cpu":
        return f"waiting for {request.cpu:g} CPU{'s' if request.cpu != 1 else ''}"
    return f"waiting for {request.memory / 2**30:.1f} GiB memory"


def _state(m: Model, team: Team, resource: str) -> str:
    """Where the team stands on the resource now (the part of a reason its alike workloads share)."""
    return m._cached(("state", team.name, resource), lambda: ": " + standing(m, team, resource))


def standing(m: Model, team: Team, resource: str) -> str:
    """Where the team stands on the resource, in words (remembered by the figures they show)."""
    used = m.used[team.name][resource]
    lend = m.lendable(team, resource) if team.cohort else None
    free = (
        m.capacity.get(resource, 0.0) - m.total_used[resource]
        if resource.startswith("gpu/") or resource == "cpu"
        else None
    )
    key = (team.name, resource, used, lend, free)
    words = m._worded.get(key)
    if words is None:
        if len(m._worded) > 10_000:
            m._worded.clear()
        show = gib if resource == "memory" else (lambda v: f"{v:g}")
        quota = f"/{show(team.nominal.get(resource, 0.0))}" if m._quoted(team, resource) else ""
        parts = [f"{team.name} uses {show(used)}{quota}"]
        if lend is not None:
            parts.append(f"cohort has {show(lend)} to lend")
        if free is not None:
            parts.append(f"{free:g} free on the machine")
        words = m._worded[key] = ", ".join(parts)
    return words
