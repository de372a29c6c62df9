"""``python -m cronoq_store._cli``: the ``cronoq-store`` command."""

from __future__ import annotations

from . import main

main()
