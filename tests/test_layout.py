"""Pure tests: the floor plan of the code, as rules a change cannot break without this file saying so.

The jobs service (``hub/service/``) is a few leaf modules and packages in one order::

    leaves < store < admission < usage < datasets < jobs < sweeps < registry < manager < api < app

A module may import its own package and those to its left, never one to its right; leaves (the modules
directly in ``hub/service/`` but ``manager``, ``app`` and ``__main__``) import only leaves. Beyond the
order: the admission model is pure (no database, clock or I/O), HTTP handlers import only leaves and the
manager and ask the manager nothing but its named facades, and only ``app.py`` asks a backend whether it
queues jobs itself. ``danlu.hub`` imports only the leaf modules of ``danlu``, and ``magics/`` never imports
``danlu.hub``. Imports inside functions count, and each one says why it is there (``# deferred:`` a heavy or
optional import, ``# cycle:`` an import cycle it breaks). No module is over 500 lines (a module that defines
a configurable class, whose option help is its documentation, 600). Each rule is checked by a function that
returns its violations, and each function is shown to find a violation of its own.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICE = "danlu.hub.service"
ORDER = ("leaves", "store", "admission", "usage", "datasets", "jobs", "sweeps", "registry", "manager", "api", "app")
PACKAGES = {"store", "admission", "usage", "datasets", "jobs", "sweeps", "registry", "api"}
#: what ``danlu.hub`` may import of ``danlu`` (the kernel side): its leaves, which import nothing of their own
KERNEL_LEAVES = {
    "danlu",
    "danlu.errors",
    "danlu.env",
    "danlu.states",
    "danlu.tags",
    "danlu.jobdir",
    "danlu.proctree",
    "danlu.lean",
    "danlu.client",
    "danlu.digests",
}
#: the ``danlu`` script joins the two sides: the client's commands plus the hub's (hub/cli.py)
SCRIPT = "danlu.hub.cli"
#: modules the pure admission model never imports (a database, the clock, files, the network, threads)
IMPURE = {
    "sqlalchemy",
    "time",
    "datetime",
    "os",
    "io",
    "pathlib",
    "shutil",
    "tempfile",
    "socket",
    "asyncio",
    "subprocess",
    "threading",
    "concurrent",
    "random",
    "logging",
    "requests",
    "httpx",
    "tornado",
    "psutil",
}
#: what the admission model may import beyond its own modules: pure leaves, which import nothing themselves
PURE = {"danlu.errors", "danlu.hub.teams"}
#: what the manager holds that a handler must not reach past it for
MANAGER_INSIDES = {
    "core",
    "groups",
    "profiles",
    "settings",
    "backend",
    "database",
    "scheduler",
    "supervisor",
    "submission",
    "mlflow",
}
REASONS = ("# deferred:", "# cycle:")
MAX_LINES, MAX_CONFIGURABLE = 500, 600
FOLDERS = {"hub": "danlu.hub", "magics": "danlu", "extensions/server": "danlu.lab"}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module imported (``from a import b`` is a.b when a.b is a module)
    line: int
    local: bool  # inside a function
    typing_only: bool  # under ``if TYPE_CHECKING:``


def module_name(path: Path) -> str:
    for folder, package in FOLDERS.items():
        base = ROOT / folder
        if base in path.parents:
            parts = path.relative_to(base).with_suffix("").parts
            name = ".".join((package, *parts))
            return name.removesuffix(".__init__")
    raise ValueError(path)


def product_files(folder: str):
    for path in sorted((ROOT / folder).rglob("*.py")):
        if "node_modules" not in path.parts and "labextension" not in path.parts:
            yield path


KNOWN = {module_name(p) for folder in FOLDERS for p in product_files(folder)}


def imports(source: str, text: str, is_package: bool = False) -> list[Import]:
    """Every import of a module's text, with whether it sits in a function or under TYPE_CHECKING."""
    tree = ast.parse(text)
    found: list[Import] = []

    def visit(node, local: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True, typing_only)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for item in child.body:
                    visit(ast.Module(body=[item], type_ignores=[]), local, True)
                for item in child.orelse:
                    visit(ast.Module(body=[item], type_ignores=[]), local, typing_only)
            elif isinstance(child, ast.Import):
                found.extend(Import(source, a.name, child.lineno, local, typing_only) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = source.split(".")
                    keep = len(parts) - child.level + (1 if is_package else 0)
                    base = ".".join(parts[:keep] + ([base] if base else []))
                for a in child.names:
                    full = f"{base}.{a.name}"
                    found.append(Import(source, full if full in KNOWN else base, child.lineno, local, typing_only))
            else:
                visit(child, local, typing_only)

    visit(tree, False, False)
    return found


def unit(module: str) -> str | None:
    """Where a module of the jobs service stands in :data:`ORDER` (None: not the service's)."""
    if module != SERVICE and not module.startswith(SERVICE + "."):
        return None
    parts = module.split(".")[3:]
    if not parts:
        return "leaves"
    if parts[0] in PACKAGES:
        return parts[0]
    if parts[0] in ("manager", "app"):
        return parts[0]
    return "app" if parts[0] == "__main__" else "leaves"


# the rules, each a function of the imports that returns what breaks it ---------------------------------------
def order_violations(found: list[Import]) -> list[str]:
    out = []
    for i in found:
        here, there = unit(i.source), unit(i.target)
        if here is None or there is None or i.typing_only:
            continue
        if ORDER.index(there) > ORDER.index(here) or (here == "leaves" and there != "leaves"):
            out.append(f"{i.source}:{i.line} imports {i.target}, which is to its right ({here} < {there})")
    return out


def admission_violations(found: list[Import]) -> list[str]:
    out = []
    for i in found:
        if unit(i.source) != "admission" or i.typing_only:
            continue
        top = i.target.split(".")[0]
        if top in IMPURE:
            out.append(f"{i.source}:{i.line} imports {i.target}: the admission model has no database, clock or I/O")
        elif i.target.startswith("danlu") and unit(i.target) != "admission" and i.target not in PURE:
            out.append(
                f"{i.source}:{i.line} imports {i.target}: the admission model imports only its own "
                f"modules and {', '.join(sorted(PURE))}"
            )
    return out


def handler_violations(found: list[Import]) -> list[str]:
    return [
        f"{i.source}:{i.line} imports {i.target}: handlers import only leaves and the manager"
        for i in found
        if unit(i.source) == "api" and unit(i.target) not in (None, "leaves", "manager", "api") and not i.typing_only
    ]


def kernel_violations(found: list[Import]) -> list[str]:
    out = []
    for i in found:
        if (
            i.source.startswith("danlu.hub")
            and i.target.startswith("danlu")
            and not i.target.startswith(("danlu.hub", "danlu.lab"))
            and i.target not in KERNEL_LEAVES
            and i.source != SCRIPT
        ):
            out.append(
                f"{i.source}:{i.line} imports {i.target}: danlu.hub imports only danlu's leaves "
                f"({', '.join(sorted(KERNEL_LEAVES))})"
            )
        if not i.source.startswith(("danlu.hub", "danlu.lab")) and i.target.startswith("danlu.hub"):
            out.append(f"{i.source}:{i.line} imports {i.target}: what runs in kernels and jobs never imports the hub")
    return out


def handler_reach(source: str, text: str) -> list[str]:
    """Attributes a handler reads past the manager (``self.manager.core``, ``.settings``, ...)."""
    if unit(source) != "api":
        return []
    return [
        f"{source}:{node.lineno} reads manager.{node.attr}: ask the manager (or one of its facades) instead"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Attribute)
        and node.attr in MANAGER_INSIDES
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "manager"
    ]


