"""Sentence and paragraph lengths of the prose in README.md and docs/, against our limits.

Prose is what is left of the markdown once fenced code, tables, headings, HTML comments
and images are left out. A paragraph is a run of prose lines; each list item is one. A
sentence ends at ``. ! ? : ;`` followed by a space or the paragraph's end; inline code
counts as one word, a link as its text. A second, stricter count splits at ``. ! ?`` only,
as a reader who reads a colon or a semicolon as part of the sentence would count, and
holds it to tighter limits. Run ``python3 tools/prose.py [-v] [FILE...]``: it prints the
figures under both counts and the paragraphs and sentences over the limits, and exits 1
if any limit is exceeded. ``tests/test_prose.py`` runs it on the repository.
"""

from __future__ import annotations

import re
import statistics
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The longest paragraph, in words.
PARAGRAPH_WORDS = 120

_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`+[^`]*`+")
_IMAGE = re.compile(r"!\[[^\]]*\]\([^)]*\)")
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_ABBREVIATIONS = {"e.g.": "eg", "i.e.": "ie", "etc.)": "etc)", "vs.": "vs"}


@dataclass(frozen=True)
class Rule:
    """Where a sentence ends, and the limits on the median and the 90th percentile."""

    name: str
    split: re.Pattern[str]
    median_words: int
    p90_words: int


#: Sentences end at ``. ! ? : ;``: the count issue 24 states its limits in.
CLAUSES = Rule("split at . ! ? : ;", re.compile(r"(?<=[.!?:;])\s+"), 18, 35)
#: Sentences end at ``. ! ?`` only: a colon or a semicolon does not end one.
FULL_STOPS = Rule("split at . ! ?", re.compile(r"(?<=[.!?])\s+"), 16, 33)
RULES = (CLAUSES, FULL_STOPS)


@dataclass
class Paragraph:
    path: Path
    line: int
    text: str
    sentences: list[str] = field(default_factory=list)

    @property
    def words(self) -> int:
        return sum(count_words(s) for s in self.sentences)


def default_files() -> list[Path]:
    """README.md and every markdown file under docs/ (the build's output left out)."""
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)
    return [ROOT / "README.md", *docs]


def count_words(sentence: str) -> int:
    return sum(1 for token in sentence.split() if any(ch.isalnum() for ch in token))


def sentences_of(text: str, rule: Rule = CLAUSES) -> list[str]:
    text = _INLINE_CODE.sub("CODE", text)
    text = _IMAGE.sub("", text)
    text = _LINK.sub(r"\1", text)
    for abbreviation, plain in _ABBREVIATIONS.items():
        text = text.replace(abbreviation, plain)
    text = re.sub(r"[*_]{1,2}(?=\w)|(?<=\w)[*_]{1,2}", "", text)
    return [s for s in rule.split.split(text.strip()) if count_words(s)]


def paragraphs(path: Path, rule: Rule = CLAUSES) -> Iterator[Paragraph]:
    """The prose paragraphs of one markdown file, with the line each starts on."""
    text = _COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
    in_code = False
    current: list[str] = []
    start = 0

    def flush() -> Iterator[Paragraph]:
        if current:
            joined = " ".join(line.strip() for line in current)
            yield Paragraph(path, start, joined, sentences_of(joined, rule))
            current.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            yield from flush()
            in_code = not in_code
            continue
        stripped = line.strip()
        if in_code or not stripped or stripped.startswith(("#", "|", "<")):
            yield from flush()
            continue
        if _ITEM.match(line):
            yield from flush()
            line = _ITEM.sub("", line)
        if not current:
            start = number
        current.append(line)
    yield from flush()


@dataclass
class Figures:
    rule: Rule
    sentences: int
    median: float
    p90: float
    longest_paragraph: Paragraph | None
    too_long: list[Paragraph]
    long_sentences: list[tuple[Paragraph, str]]

    @property
    def ok(self) -> bool:
        return (
            self.median <= self.rule.median_words
            and self.p90 <= self.rule.p90_words
            and not self.too_long
        )


def measure(files: Iterable[Path], rule: Rule = CLAUSES) -> Figures:
    found = [p for path in files for p in paragraphs(path, rule)]
    lengths = sorted(count_words(s) for p in found for s in p.sentences)
    p90 = lengths[min(len(lengths) - 1, int(len(lengths) * 0.9))] if lengths else 0
    return Figures(
        rule=rule,
        sentences=len(lengths),
        median=statistics.median(lengths) if lengths else 0,
        p90=p90,
        longest_paragraph=max(found, key=lambda p: p.words, default=None),
        too_long=[p for p in found if p.words > PARAGRAPH_WORDS],
        long_sentences=[
            (p, s) for p in found for s in p.sentences if count_words(s) > rule.p90_words
        ],
    )


def report(figures: Figures, *, verbose: bool = False) -> str:
    longest = figures.longest_paragraph
    where = f" ({_where(longest)})" if longest else ""
    rule = figures.rule
    lines = [
        f"{rule.name}: sentences: {figures.sentences}",
        f"median words per sentence: {figures.median:g} (limit {rule.median_words})",
        f"90th percentile: {figures.p90:g} (limit {rule.p90_words})",
        f"longest paragraph: {longest.words if longest else 0} words{where}"
        f" (limit {PARAGRAPH_WORDS})",
        f"paragraphs over the limit: {len(figures.too_long)}",
        f"sentences over {rule.p90_words} words: {len(figures.long_sentences)}",
    ]
    lines += [f"  paragraph of {p.words} words: {_where(p)}" for p in figures.too_long]
    if verbose:
        lines += [
            f"  {count_words(s)} words at {_where(p)}: {s[:90]}" for p, s in figures.long_sentences
        ]
    return "\n".join(lines)


def _where(paragraph: Paragraph) -> str:
    try:
        name = paragraph.path.relative_to(ROOT)
    except ValueError:
        name = paragraph.path
    return f"{name}:{paragraph.line}"


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    files = [Path(a).resolve() for a in argv if a != "-v"] or default_files()
    all_figures = [measure(files, rule) for rule in RULES]
    print("\n\n".join(report(figures, verbose=verbose) for figures in all_figures))
    return 0 if all(figures.ok for figures in all_figures) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
