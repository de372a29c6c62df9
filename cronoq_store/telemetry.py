"""OpenTelemetry metrics and traces: the one module that knows OpenTelemetry.

Everything goes through the OpenTelemetry API (the ``otel`` extra). A store records only
when it has somewhere to record to: at open it takes the global providers, and when the API
is not installed, or installed with no provider configured, it gets :data:`DISABLED`,
whose ``enabled`` is ``False``; the commit path checks that one flag and does nothing more.
:func:`instrument` gives a store providers of its own (an application's, or a test's).

Attributes name the database the OpenTelemetry way (``db.system.name`` and the older
``db.system``: ``postgresql``; ``db.namespace``: the cluster's schema) and what the store
did (outcome, write path, step-down reason); never a payload, key, message or URL.
docs/observability.md lists every instrument.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from importlib import metadata
from typing import TYPE_CHECKING, Any, Protocol

from ._config import PgStoreConfig
from ._errors import FencedError, StoreError
from ._results import CommitterStats

try:
    from opentelemetry import metrics, trace
    from opentelemetry.metrics import CallbackOptions, Observation
except ImportError:  # pragma: no cover - the otel extra is not installed
    metrics = trace = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider


__all__ = [
    "DISABLED",
    "CommitRecord",
    "Committer",
    "Instrumentable",
    "Leader",
    "Telemetry",
    "instrument",
    "resolve",
]


class Leader(Protocol):
    """What the leadership gauges read (the store's leader lock): named here as a protocol so that
    this module, which the store and its paths import, imports none of them."""

    @property
    def epoch(self) -> int | None:
        """The fencing epoch held, or ``None`` before the first acquisition."""
        ...

    @property
    def is_leader(self) -> bool:
        """Whether the instance leads now."""
        ...


class Committer(Protocol):
    """What the queue-depth gauge reads (a ``GroupCommitter``)."""

    @property
    def closed(self) -> bool:
        """Whether the committer was closed (the gauge then forgets it)."""
        ...

    def stats(self) -> CommitterStats:
        """The committer's counters, read at each collection."""
        ...


class Instrumentable(Protocol):
    """What :func:`instrument` needs of a store (a ``PgStore``)."""

    @property
    def config(self) -> PgStoreConfig:
        """The store's configuration (its schema labels the instruments)."""
        ...

    def _use_telemetry(self, recorder: Telemetry) -> None: ...


#: The instrumentation scope's name: one meter and one tracer of that name per provider.
SCOPE = "cronoq_store"


def _package_version() -> str | None:
    try:
        return metadata.version("cronoq-store")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a bare source tree
        return None


#: The instrumentation scope's version: the package's, so a backend can tell which build
#: recorded what.
SCOPE_VERSION = _package_version()

# Histogram buckets: seconds from a sub-millisecond commit to a long recovery; rows per
# batch up to the committer's caps; bytes up to the largest commit (sizing.MAX_COMMIT_BYTES).
_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_ROWS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000)
_BYTES = tuple(float(4**n) for n in range(5, 14))


class CommitRecord:
    """What one commit tells its metrics; :meth:`PgStore.commit` fills it in as it learns."""

    __slots__ = ("mutations", "path", "size")

    def __init__(self, mutations: int) -> None:
        self.mutations = mutations
        #: Bytes as the store estimates them before sending; the write path it takes.
        self.size: int | None = None
        self.path: str | None = None


class Telemetry:
    """Records nothing: what a store has when there is nowhere to record to."""

    enabled = False

    def commit(self, mutations: int) -> AbstractContextManager[CommitRecord | None]:
        """Around one commit: yields the :class:`CommitRecord` that the commit fills in, or
        ``None`` where nothing is recorded (a shared no-op, so an unrecorded commit makes no
        object)."""
        return _UNRECORDED

    @contextmanager
    def recovery(self) -> Iterator[Callable[[int, int, int, int], None]]:
        """Yields ``loaded(live, finished, recurring, quarantined)``."""
        yield _ignore

    @contextmanager
    def prune(self) -> Iterator[Callable[[int], None]]:
        """Yields ``pruned(rows)``."""
        yield _ignore

    @contextmanager
    def acquisition(self) -> Iterator[None]:
        """Around one leadership acquisition, from the first try to the lock held."""
        yield

    def step_down(self, reason: str) -> None:
        """Leadership held was given up or lost: ``session_lost``, ``fenced``,
        ``schema_gone``, ``cluster_replaced``, ``released`` or ``closed``; a hosted
        cluster's also ``rebalanced`` or ``failed`` (docs/observability.md)."""

    def watch_leadership(self, leadership: Leader) -> None:
        """Report ``leadership`` in the is-leader and epoch gauges."""

    def watch_committer(self, committer: Committer) -> None:
        """Report ``committer``'s queue depth."""

    def batch_committed(self, mutations: int, ack_latencies: Iterable[float]) -> None:
        """A group committer's batch committed; each submission waited that long."""

    def retried(self) -> None:
        """A group committer retries a batch that failed transiently."""

    def split(self) -> None:
        """A group committer splits a batch that failed."""


