"""Uploaded programs, kept on the launcher's disk rather than in its memory.

Programs are content-addressed, so uploading one twice stores it once. The store holds at most ``capacity_bytes``
of program files; past that, the programs unused for longest are evicted, never one with a running instance
(a launch of an evicted id answers "upload it first", as for any unknown id). A few recently launched programs
stay decoded in memory, so a burst of launches of one program reads the disk once.
"""

from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from pie_cluster.programs import Program, ProgramError

_META = "program.json"
_FILES = "files"


@dataclass
class _Entry:
    size: int
    running: int = 0  # instances of it that have not ended: it is not evicted while any run


class ProgramStore:
    def __init__(self, root: Path, capacity_bytes: int, decoded: int = 32):
        self._root = root
        root.mkdir(parents=True, exist_ok=True)
        self._capacity = capacity_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._decoded: OrderedDict[str, Program] = OrderedDict()
        self._decoded_limit = decoded

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def stored_bytes(self) -> int:
        return sum(e.size for e in self._entries.values())

    def put(self, program: Program) -> None:
        """Store ``program`` (a no-op for one already stored, which then counts as just used)."""
        if program.id in self._entries:
            self._entries.move_to_end(program.id)
            return
        size = sum(len(data) for data in program.files.values())
        if size > self._capacity:
            raise ProgramError(f"{program.label}: {size} bytes is more than the launcher stores ({self._capacity})")
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
        self._entries[program.id] = _Entry(size)
        self._evict()

    def get(self, program_id: str) -> Program | None:
        """The stored program, or None if it was never uploaded or has been evicted."""
        if program_id not in self._entries:
            return None
        self._entries.move_to_end(program_id)
        program = self._decoded.get(program_id)
        if program is None:
            program = self._load(program_id)
            self._decoded[program_id] = program
            if len(self._decoded) > self._decoded_limit:
                self._decoded.popitem(last=False)
        self._decoded.move_to_end(program_id)
        return program

    def started(self, program_id: str) -> None:
        """An instance of it runs (it is not evicted meanwhile); built-in programs are not stored here."""
        entry = self._entries.get(program_id)
        if entry is not None:
            entry.running += 1

    def ended(self, program_id: str) -> None:
        entry = self._entries.get(program_id)
        if entry is not None:
            entry.running -= 1
            self._evict()

    def _load(self, program_id: str) -> Program:
        directory = self._root / program_id
        meta = json.loads((directory / _META).read_text(encoding="utf-8"))
        files = {rel: (directory / _FILES / rel).read_bytes() for rel in meta["files"]}
        return Program(
            program_id, meta["name"], meta["version"], meta["entry"], files, meta["isolated"], meta["runtime_env"]
        )

    def _evict(self) -> None:
        """Drop least recently used idle programs until the store fits its capacity."""
        excess = self.stored_bytes - self._capacity
        for program_id, entry in list(self._entries.items()):
            if excess <= 0:
                return
            if entry.running:
                continue
            del self._entries[program_id]
            self._decoded.pop(program_id, None)
            shutil.rmtree(self._root / program_id, ignore_errors=True)
            excess -= entry.size
