"""Every code block of README.md, CONTRIBUTING.md and docs/ runs, so none can rot.

Python blocks run in a fresh interpreter against the suite's server: the URL
``postgresql://app@db/app`` (or its ``postgresql+asyncpg://`` form), the schema
``cluster_a`` and the port 9464 are replaced by the suite's. The text after a block says
"It prints" and quotes lines: the block must print exactly those lines, so what it sets up
shows its effect (a tracer provider that keeps no span prints none). JSON, YAML and ini
blocks are parsed; a ``text`` block is a picture. A block that cannot run on its own says
so on the line before its fence: ``<!-- same as: examples/PATH -->`` (the block is that
file, which tests/test_examples.py runs) or ``<!-- not run: REASON -->``.

A Python block that is not run is still a program: it compiles (no top-level ``await``)
and every name it uses is defined or imported, unless its reason says it is "a fragment"
of a larger file, which may use that file's names.
"""

from __future__ import annotations

import asyncio
import builtins
import configparser
import json
import re
import socket
import subprocess
import symtable
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from sqlalchemy.engine import URL

from .pgharness import admin_execute
from .support import ROOT

DOC_URL = "postgresql://app@db/app"
DOC_ASYNC_URL = "postgresql+asyncpg://app@db/app"
DOC_SCHEMA = '"cluster_a"'
DOC_PORT = "9464"
_FENCE = re.compile(r"^\s*```(\{[\w-]+\}|\w*)\s*$")
_MARKER = re.compile(r"^\s*<!-- (same as|not run): (.+?) -->$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    code: str
    marker: tuple[str, str] | None
    after: str  # the paragraph after the block

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _files() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *docs]


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        opened = _FENCE.match(lines[index])
        if opened is None:
            index += 1
            continue
        end = index + 1
        while not lines[end].lstrip().startswith("```"):
            end += 1
        before = lines[index - 1] if index else ""
        marker = _MARKER.match(before)
        rest = "\n".join(lines[end + 1 : end + 8]).strip().split("\n\n")[0]
        found.append(
            Block(
                path,
                index + 1,
                opened.group(1),
                "\n".join(lines[index + 1 : end]) + "\n",
                (marker.group(1), marker.group(2)) if marker else None,
                rest,
            )
        )
        index = end + 1
    return found


# MyST directives (```{toctree}, ```{eval-rst}) are the docs build's, not code.
BLOCKS = [b for path in _files() for b in blocks_of(path) if not b.language.startswith("{")]
PYTHON = [b for b in BLOCKS if b.language == "python" and b.marker is None]


SNIPPETS = [b for b in BLOCKS if b.language == "python" and (b.marker or ("",))[0] != "same as"]


def undefined_names(code: str) -> set[str]:
    """Names ``code`` reads that nothing in it defines or imports, nor builtins."""
    top = symtable.symtable(code, "<block>", "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    used = set()
    tables = [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for symbol in table.get_symbols():
            if symbol.is_referenced() and (table is top or symbol.is_global()):
                used.add(symbol.get_name())
    return used - defined - set(dir(builtins)) - {"__name__", "__file__"}


@pytest.mark.parametrize("block", SNIPPETS, ids=lambda b: b.name)
def test_a_python_block_is_a_whole_program(block: Block) -> None:
    """Run or not, a block compiles as a module, and names only what it defines or imports
    (a fragment of a larger file excepted). Top-level ``await`` and a name from nowhere are
    what made docs/observability.md's Prometheus block fail for a reader."""
    try:
        compile(block.code, block.name, "exec")
    except SyntaxError as exc:
        raise AssertionError(f"{block.name}: {exc.msg} (line {exc.lineno})") from None
    if block.marker is None or not block.marker[1].startswith("a fragment"):
        assert undefined_names(block.code) == set(), f"{block.name}: define or import these"


def expected_lines(block: Block) -> list[str] | None:
    """The lines the text after the block says it prints, or ``None`` when it says none."""
    if not block.after.startswith("It prints"):
        return None
    said = block.after.split(". ")[0]
    return [re.sub(r"\s*\n\s*", " ", line) for line in re.findall(r"`([^`]+)`", said)]


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.marker], ids=lambda b: b.name)
def test_a_block_that_does_not_run_says_where_it_runs_or_why_not(block: Block) -> None:
    assert block.marker is not None
    kind, what = block.marker
    if kind == "same as":
        assert block.code == (ROOT / what).read_text(), f"{block.name} differs from {what}"
    else:
        assert len(what.split()) >= 3, f"{block.name}: say why it is not run"


