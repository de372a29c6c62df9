"""The layers hold: no import goes up a layer or closes a circle, every module is declared
(cronoq_store._layers), every module but the public ones has a private name, and
docs/architecture.md shows the same declaration.

Imports are read from the source with ``ast``: those under ``TYPE_CHECKING`` and inside
functions count as much as those at the top.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping

import pytest

from cronoq_store._layers import LAYERS, PUBLIC, layer_of, markdown_table

from .support import ROOT

PACKAGE = ROOT / "cronoq_store"


def package_sources() -> dict[str, str]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path.read_text(encoding="utf-8")
    return found


def imports(module: str, source: str, modules: Mapping[str, str]) -> Iterator[tuple[str, int]]:
    """The package's modules that ``module`` imports, with the line of each import."""
    is_package = f"{module}.__init__" in modules or any(m.startswith(module + ".") for m in modules)
    here = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "cronoq_store":
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] != "cronoq_store":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield (sub if sub in modules else target), node.lineno


def graph(modules: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """Who imports whom, within the package (module -> imported module -> line)."""
    edges: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, source in modules.items():
        for target, line in imports(module, source, modules):
            if target != module:
                edges[module].setdefault(target, line)
    return edges


def upward(modules: Mapping[str, str]) -> list[str]:
    """Every import of a module from a layer above the importer's."""
    found = []
    for module, targets in graph(modules).items():
        for target, line in targets.items():
            if layer_of(target) > layer_of(module):
                found.append(
                    f"{module}:{line} imports {target} "
                    f"({LAYERS[layer_of(module)].name} -> {LAYERS[layer_of(target)].name})"
                )
    return found


def circles(modules: Mapping[str, str]) -> list[list[str]]:
    """The import circles: strongly connected sets of two or more modules (Tarjan)."""
    edges = graph(modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    return found


SOURCES = package_sources()


def test_every_module_is_declared_in_one_layer() -> None:
    undeclared = []
    for module in SOURCES:
        try:
            layer_of(module)
        except KeyError:
            undeclared.append(module)
    assert undeclared == [], "declare them in cronoq_store/_layers.py"
    declared = [m for layer in LAYERS for m in layer.modules]
    assert len(declared) == len(set(declared)), "a module declared in two layers"
    missing = [
        m
        for m in declared
        if not any(
            s == f"cronoq_store.{m}".rstrip(".") or s.startswith(f"cronoq_store.{m}.")
            for s in SOURCES
        )
    ]
    assert missing == [], "declared in cronoq_store/_layers.py but not in the package"


def test_no_import_goes_up_a_layer() -> None:
    assert upward(SOURCES) == []


def test_no_import_closes_a_circle() -> None:
    assert circles(SOURCES) == []


def test_every_module_but_the_public_ones_has_a_private_name() -> None:
    public_named = [
        m
        for m in SOURCES
        if not any(part.startswith("_") for part in m.split(".")) and m not in PUBLIC
    ]
    assert public_named == [], "private modules are named _x (cronoq_store._layers.PUBLIC)"
    assert all(m in SOURCES for m in PUBLIC)


def test_the_architecture_document_shows_the_declared_layers() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    begin, end = "<!-- layers: begin -->\n", "<!-- layers: end -->"
    assert begin in text
    assert end in text
    shown = text[text.index(begin) + len(begin) : text.index(end)]
    assert shown.strip() == markdown_table().strip(), (
        "regenerate it: python -m cronoq_store._layers"
    )


@pytest.mark.parametrize(
    ("module", "line"),
    [
        # a typing-only import of the facade from a value module
        ("cronoq_store._domain", "if TYPE_CHECKING:\n    from ._store import PgStore\n"),
        # a lazy import of a path from the SQL layer
        ("cronoq_store._statements", "def f():\n    from . import _commit_path\n"),
        # the door reaching into the paths
        ("cronoq_store._door", "from ._recovery import recover\n"),
    ],
)
def test_the_check_finds_an_upward_import(module: str, line: str) -> None:
    changed = dict(SOURCES)
    changed[module] = changed[module] + "\n" + line
    assert len(upward(changed)) == 1


def test_the_check_finds_a_circle_within_a_layer() -> None:
    changed = dict(SOURCES)
    # _migrations imports _trust; _trust importing _migrations back closes a circle.
    changed["cronoq_store._trust"] += "\nfrom . import _migrations\n"
    assert ["cronoq_store._migrations", "cronoq_store._trust"] in circles(changed)
