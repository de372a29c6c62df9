"""Stored text made visible on a page: Jinja's autoescaping keeps markup out, and this keeps
out what escaping lets through, controls and bidi/format characters, which can hide or
reorder what an operator reads (a key whose ``U+202E`` turns the rest of a line around).

Each such character becomes a visible escape (``\\x1b``, ``\\u202e``); a backslash stays as
it is, so the shown text is for reading, not for copying back byte for byte (the JSON
documents carry every value exactly). Tab and newline stay where a value is shown as a
block (:func:`visible_block`).
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["visible", "visible_block"]

# C0 controls, DEL and C1 controls; plus the format characters (Unicode category Cf: bidi
# embeddings, overrides and isolates, zero-width joiners, the BOM) and the line and
# paragraph separators, found by category below so a newer Unicode needs no edit here.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_BLOCK_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(char: str) -> str:
    code = ord(char)
    return (
        f"\\x{code:02x}"
        if code <= 0xFF
        else f"\\u{code:04x}"
        if code <= 0xFFFF
        else (f"\\U{code:08x}")
    )


def _format_characters(text: str) -> str:
    if text.isascii():
        return text
    return "".join(_escape(c) if unicodedata.category(c) == "Cf" else c for c in text)


def visible(text: str) -> str:
    """``text`` on one line, every control and format character as an escape."""
    return _format_characters(_CONTROLS.sub(lambda m: _escape(m.group()), text))


def visible_block(text: str) -> str:
    """Like :func:`visible`, keeping tabs and newlines (a message shown as a block)."""
    return _format_characters(_BLOCK_CONTROLS.sub(lambda m: _escape(m.group()), text))
