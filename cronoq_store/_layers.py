"""The package's layers, written once: each layer's modules and each module's one job.

A module imports only from its own layer and the layers below it, and no import closes a
circle (``tests/test_layers.py`` reads every import of the package with ``ast``, those under
``TYPE_CHECKING`` and inside functions too). docs/architecture.md's table is
:func:`markdown_table` of this declaration (``python -m cronoq_store._layers`` prints it,
and the same test compares). A new module is declared here, in the lowest layer whose
modules are all it needs, or the test fails.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LAYERS", "PUBLIC", "Layer", "layer_of", "markdown_table"]


@dataclass(frozen=True, slots=True)
class Layer:
    """One layer: its name, what its modules have in common, and each module's one job.

    Modules are named relative to ``cronoq_store`` (``"_commit_path"``); a subpackage stands for
    every module in it (``"_cli"``); ``""`` is the package itself (its ``__init__``)."""

    name: str
    about: str
    modules: dict[str, str]


#: The layers, bottom first.
LAYERS: tuple[Layer, ...] = (
    Layer(
        "values",
        "plain values and rules; no SQL, no connection",
        {
            "_domain": "the scheduler's task and schedule values, ids and time, the state order, "
            "BIGINT bounds, the text-cleaning rule; the mutations a batch commits, and "
            "`unhandled` ending each `match`",
            "_results": "what the store and its committer return: recovered values, records, "
            "health, lock holders, the instance id in a lock session's name, a committer's "
            "counts",
            "_errors": "every error type the store raises",
            "_config": "`PgStoreConfig`, validated when built; the schema-name rule; keepalives",
            "_codec": "JSON encodings of the task columns, the recurring template's JSON "
            "derived from `SPEC_FIELDS`; time and duration conversions",
            "_retry": "the retry policy and its loop (what to retry, the pauses, stops by "
            "exception), and the one timeout",
            "_urls": "database URLs read as libpq reads them, into the parameters the door "
            "dials; the one masking of secrets",
            "_terminal_safe": "the one rule for printed text, and the `--json` encoder",
            "telemetry": "the one module that knows OpenTelemetry: instruments and spans",
            "_layers": "this declaration of the layers",
        },
    ),
    Layer(
        "SQL",
        "tables, rows and statements as SQLAlchemy Core, built once; nothing runs here",
        {
            "_schema": "the tables as one `MetaData`, without a schema name; task and "
            "recurring rows to and from domain values, from one column list",
            "_statements": "every statement the store runs itself: commits, recovery, "
            "look-ups, pruning; the leader lock session's (the lock, the epoch "
            "bump); the one search_path and transactions on borrowed sessions; "
            "a migration's checks and locks",
            "_catalog": "the operators' catalog queries and counts (CLI, console, health, demo)",
            "_listing_statements": "the operators' bounded reads of tasks (CLI and console): "
            "pages of live and finished tasks, counts that stop at a bound, a task's spec",
        },
    ),
    Layer(
        "door",
        "the one way to the driver; nothing above it holds a driver connection",
        {
            "_door": "the store's engines and their checks at open, every session dialled "
            "from a URL's parameters, the commits' connection, transactions, statements "
            "compiled and run, bounded waits for locks with their holders named, every "
            "driver error mapped",
        },
    ),
    Layer(
        "paths",
        "what the store does, each on connections handed in",
        {
            "_commit_path": "a commit below the store: its mutations folded into column arrays, "
            "its size estimated from above, which way it is written and what it "
            "found",
            "_recovery": "`recover()`: live and recent tasks, schedules, quarantine, `next_id`",
            "_queries": "look-ups by id, key and page, outputs, and the one prune loop",
            "_trust": "the trust checks: who may control the schema, who may connect",
            "_leadership": "the leader lock session, its keeper, the epoch",
            "_migrations": "Alembic per schema from code: upgrade, downgrade, the revision "
            "check, and the environment `alembic/env.py` runs; one Alembic run "
            "at a time in the process; a downgrade never under a live leader",
        },
    ),
    Layer(
        "facade",
        "what applications call",
        {
            "": "the public names (`from cronoq_store import ...`)",
            "_store": "the `Store`, `StoreQueries` and `Committable` protocols, and "
            "`PgStore`, which implements them: opens and closes, wires the "
            "paths, where errors leave the store",
            "_committer": "`GroupCommitter`: many submitters, one transaction per batch; its "
            "admission, batches in flight, settling, and the rules that cut and order batches",
            "autogenerate": "filters that keep an application's autogenerate off our tables",
            "_host": "`PgHost`: one process leading many cluster schemas: the control schema, "
            "the host session, claims and balancing, hosted stores, the commit bus; clusters "
            "placed in several databases, and moved between them",
        },
    ),
    Layer(
        "apart",
        "not the library: tools and helpers built on it",
        {
            "_cli": "the `cronoq-store` operator commands, one module per command",
            "_console": "`cronoq-store console`, the read-mostly browser view",
            "_demo": "the HA demo, imported only when `cronoq-store demo` runs",
            "testing": "for applications' tests: `EmbeddedPostgres`, a pytest plugin, "
            "`InMemoryStore`",
        },
    ),
)

#: The public modules; every other module has a private name (a ``_`` in its path).
PUBLIC = frozenset(
    {
        "cronoq_store",
        "cronoq_store.autogenerate",
        "cronoq_store.telemetry",
        "cronoq_store.testing",
        "cronoq_store.testing.pytest_plugin",
    }
)


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module`` (dotted, ``cronoq_store.x.y``); a module
    of a subpackage is in its subpackage's layer. ``KeyError`` for an undeclared one."""
    parts = module.split(".")
    if parts[0] != "cronoq_store":
        raise KeyError(module)
    for name in (".".join(parts[1:]), parts[1] if len(parts) > 1 else ""):
        for index, layer in enumerate(LAYERS):
            if name in layer.modules:
                return index
    raise KeyError(module)


def markdown_table() -> str:
    """The layers as docs/architecture.md shows them, bottom first."""
    lines = ["| layer | module | its one job |", "|---|---|---|"]
    for layer in LAYERS:
        lines.append(f"| **{layer.name}** | | {layer.about} |")
        for module, job in layer.modules.items():
            name = f"cronoq_store.{module}" if module else "cronoq_store"
            lines.append(f"| | `{name}` | {job} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