def _ignore(*args: int) -> None:
    return None


_UNRECORDED: AbstractContextManager[None] = nullcontext()


#: The store's telemetry when there is nowhere to record to.
DISABLED = Telemetry()


class _Instruments:
    """One provider's instruments, shared by every store that records to it (an instrument
    created twice under one name keeps only its first callbacks)."""

    def __init__(self, meter: Any) -> None:
        """Every instrument, declared once. Long for a reason: a flat list of declarations
        (name, unit, description), no logic."""
        hist = meter.create_histogram
        self.commit_duration = hist(
            "cronoq.commit.duration",
            unit="s",
            description="Time PgStore.commit took, by outcome and write path",
            explicit_bucket_boundaries_advisory=_SECONDS,
        )
        self.commit_mutations = hist(
            "cronoq.commit.mutations",
            unit="{mutation}",
            description="Mutations per commit",
            explicit_bucket_boundaries_advisory=_ROWS,
        )
        self.commit_size = hist(
            "cronoq.commit.size",
            unit="By",
            description="Bytes per commit, as estimated before sending",
            explicit_bucket_boundaries_advisory=_BYTES,
        )
        self.batch_size = hist(
            "cronoq.committer.batch.size",
            unit="{mutation}",
            description="Mutations per batch the group committer committed",
            explicit_bucket_boundaries_advisory=_ROWS,
        )
        self.ack_latency = hist(
            "cronoq.committer.ack.duration",
            unit="s",
            description="From GroupCommitter.submit to its acknowledgement",
            explicit_bucket_boundaries_advisory=_SECONDS,
        )
        self.retries = meter.create_counter(
            "cronoq.committer.retries",
            unit="{retry}",
            description="Batches retried after a transient failure",
        )
        self.splits = meter.create_counter(
            "cronoq.committer.splits",
            unit="{split}",
            description="Batches split in two after a failure",
        )
        self.acquisitions = meter.create_counter(
            "cronoq.leadership.acquisitions",
            unit="{acquisition}",
            description="Leadership acquired",
        )
        self.acquisition_duration = hist(
            "cronoq.leadership.acquisition.duration",
            unit="s",
            description="From the start of acquire_leadership to leading",
            explicit_bucket_boundaries_advisory=_SECONDS,
        )
        self.step_downs = meter.create_counter(
            "cronoq.leadership.step_downs",
            unit="{step_down}",
            description="Leadership given up or lost, by reason",
        )
        self.recovery_duration = hist(
            "cronoq.recovery.duration",
            unit="s",
            description="Time PgStore.recover took",
            explicit_bucket_boundaries_advisory=_SECONDS,
        )
        self.recovery_rows = meter.create_counter(
            "cronoq.recovery.rows",
            unit="{row}",
            description="Rows recovery loaded, by kind (live, finished, recurring)",
        )
        self.quarantined = meter.create_counter(
            "cronoq.recovery.quarantined",
            unit="{row}",
            description="Undecodable live task rows recovery quarantined",
        )
        self.prune_rows = meter.create_counter(
            "cronoq.prune.rows", unit="{row}", description="Finished tasks pruned"
        )
        self.prune_duration = hist(
            "cronoq.prune.duration",
            unit="s",
            description="Time PgStore.prune took",
            explicit_bucket_boundaries_advisory=_SECONDS,
        )
        # Watched objects and their attributes, dropped when the object is gone.
        self.leaderships: weakref.WeakKeyDictionary[Leader, dict[str, str]] = (
            weakref.WeakKeyDictionary()
        )
        self.committers: weakref.WeakKeyDictionary[Committer, dict[str, str]] = (
            weakref.WeakKeyDictionary()
        )
        meter.create_observable_gauge(
            "cronoq.leadership.is_leader",
            callbacks=[self._is_leader],
            unit="1",
            description="1 while this instance leads the cluster, else 0",
        )
        meter.create_observable_gauge(
            "cronoq.leadership.epoch",
            callbacks=[self._epoch],
            unit="{epoch}",
            description="The fencing epoch while this instance leads",
        )
        meter.create_observable_gauge(
            "cronoq.committer.queue.depth",
            callbacks=[self._queue_depth],
            unit="{submission}",
            description="Submissions accepted by a group committer and not yet settled",
        )

    # Objects watched under the same attributes make one point each: the SDK keeps only the
    # last of several observations of one attribute set, which would report whichever object
    # came last (a standby's 0 beside its schema's leader; one of a host group's committers).

    def _is_leader(self, options: CallbackOptions) -> Iterable[Observation]:
        """1 for an attribute set while any object watched under it leads."""
        found = [(int(lead.is_leader), a) for lead, a in list(self.leaderships.items())]
        return _each(found, max)

    def _epoch(self, options: CallbackOptions) -> Iterable[Observation]:
        """The highest epoch held under an attribute set (no point while none leads)."""
        found = [(lead.epoch, a) for lead, a in list(self.leaderships.items())]
        return _each([(epoch, a) for epoch, a in found if epoch is not None], max)

    def _queue_depth(self, options: CallbackOptions) -> Iterable[Observation]:
        """Every open committer's pending submissions, summed per attribute set."""
        found = list(self.committers.items())
        return _each([(c.stats().pending_submissions, a) for c, a in found if not c.closed], sum)


