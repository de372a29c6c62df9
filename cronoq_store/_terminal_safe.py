"""The one rule for text the commands print: nothing a row, a URL or an argument holds can
drive the terminal, hide text, reorder it, or forge a line.

Every value is printed on one line, with these characters written as visible escapes:
controls (all of C0 including tab, line feed and carriage return, DEL, C1), format
characters (Unicode category ``Cf``: bidi embeddings, overrides and isolates, zero-width
characters, the byte-order mark...), the line and paragraph separators (``Zl``, ``Zp``) and
lone surrogates (``Cs``, from undecodable arguments). A backslash is doubled, so an escape
cannot be forged by text that spells one: ``\\x1b`` in the output always means that the value
held ESC. Other characters, non-ASCII ones included, print as they are.

``--json`` documents (:func:`json_text`) are valid JSON in which the same characters are
``\\uXXXX`` escapes (JSON escapes C0 itself), so they decode to the values as stored.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Mapping

__all__ = ["json_text", "visible", "visible_block"]

#: The Unicode categories written as escapes: controls, format characters, line and
#: paragraph separators, surrogates.
_ESCAPED = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
_NAMED = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _is_escaped(char: str) -> bool:
    return unicodedata.category(char) in _ESCAPED


def _escape(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    if not _is_escaped(char):
        return char
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def visible(text: str) -> str:
    """``text`` as one line that is safe on a terminal (the module's rule)."""
    if text.isascii() and text.isprintable() and "\\" not in text:
        return text  # the common case, untouched
    return "".join(map(_escape, text))


def visible_block(text: str) -> str:
    """Like :func:`visible`, but tabs and line feeds stay: a message shown as a block (the
    console's pages, where a value cannot start a line that passes for a label)."""
    return "\n".join("\t".join(map(visible, line.split("\t"))) for line in text.split("\n"))


def _json_escape(char: str) -> str:
    if char == "\n" or not _is_escaped(char):
        return char  # a raw line feed is the indentation's: JSON strings escape their own
    code = ord(char)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    # JSON has no escape beyond the BMP: a surrogate pair.
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def json_text(document: Mapping[str, object], *, indent: int | None = 2) -> str:
    """``document`` as indented JSON (on one line with ``indent=None``, as JSON Lines
    want), non-ASCII text readable, and every character of the module's rule escaped (only
    inside strings can such a character appear)."""
    text = json.dumps(document, ensure_ascii=False, indent=indent)
    if text.isascii() and "\x7f" not in text:
        return text  # JSON has escaped every other ASCII control
    return "".join(map(_json_escape, text))
