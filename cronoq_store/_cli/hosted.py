"""What ``status`` and ``health`` say of a cluster a host group leads (``PgHost``).

An enrolled cluster (its leader row's ``host_group`` set) has no advisory lock of its own:
its owner is the host process its control row names, and that owner is live exactly while
a session holds the process's lock ``(LOCK_NS_HOST, process_id)``. The cluster's own
standalone key stays free; a session holding it blocks every claim. A schema whose leader
table has no ``host_group`` column (a revision before ``0009_host_group``) is standalone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import click
from sqlalchemy.ext.asyncio import AsyncConnection

from .. import _catalog as catalog
from .. import _door as door
from .._config import validate_schema_name
from .._errors import MigrationError, StoreError
from .._host import control
from .._host.move import ARRIVING_MARK, MOVED_MARK, MOVING_MARK
from .._migrations import RevisionStatus
from .._queries import ClusterFacts
from .._results import LockHolder
from .._trust import refuse_untrusted
from . import output
from .exits import ExitCode

__all__ = [
    "CONTROL_SCHEMA_ENV",
    "DEFAULT_CONTROL_SCHEMA",
    "HostFacts",
    "HostRows",
    "Process",
    "control_schema_option",
    "host_document",
    "host_group",
    "hosted_verdict",
    "leader_words",
    "no_leader",
    "read_host",
    "read_hosts",
    "status_facts",
]

#: The environment variable that names the control schema when ``--control-schema`` is not
#: given.
CONTROL_SCHEMA_ENV = "CRONOQ_CONTROL_SCHEMA"

#: The control schema unless ``--control-schema`` names another (``PgHostConfig``'s default).
DEFAULT_CONTROL_SCHEMA = control.DEFAULT_CONTROL_SCHEMA

_C = TypeVar("_C", bound=Callable[..., Any])

#: The marks ``host move`` leaves in a leader row (no group can be named so), by what the
#: cluster's copy there is: frozen in the source, copied to the target not enrolled yet,
#: the source's tombstone.
_MOVE_MARKS = {MOVING_MARK: "moving", ARRIVING_MARK: "arriving", MOVED_MARK: "moved"}


def _check_control(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        return validate_schema_name(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def control_schema_option(command: _C) -> _C:
    """``--control-schema NAME``: where the host groups of this database keep their
    processes and clusters (``PgHostConfig.control_schema``)."""
    return click.option(
        "--control-schema",
        "control_schema",
        envvar=CONTROL_SCHEMA_ENV,
        show_envvar=True,
        default=control.DEFAULT_CONTROL_SCHEMA,
        show_default=True,
        callback=_check_control,
        metavar="NAME",
        help="The host groups' control schema (PgHostConfig.control_schema): where a hosted "
        "cluster's owner is read.",
    )(command)


@dataclass(frozen=True, slots=True)
class Process:
    """A host process as its control row records it; ``lock_pid`` is the session holding
    its process lock now (``None``: free, the process is not live)."""

    process_id: int
    instance: str
    backend_pid: int
    role: str
    application_name: str
    joined_at: datetime
    state: str
    lock_pid: int | None

    @property
    def live(self) -> bool:
        return self.lock_pid is not None

    def words(self) -> str:
        return (
            f"host process {self.process_id} (instance {self.instance}, backend pid "
            f"{self.backend_pid}, {self.application_name!r})"
        )

    def document(self) -> dict[str, object]:
        return {
            "process_id": self.process_id,
            "instance": self.instance,
            "backend_pid": self.backend_pid,
            "role": self.role,
            "application_name": self.application_name,
            "joined_at": output.rfc3339(self.joined_at),
            "state": self.state,
            "live": self.live,
            "lock": [control.LOCK_NS_HOST, self.process_id],
            "lock_held_by_pid": self.lock_pid,
        }


@dataclass(frozen=True, slots=True)
class HostFacts:
    """A hosted cluster's control row (``enrolled`` false when the control schema holds
    none for it) and its owner, or the process that released it last."""

    group: str
    control_schema: str
    enrolled: bool = False
    #: The control schema's group for this schema, when it differs from the leader row's.
    control_group: str | None = None
    state: str | None = None
    refused_why: str | None = None
    #: The cluster the control row enrolled (its leader table's OID then).
    incarnation: int | None = None
    owner: int | None = None
    epoch: int | None = None
    since: datetime | None = None
    released_at: datetime | None = None
    #: The owner, or unowned the process that released the cluster last.
    process: Process | None = None
    #: Why the control schema could not be read (missing, refused by the trust check).
    unreadable: str | None = None
    #: ``moving``, ``arriving`` or ``moved`` when the leader row carries a ``host move``'s
    #: mark: ``group`` is then the control row's group ("" without one), never the mark.
    move: str | None = None

    @property
    def owner_process(self) -> Process | None:
        """The owning process, ``None`` when the cluster is unowned."""
        return self.process if self.owner is not None else None

    @property
    def live_owner(self) -> Process | None:
        """The owning process when its process lock is held: the cluster is led."""
        owner = self.owner_process
        return owner if owner is not None and owner.live else None

    def since_words(self) -> str:
        return output.moment_words(self.since)

    def mode_words(self) -> str:
        if self.move is not None:
            group = f", group {self.group}" if self.group else ""
            return f"hosted ({self.move} by `cronoq-store host move`{group})"
        return f"hosted (group {self.group})"


def host_group(facts: ClusterFacts | None) -> str | None:
    """The host group the cluster's leader row names (``None``: standalone, or a revision
    without the column, which reads as standalone)."""
    return None if facts is None else facts.hosted_by


def _process(row: Any) -> Process | None:
    if row.process_id is None:
        return None
    return Process(
        process_id=int(row.process_id),
        instance=row.process_instance,
        backend_pid=int(row.process_backend_pid),
        role=row.process_role,
        application_name=row.process_application_name,
        joined_at=row.process_joined_at,
        state=row.process_state,
        lock_pid=None if row.lock_pid is None else int(row.lock_pid),
    )


async def _unreadable(
    conn: AsyncConnection, control_schema: str, vetted: set[str] | None
) -> str | None:
    """Why ``control_schema`` cannot be read (no host tables, or refused by the trust
    check), ``None`` once its trust check passed; ``vetted`` as for :func:`read_host`."""
    exists = (
        await conn.execute(catalog.relation_exists, {"schema": control_schema, "name": "clusters"})
    ).scalar()
    if not exists:
        await conn.rollback()
        return f"control schema {control_schema!r} holds no host tables (another --control-schema?)"
    if vetted is None or control_schema not in vetted:
        try:
            await conn.run_sync(
                lambda sync: refuse_untrusted(sync, control_schema, tables=control.CONTROL_TABLES)
            )
        except MigrationError as exc:
            await conn.rollback()
            return f"refused: {exc}"
        if vetted is not None:
            vetted.add(control_schema)
    return None


def _facts(row: Any, group: str, control_schema: str) -> HostFacts:
    """A cluster's :class:`HostFacts` from its control row (:data:`control.cluster_host`'s
    columns; ``None``: not enrolled there). ``group`` is the leader row's: a move's mark
    names no group, so the control row's is shown instead."""
    move = _MOVE_MARKS.get(group)
    if move is not None:
        group = "" if row is None else row.host_group
    if row is None:
        return HostFacts(group, control_schema, move=move)
    return HostFacts(
        group,
        control_schema,
        move=move,
        enrolled=True,
        control_group=None if row.host_group == group else row.host_group,
        state=row.state,
        refused_why=row.refused_why,
        incarnation=int(row.incarnation),
        owner=None if row.owner is None else int(row.owner),
        epoch=None if row.epoch is None else int(row.epoch),
        since=row.since,
        released_at=row.released_at,
        process=_process(row),
    )


