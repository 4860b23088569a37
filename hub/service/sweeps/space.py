"""What a sweep asks for, parsed and checked before anything is queued: pure, no database, MLflow or Optuna.

A search space is what ``--sweep`` says, one ``NAME=DISTRIBUTION(ARGS)`` a parameter:
``uniform(a,b)``, ``loguniform(a,b)`` (a > 0), ``int(a,b)`` (whole numbers) and ``choice(v1,...)``
(JSON or Python literals, else strings, as ``--param`` reads them). The objective is ``METRIC:min`` or
``METRIC:max``. :func:`parse_request` turns a ``POST /sweeps`` body into a :class:`SweepSpec`, or raises a
:class:`~danlu.errors.UsageError` (400) naming the field and the fix -- the same words the magic and the
CLI print, as they only relay the service's answer. Nothing here evaluates user text.
"""

from __future__ import annotations

import ast
import json
import keyword
import math
import re
from dataclasses import dataclass, field

from danlu.errors import UsageError

DISTRIBUTIONS = ("uniform", "loguniform", "int", "choice")
SCHEDULERS = ("asha", "hyperband", "none")
SAMPLERS = ("tpe", "random")
MAX_CHOICES = 100
MAX_PARAMETERS = 32
_ITEM = re.compile(r"\s*([^=\s]+)\s*=\s*([A-Za-z_]\w*)\s*\((.*)\)\s*\Z", re.S)
_OBJECTIVE = re.compile(r"([A-Za-z0-9_.\-/ ]{1,250}):(min|max)\Z")
SWEEP_FIX = 'write NAME=DISTRIBUTION(ARGS), e.g. "lr=loguniform(1e-4,1e-1)" or "batch=choice(32,64)"'


@dataclass(frozen=True)
class Dimension:
    """One parameter's distribution: ``low``/``high`` for the ranges, ``choices`` for ``choice``."""

    name: str
    distribution: str
    low: float | int | None = None
    high: float | int | None = None
    choices: tuple = ()

    def to_dict(self) -> dict:
        if self.distribution == "choice":
            return {"distribution": "choice", "choices": list(self.choices)}
        return {"distribution": self.distribution, "low": self.low, "high": self.high}

    def text(self) -> str:
        args = self.choices if self.distribution == "choice" else (self.low, self.high)
        return f"{self.name}={self.distribution}({','.join(json.dumps(a) for a in args)})"


@dataclass(frozen=True)
class SweepSpec:
    """A sweep's options, checked: the space, the objective and how the search runs."""

    space: tuple[Dimension, ...]
    metric: str
    direction: str  # "minimize" | "maximize"
    trials: int
    parallel: int
    scheduler: str = "asha"
    sampler: str = "tpe"
    seed: int | None = None
    min_resource: int = 1
    reduction_factor: int = 3
    job: dict = field(default_factory=dict)  # the trial's JobSubmission body, without the swept parameters
    name: str = ""

    @property
    def objective(self) -> str:
        return f"{self.metric}:{'min' if self.direction == 'minimize' else 'max'}"


def _bad(field_: str, message: str, fix: str) -> UsageError:
    return UsageError(message, field=field_, reason="bad_sweep", fix=fix)


def _number(raw: str, field_: str, item: str, whole: bool = False) -> float | int:
    text = raw.strip()
    try:
        value = int(text) if whole and re.fullmatch(r"[-+]?[0-9]+", text) else float(text)
    except ValueError:
        kind = "a whole number" if whole else "a number"
        raise _bad(field_, f"{item}: bound '{text[:40]}' is not {kind}", f"give {kind}, e.g. 1e-3") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad(field_, f"{item}: bound '{text[:40]}' is not a finite number", "give a finite number")
    if whole and not isinstance(value, int):
        raise _bad(field_, f"{item}: int() takes whole numbers, got '{text[:40]}'", "write e.g. int(1,8)")
    return value


def _literal(raw: str):
    raw = raw.strip()
    for parse in (json.loads, ast.literal_eval):
        try:
            value = parse(raw)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
    return raw.strip("'\"")


