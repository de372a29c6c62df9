"""The console as a Starlette application: its pages, each beside its JSON document
(``?format=json``), read-only, behind :class:`~cronoq_store._console.security.Guard`.

Templates are Jinja2 with autoescaping on, and every value goes through
:func:`~cronoq_store._terminal_safe.visible` first (Jinja's ``finalize``), so neither markup nor
controls nor bidi overrides in a stored value reach the page as such.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup, escape
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .. import _door as door
from .._cli import operations, output
from .._cli.exits import CliError, ExitCode
from .._cli.hosted import DEFAULT_CONTROL_SCHEMA
from .._cli.prune import parse_duration
from .._config import validate_schema_name
from .._domain import I64_MAX, QUEUED, TaskStatus, clean_text
from .._errors import MigrationError, StoreError
from .._listing_statements import SAMPLE
from .._terminal_safe import visible, visible_block
from .._urls import scrub
from . import actions, reads
from .security import Credentials, Guard
from .source import POOL_SIZE, ClusterNotFound, Source

__all__ = ["OVERVIEWS_AT_ONCE", "console_app"]

_HERE = Path(__file__).resolve().parent
#: Values per filter, and characters per value, a query string may carry.
_MAX_VALUES = 20
_MAX_VALUE_CHARS = 1000
_CURSOR = re.compile(r"(-?[0-9]{1,19})\.([0-9]{1,19})")
_ID = re.compile(r"[0-9]{1,19}")
_CUTOFF = re.compile(r"-?[0-9]{1,19}")
_FORM = "application/x-www-form-urlencoded"
_MAX_FORM = 4096
#: Overview pages the console reads at once, as many as the connections it keeps: one
#: asked beyond them answers 503 at once (:meth:`_Console._busy`).
OVERVIEWS_AT_ONCE = POOL_SIZE

log = logging.getLogger("cronoq_store.console")


def _finalize(value: Any) -> Any:
    """Every ``{{ value }}``: ``None`` as a dash, text made visible (then autoescaped)."""
    if value is None:
        return "-"
    if isinstance(value, str) and not isinstance(value, Markup):
        return visible(value)
    return value


#: The statuses a badge colours; any other name (a newer build's) is shown uncoloured.
_COLOURED = frozenset([QUEUED, *(s.value for s in TaskStatus)])


def _status(name: str | None) -> Markup:
    """A status as a coloured badge that keeps its name as text, for readers who do not
    tell the colours apart; the colour is a class, since the policy forbids inline style."""
    if name is None:
        return Markup("-")
    kind = name if name in _COLOURED else "other"
    return Markup('<span class="status status-{}">{}</span>').format(kind, visible(name))


def _environment(refresh_seconds: int) -> Environment:
    env = Environment(
        loader=FileSystemLoader(_HERE / "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        finalize=_finalize,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    # Escaped here (Markup), so that finalize leaves its tabs and newlines alone.
    env.filters["block"] = lambda text: escape(visible_block(text))
    env.filters["duration"] = output.age_words
    env.filters["ns"] = output.duration_words
    env.filters["when"] = output.moment_words
    env.filters["retry_words"] = output.retry_words
    env.filters["status"] = _status
    env.filters["seconds"] = lambda seconds: output.duration_words(round(seconds * 1e9))
    env.filters["leaderless"] = operations.leaderless_words
    env.filters["as_json"] = lambda value: json.dumps(value, ensure_ascii=False)
    env.filters["thousands"] = lambda n: f"{n:,}"
    env.globals["refresh_seconds"] = refresh_seconds
    env.globals["statuses"] = reads.FINISHED_STATUSES
    env.globals["live_statuses"] = reads.LIVE_STATUSES
    env.globals["sample"] = SAMPLE
    return env


class _BadRequest(ValueError):
    """A query string the page cannot take: a 400 with the reason."""


def _values(request: Request, name: str) -> tuple[str, ...]:
    values = [v for v in request.query_params.getlist(name) if v != ""]
    if len(values) > _MAX_VALUES or any(len(v) > _MAX_VALUE_CHARS for v in values):
        raise _BadRequest(f"{name}: at most {_MAX_VALUES} values of {_MAX_VALUE_CHARS} characters")
    return tuple(clean_text(v) for v in values)


def _moment(request: Request, name: str) -> int | None:
    """A time filter (``2026-12-01T20:00``, ``...Z`` or with an offset; UTC when naive) as
    Unix ns."""
    text = request.query_params.get(name, "")
    if text == "":
        return None
    try:
        moment = datetime.fromisoformat(text.removesuffix("Z"))
    except ValueError:
        raise _BadRequest(f"{name}: not a date and time: {text[:40]!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    delta = moment - datetime(1970, 1, 1, tzinfo=timezone.utc)
    ns = (delta.days * 86400 + delta.seconds) * 10**9 + delta.microseconds * 1000
    if not -(2**63) <= ns <= I64_MAX:
        raise _BadRequest(f"{name}: out of range")
    return ns


def _filters(request: Request, statuses_known: tuple[str, ...]) -> operations.TaskFilters:
    statuses = tuple(s.lower() for s in _values(request, "status"))
    for status in statuses:
        if status not in statuses_known:
            raise _BadRequest(f"status: {status[:40]!r} is not one of {', '.join(statuses_known)}")
    return operations.TaskFilters(
        pools=_values(request, "pool"),
        statuses=statuses,
        kinds=_values(request, "kind"),
        tenants=_values(request, "tenant"),
        keys=_values(request, "key"),
        since_ns=_moment(request, "since"),
        until_ns=_moment(request, "until"),
    )


def _before(request: Request) -> tuple[int, int] | None:
    """The finished list's keyset cursor: strictly older than ``(updated_unix_ns, id)``."""
    cursor = request.query_params.get("before", "")
    if not cursor:
        return None
    match = _CURSOR.fullmatch(cursor)
    if match is None or not all(-(2**63) <= int(g) <= I64_MAX for g in match.groups()):
        raise _BadRequest("before: not a cursor this page gave")
    return (int(match.group(1)), int(match.group(2)))


