"""``python -m cronoq_store._demo ROLE``: one role's process, started by the orchestrator."""

from __future__ import annotations

from .roles import main

main()
