"""The public surface: the names of the four public modules are pinned, each importable and
documented, and the README and docs/ send users to them, not to private module paths.

A change here is a change of the public API: say it in CHANGELOG.md.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re

import pytest

from .support import ALL_PUBLIC, PUBLIC_NAMES, ROOT


@pytest.mark.parametrize("module", sorted(PUBLIC_NAMES))
def test_the_exported_names_are_pinned(module: str) -> None:
    assert sorted(importlib.import_module(module).__all__) == sorted(PUBLIC_NAMES[module])


def _documented_values() -> set[str]:
    """Names of the package's module-level values that carry a ``#:`` comment above or a
    string right below their assignment (how Sphinx documents a value)."""
    found = set()
    for path in (ROOT / "cronoq_store").rglob("*.py"):
        lines = path.read_text(encoding="utf-8").splitlines()
        body = ast.parse("\n".join(lines)).body
        for index, node in enumerate(body):
            target = None
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                target = node.targets[0].id
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                target = node.target.id
            if target is None:
                continue
            above = lines[node.lineno - 2].lstrip() if node.lineno > 1 else ""
            below = body[index + 1] if index + 1 < len(body) else None
            string_below = (
                isinstance(below, ast.Expr)
                and isinstance(below.value, ast.Constant)
                and isinstance(below.value.value, str)
            )
            if above.startswith("#:") or string_below:
                found.add(target)
    return found


@pytest.mark.parametrize(("module", "name"), ALL_PUBLIC)
def test_every_public_name_is_importable_and_documented(module: str, name: str) -> None:
    value = getattr(importlib.import_module(module), name)
    if inspect.isclass(value) or inspect.isroutine(value):
        own = value.__dict__.get("__doc__") if inspect.isclass(value) else value.__doc__
        assert (own or "").strip(), f"{module}.{name} has no docstring"
    elif callable(value) and getattr(value, "__supertype__", None) is not None:
        assert name in _documented_values() or value.__doc__, f"{module}.{name}: document it"
    else:
        assert name in _documented_values(), f"{module}.{name}: give it a #: comment"


# A dotted path through a private module: cronoq_store._x.name or cronoq_store.testing._x.
_PRIVATE_PATH = re.compile(r"cronoq_store(?:\.\w+)*\._\w+((?:\.\w+)+)")


def test_the_docs_name_exported_things_by_their_public_name() -> None:
    exported = {name for names in PUBLIC_NAMES.values() for name in names}
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in _PRIVATE_PATH.finditer(line):
                if match.group(1).split(".")[-1] in exported:
                    found.append(f"{path.name}:{number}: {match.group(0)}")
    assert found == [], "write cronoq_store.NAME (or its public module's) instead"
