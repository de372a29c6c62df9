"""``cronoq-store``: the operator's tool for one cluster schema, and the HA demo.

Only ``migrate`` and ``downgrade`` change a schema's structure (``migrate`` never
downgrades): the other commands refuse a schema that is not at this build's head instead of
migrating it as a side effect (an operator looking at a database should not alter it, and
may not have the right to), and they refuse a database that a newer build migrated, whose
columns this build cannot know. They need no more than read access, except ``prune``, which
needs the runtime role's grants (``DELETE`` on the tasks, ``UPDATE`` on the leader row for
its ``FOR SHARE``), and ``handover``, which ends the leader's session
(``pg_signal_backend``, the store's own role, or a superuser). Their statements live in
:mod:`cronoq_store._statements`, the cluster's schema applied at execution as the store
does. Errors are one line on stderr with the password masked, and the exit code tells a
script what went wrong (:class:`ExitCode`).

Modules: ``app`` the group and its global options; ``exits`` exit codes and how a failure
is printed; ``database`` the connection and the revision check; ``output`` formatting; one
module per command (``migrate``, ``downgrade``, ``status``, ``tasks``, ``prune``, ``demo``,
``health``, ``handover``, ``host``, ``dev_server``, ``alembic_ini``, ``console``); ``fleet`` the
selection of many clusters (``--all``, ``--schemas``) and ``status`` and ``health`` over
them; ``fleet_migrate`` and ``migrate_worker`` ``migrate`` over them, in worker processes;
``hosted`` what ``status`` and ``health`` say of a cluster a host group leads.
"""

from __future__ import annotations

from .alembic_ini import alembic_ini_command
from .app import cli
from .console import console
from .demo import demo
from .dev_server import dev_server
from .downgrade import downgrade_command
from .exits import ExitCode
from .handover import handover
from .health import health
from .host import host
from .migrate import migrate
from .prune import parse_duration, prune
from .status import status
from .tasks import tasks

__all__ = ["ExitCode", "cli", "main", "parse_duration"]

for _command in (
    migrate,
    downgrade_command,
    status,
    tasks,
    prune,
    demo,
    health,
    handover,
    host,
    dev_server,
    alembic_ini_command,
    console,
):
    cli.add_command(_command)


def main() -> None:
    """The ``cronoq-store`` console script."""
    cli(prog_name="cronoq-store")
