"""Helpers for applications' own tests.

:class:`InMemoryStore` is a ``Store`` and ``StoreQueries`` without a server, for unit tests
(:mod:`cronoq_store.testing.memory` says what it cannot honour).
"""

from __future__ import annotations

from .memory import InMemoryDatabase, InMemoryStore

__all__ = ["InMemoryDatabase", "InMemoryStore"]
