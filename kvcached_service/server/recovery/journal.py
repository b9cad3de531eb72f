"""The daemon's journal: the least state it needs to check resume claims.

When the daemon dies, the pages its clients have mapped stay alive (the
clients' mappings and imported handles keep them). A restarted daemon reads
this journal to know which sessions existed, who owned them (uid), their
resume-token hashes, limits, and which pages each held with the page's
identity, so that it can adopt exactly the pages a returning client proves
it holds, and refuse claims that do not add up.

Format: `<state_dir>/journal.jsonl`, one JSON object per line, appended and
flushed (not fsynced: it must survive the daemon's death, not the host's).
Records: open, alloc, free, close, limits, resume, and a snapshot written at start-up
and on compaction (when the log grows past twice the live state). A journal
begins with its snapshot, which names the journal's format (`"format"`:
FORMAT; a snapshot without it is format 1, what daemons wrote before the
field existed, read the same). A journal of a format newer than this daemon
reads (READS) is not damage: `JournalTooNew` is raised before anything is
applied, and the daemon refuses to start, touching nothing (the newer daemon
that wrote it can still resume from it).
Compaction writes a new file and renames it over the old one, atomically.
Writing costs O(pages in the call), never O(pages tracked).

Reading is strict and bounded: every complete line must be UTF-8, JSON, an
object, a known record with every field present and of its type, ids and
sizes in their ranges (`MAX_ID`, `MAX_BYTES`, a uid below 2^32, a priority
that fits int32), no number longer than `MAX_DIGITS` digits, nesting no
deeper than a record has, no line longer than `MAX_LINE` bytes and no file
larger than `MAX_FILE`. Hostile contents (a line nested 5,000 deep, a
5,000-digit number, an id of 2^64) are damage like any other, never a
traceback. The one exception is
a torn last record (no newline at the end of the file: the daemon died
mid-write), which is applied if it happens to be complete and dropped
otherwise. Anything else raises JournalDamaged naming the file, the line
and the problem; the daemon then moves the file aside and starts without
resumes (resume.py, Recovery.recover; docs/reliability.md).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from ..host import procs

log = logging.getLogger("kvcached.journal")

NAME = "journal.jsonl"

# Bounds on what is read (hostile or damaged contents). Ids only grow, one per
# session or page: 2^62 is out of reach of any daemon (146,000 years at a
# million a second) and below every client's integer types (uint64, int64).
MAX_ID = 1 << 62
MAX_BYTES = (1 << 63) - 1  # guarantee / maximum of a session
MAX_UID = (1 << 32) - 1
PRIORITY = (-(1 << 31), (1 << 31) - 1)  # int32 on the wire
MAX_DIGITS = 20  # every integer a valid record holds fits in 20 digits
MAX_STRING = 64 << 10  # names, resume hashes, labels, identities
MAX_LINE = 256 << 20  # a snapshot: ~70 bytes a page, so ~3.8M pages
MAX_FILE = 1 << 30


# The journal format this daemon writes, and the ones it reads. 1: before the
# snapshot carried "format" (the same records). 2: "format" in the snapshot.
# 3: who the clients are and how long orphans wait, across restarts: the
# snapshot's "scope" (procs.scope()) and its sessions' optional "pid",
# "pstart" (the client process, procs.py) and "orphan_until" (the end of an
# orphan's resume grace, unix milliseconds, set by the first daemon that
# made it an orphan and never moved later by the next); "pid" and "ps" in
# "open"; the "resume" record (an orphan resumed: no grace end any more, and
# its client process).
FORMAT = 3
READS = (1, 2, 3)


class JournalTooNew(Exception):
    """A journal written in a format this daemon cannot read (by a newer one)."""

    def __init__(self, path: Path, fmt: object):
        self.path, self.format = path, fmt
        super().__init__(
            f"journal {path} is format {fmt!r:.40}, written by a newer kvcached; this daemon reads formats "
            f"{READS[0]}-{READS[-1]}. Nothing was changed: start the newer daemon again to resume its sessions, or move "
            f"the journal aside to start this one without them"
        )


class JournalDamaged(Exception):
    """A journal line that is not a valid record: names the file and line."""

    def __init__(self, path: Path, line: int, problem: str):
        self.path, self.line, self.problem = path, line, problem
        super().__init__(f"journal {path} line {line}: {problem}")


def _is_int(v, lo: int = 0, hi: int = MAX_ID) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _is_str(v) -> bool:
    return isinstance(v, str) and len(v) <= MAX_STRING


def _bounded_int(text: str) -> int:
    """json's parse_int: refuse a number no valid record holds before Python
    converts it (3.11 refuses 4,300+ digits with a ValueError of its own)."""
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"a number of {len(text)} digits (at most {MAX_DIGITS})")
    return int(text)


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


def _labels(v, where: str) -> dict:
    _check(isinstance(v, dict) and len(v) <= 256 and all(_is_str(k) and _is_str(x) for k, x in v.items()),
           f"{where} must be an object of at most 256 strings")
    return dict(v)


def _session_fields(rec: dict, keys: dict[str, str], where: str) -> None:
    for key, kind in keys.items():
        _check(key in rec, f"{where} lacks {key!r}")
        v = rec[key]
        if kind == "id":
            _check(_is_int(v, 1), f"{where}: {key!r} must be an integer from 1 to 2^62, not {v!r:.40}")
        elif kind == "uid":
            _check(_is_int(v, 0, MAX_UID), f"{where}: {key!r} must be a uid (0 to 2^32-1), not {v!r:.40}")
        elif kind == "bytes":
            _check(_is_int(v, 0, MAX_BYTES), f"{where}: {key!r} must be a byte count (0 to 2^63-1), not {v!r:.40}")
        elif kind == "priority":
            _check(_is_int(v, *PRIORITY), f"{where}: {key!r} must be an int32, not {v!r:.40}")
        elif kind == "str":
            _check(_is_str(v), f"{where}: {key!r} must be a string of at most 64 KiB, not {v!r:.40}")
        elif kind == "labels":
            _labels(v, f"{where}: {key!r}")


_OPEN = {"sid": "id", "uid": "uid", "name": "str", "rh": "str"}
_OPEN_OPTIONAL = {"g": "bytes", "m": "bytes", "p": "priority", "labels": "labels", "pid": "id", "ps": "bytes"}
_SNAP_SESSION = {"sid": "id", "uid": "uid", "name": "str", "resume_hash": "str", "guaranteed_bytes": "bytes",
                 "max_bytes": "bytes", "priority": "priority", "labels": "labels"}
# format 3: the client process (procs.py) and the end of an orphan's grace
_CLIENT = {"pid": "id", "pstart": "bytes", "orphan_until": "bytes"}
_RESUME_OPTIONAL = {"pid": "id", "ps": "bytes"}


def validate(rec) -> None:
    """Raise ValueError naming what is wrong with a decoded journal record."""
    _check(isinstance(rec, dict), f"a JSON {type(rec).__name__.replace('dict', 'object').replace('list', 'array')}, not an object")
    op = rec.get("op")
    _check(op is not None, "a record without 'op'")
    if op == "snapshot":
        fmt = rec.get("format", 1)
        _check(_is_int(fmt, 1, MAX_ID), f"snapshot: 'format' must be a positive integer, not {fmt!r:.40}")
        _session_fields(rec, {"next_session_id": "id", "next_page_id": "id"}, "snapshot")
        if "scope" in rec:
            _session_fields(rec, {"scope": "str"}, "snapshot")
        _check(isinstance(rec.get("sessions"), list), "snapshot: 'sessions' must be an array")
        for i, js in enumerate(rec["sessions"]):
            where = f"snapshot session #{i + 1}"
            _check(isinstance(js, dict), f"{where} is not an object")
            _session_fields(js, _SNAP_SESSION, where)
            _session_fields(js, {k: t for k, t in _CLIENT.items() if k in js}, where)
            extra = set(js) - set(_SNAP_SESSION) - set(_CLIENT) - {"pages"}
            _check(not extra, f"{where} has unknown fields {sorted(extra)}")
            pages = js.get("pages")
            _check(isinstance(pages, dict), f"{where}: 'pages' must be an object")
            for k, v in pages.items():
                _check(k.isascii() and k.isdigit() and len(k) <= MAX_DIGITS and _is_int(int(k), 1),
                       f"{where}: page id {k!r:.40} is not an integer from 1 to 2^62")
                _check(isinstance(v, list) and len(v) == 2 and all(_is_str(x) for x in v),
                       f"{where}: page {k} must be [device, identity]")
    elif op == "open":
        _session_fields(rec, _OPEN, "'open' record")
        _session_fields(rec, {k: t for k, t in _OPEN_OPTIONAL.items() if k in rec}, "'open' record")
    elif op == "alloc":
        _session_fields(rec, {"sid": "id", "dev": "str"}, "'alloc' record")
        pages = rec.get("pages")
        _check(isinstance(pages, list), "'alloc' record: 'pages' must be an array")
        for p in pages:
            _check(isinstance(p, list) and len(p) == 2 and _is_int(p[0], 1) and _is_str(p[1]),
                   f"'alloc' record: page {p!r:.60} must be [page id, identity]")
    elif op == "free":
        _session_fields(rec, {"sid": "id"}, "'free' record")
        pages = rec.get("pages")
        _check(isinstance(pages, list) and all(_is_int(p, 1) for p in pages), "'free' record: 'pages' must be an array of page ids")
    elif op == "close":
        _session_fields(rec, {"sid": "id"}, "'close' record")
    elif op == "limits":
        _session_fields(rec, {"sid": "id", "g": "bytes", "m": "bytes", "p": "priority"}, "'limits' record")
    elif op == "resume":
        _session_fields(rec, {"sid": "id"}, "'resume' record")
        _session_fields(rec, {k: t for k, t in _RESUME_OPTIONAL.items() if k in rec}, "'resume' record")
    else:
        raise ValueError(f"unknown record {op!r:.40}")


@dataclass
class JSession:
    sid: int
    uid: int
    name: str
    resume_hash: str
    guaranteed_bytes: int = 0
    max_bytes: int = 0
    priority: int = 0
    labels: dict = field(default_factory=dict)
    pages: dict = field(default_factory=dict)  # page id -> (device uuid, identity)
    pid: int = 0  # the client process (procs.py): 0 when not known
    pstart: int = 0
    orphan_until: int = 0  # unix ms: the end of its resume grace, once an orphan (0: not yet one)


def _snapshot_session(js: JSession) -> dict:
    out = {
        "sid": js.sid, "uid": js.uid, "name": js.name, "resume_hash": js.resume_hash,
        "guaranteed_bytes": js.guaranteed_bytes, "max_bytes": js.max_bytes, "priority": js.priority,
        "labels": js.labels, "pages": {str(k): list(v) for k, v in js.pages.items()},
    }
    if js.pid > 0:
        out["pid"], out["pstart"] = js.pid, js.pstart
    if js.orphan_until > 0:
        out["orphan_until"] = js.orphan_until
    return out


class Journal:
    def __init__(self, state_dir: str):
        self.dir = Path(state_dir)
        self.path = self.dir / NAME
        self.sessions: dict[int, JSession] = {}
        self.next_session_id = 1
        self.next_page_id = 1
        self.scope = ""  # where the read journal's pids mean something (procs.scope()); "" before format 3
        self._lines = 0
        self._fh = None

    # ---- reading --------------------------------------------------------
    def load(self) -> None:
        """Read what a previous daemon left. Raises JournalDamaged for any
        line that is not a valid record (what was read before it stays in
        `sessions`, `next_session_id`, `next_page_id`), OSError when the
        state directory or the file cannot be used at all."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return
        with f:
            self.read(f, os.fstat(f.fileno()).st_size)

    def read(self, f: BinaryIO, size: int) -> None:
        """Apply the records of an open journal file of `size` bytes (load)."""
        if size > MAX_FILE:
            raise JournalDamaged(self.path, 1, f"{size} bytes: larger than any journal a daemon writes ({MAX_FILE})")
        n = 0
        while True:
            raw = f.readline(MAX_LINE + 1)
            if not raw:
                return
            n += 1
            if len(raw) > MAX_LINE:
                raise JournalDamaged(self.path, n, f"a line longer than {MAX_LINE} bytes")
            if not raw.endswith(b"\n"):  # after the last newline: a record cut mid-write
                break
            if raw.strip():
                self._apply(self._parse(raw, n))
        if raw.strip():
            try:
                rec = self._parse(raw, n)
            except JournalDamaged as exc:
                log.warning("journal %s: ignoring a torn last record (line %d, the daemon died mid-write): %s",
                            self.path, n, exc.problem)
            else:
                self._apply(rec)

    def _check_format(self, rec) -> None:
        """A snapshot (the first record of every journal) of a format this
        daemon does not read: JournalTooNew, before it is validated (a newer
        format may have other fields) or anything of it applied."""
        if isinstance(rec, dict) and rec.get("op") == "snapshot":
            fmt = rec.get("format", 1)
            if _is_int(fmt, 1, MAX_ID) and fmt not in READS:
                raise JournalTooNew(self.path, fmt)

    def _parse(self, raw: bytes, n: int) -> dict:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JournalDamaged(self.path, n, f"not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})") from None
        try:
            rec = json.loads(text, parse_int=_bounded_int)
        except json.JSONDecodeError as exc:
            raise JournalDamaged(self.path, n, f"not JSON: {exc.msg} (column {exc.colno})") from None
        except RecursionError:
            raise JournalDamaged(self.path, n, "JSON nested deeper than any record") from None
        except ValueError as exc:  # _bounded_int
            raise JournalDamaged(self.path, n, str(exc)) from None
        self._check_format(rec)
        try:
            validate(rec)
        except ValueError as exc:
            raise JournalDamaged(self.path, n, str(exc)) from None
        return rec

    def move_aside(self) -> Path:
        """Rename a damaged journal out of the way (kept for a bug report)."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = self.path.with_name(f"{NAME}.damaged-{stamp}")
        n = 1
        while aside.exists():
            n += 1
            aside = self.path.with_name(f"{NAME}.damaged-{stamp}-{n}")
        os.replace(self.path, aside)
        return aside

    def forget(self) -> None:
        """Drop what a damaged journal said about sessions (ids stay: they
        only ever grow)."""
        self.sessions = {}

    def _apply(self, rec: dict) -> None:
        op = rec["op"]
        if op == "snapshot":
            self.sessions = {}
            self.next_session_id = rec["next_session_id"]
            self.next_page_id = rec["next_page_id"]
            self.scope = rec.get("scope", "")
            for js in rec["sessions"]:
                js = dict(js)
                pages = {int(k): tuple(v) for k, v in js.pop("pages").items()}
                self.sessions[js["sid"]] = JSession(**js, pages=pages)
        elif op == "open":
            self.sessions[rec["sid"]] = JSession(
                rec["sid"], rec["uid"], rec["name"], rec["rh"], rec.get("g", 0), rec.get("m", 0), rec.get("p", 0), rec.get("labels", {}),
                pid=rec.get("pid", 0), pstart=rec.get("ps", 0),
            )
            self.next_session_id = max(self.next_session_id, rec["sid"] + 1)
        elif op == "alloc":
            js = self.sessions.get(rec["sid"])
            for pid, ident in rec["pages"]:
                if js is not None:
                    js.pages[pid] = (rec["dev"], ident)
                self.next_page_id = max(self.next_page_id, pid + 1)
        elif op == "free":
            js = self.sessions.get(rec["sid"])
            if js is not None:
                for pid in rec["pages"]:
                    js.pages.pop(pid, None)
        elif op == "close":
            self.sessions.pop(rec["sid"], None)
        elif op == "limits":
            js = self.sessions.get(rec["sid"])
            if js is not None:
                js.guaranteed_bytes, js.max_bytes, js.priority = rec["g"], rec["m"], rec["p"]
        elif op == "resume":
            js = self.sessions.get(rec["sid"])
            if js is not None:
                js.pid, js.pstart, js.orphan_until = rec.get("pid", 0), rec.get("ps", 0), 0
        else:
            raise ValueError(f"journal: unknown record {op!r}")

    # ---- writing --------------------------------------------------------
    def start(self, sessions: dict[int, JSession], next_session_id: int, next_page_id: int) -> None:
        """Begin a new journal with a snapshot of the given live state."""
        self._write_snapshot(sessions, next_session_id, next_page_id)

    def _write_snapshot(self, sessions: dict[int, JSession], next_session_id: int, next_page_id: int) -> None:
        snap = {
            "op": "snapshot",
            "format": FORMAT,
            "next_session_id": next_session_id,
            "next_page_id": next_page_id,
            "scope": procs.scope(),
            "sessions": [_snapshot_session(js) for js in sessions.values()],
        }
        tmp = self.path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(snap, separators=(",", ":")) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError:
            try:
                tmp.unlink()  # a half-written snapshot must not take the space a retry needs
            except OSError:
                pass
            raise
        if self._fh is not None:
            self._fh.close()
        self._fh = open(self.path, "a", buffering=1)
        self._lines = 1
        self._live = sum(len(js.pages) for js in sessions.values()) + len(sessions)

    def append(self, rec: dict) -> None:
        self._fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self._lines += 1

    def wants_compaction(self, live_records: int) -> bool:
        return self._lines > 2 * max(live_records, 1024)

    def compact(self, sessions: dict[int, JSession], next_session_id: int, next_page_id: int) -> None:
        self._write_snapshot(sessions, next_session_id, next_page_id)

    def abandon(self) -> bool:
        """After a failed write: drop the open file and remove the journal,
        which no longer matches the books (a later daemon must not resume
        from it). Removing needs no space. Returns whether it is gone."""
        if self._fh is not None:
            try:
                self._fh.close()  # may fail again flushing what failed
            except OSError:
                pass
            self._fh = None
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError:
            return False
        return True

    def close(self, remove: bool = False) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if remove:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