def _each(
    found: Iterable[tuple[int, dict[str, str]]], combine: Callable[[list[int]], int]
) -> list[Observation]:
    """One observation per attribute set of ``found``, its values combined."""
    by_attrs: dict[tuple[tuple[str, str], ...], tuple[dict[str, str], list[int]]] = {}
    for value, attrs in found:
        by_attrs.setdefault(tuple(sorted(attrs.items())), (attrs, []))[1].append(value)
    return [Observation(combine(values), attrs) for attrs, values in by_attrs.values()]


# One set of instruments per meter provider.
_by_provider: weakref.WeakKeyDictionary[Any, _Instruments] = weakref.WeakKeyDictionary()


class _Recording(Telemetry):
    """Records to a meter provider, a tracer provider, or both, under ``labels`` (the
    cluster's schema as ``db.namespace``, or a host group as ``cronoq.host.group`` and its
    database's label as ``cronoq.host.database``); spans are named after ``target``."""

    enabled = True

    def __init__(
        self,
        labels: Mapping[str, str],
        target: str,
        meter_provider: MeterProvider | None,
        tracer_provider: Any,
    ) -> None:
        self._attrs = {"db.system.name": "postgresql", "db.system": "postgresql", **labels}
        self._target = target
        self._tracer = (
            None if tracer_provider is None else tracer_provider.get_tracer(SCOPE, SCOPE_VERSION)
        )
        self._m: _Instruments | None = None
        if meter_provider is not None:
            found = _by_provider.get(meter_provider)
            if found is None:
                found = _by_provider[meter_provider] = _Instruments(
                    meter_provider.get_meter(SCOPE, SCOPE_VERSION)
                )
            self._m = found

    def _span(self, operation: str) -> Any:
        if self._tracer is None:
            return nullcontext()
        return self._tracer.start_as_current_span(
            f"{operation} {self._target}",
            kind=trace.SpanKind.CLIENT,
            attributes={**self._attrs, "db.operation.name": operation},
            # An error's message may quote a key or a value (a unique violation's detail):
            # a failed span gets the error's type, never its text or traceback.
            record_exception=False,
            set_status_on_exception=False,
        )

    @contextmanager
    def _timed(self, operation: str) -> Iterator[dict[str, str]]:
        """Runs the block in a span; yields the attributes its metrics get (with
        ``error.type`` set, the span's too, when it fails)."""
        attrs = dict(self._attrs)
        with self._span(operation) as span:
            try:
                yield attrs
            except BaseException as exc:
                attrs["error.type"] = type(exc).__qualname__
                if span is not None:
                    span.set_attribute("error.type", attrs["error.type"])
                    span.set_status(trace.StatusCode.ERROR)
                raise

    @contextmanager
    def commit(self, mutations: int) -> Iterator[CommitRecord]:
        record = CommitRecord(mutations)
        started = time.perf_counter()
        outcome = "ok"
        try:
            with self._timed("commit") as attrs:
                yield record
        except FencedError:
            outcome = "fenced"
            raise
        except StoreError as exc:
            outcome = "transient" if exc.is_transient else "failed"
            raise
        except BaseException:
            outcome = "failed"
            raise
        finally:
            m = self._m
            if m is not None:
                attrs["cronoq.commit.outcome"] = outcome
                attrs["cronoq.commit.write_path"] = record.path or "none"
                m.commit_duration.record(time.perf_counter() - started, attrs)
                m.commit_mutations.record(record.mutations, self._attrs)
                if record.size is not None:
                    m.commit_size.record(record.size, self._attrs)

    @contextmanager
    def recovery(self) -> Iterator[Callable[[int, int, int, int], None]]:
        started = time.perf_counter()

        def loaded(live: int, finished: int, recurring: int, quarantined: int) -> None:
            if self._m is not None:
                kinds = (("live", live), ("finished", finished), ("recurring", recurring))
                for kind, rows in kinds:
                    self._m.recovery_rows.add(rows, {**self._attrs, "cronoq.row.kind": kind})
                self._m.quarantined.add(quarantined, self._attrs)

        with self._timed("recover") as attrs:
            try:
                yield loaded
            finally:
                if self._m is not None:
                    self._m.recovery_duration.record(time.perf_counter() - started, attrs)

    @contextmanager
    def prune(self) -> Iterator[Callable[[int], None]]:
        started = time.perf_counter()

        def pruned(rows: int) -> None:
            if self._m is not None:
                self._m.prune_rows.add(rows, self._attrs)

        with self._timed("prune") as attrs:
            try:
                yield pruned
            finally:
                if self._m is not None:
                    self._m.prune_duration.record(time.perf_counter() - started, attrs)

    @contextmanager
    def acquisition(self) -> Iterator[None]:
        started = time.perf_counter()
        with self._timed("acquire"):
            yield
        if self._m is not None:
            self._m.acquisitions.add(1, self._attrs)
            self._m.acquisition_duration.record(time.perf_counter() - started, self._attrs)

    def step_down(self, reason: str) -> None:
        if self._m is not None:
            self._m.step_downs.add(1, {**self._attrs, "cronoq.step_down.reason": reason})

    def watch_leadership(self, leadership: Leader) -> None:
        if self._m is not None:
            self._m.leaderships[leadership] = self._attrs

    def watch_committer(self, committer: Committer) -> None:
        if self._m is not None:
            self._m.committers[committer] = self._attrs

    def batch_committed(self, mutations: int, ack_latencies: Iterable[float]) -> None:
        m = self._m
        if m is not None:
            m.batch_size.record(mutations, self._attrs)
            for latency in ack_latencies:
                m.ack_latency.record(latency, self._attrs)

    def retried(self) -> None:
        if self._m is not None:
            self._m.retries.add(1, self._attrs)

    def split(self) -> None:
        if self._m is not None:
            self._m.splits.add(1, self._attrs)


