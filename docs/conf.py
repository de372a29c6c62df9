"""Sphinx configuration: the API reference from the docstrings, and the markdown docs.

``nox -s docs`` builds it with ``-W`` (every warning an error) and ``nitpicky``, so every
public name is documented and every cross-reference resolves. The theme is Furo: the look
of the pip, attrs and urllib3 docs, a sidebar that keeps the tutorial, how-to guides,
reference and explanations apart by caption, and no JavaScript framework.
"""

from __future__ import annotations

import importlib
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cronoq_store  # noqa: E402

project = "cronoq-store"
author = "the cronoq-store authors"
release = version = metadata.version("cronoq-store")

extensions = ["sphinx.ext.autodoc", "myst_parser"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", ".venv"]
myst_heading_anchors = 3
nitpicky = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
html_theme = "furo"
html_title = f"cronoq-store {release}"
html_static_path: list[str] = []
html_copy_source = False
html_show_sourcelink = False

# Without a network there is no intersphinx inventory: names from other projects (the
# standard library's included) stay as text instead of failing the build. Only those.
nitpick_ignore_regex = [
    ("py:.*", r"(sqlalchemy|asyncpg|alembic|opentelemetry|pytest|_pytest|click)(\..*)?"),
    ("py:.*", r"(collections\.abc|typing|datetime|enum|asyncio|pathlib|types|os)\..*"),
    ("py:.*", r"(int|str|bytes|float|bool|object|list|dict|tuple|set|frozenset|type)"),
    ("py:.*", r"(Exception|BaseException|ValueError|TypeError|NotImplementedError)"),
    # OpenTelemetry's providers, named under TYPE_CHECKING in cronoq_store.telemetry.
    ("py:class", r"(MeterProvider|TracerProvider)"),
    # A generic function's type variables (run_command's), shown by their names.
    ("py:class", r"[PRT](\.args|\.kwargs)?"),
]


#: The public modules: what they export is documented and linked; any other module of the
#: package is private (being renamed ``_commit_path``, ...), so a docstring's reference to one
#: of its names is shown as code, not linked and not a warning.
PUBLIC_MODULES = {
    "cronoq_store",
    "cronoq_store.testing",
    "cronoq_store.testing.pytest_plugin",
    "cronoq_store.autogenerate",
    "cronoq_store.telemetry",
}
_TOP = set(cronoq_store.__all__)


def _public_homes() -> dict[str, str]:
    """Where each exported class, function or alias is defined (``cronoq_store._domain.
    TaskSpec``) mapped to the public name a reader imports (``cronoq_store.TaskSpec``)."""
    homes = {}
    for module_name in sorted(PUBLIC_MODULES):
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            home = getattr(value, "__module__", None)
            qualname = getattr(value, "__qualname__", None)
            if isinstance(home, str) and isinstance(qualname, str) and home != module_name:
                homes[f"{home}.{qualname}"] = f"{module_name}.{name}"
    return homes


_HOMES = _public_homes()
#: A dotted path through a private module of the package (``cronoq_store._x.Name.member``).
_PRIVATE_PATH = re.compile(r"~?cronoq_store(?:\.\w+)*\._\w+(?:\.\w+)*")


def _public_path(path: str) -> str:
    """``path`` through its public home where its head is exported, else ``path``."""
    parts = path.lstrip("~").split(".")
    for end in range(len(parts), 1, -1):
        public = _HOMES.get(".".join(parts[:end]))
        if public is not None:
            return ".".join([public, *parts[end:]])
    return path


def _publicly_named(app: Any, doctree: Any) -> None:
    """Every type, base class and value autodoc wrote as a private module's path (it writes
    where a name is defined) names the public home instead, in text and in links alike."""
    from docutils import nodes
    from sphinx import addnodes

    for xref in doctree.findall(addnodes.pending_xref):
        target = xref.get("reftarget", "")
        if _PRIVATE_PATH.fullmatch(target):
            xref["reftarget"] = _public_path(target)
    for text in list(doctree.findall(nodes.Text)):
        rewritten = _PRIVATE_PATH.sub(lambda m: _public_path(m.group(0)), str(text))
        if rewritten != str(text):
            text.parent.replace(text, nodes.Text(rewritten))
    for paragraph in list(doctree.findall(nodes.paragraph)):
        if paragraph.astext().strip() == "Bases:":
            paragraph.parent.remove(paragraph)


#: Classes that an application never builds itself: their constructor's arguments are the
#: package's wiring, not API (``PgStore.connect`` and ``PgStore.from_engine`` build one).
_NOT_BUILT_DIRECTLY = {"cronoq_store.PgStore"}


def _signature(
    app: Any, what: str, name: str, obj: Any, options: Any, signature: Any, annotation: Any
) -> Any:
    """No signature for a class built only by the package; type variables by their names."""
    if what == "class" and name in _NOT_BUILT_DIRECTLY:
        return "", None
    if signature is None:
        return None
    return (
        re.sub(r"~?cronoq_store\.\w+\._([PRT])\b", r"\1", signature),
        annotation and re.sub(r"~?cronoq_store\.\w+\._([PRT])\b", r"\1", annotation),
    )


def _bases(app: Any, name: str, obj: Any, options: Any, bases: list[Any]) -> None:
    """Only bases a reader can use: not ``object`` (every class has it), nor a private class
    of the package (``Store``'s ``SupportsCommit``, whose ``commit`` the page shows as
    ``Store``'s own). A line left empty is dropped by :func:`_publicly_named`."""

    def shown(base: Any) -> bool:
        home = f"{getattr(base, '__module__', '')}.{getattr(base, '__qualname__', '')}"
        return base is not object and (
            not home.startswith("cronoq_store.") or home in _HOMES or not _PRIVATE_PATH.match(home)
        )

    bases[:] = [base for base in bases if shown(base)]


def _private_home(target: str) -> bool:
    """Whether ``target`` names something of a private module of the package."""
    target = target.lstrip("~.")
    if target.startswith("cronoq_store."):
        module = target
        while module not in sys.modules and "." in module:
            module = module.rsplit(".", 1)[0]
        return module not in PUBLIC_MODULES
    head = target.split(".", 1)[0]
    return any(
        name.startswith("cronoq_store.") and name not in PUBLIC_MODULES and hasattr(mod, head)
        for name, mod in list(sys.modules.items())
    )


def _to_public(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """Resolve a name at its top-level home, where the reference names its module:
    ``cronoq_store._domain.TaskSpec`` (or a bare ``TaskSpec``) links to the documented
    ``cronoq_store.TaskSpec``, so renaming a module to a private name breaks no link."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    parts = target.split(".")
    candidates = [
        "cronoq_store." + ".".join(parts[i:]) for i, part in enumerate(parts) if part in _TOP
    ]
    domain = env.get_domain("py")
    for candidate in candidates:
        for role in (node["reftype"], "obj"):
            resolved = domain.resolve_xref(
                env, node["refdoc"], app.builder, role, candidate, node, contnode
            )
            if resolved is not None:
                return resolved
    if _private_home(target):
        return contnode
    return None


def _undocumented(app: Any, what: str, name: str, obj: Any, skip: bool, options: Any) -> Any:
    """A public name that autodoc would skip for want of a docstring fails the build."""
    if skip and not name.startswith("_") and what == "class":
        doc = getattr(obj, "__doc__", None)
        if not doc:
            from sphinx.util import logging

            logging.getLogger(__name__).warning("public name %r has no docstring", name)
    return None


def _defining_module_doc(name: str, obj: Any) -> list[str]:
    """The ``#:`` comment or docstring of ``name`` in the package module that defines it.

    A constant or type alias exported at the top level is documented where it is defined
    (``TaskId`` in a private module); autodoc reads doc comments only from the module it
    documents, so the top-level entry takes them from there."""
    from sphinx.pycode import ModuleAnalyzer

    for module_name, module in sorted(sys.modules.items()):
        if not module_name.startswith("cronoq_store.") or getattr(module, name, None) is not obj:
            continue
        docs = ModuleAnalyzer.for_module(module_name).find_attr_docs()
        if ("", name) in docs:
            return list(docs["", name])
    return []


def _data_doc(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    if what != "data" or not name.startswith("cronoq_store."):
        return
    module_name, short = name.rsplit(".", 1)
    if module_name not in PUBLIC_MODULES:
        return
    from sphinx.pycode import ModuleAnalyzer

    if ("", short) in ModuleAnalyzer.for_module(module_name).find_attr_docs():
        return
    found = _defining_module_doc(short, obj)
    if not found:
        from sphinx.util import logging

        logging.getLogger(__name__).warning("public name %r has no docstring", name)
    lines[:] = found


def _every_export_listed(app: Any, env: Any) -> None:
    """Every name a public module exports (``__all__``) has an entry in the reference."""
    from sphinx.util import logging

    listed = env.get_domain("py").objects
    for module_name in sorted(PUBLIC_MODULES):
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            if f"{module_name}.{name}" not in listed:
                logging.getLogger(__name__).warning(
                    "%s.%s is exported but not in the API reference", module_name, name
                )


def setup(app: Any) -> None:
    app.connect("env-check-consistency", _every_export_listed)
    app.connect("missing-reference", _to_public)
    app.connect("autodoc-skip-member", _undocumented)
    app.connect("autodoc-process-docstring", _data_doc)
    app.connect("autodoc-process-signature", _signature)
    app.connect("autodoc-process-bases", _bases)
    app.connect("doctree-read", _publicly_named)