@pytest.mark.parametrize(
    "block",
    [b for b in BLOCKS if b.marker is None and b.language != "python"],
    ids=lambda b: b.name,
)
def test_a_data_block_parses(block: Block) -> None:
    if block.language == "json":
        json.loads(block.code)
    elif block.language == "yaml":
        yaml.safe_load(block.code)
    elif block.language == "ini":
        configparser.ConfigParser().read_string(block.code)
    else:
        assert block.language == "text", (
            f"{block.name}: a {block.language or 'plain'} block cannot run here; "
            "mark it <!-- not run: REASON --> or <!-- same as: examples/PATH -->"
        )


async def run_block(block: Block, pg_url: URL, schema: str) -> subprocess.CompletedProcess[str]:
    """``block`` run in a fresh interpreter against the suite's server and ``schema``."""
    url = pg_url.render_as_string(hide_password=False)
    code = block.code.replace(
        f'"{DOC_ASYNC_URL}"', repr(url.replace("postgresql://", "postgresql+asyncpg://", 1))
    )
    code = code.replace(f'"{DOC_URL}"', repr(url)).replace(DOC_SCHEMA, repr(schema))
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        code = code.replace(DOC_PORT, str(free.getsockname()[1]))
    ran = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, f"{block.name}:\n{ran.stderr}"
    return ran


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.name)
async def test_a_python_block_runs_and_prints_what_the_text_says(
    block: Block, pg_url: URL, schema: str
) -> None:
    ran = await run_block(block, pg_url, schema)
    expected = expected_lines(block)
    assert expected is not None, f"{block.name}: say what it prints (It prints `...`)"
    assert ran.stdout.splitlines() == expected


async def test_the_readme_program_writes_what_it_says(pg_url: URL, schema: str) -> None:
    """The README's program, run by the test above, leaves the rows it describes."""
    (program,) = [b for b in PYTHON if b.path.name == "README.md"]
    assert program.code.count(f'"{DOC_URL}"') == 1
    assert program.code.count(DOC_SCHEMA) == 1
    await test_a_python_block_runs_and_prints_what_the_text_says(program, pg_url, schema)
    rows = await admin_execute(
        pg_url, f'SELECT key, status FROM "{schema}".cronoq_tasks ORDER BY id'
    )
    assert [tuple(r) for r in rows] == [("report-day-1", "succeeded"), ("mail-42", "queued")]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    (command,) = [b.code for b in BLOCKS if b.path.name == "README.md" and "nox -s" in b.code]
    nox = command.strip().split(" && ")[-1]
    last = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert last == nox


async def test_the_readme_program_run_again_prints_what_the_text_says(
    pg_url: URL, schema: str
) -> None:
    """Run a second time on the same schema, the README's program prints the one line the
    README says, and no log line nor traceback: its refusal is the caller's answer."""
    (program,) = [b for b in PYTHON if b.path.name == "README.md"]
    said = re.search(
        r"Run it again on the same schema and it prints only `([^`]+)`",
        " ".join((ROOT / "README.md").read_text().split()),
    )
    assert said is not None, "the README says what a second run prints"
    first = await run_block(program, pg_url, schema)
    assert first.stderr == ""
    second = await run_block(program, pg_url, schema)
    assert (second.stdout.splitlines(), second.stderr) == ([said.group(1)], "")