def queues_readers(source: str, text: str) -> list[str]:
    """Who asks a backend whether it queues jobs itself (only the service's app, to choose its scheduler)."""
    if source == f"{SERVICE}.app":
        return []
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr == "queues":
            owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
            if "backend" in owner.lower():
                out.append(
                    f"{source}:{node.lineno} reads {owner}.queues: ask the scheduler (owns_queues, "
                    "multi_node, explain) instead"
                )
    return out


def unexplained_local_imports(source: str, text: str) -> list[str]:
    """Imports inside functions without their reason: on the import's line, or on a comment line above the
    block of imports it belongs to."""
    lines = text.splitlines()
    out = []
    for i in imports(source, text):
        if not i.local or any(r in lines[i.line - 1] for r in REASONS):
            continue
        above = i.line - 2
        while above >= 0 and lines[above].strip().startswith(("import ", "from ")):
            if any(r in lines[above] for r in REASONS):
                break
            above -= 1
        if above < 0 or not any(r in lines[above] for r in REASONS):
            out.append(
                f"{source}:{i.line} imports {i.target} inside a function without saying why "
                "(# deferred: ... or # cycle: ...)"
            )
    return out


def too_long(source: str, text: str) -> list[str]:
    configurable = ".tag(config=True)" in text
    limit = MAX_CONFIGURABLE if configurable else MAX_LINES
    count = len(text.splitlines())
    return [f"{source} has {count} lines (at most {limit})"] if count > limit else []


