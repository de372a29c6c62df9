"""Stored text on a page follows the CLI's rule (:mod:`cronoq_store._terminal_safe`):
controls and format characters become visible escapes, everything printable stays as it
is, and markup is left for Jinja to escape."""

from __future__ import annotations

import pytest

from cronoq_store._terminal_safe import visible, visible_block


@pytest.mark.parametrize(
    ("stored", "shown"),
    [
        ("\x1b]0;title\x07", "\\x1b]0;title\\x07"),  # OSC: sets a terminal's title
        ("\x1b]52;c;aGk=\x07", "\\x1b]52;c;aGk=\\x07"),  # OSC 52: writes the clipboard
        ("a\x00b\x7fc", "a\\x00b\\x7fc"),
        ("\x9b2J\x85", "\\x9b2J\\x85"),  # C1: CSI, NEL
        ("\u202egnp.exe", "\\u202egnp.exe"),  # right-to-left override
        ("\u2066x\u2069\u200e\u061c", "\\u2066x\\u2069\\u200e\\u061c"),  # isolates, marks
        ("zero\u200bwidth\ufeff", "zero\\u200bwidth\\ufeff"),
        ("tag\U000e0041", "tag\\U000e0041"),  # a format character beyond the BMP
        ("line\u2028para\u2029", "line\\u2028para\\u2029"),
        ("tab\tnew\nret\r", "tab\\tnew\\nret\\r"),
        ("C:\\x1b", "C:\\\\x1b"),  # text that spells an escape cannot pass for one
        ("café 日本 <b>&amp;", "café 日本 <b>&amp;"),  # markup is Jinja's to escape
        ("", ""),
    ],
)
def test_visible_escapes_controls_and_format_characters(stored: str, shown: str) -> None:
    assert visible(stored) == shown


def test_a_block_keeps_tabs_and_newlines_only() -> None:
    assert visible_block("a\tb\nc\rd\x1b\u202e") == "a\tb\nc\\rd\\x1b\\u202e"
