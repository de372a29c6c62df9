"""The store on a real HA stack: etcd, Patroni-managed PostgreSQL, HAProxy, on loopback.

- :mod:`.stack`: the stack's processes (started, hurt and torn down by the tests);
- :mod:`.workload`: store instances (the torture test's workers) committing through it while
  faults hit the stack, and the torture checker's proof of what they acknowledged;
- ``test_*.py``: the short profile (default suite) and, with ``CRONOQ_HA_PROFILE=long``,
  the long one (``nox -s ha_long``).
"""