def _unreadable_facts(group: str, control_schema: str, unreadable: str) -> HostFacts:
    """The facts of a cluster whose control schema could not be read: a move's mark in the
    leader row still says what the cluster is, though no group can be shown."""
    move = _MOVE_MARKS.get(group)
    return HostFacts("" if move else group, control_schema, unreadable=unreadable, move=move)


async def read_host(
    conn: AsyncConnection,
    schema: str,
    group: str,
    control_schema: str,
    vetted: set[str] | None = None,
) -> HostFacts:
    """The control row of ``schema`` enrolled in ``group``, read in ``control_schema`` after
    its trust check; a missing or refused control schema is said in ``unreadable``.

    ``vetted``: the control schemas whose trust check passed already in this command (a
    command over many clusters checks its control schema once, not once per cluster);
    one that passes here is added."""
    rows, unreadable = await _control_rows(
        conn, control.cluster_host, {"schema": schema}, control_schema, vetted
    )
    if unreadable is not None:
        return _unreadable_facts(group, control_schema, unreadable)
    return _facts(rows[0] if rows else None, group, control_schema)


async def _control_rows(
    conn: AsyncConnection,
    statement: Any,
    params: Mapping[str, object],
    control_schema: str,
    vetted: set[str] | None,
) -> tuple[Sequence[Any], str | None]:
    """The rows of ``statement`` in ``control_schema`` after its trust check, or why they
    could not be read: missing, refused, or out of this role's reach (no ``USAGE`` on the
    schema, no ``SELECT``). A role that may read the clusters and not the control schema
    sees each hosted one with its owner unknown, rather than an error for the whole page or
    command. A transient failure is raised as any other."""
    try:
        async with door.translated("reading the host control schema"):
            unreadable = await _unreadable(conn, control_schema, vetted)
            if unreadable is not None:
                return [], unreadable
            found = await conn.execute(
                statement, params, execution_options=control.control_options(control_schema)
            )
            rows = found.all()
    except StoreError as error:
        if error.is_transient:
            raise
        await conn.rollback()
        return [], str(error)
    await conn.rollback()
    return rows, None


