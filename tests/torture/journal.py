"""What a store instance records outside the database, and reading it back.

One journal file per worker process (a restarted worker gets a new file, so a line cut
short by a SIGKILL is never continued by someone else). Each record is one JSON line,
appended with a single ``write`` as soon as the event happened, so a SIGKILL loses nothing
already written; a background thread ``fsync``\\ s behind the writes (grouping them: an
fsync costs about a millisecond here), so a machine crash loses at most the last few.

Records carry the wall clock (``time.time()``): every process runs on the same machine,
so times from different journals, the orchestrator and the server compare directly.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Ack",
    "History",
    "Journal",
    "Lead",
    "Note",
    "Recovery",
    "StepDown",
    "count_acked",
    "read_history",
]


class Journal:
    """An append-only, fsynced JSON-lines file written by one process."""

    def __init__(self, path: Path, worker: str) -> None:
        self.path = path
        self.worker = worker
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._dirty = threading.Event()
        self._closing = False
        self._syncer = threading.Thread(target=self._sync_loop, name="journal-fsync", daemon=True)
        self._syncer.start()

    def write(self, kind: str, **fields: Any) -> None:
        record = {"k": kind, "w": self.worker, "t": time.time(), **fields}
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
        self._dirty.set()

    def close(self) -> None:
        self._closing = True
        self._dirty.set()
        self._syncer.join(timeout=10)
        os.fsync(self._fd)
        os.close(self._fd)

    def _sync_loop(self) -> None:
        while not self._closing:
            self._dirty.wait()
            self._dirty.clear()
            os.fsync(self._fd)


# --- reading ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Lead:
    """``worker`` took ``epoch`` at ``at`` (its acquisition had started at ``asked``)."""

    worker: str
    pid: int
    epoch: int
    asked: float
    at: float


@dataclass(frozen=True, slots=True)
class Recovery:
    """The leader of ``epoch`` finished recovering at ``at``, after ``seconds``."""

    worker: str
    epoch: int
    at: float
    seconds: float
    live: int


@dataclass(frozen=True, slots=True)
class Ack:
    """A submission acknowledged at ``at`` (submitted at ``sent``): ``(task id, attempt,
    state code)`` for each of its mutations, in order."""

    worker: str
    epoch: int
    sent: float
    at: float
    mutations: tuple[tuple[int, int, str], ...]


@dataclass(frozen=True, slots=True)
class StepDown:
    """The leader of ``epoch`` stopped leading at ``at``; ``reason`` says why."""

    worker: str
    epoch: int
    at: float
    reason: str


@dataclass(frozen=True, slots=True)
class Note:
    """Anything else a worker recorded: ``start``, ``stop``, ``fenced``, ``error``..."""

    worker: str
    kind: str
    at: float
    fields: dict[str, Any]


@dataclass
class History:
    """Every journal of one run, parsed; lists are in time order."""

    leads: list[Lead] = field(default_factory=list)
    recoveries: list[Recovery] = field(default_factory=list)
    acks: list[Ack] = field(default_factory=list)
    step_downs: list[StepDown] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    #: Lines that could not be parsed: at most the last line of a killed process's file.
    torn_lines: int = 0

    @property
    def acked_mutations(self) -> int:
        return sum(len(a.mutations) for a in self.acks)

    def errors(self) -> list[Note]:
        return [n for n in self.notes if n.kind == "error"]


def _records(path: Path) -> Iterator[dict[str, Any] | None]:
    with path.open("rb") as f:
        for line in f:
            try:
                yield json.loads(line)
            except ValueError:
                yield None


def read_history(paths: Iterable[Path]) -> History:
    """Parse the journals ``paths`` into one :class:`History`."""
    history = History()
    for path in paths:
        for r in _records(path):
            if r is None:
                history.torn_lines += 1
                continue
            kind, worker, at = r.pop("k"), r.pop("w"), r.pop("t")
            if kind == "lead":
                history.leads.append(Lead(worker, r["pid"], r["e"], r["asked"], at))
            elif kind == "recovered":
                history.recoveries.append(Recovery(worker, r["e"], at, r["seconds"], r["live"]))
            elif kind == "ack":
                mutations = tuple((m[0], m[1], m[2]) for m in r["m"])
                history.acks.append(Ack(worker, r["e"], r["sent"], at, mutations))
            elif kind == "stepdown":
                history.step_downs.append(StepDown(worker, r["e"], at, r["reason"]))
            else:
                history.notes.append(Note(worker, kind, at, r))
    history.leads.sort(key=lambda x: x.at)
    history.recoveries.sort(key=lambda x: x.at)
    history.acks.sort(key=lambda x: x.at)
    history.step_downs.sort(key=lambda x: x.at)
    history.notes.sort(key=lambda x: x.at)
    return history


def count_acked(path: Path, offset: int) -> tuple[int, int]:
    """``(acknowledged mutations, new offset)`` in the complete lines of ``path`` after
    ``offset``: the orchestrator's cheap running count while a run is in progress."""
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    acked = 0
    for line in data[:end].splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("k") == "ack":
            acked += len(record["m"])
    return acked, offset + end
