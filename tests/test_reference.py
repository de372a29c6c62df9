"""The built docs read like a product: the API reference grouped by what a reader looks
for, every enum's members listed, no private module named, and ``PgStore``'s internal
constructor arguments not shown as API.

The docs are built once, as ``nox -s docs`` builds them (warnings are errors), and the HTML
is read back: what a reader sees, not the sources.
"""

from __future__ import annotations

import enum
import html
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import cronoq_store

from .support import ALL_PUBLIC, ROOT

#: The reference's groups, in the order api.md lists them: page, title, what it documents.
GROUPS: list[tuple[str, str, set[str]]] = [
    (
        "store",
        "The store",
        {
            "PgStore",
            "Store",
            "StoreQueries",
            "Recovered",
            "RecoveredTask",
            "RecoveredTerminal",
            "RecoveredRecurring",
            "TaskRecord",
            "Health",
            "LockHolder",
        },
    ),
    (
        "host",
        "The host",
        {"PgHost", "PgHostConfig", "HostedStore", "MultiDatabaseHost", "ClusterRef"},
    ),
    ("committer", "The group committer", {"GroupCommitter", "CommitterStats", "Backoff"}),
    (
        "values",
        "Mutations and values",
        {
            "Mutation",
            "Submitted",
            "StatusChanged",
            "RecurringUpsert",
            "RecurringNext",
            "RecurringRemove",
            "TaskSpec",
            "TaskStatus",
            "Priority",
            "RetryPolicy",
            "FixedStart",
            "MissPolicy",
            "Dependency",
            "DependencyCondition",
            "RecurringSpec",
            "Schedule",
            "CronSchedule",
            "IntervalSchedule",
            "TaskId",
            "TaskRef",
            "task_id",
            "epoch_of",
            "EPOCH_MIN",
            "EPOCH_MAX",
            "TimeBase",
        },
    ),
    (
        "errors",
        "Errors",
        {
            "StoreError",
            "UnavailableError",
            "FencedError",
            "SchemaGoneError",
            "ClusterReplacedError",
            "ClusterHostedError",
            "KeyTakenError",
            "IdCollisionError",
            "BatchTooLargeError",
            "CommitterClosedError",
            "MigrationError",
            "LockHeldError",
            "UnsupportedParameterError",
        },
    ),
    ("configuration", "Configuration", {"PgStoreConfig", "engine_arguments", "scrub"}),
    ("testing", "Testing", {"testing.*", "testing.pytest_plugin.*"}),
    ("telemetry", "Telemetry", {"telemetry.*"}),
    (
        "migrations",
        "Migrations from code",
        {"upgrade", "downgrade", "run_command", "autogenerate.*"},
    ),
]

#: What ``nox -s docs`` runs: every warning an error, every cross-reference resolved.
SPHINX_BUILD = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html"]
#: The one page about the package's own modules, for whoever changes them.
CONTRIBUTORS_PAGES = {"architecture.html"}