def _configured(provider: Any, unset: Sequence[str]) -> Any:
    """``provider``, or ``None`` when it is the API's own stand-in (nothing configured)."""
    return None if type(provider).__name__ in unset else provider


def resolve(
    schema: str, meter_provider: MeterProvider | None = None, tracer_provider: Any = None
) -> Telemetry:
    """The telemetry of the cluster in ``schema``: the given providers, else the global
    ones if the application configured them, else :data:`DISABLED`."""
    return _resolved({"db.namespace": schema}, schema, meter_provider, tracer_provider)


def resolve_group(group: str, database: str | None = None) -> Telemetry:
    """The telemetry a ``PgHost`` records its clusters under (not exported), on the global
    providers: labelled ``cronoq.host.group``, never ``db.namespace``, so a group named
    like a schema never adds to that cluster's figures. ``database``, the label a
    ``MultiDatabaseHost`` gives the host's database, is ``cronoq.host.database``: one group's
    hosts in two databases are two series, and the label values stay as few as the
    databases."""
    labels = {"cronoq.host.group": group}
    if database is not None:
        labels["cronoq.host.database"] = database
    return _resolved(labels, f"host group {group}", None, None)


def _resolved(
    labels: Mapping[str, str],
    target: str,
    meter_provider: MeterProvider | None,
    tracer_provider: Any,
) -> Telemetry:
    if metrics is None:
        return DISABLED
    meter = meter_provider or _configured(
        metrics.get_meter_provider(), ("_ProxyMeterProvider", "NoOpMeterProvider")
    )
    tracer = tracer_provider or _configured(
        trace.get_tracer_provider(), ("ProxyTracerProvider", "NoOpTracerProvider")
    )
    if meter is None and tracer is None:
        return DISABLED
    return _Recording(labels, target, meter, tracer)


def instrument(
    store: Instrumentable,
    *,
    meter_provider: MeterProvider | None = None,
    tracer_provider: TracerProvider | None = None,
) -> Telemetry:
    """Make ``store`` record to these providers (the global ones for any not given), and
    return its telemetry. Group committers made afterwards record to them too.

    On a ``HostedStore`` it is the opt-in to one cluster's figures: a host records every
    cluster it leads under its host group, and a store instrumented in its ``lead``
    records under its own schema instead, with its term in the leadership gauges, for as
    long as the term lasts (docs/observability.md, "Hosted clusters").

    ``ImportError`` without the OpenTelemetry API (``pip install cronoq-store[otel]``).
    """
    if metrics is None:
        raise ImportError("cronoq_store.telemetry needs opentelemetry-api: cronoq-store[otel]")
    telemetry = resolve(store.config.schema, meter_provider, tracer_provider)
    store._use_telemetry(telemetry)
    return telemetry
