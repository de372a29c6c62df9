"""``cronoq-store alembic-ini``: where the ``alembic.ini`` of the installed migrations is, so
that ops with only the wheel can run Alembic's own command line on them."""

from __future__ import annotations

import click

from .._migrations import alembic_ini

__all__ = ["alembic_ini_command"]


@click.command("alembic-ini")
def alembic_ini_command() -> None:
    """Print the path of an alembic.ini for these migrations, for
    `alembic -c "$(cronoq-store alembic-ini)" -x schema=NAME upgrade head`."""
    click.echo(str(alembic_ini()))
