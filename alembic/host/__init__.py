"""The host's control schema migrations (``cronoq_store._host.control``). Alembic loads
``env.py`` by path and never imports this package; it exists so that type checkers name
this ``env.py`` apart from the cluster migrations' own."""
