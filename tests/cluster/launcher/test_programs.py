"""Program uploads as an attacker would send them, and the launcher's program store (on disk, and in the GCS).

No Ray needed but for the store's copy in the GCS: ``Program.from_upload`` is exactly what the launcher runs on an
upload, and ``load_main`` what a host runs on a launch (it writes a multi-file program's files to disk, where a
hostile name would escape)."""

from __future__ import annotations

import io
import stat
import tempfile
import zipfile
from pathlib import Path

import pytest
from pie_cluster.programs.program import MAX_ARCHIVE_MEMBERS, MAX_PROGRAM_BYTES, Program, ProgramError
from pie_cluster.programs.store import ProgramStore

MANIFEST = '[package]\nname = "p"\nversion = "0.1.0"\n'
MAIN = "from .helpers import VALUE\n\nasync def main(input):\n    return VALUE\n"


def archive(members: dict[str, bytes | str], symlinks: tuple[str, ...] = ()) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, content in members.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            if name in symlinks:
                info.external_attr = (stat.S_IFLNK | 0o777) << 16
            z.writestr(info, content)
    return buf.getvalue()


def program_zip(**extra: bytes | str) -> bytes:
    return archive({"pie.toml": MANIFEST, "main.py": MAIN, "helpers.py": "VALUE = 'safe'\n", **extra})


def test_a_well_formed_archive_loads_and_runs_from_its_own_directory():
    import asyncio

    program = Program.from_upload("p.zip", program_zip(**{"sub/data.txt": "x"}))
    assert asyncio.run(program.load_main()({})) == "safe"
    assert set(program.files) == {"pie.toml", "main.py", "helpers.py", "sub/data.txt"}


@pytest.mark.parametrize(
    "name",
    [
        "../escaped.py",
        "sub/../../escaped.py",
        "/tmp/pie-absolute-escape.py",
        "..\\escaped.py",
        "C:/escaped.py",
        "a/../../../escaped.py",
    ],
)
def test_members_outside_the_program_directory_are_refused_at_upload(name, tmp_path):
    with pytest.raises(ProgramError, match="not a relative path inside the program directory") as refused:
        Program.from_upload("evil.zip", program_zip(**{name: "pwned = True\n"}))
    assert repr(name) in str(refused.value)  # the message names the member
    assert not Path("/tmp/pie-absolute-escape.py").exists()
    assert not (Path(tempfile.gettempdir()) / "escaped.py").exists()


def test_a_directory_program_cannot_smuggle_names_either():
    with pytest.raises(ProgramError, match="outside|relative path"):
        Program.from_files({"pie.toml": MANIFEST.encode(), "main.py": MAIN.encode(), "../x.py": b""}, "dir")


def test_symbolic_links_are_refused():
    with pytest.raises(ProgramError, match="symbolic link"):
        members = {"pie.toml": MANIFEST, "main.py": MAIN, "link.py": "/etc/passwd"}
        Program.from_upload("link.zip", archive(members, symlinks=("link.py",)))


def test_an_archive_expanding_past_the_limit_is_refused_though_it_is_small():
    data = program_zip(**{"zeros.bin": b"\0" * (MAX_PROGRAM_BYTES + 1)})
    assert len(data) < MAX_PROGRAM_BYTES // 64  # a zip bomb: tiny on the wire
    with pytest.raises(ProgramError, match="expands to more than"):
        Program.from_upload("bomb.zip", data)


def test_an_archive_whose_headers_understate_its_size_is_measured_as_read():
    """The size check counts bytes as they decompress; a forged header (file_size says 1) does not get past it."""
    data = bytearray(program_zip(**{"zeros.bin": b"\0" * (MAX_PROGRAM_BYTES + 1)}))
    real = (MAX_PROGRAM_BYTES + 1).to_bytes(4, "little")
    forged = bytes(data).replace(real, (1).to_bytes(4, "little"))
    assert forged != bytes(data)
    with pytest.raises(ProgramError, match="expands to more than|not a valid zip"):
        Program.from_upload("forged.zip", forged)


def test_too_many_members_are_refused():
    members = {f"m{i}.txt": "" for i in range(MAX_ARCHIVE_MEMBERS + 1)}
    with pytest.raises(ProgramError, match="files is over the limit"):
        Program.from_upload("many.zip", archive({"pie.toml": MANIFEST, "main.py": MAIN, **members}))


def test_garbage_is_not_a_zip():
    with pytest.raises(ProgramError, match="not a valid zip archive"):
        Program.from_upload("junk.zip", b"PK\x03\x04 definitely not a zip")


def small(tag: str, size: int = 1000) -> Program:
    return Program.from_upload(f"{tag}.py", f"async def main(input):\n    return {tag!r}\n#{'x' * size}".encode())


def test_the_store_keeps_one_copy_and_reads_it_back_from_disk(tmp_path):
    store = ProgramStore(tmp_path, capacity_bytes=1 << 20, decoded=1)
    a, b = small("a"), small("b")
    store.put("alice", a)
    store.put("alice", a)  # deduplicated: the id is the content's hash
    store.put("bob", a)  # bob holds it too, from the same files
    store.put("alice", b)  # pushes a out of the decoded cache: the next get reads the disk
    assert len(store) == 2 and len(list(tmp_path.iterdir())) == 2
    loaded = store.get("alice", a.id)
    assert loaded == a and loaded is not a
    assert store.get("bob", a.id) == a
    assert store.get("alice", "no-such-id") is None


