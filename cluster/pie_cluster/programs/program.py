"""Inferlet programs: what users upload, how they are identified, and how a host turns one into ``main``.

A program is either a single ``.py`` file (named after the file, version 0.0.0) or a directory/zip archive with a
``pie.toml`` manifest::

    [package]
    name = "agent"          # identity: name@version
    version = "0.1.0"
    [inferlet]
    entry = "main.py"       # defines `async def main(input)`; siblings are reached with relative imports
    isolated = false        # true: each instance gets a process of its own instead of sharing the user's worker
    [inferlet.runtime_env]  # Ray runtime_env for its own dependencies (implies isolated); refused at upload
                            # unless the cluster's [sandbox] mode is "off" (see Launcher.upload)
    pip = ["rapidfuzz"]

Programs are content-addressed: the id is a hash of the files, so uploading the same program twice is a no-op.
Each instance gets a fresh copy of the entry module's globals; sibling modules are imported once per process.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import re
import sys
import tempfile
import tomllib
import types
import zipfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "pie.toml"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_VERSION = re.compile(r"^\d+\.\d+\.\d+$")
MAX_PROGRAM_BYTES = 64 << 20
"""Limit on an upload, and separately on the files a zip expands to (a small zip can expand to gigabytes)."""
MAX_ARCHIVE_MEMBERS = 4096
_SYMLINK = 0o120000

Main = Callable[[dict], Awaitable[Any]]


@functools.lru_cache(maxsize=256)
def _compiled(program_id: str, label: str, entry: str, source: bytes) -> types.CodeType:
    """The entry module's code, compiled once per process (launching an instance only executes it)."""
    try:
        # dont_inherit: the program gets its own __future__ flags, not this module's (postponed annotations
        # would turn its dataclasses' field types into strings)
        return compile(source, f"<{label}>/{entry}", "exec", dont_inherit=True)
    except SyntaxError as e:
        raise ProgramError(f"{label}: {entry} line {e.lineno}: {e.msg}") from None


class ProgramError(ValueError):
    """The upload cannot be run as an inferlet; the message says what is wrong with it."""