def _after(request: Request) -> int | None:
    """The live list's keyset cursor: after this id."""
    cursor = request.query_params.get("after", "")
    if not cursor:
        return None
    if _ID.fullmatch(cursor) is None or int(cursor) > I64_MAX:
        raise _BadRequest("after: not a cursor this page gave")
    return int(cursor)


def _paged(doc: dict[str, Any], request: Request, cursor: str, dropped: tuple[str, ...]) -> None:
    """A list's links: the same filters one page on (``cursor`` set to the page's ``next``),
    and back to the first page when this one is not it."""
    items = [(k, v) for k, v in request.query_params.multi_items() if k not in dropped]
    kept = [(k, v) for k, v in items if k != cursor]
    doc["next_url"] = None if doc["next"] is None else _query([*kept, (cursor, doc["next"])])
    doc["first_url"] = _query(kept) if request.query_params.get(cursor) else None


def _name_cursor(request: Request, name: str) -> str | None:
    """The overview's keyset cursor: a schema name the page gave."""
    cursor = request.query_params.get(name, "")
    if not cursor:
        return None
    if "\0" in cursor or len(cursor.encode("utf-8", "replace")) > reads.NAME_BYTES:
        raise _BadRequest(f"{name}: not a cursor this page gave")
    return clean_text(cursor)


def _schema(request: Request) -> str:
    try:
        return validate_schema_name(request.path_params["schema"])
    except ValueError:
        raise ClusterNotFound(request.path_params["schema"]) from None


def _ref(request: Request) -> output.IdRef | str:
    by_id, by_key = request.query_params.get("id"), request.query_params.get("key")
    if (by_id is None) == (by_key is None):
        raise _BadRequest("give one of id= and key=")
    if by_id is not None:
        try:
            parsed = output.parse_id(by_id.strip()[:40])
        except ValueError as exc:
            raise _BadRequest(f"id: {exc}") from None
        if parsed is None:
            raise _BadRequest(f"id: not a task id ({output.ID_FORMS}): {by_id[:40]!r}")
        return parsed
    assert by_key is not None
    if len(by_key) > _MAX_VALUE_CHARS * 10:
        raise _BadRequest("key: too long")
    return by_key


async def _form(request: Request) -> dict[str, str]:
    """A small url-encoded form (one value per field)."""
    if request.headers.get("content-type", "").split(";")[0] != _FORM:
        raise _BadRequest(f"expected a form ({_FORM})")
    body = await request.body()
    if len(body) > _MAX_FORM:
        raise _BadRequest("form too large")
    return {k: v[0] for k, v in parse_qs(body.decode("latin-1"), max_num_fields=10).items()}


