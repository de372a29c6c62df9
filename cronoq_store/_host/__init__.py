"""The host: one process leading many cluster schemas, balanced across the processes of its
group, each cluster fenced on its own by its epoch (issue 31).

:mod:`cronoq_store._host.control` holds the control schema that every host process of a
database shares: its tables, its migrations and every statement the host runs on it.
"""