@dataclass(frozen=True)
class Program:
    id: str
    name: str
    version: str
    entry: str
    files: dict[str, bytes] = field(repr=False)
    isolated: bool = False
    runtime_env: dict | None = None

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"

    def check_sandboxable(self) -> None:
        """Refuse a program that asks for a Ray runtime_env: sandboxed, programs run with the cluster's Python."""
        if self.runtime_env is not None:
            raise ProgramError(
                f"{self.label}: pie.toml's [inferlet.runtime_env] is refused: programs run in the cluster's "
                "sandbox with its Python environment (an operator whose users are all trusted may allow it with "
                '[sandbox] mode = "off")'
            )

    # -- construction ----------------------------------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str | Path) -> Program:
        """A ``.py`` file, or a directory holding ``pie.toml``."""
        path = Path(path)
        if path.is_dir():
            files = {
                str(p.relative_to(path)): p.read_bytes()
                for p in sorted(path.rglob("*"))
                if p.is_file() and "__pycache__" not in p.parts
            }
            return cls.from_files(files, source=str(path))
        if not path.is_file():
            raise ProgramError(f"{path}: no such program file or directory")
        return cls.from_upload(path.name, path.read_bytes())

    @classmethod
    def from_upload(cls, filename: str, data: bytes) -> Program:
        """What a client uploads: a ``.py`` source file or a ``.zip`` of a program directory."""
        if len(data) > MAX_PROGRAM_BYTES:
            raise ProgramError(f"{filename}: {len(data)} bytes is over the {MAX_PROGRAM_BYTES >> 20} MiB limit")
        if filename.endswith(".py"):
            name = re.sub(r"[^A-Za-z0-9_-]", "-", Path(filename).stem).strip("-") or "program"
            return cls._build(name, "0.0.0", Path(filename).name, {Path(filename).name: data}, False, None)
        if filename.endswith(".zip"):
            return cls.from_files(_unzip(filename, data), source=filename)
        raise ProgramError(f"{filename}: upload a .py file or a .zip of a directory with {MANIFEST}")

    @classmethod
    def from_files(cls, files: dict[str, bytes], source: str) -> Program:
        for name in files:
            _check_member(source, name)
        if MANIFEST not in files:
            raise ProgramError(f"{source}: a program directory needs a {MANIFEST} manifest at its top level")
        try:
            manifest = tomllib.loads(files[MANIFEST].decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ProgramError(f"{source}/{MANIFEST}: {e}") from None
        package, spec = manifest.get("package", {}), manifest.get("inferlet", {})
        entry = spec.get("entry", "main.py")
        if entry not in files:
            raise ProgramError(f"{source}/{MANIFEST}: entry {entry!r} is not in the program")
        runtime_env = spec.get("runtime_env") or None
        isolated = bool(spec.get("isolated", False)) or runtime_env is not None
        return cls._build(package.get("name", ""), package.get("version", ""), entry, files, isolated, runtime_env)

    @classmethod
    def _build(cls, name, version, entry, files, isolated, runtime_env) -> Program:
        if not _NAME.match(str(name)):
            raise ProgramError(f"program name {name!r} must match {_NAME.pattern}")
        if not _VERSION.match(str(version)):
            raise ProgramError(f"program version {version!r} must be MAJOR.MINOR.PATCH")
        digest = hashlib.sha256()
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
        program = cls(digest.hexdigest()[:24], name, version, entry, dict(files), isolated, runtime_env)
        program._compile()  # syntax errors surface at upload, not at the first launch
        return program

    # -- loading -------------------------------------------------------------------------------------------------

    def _compile(self) -> types.CodeType:
        return _compiled(self.id, self.label, self.entry, self.files[self.entry])

    def load_main(self, root: Path | None = None) -> Main:
        """A fresh instance of the entry module; returns its ``async def main(input)``. ``root``: where the
        program's files already are (a sandboxed worker's read-only view), else they are written out if needed."""
        package = self._package(root)
        module = types.ModuleType(f"{package}.{Path(self.entry).stem}" if package else f"inferlet_{self.id}")
        module.__package__ = package
        module.__file__ = f"<{self.label}>/{self.entry}"
        previous = sys.modules.get(module.__name__)
        sys.modules[module.__name__] = module  # while it runs: dataclasses and typing look their module up there
        try:
            exec(self._compile(), module.__dict__)
        finally:
            if previous is None:
                sys.modules.pop(module.__name__, None)
            else:
                sys.modules[module.__name__] = previous
        main = module.__dict__.get("main")
        if main is None or not inspect.iscoroutinefunction(main):
            raise ProgramError(f"{self.label}: {self.entry} must define `async def main(input)` at top level")
        return main

    def _package(self, root: Path | None) -> str:
        """Multi-file programs become a package in a per-program directory, so relative imports work."""
        if len(self.files) == 1:
            return ""
        name = f"pie_program_{self.id}"
        if name not in sys.modules:
            root = root or self.write_out()
            package = types.ModuleType(name)
            package.__path__ = [str(root)]
            sys.modules[name] = package
        return name

    def write_out(self, root: Path | None = None) -> Path:
        """The program's files written under ``root`` (default: this process's temporary directory)."""
        root = (root or Path(tempfile.gettempdir()) / "pie-programs" / self.id).resolve()
        for rel, data in self.files.items():
            target = (root / rel).resolve()
            if not target.is_relative_to(root):  # from_files refuses such names; this guards the write itself
                raise ProgramError(f"{self.label}: {rel!r} is outside the program directory")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        return root


def _check_member(source: str, name: str) -> None:
    """A program's file names are relative paths that stay inside its directory: no absolute paths, drive
    letters, backslashes or ``..`` (a name like ``../../etc/cron.d/x`` would be written outside it)."""
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or ":" in parts[0] or ".." in parts or "\0" in name:
        raise ProgramError(f"{source}: member {name!r} is not a relative path inside the program directory")


def _unzip(filename: str, data: bytes) -> dict[str, bytes]:
    """A zip's files, refusing unsafe names, links and archives that expand past the limit. Sizes are counted
    as the members are read, not taken from the archive's headers, which an attacker writes."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = [m for m in archive.infolist() if not m.is_dir()]
            if len(members) > MAX_ARCHIVE_MEMBERS:
                raise ProgramError(f"{filename}: {len(members)} files is over the limit of {MAX_ARCHIVE_MEMBERS}")
            files, left = {}, MAX_PROGRAM_BYTES
            for member in members:
                _check_member(filename, member.filename)
                if (member.external_attr >> 16) & 0o170000 == _SYMLINK:
                    raise ProgramError(f"{filename}: member {member.filename!r} is a symbolic link")
                with archive.open(member) as f:
                    content = f.read(left + 1)
                left -= len(content)
                if left < 0:
                    raise ProgramError(f"{filename}: expands to more than the {MAX_PROGRAM_BYTES >> 20} MiB limit")
                files[member.filename] = content
            return files
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError) as e:
        raise ProgramError(f"{filename}: not a valid zip archive ({e})") from None
