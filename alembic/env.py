"""Alembic environment of cronoq-store: the logic lives in ``cronoq_store.migrations``."""

from logging.config import fileConfig
from typing import cast

from alembic import context
from alembic.runtime.environment import EnvironmentContext

from cronoq_store.migrations import run_environment

# Configure logging only for the command line (an ini file was read); a host application
# that migrates from code keeps its own logging.
if context.config.config_file_name is not None and context.config.cmd_opts is not None:
    fileConfig(context.config.config_file_name, disable_existing_loggers=False)

# `alembic.context` is a module that proxies the EnvironmentContext of this run.
run_environment(cast(EnvironmentContext, context))
