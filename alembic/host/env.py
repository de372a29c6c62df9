"""Alembic environment of the host's control schema: the logic lives in
``cronoq_store._host.control``, which runs it from code (``prepare_control``)."""

from typing import cast

from alembic import context
from alembic.runtime.environment import EnvironmentContext

from cronoq_store._host.control import run_environment
from cronoq_store._migrations import resolve

# `alembic.context` proxies the EnvironmentContext of the latest run: this run's, or a
# MigrationError if another thread's command replaced it meanwhile.
run_environment(resolve(cast(EnvironmentContext, context)))
