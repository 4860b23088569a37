"""From danlu.yaml to the admission model: teams, priority classes, requests.

:func:`build_model` turns ``teams``, the GPU inventory and ``resources`` into a
:class:`~danlu.hub.service.admission.model.Model` (with admins' live changes, kept in
the database, applied on top). :func:`check` refuses a configuration that names
a GPU flavor the machine does not have. :func:`queue_for` decides which team's
queue a job goes to, and :func:`priority_of` what its priority class is worth.
Without ``teams`` there is one queue, ``default``, holding the whole machine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from danlu.errors import ConfigError, PolicyError, ValidationError
from danlu.hub.service.admission.model import Model
from danlu.hub.service.admission.workloads import Request, Team, gpu_key
from danlu.hub.teams import DEFAULT_QUEUE, parse_size

if TYPE_CHECKING:
    from danlu.hub.config import Settings
    from danlu.hub.gpus import GPU


def _amounts(spec: dict | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for flavor, count in ((spec or {}).get("gpus") or {}).items():
        out[gpu_key(flavor)] = float(count)
    if spec and "cpu" in spec:
        out["cpu"] = float(spec["cpu"])
    if spec and "memory" in spec:
        out["memory"] = parse_size(spec["memory"])
    return out


def flavors_of(inventory: Iterable[GPU]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for gpu in inventory:
        out.setdefault(gpu.flavor, []).append(gpu.index)
    return out


def team_specs(settings: Settings, overrides: dict[str, dict] | None = None) -> dict[str, dict]:
    """Every team's settings with admins' live changes applied (name -> dict)."""
    teams = settings.teams
    for name, change in (overrides or {}).items():
        if name in teams:
            teams[name] = {**teams[name], **{k: v for k, v in change.items() if k != "held"}}
    return teams


def build_teams(settings: Settings, inventory: list[GPU], overrides: dict[str, dict] | None = None) -> list[Team]:
    flavors = list(flavors_of(inventory))
    overrides = overrides or {}
    specs = team_specs(settings, overrides)
    if not specs:
        nominal = {gpu_key(f): float(len(ids)) for f, ids in flavors_of(inventory).items()}
        return [
            Team(
                DEFAULT_QUEUE,
                nominal=nominal,
                flavors=tuple(flavors),
                held=bool(overrides.get(DEFAULT_QUEUE, {}).get("held")),
            )
        ]
    teams = []
    for name, spec in specs.items():
        own = list(((spec.get("quota") or {}).get("gpus") or {}))
        preemption = spec.get("preemption") or {}
        teams.append(
            Team(
                name=name,
                nominal=_amounts(spec.get("quota")),
                borrowing_limit=_amounts(spec.get("borrowing_limit")),
                lending_limit=_amounts(spec.get("lending_limit")),
                cohort=spec.get("cohort"),
                flavors=tuple(own + [f for f in flavors if f not in own]),
                within_team=preemption.get("within_team", "lower_priority"),
                reclaim=preemption.get("reclaim", "any"),
                held=bool(overrides.get(name, {}).get("held")),
            )
        )
    return teams


def check(settings: Settings, inventory: list[GPU]) -> None:
    """Refuse teams that name GPU flavors this machine does not have."""
    have = set(flavors_of(inventory))
    for name, spec in settings.teams.items():
        for section in ("quota", "borrowing_limit", "lending_limit"):
            for flavor in (spec.get(section) or {}).get("gpus") or {}:
                if flavor not in have:
                    raise ConfigError(
                        f"{settings.where('teams', name, section, 'gpus', flavor)}: teams.{name}.{section}.gpus: "
                        f"no GPU of flavor '{flavor}' on this machine",
                        fix=f"flavors here: {', '.join(sorted(have)) or 'none (declare them under gpus.declared)'}",
                    )


def build_model(settings: Settings, inventory: list[GPU], overrides: dict[str, dict] | None = None) -> Model:
    resources = settings.job_resources
    return Model(
        build_teams(settings, inventory, overrides),
        flavors_of(inventory),
        cpu=resources["cpu"],
        memory=resources["memory"],
        starvation_seconds=settings.jobs.starvation_seconds,
    )


def queue_for(settings: Settings, requested: str | None, groups: Iterable[str], *, admin: bool = False) -> str:
    """The team whose queue a job goes to: the one asked for (if the user is in it), else their first team."""
    teams = list(settings.teams)
    if not teams:
        if requested not in (None, DEFAULT_QUEUE):
            raise ValidationError(f"unknown queue '{requested}'", field="queue", fix=f"use {DEFAULT_QUEUE}")
        return DEFAULT_QUEUE
    groups = set(groups)
    mine = [t for t in teams if t in groups]
    if requested is not None:
        if requested not in teams:
            raise ValidationError(f"unknown queue '{requested}'", field="queue", fix=f"queues: {', '.join(teams)}")
        if requested not in groups and not admin:
            raise PolicyError(
                f"queue '{requested}' belongs to team {requested}; you are in {', '.join(sorted(groups)) or 'no team'}",
                field="queue",
                reason="not_in_team",
                fix=f"submit to {', '.join(mine)}" if mine else "ask an admin to add you to a team",
            )
        return requested
    if not mine:
        if admin:
            return teams[0]
        raise PolicyError(
            "you are in no team, so you have no queue",
            field="queue",
            reason="no_team",
            fix="ask an admin to add you to a team (a JupyterHub group listed under teams)",
        )
    return mine[0]


def priority_of(settings: Settings, name: str | None) -> tuple[str, int]:
    classes = settings.priority_classes
    if name is None:
        default = settings.default_priority_class
        return (default, classes[default]) if default else ("", 0)
    if name not in classes:
        raise ValidationError(
            f"unknown priority class '{name}'", field="priority", fix=f"use one of: {', '.join(classes)}"
        )
    return name, classes[name]


def request_for(resources: dict, nproc: int, profile) -> Request:
    """What a job asks for: GPUs, CPUs (default one per process) and memory (default the profile's)."""
    memory = resources.get("memory")
    if memory is None and getattr(profile, "memory", None):
        memory = profile.memory
    return Request(
        gpus=int(resources.get("gpus", 0)),
        gpu_flavor=resources.get("gpu_type"),
        cpu=float(resources.get("cpu", nproc)),
        memory=parse_size(memory) if memory else 0.0,
    )
