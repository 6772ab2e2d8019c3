"""The journal under faults (issue 14, item 16): locked by another writer, disk full, read-only,
corrupt. Each gives one line naming the file and the cause, exit 6, no traceback, and no action is
taken whose intent could not be written.

Faults are real: another connection holding SQLite's write lock; SQLite's own ``max_page_count``
(the database cannot grow: SQLITE_FULL) and a 256 KiB tmpfs filled to the last block; a read-only
bind mount and ``query_only``; garbage bytes. Mounts are made inside a private mount namespace
(``unshare -m``) that vanishes with the command: nothing is mounted on this machine.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.errors import ExitCode, JournalError
from engine.journal import LOCK_TIMEOUT, Journal
from engine.model import RunState
from tests.fakes import FakeNodes
from tests.unit.test_journal import World, world  # noqa: F401  (the fixture: a flagship run on fakes)

REPO = Path(__file__).resolve().parents[2]


def waiting_run(path: Path) -> tuple[str, str]:
    """A journal holding one run that waits for approval: (run id, plan digest)."""
    j = Journal(path)
    run_id = j.create_run("gpu-node-recovery", {"node": "omen2"}, ["omen2"])
    j.set_plan(run_id, {"steps": []}, "d" * 64)
    j.set_state(run_id, RunState.WAITING_APPROVAL.value)
    j.close()
    return run_id, "d" * 64


def sealed_waiting_run(path: Path) -> tuple[str, str]:
    """As ``waiting_run``, sealed as the engine seals its runs (engine.integrity), so that an
    approval gets as far as writing."""
    from engine.integrity import RunIntegrity
    from engine.store import new_run_id

    j = Journal(path)
    integrity = RunIntegrity(j)
    run_id = new_run_id()
    seal = integrity.first_seal(run_id, runbook="gpu-node-recovery", nodes=["omen2"], params={"node": "omen2"},
                                source="cli", approval_required=True, requested_by="zed")
    j.create_run("gpu-node-recovery", {"node": "omen2"}, ["omen2"], approval_required=True, run_id=run_id,
                 events=[("run.requested", {"by": "zed"}), seal])
    j.set_plan(run_id, {"steps": []}, "d" * 64)
    integrity.seal(run_id, plan_digest="d" * 64)
    j.set_state(run_id, RunState.WAITING_APPROVAL.value)
    j.close()
    return run_id, "d" * 64


@pytest.fixture
def held_lock(tmp_path: Path) -> Iterator[Path]:
    """Another writer holds the journal's write lock (an open write transaction)."""
    path = tmp_path / "journal.sqlite"
    Journal(path).close()
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO runs (id, runbook, params, nodes, state, created) VALUES ('x','x','{}','[]','x',0)")
    yield path
    other.execute("ROLLBACK")
    other.close()


def one_line(e: JournalError, path: Path, cause: str) -> None:
    text = str(e)
    assert "\n" not in text and text.startswith(f"{path}: cannot ") and cause in text, text
    assert e.exit_code == ExitCode.JOURNAL == 6


# -- the Journal itself -------------------------------------------------------------------------------

def test_a_journal_locked_by_another_writer_is_waited_for_then_a_clear_error(held_lock: Path) -> None:
    assert LOCK_TIMEOUT == 30.0
    default = Journal(held_lock)  # opening reads only: not blocked by the writer (WAL)
    assert default.lock_timeout == 30.0
    assert default._db.execute("PRAGMA busy_timeout").fetchone()[0] == 30_000  # what SQLite really waits
    default.close()
    j = Journal(held_lock, lock_timeout=1.0)
    start = time.monotonic()
    with pytest.raises(JournalError) as e:
        j.create_run("gpu-node-recovery", {}, ["omen2"])
    assert 0.9 <= time.monotonic() - start <= 5
    one_line(e.value, held_lock, "locked by another process for more than 1s")
    assert j.list_runs() == []  # reads still work, nothing half-written


