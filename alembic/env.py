"""Alembic environment of cronoq-store: the logic lives in ``cronoq_store._migrations``."""

from logging.config import fileConfig
from typing import cast

from alembic import context
from alembic.runtime.environment import EnvironmentContext

from cronoq_store._migrations import resolve, run_environment

# `alembic.context` is a module that proxies the EnvironmentContext of the latest run: the
# one of this run, or a MigrationError if another thread's command replaced it meanwhile.
environment = resolve(cast(EnvironmentContext, context))

# Configure logging only for the command line (an ini file was read); a host application
# that migrates from code keeps its own logging.
if environment.config.config_file_name is not None and environment.config.cmd_opts is not None:
    fileConfig(environment.config.config_file_name, disable_existing_loggers=False)

run_environment(environment)
