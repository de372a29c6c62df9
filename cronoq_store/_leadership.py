"""Leader election: a session advisory lock held on a dedicated connection, and its keeper.

The lock lives exactly as long as the session that took it. That session therefore never
comes from the application's pool and never returns to any pool (a pooled connection keeps
a session lock after ``close()``): it is discarded when it ends, and releasing leadership
means closing it. On an application's engine it is made as that engine makes its own
(creator, TLS, connect arguments), then sets its own keepalives, idle limit, search path,
durability and read-write mode (``session_settings``). Taking the lock bumps the
fencing epoch, which every commit checks in its own transaction.

The keeper reads the leader row on the session every ``keepalive``. If nothing has been
heard from it for ``session_timeout``, this instance steps down: the session is torn down
without waiting on its socket, so a partition cannot keep a deposed leader believing it
leads. Across a partition the server gives up on the session only later (its TCP keepalives
start after ``session_timeout`` idle, then probe three times, a second apart), so the old
leader has stepped down before the lock can move. When the server ends the session first (a
terminated backend), a standby may lead before the keeper notices; the epoch fences every
commit of the old leader from then on. The row it reads also steps this instance down at
once when the epoch moved without it, or the schema no longer holds the cluster it was
opened on (its incarnation, the leader table's OID: dropped, made again, renamed, restored):
the lock it holds is then keyed on a schema that is gone, and excludes nobody.

Each acquisition reads the lock's key (the schema's OID) again, on the lock session: a
schema's OID is not kept by ``pg_upgrade``, and the lock must be the one that instances
opened since take.

Each instance has an id, drawn when it opens, that its lock session shows the server at the
end of its ``application_name`` (:func:`~cronoq_store._results.lock_session_name`):
one instance's successive sessions have new pids but the same id, so an operator (and
``cronoq-store handover``) can tell whether leadership moved to another instance.

An instance whose term ended waits :func:`cool_down` before it competes again, so that a
waiting standby takes the lock first: a handover (the server ending the lock session, or
the application releasing leadership) then hands over, instead of racing the instance it
removed.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from datetime import datetime
from typing import NoReturn, Protocol

from sqlalchemy.engine import URL
from sqlalchemy.pool import Pool

from . import _door as door
from . import _statements as st
from ._config import PgStoreConfig
from ._door import LeaderRow, LockSession
from ._errors import (
    ClusterHostedError,
    ClusterReplacedError,
    SchemaGoneError,
    StoreError,
    UnavailableError,
)
from ._queries import lock_keys
from ._results import LockHolder, lock_session_name
from ._retry import Retry, acquisition_backoff, pause
from ._schema import schema_options
from ._trust import ConnectCheck, TrustCheck
from ._urls import redact, resolve
from .telemetry import DISABLED, Telemetry

__all__ = ["LeaderTerm", "Leadership", "cool_down", "session_settings"]

logger = logging.getLogger("cronoq_store")

#: A waiting standby looks at who holds the lock every this many polls.
_HOLDER_CHECK_POLLS = 10
#: A standby warns about a foreign lock holder at most this often (seconds).
_FOREIGN_WARNING_INTERVAL = 60.0
#: A standby says which leader it waits behind when that changes, and again this often
#: (seconds): at INFO, since waiting is a standby's purpose.
_WAITING_INTERVAL = 600.0
#: What a cool-down adds to a standby's two polls: room for a poll that a loaded machine
#: delays (the standby's process not scheduled, its statement queued on a busy server).
_COOL_DOWN_SLACK = 1.0


def cool_down(config: PgStoreConfig) -> float:
    """How long an instance whose term ended waits before it polls the lock again:
    ``2 * lock_poll + 1`` seconds (2 s with the defaults).

    A waiting standby tries the lock every ``lock_poll`` (plus its round trips), so it
    takes a freed lock within about one ``lock_poll``. The cool-down counts from when this
    instance learned of its loss, never before the lock was freed, and allows a second
    ``lock_poll`` and one more second for a standby that a loaded machine slows (its process
    not scheduled, the server slow to answer). A lone instance pays it once: it leads again
    about ``cool_down`` after it stepped down (plus a connect and one poll).
    """
    return 2 * config.lock_poll + _COOL_DOWN_SLACK


#: What the keeper logs when it ends a term, by step-down reason.
_STEP_DOWNS = {
    "session_lost": "leader lock session lost; stepping down",
    "schema_gone": "the cluster's leader table or row is gone; stepping down",
    "cluster_replaced": "the schema holds another cluster than this store's; stepping down",
    "fenced": "the epoch moved without this instance; stepping down",
}


def _idle_session_timeout_ms(config: PgStoreConfig) -> int:
    return max(1000, round(1500 * config.session_timeout))


def session_settings(config: PgStoreConfig, instance: str, name: str) -> dict[str, str]:
    """The lock session's own server settings (:data:`statements.LOCK_SESSION_SETTINGS`),
    named ``name`` (the application's) followed by the instance id."""
    settings = {
        # Names resolve in pg_catalog only: no schema another role can write can capture
        # a function or operator the lock session calls.
        "search_path": st.SEARCH_PATH,
        # Set after any the application's connect arguments give: the instance id must
        # show, whole, whatever name the application chose.
        "application_name": lock_session_name(name, instance),
        # The server drops the session (and the lock) once the client is gone.
        "tcp_keepalives_idle": str(max(1, int(config.session_timeout))),
        "tcp_keepalives_interval": "1",
        "tcp_keepalives_count": "3",
        # Keepalives cannot see a client behind a stalled path whose kernel still answers
        # probes (a proxy, a NAT): a lock session with no query for 1.5 x session_timeout
        # is ended by the server, freeing the lock for a standby. The keeper queries every
        # `keepalive` and standbys every `lock_poll`, both shorter, so a healthy session is
        # never idle that long.
        "idle_session_timeout": str(_idle_session_timeout_ms(config)),
        # The same inside a transaction (an epoch bump, a host's claim), which the idle limit
        # does not cover: a session stalled between two of its statements holds the lock,
        # and the leader table, until the server ends it.
        "idle_in_transaction_session_timeout": str(_idle_session_timeout_ms(config)),
        # Whatever an application's connect arguments say: the epoch bump is as durable as
        # a commit (a bump lost in a failover would let the next leader take the same
        # epoch), and it writes.
        "synchronous_commit": "on",
        "default_transaction_read_only": "off",
    }
    assert tuple(settings) == st.LOCK_SESSION_SETTINGS
    return settings


class LeaderTerm(Protocol):
    """What a store needs of whatever makes it lead: :class:`Leadership` for a standalone
    store (its own lock session), or a host's term for a cluster it leads among many
    (:mod:`cronoq_store._host`). The store reads the term's state before each commit and
    ends it when a commit finds the fence moved; the source decides how a term starts and
    how it ends."""

    telemetry: Telemetry
    replaced: ClusterReplacedError | None

    @property
    def epoch(self) -> int | None: ...

    @property
    def is_leader(self) -> bool: ...

    @property
    def lock_key(self) -> tuple[int, int]: ...

    def mark_lost(self, reason: str = "fenced") -> None: ...

    async def wait_lost(self) -> None: ...

    async def acquire(self) -> int: ...

    async def release(self) -> None: ...

    async def close(self) -> None: ...


class Leadership:
    """Leader election for one cluster (one schema) on its own lock session.

    ``url`` is a ``postgresql+asyncpg`` URL of a server reached directly (a session advisory
    lock cannot live behind a transaction-pooling PgBouncer). Given ``pool`` (an application
    engine's pool ``recreate()``-d: its creator and connect arguments, none of its
    connections), sessions are made by that pool instead, and ``url`` only names the
    dialect and the server in logs; each session is discarded when it ends, never reused.
    ``lock_key`` is the pair of advisory-lock keys as the store read them at open; each
    acquisition reads the second (the schema's OID) again. ``incarnation`` is the cluster's
    the store was opened on (its leader table's OID): an acquisition refuses any other, with
    ``ClusterReplacedError``, before it takes an epoch. Given ``trust``, each acquisition runs
    that check on the lock session once the lock is taken, and refuses (releasing the lock,
    no epoch taken) a schema that fails it. Given ``connect``, each acquisition first checks
    who may connect to the database and refuses to wait for the lock where untrusted roles
    may (``config.allow_untrusted_connect`` makes that a warning). A standby waiting behind a
    holder that is not a store instance logs it, at most every
    ``_FOREIGN_WARNING_INTERVAL``. The object can lead many times: after a loss,
    :meth:`acquire` opens a new session and takes a new epoch, after :func:`cool_down`
    when the last term ended. ``instance`` is this object's id, the same for each session
    it opens.
    """

    def __init__(
        self,
        url: str | URL,
        schema: str,
        lock_key: tuple[int, int],
        config: PgStoreConfig,
        *,
        incarnation: int,
        pool: Pool | None = None,
        trust: TrustCheck | None = None,
        connect: ConnectCheck | None = None,
    ) -> None:
        self._url = url
        self._trust = trust
        self._connect = connect
        # loop.time() of the last warning about a foreign lock holder.
        self._warned_at: float | None = None
        # The leader a waiting standby last said it waits behind (pid, epoch), and when.
        self._waiting_behind: tuple[int, int] | None = None
        self._said_waiting_at = 0.0
        self._schema = schema
        self._key = {"k1": lock_key[0], "k2": lock_key[1]}
        self._incarnation = incarnation
        self._config = config
        #: This instance's id, at the end of its lock session's ``application_name``.
        self.instance = secrets.token_hex(4)
        # Dialled from a URL, the URL's application_name (or $PGAPPNAME) is the name's
        # prefix, as it names the store's other sessions; the id always ends it.
        parameters = None if pool is not None else resolve(url)
        self._settings = session_settings(
            config,
            self.instance,
            config.application_name
            if parameters is None
            else parameters.session_name(config.application_name),
        )
        # time.monotonic() when the last term ended: the cool-down counts from there.
        self._ended_at: float | None = None
        self._backoff = acquisition_backoff(config)
        # With `pool`, sessions are made the way an application's engine makes its own (its
        # creator, TLS, connect_args), on a pool of their own, and the settings are applied
        # once connected; otherwise they are dialled from `url` with the settings attached.
        self._via = "the engine's connection creator" if pool is not None else "the URL"
        if pool is not None:
            self._engine = door.borrowed_lock_engine(url, pool)
        else:
            assert parameters is not None
            self._engine = door.lock_engine(
                parameters.with_application_name(self._settings["application_name"]),
                self._settings,
                # asyncpg's bound on opening a connection (a silent server never refuses).
                config.session_timeout,
            )
        self._apply_settings = pool is not None
        # bump_epoch must hit the cluster's schema.
        self._db = self._engine.execution_options(**schema_options(schema))
        self._epoch: int | None = None
        # Set while this instance does not lead after having led (or released); cleared by
        # each acquisition. Never set before the first one, so wait_lost() then waits.
        self._lost = asyncio.Event()
        self._closing = asyncio.Event()
        self._acquiring = asyncio.Lock()
        self._session: LockSession | None = None
        self._keeper: asyncio.Task[None] | None = None
        #: Set once the schema was found holding another cluster than the store's (by the
        #: keeper, an acquisition or the store): what every later write is refused with.
        self.replaced: ClusterReplacedError | None = None
        #: Where step-downs are counted (``PgStore`` sets its own).
        self.telemetry: Telemetry = DISABLED

    @property
    def epoch(self) -> int | None:
        """The fencing epoch while this instance leads, else ``None``."""
        return self._epoch

    @property
    def is_leader(self) -> bool:
        return self._epoch is not None

    @property
    def lock_key(self) -> tuple[int, int]:
        """The advisory lock's keys as the last acquisition read them (at open before one)."""
        return self._key["k1"], self._key["k2"]

    def mark_lost(self, reason: str = "fenced") -> None:
        """Stop leading now (a commit found another epoch); the keeper closes the session.
        ``reason`` is the step-down's, counted when this instance was leading."""
        if self._epoch is not None:
            self.telemetry.step_down(reason)
            self._ended_at = time.monotonic()
        self._epoch = None
        self._lost.set()

    async def wait_lost(self) -> None:
        """Return once leadership held by this instance is lost or released."""
        await self._lost.wait()

    async def acquire(self) -> int:
        """Wait until this instance leads; returns the new epoch.

        A session already held is closed first: each acquisition is a new term with a new
        epoch. When a term of this instance ended (lost, or released), it first waits what
        is left of :func:`cool_down` since then, so that a waiting standby leads instead;
        not when this instance still leads (it renews its own term). While the database is
        unreachable, retries and logs each failure, pausing as
        :func:`~cronoq_store._retry.acquisition_backoff` says: never longer than
        ``lock_poll``, so once the server is back this instance leads (if nobody else does)
        within ``session_timeout + lock_poll``, or at the cool-down's end if that is later.
        Errors that retrying cannot fix are raised as ``StoreError``.
        """
        async with self._acquiring:
            self._check_open()
            renewing = self.is_leader
            if self._session is not None:
                await self.release()
            if not renewing:
                await self._cool_down()
            session, epoch = await _AcquisitionRetry(self).run(self._attempt_lead)
            self._epoch = epoch
            self._lost.clear()
            self._session = session
            self._keeper = asyncio.ensure_future(self._keep(session, epoch))
            logger.info(
                "acquired leadership",
                extra={"epoch": epoch, "schema": self._schema, "instance": self.instance},
            )
            return epoch

    async def release(self) -> None:
        """Give up leadership: the lock session is closed, so the server releases the lock."""
        self.mark_lost("released")
        await self._end_term()

    async def close(self) -> None:
        """Release leadership, stop any acquisition in progress and free the engine."""
        self._closing.set()
        self.mark_lost("closed")
        async with self._acquiring:  # an acquisition in progress notices and gives up
            await self._end_term()
            await self._engine.dispose()

    # --- internals ------------------------------------------------------------------------

    async def _cool_down(self) -> None:
        """Wait what is left of :func:`cool_down` since the last term ended, if any."""
        if self._ended_at is None:
            return
        left = self._ended_at + cool_down(self._config) - time.monotonic()
        if left <= 0:
            return
        logger.info(
            "waiting %.1f s before competing for leadership again, so that a waiting standby "
            "leads first",
            left,
            extra={"schema": self._schema, "instance": self.instance},
        )
        if await self._closed_within(left):
            raise self._closed_error()

    async def _attempt_lead(self) -> tuple[LockSession, int]:
        """One attempt at the lock (:meth:`_try_lead`), every failure translated."""
        async with door.translated("acquiring leadership"):
            return await self._try_lead()

    async def _try_lead(self) -> tuple[LockSession, int]:
        """Open a lock session and poll for the lock; returns the session and the new epoch."""
        timeout = self._config.session_timeout
        session = await LockSession.open(self._db, timeout)
        try:
            if self._apply_settings:
                await session.apply_settings(self._settings, timeout)
            if self._connect is not None:
                await self._refuse_untrusted_connect(session, self._connect, timeout)
            await self._read_key(session, timeout)
            polls, suspect, seen_held = 0, None, None
            while True:
                taken, held_since = await session.try_lock(self._key, timeout)
                if taken:
                    break
                seen_held = held_since
                if polls % _HOLDER_CHECK_POLLS == 0:
                    suspect = await self._watch_holder(session, suspect, timeout)
                polls += 1
                if await self._closed_within(self._config.lock_poll):
                    raise self._closed_error()
            if self._trust is not None:
                await self._vet(session, self._trust, timeout)
            epoch = await self._bump(session, timeout, seen_held)
            if epoch is None:
                await self._refuse_to_bump(session, timeout)
            # The keeper's check waits for no lock for long, and is prepared now, so that
            # each of its checks is a single round trip.
            await session.set_lock_timeout(_keeper_lock_timeout_ms(self._config), timeout)
            await session.leader_row(timeout)
            return session, epoch
        except BaseException:
            await session.close()  # releases the lock if this session took it
            raise

    async def _bump(
        self, session: LockSession, timeout: float, seen_held: datetime | None
    ) -> int | None:
        """Bump the epoch (``None``: no leader row) in a transaction that first takes
        :data:`~cronoq_store._statements.leader_barrier`: the bump waits for the commits in
        flight, and those that arrive meanwhile wait for it, so overlapping commits of a
        deposed leader cannot starve the takeover (they would pass a waiting row lock).
        The server gives up waiting at half ``timeout``, before this session is taken for
        silent: the ``LockHeldError`` names who holds the leader table, and the acquisition
        logs it and tries again."""
        async with session.takeover(timeout):
            await session.leader_barrier(
                self._schema, timeout / 2, "taking over leadership", timeout
            )
            epoch = await session.bump_epoch(self._incarnation, timeout)
            if epoch is not None:
                await session.record_term(epoch, seen_held, timeout)
        return epoch

    async def _read_key(self, session: LockSession, timeout: float) -> None:
        """Read the lock's second key, the schema's OID, now: ``pg_upgrade`` gives a schema
        another OID, and every instance opened since takes the lock with that one. A schema
        that is gone is a cluster gone: ``SchemaGoneError``, no lock to wait for."""
        oid = await session.schema_oid(self._schema, timeout)
        if oid is None:
            raise SchemaGoneError(
                f"acquiring leadership failed: schema {self._schema!r} does not exist (dropped "
                "while this store was open): this store cannot lead it; once it is migrated "
                "again, open a new store"
            )
        self._key["k2"] = oid

    async def _refuse_to_bump(self, session: LockSession, timeout: float) -> NoReturn:
        """Raise why the bump found no leader row to move: none in the schema, the row of
        another cluster than the store's (``ClusterReplacedError``), or a cluster enrolled in
        a host group (``ClusterHostedError``: a host leads it without the lock). The caller
        closes the session, which releases the lock; no epoch was taken."""
        found = await session.leader_enrolment(timeout)
        if found is None:
            raise StoreError(
                f"the leader row of schema {self._schema!r} is missing: run the migrations"
            )
        if found.tableoid != self._incarnation:
            self.replaced = ClusterReplacedError(
                self._schema, self._incarnation, found.tableoid, "acquiring leadership"
            )
            raise self.replaced
        if found.host_group is not None:
            raise ClusterHostedError(self._schema, found.host_group, "acquiring leadership")
        # Enrolled when the bump ran, removed from its group since: the next attempt bumps.
        raise UnavailableError(
            f"acquiring leadership of schema {self._schema!r}: the cluster left its host "
            "group while this instance took the lock; trying again"
        )

    async def _vet(self, session: LockSession, trust: TrustCheck, timeout: float) -> None:
        """Refuse to lead a schema that fails the trust check, before the epoch bump: its
        UPDATE of the leader row runs any trigger planted there since the store opened."""
        found = await session.findings(trust.statement, trust.params, timeout)
        if found:
            raise trust.refusal(found, await session.current_user(timeout))

    async def _refuse_untrusted_connect(
        self, session: LockSession, check: ConnectCheck, timeout: float
    ) -> None:
        """Refuse to wait for the lock where roles the store does not trust may connect:
        any of them could hold it forever. A warning instead with allow_untrusted_connect."""
        found = await session.findings(check.statement, check.params, timeout)
        if not found:
            return
        database = await session.current_database(timeout)
        me = await session.current_user(timeout)
        refusal = check.refusal(found, database, me)
        if not self._config.allow_untrusted_connect:
            raise refusal
        logger.warning(
            "leading although untrusted roles may connect (allow_untrusted_connect=True): "
            "any of them can hold the leader lock and stop every instance from leading",
            extra={"schema": self._schema, "database": database, "roles": list(found)},
        )

    async def _watch_holder(
        self, session: LockSession, suspect: int | None, timeout: float
    ) -> int | None:
        """Look at who holds the lock this standby waits for. A store instance: say so at
        INFO when it changes (another pid or epoch), and every ``_WAITING_INTERVAL``. Not a
        store instance: warn (at most every ``_FOREIGN_WARNING_INTERVAL``) once it was seen
        twice, a check apart (a takeover is an instance before its epoch bump). Returns the
        pid of a foreign holder seen now, for the next check."""
        keys = lock_keys((self._key["k1"], self._key["k2"]))
        holder, held_epoch = await session.lock_holder(keys, timeout)
        now = asyncio.get_running_loop().time()
        if holder is None:
            return None
        if holder.store_instance:
            behind = (holder.pid, held_epoch)
            if behind != self._waiting_behind or now - self._said_waiting_at >= _WAITING_INTERVAL:
                self._waiting_behind, self._said_waiting_at = behind, now
                logger.info(
                    "waiting for the leader lock of schema %r: the leader at epoch %d is pid "
                    "%d (role %r, application %r, session since %s)",
                    self._schema,
                    held_epoch,
                    holder.pid,
                    holder.role,
                    holder.application_name,
                    "an unknown time" if holder.since is None else holder.since.isoformat(),
                    extra={"schema": self._schema, "epoch": held_epoch, **_holder_fields(holder)},
                )
            return None
        recent = self._warned_at is not None and now - self._warned_at < _FOREIGN_WARNING_INTERVAL
        if holder.pid == suspect and not recent:
            self._warned_at = now
            logger.warning(
                "waiting for the leader lock, held by pid %d (role %r), a session that is not "
                "a store instance: no instance can lead until it lets go",
                holder.pid,
                holder.role,
                extra={"schema": self._schema, **_holder_fields(holder)},
            )
        return holder.pid

    async def _keep(self, session: LockSession, epoch: int) -> None:
        """Read the leader row on the session every ``keepalive``; step down once the
        session was silent too long, or at once when the row says this term is over.

        Silence is measured from the last answer, so the step-down comes at most
        ``session_timeout`` after the session went silent, whatever the check interval. A
        check that waited too long for a lock on the leader table (55P03, under the
        ``lock_timeout`` set at acquisition) is an answer that tells nothing of the row.
        """
        loop = asyncio.get_running_loop()
        keepalive, limit = self._config.keepalive, self._config.session_timeout
        last_answer = loop.time()
        try:
            while not await self._lost_within(keepalive):
                try:
                    row = await session.check_leader(last_answer + limit - loop.time())
                except StoreError as error:
                    if self._epoch != epoch:  # already released or marked lost
                        return
                    if isinstance(error, door.LockNotAvailable):
                        last_answer = loop.time()
                        continue
                    if isinstance(error, SchemaGoneError):
                        # The leader table (or its schema) is gone: so is this cluster,
                        # whatever stands under the name later.
                        self.replaced = ClusterReplacedError(
                            self._schema, self._incarnation, None, "checking the leader row"
                        )
                        self._step_down(epoch, "schema_gone", str(error))
                    else:
                        self._step_down(epoch, "session_lost", str(error))
                    return
                last_answer = loop.time()
                ended = self._term_ended(epoch, row)
                if ended is not None and self._epoch == epoch:
                    self._step_down(epoch, *ended)
                    return
        finally:
            await session.close()

    def _term_ended(self, epoch: int, row: LeaderRow | None) -> tuple[str, str] | None:
        """Why the leader row ``row`` (:data:`~cronoq_store._statements.leader_now`)
        ends the term of ``epoch`` (a step-down reason and words), or ``None`` if it does
        not."""
        if row is None:
            # The table stands without its row: this cluster's row is gone, as when its table
            # is (a restore's tables are made before their rows are loaded, under a new OID):
            # later writes must say the cluster was replaced, not merely fenced.
            self.replaced = ClusterReplacedError(
                self._schema, self._incarnation, None, "checking the leader row"
            )
            return "schema_gone", str(self.replaced)
        if row.tableoid != self._incarnation:
            self.replaced = ClusterReplacedError(
                self._schema, self._incarnation, row.tableoid, "checking the leader row"
            )
            return "cluster_replaced", str(self.replaced)
        if row.epoch != epoch:
            return "fenced", f"the stored epoch is {row.epoch}: another instance took over"
        return None

    def _step_down(self, epoch: int, reason: str, why: str) -> None:
        """The keeper ends the term of ``epoch``; its caller then closes the session."""
        self.mark_lost(reason)
        logger.error(
            _STEP_DOWNS[reason],
            extra={"epoch": epoch, "schema": self._schema, "reason": reason, "error": why},
        )

    async def _end_term(self) -> None:
        """Stop the keeper of the current or last term and close its session."""
        keeper, self._keeper = self._keeper, None
        session, self._session = self._session, None
        if keeper is not None:
            keeper.cancel()
            await asyncio.wait({keeper})
        if session is not None:
            # Also when the keeper was cancelled before it ever ran.
            await session.close()

    async def _lost_within(self, seconds: float) -> bool:
        """Whether leadership is marked lost within ``seconds`` (a sleep that wakes early)."""
        return await pause(seconds, self._lost)

    def _log_retry(self, error: StoreError, failures: int, pause: float) -> None:
        logger.warning(
            "cannot acquire leadership for now (transient: see error); retrying",
            extra={
                "schema": self._schema,
                "url": redact(self._url),
                "via": self._via,
                "error": str(error),
                "retry_in": round(pause, 3),
            },
        )

    async def _closed_within(self, seconds: float) -> bool:
        return await pause(seconds, self._closing)

    def _check_open(self) -> None:
        if self._closing.is_set():
            raise self._closed_error()

    def _closed_error(self) -> StoreError:
        return StoreError(f"leadership of schema {self._schema!r} is closed")


def _keeper_lock_timeout_ms(config: PgStoreConfig) -> int:
    """How long the keeper's check may wait for a lock on the leader table: at most a
    ``keepalive``, and half of what is left of ``session_timeout`` after one, so the check
    answers (with 55P03) well before its silence could read as a lost session."""
    wait = min(config.keepalive, (config.session_timeout - config.keepalive) / 2)
    return max(1, round(wait * 1000))


class _AcquisitionRetry(Retry):
    """Acquisition's retry policy: every failure (translated by the attempt), the transient
    ones retried (each logged) until the leadership is closed, however many fail in a row."""

    def __init__(self, leadership: Leadership) -> None:
        super().__init__(leadership._backoff)
        self._leadership = leadership

    async def next_pause(self, error: StoreError, failures: int) -> float:
        delay = await super().next_pause(error, failures)
        self._leadership._log_retry(error, failures, delay)
        return delay

    async def wait(self, seconds: float, error: StoreError) -> None:
        if await self._leadership._closed_within(seconds):
            raise self._leadership._closed_error() from error


def _holder_fields(holder: LockHolder) -> dict[str, object]:
    """A lock holder as a log record's fields."""
    return {
        "holder_pid": holder.pid,
        "holder_role": holder.role,
        "holder_application_name": holder.application_name,
        "holder_since": None if holder.since is None else holder.since.isoformat(),
    }
