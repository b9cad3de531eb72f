"""Upgrades in place (issue 46 item 4): the journal and the page store carry
a format version. A daemon of this tree resumes the sessions and pages that
a daemon of the tree before left (live, clients of the old client library
included, and from a state dir recorded from it), and a journal or page
store of a format it cannot read stops its start with one line, touching
nothing, so the newer daemon that wrote them can still resume from them."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import threading
import time

import pytest

from kvtest import HELPERS, PY, ROOT, assert_books, wait_until

# The tree before journal format 3 (format 2: no client processes, no orphan
# deadlines): the daemon and the Python client as they landed at stop 50.
PREVIOUS = "62f7cfd"
FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
# state dirs recorded from earlier trees (README in each), and their format
RECORDED = {"2d79f9a": 1, PREVIOUS: 2}


def previous_tree() -> pathlib.Path:
    """kvcached_service of PREVIOUS, extracted once into build/upgrade/<sha>/
    (its one compiled part built as setup.py builds it)."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{PREVIOUS}^{{commit}}"], cwd=ROOT, capture_output=True, text=True)
    assert sha.returncode == 0, (f"revision {PREVIOUS} is not in this clone ({sha.stderr.strip()}): the upgrade test runs the "
                                 "daemon of the tree before; clone with history (git fetch --unshallow)")
    tree = ROOT / "build" / "upgrade" / sha.stdout.strip()
    pkg = tree / "kvcached_service"
    if not (pkg / "server" / "_relay.abi3.so").exists():
        part = tree.with_name(tree.name + ".tmp")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        arch = subprocess.run(["git", "archive", sha.stdout.strip(), "kvcached_service"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(part)], input=arch.stdout, check=True)
        relay = part / "kvcached_service" / "server" / "relay.c"
        subprocess.run(["cc", "-O2", "-Wall", "-shared", "-fPIC", "-o", str(relay.parent / "_relay.abi3.so"), str(relay),
                        "-lpthread"], check=True)
        shutil.rmtree(tree, ignore_errors=True)
        part.rename(tree)  # whole, or not there: an interrupted extraction is redone
    return tree


def journal_snapshot(state: pathlib.Path) -> dict:
    return json.loads((state / "journal.jsonl").read_text().splitlines()[0])


