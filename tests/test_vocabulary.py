"""Pure tests: one vocabulary, one home.

Job states, ``DANLU_*`` variables, MLflow tag names and scopes are each
defined once (danlu.states, danlu.env, danlu.tags, danlu.hub.scopes) and
imported everywhere else; the TypeScript of the lab extension and the shell
of the build are checked against them. And the import rule of the layout:
what runs in a kernel or a job (``danlu``) never imports the hub side
(``danlu.hub``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from danlu import env, tags
from danlu.hub import scopes
from danlu.states import FINAL, JobState

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ["hub", "magics", "extensions/server", "benchmarks", "examples"]
HOMES = {"magics/env.py", "magics/tags.py", "hub/scopes.py", "magics/states.py"}


def python_files(folders=PRODUCT):
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "node_modules" not in path.parts:
                yield path


def string_constants(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_product_code_never_spells_a_vocabulary_word():
    words = {v: "danlu.env" for v in env.ALL}
    words.update({v: "danlu.tags" for k, v in vars(tags).items() if k.isupper() and v.startswith("danlu.")})
    words.update({v: "danlu.hub.scopes" for v in (scopes.READ, scopes.WRITE, scopes.ADMIN)})
    found = []
    for path in python_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in HOMES:
            continue
        for line, value in string_constants(path):
            if value in words:
                found.append(f"{rel}:{line}: {value!r} (import it from {words[value]})")
    assert not found, "\n".join(found)


def test_every_danlu_variable_used_anywhere_is_defined_once():
    defined = {str(v) for v in env.ALL}
    assert len(defined) == len(env.ALL)
    sources = [
        ROOT / "Makefile",
        ROOT / ".ci" / "run",
        *(ROOT / "extensions" / "lab").glob("ui-tests/*.ts"),
        *(ROOT / "extensions" / "lab" / "ui-tests" / "tests").glob("*.ts"),
        *python_files(PRODUCT + ["tests"]),
    ]
    used = {}
    for path in sources:
        if path.exists():
            for name in re.findall(r"\bDANLU_[A-Z0-9_]+\b", path.read_text(encoding="utf-8")):
                used.setdefault(name, path.relative_to(ROOT).as_posix())
    unknown = {name: where for name, where in used.items() if name not in defined}
    assert not unknown, f"DANLU_* names not defined in magics/env.py: {unknown}"
    assert all(v.meaning for v in env.ALL)


def _ts_union(source: str, name: str) -> set[str]:
    match = re.search(rf"export type {name} =([^;]+);", source)
    assert match, f"type {name} not found"
    return set(re.findall(r"'([a-z_]+)'", match.group(1)))


def test_the_lab_extensions_job_states_are_the_services():
    source = (ROOT / "extensions" / "lab" / "src" / "tokens.ts").read_text(encoding="utf-8")
    assert _ts_union(source, "JobState") == {s.value for s in JobState}
    final = re.search(r"FINAL_STATES[^=]*= new Set\(\[([^\]]+)\]", source)
    assert final and set(re.findall(r"'([a-z_]+)'", final.group(1))) == {s.value for s in FINAL}


def test_the_openapi_document_names_the_same_states():
    from danlu.hub.service.validation import openapi

    assert set(openapi()["components"]["schemas"]["Job"]["properties"]["state"]["enum"]) == {s.value for s in JobState}


def test_lineage_kinds_are_one_list_in_the_service_the_document_and_the_lab():
    from danlu.hub.service.registry.lineage import KINDS
    from danlu.hub.service.validation import openapi

    node = openapi()["components"]["schemas"]["Lineage"]["properties"]["nodes"]["items"]
    assert set(node["properties"]["kind"]["enum"]) == set(KINDS)
    source = (ROOT / "extensions" / "lab" / "src" / "tokens.ts").read_text(encoding="utf-8")
    assert _ts_union(source, "LineageNodeKind") == set(KINDS)


@pytest.mark.parametrize("path", list(python_files(["magics"])), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_kernel_side_never_imports_the_hub_side(path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            assert not name.startswith("danlu.hub"), f"{path.name}:{node.lineno} imports {name}"