def _prune_action(cutoff: object, expected: object) -> str:
    """What a prune's CSRF token is bound to: the dry run's cutoff and count."""
    return f"prune:{cutoff}:{expected}"


def _query(items: list[tuple[str, str]]) -> str:
    return "?" + urlencode(items)


class _Console:
    """The console's route handlers, on what they share: its templates, its CSRF tokens,
    the database and the prunes it started."""

    def __init__(
        self,
        url: str,
        templates: Environment,
        csrf: actions.Csrf,
        source: Source,
        pruning: actions.Pruning,
        retry_after: int,
    ) -> None:
        self._url = url
        self._templates = templates
        self._csrf = csrf
        self._source = source
        self._pruning = pruning
        #: Overview pages being read now (the event loop is the console's one thread).
        self._overviews_reading = 0
        #: Seconds a 503 for a busy overview asks a client to wait (the pages' refresh).
        self._retry_after = retry_after

    def _respond(
        self,
        request: Request,
        template: str,
        doc: dict[str, Any],
        status: int = 200,
        **shown: Any,
    ) -> Response:
        """``doc`` as JSON (``?format=json``), or the page ``template`` draws of it and of
        ``shown``, what a page draws besides its document (a task's facts)."""
        if request.query_params.get("format") == "json":
            # ASCII-escaped: valid JSON whatever a value holds, safe in any viewer.
            return Response(
                json.dumps(doc, ensure_ascii=True, indent=2),
                status,
                media_type="application/json",
            )
        body = self._templates.get_template(template).render(doc=doc, request=request, **shown)
        return HTMLResponse(body, status)

    async def _guarded(self, request: Request, template: str, work: Any) -> Response:
        # What the page handles itself passes; any other failure leaves through the door.
        handled = (
            ClusterNotFound,
            reads.TaskNotFound,
            actions.PruneNotFound,
            _BadRequest,
            actions.ActionRefused,
            CliError,
        )
        try:
            async with door.translated("reading the cluster", passing=handled):
                done = await work()
                if isinstance(done, Response):
                    return done
                return self._respond(request, template, done)
        except (ClusterNotFound, reads.TaskNotFound, actions.PruneNotFound) as exc:
            what = {
                ClusterNotFound: "cluster",
                reads.TaskNotFound: "task",
                actions.PruneNotFound: "prune (this console keeps its last ones only)",
            }[type(exc)]
            return self._respond(
                request, "error.html", {"error": f"no {what} {exc.args[0]!r}"}, 404
            )
        except _BadRequest as exc:
            return self._respond(request, "error.html", {"error": str(exc)}, 400)
        except actions.ActionRefused as exc:
            # Made visible: a log line goes to the operator's terminal.
            log.warning("refused %s %s: %s", request.method, visible(request.url.path), exc)
            return self._respond(request, "error.html", {"error": str(exc)}, 403)
        except MigrationError as exc:  # the trust check refused the schema
            return self._respond(
                request, "error.html", {"error": scrub(str(exc), [self._url])}, 409
            )
        except CliError as exc:  # cannot connect or a lock held too long (503), or a schema
            # not at this build's head (409)
            status = 503 if exc.code in (ExitCode.UNREACHABLE, ExitCode.LOCK_HELD) else 409
            return self._respond(
                request, "error.html", {"error": scrub(str(exc), [self._url])}, status
            )
        except StoreError as error:  # e.g. a role without SELECT: said, not a traceback
            log.warning(
                "%s %s: %s",
                request.method,
                visible(request.url.path),
                visible(scrub(str(error), [self._url])),
            )
            status = 503 if error.is_transient else 500
            return self._respond(
                request, "error.html", {"error": scrub(str(error), [self._url])}, status
            )

    async def overview(self, request: Request) -> Response:
        async def work() -> Response | dict[str, Any]:
            search = request.query_params.get("q", "").strip()
            after, before = _name_cursor(request, "after"), _name_cursor(request, "before")
            if after and before:
                raise _BadRequest("give one of after= and before=")
            if self._overviews_reading >= OVERVIEWS_AT_ONCE:
                return self._busy(request)
            self._overviews_reading += 1
            try:
                doc = await reads.overview(self._source, search, after or "", before)
            finally:
                self._overviews_reading -= 1
            kept = [("q", search)] if search else []
            cursors = doc["page"]
            doc["next_url"] = (
                None if cursors["after"] is None else _query([*kept, ("after", cursors["after"])])
            )
            doc["previous_url"] = (
                None
                if cursors["before"] is None
                else _query([*kept, ("before", cursors["before"])])
            )
            doc["first_url"] = _query(kept) if after or before else None
            return doc

        return await self._guarded(request, "overview.html", work)

    def _busy(self, request: Request) -> Response:
        """503 at once for an overview asked while :data:`OVERVIEWS_AT_ONCE` are read: a
        slow database then gets no more work from the console, and a tab's refresh says
        why instead of waiting in line."""
        response = self._respond(
            request,
            "error.html",
            {
                "error": f"the console is already reading {self._overviews_reading} overview "
                "pages (the database answers slowly): this one was not started; try again "
                "in a moment"
            },
            503,
        )
        response.headers["Retry-After"] = str(self._retry_after)
        return response

    async def cluster(self, request: Request) -> Response:
        async def work() -> dict[str, Any]:
            schema = _schema(request)
            filters, before = _filters(request, reads.FINISHED_STATUSES), _before(request)
            after = request.query_params.get("schedules_after", "")
            if len(after) > _MAX_VALUE_CHARS:
                raise _BadRequest("schedules_after: too long")
            doc = await reads.cluster(self._source, schema, filters, before, clean_text(after))
            finished = doc.get("finished")
            if finished is not None:
                # The same filters, one page on; and back to the newest page.
                items = request.query_params.multi_items()
                kept = [(k, v) for k, v in items if k not in ("before", "schedules_after")]
                name = doc["recurring_next"]
                doc["recurring_next_url"] = (
                    None if name is None else _query([*kept, ("schedules_after", name)])
                )
                _paged(finished, request, "before", ())
            return doc

        return await self._guarded(request, "cluster.html", work)

    async def live(self, request: Request) -> Response:
        async def work() -> dict[str, Any]:
            schema = _schema(request)
            filters, after = _filters(request, reads.LIVE_STATUSES), _after(request)
            if filters.since_ns is not None or filters.until_ns is not None:
                raise _BadRequest("since, until: the live list has no time window")
            doc = await reads.live(self._source, schema, filters, after)
            _paged(doc["live"], request, "after", ())
            return doc

        return await self._guarded(request, "live.html", work)

    async def charts(self, request: Request) -> Response:
        async def work() -> dict[str, Any]:
            schema = _schema(request)
            end = _moment(request, "end")
            # The charts end on the minute: the day before that minute must be a time.
            if end is not None and reads.chart_end(end) - reads.DAY.span_ns < -(2**63):
                raise _BadRequest("end: the day before it is out of range")
            doc = await reads.charts(self._source, schema, end)
            # Where the page's script reads the same document from.
            kept = [(k, v) for k, v in request.query_params.multi_items() if k != "format"]
            doc["json_url"] = f"/clusters/{schema}/charts" + _query([*kept, ("format", "json")])
            return doc

        return await self._guarded(request, "charts.html", work)

    async def handover_page(self, request: Request) -> Response:
        async def work() -> dict[str, Any]:
            schema = _schema(request)
            await self._source.known(schema)
            doc = await actions.handover_facts(self._source, schema)
            doc["csrf"] = self._csrf.token(schema, "handover")
            return doc

        return await self._guarded(request, "handover.html", work)

    async def _posted(
        self, request: Request, action: Callable[[dict[str, str]], str]
    ) -> tuple[str, dict[str, str], str]:
        """A POST from the console's own page: its cluster, its form and who asked, once
        its origin and its CSRF token (bound to the action ``action(form)`` names) pass."""
        schema = _schema(request)
        actions.check_origin(request)
        form = await _form(request)
        self._csrf.check(schema, action(form), form.get("csrf"))
        await self._source.known(schema)
        return schema, form, getattr(request.state, "who", None) or "unauthenticated"

    async def handover(self, request: Request) -> Response:
        async def work() -> dict[str, Any]:
            schema, form, who = await self._posted(request, lambda form: "handover")
            pid = form.get("pid", "")
            if _ID.fullmatch(pid) is None or int(pid) > 2**31 - 1:
                raise _BadRequest("pid: not a backend pid")
            return await actions.handover(self._source, schema, int(pid), who)

        return await self._guarded(request, "handed_over.html", work)

    async def prune_page(self, request: Request) -> Response:
        async def work() -> dict[str, Any]:
            schema = _schema(request)
            try:
                older_than = parse_duration(request.query_params.get("older_than", "7d"))
            except ValueError as exc:
                raise _BadRequest(str(exc)) from None
            await self._source.known(schema)
            doc = await actions.prune_preview(self._source, schema, older_than)
            # Bound to the dry run: the real run deletes before its cutoff, and its page
            # counts against what the dry run counted.
            doc["csrf"] = self._csrf.token(
                schema, _prune_action(doc["cutoff_ns"], doc["would_delete"])
            )
            return doc

        return await self._guarded(request, "prune.html", work)

    async def prune(self, request: Request) -> Response:
        async def work() -> Response:
            schema, form, who = await self._posted(
                request, lambda form: _prune_action(form.get("cutoff"), form.get("expected"))
            )
            cutoff, expected = form.get("cutoff", ""), form.get("expected", "")
            if _CUTOFF.fullmatch(cutoff) is None or not -(2**63) <= int(cutoff) <= I64_MAX:
                raise _BadRequest("cutoff: not one a dry run gave")
            if _ID.fullmatch(expected) is None or int(expected) > I64_MAX:
                raise _BadRequest("expected: not a count a dry run gave")
            job = self._pruning.start(schema, int(cutoff), int(expected), who)
            # See Other: the browser GETs the prune's page, which refreshes until it ends.
            return RedirectResponse(f"/clusters/{schema}/prune/{job.id}", 303)

        return await self._guarded(request, "pruning.html", work)

    async def prune_progress(self, request: Request) -> Response:
        async def work() -> dict[str, Any]:
            schema = _schema(request)
            job = self._pruning.job(schema, request.path_params["job"])
            if job is None:
                raise actions.PruneNotFound(request.path_params["job"])
            return job.document()

        return await self._guarded(request, "pruning.html", work)

    async def task(self, request: Request) -> Response:
        async def work() -> Response | dict[str, Any]:
            schema, ref = _schema(request), _ref(request)
            try:
                doc, facts = await reads.task(self._source, schema, ref)
            except reads.TaskAmbiguous as exc:
                # 300 Multiple Choices: the page lists them, as `tasks show` does.
                return self._respond(request, "ambiguous.html", exc.document(schema), 300)
            doc["schema"] = schema
            return self._respond(request, "task.html", doc, facts=facts)

        return await self._guarded(request, "task.html", work)


