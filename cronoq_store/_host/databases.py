"""One process leading clusters placed in several databases: a :class:`~._host.host.PgHost`
per database, each on its own.

Placement is explicit: the application names each database with a label (``{"east": url_a,
"west": url_b}``) and enrolls each cluster in one of them, and ``lead`` is told where each
cluster it gains lives (:class:`ClusterRef`). Each database's host has its own pool,
control schema, membership and process lock, and runs and fails on its own: a database
that does not answer (a server stopped, a Patroni failover under way) steps its own
clusters down and is tried again, while the other databases' clusters stay led. Nothing
is shared across databases but the process and ``lead``, so no fence depends on two
servers agreeing: each cluster is fenced by its epoch in the one database it lives in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from types import TracebackType

from sqlalchemy import select
from sqlalchemy.engine import URL

from .. import _door as door
from .._config import validate_schema_name
from .._errors import StoreError, UnavailableError
from .._retry import acquisition_backoff, bounded, pause
from .._urls import redact
from . import control
from .host import HostedStore, PgHost, PgHostConfig
from .move import MOVED

__all__ = ["ClusterRef", "MultiDatabaseHost"]

logger = logging.getLogger("cronoq_store")


@dataclass(frozen=True, slots=True, order=True)
class ClusterRef:
    """Where a cluster lives: the label of its database and its schema. The same schema
    name in two databases is two clusters, so a cluster is always named by both."""

    database: str
    schema: str


#: How a database's dial or read fails; :func:`_unanswered` tells which of these only an
#: operator mends.
_FAILURES = (StoreError, OSError, asyncio.TimeoutError)


def _unanswered(error: BaseException) -> bool:
    """Whether ``error`` says the database did not answer (down, silent, in a failover):
    tried again, and no caller's error. Anything else (a wrong password or database name,
    a control schema a newer build migrated or a role we cannot trust controls) holds until
    an operator acts: :meth:`MultiDatabaseHost.connect` raises it."""
    if isinstance(error, StoreError):
        return error.is_transient
    return isinstance(error, (OSError, asyncio.TimeoutError))


def _log_failed_dial(label: str, dial: asyncio.Task[PgHost]) -> None:
    """Log a dial that failed, whoever waits for it (perhaps no one yet): a warning if the
    database did not answer, an error if only an operator can mend it."""
    if not dial.cancelled() and (error := dial.exception()) is not None:
        unanswered = _unanswered(error)
        logger.log(
            logging.WARNING if unanswered else logging.ERROR,
            "cannot reach a database of the host for now"
            if unanswered
            else "a database of the host refuses this process; retrying until it is mended",
            extra={"database": label, "error": str(error)},
        )


#: The application's work for one cluster gained: where it lives, and its store for the term.
Lead = Callable[[ClusterRef, HostedStore], Awaitable[None]]


class _Database:
    """One labelled database: its URL, its host once connected, and the dial under way."""

    def __init__(self, label: str, url: str | URL) -> None:
        self.label = label
        self.url = url
        self.host: PgHost | None = None
        self.dial: asyncio.Task[PgHost] | None = None


class MultiDatabaseHost:
    """Leads the clusters of several databases, one :class:`PgHost` each (see the module's
    docstring). Open with :meth:`connect`, enroll each cluster in its database with
    :meth:`enroll`, then :meth:`serve`."""

    def __init__(self, databases: Mapping[str, str | URL], config: PgHostConfig) -> None:
        if not databases:
            raise ValueError("databases: at least one")
        for label in databases:
            if not label or "\x00" in label:
                raise ValueError("a database's label: not empty, no NUL")
        self._config = config
        self._databases = {label: _Database(label, url) for label, url in databases.items()}
        self._lead: Lead | None = None
        self._closing = asyncio.Event()
        self._runners: list[asyncio.Task[None]] = []

    @classmethod
    async def connect(
        cls, databases: Mapping[str, str | URL], config: PgHostConfig | None = None
    ) -> MultiDatabaseHost:
        """A host for each database, connected as :meth:`PgHost.connect` does, its config's
        ``database`` the database's label (its telemetry's ``cronoq.host.database``).

        Each database gets ``session_timeout`` to answer, the bound within which the store
        tells a slow server from a silent one. One that has not answered by then, or is
        down, is not an error: its dial goes on in the background (a server that accepts and never
        answers holds it for the pool's connect bound, 60 s), :meth:`serve` keeps trying it,
        and :meth:`enroll` in it waits for that dial and raises if it fails. One that
        refuses this process (a wrong password or database name, a control schema a newer
        build migrated or an untrusted role controls) raises here: only an operator mends
        it, and :meth:`serve` would retry it, logging an error, until one does."""
        made = cls(databases, config or PgHostConfig())
        dials = [made._dial(db) for db in made._databases.values()]
        try:
            await asyncio.wait(dials, timeout=made._config.store.session_timeout)
            for dial in dials:
                if dial.done() and not dial.cancelled():
                    error = dial.exception()
                    if error is not None and not _unanswered(error):
                        raise error
        except BaseException:
            await made.close()
            raise
        return made

    def _dial(self, db: _Database) -> asyncio.Task[PgHost]:
        """``db``'s dial under way, or a new one if none is: one at a time per database,
        whoever asks, in a task of its own, so that a caller given up on (its own bound, a
        cancel) leaves it running for the next one instead of starting over."""
        if db.dial is None or (db.dial.done() and db.host is None):
            db.dial = asyncio.ensure_future(self._connect_host(db))
            db.dial.add_done_callback(partial(_log_failed_dial, db.label))
        return db.dial

    async def _connect_host(self, db: _Database) -> PgHost:
        db.host = await PgHost.connect(db.url, replace(self._config, database=db.label))
        return db.host

    async def _connected(self, db: _Database) -> PgHost:
        """``db``'s host, waiting for its dial if it is not connected yet."""
        if self._closing.is_set():
            raise StoreError("this host is closed")
        if db.host is not None:
            return db.host
        dial = self._dial(db)
        # Waited for, not awaited: the dial is shared, and one waiter's cancel must not end it.
        await asyncio.wait({dial})
        if dial.cancelled():
            raise StoreError("this host is closed")
        return dial.result()

    async def _reached(self, db: _Database) -> PgHost:
        """``db``'s host for an application's call: a database that has not answered is
        named in the error, which would otherwise say only what timed out."""
        try:
            return await self._connected(db)
        except _FAILURES as error:
            if self._closing.is_set() or not _unanswered(error):
                raise
            raise UnavailableError(
                f"database {db.label!r} of this host has not answered ({error}); serve() "
                "keeps trying it"
            ) from error

    def _database(self, label: str) -> _Database:
        try:
            return self._databases[label]
        except KeyError:
            raise ValueError(
                f"database {label!r} is not one of this host's ({', '.join(self._databases)})"
            ) from None

    async def close(self) -> None:
        """Hand every cluster of every database over, leave each group, close each pool."""
        self._closing.set()
        # A dial to a server that accepts and never answers would hold close for the
        # pool's connect bound: it is cancelled (PgHost.connect disposes of its pool).
        dials = [db.dial for db in self._databases.values() if db.dial and not db.dial.done()]
        for dial in dials:
            dial.cancel()
        if dials:
            await asyncio.wait(dials)
        hosts = [db.host for db in self._databases.values() if db.host is not None]
        await asyncio.gather(*(host.close() for host in hosts))
        runners, self._runners = self._runners, []
        if runners:
            await asyncio.wait(runners)

    async def __aenter__(self) -> MultiDatabaseHost:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        placed = ", ".join(f"{label}={redact(db.url)!r}" for label, db in self._databases.items())
        return f"MultiDatabaseHost({placed}, group={self._config.group!r})"

    @property
    def databases(self) -> tuple[str, ...]:
        """The labels of the databases, in the order given."""
        return tuple(self._databases)

    def host(self, database: str) -> PgHost | None:
        """The host of ``database``, or ``None`` while it has not answered yet."""
        return self._database(database).host

    @property
    def process_ids(self) -> Mapping[str, int | None]:
        """This process's id in each database's group, by label (``None``: not registered
        there now)."""
        return {
            label: None if db.host is None else db.host.process_id
            for label, db in self._databases.items()
        }

    def led(self) -> Mapping[ClusterRef, HostedStore]:
        """The clusters this process leads now, in every database."""
        return {
            ClusterRef(label, schema): store
            for label, db in self._databases.items()
            if db.host is not None
            for schema, store in db.host.led().items()
        }

    # --- placement --------------------------------------------------------------------

    async def enroll(
        self,
        schemas: str | Iterable[str],
        database: str,
        *,
        migrate: bool = True,
        allow_duplicate_names: bool = False,
    ) -> list[str]:
        """Enroll clusters in the database labelled ``database``, as :meth:`PgHost.enroll`
        does there. A schema name this host group has enrolled in another of its databases
        is refused (``StoreError``) unless ``allow_duplicate_names``: two clusters of one
        name are legal (:class:`ClusterRef` keeps them apart) but are more often a cluster
        enrolled twice by mistake. Moved-away tombstones (``host move``) do not count. The
        check guards against mistakes and is no lock: a database that does not answer within
        ``session_timeout`` is skipped (logged), and two enrolments at once in two databases
        both pass it."""
        db = self._database(database)
        names = [schemas] if isinstance(schemas, str) else list(schemas)
        for name in names:
            validate_schema_name(name)
        if not allow_duplicate_names:
            for other in self._databases.values():
                if other is not db:
                    await self._refuse_duplicates(other, names, database)
        host = await self._reached(db)
        return await host.enroll(names, migrate=migrate)

    async def _refuse_duplicates(self, other: _Database, names: list[str], into: str) -> None:
        try:
            found = await bounded(
                self._enrolled_among(other, names),
                self._config.store.session_timeout,
                silent=f"database {other.label!r} did not answer",
            )
        except _FAILURES as error:
            # Refusing, or waiting for the dial's own bound, would keep an application that
            # enrolls at its start from leading any database while one is down or silent;
            # the check is no lock anyway.
            logger.warning(
                "cannot check a database of the host for clusters of the same names; "
                "enrolling them anyway",
                extra={"database": other.label, "into": into, "error": str(error)},
            )
            return
        if found:
            raise StoreError(
                f"schema {', '.join(map(repr, found))} is enrolled in host group "
                f"{self._config.group!r} in database {other.label!r} already: move it with "
                "`cronoq-store host move`, or allow duplicate names if two clusters of one "
                "name are meant"
            )

    async def _enrolled_among(self, db: _Database, names: list[str]) -> list[str]:
        """Which of ``names`` this group has enrolled in ``db``, moved-away tombstones
        aside; on a connection of its own (enrolments are rare), once ``db``'s host has
        made its control schema."""
        await self._connected(db)
        clusters = control.clusters
        statement = select(clusters.c.schema_name).where(
            clusters.c.host_group == self._config.group,
            clusters.c.schema_name.in_(names),
            clusters.c.state != MOVED,
        )
        engine = door.own_engine(db.url, replace(self._config.store, max_connections=1))
        try:
            async with door.translated("reading enrolled clusters"), engine.connect() as conn:
                rows = await conn.execute(
                    statement,
                    execution_options=control.control_options(self._config.control_schema),
                )
                return sorted(row.schema_name for row in rows)
        finally:
            await engine.dispose()

    async def remove(self, ref: ClusterRef) -> bool:
        """Take ``ref`` out of its database's host group, as :meth:`PgHost.remove` does."""
        host = await self._reached(self._database(ref.database))
        return await host.remove(ref.schema)

    # --- serving ----------------------------------------------------------------------

    async def serve(self, lead: Lead) -> None:
        """Lead this process's share of each database's clusters until :meth:`close`:
        ``lead(ref, store)`` runs in a task of its own for each cluster gained, as
        :meth:`PgHost.serve` runs it. Each database is served on its own: one that does
        not answer is tried again every ``lock_poll`` at most, and the others go on.
        Raises once :meth:`close` began."""
        if self._closing.is_set():
            raise StoreError("this host is closed")
        if self._lead is not None:
            raise StoreError("this host is already serving")
        self._lead = lead
        self._runners = [
            asyncio.ensure_future(self._serve_database(db)) for db in self._databases.values()
        ]
        try:
            await self._closing.wait()
        finally:
            if not self._closing.is_set():
                await self.close()

    async def _serve_database(self, db: _Database) -> None:
        """Connect to ``db`` until it answers, then serve its clusters until closed."""
        delays = acquisition_backoff(self._config.store).delays()
        while not self._closing.is_set():
            try:
                host = await self._connected(db)
            except _FAILURES:  # logged by the dial; one refused is retried until mended
                await pause(next(delays), self._closing)
                continue
            if self._closing.is_set():
                return  # closed while the dial finished: its host is closed too
            await host.serve(partial(self._lead_one, db.label))
            return

    async def _lead_one(self, label: str, store: HostedStore) -> None:
        assert self._lead is not None
        await self._lead(ClusterRef(label, store.config.schema), store)