# the product ---------------------------------------------------------------------------------------------------
def product():
    for folder in FOLDERS:
        for path in product_files(folder):
            yield module_name(path), path.read_text(encoding="utf-8"), path.name == "__init__.py"


def all_imports() -> list[Import]:
    return [i for name, text, package in product() for i in imports(name, text, package)]


@pytest.mark.parametrize("rule", [order_violations, admission_violations, handler_violations, kernel_violations])
def test_imports_keep_the_floor_plan(rule):
    broken = rule(all_imports())
    assert not broken, "\n".join(broken)


def test_what_the_admission_model_may_import_is_pure():
    for name, text, _ in product():
        if name in PURE:
            found = [i.target for i in imports(name, text) if not i.typing_only and i.target != "__future__"]
            assert found == [], f"{name} must import nothing (the admission model imports it): {found}"


@pytest.mark.parametrize("rule", [handler_reach, queues_readers, unexplained_local_imports, too_long])
def test_modules_keep_the_floor_plan(rule):
    broken = [v for name, text, _ in product() for v in rule(name, text)]
    assert not broken, "\n".join(broken)


# each rule finds what it is for ------------------------------------------------------------------------------
def _found(source: str, text: str) -> list[Import]:
    return imports(source, text)


def test_a_module_importing_to_its_right_is_found():
    assert order_violations(_found(f"{SERVICE}.store.audit", f"from {SERVICE}.jobs import core\n"))
    assert order_violations(_found(f"{SERVICE}.validation", "def f():\n    from danlu.hub.service.store import orm\n"))
    assert not order_violations(_found(f"{SERVICE}.jobs.views", f"from {SERVICE}.store import orm\n"))


def test_the_admission_model_importing_io_is_found():
    assert admission_violations(_found(f"{SERVICE}.admission.model", "import time\n"))
    assert admission_violations(_found(f"{SERVICE}.admission.model", f"from {SERVICE}.store.orm import Job\n"))
    assert not admission_violations(
        _found(
            f"{SERVICE}.admission.model",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from danlu.hub.config import Settings\n",
        )
    )


def test_a_handler_importing_the_database_is_found():
    assert handler_violations(_found(f"{SERVICE}.api.jobs", f"from {SERVICE}.store.orm import Job\n"))
    assert handler_reach(f"{SERVICE}.api.jobs", "x = self.manager.core.model\n")
    assert not handler_violations(_found(f"{SERVICE}.api.jobs", f"from {SERVICE} import validation\n"))


def test_the_other_rules_find_what_they_are_for():
    assert kernel_violations(_found("danlu.train", "from danlu.hub import config\n"))
    assert kernel_violations(_found("danlu.hub.gpus", "from danlu.datasets import scan\n"))
    assert queues_readers(f"{SERVICE}.jobs.supervisor", "if self.backend.queues:\n    pass\n")
    assert unexplained_local_imports("danlu.x", "def f():\n    import json\n")
    assert not unexplained_local_imports("danlu.x", "def f():\n    import mlflow  # deferred: slow\n")
    assert not unexplained_local_imports("danlu.x", "def f():\n    # deferred: slow\n    import a\n    import b\n")
    assert unexplained_local_imports("danlu.x", "def f():\n    # deferred: a\n    import a\n    x = 1\n    import b\n")
    assert too_long("danlu.x", "x = 1\n" * 501)
