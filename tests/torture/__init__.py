"""The failover torture test's machinery: store instances in processes of their own, the
faults injected into them, and the checker that proves what they acknowledged.

- :mod:`.journal`: what an instance records outside the database (append, flush, fsync);
- :mod:`.worker`: one store instance (``python -m tests.torture.worker CONFIG``);
- :mod:`.faults`: the fault toolkit and the seeded fault schedule;
- :mod:`.audit`: the triggers that record every committed row version and epoch;
- :mod:`.checker`: the four properties, checked against journals, audit and tables;
- :mod:`.orchestrator`: a whole run, short or long profile.
"""