def test_another_users_program_id_reads_as_unknown(tmp_path):
    store = ProgramStore(tmp_path, capacity_bytes=1 << 20)
    a = small("a")
    store.put("alice", a)
    assert store.get("bob", a.id) is None
    store.started("bob", a.id)  # no hold of bob's: nothing to count
    store.ended("bob", a.id)
    assert store.get("alice", a.id) == a


def test_the_store_evicts_least_recently_used_idle_programs_never_running_ones(tmp_path):
    a, b, c = small("a"), small("b"), small("c")
    size = sum(len(v) for v in a.files.values())
    store = ProgramStore(tmp_path, capacity_bytes=2 * size + size // 2)
    store.put("alice", a)
    store.put("alice", b)
    store.started("alice", a.id)  # a has a running instance
    store.put("alice", c)  # over capacity: b (idle) goes, a (running) stays although it is older
    assert store.get("alice", b.id) is None and not (tmp_path / b.id).exists()
    assert store.get("alice", a.id) == a and store.get("alice", c.id) == c
    store.ended("alice", a.id)
    store.put("alice", b)  # over again: now the least recently used idle one goes
    assert len(store) == 2 and store.get("alice", b.id) == b
    assert store.stored_bytes("alice") <= 2 * size + size // 2


def test_the_limit_is_per_user_and_one_users_uploads_never_evict_anothers(tmp_path):
    a, b, c, d = small("a"), small("b"), small("c"), small("d")
    size = sum(len(v) for v in a.files.values())
    store = ProgramStore(tmp_path, capacity_bytes=2 * size)
    store.put("alice", a)
    store.put("alice", b)  # alice's store is full
    store.put("bob", a)  # the same program, held by bob as well
    store.put("bob", c)
    store.put("bob", d)  # bob over his limit: his least recently used (a) goes, for him only
    assert store.get("bob", a.id) is None and store.get("bob", c.id) == c and store.get("bob", d.id) == d
    assert store.get("alice", b.id) == b and store.get("alice", a.id) == a  # (a is now her most recently used)
    assert (tmp_path / a.id).exists()  # alice still holds its files
    store.put("alice", c)  # alice's turn: her least recently used (b) goes; a is hers alone now
    assert store.get("alice", b.id) is None and not (tmp_path / b.id).exists()
    assert store.stored_bytes("alice") == store.stored_bytes("bob") == 2 * size


def test_a_program_bigger_than_the_store_is_refused(tmp_path):
    store = ProgramStore(tmp_path, capacity_bytes=100)
    with pytest.raises(ProgramError, match="more than the launcher stores per user"):
        store.put("alice", small("a"))


def test_an_upload_that_only_running_programs_leave_no_room_for_is_refused(tmp_path):
    a, b = small("a"), small("b")
    size = sum(len(v) for v in a.files.values())
    store = ProgramStore(tmp_path, capacity_bytes=size + size // 2)
    store.put("alice", a)
    store.started("alice", a.id)
    with pytest.raises(ProgramError, match="running instances fill"):
        store.put("alice", b)
    assert store.get("alice", b.id) is None and not (tmp_path / b.id).exists() and store.get("alice", a.id) == a
    store.ended("alice", a.id)
    store.put("alice", b)  # a is idle now: it makes room
    assert store.get("alice", a.id) is None and store.get("alice", b.id) == b


def test_removing_everything_takes_the_directory(tmp_path):
    root = tmp_path / "store"
    store = ProgramStore(root, capacity_bytes=1 << 20)
    store.put("alice", small("a"))
    store.remove_all()
    assert not root.exists() and len(store) == 0


def test_a_store_reopened_on_a_disk_without_its_files_reads_them_from_the_gcs(tmp_path, ray_session):
    """A launcher restarted on another node reopens its store there: the holds and the programs' content come from
    the GCS's key-value store, the files are written to the new disk, and content nobody holds leaves both."""
    from uuid import uuid4

    from pie_cluster.gcs_store import GcsStore

    key = uuid4().hex
    holds, blobs = GcsStore("pie-test-programs", f"{key}/holds"), GcsStore("pie-test-programs", f"{key}/blobs")
    a, b = small("a"), small("b")
    ProgramStore(tmp_path / "first", capacity_bytes=1 << 20, stored=holds, blobs=blobs).put("alice", a)

    elsewhere = tmp_path / "second"
    store = ProgramStore(elsewhere, capacity_bytes=1 << 20, stored=holds, restore=True, blobs=blobs)
    assert store.get("alice", a.id) == a and (elsewhere / a.id).is_dir()
    assert store.get("bob", a.id) is None  # still only hers
    store.put("alice", b)
    assert set(blobs.load()) == {a.id, b.id}
    store.remove_all()
    assert blobs.load() == {} and holds.load() == {}
