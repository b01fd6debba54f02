"""Uploaded programs, kept on the launcher's disk rather than in its memory, each owned by the users who uploaded it.

A program is visible only to a user who uploaded it: another user's id reads as unknown, exactly like an id never
uploaded, so ids cannot be probed. Programs are content-addressed, so the files are stored once however many users
upload the same program — sharing them leaks nothing, since holding an id means having uploaded the same bytes.

Each user may hold at most ``capacity_bytes`` of programs (a program two users hold counts for each); past that, the
user's programs unused for longest are evicted, never one with a running instance, and never another user's (a
launch of an evicted id answers "upload it first", as for any unknown id). Files leave the disk when no user holds
them. A few recently launched programs stay decoded in memory, so a burst of launches reads the disk once.

Who holds what is also written to a ``GcsStore`` when given one, so that a launcher Ray restarts reopens the same
directory with the same holds (``restore``); and so is every program's content (``blobs``, as Ray keeps its
runtime_env packages), so that a launcher restarted on another node, whose disk does not have the files, reads them
from there (and writes them to its disk again). A program's content leaves both when nobody holds it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from pie_cluster.gcs_store import GcsStore
from pie_cluster.programs.program import Program, ProgramError

_META = "program.json"
_FILES = "files"


def new_store_directory(parent: str | None) -> Path:
    """A new directory for the uploaded programs, readable by this OS user only, under ``parent`` (default: the
    system's temporary directory)."""
    if parent is not None:
        Path(parent).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="pie-program-store-", dir=parent))  # mode 0700


@dataclass
class _Hold:
    """One user's hold on a stored program."""

    size: int
    running: int = 0  # the user's instances of it that have not ended: it is not evicted while any run


class ProgramStore:
    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        decoded: int = 32,
        stored: GcsStore | None = None,
        restore: bool = False,
        blobs: GcsStore | None = None,
    ):
        self._root = root
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._capacity = capacity_bytes
        self._holds: dict[str, OrderedDict[str, _Hold]] = {}  # user -> program id -> hold, least recently used first
        self._owners: dict[str, set[str]] = {}  # program id -> users holding it: on disk while there is one
        self._decoded: OrderedDict[str, Program] = OrderedDict()
        self._decoded_limit = decoded
        self._stored = stored
        self._blobs = blobs
        for (user,), sizes in (stored.load() if stored is not None and restore else {}).items():
            self._holds[user] = OrderedDict((program_id, _Hold(size)) for program_id, size in sizes)
            for program_id, _ in sizes:
                self._owners.setdefault(program_id, set()).add(user)

    def __len__(self) -> int:
        """Programs on disk (one per content, however many users hold it)."""
        return len(self._owners)

    def stored_bytes(self, user: str) -> int:
        """What the user's programs count against their limit."""
        return sum(hold.size for hold in self._holds.get(user, {}).values())

    def put(self, user: str, program: Program) -> None:
        """Store ``program`` for ``user`` (a no-op for one the user holds already, which then counts as just used)."""
        holds = self._holds.setdefault(user, OrderedDict())
        if program.id in holds:
            holds.move_to_end(program.id)
            return
        size = sum(len(data) for data in program.files.values())
        if size > self._capacity:
            raise ProgramError(
                f"{program.label}: {size} bytes is more than the launcher stores per user ({self._capacity})"
            )
        if program.id not in self._owners:
            self._write(program)
            self._owners[program.id] = set()
        self._owners[program.id].add(user)
        holds[program.id] = _Hold(size)
        self._evict(user, keep=program.id)
        self._save(user)
        if self.stored_bytes(user) > self._capacity:  # the rest are running: the new one cannot be kept
            self._drop(user, program.id)
            raise ProgramError(
                f"{program.label}: the programs of your running instances fill your {self._capacity} bytes of the "
                "launcher's store; upload it again once some have ended"
            )

    def get(self, user: str, program_id: str) -> Program | None:
        """The user's stored program, or None if they never uploaded it or it has been evicted."""
        holds = self._holds.get(user, {})
        if program_id not in holds:
            return None
        holds.move_to_end(program_id)
        program = self._decoded.get(program_id)
        if program is None:
            program = self._load(program_id)
            self._decoded[program_id] = program
            if len(self._decoded) > self._decoded_limit:
                self._decoded.popitem(last=False)
        self._decoded.move_to_end(program_id)
        return program

    def started(self, user: str, program_id: str) -> None:
        """An instance of it runs (it is not evicted meanwhile); built-in programs are not stored here."""
        hold = self._holds.get(user, {}).get(program_id)
        if hold is not None:
            hold.running += 1

    def ended(self, user: str, program_id: str) -> None:
        hold = self._holds.get(user, {}).get(program_id)
        if hold is not None:
            hold.running -= 1
            self._evict(user)

    def remove_all(self) -> None:
        """The cluster stops: every program leaves the disk, the store's directory with them."""
        shutil.rmtree(self._root, ignore_errors=True)
        for store in (self._stored, self._blobs):
            if store is not None:
                store.clear()
        self._holds.clear()
        self._owners.clear()
        self._decoded.clear()

    def _save(self, user: str) -> None:
        if self._stored is not None:
            self._stored.put((user,), [(program_id, hold.size) for program_id, hold in self._holds[user].items()])

    def _write(self, program: Program) -> None:
        self._write_files(program)
        if self._blobs is not None:
            self._blobs.put(program.id, program)

    def _write_files(self, program: Program) -> None:
        directory = self._root / program.id
        for rel, data in program.files.items():
            target = directory / _FILES / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        meta = {
            "name": program.name,
            "version": program.version,
            "entry": program.entry,
            "files": sorted(program.files),
            "isolated": program.isolated,
            "runtime_env": program.runtime_env,
        }
        (directory / _META).write_text(json.dumps(meta), encoding="utf-8")

    def _load(self, program_id: str) -> Program:
        directory = self._root / program_id
        if not (directory / _META).exists() and self._blobs is not None:  # restarted on another node's disk
            program = self._blobs.get(program_id)
            if program is not None:
                self._write_files(program)
                return program
        meta = json.loads((directory / _META).read_text(encoding="utf-8"))
        files = {rel: (directory / _FILES / rel).read_bytes() for rel in meta["files"]}
        return Program(
            program_id, meta["name"], meta["version"], meta["entry"], files, meta["isolated"], meta["runtime_env"]
        )

    def _evict(self, user: str, keep: str | None = None) -> None:
        """Drop the user's least recently used idle programs (but ``keep``) until theirs fit the limit."""
        excess = self.stored_bytes(user) - self._capacity
        for program_id, hold in list(self._holds[user].items()):
            if excess <= 0:
                return
            if not hold.running and program_id != keep:
                self._drop(user, program_id)
                excess -= hold.size

    def _drop(self, user: str, program_id: str) -> None:
        """The user no longer holds the program; its files go when nobody does."""
        del self._holds[user][program_id]
        self._save(user)
        owners = self._owners[program_id]
        owners.discard(user)
        if not owners:
            del self._owners[program_id]
            self._decoded.pop(program_id, None)
            shutil.rmtree(self._root / program_id, ignore_errors=True)
            if self._blobs is not None:
                self._blobs.delete(program_id)