@dataclass(frozen=True, slots=True)
class HostRows:
    """The control rows of many clusters read at once (:func:`read_hosts`), by schema."""

    control_schema: str
    rows: Mapping[str, Any]
    #: Why the control schema could not be read (as :attr:`HostFacts.unreadable`).
    unreadable: str | None = None

    def facts(self, schema: str, group: str) -> HostFacts:
        """What :func:`read_host` would say of ``schema``, whose leader row names ``group``."""
        if self.unreadable is not None:
            return _unreadable_facts(group, self.control_schema, self.unreadable)
        return _facts(self.rows.get(schema), group, self.control_schema)


async def read_hosts(
    conn: AsyncConnection, schemas: Sequence[str], control_schema: str
) -> HostRows:
    """The control rows of ``schemas`` in ``control_schema``, after its trust check: one
    statement for all of them (a page of the console's overview), where :func:`read_host`
    for each would cost one per cluster."""
    rows, unreadable = await _control_rows(
        conn, control.cluster_hosts, {"schemas": list(schemas)}, control_schema, None
    )
    if unreadable is not None:
        return HostRows(control_schema, {}, unreadable)
    return HostRows(control_schema, {row.schema_name: row for row in rows})


def _unowned_words(host: HostFacts) -> str:
    """Why a hosted cluster has no leader, naming its last owner when the control schema
    knows it."""
    last = host.process
    said = "no live host process owns it"
    if last is None:
        return f"{said}; no owner recorded (never claimed, or its last owner died)"
    owner = f"{said}; last owner {last.words().removeprefix('host ')}, owner since "
    if host.owner is not None:
        return f"{owner}{host.since_words()}: its process lock is free (the process is gone)"
    released = output.moment_words(host.released_at)
    return f"{owner}{host.since_words()}, released it {released}"


def no_leader(host: HostFacts) -> str | None:
    """Why a hosted cluster has no leader now, ``None`` when a live host process owns it."""
    if host.move is not None:
        return _move_words(host)
    if host.unreadable is not None:
        return f"enrolled in host group {host.group}, but {host.unreadable}"
    if not host.enrolled:
        return (
            f"enrolled in host group {host.group}, but control schema {host.control_schema} "
            "holds no row for it (another --control-schema?)"
        )
    if host.control_group is not None:
        return (
            f"the leader row names host group {host.group}, the control schema "
            f"{host.control_group}: no host process of either group claims it"
        )
    if host.state == "refused":
        return (
            f"host group {host.group} refuses to lead it: {host.refused_why or 'no reason given'} "
            "(once that is fixed, `cronoq-store host enroll` it again)"
        )
    if host.live_owner is None:
        return _unowned_words(host)
    return None


def _move_words(host: HostFacts) -> str:
    """Why no host process leads a copy ``host move`` marked, and what to do; where it
    goes from the control row's note (the target's URL, password hidden)."""
    note = host.refused_why or "no control row says where"
    if host.move == "moving":
        return (
            f"frozen by `cronoq-store host move` ({note}): nothing leads it until the move "
            "ends; run the move again to finish it"
        )
    if host.move == "arriving":
        return (
            "a copy `cronoq-store host move` is bringing here, not enrolled yet: run the move "
            "again to finish it"
        )
    return (
        f"a tombstone `cronoq-store host move` left ({note}): the cluster is led where it "
        "went; drop this schema once it is no longer needed"
    )


