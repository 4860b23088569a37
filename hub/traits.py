"""The trait types of danlu.yaml's options, and the JSON Schema that follows from them.

Every option of danlu.yaml is a trait of a ``Configurable`` (:mod:`danlu.hub.config`). The
types here add what a file that admins edit needs beyond traitlets' own: text that must match a
pattern (:class:`Text`), a number above zero (:class:`Positive`), paths relative to where
``danlu up`` runs (:class:`Path`), sizes such as ``8G`` (:class:`Size`), mappings with named
fields (:class:`Record`), and containers whose every read is a copy (:class:`List`,
:class:`Dict`), so no reader can change what the next one sees. :func:`schema_of` writes a
trait as JSON Schema, which is how the schema danlu.yaml is validated with (line-accurate
errors, :mod:`danlu.hub.yamlconfig`) says exactly what the traits accept and nothing else.
"""

from __future__ import annotations

import copy
import os
import pathlib
import re
import sys
from typing import Any

import traitlets
from traitlets import Bool, Enum, Integer, TraitError, TraitType, Undefined, Unicode, Union


class Text(Unicode):
    """A string that matches ``pattern`` (``re.search``, as JSON Schema does) and has a bounded length."""

    def __init__(
        self,
        default_value: Any = Undefined,
        *,
        pattern: str | None = None,
        min_length: int | None = None,
        max_length: int | None = None,
        **kwargs,
    ):
        self.pattern = pattern
        self.min_length = min_length
        self.max_length = max_length
        super().__init__(default_value, **kwargs)

    def validate(self, obj, value):
        value = super().validate(obj, value)
        if self.pattern is not None and not re.search(self.pattern, value):
            raise TraitError(f"{self.name or 'value'}: {value!r} does not match {self.pattern}")
        if self.min_length is not None and len(value) < self.min_length:
            raise TraitError(f"{self.name or 'value'}: {value!r} is shorter than {self.min_length} characters")
        if self.max_length is not None and len(value) > self.max_length:
            raise TraitError(f"{self.name or 'value'}: {value!r} is longer than {self.max_length} characters")
        return value


class Positive(traitlets.Float):
    """A number above zero (and at most ``max``)."""

    def validate(self, obj, value):
        value = super().validate(obj, value)
        if value <= 0:
            raise TraitError(f"{self.name or 'value'}: {value!r} is not above 0")
        return value


class Path(TraitType):
    """A filesystem path, as a :class:`pathlib.Path`.

    ``~`` is expanded, and a relative path starts at the owner's ``base_dir`` (where ``danlu up``
    runs), as relative paths in danlu.yaml always have. ``resolve=True`` resolves symbolic links too.
    """

    info_text = "a path"

    def __init__(self, default_value: Any = Undefined, *, resolve: bool = False, **kwargs):
        self.resolve = resolve
        super().__init__(default_value, **kwargs)

    def validate(self, obj, value):
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            self.error(obj, value)
        path = from_base(value, getattr(obj, "base_dir", None))
        return path.resolve() if self.resolve else path


def from_base(value: str | os.PathLike, base_dir: str | os.PathLike | None) -> pathlib.Path:
    """``value`` with ``~`` expanded; when relative, under ``base_dir`` (if one is given)."""
    path = pathlib.Path(os.path.expanduser(value))
    return pathlib.Path(base_dir) / path if base_dir is not None and not path.is_absolute() else path


SIZE_PATTERN = r"^[0-9]{1,12}(\.[0-9]{1,6})?[KMGT]i?$"


class Size(Union):
    """A size: ``512M``, ``8G``, ``1T`` (binary units; ``Gi`` accepted too) or a number of bytes, at most 2**60.

    The value stays as written (see :func:`danlu.hub.teams.parse_size` and
    :func:`danlu.hub.kueue.memory_quantity` for its two readings).
    """

    def __init__(self, default_value: Any = Undefined, **kwargs):
        super().__init__([Integer(min=0, max=2**60), Text(pattern=SIZE_PATTERN)], default_value=default_value, **kwargs)


class _ReadsAsCopy:
    """Every read of the option is a deep copy: one reader changing what it got changes nothing for the next."""

    def get(self, obj, cls=None):
        return copy.deepcopy(super().get(obj, cls))


class List(_ReadsAsCopy, traitlets.List):
    """traitlets' ``List``, read as a copy."""


class Dict(_ReadsAsCopy, traitlets.Dict):
    """traitlets' ``Dict`` with at least ``minlen`` and at most ``maxlen`` entries, read as a copy."""

    def __init__(
        self,
        value_trait=None,
        per_key_traits=None,
        key_trait=None,
        default_value=Undefined,
        *,
        minlen: int = 0,
        maxlen: int | None = None,
        **kwargs,
    ):
        self.minlen = minlen
        self.maxlen = maxlen
        super().__init__(value_trait, per_key_traits, key_trait, default_value, **kwargs)

    def validate_elements(self, obj, value):
        if len(value) < self.minlen or (self.maxlen is not None and len(value) > self.maxlen):
            most = "" if self.maxlen is None else f" and at most {self.maxlen}"
            raise TraitError(f"{self.name or 'value'}: needs at least {self.minlen}{most} entries, has {len(value)}")
        return super().validate_elements(obj, value)


