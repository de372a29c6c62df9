"""Every ``--help`` of the ``cronoq-store`` command reads as plain text on a terminal: no
reST markup from the docstrings, and no pointer to a docs/ file that the wheel does not
carry (a command's own ``--help`` is where to read on)."""

from __future__ import annotations

import re

import click
import pytest
from click.testing import CliRunner

from cronoq_store._cli import cli


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [prefix]
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            found += _commands(command, (*prefix, name))
        else:
            found.append((*prefix, name))
    return found


MARKUP = re.compile(r"``|:(?:class|meth|func|mod|data|attr):|docs/|\.md\b|\.rst\b")


@pytest.mark.parametrize("path", _commands(cli), ids=lambda p: " ".join(p) or "cronoq-store")
def test_help_is_plain_text_without_pointers_to_missing_docs(path: tuple[str, ...]) -> None:
    shown = CliRunner().invoke(cli, [*path, "--help"])
    assert shown.exit_code == 0, shown.output
    assert not MARKUP.findall(shown.output), shown.output