def parse_dimension(text, field_: str) -> Dimension:
    """``NAME=DISTRIBUTION(ARGS)`` as a :class:`Dimension`; a UsageError naming ``field_`` otherwise."""
    if not isinstance(text, str) or len(text) > 4096:
        raise _bad(field_, "a sweep parameter is a string of at most 4096 characters", SWEEP_FIX)
    found = _ITEM.match(text)
    if not found:
        raise _bad(field_, f"'{text[:80]}' is not NAME=DISTRIBUTION(ARGS)", SWEEP_FIX)
    name, kind, args = found.group(1), found.group(2), found.group(3)
    if not name.isidentifier() or keyword.iskeyword(name):
        raise _bad(field_, f"'{name[:40]}' is not a usable Python name", "use letters, digits and _ (not a keyword)")
    if kind not in DISTRIBUTIONS:
        raise _bad(
            field_,
            f"{name}: unknown distribution '{kind[:40]}'",
            f"use one of {', '.join(d + '(...)' for d in DISTRIBUTIONS)}",
        )
    parts = [p for p in (a.strip() for a in args.split(","))] if args.strip() else []
    if kind == "choice":
        if not parts or len(parts) > MAX_CHOICES or any(not p for p in parts):
            raise _bad(field_, f"{name}: choice() takes 1 to {MAX_CHOICES} values", "write e.g. choice(32,64)")
        choices = tuple(_literal(p) for p in parts)
        if len(set(map(json.dumps, choices))) != len(choices):
            raise _bad(field_, f"{name}: choice() lists a value twice", "list each value once")
        return Dimension(name, "choice", choices=choices)
    if len(parts) != 2:
        raise _bad(field_, f"{name}: {kind}() takes two bounds, low and high", f"write e.g. {kind}(1,10)")
    item = f"{name}={kind}(...)"
    low, high = (_number(p, field_, item, whole=kind == "int") for p in parts)
    if low >= high:
        raise _bad(field_, f"{item}: low {low} is not below high {high}", "give the smaller bound first")
    if kind == "loguniform" and low <= 0:
        raise _bad(field_, f"{item}: loguniform needs low > 0, got {low}", "give a positive low bound, e.g. 1e-5")
    return Dimension(name, kind, low=low, high=high)


def parse_objective(text) -> tuple[str, str]:
    """``METRIC:min|max`` -> (metric, "minimize" | "maximize")."""
    found = _OBJECTIVE.match(text) if isinstance(text, str) else None
    if not found:
        raise _bad(
            "objective",
            f"objective '{str(text)[:80]}' is not METRIC:min or METRIC:max",
            "name the metric the cell logs and the direction, e.g. val_loss:min or accuracy:max",
        )
    return found.group(1), "minimize" if found.group(2) == "min" else "maximize"


def _whole(body: dict, key: str, default, low: int, high: int, fix: str):
    value = body.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad(key, f"{key} must be a whole number from {low} to {high}, got {str(value)[:40]}", fix)
    return value


def parse_request(body, *, max_trials: int, max_parallel: int) -> SweepSpec:
    """A ``POST /sweeps`` body as a :class:`SweepSpec`; the first problem as a 400 naming its field."""
    if not isinstance(body, dict):
        raise _bad("body", "the request body must be a JSON object", 'send {"job": {...}, "sweep": [...], ...}')
    job = body.get("job")
    if not isinstance(job, dict):
        raise _bad("job", "a sweep needs the trials' job: a JobSubmission object", 'send "job": {"notebook": ...}')
    items = body.get("sweep")
    if not isinstance(items, list) or not items:
        raise _bad("sweep", "a sweep needs at least one parameter to search", SWEEP_FIX)
    if len(items) > MAX_PARAMETERS:
        raise _bad("sweep", f"at most {MAX_PARAMETERS} parameters", "search fewer parameters")
    space = tuple(parse_dimension(item, f"sweep[{i}]") for i, item in enumerate(items))
    names = [d.name for d in space]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise _bad(f"sweep[{i}]", f"parameter '{name}' is swept twice", "give each parameter one --sweep")
    given = job.get("parameters")
    fixed: dict = given if isinstance(given, dict) else {}
    for i, name in enumerate(names):
        if name in fixed:
            raise _bad(f"sweep[{i}]", f"'{name}' is both a fixed --param and swept", f"drop --param {name}=...")
    metric, direction = parse_objective(body.get("objective"))
    trials = _whole(body, "trials", 16, 1, max_trials, f"ask for 1 to {max_trials} trials")
    parallel = _whole(body, "parallel", min(4, trials), 1, max_parallel, f"run 1 to {max_parallel} trials at once")
    scheduler = body.get("scheduler", "asha")
    if scheduler not in SCHEDULERS:
        raise _bad("scheduler", f"unknown scheduler '{str(scheduler)[:40]}'", f"use {', '.join(SCHEDULERS)}")
    sampler = body.get("sampler", "tpe")
    if sampler not in SAMPLERS:
        raise _bad("sampler", f"unknown sampler '{str(sampler)[:40]}'", f"use {', '.join(SAMPLERS)}")
    seed = _whole(body, "seed", None, 0, 2**32 - 1, "give a whole number from 0 to 4294967295")
    min_resource = _whole(body, "min_resource", 1, 1, 10**9, "the first rung's step: a whole number >= 1")
    reduction = _whole(body, "reduction_factor", 3, 2, 100, "keep 1 in N at each rung: N from 2 to 100")
    name = body.get("name", "")
    if not isinstance(name, str) or not re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]{0,99})?", name):
        raise _bad("name", "a sweep's name is letters, digits, . _ - (at most 100)", "e.g. lr-search")
    return SweepSpec(
        space=space,
        metric=metric,
        direction=direction,
        trials=trials,
        parallel=parallel,
        scheduler=scheduler,
        sampler=sampler,
        seed=seed,
        min_resource=min_resource,
        reduction_factor=reduction,
        job=job,
        name=name or job.get("name") or "",
    )


def placeholder(space: tuple[Dimension, ...]) -> dict:
    """A value of each parameter (its low bound, its first choice): what the dry run of the trials' job checks."""
    return {d.name: (d.choices[0] if d.distribution == "choice" else d.low) for d in space}
