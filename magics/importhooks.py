"""Running code right after a module is imported, without importing it: :func:`when_imported`.

Auto-logging patches ``SummaryWriter`` when ``torch.utils.tensorboard.writer``
is imported and turns on ``mlflow.autolog`` when a framework it covers is
(:mod:`danlu.autolog`); seed watching wraps the seeding functions of
``random``, numpy, torch and Lightning when each is (:mod:`danlu.seeds`). A
job whose code imports none of them pays nothing for them.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Calls ``callback(module)`` right after one of ``names`` finishes importing."""

    def __init__(self, names, callback):
        self.names = set(names)
        self.callback = callback
        self._busy: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.names or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, callback = spec.loader, self.callback

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec_):
                return loader.create_module(spec_)

            def exec_module(self, module):
                loader.exec_module(module)
                callback(module)

        spec.loader = _Loader()
        return spec


def when_imported(names, callback) -> None:
    """Run ``callback(module)`` now for modules already imported, else right after their import."""
    pending = []
    for name in names:
        module = sys.modules.get(name)
        if module is not None:
            callback(module)
        else:
            pending.append(name)
    if pending:
        sys.meta_path.insert(0, _PostImportHook(pending, callback))