def test_busy_clients_of_the_previous_tree_resume_on_a_daemon_of_this_tree(daemon_factory, tmp_path):
    """The previous tree's daemon (with its page store: the keeper it starts
    is the previous tree's too) and two busy clients of the previous tree's
    client library; the daemon is SIGKILLed mid-run and this tree's daemon
    starts on the same state dir and socket: both sessions resume, no page
    loses a byte, the books add up, and the journal is rewritten in this
    tree's format."""
    old = previous_tree()
    state = tmp_path / "state"
    d = daemon_factory("host", state_dir=str(state), memory_limit="512MiB", tree=old)
    assert journal_snapshot(state)["format"] == 2  # the tree before writes format 2
    env = dict(d.client_env(), PYTHONPATH=str(old))
    procs = [subprocess.Popen([PY, str(HELPERS / "resume_client.py"), "6"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        line = p.stdout.readline()
        assert line and json.loads(line)["ready"], p.stderr.read()
    time.sleep(1.5)
    d.sigkill()
    time.sleep(0.3)
    d2 = daemon_factory("host", socket=d.socket, state_dir=str(state), memory_limit="512MiB")
    results = []
    for p in procs:
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, err
        results.append(json.loads(out.splitlines()[-1]))
    assert all(r["bad"] == 0 for r in results), results  # no client lost a byte
    assert all(r["resumes"] == 1 for r in results), results  # both resumed on the new daemon
    assert all(r["held"] == r["mapped"] for r in results), results
    assert d2.log_text().count("resumed by pid") == 2, d2.log_text()
    assert journal_snapshot(state)["format"] == 3
    with d2.client() as c:
        assert wait_until(lambda: c.stats().sessions_open == 0)
        st = c.stats()
        assert st.total.pages_in_use == 0
        assert_books(st)


@pytest.mark.parametrize("tree", sorted(RECORDED))
def test_a_state_dir_recorded_from_the_previous_tree_is_read(daemon_factory, tmp_path, tree):
    """tests/fixtures/state-<tree> (README there): two sessions, five pages,
    left by an earlier tree (format 1 and 2). This tree's daemon takes them
    as orphans (their pages in use until resumed or forgotten: the journal
    names no client processes, so whether they live is not known),
    continues the ids after them, rewrites the journal in its own format
    with the same sessions and their grace's end, and forgets them after
    its resume grace, freeing the budget."""
    state = tmp_path / "state"
    shutil.copytree(FIXTURES / f"state-{tree}", state, ignore=shutil.ignore_patterns("*.md", "*.py"))
    assert journal_snapshot(state).get("format", 1) == RECORDED[tree]
    state.chmod(0o700)
    t0 = time.time()
    d = daemon_factory("host", state_dir=str(state), memory_limit="64MiB", page_store="none", resume_grace="2")
    snap = journal_snapshot(state)
    assert snap["format"] == 3
    assert all(t0 + 1 < s["orphan_until"] / 1000 < time.time() + 2 for s in snap["sessions"]), snap
    assert all("pid" not in s for s in snap["sessions"]), snap
    assert [(s["sid"], s["name"], sorted(s["pages"])) for s in snap["sessions"]] == [(1, "chat-8b", ["1", "2", "3"]),
                                                                                    (2, "embed", ["4", "5"])]
    assert snap["sessions"][0]["labels"] == {"model": "chat"} and snap["sessions"][0]["guaranteed_bytes"] == 4 << 20
    assert snap["next_session_id"] == 3 and snap["next_page_id"] == 6
    with d.client() as c:
        st = c.stats()
        assert st.total.pages_in_use == 5  # the orphans' pages: their clients may still map them
        assert_books(st)
        with c.open_session("after-upgrade") as s:
            assert s.id == 3  # ids continue after the recorded ones
            pages = s.allocate(2)
            assert min(p.id for p in pages) >= 6
            s.free(pages)
        assert wait_until(lambda: c.stats().total.pages_in_use == 0, timeout=10)  # forgotten after the grace
        assert_books(c.stats())
    assert "2 session(s) of the previous daemon (5 pages)" in d.log_text()


def test_a_journal_of_a_newer_format_stops_the_start_and_is_left_as_it_was(daemon_factory, tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    newer = (json.dumps({"op": "snapshot", "format": 4, "next_session_id": 7, "next_page_id": 40, "sessions": [],
                         "a_field_of_format_4": {"x": 1}}) + "\n"
             + json.dumps({"op": "a_record_of_format_4", "sid": 6}) + "\n").encode()
    (state / "journal.jsonl").write_bytes(newer)
    d = daemon_factory("host", state_dir=str(state), wait=False)
    assert d.proc.wait(30) == 1
    lines = [ln for ln in d.log_text().splitlines() if "cannot start" in ln]
    assert len(lines) == 1 and "is format 4, written by a newer kvcached; this daemon reads formats 1-3" in lines[0], d.log_text()
    assert (state / "journal.jsonl").read_bytes() == newer  # untouched, not moved aside
    assert sorted(os.listdir(state)) == ["journal.jsonl"]
    assert not os.path.exists(d.socket)


def _fake_keeper(path: str, fmt: int, stop: threading.Event) -> threading.Thread:
    """A keeper of a newer store format: answers TAKE with one page of format `fmt`."""
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lsock.bind(path)
    lsock.listen(1)
    lsock.settimeout(0.2)
    page = os.memfd_create("a-page-of-the-newer-store")

    def run():
        try:
            while not stop.is_set():
                try:
                    conn, _ = lsock.accept()
                except socket.timeout:
                    continue
                with conn:
                    msg = conn.recv(65536)
                    if json.loads(msg).get("op") == "take":
                        socket.send_fds(conn, [json.dumps({"op": "pages", "format": fmt, "ids": [9], "last": True}).encode()], [page])
                    conn.settimeout(5)
                    try:
                        conn.recv(65536)  # until the daemon hangs up
                    except OSError:
                        pass
        finally:
            lsock.close()
            os.close(page)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_page_store_of_a_newer_format_stops_the_start_and_takes_nothing(daemon_factory, tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    stop = threading.Event()
    t = _fake_keeper(str(state / "keeper.sock"), 2, stop)
    try:
        d = daemon_factory("host", state_dir=str(state), wait=False)
        assert d.proc.wait(30) == 1
    finally:
        stop.set()
        t.join(10)
    lines = [ln for ln in d.log_text().splitlines() if "cannot start" in ln]
    assert len(lines) == 1 and "page store (the keeper of" in lines[0] and "is format 2" in lines[0], d.log_text()
    assert not (state / "journal.jsonl").exists()  # nothing written before the store was read


def test_systemd_store_names_carry_the_format():
    from kvcached_service.server.recovery import keeper

    assert keeper.store_format_of(keeper.fdname(12345)) == 1
    assert keeper.store_format_of("~2.AbC") == 2 and keeper.store_format_of("stdin") is None
    a, b = os.memfd_create("p"), os.memfd_create("q")
    try:
        store = keeper.SystemdStore("/nonexistent/notify", None, [(keeper.fdname(7), a), ("~3.x7", b)])
        try:
            store.take_all()
        except keeper.StoreTooNew as exc:
            assert "systemd's fd store" in str(exc) and "is format 3" in str(exc)
        else:
            raise AssertionError("a store name of format 3 was taken")
        os.fstat(a), os.fstat(b)  # nothing closed: systemd keeps its copies, the daemon exits
        store.close()
    finally:
        os.close(a)
        os.close(b)