def test_a_lock_released_within_the_wait_is_no_error(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    Journal(path).close()
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    threading.Timer(0.5, lambda: other.execute("ROLLBACK")).start()
    j = Journal(path, lock_timeout=10.0)
    assert j.create_run("gpu-node-recovery", {}, ["omen2"])
    other.close()


def fill(j: Journal, run_id: str | None = None) -> None:
    """The database may not grow by one more page, and its last free pages are used. With
    ``run_id``: the room left in the pages that run's next event would go to is used too (rows of
    that run, ever smaller), so its next event cannot be written whatever the pages held before."""
    db = j._db
    db.execute("CREATE TABLE IF NOT EXISTS filler (b BLOB)")
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count={pages + 2}")
    with pytest.raises(sqlite3.OperationalError, match="full"):
        for _ in range(100):
            db.execute("INSERT INTO filler VALUES (zeroblob(1000))")
    if run_id is None:
        return
    seq = 1_000_000
    for size in (1000, 200, 50, 10, 0):
        for _ in range(200):
            seq += 1
            try:
                db.execute("INSERT INTO events (run_id, seq, ts, kind, step, data) VALUES (?, ?, 0, 'f', NULL, ?)",
                           (run_id, seq, json.dumps({"f": "x" * size})))
            except sqlite3.OperationalError as e:
                assert "full" in str(e)
                break


def test_a_full_disk_is_a_clear_error_and_the_failed_write_leaves_nothing_half_done(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    j = Journal(path)
    run_id = j.create_run("gpu-node-recovery", {}, ["omen2"])
    before = len(j.events(run_id))
    fill(j)
    with pytest.raises(JournalError) as e:
        j.append(run_id, "action.intent", step="swap-off", summary="x" * 5000)
    one_line(e.value, path, "the disk is full")
    assert "record event action.intent of run" in str(e.value)
    assert len(j.events(run_id)) == before  # rolled back, not half-written
    j._db.execute("DROP TABLE filler")
    j._db.execute("PRAGMA max_page_count=1073741823")  # space again: the journal is usable (no stuck transaction)
    j.append(run_id, "action.intent", step="swap-off")
    assert [e.kind for e in j.events(run_id)][-1] == "action.intent"


def test_a_read_only_journal_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    j = Journal(path)
    j._db.execute("PRAGMA query_only=ON")  # what SQLite says for a file it cannot write
    with pytest.raises(JournalError) as e:
        j.create_run("gpu-node-recovery", {}, ["omen2"])
    one_line(e.value, path, "read-only")


@pytest.mark.parametrize("garbage", [b"\x00" * 10, b"not a database at all\n" * 200,
                                     b"SQLite format 3\x00" + b"\xff" * 4080], ids=["zeros", "text", "bad-header"])
def test_a_corrupt_journal_is_a_clear_error_at_open(tmp_path: Path, garbage: bytes) -> None:
    path = tmp_path / "journal.sqlite"
    path.write_bytes(garbage)
    with pytest.raises(JournalError) as e:
        Journal(path)
    one_line(e.value, path, "the file is corrupt or not a runbook journal")
    assert path.read_bytes() == garbage  # changed nothing


def test_a_journal_whose_folder_cannot_be_made_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(JournalError) as e:
        Journal(blocker / "journal.sqlite")
    assert str(e.value).startswith(f"{blocker / 'journal.sqlite'}: cannot create the journal's folder")


# -- a run: nothing acts once the journal cannot record ------------------------------------------------

def test_a_disk_full_mid_run_stops_it_before_the_next_action(world: World) -> None:  # noqa: F811
    """The disk fills while relabel-container's patch is applied: nothing after it is recorded, so
    no later intent is written and swap-off and restart-kubelet never act."""
    journal = world.service.journal
    plan = world.plan()
    run_id = world.service.create(world.prepared, plan)
    world.kube.on_patch = lambda name, patch: fill(journal, run_id)
    with pytest.raises(JournalError) as e:
        world.service.execute(run_id, world.prepared, plan)
    one_line(e.value, journal.path, "the disk is full")
    assert world.effects() == {"label": 1, "swap-off": 0, "restart": 0}
    kinds = [(ev.kind, ev.step) for ev in journal.events(run_id)]
    assert ("action.intent", "relabel-container") in kinds
    assert ("action.intent", "swap-off") not in kinds and ("action.intent", "restart-kubelet") not in kinds


def test_a_journal_locked_mid_run_stops_it_before_the_next_action(world: World, tmp_path: Path) -> None:  # noqa: F811
    journal = world.service.journal
    journal._db.execute(f"PRAGMA busy_timeout={500}")
    journal.lock_timeout = 0.5
    other = sqlite3.connect(journal.path, isolation_level=None, check_same_thread=False)
    original = world.nodes.effects["swap-off.yml"]

    def swap_off_then_someone_locks_the_journal(fn: FakeNodes, node: str, ev: Any) -> Any:
        other.execute("BEGIN IMMEDIATE")
        return original(fn, node, ev)

    world.nodes.effects["swap-off.yml"] = swap_off_then_someone_locks_the_journal
    plan = world.plan()
    run_id = world.service.create(world.prepared, plan)
    with pytest.raises(JournalError) as e:
        world.service.execute(run_id, world.prepared, plan)
    one_line(e.value, journal.path, "locked by another process")
    other.execute("ROLLBACK")
    other.close()
    assert world.effects()["restart"] == 0
    assert ("action.intent", "restart-kubelet") not in [(ev.kind, ev.step) for ev in journal.events(run_id)]


# -- through the CLI: one line, exit 6, no traceback ---------------------------------------------------

def cli(*args: str, journal: Path, wrap: list[str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RUNBOOK_JOURNAL": str(journal), "PYTHONPATH": str(REPO), "NO_COLOR": "1"}
    argv = [sys.executable, "-m", "engine", *args]
    if wrap:
        argv = [*wrap, " ".join(f"'{a}'" for a in argv)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def assert_clean_failure(done: subprocess.CompletedProcess[str], path: Path, cause: str) -> None:
    assert done.returncode == 6, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{path}: cannot ") and cause in lines[0], done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_the_cli_on_a_corrupt_journal_prints_one_line_and_exits_6(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    path.write_bytes(os.urandom(8192))
    assert_clean_failure(cli("runs", journal=path), path, "corrupt")
    debug = cli("runs", "--debug", journal=path)
    assert "Traceback" in debug.stderr  # the traceback is there for whoever asks


NEEDS_ROOT_MOUNTS = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                       reason="needs root and unshare for a private mount namespace")


@NEEDS_ROOT_MOUNTS
def test_the_cli_on_a_read_only_mount_prints_one_line_exits_6_and_approves_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    path = folder / "journal.sqlite"
    run_id, digest = waiting_run(path)
    done = cli("approve", run_id, "--plan-digest", digest, journal=path,
               wrap=["unshare", "-m", "--propagation", "private", "sh", "-c",
                     f"mount --bind -o ro {folder} {folder} && exec \"$0\" \"$@\" || exit 99", "sh", "-c"])
    assert_clean_failure(done, path, "read-only")
    assert Journal(path).get_run(run_id).approved_by is None


@NEEDS_ROOT_MOUNTS
def test_the_cli_on_a_full_disk_prints_one_line_exits_6_and_approves_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "small"
    folder.mkdir()
    seed = tmp_path / "seed.sqlite"
    run_id, digest = waiting_run(seed)
    script = (f"mount -t tmpfs -o size=256k tmpfs {folder} && cp {seed} {folder}/journal.sqlite && "
              f"(dd if=/dev/zero of={folder}/filler bs=4k 2>/dev/null; true) && exec \"$0\" \"$@\" || exit 99")
    done = cli("approve", run_id, "--plan-digest", digest, journal=folder / "journal.sqlite",
               wrap=["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", "-c"])
    assert_clean_failure(done, folder / "journal.sqlite", "the disk is full")
    assert not (folder / "filler").exists()  # the tmpfs lived only in the command's namespace


@pytest.mark.slow
def test_the_cli_waits_30s_for_a_locked_journal_then_prints_one_line_and_exits_6(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    run_id, digest = sealed_waiting_run(path)  # approve reads and verifies the run first (reads are not
    # blocked), then writes
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        start = time.monotonic()
        done = cli("approve", run_id, "--plan-digest", digest, journal=path)
        assert 29 <= time.monotonic() - start <= 45
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert_clean_failure(done, path, "locked by another process for more than 30s")