class Record(Dict):
    """A mapping with named fields, each one a trait: the ``required`` ones present, no others."""

    def __init__(self, fields: dict[str, TraitType], *, required: tuple[str, ...] = (), **kwargs):
        self.fields = fields
        self.required = tuple(required)
        super().__init__(per_key_traits=fields, **kwargs)

    def validate_elements(self, obj, value):
        unknown = [key for key in value if key not in self.fields]
        missing = [key for key in self.required if key not in value]
        if unknown or missing:
            problems = [f"unknown key {key!r}" for key in unknown] + [f"{key!r} is required" for key in missing]
            raise TraitError(f"{self.name or 'value'}: {', '.join(problems)}")
        return super().validate_elements(obj, value)


def _help(trait: TraitType) -> str:
    return " ".join((trait.help or "").split())


def schema_of(trait: TraitType) -> dict:
    """The JSON Schema of what ``trait`` accepts (with its help as the description).

    A trait whose shape JSON Schema says better than its type may carry ``schema`` metadata,
    which is merged over the generated schema.
    """
    out = _schema(trait)
    out.update(trait.metadata.get("schema", {}))
    if _help(trait):
        out = {"description": _help(trait), **out}
    return out


def _bounds(trait, low: str, high: str) -> dict:
    """``{low: min, high: max}`` for the bounds a number trait has (``low=""``: leave the minimum out)."""
    out = {}
    if low and trait.min is not None and trait.min != -float("inf"):
        out[low] = trait.min
    if trait.max is not None and trait.max != float("inf"):
        out[high] = trait.max
    return out


def _schema(trait: TraitType) -> dict:
    if isinstance(trait, Union):
        return {"oneOf": [schema_of(t) for t in trait.trait_types]}
    if isinstance(trait, Bool):
        return {"type": "boolean"}
    if isinstance(trait, Enum):
        return {"enum": list(trait.values)}
    if isinstance(trait, Integer):
        return {"type": "integer", **_bounds(trait, "minimum", "maximum")}
    if isinstance(trait, Positive):
        return {"type": "number", "exclusiveMinimum": 0, **_bounds(trait, "", "maximum")}
    if isinstance(trait, traitlets.Float):
        return {"type": "number", **_bounds(trait, "minimum", "maximum")}
    if isinstance(trait, Path):
        return {"type": "string", "minLength": 1}
    if isinstance(trait, Unicode):
        out: dict[str, Any] = {"type": "string"}
        for attr, key in (("pattern", "pattern"), ("min_length", "minLength"), ("max_length", "maxLength")):
            if getattr(trait, attr, None) is not None:
                out[key] = getattr(trait, attr)
        return out
    if isinstance(trait, traitlets.List):
        out = {"type": "array"}
        if trait._trait is not None:
            out["items"] = schema_of(trait._trait)
        if trait._minlen:
            out["minItems"] = trait._minlen
        if trait._maxlen < sys.maxsize:
            out["maxItems"] = trait._maxlen
        return out
    if isinstance(trait, Record):
        out = {
            "type": "object",
            "additionalProperties": False,
            "properties": {key: schema_of(field) for key, field in trait.fields.items()},
        }
        if trait.required:
            out["required"] = list(trait.required)
        return out
    if isinstance(trait, traitlets.Dict):
        out = {"type": "object"}
        names = {k: v for k, v in schema_of(trait._key_trait or Unicode()).items() if k not in ("type", "description")}
        if names:
            out["propertyNames"] = names
        if trait._value_trait is not None:
            out["additionalProperties"] = schema_of(trait._value_trait)
        if getattr(trait, "minlen", 0):
            out["minProperties"] = trait.minlen
        if getattr(trait, "maxlen", None) is not None:
            out["maxProperties"] = trait.maxlen
        return out
    raise TypeError(
        f"{type(trait).__name__} has no JSON Schema: give it schema= metadata or use a type of danlu.hub.traits"
    )


def options(cls: type) -> dict[str, TraitType]:
    """The options (``config=True`` traits) of a Configurable class, in the order its classes declare them."""
    traits = cls.class_traits(config=True)
    order = [name for klass in reversed(cls.__mro__) for name in vars(klass) if name in traits]
    return {name: traits[name] for name in dict.fromkeys(order)}


def type_text(trait: TraitType) -> str:
    """What an option takes, in a few words: ``integer, 1-65535``, ``list of string``, ``auto|on|off``."""
    return _words(_schema(trait))


def _words(schema: dict) -> str:
    if "oneOf" in schema:
        return " or ".join(_words(s) for s in schema["oneOf"])
    if "enum" in schema:
        return "|".join(str(v) for v in schema["enum"])
    kind = {
        "integer": "integer",
        "number": "number",
        "boolean": "boolean",
        "string": "string",
        "array": "list",
        "object": "map",
    }.get(schema.get("type", ""), "value")
    low = schema.get("minimum")
    high = schema.get("maximum")
    if schema.get("exclusiveMinimum") is not None:
        kind += f" > {schema['exclusiveMinimum']}"
    elif low is not None and high is not None:
        kind += f", {low}-{high}"
    elif low is not None:
        kind += f" >= {low}"
    elif high is not None:
        kind += f" <= {high}"
    if schema.get("pattern"):
        kind += f" matching {schema['pattern']}"
    if kind == "list" and "items" in schema:
        kind += " of " + _words(schema["items"])
    if kind == "map" and "properties" in schema:
        kind += " with keys " + ", ".join(schema["properties"])
    elif kind == "map" and isinstance(schema.get("additionalProperties"), dict):
        kind += " of " + _words(schema["additionalProperties"])
    return kind
