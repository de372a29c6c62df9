"""``PgHost``: one process leading many cluster schemas, sharing them with the other
processes of its host group, each cluster fenced on its own by its epoch.

:mod:`~cronoq_store._host.control` is the control schema every host process of a database
shares (tables, migrations, statements); :mod:`~cronoq_store._host.session` the host
session that keeps a process alive and claims clusters; :mod:`~cronoq_store._host.balance`
what each process leads; :mod:`~cronoq_store._host.host` the host and its hosted stores;
:mod:`~cronoq_store._host.databases` one process's hosts in several databases, and
:mod:`~cronoq_store._host.move` a cluster moved from one database to another.
"""