def hosted_verdict(
    revision: RevisionStatus,
    facts: ClusterFacts | None,
    holder: LockHolder | None,
    host: HostFacts,
) -> tuple[ExitCode, list[str], list[str]]:
    """``health``'s exit code, reasons and warnings for a hosted cluster: 4 or 5 for the
    revision as for any; 7 when a session holds the cluster's standalone key (it blocks
    every claim), unless it is the owner's host session claiming; 6 when no live host
    process owns it (the refused state and its reason among the reasons); 1 when the
    control schema could not be read, so that who leads it is unknown."""
    codes: list[ExitCode] = []
    reasons: list[str] = []
    warnings: list[str] = []
    if not revision.at_head:
        codes.append(ExitCode.NEWER_DATABASE if revision.unknown else ExitCode.NOT_MIGRATED)
        reasons.append(
            f"schema {revision.schema} is {revision.describe()} (this build's head is "
            f"{revision.head})"
        )
    owner = host.live_owner
    claiming = holder is not None and owner is not None and holder.pid == owner.lock_pid
    if holder is not None and not claiming:
        codes.append(ExitCode.FOREIGN_HOLDER)
        reasons.append(
            f"{output.describe_session(holder)} holds the cluster's standalone leader lock, "
            f"which a hosted cluster keeps free: no host process can claim it until that "
            "session lets go"
        )
    missing = no_leader(host)
    if missing is not None and host.unreadable is not None and host.move is None:
        # Who leads it is unknown, not "nobody": a role without a grant on the control
        # schema must not report every hosted cluster leaderless.
        codes.append(ExitCode.FAILED)
        reasons.append(f"cannot tell which host process leads it: {missing}")
    elif missing is not None:
        codes.append(ExitCode.NO_LEADER)
        reasons.append(missing)
    stored = None if facts is None else facts.incarnation
    if host.incarnation is not None and stored is not None and stored != host.incarnation:
        # A claim bumps the epoch only in the cluster enrolled: no process leads this one.
        if missing is None:
            codes.append(ExitCode.NO_LEADER)
        reasons.append(
            f"the schema holds another cluster (incarnation {stored}) than the one enrolled "
            f"(incarnation {host.incarnation}): no host process can claim it; enroll it "
            "again (`cronoq-store host enroll`) to have the group lead the one there now"
        )
    if (
        owner is not None
        and facts is not None
        and host.epoch is not None
        and facts.stored_epoch != host.epoch
    ):
        warnings.append(
            f"the stored epoch is {facts.stored_epoch}, the control row's {host.epoch}: the "
            "epoch moved outside the host group (a removal, or a claim under way)"
        )
    return (codes[0] if codes else ExitCode.OK), reasons, warnings


def leader_words(host: HostFacts) -> str:
    """The hosted leader in a line (``status``, ``health``, over many clusters)."""
    owner = host.live_owner
    if owner is None:
        return "none: no live host process owns it"
    return (
        f"host process {owner.process_id}, instance {owner.instance}, backend pid "
        f"{owner.backend_pid}"
    )


def status_facts(
    host: HostFacts, holder: LockHolder | None, standalone_lock: str
) -> list[tuple[str, str]]:
    """A hosted cluster's mode, leader and standalone lock as ``status`` prints them."""
    facts = [("mode", f"{host.mode_words()}, control schema {host.control_schema}")]
    owner = host.live_owner
    if owner is not None:
        facts += [
            (
                "leader",
                f"host process {owner.process_id}, instance {owner.instance}, backend pid "
                f"{owner.backend_pid}, {owner.application_name!r}",
            ),
            ("", f"since {host.since_words()}, epoch {host.epoch}"),
            (
                "",
                f"its process lock ({control.LOCK_NS_HOST}, {owner.process_id}) is held "
                f"(backend pid {owner.lock_pid})",
            ),
        ]
    else:
        facts.append(("leader", f"none: {no_leader(host) or _unowned_words(host)}"))
    if host.state == "refused" and owner is not None:
        facts.append(("refused", host.refused_why or "no reason given"))
    if holder is None:
        facts.append(("standalone lock", f"free ({standalone_lock}; a hosted cluster keeps it so)"))
    else:
        facts.append(
            (
                "standalone lock",
                f"held by {output.describe_session(holder)}: it blocks every claim of this cluster",
            )
        )
    return facts


def host_document(host: HostFacts, holder: LockHolder | None) -> dict[str, object]:
    """``"host"`` of ``status --json`` and ``health --json`` for a hosted cluster."""
    return {
        "group": host.group,
        "control_schema": host.control_schema,
        "enrolled": host.enrolled,
        "control_group": host.control_group,
        "state": host.state,
        "refused_why": host.refused_why,
        "incarnation": host.incarnation,
        "owner": host.owner,
        "live": host.live_owner is not None,
        "epoch": host.epoch,
        "since": output.rfc3339(host.since),
        "released_at": output.rfc3339(host.released_at),
        "process": None if host.process is None else host.process.document(),
        "standalone_lock_holder": output.session_document(holder),
        "unreadable": host.unreadable,
        "move": host.move,
    }
