"""Job backends (where admitted jobs run) and their registry.

``backends.get("local")`` returns a backend class, found through the
``danlu.backends`` entry point group (pyproject.toml lists the local and the
Kubernetes backend there), the way JupyterHub finds spawners by name; an
unknown name is a :class:`~danlu.errors.ConfigError` that lists the valid ones.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from danlu.errors import ConfigError


class Registry:
    """Named plug-ins: explicit ``register``, lazy entry points, typed errors for unknown names."""

    def __init__(self, group: str, kind: str):
        self.group = group
        self.kind = kind
        self._items: dict[str, object] = {}

    def register(self, name: str, item: object) -> None:
        self._items[name] = item

    def names(self) -> list[str]:
        found = {ep.name for ep in entry_points(group=self.group)}
        return sorted(found | set(self._items))

    def get(self, name: str):
        if name in self._items:
            item = self._items[name]
            if isinstance(item, str):  # "module:attr", imported on first use
                module, _, attr = item.partition(":")
                item = getattr(__import__(module, fromlist=[attr]), attr)
                self._items[name] = item
            return item
        for ep in entry_points(group=self.group):
            if ep.name == name:
                item = ep.load()
                self._items[name] = item
                return item
        raise ConfigError(
            f"unknown {self.kind} '{name}'",
            reason=f"unknown_{self.kind}",
            fix=f"choose one of: {', '.join(self.names())}",
        )


backends = Registry("danlu.backends", "backend")