_ENTRY = re.compile(r'<dt class="sig sig-object py"[^>]*\bid="([^"]+)"')
_PRIVATE_MODULES = sorted(
    {
        part[1:]
        for module in pkgutil.walk_packages(cronoq_store.__path__, "cronoq_store.")
        for part in module.name.split(".")[1:]
        if part.startswith("_") and not part.startswith("__")
    },
    key=len,
    reverse=True,
)
#: A private module by its dotted path or file (``cronoq_store._schema``, ``cronoq_store/
#: _schema.py``), or by its own name (``_schema``, ``_schema.LiveTasks``).
_PRIVATE = re.compile(
    r"cronoq_store(?:[./]\w+)*[./]_[a-z]\w*"
    rf"|(?<![\w/.-])_(?:{'|'.join(_PRIVATE_MODULES)})\b(?!_)"
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("html")
    built = subprocess.run(
        [*SPHINX_BUILD, "docs", str(out)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    return out


def visible(page: Path) -> str:
    """The text of ``page`` as a reader sees it: markup and scripts gone, tooltips kept."""
    raw = re.sub(r"<(script|style)\b.*?</\1>", "", page.read_text(), flags=re.S)
    titles = " ".join(re.findall(r'\btitle="([^"]*)"', raw))
    return html.unescape(re.sub(r"<[^>]+>", " ", raw) + " " + titles)


def entries(page: Path) -> list[str]:
    return _ENTRY.findall(page.read_text())


def _expand(pattern: str) -> set[str]:
    if not pattern.endswith(".*"):
        return {f"cronoq_store.{pattern}"}
    module = f"cronoq_store.{pattern[:-2]}"
    return {f"{module}.{name}" for name in importlib.import_module(module).__all__}


def test_the_reference_is_grouped_by_what_a_reader_looks_for(site: Path) -> None:
    index = (site / "api.html").read_text()
    linked = re.findall(r'href="reference/(\w+)\.html"', index)
    assert list(dict.fromkeys(linked)) == [page for page, _, _ in GROUPS]
    homes: dict[str, str] = {}
    for page, title, patterns in GROUPS:
        path = site / "reference" / f"{page}.html"
        assert re.search(rf"<h1>{re.escape(title)}<", path.read_text()), f"{page}: {title}"
        names = set(entries(path))
        expected = set().union(*(_expand(p) for p in patterns))
        assert expected <= names, f"{page}: missing {sorted(expected - names)}"
        for name in expected:
            homes[name] = page
    every = {f"{module}.{name}" for module, name in ALL_PUBLIC}
    assert every <= set(homes), f"in no group: {sorted(every - set(homes))}"
    # One home each: a name is documented on one page only.
    documented = [e for p in (site / "reference").glob("*.html") for e in entries(p)]
    assert sorted(set(documented)) == sorted(documented)
    assert entries(site / "api.html") == []


def test_every_enum_lists_its_members(site: Path) -> None:
    found = {e for p in site.rglob("*.html") for e in entries(p)}
    text = " ".join(visible(p) for p in site.rglob("*.html"))
    checked = []
    for module, name in ALL_PUBLIC:
        value = getattr(importlib.import_module(module), name)
        if isinstance(value, type) and issubclass(value, enum.Enum):
            members = {f"{module}.{name}.{member.name}" for member in value}
            assert members <= found, f"{name}: not listed {sorted(members - found)}"
            checked.append(name)
        elif typing.get_origin(value) is typing.Literal:
            assert all(f"'{v}'" in text for v in typing.get_args(value)), name
            checked.append(name)
    assert {"TaskStatus", "Priority", "MissPolicy", "DependencyCondition", "StopMode"} <= set(
        checked
    )


def _private_objects() -> set[str]:
    """Classes and functions of the package's private modules that no public module
    exports: the reference may describe what they do, never send a reader to them."""
    exported = {name for _, name in ALL_PUBLIC}
    # A public class's own methods (``PgStore.recover()``) are not the private namesakes.
    public_members = {
        f"{member}()"
        for module, name in ALL_PUBLIC
        for member in dir(getattr(importlib.import_module(module), name))
    }
    found = set()
    for info in pkgutil.walk_packages(cronoq_store.__path__, "cronoq_store."):
        private = any(part.startswith("_") for part in info.name.split(".")[1:])
        if not private or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            defined_here = getattr(value, "__module__", None) == info.name
            if defined_here and not name.startswith("_") and name not in exported:
                if inspect.isclass(value):
                    found.add(name)
                elif inspect.isfunction(value):
                    found.add(f"{name}()")
    return found - public_members


def test_no_page_sends_a_reader_to_a_private_class_or_function(site: Path) -> None:
    private = _private_objects()
    named = {}
    for page in sorted(site.rglob("*.html")):
        if page.name in CONTRIBUTORS_PAGES:
            continue
        code = re.findall(r"<code[^>]*>(.*?)</code>", page.read_text(), re.S)
        found = sorted({visible_text(c).strip() for c in code} & private)
        if found:
            named[page.name] = found
    assert named == {}


def test_no_page_names_a_private_module(site: Path) -> None:
    named = {}
    for page in sorted(site.rglob("*.html")):
        if page.name in CONTRIBUTORS_PAGES or page.parent.name == "_modules":
            continue
        found = sorted(set(_PRIVATE.findall(visible(page))))
        if found:
            named[str(page.relative_to(site))] = found
    assert named == {}
    assert not (site / "_modules").exists()


def test_pgstore_shows_how_to_open_one_not_its_wiring(site: Path) -> None:
    page = (site / "reference" / "store.html").read_text()
    header = re.search(
        r'<dt class="sig sig-object py" id="cronoq_store\.PgStore">(.*?)</dt>', page, re.S
    )
    assert header is not None
    assert "(" not in visible_text(header.group(1))
    for wiring in ("schema_oid", "owns_engine", "lock_pool", "pool_role"):
        assert wiring not in visible_text(page), wiring
    assert "cronoq_store.PgStore.connect" in entries(site / "reference" / "store.html")
    assert "cronoq_store.PgStore.from_engine" in entries(site / "reference" / "store.html")


def visible_text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))