def console_app(
    url: str,
    credentials: Credentials | None,
    trusted_triggers: frozenset[str] = frozenset(),
    *,
    refresh_seconds: int = 5,
    allow_actions: bool = False,
    control_schema: str = DEFAULT_CONTROL_SCHEMA,
) -> Guard:
    """The console for the database at ``url``, guarded by ``credentials`` (``None``:
    loopback hosts only); its overview and cluster pages refresh every ``refresh_seconds``.
    With ``allow_actions`` (which needs ``credentials``), its pages offer a handover and a
    prune. The owners of clusters a host group leads are read in ``control_schema``."""
    if allow_actions and credentials is None:
        raise ValueError("actions need credentials: every local user can reach loopback")
    templates = _environment(refresh_seconds)
    templates.globals["actions"] = allow_actions
    csrf = actions.Csrf()
    source = Source(url, trusted_triggers, control_schema)
    pruning = actions.Pruning(source)
    console = _Console(url, templates, csrf, source, pruning, refresh_seconds)

    routes = [
        Route("/", console.overview),
        Route("/clusters/{schema}", console.cluster),
        Route("/clusters/{schema}/task", console.task),
        Route("/clusters/{schema}/live", console.live),
        Route("/clusters/{schema}/charts", console.charts),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ]
    if allow_actions:
        routes.append(Route("/clusters/{schema}/handover", console.handover_page, methods=["GET"]))
        routes.append(Route("/clusters/{schema}/handover", console.handover, methods=["POST"]))
        routes.append(Route("/clusters/{schema}/prune", console.prune_page, methods=["GET"]))
        routes.append(Route("/clusters/{schema}/prune", console.prune, methods=["POST"]))
        routes.append(
            Route("/clusters/{schema}/prune/{job}", console.prune_progress, methods=["GET"])
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await pruning.close()
        await source.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    return Guard(app, credentials)
