"""The prose of README.md and docs/ stays within the limits tools/prose.py sets."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from .support import ROOT


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("prose", ROOT / "tools" / "prose.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["prose"] = module
    spec.loader.exec_module(module)
    return module


prose = _checker()


@pytest.mark.parametrize("rule", prose.RULES, ids=lambda rule: rule.name)
def test_sentences_and_paragraphs_stay_within_the_limits(rule: Any) -> None:
    figures = prose.measure(prose.default_files(), rule)
    assert figures.ok, prose.report(figures, verbose=True)


def test_the_checker_counts_what_a_reader_reads(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A heading of many words that is not prose at all\n\n"
        "One two three. Four five: six; seven `a.b(c) d` eight!\n\n"
        "```python\nnot = prose.at(all)\n```\n\n"
        "| a table | is | not prose |\n|---|---|---|\n\n"
        "- a [linked text](https://example.org/x.y) item\n"
        "  that goes on\n"
    )
    paragraphs = list(prose.paragraphs(page))
    assert [p.sentences for p in paragraphs] == [
        ["One two three.", "Four five:", "six;", "seven CODE eight!"],
        ["a linked text item that goes on"],
    ]
    figures = prose.measure([page])
    assert (figures.sentences, figures.median, figures.p90) == (5, 3, 7)
    full_stops = prose.measure([page], prose.FULL_STOPS)
    assert next(p.sentences for p in prose.paragraphs(page, prose.FULL_STOPS)) == [
        "One two three.",
        "Four five: six; seven CODE eight!",
    ]
    assert (full_stops.sentences, full_stops.median, full_stops.p90) == (3, 6, 7)
    long = tmp_path / "long.md"
    long.write_text(" ".join(["word"] * 121) + "\n")
    assert [p.words for p in prose.measure([long]).too_long] == [121]
