"""Filters that keep an application's Alembic autogenerate away from the store's objects.

An application whose own Alembic env compares its ``MetaData`` with the database sees the
store's tables as tables it does not know, and autogenerate writes a migration that drops
them: when a cluster lives in the application's schema, or in any schema once the env sets
``include_schemas=True``. The store's migrations own those tables (``cronoq-store migrate``);
these filters hide them, with their columns, indexes and constraints, and the store's version
tables (``cronoq_alembic_version``, the legacy ``cronoq_schema_version``), whatever schema
they are in. In the application's ``env.py``::

    from cronoq_store.autogenerate import include_name, include_object

    context.configure(..., include_name=include_name, include_object=include_object)

or, with filters of its own, ``context.configure(..., **hiding_store(include_name=mine))``.
A public module: the names in ``__all__`` are kept stable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ._schema import LEGACY_VERSION_TABLE, VERSION_TABLE, metadata

__all__ = ["STORE_TABLES", "hiding_store", "include_name", "include_object"]

#: The names of the store's tables in every cluster schema, version tables included (the
#: legacy one is what builds before Alembic kept their version in; see ``migrations``).
STORE_TABLES = frozenset({*metadata.tables, VERSION_TABLE, LEGACY_VERSION_TABLE})

#: Alembic's ``include_name`` and ``include_object`` hooks (``alembic.runtime.environment``
#: spells out their literal types; any callable of these arguments will do).
IncludeName = Callable[[str | None, str, Mapping[str, str | None]], bool]
IncludeObject = Callable[[Any, str | None, str, bool, Any], bool]


def include_name(name: str | None, type_: str, parent_names: Mapping[str, str | None]) -> bool:
    """Alembic's ``include_name``: False for a store table and what belongs to one, so
    autogenerate does not even reflect them."""
    if type_ == "table":
        return name not in STORE_TABLES
    if type_ == "schema":
        return True
    return parent_names.get("table_name") not in STORE_TABLES


def include_object(
    object: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Alembic's ``include_object``: False for a store table, its columns, indexes and
    constraints, on either side of the comparison (an application's ``MetaData`` that
    declares them too included)."""
    if type_ == "table":
        return name not in STORE_TABLES
    table = getattr(object, "table", None)
    return getattr(table, "name", None) not in STORE_TABLES


def hiding_store(
    *, include_name: IncludeName | None = None, include_object: IncludeObject | None = None
) -> dict[str, Any]:
    """``include_name`` and ``include_object`` keyword arguments for ``context.configure``
    that hide the store's objects and leave every other decision to the application's own
    filters (when given)."""
    own_name, own_object = include_name, include_object

    def name_filter(name: str | None, type_: str, parent_names: Mapping[str, str | None]) -> bool:
        if not _include_name(name, type_, parent_names):
            return False
        return own_name is None or own_name(name, type_, parent_names)

    def object_filter(
        object: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
    ) -> bool:
        if not _include_object(object, name, type_, reflected, compare_to):
            return False
        return own_object is None or own_object(object, name, type_, reflected, compare_to)

    return {"include_name": name_filter, "include_object": object_filter}


# The module-level filters, under names the keyword arguments above do not shadow.
_include_name = include_name
_include_object = include_object
